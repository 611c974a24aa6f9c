"""TeacherPool: one resident teacher, the next one prefetched in the background.

MOPD/GLM-5.3-style dynamic teacher switching. Only the *active* teacher is resident on the
device; the others stay on local disk as safetensors. While the active teacher scores, the next
teacher of the schedule is staged by a background thread (read into pinned host memory when an
accelerator is present, plain host memory on CPU; or, for an external engine, copied to a local
stage directory / read once to warm the page cache). A switch then costs only the hand-over
(host->device copy, an in-memory ``assign`` on CPU, or one ``/update_weights_from_disk`` call).

Memory bound: at most one resident + one prefetched teacher; a new prefetch for a different
teacher discards the old one, and a cold load drops any prefetched teacher first.

Loaders (:class:`TeacherLoader`) adapt the pool to the thing that holds the weights:

* :class:`TorchModuleLoader`: an in-process ``torch.nn.Module`` (``load_state_dict``).
* :class:`WeightDictLoader`: megatron-mode "weight backup" swap, in-place ``copy_`` into a dict
  of live tensors.
* :class:`SGLangEngineLoader`: an HTTP SGLang (or slime ``megatron_server``) teacher engine,
  switched with ``POST /update_weights_from_disk {"model_path": dir}``.

Faults: a missing/corrupt checkpoint marks only that teacher ``failed`` (name and path in the
error); the others stay usable. Vocabulary/tokenizer mismatches with the student are refused at
construction. A failed stage is retried once, then reported.

Checkpoints are read with ``safetensors`` only (never pickle).
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from slime_ascend.json_client import JSONRequestError, request_json
from slime_ascend.opd.teachers import NAME_RE, TeacherSpec, check_teacher_compatible, parse_teachers

__all__ = [
    "accelerator_available",
    "TeacherLoadError",
    "TeacherUnavailableError",
    "Staged",
    "SwitchInfo",
    "TeacherLoader",
    "TorchModuleLoader",
    "WeightDictLoader",
    "SGLangEngineLoader",
    "TeacherPool",
    "TeacherPoolService",
    "make_teacher_pool_actor",
    "safetensors_files",
    "validate_safetensors_dir",
    "read_safetensors_dir",
]


def accelerator_available() -> bool:
    """True when torch sees an accelerator (CUDA, or a registered backend such as NPU)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        try:
            return bool(acc.is_available())
        except Exception:  # pragma: no cover - defensive, backend probing can raise
            pass
    return torch.cuda.is_available()


class TeacherLoadError(RuntimeError):
    """Staging or activating a teacher failed; names the teacher and its checkpoint path."""

    def __init__(self, name: str, path: Path | str, reason: str, attempts: int = 1) -> None:
        super().__init__(f"teacher {name!r} ({path}): {reason} (after {attempts} attempt(s))")
        self.name, self.path, self.reason, self.attempts = name, str(path), reason, attempts


class TeacherUnavailableError(TeacherLoadError):
    """The teacher was marked failed earlier; the pool refuses it."""


# --------------------------------------------------------------------------------------------
# safetensors helpers
# --------------------------------------------------------------------------------------------
def safetensors_files(ckpt_dir: Path | str) -> list[Path]:
    """Sorted ``*.safetensors`` files of a checkpoint directory."""
    return sorted(Path(ckpt_dir).glob("*.safetensors"))


def validate_safetensors_dir(ckpt_dir: Path | str) -> int:
    """Cheap integrity check (directory, files, headers, sizes); returns total tensor bytes.

    Raises ``FileNotFoundError`` / ``ValueError`` describing the first problem.
    """
    from safetensors import safe_open

    d = Path(ckpt_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint directory does not exist: {d}")
    files = safetensors_files(d)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    total = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    total += math.prod(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 4)
        except Exception as e:  # SafetensorError is not exported as a stable type
            raise ValueError(f"corrupt safetensors file {f}: {e}") from e
    return total


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read_safetensors_dir(
    ckpt_dir: Path | str,
    *,
    pin_memory: bool = False,
    key_map: Callable[[str], str | None] | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Read every tensor of a checkpoint directory into fresh host memory.

    The data is copied out of safetensors' memory map into newly allocated (pinned when
    ``pin_memory``) tensors, so the returned dict is fully resident and independent of the file.
    ``key_map`` renames keys (return None to skip one). Returns ``(state, total_bytes)``.
    """
    from safetensors import safe_open

    files = safetensors_files(ckpt_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {ckpt_dir}")
    state: dict[str, torch.Tensor] = {}
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in sf.keys():
                name = key_map(k) if key_map is not None else k
                if name is None:
                    continue
                if name in state:
                    raise ValueError(f"duplicate tensor {name!r} in {f}")
                src = sf.get_tensor(k)  # lazily mmapped; force the read with an explicit copy
                dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin_memory)
                dst.copy_(src)
                del src
                state[name] = dst
                total += dst.numel() * dst.element_size()
    return state, total


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------
@dataclass
class Staged:
    """A teacher staged for activation: loader-specific ``payload`` plus its host-memory size."""

    name: str
    payload: Any
    host_bytes: int = 0


class TeacherLoader(ABC):
    """Adapter between the pool and whatever holds the teacher weights.

    ``stage`` runs on the pool's background thread (no device work other than pinned host
    allocation); ``activate`` runs on the caller's thread and makes the staged teacher resident,
    returning the host bytes it keeps resident afterwards (e.g. CPU tensors handed to a CPU model).
    """

    def validate(self, spec: TeacherSpec) -> None:
        """Cheap start-up check of the teacher's checkpoint; raise to mark it failed."""
        validate_safetensors_dir(spec.checkpoint_dir)

    @abstractmethod
    def stage(self, spec: TeacherSpec) -> Staged: ...

    @abstractmethod
    def activate(self, spec: TeacherSpec, staged: Staged) -> int: ...

    def release(self, spec: TeacherSpec) -> None:
        """Called after ``spec`` stopped being resident (default: nothing to do)."""

    def take_garbage(self) -> Any:
        """Memory left over by the last ``activate`` (old weights, used staging buffers), or None.

        The pool frees it on its background thread, before the next prefetch, so that
        deallocating hundreds of MiB (or unpinning host memory) stays out of the switch stall.
        """
        garbage, self._garbage = getattr(self, "_garbage", None), None
        return garbage

    def discard(self, staged: Staged) -> None:
        """Drop a staged teacher that will not be activated (default: let GC free it)."""
        staged.payload = None


def _placement(first: torch.Tensor | None, pin_memory: bool | None) -> tuple[torch.device, bool]:
    """The live weights' device (CPU when there are none) and whether staged tensors are pinned."""
    device = first.device if first is not None else torch.device("cpu")
    if pin_memory is None:
        return device, device.type != "cpu" and accelerator_available()
    return device, bool(pin_memory) and accelerator_available()


def _synchronize(device: torch.device) -> None:
    if device.type == "cpu":
        return
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


class TorchModuleLoader(TeacherLoader):
    """Drive an in-process ``nn.Module`` whose weights are replaced per teacher.

    Args:
        model: the teacher module (same architecture for all teachers).
        mode: ``"assign"`` (``load_state_dict(assign=True)``: the staged tensors become the
            parameters, zero-copy on CPU), ``"copy"`` (``copy_`` into the existing parameters,
            the host->device path), or ``"auto"`` (assign on CPU, copy otherwise).
        pin_memory: pin staged tensors; default: only when the model is on an accelerator.
        key_map: optional checkpoint-key -> state-dict-key renaming (None drops a key).
        strict: passed to ``load_state_dict``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: str = "auto",
        pin_memory: bool | None = None,
        key_map: Callable[[str], str | None] | None = None,
        strict: bool = True,
    ) -> None:
        if mode not in ("auto", "assign", "copy"):
            raise ValueError(f"mode must be 'auto', 'assign' or 'copy', got {mode!r}")
        self.model = model
        self.device, self.pin = _placement(next(iter(model.parameters()), None), pin_memory)
        self.mode = ("assign" if self.device.type == "cpu" else "copy") if mode == "auto" else mode
        self.key_map = key_map
        self.strict = strict

    def stage(self, spec: TeacherSpec) -> Staged:
        state, nbytes = read_safetensors_dir(spec.checkpoint_dir, pin_memory=self.pin, key_map=self.key_map)
        return Staged(spec.name, state, nbytes)

    def activate(self, spec: TeacherSpec, staged: Staged) -> int:
        state, on_cpu = staged.payload, self.device.type == "cpu"
        if self.mode == "assign":
            old = list(self.model.state_dict().values())  # freed later, off the stall path
            if not on_cpu:
                state = {k: v.to(self.device, non_blocking=self.pin) for k, v in state.items()}
            self.model.load_state_dict(state, strict=self.strict, assign=True)
            self._garbage = [old, None if on_cpu else staged.payload]
        else:
            with torch.no_grad():
                self.model.load_state_dict(state, strict=self.strict)
            self._garbage = staged.payload
        _synchronize(self.device)
        staged.payload = None
        return staged.host_bytes if self.mode == "assign" and on_cpu else 0  # assigned CPU tensors stay resident


class WeightDictLoader(TeacherLoader):
    """Megatron-mode "weight backup" swap: copy a staged host dict into live tensors in place.

    ``targets`` maps names to the live (device) tensors, e.g. ``dict(model.named_parameters())``
    over all model chunks, or a callable returning such a mapping. Each teacher checkpoint must
    provide every target name with the same shape (``key_map`` renames checkpoint keys).
    """

    def __init__(
        self,
        targets: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
        *,
        pin_memory: bool | None = None,
        key_map: Callable[[str], str | None] | None = None,
    ) -> None:
        self._targets = targets
        self.device, self.pin = _placement(next(iter(self.targets().values()), None), pin_memory)
        self.key_map = key_map

    def targets(self) -> Mapping[str, torch.Tensor]:
        return self._targets() if callable(self._targets) else self._targets

    def stage(self, spec: TeacherSpec) -> Staged:
        state, nbytes = read_safetensors_dir(spec.checkpoint_dir, pin_memory=self.pin, key_map=self.key_map)
        live = self.targets()
        missing = [k for k in live if k not in state]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[0]!r}")
        for k, t in live.items():
            if tuple(state[k].shape) != tuple(t.shape):
                raise ValueError(f"weight {k!r}: checkpoint shape {tuple(state[k].shape)} != live {tuple(t.shape)}")
        return Staged(spec.name, state, nbytes)

    def activate(self, spec: TeacherSpec, staged: Staged) -> int:
        state = staged.payload
        with torch.no_grad():
            for k, t in self.targets().items():
                t.copy_(state[k], non_blocking=self.pin)
        _synchronize(self.device)
        self._garbage = state
        staged.payload = None
        return 0


class SGLangEngineLoader(TeacherLoader):
    """Switch an HTTP teacher engine (SGLang, or slime's ``megatron_server``) between checkpoints.

    Staging copies the checkpoint into ``stage_dir/<teacher name>`` (local NVMe as a cache tier;
    reused when file names and sizes match) or, without ``stage_dir``, reads every file once to
    warm the page cache. Activation POSTs ``{"model_path": <dir>}`` to each engine URL's
    ``/update_weights_from_disk`` and checks ``success``. No host memory is held.

    Staging deletes only what it created: the target must resolve to a direct child of
    ``stage_dir``, and a directory is replaced or reused only when it holds the pool's
    :data:`STAGE_MARKER` (anything else there is reported, not touched).
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
            if self.warm_page_cache:
                for f in sorted(p for p in src.iterdir() if p.is_file()):
                    with open(f, "rb") as fh:
                        while fh.read(16 << 20):
                            pass
            return Staged(spec.name, src, 0)
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
        return Staged(spec.name, dst, 0)

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


# --------------------------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------------------------
@dataclass
class SwitchInfo:
    """Outcome of :meth:`TeacherPool.activate`."""

    teacher: str
    previous: str | None
    switched: bool
    prefetch: str  # "hit" (staged in time), "late" (waited for the prefetch), "miss" (cold load), "none"
    stall_s: float


@dataclass
class _Slot:
    name: str
    future: Future


class TeacherPool:
    """One resident teacher plus at most one prefetched teacher.

    Args:
        teachers: teacher specs (or raw dicts, parsed with :func:`parse_teachers`).
        loader: the :class:`TeacherLoader` that owns the weights.
        student_vocab_size / student_tokenizer_revision / student_dir: when given, each teacher is
            checked with :func:`check_teacher_compatible` and a mismatch raises at construction.
        compat_check: that check's mode (strict | warn | off) for teachers without their own.
        validate: run ``loader.validate`` per teacher at start (failures mark that teacher failed).
        stage_attempts: attempts per stage (default 2 = retried once).
    """

    def __init__(
        self,
        teachers: Sequence[TeacherSpec | Mapping[str, Any]],
        loader: TeacherLoader,
        *,
        student_vocab_size: int | None = None,
        student_tokenizer_revision: str | None = None,
        student_dir: str | Path | None = None,
        compat_check: str = "strict",
        validate: bool = True,
        stage_attempts: int = 2,
    ) -> None:
        specs = parse_teachers(list(teachers))
        for spec in specs:  # mismatches are configuration errors: refuse the whole pool
            check_teacher_compatible(
                spec,
                student_vocab_size=student_vocab_size,
                student_tokenizer_revision=student_tokenizer_revision,
                student_dir=student_dir,
                mode=compat_check,
            )
        if stage_attempts < 1:
            raise ValueError(f"stage_attempts must be >= 1, got {stage_attempts}")
        self.specs: dict[str, TeacherSpec] = {s.name: s for s in specs}
        self.loader = loader
        self.stage_attempts = stage_attempts
        self._lock = threading.RLock()  # state transitions; may be held while waiting on a prefetch
        self._count_lock = threading.Lock()  # counters and byte totals; never held while waiting
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-prefetch")
        self._active: str | None = None
        self._slot: _Slot | None = None
        self._schedule: list[str] = []
        self._errors: dict[str, str] = {}
        self._resident_host_bytes = 0
        self._staged_host_bytes = 0
        self._closed = False
        self.counters: dict[str, float] = {
            "switches": 0,
            "stall_s": 0.0,
            "last_stall_s": 0.0,
            "cold_loads": 0,
            "prefetch_hits": 0,
            "prefetch_late": 0,
            "prefetch_misses": 0,
            "prefetch_started": 0,
            "prefetch_discarded": 0,
            "stage_retries": 0,
            "stage_failures": 0,
            "peak_host_bytes": 0,
        }
        if validate:
            for spec in specs:
                try:
                    loader.validate(spec)
                except Exception as e:
                    self._errors[spec.name] = f"invalid checkpoint at {spec.checkpoint_dir}: {e}"

    # ---------------------------------------------------------------- introspection
    @property
    def active(self) -> str | None:
        return self._active

    @property
    def prefetched(self) -> str | None:
        slot = self._slot
        return slot.name if slot is not None else None

    def state(self) -> dict[str, dict[str, Any]]:
        """Per teacher: ``status`` (resident/prefetched/prefetching/on_disk/failed) and ``error``."""
        with self._lock:
            out: dict[str, dict[str, Any]] = {}
            for name, spec in self.specs.items():
                if name in self._errors:
                    status = "failed"
                elif name == self._active:
                    status = "resident"
                elif self._slot is not None and self._slot.name == name:
                    status = "prefetched" if self._slot.future.done() else "prefetching"
                else:
                    status = "on_disk"
                out[name] = {"status": status, "path": str(spec.checkpoint_dir), "error": self._errors.get(name)}
            return out

    def metrics(self) -> dict[str, float]:
        """Counters: switches, stall seconds, prefetch hits/late/misses, retries, peak host bytes."""
        with self._count_lock:
            m = dict(self.counters)
            m["host_bytes"] = self._resident_host_bytes + self._staged_host_bytes
            m["failed_teachers"] = len(self._errors)
            return m

    # ---------------------------------------------------------------- scheduling / prefetch
    def set_schedule(self, names: Sequence[str]) -> None:
        """Declare the upcoming teacher order; prefetches the first one that is not active."""
        for n in names:
            self._spec(n)
        with self._lock:
            self._schedule = list(names)
            self._prefetch_next()

    def prefetch(self, name: str) -> bool:
        """Start staging ``name`` in the background. False if active, failed or already staged.

        A prefetch for another teacher still in the slot is discarded (bound: one prefetched).
        """
        spec = self._spec(name)
        with self._lock:
            if self._closed or name == self._active or name in self._errors:
                return False
            if self._slot is not None:
                if self._slot.name == name:
                    return False
                self._discard_slot()
            fut = self._executor.submit(self._stage_bg, spec)
            self._slot = _Slot(name, fut)
            self._count("prefetch_started")
            return True

    def _prefetch_next(self) -> None:
        for n in self._schedule:
            if n != self._active and n not in self._errors:
                self.prefetch(n)
                return

    def _stage_bg(self, spec: TeacherSpec) -> Staged:
        staged = self._stage_with_retry(spec)
        self._host_bytes(staged.host_bytes)
        return staged

    def _stage_with_retry(self, spec: TeacherSpec) -> Staged:
        last: BaseException | None = None
        for attempt in range(1, self.stage_attempts + 1):
            try:
                return self.loader.stage(spec)
            except Exception as e:  # retried, then reported with name and path
                last = e
                if attempt < self.stage_attempts:
                    self._count("stage_retries")
        self._count("stage_failures")
        raise TeacherLoadError(spec.name, spec.checkpoint_dir, f"staging failed: {last}", self.stage_attempts) from last

    def _discard_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is None:
            return
        self._count("prefetch_discarded")
        try:
            staged = slot.future.result()
        except Exception:
            return
        self._host_bytes(-staged.host_bytes)
        self.loader.discard(staged)

    def _count(self, key: str, delta: float = 1) -> None:
        with self._count_lock:
            self.counters[key] += delta

    def _host_bytes(self, staged_delta: int = 0, resident: int | None = None) -> None:
        """Add ``staged_delta`` to the staged bytes or set the resident bytes, keeping the peak of their sum."""
        with self._count_lock:
            self._staged_host_bytes += staged_delta
            if resident is not None:
                self._resident_host_bytes = resident
            now = self._resident_host_bytes + self._staged_host_bytes
            self.counters["peak_host_bytes"] = max(self.counters["peak_host_bytes"], now)

    def _spec(self, name: str) -> TeacherSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"unknown teacher {name!r}; configured: {sorted(self.specs)}") from None

    # ---------------------------------------------------------------- switching
    def activate(self, name: str) -> SwitchInfo:
        """Make ``name`` the resident teacher; then prefetch the next teacher of the schedule.

        Raises :class:`TeacherUnavailableError` for a teacher marked failed, and
        :class:`TeacherLoadError` when staging (after the retry) or activation fails; in both
        cases the teacher is marked failed and the pool stays usable for the others.
        """
        spec = self._spec(name)
        with self._lock:
            if self._closed:
                raise RuntimeError("TeacherPool is closed")
            if name in self._errors:
                raise TeacherUnavailableError(name, spec.checkpoint_dir, self._errors[name])
            prev = self._active
            if name == prev:
                self._advance_schedule(name)
                return SwitchInfo(name, prev, False, "none", 0.0)
            t0 = time.perf_counter()
            try:
                if self._slot is not None and self._slot.name == name:
                    slot, self._slot = self._slot, None
                    kind = "hit" if slot.future.done() else "late"
                    staged = slot.future.result()
                else:
                    kind = "miss"
                    self._discard_slot()  # keep the bound: resident + the one being loaded
                    staged = self._stage_with_retry(spec)
                    self._count("cold_loads")
                    self._host_bytes(staged.host_bytes)
            except TeacherLoadError as e:
                self._errors[name] = e.reason
                self._count("prefetch_misses")
                raise
            # the staged bytes move to "resident" (or are freed) by the activation below
            self._host_bytes(-staged.host_bytes)
            try:
                resident_bytes = self.loader.activate(spec, staged)
            except Exception as e:
                self._errors[name] = f"activation failed: {e}"
                self._active = None  # the previous teacher's weights may be partly overwritten
                self._host_bytes(resident=0)
                raise TeacherLoadError(name, spec.checkpoint_dir, f"activation failed: {e}") from e
            finally:
                if prev is not None:
                    self.loader.release(self.specs[prev])
            garbage = self.loader.take_garbage()
            if garbage is not None:
                self._executor.submit(_drop, garbage)  # runs before the next prefetch (one worker)
                del garbage
            self._active = name
            self._host_bytes(resident=resident_bytes)
            stall = time.perf_counter() - t0
            with self._count_lock:
                c = self.counters
                c["switches"] += 1
                c["stall_s"] += stall
                c["last_stall_s"] = stall
                c[{"hit": "prefetch_hits", "late": "prefetch_late", "miss": "prefetch_misses"}[kind]] += 1
            self._advance_schedule(name)
            return SwitchInfo(name, prev, True, kind, stall)

    def _advance_schedule(self, name: str) -> None:
        if name in self._schedule:
            del self._schedule[: self._schedule.index(name) + 1]
        self._prefetch_next()

    def close(self) -> None:
        """Stop the background thread and drop any prefetched teacher."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._discard_slot()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> TeacherPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _drop(garbage: Any) -> None:
    if isinstance(garbage, (list, dict)):
        garbage.clear()


# --------------------------------------------------------------------------------------------
# Ray actor front end
# --------------------------------------------------------------------------------------------
class TeacherPoolService:
    """A :class:`TeacherPool` built from serialisable arguments, with plain-data results.

    ``loader_factory`` is called inside the owning process (e.g. a Ray actor) to build the
    loader, so unpicklable things (models, sessions) never cross process boundaries.
    """

    def __init__(
        self,
        teachers: Sequence[Mapping[str, Any]],
        loader_factory: Callable[[], TeacherLoader],
        **pool_kwargs: Any,
    ) -> None:
        self.pool = TeacherPool(teachers, loader_factory(), **pool_kwargs)

    def activate(self, name: str) -> dict[str, Any]:
        return asdict(self.pool.activate(name))

    def prefetch(self, name: str) -> bool:
        return self.pool.prefetch(name)

    def set_schedule(self, names: Sequence[str]) -> None:
        self.pool.set_schedule(names)

    def active(self) -> str | None:
        return self.pool.active

    def state(self) -> dict[str, dict[str, Any]]:
        return self.pool.state()

    def metrics(self) -> dict[str, float]:
        return self.pool.metrics()

    def close(self) -> None:
        self.pool.close()


def make_teacher_pool_actor(**ray_options: Any) -> Any:
    """``ray.remote(**ray_options)(TeacherPoolService)``, an actor class rollout workers can share.

    Ray is imported lazily; raises ImportError with a hint when it is not installed. Ray actors run
    one call at a time by default, so ``activate`` calls from several workers are serialised.
    """
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("make_teacher_pool_actor needs ray; install ray or use TeacherPool directly") from e
    return ray.remote(**ray_options)(TeacherPoolService) if ray_options else ray.remote(TeacherPoolService)
