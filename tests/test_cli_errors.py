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


# ------------------------------------------------------------------ a user's bad file, a full disk
# Each case: the command line ({tmp} is the test's directory, laid out by _bad_files) and the file the one line
# must name. A bad file or a full disk is the user's to fix: exit status 2 (not the internal error's 1), one line
# with the file and a Fix, never a traceback or "internal error".
BAD_FILES = [
    (("quantize", "{tmp}/truncated", "{tmp}/q", "--format", "int8-ct"), "truncated/model.safetensors"),
    (("quantize", "{tmp}/empty", "{tmp}/q", "--format", "int8-ct"), "empty/model.safetensors"),
    (("quantize", "{tmp}/foreign", "{tmp}/q", "--format", "int8-ct"), "foreign/model.safetensors"),
    (("quantize", "{tmp}/badjson", "{tmp}/q", "--format", "int8-ct"), "badjson/config.json"),
    (("verify-quant", "{tmp}/truncated", "{tmp}/good"), "truncated/model.safetensors"),
    (("verify-quant", "{tmp}/good", "{tmp}/foreign/model.safetensors"), "foreign/model.safetensors"),
    (("memory", "--config", "{tmp}/nokey.json"), "nokey.json"),
    (("memory", "--config", "{tmp}/wrongtype.json"), "wrongtype.json"),
    (("memory", "--config", "{tmp}/dirconfig"), "dirconfig/config.json"),
    (("memory", "--config", "{tmp}/good", "--teachers", "1", "--teacher-config", "{tmp}/notjson.json"),
     "notjson.json"),
    (("check", "--verifiers", "{tmp}/bad.yaml"), "bad.yaml"),
    (("check", "--verifiers", "{tmp}/afile/job.yaml"), "afile/job.yaml"),
    (("check", "--model", "{tmp}/truncated"), "truncated/model.safetensors"),
    (("serve-torch", "--model", "{tmp}/truncated", "--port", "0"), "truncated/model.safetensors"),
    (("tito-fingerprint", "{tmp}/badtokenizer"), "badtokenizer/tokenizer_config.json"),
    (("dsa-index-sets", "{tmp}/records"), "train-rank0000-1-000000.pt"),
    (("demo", "--loop", "mini", "--out", "{tmp}/afile/demo"), "afile"),
    (("config", "dis", "-o", "{tmp}/full.yaml", "--force"), "full.yaml"),  # a link to /dev/full: a full disk
    (("check", "--json", "{tmp}/full.json"), "full.json"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """One directory with every bad file of :data:`BAD_FILES` (built once: the cases only read it)."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("bad_files")
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100, "head_dim": 32}
    good = tmp / "good"
    good.mkdir()
    (good / "config.json").write_text(json.dumps(config))
    save_file({"model.layers.0.mlp.down_proj.weight": torch.randn(64, 128).to(torch.bfloat16)},
              str(good / "model.safetensors"))
    shard = (good / "model.safetensors").read_bytes()
    for name, data in (("truncated", shard[:200]), ("empty", b""), ("foreign", b"not safetensors at all " * 8),
                       ("badjson", shard)):
        (tmp / name).mkdir()
        (tmp / name / "model.safetensors").write_bytes(data)
        (tmp / name / "config.json").write_text("{not json" if name == "badjson" else json.dumps(config))
    (tmp / "nokey.json").write_text("{}")
    (tmp / "wrongtype.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    (tmp / "dirconfig" / "config.json").mkdir(parents=True)
    (tmp / "notjson.json").write_text("{oops")
    (tmp / "bad.yaml").write_text("ascend_plugins: [compaction\n")
    (tmp / "afile").write_text("a file where a directory is expected\n")
    (tmp / "badtokenizer").mkdir()
    (tmp / "badtokenizer" / "tokenizer_config.json").write_text("{bad")
    (tmp / "records").mkdir()
    (tmp / "records" / "train-rank0000-1-000000.pt").write_bytes(b"PK\x03\x04 truncated")
    if os.path.exists("/dev/full"):  # links: a writer that replaces its file replaces the link, never /dev/full
        (tmp / "full.yaml").symlink_to("/dev/full")
        (tmp / "full.json").symlink_to("/dev/full")
    return tmp


@pytest.mark.parametrize("argv,name", BAD_FILES, ids=[" ".join(a) for a, _ in BAD_FILES])
def test_a_bad_file_or_a_full_disk_is_one_line_naming_the_file(argv, name, bad_files, capsys, monkeypatch):
    import os
    import stat

    if name.startswith("full.") and not stat.S_ISCHR(os.stat("/dev/full").st_mode):
        pytest.skip("no /dev/full character device here to stand for a full disk")
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    monkeypatch.chdir(bad_files)  # `check` writes its default JSON report into the working directory
    code = cli.main([a.format(tmp=bad_files) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("quantize ", "note: "))]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert name in lines[0] and "Fix: " in lines[0], lines[0]
    assert "internal error" not in err and "Traceback" not in err
    if name.startswith("full."):
        assert "No space left on device" in lines[0] and "free space" in lines[0].split("Fix:")[1]
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # the device itself was written through, not replaced


def test_a_truncated_shard_is_one_line_from_the_command_itself(bad_files):
    """The same in a process of its own, as a user runs it: exit status 2, nothing else on stderr."""
    proc = _run("quantize", str(bad_files / "truncated"), str(bad_files / "q2"), "--format", "int8-ct", cwd=bad_files)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "truncated/model.safetensors: not a readable safetensors file" in proc.stderr and "Fix:" in proc.stderr


def test_an_error_raised_while_another_package_imports_is_not_called_a_bad_value(tmp_path, monkeypatch, capsys):
    """A leftover package whose import raises ValueError (as `kernels` did inside transformers) is named as a
    package that fails to import, not as a value the user gave."""
    (tmp_path / "leftover").mkdir()
    (tmp_path / "leftover" / "__init__.py").write_text(
        "def check():\n    raise ValueError('Either a revision or a version must be specified')\ncheck()\n")
    (tmp_path / "host_pkg.py").write_text("import leftover\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)

    def command():
        import host_pkg  # noqa: F401

    assert cli.run_command(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "importing host_pkg failed in leftover (ValueError: Either a revision" in err
    assert "remove leftover" in err and "correct the value" not in err

    def own_value_error():  # a ValueError of the command itself stays the user's value
        raise ValueError("--steps -1 is not positive")

    assert cli.run_command(own_value_error) == 2
    assert "correct the value named above" in capsys.readouterr().err


@pytest.mark.parametrize("exc", ["yaml", "json", "safetensors"])
def test_a_file_format_error_no_command_named_is_still_the_users(exc, tmp_path, capsys, monkeypatch):
    """The funnel's fallback: a parser's error that reached it unnamed is a bad file, never an internal error."""
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)

    def command():
        if exc == "yaml":
            import yaml

            yaml.safe_load("a: [1\n")
        elif exc == "json":
            import json

            json.loads("{x")
        else:
            from safetensors.torch import load_file

            (tmp_path / "t.safetensors").write_bytes(b"")
            load_file(str(tmp_path / "t.safetensors"))

    assert cli.run_command(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err and "truncated or not in the format" in err


@pytest.mark.parametrize("command", ["quantize", "demo"])
def test_a_full_disk_met_deep_inside_a_command_names_where_it_was_writing(command, bad_files, tmp_path, capsys,
                                                                          monkeypatch):
    """Where the writer does not name its file (safetensors reports ENOSPC as its own error, transformers' config
    writer as a bare OSError), the command names it: the shard being written, or the demo's --out."""
    import errno

    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    if command == "quantize":
        from safetensors import SafetensorError

        from slime_ascend.quant import checkpoint

        def full(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(checkpoint, "save_file", full)
        argv, name = ["quantize", str(bad_files / "good"), str(tmp_path / "q"), "--format", "int8-ct"], ".tmp"
    else:
        from slime_ascend.demo import loop

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(loop, "_run", full)
        argv, name = ["demo", "--loop", "mini", "--out", str(tmp_path / "demo-out")], str(tmp_path / "demo-out")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "No space left on device" in lines[0] and name in lines[0], err
    assert "Fix: free space" in lines[0] and "internal error" not in err
    assert command != "quantize" or not (tmp_path / "q").exists()  # OUT_DIR left as it was: never created
