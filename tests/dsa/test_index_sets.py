"""The DSA key-set records and their comparison (``slime_ascend.dsa.index_sets``): sets, not slot order or padding;
samples split out of a packed train record; a single differing key found at its layer and position."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from slime_ascend.dsa.index_sets import canonical_sets, compare, compare_dirs, train_samples

TOPK = 4


def _causal_sets(length: int, seed: int) -> torch.Tensor:
    """int32 [length, TOPK]: for each query q a random choice of min(q + 1, TOPK) of its keys, -1 padded (the
    train side's layout), in a random slot order."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for q in range(length):
        keys = torch.randperm(q + 1, generator=g)[:TOPK]
        rows.append(torch.cat([keys, torch.full((TOPK - len(keys),), -1)]))
    return torch.stack(rows).to(torch.int32)


def _sides(lengths: list[int], pad: int = 3, seed: int = 0):
    """A packed train record of one layer over samples of ``lengths`` (plus a padding segment), and the rollout
    records the same selections make: fed tokens = each sample but its last, the engine's layout (a slot without
    a key repeats the first selected one, another slot order)."""
    tokens = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    sets = [_causal_sets(n, seed + i) for i, n in enumerate(lengths)]
    cu = [0]
    for n in [*lengths, pad]:
        cu.append(cu[-1] + n)
    packed = torch.cat([torch.where(s >= 0, s + cu[i], s) for i, s in enumerate(sets)]
                       + [torch.full((pad, TOPK), -1, dtype=torch.int32)])
    train = {"layer": 2, "cu_seqlens": cu, "tokens": tokens, "indices": packed}
    rollout = []
    for sample, s in zip(tokens, sets):
        engine = torch.where(s >= 0, s, s[:, :1]).flip(-1)[:-1]
        rollout.append({"tokens": sample[:-1], "start": 0, "weight_version": "1", "layers": {2: engine}})
    return train, rollout


def test_samples_are_split_out_of_the_packed_record_in_their_own_positions():
    train, _ = _sides([5, 3])
    (first, a), (second, b) = train_samples(train)
    assert first == tuple(range(5)) and second == (100, 101, 102)
    assert a.shape == (5, TOPK) and b.shape == (3, TOPK)
    assert int(b.max()) == 2 and int(b[0].max()) == 0  # relative to the sample's start, -1 padding kept


def test_equal_selections_in_another_layout_compare_equal():
    train, rollout = _sides([9, 6, 4])
    result = compare([train], rollout)
    assert result.equal and result.unmatched == 0 and result.train_samples == 3
    assert result.layers[2].positions == 8 + 5 + 3 and result.layers[2].samples == 3


@given(st.lists(st.integers(3, 12), min_size=1, max_size=4), st.integers(0, 10_000), st.data())
@settings(max_examples=60, deadline=None)
def test_one_changed_key_is_found_at_its_position(lengths, seed, data):
    train, rollout = _sides(lengths, seed=seed)
    sample = data.draw(st.integers(0, len(lengths) - 1))
    q = data.draw(st.integers(1, lengths[sample] - 2))  # a fed position with at least two past keys
    engine = rollout[sample]["layers"][2]
    # replace one selected key with a key of the query's past that is not selected (or drop one where all are)
    chosen = set(engine[q].tolist())
    spare = [k for k in range(q + 1) if k not in chosen]
    engine[q] = torch.where(engine[q] == engine[q][0], spare[0] if spare else -1, engine[q])
    result = compare([train], rollout)
    assert not result.equal and result.layers[2].differing == 1
    assert result.layers[2].first_difference == f"position {q} of a {lengths[sample]}-token sample"


def test_a_sample_without_a_rollout_record_is_counted_not_compared():
    train, rollout = _sides([5, 4])
    result = compare([train], rollout[:1])
    assert result.unmatched == 1 and result.layers[2].samples == 1 and result.equal
    assert not compare([train], []).equal  # nothing compared is not equality


def test_several_rollout_records_of_the_same_tokens_differ_only_where_all_differ():
    train, rollout = _sides([6])
    other = {**rollout[0], "weight_version": "2", "layers": {2: torch.zeros_like(rollout[0]["layers"][2])}}
    assert compare([train], [other, rollout[0]]).equal
    assert compare([train], [other]).layers[2].differing > 0


def test_canonical_sets_are_distinct_keys_ascending_then_padding():
    rows = torch.tensor([[3, 1, -1, 1], [0, 0, 0, 0]])
    assert canonical_sets(rows, 4).tolist() == [[1, 3, -1, -1], [0, -1, -1, -1]]
    with pytest.raises(ValueError, match="more than width=1"):
        canonical_sets(rows, 1)


def test_a_context_parallel_shard_is_refused_in_one_line():
    train, _ = _sides([5, 3])
    train["indices"] = train["indices"][:4]
    with pytest.raises(ValueError, match="context-parallel-size 1"):
        train_samples(train)


def test_directories_without_records_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no train-\\*.pt records"):
        compare_dirs(tmp_path, tmp_path)


def test_the_dump_setting_is_off_by_default_and_refused_under_context_parallelism():
    import types

    from slime_ascend.dsa.checks import validate
    from slime_ascend.dsa.plugin import PLUGIN
    from slime_ascend.patch.train.dsa_index_dump import wanted
    from slime_ascend.plugins.settings import SettingsError, SettingsView

    assert [s.key for s in PLUGIN.settings] == ["ascend_dsa_index_dump_dir"] and PLUGIN.settings[0].default is None
    assert not wanted(types.SimpleNamespace()) and wanted(types.SimpleNamespace(ascend_dsa_index_dump_dir="/d"))
    on = SettingsView("dsa-determinism", {"ascend_dsa_index_dump_dir": "/d"})
    validate(types.SimpleNamespace(context_parallel_size=1), on)
    validate(types.SimpleNamespace(context_parallel_size=2), SettingsView("dsa-determinism",
                                                                          {"ascend_dsa_index_dump_dir": None}))
    with pytest.raises(SettingsError) as info:
        validate(types.SimpleNamespace(context_parallel_size=2), on)
    assert "\n" not in str(info.value) and "ascend_dsa_index_dump_dir" in str(info.value) and "Fix:" in str(info.value)


def test_the_command_prints_each_layer_and_exits_1_where_sets_differ(tmp_path, capsys):
    from slime_ascend.dsa.cli import main

    train, rollout = _sides([7, 5])
    torch.save(train, tmp_path / "train-rank0000-1-000000.pt")
    for i, record in enumerate(rollout):
        torch.save(record, tmp_path / f"rollout-1-{i:06d}.pt")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layer 2: 10 query positions in 2 samples, 0 with another key set" in out and "the same key sets" in out
    rollout[0]["layers"][2][3] = torch.tensor([3, 3, 3, 3], dtype=torch.int32)  # one set of four keys: now one
    torch.save(rollout[0], tmp_path / "rollout-1-000000.pt")
    assert main([str(tmp_path)]) == 1
    assert "1 with another key set (first: position 3 of a 7-token sample)" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "truncated", "not a record", "no tokens"])
def test_a_file_named_like_a_record_that_is_not_one_is_refused_in_one_line(kind, tmp_path, capsys):
    """A FIFO named like a dump once made the command wait for ever: each is refused before it is read."""
    import os
    import socket

    from slime_ascend.dsa.cli import main

    train, rollout = _sides([5])
    torch.save(train, tmp_path / "train-rank0000-1-000000.pt")
    torch.save(rollout[0], tmp_path / "rollout-1-000000.pt")
    bad = tmp_path / "rollout-1-000001.pt"
    held = None
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "socket":
        held = socket.socket(socket.AF_UNIX)
        held.bind(str(bad))
    elif kind == "directory":
        bad.mkdir()
    elif kind == "truncated":
        bad.write_bytes((tmp_path / "rollout-1-000000.pt").read_bytes()[:100])
    elif kind == "not a record":
        bad.write_bytes(b"not a torch file at all")
    else:
        torch.save({"start": 0, "layers": {}}, bad)
    try:
        with pytest.raises(ValueError) as info:
            main([str(tmp_path)])
    finally:
        if held is not None:
            held.close()
    line = str(info.value)
    assert "\n" not in line and str(bad) in line and "Fix: remove it" in line
    assert ("not a regular file" in line) == (kind in ("fifo", "socket", "directory"))
    assert kind != "no tokens" or "no tokens" in line


def test_the_command_on_a_fifo_answers_at_once_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "train-rank0000-1-000000.pt")
    proc = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "dsa-index-sets", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "is a FIFO, not a regular file" in lines[0], proc.stderr
    assert "Fix:" in lines[0] and "Traceback" not in proc.stderr
