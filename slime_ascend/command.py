"""The bottom of every ``slime-ascend`` command: the argument parser whose usage error is one line, and the
one handler that turns a user mistake into one line with a ``Fix:``. It imports nothing of the package, so
every command module (``cli``, ``quant.cli``, ``memory.cli``, the engines' servers) can build on it."""

from __future__ import annotations

import argparse
import sys

__all__ = ["ArgumentParser", "TRACEBACK_ENV", "USER_ERRORS", "UserError", "run_command"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line usage error (``error: ... Fix: ...``, exit status 2) instead of the usage
    block; every ``slime-ascend`` subcommand builds its parser with it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message.rstrip('.')}. Fix: see `{self.prog} --help`\n")


class UserError(Exception):
    """A mistake the user can fix (a plugin's ``PluginError`` is one); :func:`run_command` prints it in one line."""


# A user mistake: a bad value (``ValueError``, a ``SettingsError`` too), a path or port (``OSError``), a missing
# package (``ImportError``), or a :class:`UserError`.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ValueError, OSError, ImportError)


TRACEBACK_ENV = "SLIME_ASCEND_TRACEBACK"  # =1: let unexpected errors raise (for a bug report)


def _fix_for(exc: BaseException) -> str:
    """The ``Fix:`` for a user mistake that did not name its own."""
    import errno

    if isinstance(exc, ImportError):
        return "install the missing package (the README's install command installs what each command needs)"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return "choose another --port, or stop the process that holds this one"
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES) and "bind" in str(exc).lower():
        return "choose a --host this machine owns and a port above 1023"
    if isinstance(exc, FileNotFoundError):
        return "check the path (a directory or file named on the command line does not exist)"
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return "pass a file where a file is expected and a directory where a directory is expected"
    if isinstance(exc, PermissionError):
        return "choose a path this user may read and write"
    if isinstance(exc, FileExistsError):
        return "choose another output path, or pass --force where the command offers it"
    return "correct the value named above (`slime-ascend <command> --help` lists each option)"


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
        text = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, USER_ERRORS):  # a user mistake (a SettingsError too)
            print(f"error: {text}" if "Fix:" in text else f"error: {text.rstrip('.')}. Fix: {_fix_for(exc)}",
                  file=sys.stderr)
            return 2
        print(f"error: internal error ({type(exc).__name__}: {text}). Fix: none needed from you; rerun with "
              f"{TRACEBACK_ENV}=1 and report the traceback", file=sys.stderr)
        return 1
