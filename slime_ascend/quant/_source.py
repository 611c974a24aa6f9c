"""Which files of HF_DIR the offline converter reads, and how what it writes is published.

HF_DIR may be shared: someone who can write into it must not be able to make ``slime-ascend quantize``
read a file only the user can read and publish it in OUT_DIR. So every file the converter reads
(config.json, the *.safetensors shards, the files it copies: tokenizer, generation config, chat
template, ...) is checked before anything is opened:

* it must resolve (symlinks followed) inside HF_DIR, or, for a Hugging Face cache snapshot
  (``.../snapshots/REV``, whose files link to ``../../blobs/HASH``), inside that repository's ``blobs``;
  else it is refused, naming the file and the fix;
* it must be a regular file: a FIFO, device or socket is refused from its ``stat`` (opening a FIFO
  would block).

A copy is opened without following links and checked to be the file that was checked. Every
output file gets the mode a new file would get (0666 less the umask) masked by its source's mode,
never wider than the source: a copy is created so, `publish_mode` sets it on a file written by a
library (safetensors writes 0600 whatever the umask) from the narrowest of its sources' modes.
Directories in HF_DIR and other weight formats (``.bin``, ``.pt``, ...) are never read. No
torch import: the CLI checks HF_DIR before loading heavy modules.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import IO, NamedTuple

from ._outdir import creation_mode

INDEX_SUFFIX = ".safetensors.index.json"
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")  # never read nor copied
_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISSOCK, "socket"))


class SourceFile(NamedTuple):
    path: str  # resolved
    st: os.stat_result

    @property
    def mode(self) -> int:
        return stat.S_IMODE(self.st.st_mode)


def read_by_converter(name: str) -> bool:
    """Whether the converter reads (or copies) the HF_DIR entry ``name`` when it is a file."""
    return not name.endswith(INDEX_SUFFIX) and not name.endswith(OTHER_WEIGHT_SUFFIXES)


def _roots(src_real: str) -> tuple[str, ...]:
    parent = os.path.dirname(src_real)
    if os.path.basename(parent) == "snapshots":  # Hugging Face cache: snapshots/REV/NAME -> ../../blobs/HASH
        return src_real, os.path.join(os.path.dirname(parent), "blobs")
    return (src_real,)


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _kind(mode: int) -> str:
    return next((kind for test, kind in _KINDS if test(mode)), "special file")


def check_source(src: str, *, label: str = "HF_DIR") -> dict[str, SourceFile]:
    """The files of ``src`` the converter reads, checked (see the module docstring), by name.

    Raises ValueError with a one-line message naming the file and the fix."""
    src_real = os.path.realpath(src)
    roots = _roots(src_real)
    out: dict[str, SourceFile] = {}
    for name in sorted(os.listdir(src_real)):
        if not read_by_converter(name):
            continue
        path = os.path.join(src, name)
        real = os.path.realpath(path)
        try:
            st = os.stat(real)  # never open(): a FIFO would block
        except OSError as exc:
            raise ValueError(f"{label} file {path!r} cannot be read ({exc.strerror}: {real!r}). Fix: replace or "
                             f"remove it") from None
        if stat.S_ISDIR(st.st_mode):
            continue  # not read
        if not any(_within(real, root) for root in roots):
            raise ValueError(f"{label} file {path!r} is a link to {real!r}, outside {label} {src!r}; it would be "
                             f"copied into the output. Fix: replace the link with a copy of the file you mean to "
                             f"publish, or remove it")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{label} file {path!r} is a {_kind(st.st_mode)}, not a regular file; it is not "
                             f"opened. Fix: remove it from {label}, or replace it with a regular file")
        out[name] = SourceFile(real, st)
    return out


def open_checked(source: SourceFile) -> IO[bytes]:
    """``source`` opened for reading, without following a link and only if it is still the checked file."""
    fd = os.open(source.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (source.st.st_dev, source.st.st_ino) or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{source.path!r} changed while the checkpoint was being read. Fix: run again once "
                         f"nothing writes into the source directory")
    return os.fdopen(fd, "rb")


def copy_no_wider(source: SourceFile, dst: str) -> None:
    """Copy ``source`` to the new file ``dst``, whose mode is the source's masked by the default (and umask)."""
    with open_checked(source) as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666 & source.mode)
        with os.fdopen(fd, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)


def publish_mode(path: str, source_mode: int) -> None:
    """Give the output ``path``, written from sources of ``source_mode``, a new file's mode masked by it."""
    os.chmod(path, creation_mode() & 0o666 & source_mode)


__all__ = ["INDEX_SUFFIX", "SourceFile", "check_source", "copy_no_wider", "open_checked", "publish_mode",
           "read_by_converter"]
