"""Is the installed transformers one the engine, the demo and slime's converters can use?

``pip install -e ".[demo]"`` takes transformers in the range ``pyproject.toml`` gives (:data:`SUPPORTED`). Two
environments still break first contact, each inside transformers with a message that names neither package:

- a transformers outside the range, installed before (the newest one fails in the engine's RoPE init);
- transformers 5.12 beside the ``kernels`` package a newer transformers pulled in and left behind on a downgrade:
  transformers' hub-kernels integration then fails at import with ``Either a revision or a version must be
  specified``, which reads like a bad command-line value.

:func:`problem` names either in one line with its fix; the demo and ``serve-torch`` call :func:`check` before they
start, ``slime-ascend doctor`` reports it.
"""

from __future__ import annotations

from importlib import import_module, metadata

__all__ = ["SUPPORTED", "check", "problem"]

SUPPORTED = ">=5.12.1,<5.13"  # as pyproject.toml's extras (tests/compat/test_transformers_stack.py keeps them equal)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def problem(import_check: bool = True) -> str | None:
    """One line naming what is wrong with the installed transformers and how to fix it, or None."""
    version = _version("transformers")
    if version is None:
        return f"transformers is not installed. Fix: pip install 'transformers{SUPPORTED}' (or pip install -e \".[demo]\")"
    from packaging.specifiers import SpecifierSet  # a dependency of transformers

    if version not in SpecifierSet(SUPPORTED, prereleases=True):
        return (f"transformers {version} is installed; slime-ascend is checked with transformers{SUPPORTED} "
                f"(slime's pin). Fix: pip install 'transformers{SUPPORTED}'")
    kernels = _version("kernels")
    if not import_check:
        return None
    try:
        import_module("transformers.integrations.hub_kernels")  # imports `kernels` where it is installed
    except Exception as exc:  # noqa: BLE001 - whatever it raises, the line says which package and what to do
        if kernels is not None:
            return (f"transformers {version} cannot be imported beside kernels {kernels} (left behind by a newer "
                    f"transformers: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                    "Fix: pip uninstall -y kernels")
        return (f"transformers {version} does not import ({type(exc).__name__}: {exc}). "
                f"Fix: pip install --force-reinstall 'transformers{SUPPORTED}'")
    return None


def check() -> None:
    """Raise :class:`~slime_ascend.command.UserError` with :func:`problem`'s line where there is one."""
    line = problem()
    if line is not None:
        from ..command import UserError

        raise UserError(line)
