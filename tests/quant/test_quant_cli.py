"""`slime-ascend quantize` and `slime-ascend verify-quant`: conversion, refusals, exit codes."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weight_sync"))
from _ws_helpers import hf_tensors, write_hf  # noqa: E402

from slime_ascend.quant.checkpoint import CheckpointReader, quant_spec_of, tensors_bit_equal  # noqa: E402
from slime_ascend.quant.cli import main_quantize, main_verify  # noqa: E402
from slime_ascend.quant.params import quantize_named_params  # noqa: E402
from slime_ascend.quant.names import FORMATS  # noqa: E402

SRC = hf_tensors(3)


def quant_format(d) -> str:
    return quant_spec_of(d).fmt


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("cli") / "hf", SRC)


@pytest.mark.parametrize("fmt", FORMATS)  # every format the converter offers
def test_quantize_then_verify_online_tensors(fmt, hf, tmp_path, capsys):
    out = tmp_path / "q"
    assert main_quantize([str(hf), str(out), "--format", fmt]) == 0
    captured = capsys.readouterr()
    assert "tensors quantised" in captured.out
    # progress on stderr: the last line counts every source tensor, its bytes and a rate
    total = len(SRC)
    nbytes = sum(t.numel() * t.element_size() for t in SRC.values())
    assert captured.err.strip().splitlines()[-1] == (
        f"quantize {fmt}: {total}/{total} tensors, {nbytes / 1e9:.2f} GB, " + captured.err.strip().split(" GB, ")[-1])
    assert captured.err.strip().endswith("MB/s")
    reader = CheckpointReader(out)
    online = dict(quantize_named_params(list(SRC.items()), fmt))  # what a sync sends
    assert set(online) == set(reader.keys())
    assert all(tensors_bit_equal(v, reader.get(k)) for k, v in online.items())
    synced = tmp_path / "synced"
    synced.mkdir()
    save_file({k: v.contiguous() for k, v in online.items()}, str(synced / "model-00001-of-00001.safetensors"))
    assert main_verify([str(out), str(synced)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1].startswith("OK")
    assert captured.err.strip().splitlines()[-1].startswith(f"verify-quant: {len(online)}/{len(online)} tensors, ")


def test_refuses_overwrite_without_force(hf, tmp_path, capsys):
    out = tmp_path / "q"
    assert main_quantize([str(hf), str(out), "--format", "fp8-block"]) == 0
    (out / "stale.txt").write_text("x")
    assert main_quantize([str(hf), str(out), "--format", "int8-ct"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "stale.txt").exists()
    assert main_quantize([str(hf), str(out), "--format", "int8-ct", "--force"]) == 0  # a checkpoint is replaced
    assert not (out / "stale.txt").exists()
    assert quant_format(out) == "int8-ct"
    assert sorted(os.listdir(tmp_path)) == ["q"]  # the previous output and the temporary are gone
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~current_umask()  # not the temporary's 0700


def test_force_never_replaces_a_directory_that_is_not_a_checkpoint(hf, tmp_path, capsys):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main_quantize([str(hf), str(out), "--format", "int8-ct", "--force"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert main_quantize([str(hf), str(out), "--format", "int8-ct"]) == 0  # an empty directory is fine


@pytest.mark.parametrize("case", ["bad_format", "no_dir", "no_config", "no_safetensors", "same_dir", "quantised"])
def test_clear_errors(case, hf, tmp_path, capsys):
    out = str(tmp_path / "q")
    if case == "bad_format":
        argv, needle = [str(hf), out, "--format", "int3"], "--format 'int3' is not supported"
    elif case == "no_dir":
        argv, needle = [str(tmp_path / "nope"), out, "--format", "int8-ct"], "is not a directory"
    elif case == "no_config":
        d = tmp_path / "nc"
        d.mkdir()
        argv, needle = [str(d), out, "--format", "int8-ct"], "no config.json"
    elif case == "no_safetensors":
        d = tmp_path / "ns"
        d.mkdir()
        (d / "config.json").write_text("{}")
        torch.save({}, d / "pytorch_model.bin")
        argv, needle = [str(d), out, "--format", "int8-ct"], "safetensors"
    elif case == "same_dir":
        argv, needle = [str(hf), str(hf), "--format", "int8-ct"], "must differ"
    else:
        q = tmp_path / "q1"
        assert main_quantize([str(hf), str(q), "--format", "int8-ct"]) == 0
        argv, needle = [str(q), out, "--format", "fp8-block"], "already quantised"
    capsys.readouterr()
    assert main_quantize(argv) == 2
    assert needle in capsys.readouterr().err


def test_verify_detects_a_flipped_bit_and_missing(hf, tmp_path, capsys):
    out = tmp_path / "q"
    assert main_quantize([str(hf), str(out), "--format", "int4-group"]) == 0
    online = dict(quantize_named_params(list(SRC.items()), "int4-group"))
    name = "model.layers.0.mlp.up_proj.weight_packed"
    bad = online[name].clone()
    bad.view(-1)[5] ^= 1
    f = tmp_path / "bucket.safetensors"
    save_file({name: bad}, str(f))
    capsys.readouterr()
    assert main_verify([str(out), str(f)]) == 1
    text = capsys.readouterr().out
    assert name in text and "FAIL" in text
    # a file with one good tensor passes; --names picks tensors
    save_file({name: online[name].contiguous()}, str(f))
    assert main_verify([str(out), str(f)]) == 0
    assert main_verify([str(out), str(f), "--names", name, "model.norm.weight"]) == 1  # norm not in the file
    # a directory lacking offline tensors fails unless --partial
    d = tmp_path / "partial"
    d.mkdir()
    save_file({name: online[name].contiguous()}, str(d / "model.safetensors"))
    assert main_verify([str(out), str(d)]) == 1
    assert main_verify([str(out), str(d), "--partial"]) == 0
    assert main_verify([str(tmp_path / "nope"), str(d)]) == 2


def test_cli_passthrough_wired():
    from slime_ascend import cli

    assert cli.PASSTHROUGH["quantize"][0] == "slime_ascend.quant.cli:main_quantize"
    assert cli.PASSTHROUGH["verify-quant"][0] == "slime_ascend.quant.cli:main_verify"


def test_progress_rewrites_one_line_on_a_terminal_and_throttles_elsewhere():
    import io

    from slime_ascend.quant.cli import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    clock = iter([0.1, 0.5, 1.0])  # one reading per call
    tty = Tty()
    p = Progress("q", stream=tty)
    p._clock = lambda: next(clock)
    p.start = p.last = 0.0
    p(1, 3, 10**9)  # 0.1 s after the last line: skipped on a terminal too (0.2 s)
    p(2, 3, 2 * 10**9)
    p(3, 3, 3 * 10**9)
    assert tty.getvalue() == "\rq: 2/3 tensors, 2.00 GB, 4000 MB/s\rq: 3/3 tensors, 3.00 GB, 3000 MB/s\n"
    log = io.StringIO()
    p = Progress("q", stream=log, interval=5.0)
    p._clock = iter([1.0, 2.0, 6.0]).__next__
    p.start = p.last = 0.0
    p(1, 9, 1)
    p(2, 9, 2)
    p(9, 9, 9)
    assert log.getvalue().splitlines() == ["q: 9/9 tensors, 0.00 GB, 0 MB/s"]


def test_a_planted_link_to_a_secret_is_refused_and_nothing_is_written(tmp_path, capsys):
    """A neighbour who can write into a shared HF_DIR links tokenizer.json to the user's 0600 secret."""
    hf = write_hf(tmp_path / "shared" / "hf", SRC)
    secret = tmp_path / "home" / ".netrc"
    secret.parent.mkdir()
    secret.write_text("machine hub login me password hunter2")
    secret.chmod(0o600)
    (hf / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "q"
    assert main_quantize([str(hf), str(out), "--format", "int8-ct"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: HF_DIR file ")
    assert "tokenizer.json" in err and "outside HF_DIR" in err and "Fix: replace the link" in err
    assert not out.exists() and "hunter2" not in err


def test_a_link_inside_hf_dir_is_copied_as_its_target_and_no_output_is_wider_than_its_source(tmp_path, capsys):
    hf = write_hf(tmp_path / "hf", SRC)
    (hf / "tokenizers").mkdir()
    (hf / "tokenizers" / "v2.json").write_text('{"v": 2}')
    (hf / "tokenizer.json").symlink_to("tokenizers/v2.json")
    (hf / "tokenizers" / "v2.json").chmod(0o600)
    (hf / "model.safetensors").chmod(0o640)
    (hf / "tokenizer_config.json").chmod(0o444)
    out = tmp_path / "q"
    old = os.umask(0o022)
    try:
        assert main_quantize([str(hf), str(out), "--format", "int8-w8a8"]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in out.iterdir()}
    assert not (out / "tokenizer.json").is_symlink() and (out / "tokenizer.json").read_text() == '{"v": 2}'
    assert modes == {"tokenizer.json": 0o600, "tokenizer_config.json": 0o444, "config.json": 0o644,
                     "quant_model_weights.safetensors": 0o640, "quant_model_weights.safetensors.index.json": 0o640,
                     "quant_model_description.json": 0o640}


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_a_fifo_in_hf_dir_is_refused_without_blocking(name, tmp_path, capsys):
    import threading

    hf = write_hf(tmp_path / "hf", SRC)
    (hf / name).unlink(missing_ok=True)
    os.mkfifo(hf / name)
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(main_quantize([str(hf), str(tmp_path / "q"), "--format",
                                                                         "int8-ct"])), daemon=True)
    worker.start()
    worker.join(30)
    assert codes == [2], "quantize blocked on a FIFO"
    err = capsys.readouterr().err
    assert f"{name}' is a FIFO, not a regular file" in err and len(err.strip().splitlines()) == 1
