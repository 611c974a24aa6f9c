"""Replayed bad inputs for `slime-ascend quantize` (issue 15): whatever goes wrong, the source
checkpoint and a previous good OUT_DIR survive byte for byte, and nothing partial is left that
looks like a checkpoint. Small tensors, tmp_path only."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weight_sync"))
from _ws_helpers import hf_tensors, write_hf  # noqa: E402

from slime_ascend.quant import checkpoint as ckpt_mod  # noqa: E402
from slime_ascend.quant.cli import main_quantize  # noqa: E402

FMT = ["--format", "int8-ct"]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root` (not following symlinks): file bytes, None for directories."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = b"link:" + os.readlink(p).encode() if os.path.islink(p) else \
                Path(p).read_bytes()
    return out


@pytest.fixture
def hf(tmp_path):
    return write_hf(tmp_path / "parent" / "hf", hf_tensors(3))


def _bad_hf(tmp_path: Path, name: str, value: float) -> Path:
    ts = hf_tensors(3)
    if name not in ts:  # a bias the name policy passes through
        ts[name] = torch.zeros(ts["model.layers.0.self_attn.q_proj.weight"].shape[0], dtype=torch.bfloat16)
    ts[name].view(-1)[7] = value
    return write_hf(tmp_path / "bad", ts)


# ----------------------------------------------------------------------------- OUT_DIR vs HF_DIR
def _same(tmp_path, hf):
    return [str(hf), str(hf)], "must differ"


def _same_via_symlinked_parent(tmp_path, hf):
    (tmp_path / "plink").symlink_to(hf.parent, target_is_directory=True)
    return [str(hf), str(tmp_path / "plink" / "hf")], "must differ"


def _out_is_parent_of_hf(tmp_path, hf):
    return [str(hf), str(hf.parent)], "contains HF_DIR"


def _hf_is_symlink_to_out(tmp_path, hf):
    (tmp_path / "hflink").symlink_to(hf, target_is_directory=True)
    return [str(tmp_path / "hflink"), str(hf)], "must differ"


def _out_inside_hf(tmp_path, hf):
    return [str(hf), str(hf / "q")], "inside HF_DIR"


def _out_is_symlink_inside_hf(tmp_path, hf):
    (hf / "sub").mkdir()
    (tmp_path / "qlink").symlink_to(hf / "sub", target_is_directory=True)
    return [str(hf), str(tmp_path / "qlink")], "inside HF_DIR"


@pytest.mark.parametrize("case", [_same, _same_via_symlinked_parent, _out_is_parent_of_hf, _hf_is_symlink_to_out,
                                  _out_inside_hf, _out_is_symlink_inside_hf], ids=lambda f: f.__name__[1:])
def test_out_overlapping_source_is_refused_and_source_untouched(case, hf, tmp_path, capsys):
    argv, needle = case(tmp_path, hf)
    before = snapshot(tmp_path)
    assert main_quantize(argv + FMT + ["--force"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before


def test_force_refuses_a_directory_that_is_not_a_checkpoint(hf, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "config.json").write_text("{}")  # a config.json alone is not a checkpoint
    before = snapshot(out)
    assert main_quantize([str(hf), str(out), "--force"] + FMT) == 2
    err = capsys.readouterr().err
    assert "holds no checkpoint" in err and repr(str(out)) in err
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- NaN / inf
@pytest.mark.parametrize("name,value", [
    ("model.layers.1.self_attn.k_proj.weight", float("nan")),       # quantised
    ("model.norm.weight", float("nan")),                            # passed through: norm
    ("model.embed_tokens.weight", float("inf")),                    # passed through: embedding
    ("lm_head.weight", float("-inf")),                              # passed through: lm_head
    ("model.layers.0.self_attn.q_proj.bias", float("nan")),         # passed through: bias
])
def test_non_finite_tensor_refused_naming_tensor_and_file(name, value, tmp_path, capsys):
    bad = _bad_hf(tmp_path, name, value)
    out = tmp_path / "q"
    assert main_quantize([str(bad), str(out)] + FMT) == 2
    err = capsys.readouterr().err
    assert name in err and "NaN or inf" in err and "model.safetensors" in err
    # one error line (a progress line may precede it on a slow host: Progress prints every few seconds)
    assert [line.startswith("error:") for line in err.strip().splitlines() if not line.startswith("quantize ")] == [True]
    assert sorted(os.listdir(tmp_path)) == ["bad"]  # no OUT_DIR, no temporary left behind


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"])
def test_failed_force_run_keeps_previous_output_byte_identical(name, hf, tmp_path, capsys):
    out = tmp_path / "q"
    assert main_quantize([str(hf), str(out)] + FMT) == 0
    good = snapshot(out)
    bad = _bad_hf(tmp_path, name, float("nan"))
    capsys.readouterr()
    assert main_quantize([str(bad), str(out), "--force"] + FMT) == 2
    assert name in capsys.readouterr().err
    assert snapshot(out) == good
    assert sorted(os.listdir(tmp_path)) == ["bad", "parent", "q"]


# ----------------------------------------------------------------------------- interrupted / failing writer
@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError(errno.ENOSPC, "No space left on device")],
                         ids=["sigint", "disk-full"])
@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "force-over-previous"])
def test_interrupted_writer_leaves_nothing_that_looks_valid(exc, previous, hf, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    if previous:
        assert main_quantize([str(hf), str(out)] + FMT) == 0
    good = snapshot(out) if previous else None
    real_save, calls = ckpt_mod.save_file, []

    def failing_save(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # one shard is already on disk
            raise exc
        return real_save(*a, **k)

    monkeypatch.setattr(ckpt_mod, "save_file", failing_save)
    argv = [str(hf), str(out), "--max-shard-gb", "0.0002"] + FMT + (["--force"] if previous else [])
    try:
        rc = main_quantize(argv)
    except BaseException as e:  # noqa: BLE001  (the unfixed CLI lets it escape)
        rc = type(e).__name__
    assert len(calls) == 2
    assert rc == (130 if exc is KeyboardInterrupt else 2)
    assert "left as it was" in capsys.readouterr().err
    if previous:
        assert snapshot(out) == good
    else:
        assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["parent"] + (["q"] if previous else [])  # no temporary left


def _hold_the_writer(monkeypatch):
    """Stop a quantize run inside its staged write until released (the second run starts meanwhile)."""
    import threading

    entered, release = threading.Event(), threading.Event()
    real = ckpt_mod._write_converted

    def slow(*a, **k):
        entered.set()
        assert release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(ckpt_mod, "_write_converted", slow)
    return entered, release


@pytest.mark.parametrize("force", [False, True])
def test_two_runs_into_one_out_dir_cannot_both_succeed(force, hf, tmp_path, monkeypatch, capsys):
    """The second run is refused at once naming the first's pid; the first completes; nothing else is left."""
    import threading

    out = tmp_path / "out"
    entered, release = _hold_the_writer(monkeypatch)
    first: dict[str, int] = {}
    t = threading.Thread(target=lambda: first.setdefault("rc", main_quantize([str(hf), str(out), *FMT])))
    t.start()
    try:
        assert entered.wait(30)
        capsys.readouterr()
        second = main_quantize([str(hf), str(out), *FMT, *(["--force"] if force else [])])
        err = capsys.readouterr().err
    finally:
        release.set()
        t.join(60)
    assert second == 2 and "being written by another run" in err and f"pid {os.getpid()}" in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # (a progress line may precede)
    assert len(errors) == 1 and "Fix:" in errors[0], err
    assert first["rc"] == 0 and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "parent"]  # no lock, temp or aside left


def test_an_output_that_appeared_meanwhile_is_not_replaced_without_force(hf, tmp_path, monkeypatch, capsys):
    """A run that checked an empty OUT_DIR refuses at its rename what another run put there meanwhile."""
    from slime_ascend.quant import _outdir

    out = tmp_path / "out"
    real_lock = _outdir.output_lock

    def lock_then_fill(final, label="OUT_DIR"):  # another run finished between our check and our lock
        write_hf(Path(final), hf_tensors(2))
        return real_lock(final, label)

    monkeypatch.setattr(_outdir, "output_lock", lock_then_fill)
    before = snapshot(tmp_path / "parent")
    other = snapshot(out) if out.exists() else None
    assert main_quantize([str(hf), str(out), *FMT]) == 2
    err = capsys.readouterr().err
    assert "filled by another run while this one worked" in err and "--force" in err, err
    assert snapshot(tmp_path / "parent") == before and other is None
    assert (out / "config.json").is_file() and not any(n.startswith(".out") for n in os.listdir(tmp_path))
