"""Every subcommand answers a user mistake with one line (``error: ... Fix: ...``, exit status 2), never a
traceback; ``--help`` never imports torch; ``--version``."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from slime_ascend import __version__, cli


def _run(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_ascend.cli", *argv], capture_output=True, text=True,
                          cwd=str(cwd), timeout=300)


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


MISTAKES = [
    (("config", "nope", "-o", "-"), "unknown plugin 'nope'"),
    (("config", "dis", "-o", "{tmp}/exists.yaml"), "exists"),
    (("config", "", "-o", "{tmp}/empty.yaml"), "no plugin named"),
    (("config", " , ", "--flags"), "no plugin named"),
    (("serve-torch", "--model", "{tmp}/no-model", "--port", "0"), "no-model"),
    (("serve-torch", "--port", "{busy}"), "Address already in use"),
    (("serve-torch", "--port", "x"), "invalid int value"),
    (("quantize", "{tmp}/nowhere", "{tmp}/q", "--format", "int8-ct"), "not a directory"),
    (("quantize", "{tmp}", "{tmp}/q", "--format", "nope"), "not supported"),
    (("verify-quant", "{tmp}/nowhere", "{tmp}/nowhere"), "not a directory"),
    (("tito-fingerprint", "{tmp}/nowhere"), "not a directory"),
    (("demo", "--steps", "0"), "--steps"),
    (("demo", "--model", "llama"), "--model"),
    (("serve-torch", "--prefix-cache-tokens", "-1", "--port", "0"), "--prefix-cache-tokens"),
    (("demo", "--loop", "slime", "--slime-src", "{tmp}/nowhere"), "--slime-src"),
    (("demo", "--slime-src", "{tmp}", "--loop", "mini"), "drop --loop mini"),
    (("check", "--device", "nope"), "not a torch device"),
    (("check", "--seed", "x"), "invalid int value"),
    (("doctor", "--bogus"), "unrecognized arguments"),
    (("nope",), "invalid choice"),
]


@pytest.mark.parametrize("argv,needle", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_line_with_a_fix(argv, needle, tmp_path, busy_port):
    (tmp_path / "exists.yaml").write_text("x: 1\n")
    argv = [a.format(tmp=tmp_path, busy=busy_port) for a in argv]
    proc = _run(*argv, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix: " in lines[0], proc.stderr
    assert needle in lines[0], lines[0]


def test_an_unexpected_error_is_one_line_that_says_how_to_get_the_traceback(monkeypatch, capsys):
    def broken():
        raise TypeError("a bug")

    assert cli.run_command(broken) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (TypeError: a bug)" in err and cli.TRACEBACK_ENV in err
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(TypeError):
        cli.run_command(broken)


def test_version(tmp_path):
    proc = _run("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"slime-ascend {__version__}"


def test_help_of_every_subcommand_imports_no_torch(tmp_path):
    """--help answers before any heavy import (torch is imported only when work starts)."""
    commands = [[], ["plugins"], ["config"], ["doctor"], *([name] for name in cli.PASSTHROUGH)]
    code = (
        "import sys\nfrom slime_ascend import cli\nheavy = []\n"
        f"for argv in {commands!r}:\n"
        "    try:\n        cli.main(argv + ['--help'])\n    except SystemExit:\n        pass\n"
        "    heavy += [(argv, m) for m in ('torch', 'transformers', 'ray', 'slime') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
