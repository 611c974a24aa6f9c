"""Directories the torch engine writes into on a user's word (``serve-torch --dump-dsa-index-sets DIR``,
``--keep-received-weights DIR``), written so that nobody else can redirect a write.

* At start, :func:`check_dump_dir` creates the directory (each level it creates with mode 0700) and refuses, in
  one line naming the flag, a directory owned by another user (its owner can swap anything in it) or one that is
  world-writable without the sticky bit (anyone could rename the engine's files away or put links in their place).
* Every file is created by :func:`create_file` with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600: a name that
  already exists, a symlink planted under the name included, is never opened, so a link's target is never written.
  :func:`write_file` removes the file it created when the write fails (a full disk), and only that file.
* :func:`private_subdir` makes a per-version subdirectory with mode 0700 (a name that exists must be a real
  directory of this user, writable by nobody else), and :func:`replace_file` puts a file there by writing a new
  file and renaming it over the name (a rename replaces a planted link, never writes through it).

Stdlib only.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["check_dump_dir", "create_file", "private_subdir", "replace_file", "write_file"]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _mkdirs(path: Path) -> None:
    """``mkdir -p`` creating each missing level with mode 0700."""
    if path.is_dir():
        return
    if path.parent != path:
        _mkdirs(path.parent)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass


def _unsafe(st: os.stat_result, what: str) -> str | None:
    """Why a directory with status ``st`` must not receive the engine's files, or None."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {uid}), who could replace its files"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (f"{what} is world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}), so anyone "
                "could put links in place of its files")
    return None


def check_dump_dir(path: str | os.PathLike, flag: str) -> Path:
    """``path`` created if missing and checked (module docstring); ValueError naming ``flag`` and the fix."""
    directory = Path(path)
    try:
        _mkdirs(directory)
        st = os.stat(directory)
    except OSError as exc:
        raise ValueError(f"{flag} {str(directory)!r}: cannot create or read it ({exc.strerror}). Fix: name a "
                         "directory this user may create and write") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{flag} {str(directory)!r} is not a directory. Fix: name a directory")
    why = _unsafe(st, f"{flag} {str(directory)!r}")
    if why is not None:
        raise ValueError(f"{why}. Fix: name a directory of your own that only you can write (e.g. mkdir -m 700 "
                         "DIR)")
    return directory


def create_file(directory: Path, name: str) -> BinaryIO:
    """``directory/name``, created new (never an existing name, never through a link), mode 0600, for writing.
    FileExistsError when the name exists (a planted link included)."""
    fd = os.open(directory / name, _CREATE, 0o600)
    return os.fdopen(fd, "wb")


def write_file(directory: Path, name: str, write: Callable[[BinaryIO], object]) -> Path:
    """``write(f)`` into the new file ``directory/name`` (:func:`create_file`); on any failure the file it created
    is removed and the error raised."""
    path = directory / name
    with create_file(directory, name) as f:
        try:
            write(f)
            f.flush()
        except BaseException:
            try:
                os.unlink(path)  # ours: created above with O_EXCL
            except OSError:
                pass
            raise
    return path


def private_subdir(directory: Path, name: str) -> Path:
    """``directory/name`` created with mode 0700, or the existing one when it is a real directory (not a link) of
    this user that nobody else can write; ValueError otherwise."""
    path = directory / name
    try:
        os.mkdir(path, 0o700)
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{str(path)!r} exists and is not a directory (a link?); refusing to write into it. Fix: "
                         "remove it")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ValueError(f"{str(path)!r} is owned by uid {st.st_uid} or writable by others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); refusing to write into it. Fix: remove it")
    return path


def replace_file(directory: Path, name: str, write: Callable[[BinaryIO], object]) -> Path:
    """``write(f)`` into a new file of ``directory``, then renamed to ``name`` (an existing file or link of that
    name is replaced, never written through)."""
    temporary = write_file(directory, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp", write)
    try:
        os.replace(temporary, directory / name)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return directory / name
