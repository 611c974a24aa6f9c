"""The delta bucket of the distributed transport (weight_sync/distributed_delta.py): what the engine rebuilds from
its served version and the three wire tensors is the full push's bytes, and malformed deltas are refused."""

from __future__ import annotations

import pytest
import torch

from slime_ascend.quant import make_spec, quantize_named_params
from slime_ascend.quant.checkpoint import tensors_bit_equal
from slime_ascend.weight_sync.distributed_delta import (
    DeltaSender,
    decode_delta,
    delta_load_format,
    encode_delta,
    parse_delta_format,
)


def _version(step: float, fmt: str, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = {f"model.layers.0.mlp.{n}.weight": torch.randn(64, 96, generator=g) * 0.05 for n in ("up_proj", "down_proj")}
    w["model.norm.weight"] = torch.randn(96, generator=g)
    g2 = torch.Generator().manual_seed(1)
    for t in w.values():  # 2% of the values moved by `step` of themselves
        t += (torch.rand(t.shape, generator=g2) < 0.02) * t * step
    return quantize_named_params([(k, v.to(torch.bfloat16)) for k, v in w.items()], make_spec(fmt))


def _entries(bucket):
    return [(n, t.dtype, tuple(t.shape)) for n, t in bucket]


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8-block", "int8-w8a8"])
@pytest.mark.parametrize("block_bytes", [32, 7])
def test_decoded_delta_is_the_full_push(fmt, block_bytes):
    old, new = dict(_version(0.0, fmt)), _version(0.05, fmt)
    old_bytes = {k: v.clone() for k, v in old.items()}
    counts, index, blocks = encode_delta(old, new, block_bytes)
    got = decode_delta(old, _entries(new), counts, index, blocks, block_bytes)
    assert [n for n, _ in got] == [n for n, _ in new]
    for (name, t), (_, want) in zip(got, new, strict=True):
        assert tensors_bit_equal(t, want), name
    assert all(tensors_bit_equal(old[k], old_bytes[k]) for k in old)  # the served version untouched
    full = sum(t.numel() * t.element_size() for _, t in new)
    # 2% of the values moved: fewer bytes than the full push, but not nothing (measured with the indices, at 32
    # and 7 bytes: mxfp8 0.42 / 0.19, fp8-block 0.42 / 0.18, int8-w8a8 0.54 / 0.28)
    assert 0 < index.numel() and blocks.numel() + index.numel() * 8 < 0.7 * full
    # a tensor the base lacks goes whole (-1), and nothing changed sends no block
    got = decode_delta({}, _entries(new), *encode_delta({}, new, block_bytes), block_bytes)
    assert all(tensors_bit_equal(t, w) for (_, t), (_, w) in zip(got, new, strict=True))
    counts, index, blocks = encode_delta(dict(new), new, block_bytes)
    assert counts.tolist() == [0] * len(new) and index.numel() == 0 and blocks.shape[0] == 0


def test_malformed_deltas_are_refused():
    old, new = dict(_version(0.0, "mxfp8")), _version(0.05, "mxfp8")
    counts, index, blocks = encode_delta(old, new)
    with pytest.raises(ValueError, match="counts"):
        decode_delta(old, _entries(new)[:-1], counts, index, blocks)
    with pytest.raises(ValueError, match="beyond its tensors"):
        decode_delta(old, _entries(new), counts, index, torch.cat([blocks, blocks[:1]]))
    with pytest.raises(ValueError, match="base holds as absent"):
        decode_delta({}, _entries(new), counts, index, blocks)
    bad = index.clone()
    bad[0] = 10**9
    with pytest.raises(ValueError, match="outside"):
        decode_delta(old, _entries(new), counts, bad, blocks)
    assert parse_delta_format(delta_load_format("7")) == (32, "7") and parse_delta_format(None) is None
    with pytest.raises(ValueError, match="block_bytes"):
        parse_delta_format("slime_ascend.quant_delta:x:7")


def test_sender_keeps_the_base_only_when_every_engine_serves():
    from slime_ascend.weight_sync.distributed_delta import _Version

    sender, pushed, version = DeltaSender(), _version(0.0, "mxfp8"), _Version("3")
    sender._received("g", version, pushed, [{"success": True, "weight_version": "3", "serving": False}])
    assert "g" not in sender.held  # staged, not serving yet
    sender._received("g", version, pushed, [{"weight_version": "3", "serving": True}, None])
    assert "g" not in sender.held  # one engine did not answer (a non-zero node rank, an SGLang engine)
    sender._received("g", version, pushed, [{"weight_version": "3", "serving": True}] * 2)
    assert sender.held["g"].version == "3" and set(sender.held["g"].tensors) == {n for n, _ in pushed}
