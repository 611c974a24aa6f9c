"""An HTTP teacher engine (SGLang, or slime's ``megatron_server``) as a teacher loader, switched with
``POST /update_weights_from_disk {"model_path": dir}``, and the stage directory it copies checkpoints into
(it deletes only what it staged: :data:`STAGE_MARKER`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from slime_ascend.json_client import JSONRequestError, request_json
from slime_ascend.opd.loaders import Staged, TeacherLoader
from slime_ascend.opd.teachers import NAME_RE, TeacherSpec

__all__ = ["STAGE_MARKER", "SGLangEngineLoader"]


class SGLangEngineLoader(TeacherLoader):
    """Switch an HTTP teacher engine (SGLang, or slime's ``megatron_server``) between checkpoints.

    Staging copies the checkpoint into ``stage_dir/<teacher name>`` (local NVMe as a cache tier;
    reused when file names and sizes match) or, without ``stage_dir``, reads every file once to
    warm the page cache. Activation POSTs ``{"model_path": <dir>}`` to each engine URL's
    ``/update_weights_from_disk`` and checks ``success``. No host memory is held.

    Staging deletes only what it created: the target must resolve to a direct child of
    ``stage_dir``, and a directory is replaced, reused or deleted only when it holds the pool's
    :data:`STAGE_MARKER` (anything else there is reported, not touched). A staged copy is deleted once the pool
    no longer needs it: when its teacher stops being resident (:meth:`release`, the engine holds the next
    teacher's weights) and when a prefetch is discarded (:meth:`discard`), so the stage directory holds at most
    the resident teacher's copy and the one prefetched.
    """

    def __init__(
        self,
        engine_urls: str | Sequence[str],
        *,
        stage_dir: str | Path | None = None,
        warm_page_cache: bool = True,
        timeout_s: float = 1800.0,
        extra_payload: Mapping[str, Any] | None = None,
        post: Callable[[str, dict[str, Any], float], Mapping[str, Any]] | None = None,
    ) -> None:
        urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
        if not urls:
            raise ValueError("engine_urls is empty; give the teacher engine URL(s)")
        self.urls = [u.rstrip("/") for u in urls]
        self.stage_dir = Path(stage_dir) if stage_dir is not None else None
        self.warm_page_cache = warm_page_cache
        self.timeout_s = timeout_s
        self.extra_payload = dict(extra_payload or {})
        self._post = post or (lambda url, payload, timeout_s: request_json(url, payload, timeout_s=timeout_s))

    def stage(self, spec: TeacherSpec) -> Staged:
        src = spec.checkpoint_dir
        if not src.is_dir():
            raise FileNotFoundError(f"checkpoint directory does not exist: {src}")
        if self.stage_dir is None:
            read = 0
            if self.warm_page_cache:
                for f in sorted(p for p in src.iterdir() if p.is_file()):
                    with open(f, "rb") as fh:
                        while chunk := fh.read(16 << 20):
                            read += len(chunk)
            return Staged(spec.name, src, 0, read)
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        dst = self._stage_path(spec.name, spec.name)
        tmp = self._stage_path(spec.name, f".{spec.name}.staging")
        if _exists(dst):
            _require_ours(dst, spec.name)
            if _same_tree(src, dst):
                return Staged(spec.name, dst, 0)
        if _exists(tmp):
            _require_ours(tmp, spec.name)
            shutil.rmtree(tmp)
        tmp.mkdir()
        # the marker goes in first, so that a copy cut short is still known to be ours
        (tmp / STAGE_MARKER).write_text(json.dumps({"teacher": spec.name, "source": str(src)}) + "\n")
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        if _exists(dst):
            shutil.rmtree(dst)  # checked above: a directory this pool staged
        tmp.rename(dst)
        read = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
        return Staged(spec.name, dst, 0, read)

    def _stage_path(self, teacher: str, entry: str) -> Path:
        """``stage_dir/entry``, refused unless it resolves to a direct child of the stage directory."""
        assert self.stage_dir is not None
        if not NAME_RE.fullmatch(teacher):
            raise ValueError(
                f"teacher name {teacher!r} is not usable as a directory under the stage directory {self.stage_dir} "
                "(allowed: 1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit)"
            )
        path = self.stage_dir / entry
        root = self.stage_dir.resolve()
        if path.resolve().parent != root:
            raise ValueError(
                f"{path} resolves to {path.resolve()}, outside the stage directory {root}; refusing to write or "
                "delete there. Fix: remove that link, or set ascend_opd_stage_dir to a directory of its own"
            )
        return path

    def activate(self, spec: TeacherSpec, staged: Staged) -> int:
        payload = {"model_path": str(staged.payload), **self.extra_payload}
        for url in self.urls:
            try:
                resp = self._post(f"{url}/update_weights_from_disk", payload, self.timeout_s)
            except JSONRequestError as e:
                resp = {"message": str(e)}
            if not isinstance(resp, Mapping) or not resp.get("success", False):
                why = resp.get("message", resp) if isinstance(resp, Mapping) else f"unexpected reply {resp!r}"
                raise RuntimeError(f"{url}/update_weights_from_disk refused {payload['model_path']}: {why}")
        return 0

    def release(self, spec: TeacherSpec) -> None:
        """``spec`` is no longer resident (the engines loaded another teacher): its staged copy goes."""
        if self.stage_dir is not None:
            self._delete_staged(self.stage_dir / spec.name, spec.name)

    def discard(self, staged: Staged) -> None:
        """A prefetch that will not be activated: its staged copy goes."""
        if self.stage_dir is not None and isinstance(staged.payload, Path) and staged.payload.parent == self.stage_dir:
            self._delete_staged(staged.payload, staged.name)
        staged.payload = None

    def _delete_staged(self, path: Path, teacher: str) -> None:
        """Delete ``path`` when it is a copy this pool staged (marker, a real directory directly under the stage
        directory); anything else is left alone."""
        if not _exists(path):
            return
        try:
            path = self._stage_path(teacher, path.name)
            _require_ours(path, teacher)
        except (ValueError, FileExistsError):
            return  # not ours: never deleted (the staging of that teacher reports it)
        shutil.rmtree(path, ignore_errors=True)


#: Written by the pool into every directory it stages; only directories holding it are ever deleted.
STAGE_MARKER = ".slime-ascend-staged"


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _require_ours(path: Path, teacher: str) -> None:
    """Refuse to reuse or delete ``path`` unless it is a real directory this pool staged (marker file)."""
    if path.is_symlink() or not path.is_dir() or not (path / STAGE_MARKER).is_file():
        raise FileExistsError(
            f"teacher {teacher!r}: {path} exists but was not staged by slime-ascend's teacher pool (no "
            f"{STAGE_MARKER} in it), so it is neither reused nor deleted. Fix: move it out of the stage directory, "
            "or set ascend_opd_stage_dir to a directory of its own"
        )


def _same_tree(src: Path, dst: Path) -> bool:
    """Same files and sizes (the marker aside); ``dst`` is a staged directory (``_require_ours``)."""
    a = {p.relative_to(src): p.stat().st_size for p in src.rglob("*") if p.is_file()}
    b = {p.relative_to(dst): p.stat().st_size for p in dst.rglob("*") if p.is_file()}
    b.pop(Path(STAGE_MARKER), None)
    return a == b
