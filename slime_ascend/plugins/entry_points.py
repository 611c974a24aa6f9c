"""A registry of named objects found through an entry-point group (the plugins).

Entry points are loaded once, on first use. One that fails to load, has the wrong type, or is
named differently from its entry point is reported by :meth:`EntryPointRegistry.broken` and
refused by name; it does not take the others down. Objects can also be registered directly
(tests, code that ships no entry point).
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class EntryPointRegistry(Generic[T]):
    def __init__(self, group: str, kind: type, what: str):
        self.group = group
        self.kind = kind
        self.what = what  # "plugin": used in messages
        self._lock = threading.Lock()
        self._cache: dict[str, T] | None = None
        self._broken: dict[str, str] = {}
        self._extra: dict[str, T] = {}

    def register(self, obj: T) -> None:
        with self._lock:
            self._extra[obj.name] = obj

    def unregister(self, name: str) -> None:
        with self._lock:
            self._extra.pop(name, None)

    def available(self) -> dict[str, T]:
        """Every known object by name: installed entry points plus registered ones."""
        with self._lock:
            if self._cache is None:
                found: dict[str, T] = {}
                for ep in entry_points(group=self.group):
                    try:
                        obj = ep.load()
                    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported by broken(), not fatal
                        # (SystemExit: a plugin module that runs argparse or sys.exit at import)
                        self._broken[ep.name] = f"entry point {ep.value} failed to load: {type(exc).__name__}: {exc}"
                        continue
                    if not isinstance(obj, self.kind):
                        self._broken[ep.name] = f"entry point {ep.value} is not a {self.kind.__name__}"
                    elif obj.name != ep.name:
                        self._broken[ep.name] = f"entry point {ep.value} loads a {self.what} named {obj.name!r}"
                    elif obj.name in found:
                        self._broken[ep.name] = f"two installed distributions provide this {self.what}"
                        found.pop(obj.name)
                    else:
                        found[obj.name] = obj
                self._cache = found
            return {**self._cache, **self._extra}

    def broken(self) -> dict[str, str]:
        """Installed entries that could not be loaded, with the reason."""
        self.available()
        return dict(self._broken)

    def why_broken(self, name: str) -> str | None:
        self.available()
        return self._broken.get(name)

    def reset(self) -> None:
        """Forget loaded entry points (tests)."""
        with self._lock:
            self._cache = None
            self._broken.clear()
