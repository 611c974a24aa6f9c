"""The bottom of every ``slime-ascend`` command: the argument parser whose usage error is one line, and the
one handler that turns a user mistake into one line with a ``Fix:``. It imports nothing of the package, so
every command module (``cli``, ``quant.cli``, ``memory.cli``, the engines' servers) can build on it."""

from __future__ import annotations

import argparse
import sys

__all__ = ["ArgumentParser", "TRACEBACK_ENV", "USER_ERRORS", "UserError", "fix_for", "one_line", "run_command"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line usage error (``error: ... Fix: ...``, exit status 2) instead of the usage
    block; every ``slime-ascend`` subcommand builds its parser with it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message.rstrip('.')}. Fix: see `{self.prog} --help`\n")


class UserError(Exception):
    """A mistake the user can fix (a plugin's ``PluginError`` is one); :func:`run_command` prints it in one line."""


# A user mistake: a bad value (``ValueError``, a ``SettingsError`` too), a path or port (``OSError``), a missing
# package (``ImportError``), or a :class:`UserError`; also a file safetensors, YAML or JSON cannot parse. An error
# that escapes the import of another package is not one of them: it is reported as that package's failure.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ValueError, OSError, ImportError)


TRACEBACK_ENV = "SLIME_ASCEND_TRACEBACK"  # =1: let unexpected errors raise (for a bug report)


def fix_for(exc: BaseException) -> str:
    """The ``Fix:`` for a user mistake that did not name its own."""
    import errno

    if isinstance(exc, ImportError):
        return "install the missing package (the README's install command installs what each command needs)"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return "choose another --port, or stop the process that holds this one"
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES) and "bind" in str(exc).lower():
        return "choose a --host this machine owns and a port above 1023"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "free space on the filesystem that holds it (or write to a path on another filesystem)"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return "choose a path on a writable filesystem"
    if isinstance(exc, OSError) and exc.errno in (errno.ENXIO, errno.ENODEV):
        return "pass a regular file (this path is a socket or a device)"
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "pass the file itself, not a symbolic link to it"
    if isinstance(exc, FileNotFoundError):
        return "check the path (a directory or file named on the command line does not exist)"
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return "pass a file where a file is expected and a directory where a directory is expected"
    if isinstance(exc, PermissionError):
        return "choose a path this user may read and write"
    if isinstance(exc, FileExistsError):
        return "choose another output path, or pass --force where the command offers it"
    if isinstance(exc, OSError) and exc.filename is not None:
        return "check the file named above and the filesystem that holds it"
    if _is_file_format_error(exc):
        return ("the file is truncated or not in the format the command reads (a safetensors, YAML or JSON file): "
                "write or download it again")
    return "correct the value named above (`slime-ascend <command> --help` lists each option)"


def _is_file_format_error(exc: BaseException) -> bool:
    """A file that safetensors, YAML or JSON could not parse (the command that read it should have named it; this
    is the funnel's fallback: still the user's file, never an internal error)."""
    import json

    module = type(exc).__module__ or ""
    return (isinstance(exc, json.JSONDecodeError) or type(exc).__name__ == "SafetensorError"
            or module == "yaml" or module.startswith("yaml."))


def one_line(exc: BaseException) -> str:
    """``exc`` on one line; an OSError with a path as ``'PATH': reason`` (the path is what the user can act on)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        names = " -> ".join(repr(str(n)) for n in (exc.filename, exc.filename2) if n is not None)
        return f"{names}: {exc.strerror}"
    return " ".join(str(exc).split()) or type(exc).__name__


def _failed_import(exc: BaseException) -> tuple[str, str] | None:
    """``(module, where)`` when ``exc`` escaped the import of a module that is not this package's (a module body
    in its traceback): a package installed here is broken or does not fit the others. Its error is then not a
    bad value of the user's, whatever its type. ``where``: the module whose code raised it."""
    outer, tb, where = None, exc.__traceback__, ""
    while tb is not None:
        frame = tb.tb_frame
        name = str(frame.f_globals.get("__name__", ""))
        if outer is None and frame.f_code.co_name == "<module>" and name != "__main__" \
                and name.split(".")[0] != __name__.split(".")[0]:
            outer = name
        where = name
        tb = tb.tb_next
    return None if outer is None else (outer, where)


def run_command(fn, *args) -> int:
    """The one handler of every subcommand: a user mistake is one line with a ``Fix:`` on stderr and exit
    status 2; Ctrl-C is 130; anything else (a bug) is one line that says how to get the traceback."""
    import os

    try:
        return int(fn(*args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI prints the reason, not a traceback
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        text = one_line(exc)
        broken = None if isinstance(exc, (UserError, ImportError)) else _failed_import(exc)
        if broken is not None:  # e.g. a ValueError of a leftover package's import: not the user's value
            module, where = broken
            print(f"error: importing {module} failed in {where} ({type(exc).__name__}: {text.rstrip('.')}). Fix: "
                  f"a package installed here is broken or does not fit the others; reinstall {module.split('.')[0]}"
                  + (f" or remove {where.split('.')[0]}" if where.split(".")[0] != module.split(".")[0] else "")
                  + " (the README's install command; `slime-ascend doctor` lists the versions)", file=sys.stderr)
            return 2
        if isinstance(exc, USER_ERRORS) or _is_file_format_error(exc):  # a user mistake (a SettingsError too)
            print(f"error: {text}" if "Fix:" in text else f"error: {text.rstrip('.')}. Fix: {fix_for(exc)}",
                  file=sys.stderr)
            return 2
        print(f"error: internal error ({type(exc).__name__}: {text}). Fix: none needed from you; rerun with "
              f"{TRACEBACK_ENV}=1 and report the traceback", file=sys.stderr)
        return 1
