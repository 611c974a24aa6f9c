"""The weight-version directories a job wrote under ``--update-weight-disk-dir``: the only ones it deletes.

slime's writer puts each version in ``DISK_DIR/weight_vNNNNNN``; the acknowledged switch keeps the last
acknowledged one as its roll-back point and deletes the one before. What is deleted must be what this job
wrote, however the flags nest (the checkpoint inside the disk dir, the disk dir inside the checkpoint, the
two equal, either a symlink): :meth:`VersionDirs.claim` marks a freshly written version directory with a
file naming this job's token, and :meth:`VersionDirs.delete` removes a directory only when

* it was claimed by this object, and resolves to the same real path now as then;
* its own path is no symlink, and it is a direct child of the (resolved) disk dir;
* it is not, and does not contain, a path the job was started on (``--hf-checkpoint``, ``--load``,
  ``--ref-load``, ``--save``, resolved);
* the marker is still there, a plain file holding this job's token and that version.

Anything else is kept, with a warning naming it. No slime or Ray import.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterable

logger = logging.getLogger(__name__)

MARKER = ".slime_ascend_weight_version.json"
PROTECTED_FLAGS = ("hf_checkpoint", "load", "ref_load", "save")


def _within(path: str, root: str) -> bool:
    """``path`` is ``root`` or below it (both absolute, resolved)."""
    return os.path.commonpath([path, root]) == root


class VersionDirs:
    """Version directories written by this job under ``disk_dir``, never ``protected`` paths."""

    def __init__(self, disk_dir: str, protected: Iterable[str | None]) -> None:
        self.disk_dir = os.path.realpath(disk_dir)
        self.protected = tuple(os.path.realpath(p) for p in protected if p)
        self.token = secrets.token_hex(16)
        self._claimed: dict[str, str] = {}  # path as given -> its real path when claimed

    @classmethod
    def for_args(cls, args) -> "VersionDirs":
        return cls(args.update_weight_disk_dir, (getattr(args, flag, None) for flag in PROTECTED_FLAGS))

    def _refusal(self, path: str) -> str | None:
        """Why ``path`` may not be claimed or deleted (None: it may)."""
        real = os.path.realpath(path)
        if os.path.islink(path):
            return "it is a symlink"
        if os.path.dirname(real) != self.disk_dir:
            return f"it is not directly inside --update-weight-disk-dir {self.disk_dir!r}"
        for held in self.protected:
            if _within(held, real):
                return f"it is or contains {held!r}, a path the job was started with"
        try:
            mode = os.lstat(real).st_mode
        except OSError as exc:
            return f"it cannot be read ({exc.strerror})"
        return None if stat.S_ISDIR(mode) else "it is not a directory"

    def _marker_text(self, version: str) -> str:
        return json.dumps({"version": str(version), "job": self.token})

    def claim(self, path: str | os.PathLike[str], version: str) -> bool:
        """Mark ``path`` (just written for ``version``) as this job's; False (and a warning) when it may not be
        deleted later."""
        path = os.fspath(path)
        why = self._refusal(path)
        if why is None:
            try:  # a marker already there means the directory was not freshly written: not ours
                fd = os.open(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                why = f"its marker could not be written ({exc.strerror})"
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(self._marker_text(version))
                self._claimed[path] = os.path.realpath(path)
                return True
        logger.warning("weight version directory %s is kept when it is no longer the roll-back point: %s", path, why)
        return False

    def delete(self, path: str | os.PathLike[str], version: str) -> bool:
        """Remove ``path`` if it is a version directory this job claimed for ``version`` (see the module
        docstring); True when removed."""
        path = os.fspath(path)
        if path not in self._claimed:
            return False  # the checkpoint the engines started on, or a directory this job never claimed
        why = self._refusal(path)
        if why is None and os.path.realpath(path) != self._claimed[path]:
            why = "it resolves elsewhere than when it was written"
        if why is None:
            try:
                fd = os.open(os.path.join(path, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                with os.fdopen(fd) as f:
                    marker_ok = stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read(4096) == self._marker_text(
                        version)
            except OSError:
                marker_ok = False
            why = None if marker_ok else "its marker is gone or is not this job's"
        if why is not None:
            logger.warning("weight version directory %s is not deleted: %s", path, why)
            return False
        del self._claimed[path]
        shutil.rmtree(path, ignore_errors=True)
        return True


__all__ = ["MARKER", "VersionDirs"]
