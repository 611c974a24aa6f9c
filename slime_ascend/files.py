"""Reading the small files a user names (configs, tokenizer files, weight shards) without being stalled or
misled by them: a file is opened only if it is a regular file (``O_NONBLOCK``, then ``fstat`` on the open fd,
so a FIFO or device neither blocks the open nor is read), read in chunks that release the GIL, bounded in size,
and a JSON config that is malformed, too big or nested too deeply is a ``ValueError`` naming the file. A file a
user named is written so that a failure (a full disk) names it.
Imports nothing of the package."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["MAX_JSON_BYTES", "check_regular_file", "json_object", "open_regular", "read_json_object",
           "read_regular_file", "regular_files", "write_file"]

MAX_JSON_BYTES = 16 * 1024 * 1024  # config.json and friends; real ones are a few KiB
_READ_CHUNK = 8 * 1024 * 1024


def _read_chunk(fd: int, size: int) -> bytes:
    """One ``os.read`` (releases the GIL while the kernel reads)."""
    return os.read(fd, size)


def _refuse_irregular(path: str | Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("FIFO" if stat.S_ISFIFO(mode) else "directory" if stat.S_ISDIR(mode) else
                "socket" if stat.S_ISSOCK(mode) else "device")
        raise ValueError(f"{str(path)!r} is a {kind}, not a regular file; refusing to read it")


def _open_regular(path: str | Path) -> int:
    """An fd open for reading on ``path``, refused with ValueError unless it is a regular file.

    Opened with ``O_NONBLOCK`` so a FIFO does not block the open, then checked with ``fstat`` on the
    fd itself (no window between the check and the open).
    """
    _refuse_irregular(path, os.stat(path).st_mode)  # a socket cannot even be opened (ENXIO): named first
    fd = os.open(str(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse_irregular(path, os.fstat(fd).st_mode)  # what was opened, whatever the name points to by now
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular_file(path: str | Path) -> None:
    """Raise ValueError unless ``path`` is a regular file (symlinks to one are fine); never blocks."""
    os.close(_open_regular(path))


def open_regular(path: str | Path) -> BinaryIO:
    """A binary file object reading regular file ``path`` (ValueError for a FIFO, device, socket or directory: the
    open never blocks, and the check is on the open fd itself), for readers that take a file (``torch.load``)."""
    return os.fdopen(_open_regular(path), "rb")


def read_regular_file(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of regular file ``path`` (ValueError for anything else, or for more than ``max_bytes``)."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"{str(path)!r} is {size} bytes; more than the {max_bytes} bytes allowed for it")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = _read_chunk(fd, _READ_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:  # grew while being read
                raise ValueError(f"{str(path)!r} is more than the {max_bytes} bytes allowed for it")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON-object file; ValueError naming the file for anything else (bad JSON, too deep, too big)."""
    return json_object(read_regular_file(path, MAX_JSON_BYTES), path)


def json_object(raw: bytes | str, path: str | Path) -> dict[str, Any]:
    """The JSON object ``raw`` (the bytes of file ``path``); ValueError naming ``path`` for anything else."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{str(path)!r} is nested too deeply to be a config file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def write_file(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to the file ``path`` a user named (created or truncated); an OSError (a full disk, a read-only
    filesystem) names ``path``, so the command's one line says which file could not be written."""
    try:
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None


def regular_files(directory: str | Path, pattern: str) -> list[Path]:
    """The sorted entries of ``directory`` matching ``pattern``, each checked to be a regular file (``ValueError``
    naming the first that is not: a FIFO would block its reader, a device would be read without end)."""
    files = sorted(Path(directory).glob(pattern))
    for f in files:
        check_regular_file(f)  # never blocks: opened O_NONBLOCK, checked with fstat
    return files
