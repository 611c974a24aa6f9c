"""Where the offline converter may write, and how it replaces an output directory safely.

`check_out_dir` refuses an output directory that is, lies inside, or contains the source
checkpoint (after resolving symlinks), and one that `--force` may not replace: only an empty
directory or one that holds a checkpoint (config.json + *.safetensors) is ever replaced.

`staged_dir` gives a private temporary directory beside the output (`.NAME.tmp-XXXXXXXX`, mode
0700, same filesystem). Only when the body finishes is it renamed into place; the previous
output is moved aside first and deleted only after the new one is in. On any error or Ctrl-C
the temporary directory is removed and the previous output is left as it was, so nothing
partial ever sits under the output's name. Two runs into one output cannot both succeed: each holds
an exclusive lock (``flock`` on ``.NAME.lock`` beside it, released by the kernel if the process dies) from
its start to its rename, a second run is refused at once naming the first's pid, and a run without
``--force`` refuses at its rename an output that appeared while it worked. No torch import: the CLI
checks paths before loading heavy modules.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
LOCK_MARK = ".lock"


def _inside(path: str, root: str) -> bool:
    """`path` is strictly below `root` (both absolute, resolved)."""
    return path != root and os.path.commonpath([path, root]) == root


def looks_like_checkpoint(path: str) -> bool:
    """A directory holding config.json and at least one *.safetensors file (HF or ours)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def check_out_dir(src: str, dst: str, overwrite: bool, *, label: str = "OUT_DIR", src_label: str = "HF_DIR",
                  force_flag: str = "--force") -> str:
    """Validate the output directory for a conversion of `src`; return its resolved path.

    Raises ValueError with a one-line message naming the path and the fix."""
    src_real, dst_real = os.path.realpath(src), os.path.realpath(dst)
    if dst_real == src_real:
        raise ValueError(f"{label} {dst!r} is {src_label} {src!r} (after resolving symlinks); "
                         f"{label} must differ from {src_label}: pick a new directory")
    if _inside(dst_real, src_real):
        raise ValueError(f"{label} {dst!r} is inside {src_label} {src!r} (after resolving symlinks); "
                         f"pick a directory outside the source checkpoint")
    if _inside(src_real, dst_real):
        raise ValueError(f"{label} {dst!r} contains {src_label} {src!r} (after resolving symlinks); "
                         f"replacing it would delete the source: pick a directory outside it")
    if os.path.lexists(dst_real) and not os.path.isdir(dst_real):
        raise ValueError(f"{label} {dst!r} exists and is not a directory; pick a directory path")
    if os.path.isdir(dst_real) and os.listdir(dst_real):
        if not overwrite:
            raise ValueError(f"{label} {dst!r} exists and is not empty; pass {force_flag} to replace a previous "
                             f"checkpoint there, or pick another directory")
        if not looks_like_checkpoint(dst_real):
            raise ValueError(f"{label} {dst!r} is not empty and holds no checkpoint (config.json + *.safetensors); "
                             f"{force_flag} only replaces a checkpoint directory: pick another {label} "
                             f"or empty it yourself")
    return dst_real


def creation_mode() -> int:
    """The mode mkdir gives a new directory (0777 less the umask); files get it less 0111."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def _swap_in(tmp: str, final: str) -> None:
    if not os.path.lexists(final):
        os.rename(tmp, final)
        return
    parent, name = os.path.split(final)
    aside = os.path.join(parent, f".{name}{OLD_MARK}{secrets.token_hex(4)}")
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    try:
        shutil.rmtree(aside)
    except OSError as exc:  # the new output is in place; say where the old one was left
        warnings.warn(f"new checkpoint is at {final!r}, but the previous one could not be removed from "
                      f"{aside!r} ({exc}); delete it yourself", RuntimeWarning, stacklevel=3)


@contextmanager
def output_lock(final: str, label: str = "OUT_DIR") -> Iterator[None]:
    """Hold the exclusive lock of output directory `final` (resolved path) for the body; ValueError at once
    when another run holds it. The lock file is ours: created here and removed when the body ends."""
    parent, name = os.path.split(final)
    path = os.path.join(parent, f".{name}{LOCK_MARK}")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ValueError(f"{label} {final!r} is being written by another run (pid {holder}); wait for it to "
                             f"finish or pick another directory") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:  # the run before us removed it between our open and our lock
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


@contextmanager
def staged_dir(final: str, overwrite: bool = True, *, label: str = "OUT_DIR",
               force_flag: str = "--force") -> Iterator[str]:
    """Yield a private temporary directory beside `final`; move it to `final` if the body succeeds.

    `final` must already have passed `check_out_dir` (resolved path). The output's lock is held throughout;
    without `overwrite`, an output that another run put in place meanwhile is refused, not replaced. On any
    exception (including KeyboardInterrupt) only the temporary directory is removed."""
    final = os.path.abspath(final)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    with output_lock(final, label):
        tmp = tempfile.mkdtemp(prefix=f".{name}{TMP_MARK}", dir=parent)  # mode 0700
        try:
            yield tmp
            if not overwrite and os.path.isdir(final) and os.listdir(final):
                raise ValueError(f"{label} {final!r} was filled by another run while this one worked; pass "
                                 f"{force_flag} to replace it, or pick another directory")
            os.chmod(tmp, creation_mode())
            _swap_in(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


__all__ = ["check_out_dir", "creation_mode", "looks_like_checkpoint", "output_lock", "staged_dir"]
