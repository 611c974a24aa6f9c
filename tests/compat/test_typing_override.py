"""slime_ascend.compat.typing_override: typing.override on Python 3.11, never replacing one."""

import json
import typing

from conftest import run_python
from slime_ascend.compat import typing_override


def test_present_name_is_kept(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(typing, "override", sentinel, raising=False)
    assert typing_override.ensure() is False
    assert typing.override is sentinel


def test_missing_name_is_added_from_typing_extensions():
    proc = run_python(
        "import json, typing, typing_extensions\n"
        "if hasattr(typing, 'override'):\n"
        "    del typing.override\n"
        "from slime_ascend.compat import typing_override\n"
        "first = typing_override.ensure()\n"
        "second = typing_override.ensure()\n"
        "class A:\n"
        "    @typing.override\n"
        "    def f(self): return 1\n"
        "print(json.dumps([first, second, typing.override is typing_extensions.override,"
        " A().f(), getattr(A.f, '__override__', None)]))"
    )
    assert proc.returncode == 0, proc.stderr
    first, second, same, value, marker = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first is True and second is False and same is True
    assert value == 1 and marker is True


def test_fallback_without_typing_extensions():
    proc = run_python(
        "import json, sys, typing\n"
        "if hasattr(typing, 'override'):\n"
        "    del typing.override\n"
        "sys.modules['typing_extensions'] = None\n"  # import typing_extensions now raises ImportError
        "from slime_ascend.compat import typing_override\n"
        "added = typing_override.ensure()\n"
        "def f(): return 2\n"
        "g = typing.override(f)\n"
        "print(json.dumps([added, g is f, f(), f.__override__]))"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True, 2, True]
