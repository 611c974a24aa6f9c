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
    tensor_digest,
    version_digest,
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
    digest = "0123456789abcdef" * 2
    assert parse_delta_format(delta_load_format("7", digest)) == (32, "7", digest) and parse_delta_format(None) is None
    assert parse_delta_format(delta_load_format("run:7", digest, 7)) == (7, "run:7", digest)  # a ':' in a version
    for bad in ("slime_ascend.quant_delta:x:7:" + digest, "slime_ascend.quant_delta:32:7",  # no digest: an old sender
                "slime_ascend.quant_delta:32:7:" + digest[:-1], "slime_ascend.quant_delta:32::" + digest):
        with pytest.raises(ValueError, match="block_bytes.*base digest"):
            parse_delta_format(bad)


def test_sender_keeps_the_base_only_when_every_engine_serves():
    from slime_ascend.weight_sync.distributed_delta import _Version

    sender, pushed, version = DeltaSender(), _version(0.0, "mxfp8"), _Version("3")
    sender._received("g", version, pushed, [{"success": True, "weight_version": "3", "serving": False}])
    assert "g" not in sender.held  # staged, not serving yet
    sender._received("g", version, pushed, [{"weight_version": "3", "serving": True}, None])
    assert "g" not in sender.held  # one engine did not answer (a non-zero node rank, an SGLang engine)
    sender._received("g", version, pushed, [{"weight_version": "3", "serving": True}] * 2)
    assert sender.held["g"].version == "3" and set(sender.held["g"].tensors) == {n for n, _ in pushed}


def test_the_base_digest_tells_other_bytes_under_one_label_apart():
    """What a delta carries of its base (issue 40): the digest of the version as the sender sent it, which every
    engine acknowledged; one changed byte, a changed dtype or shape, or a missing tensor changes it."""
    from slime_ascend.weight_sync.distributed_delta import _Version

    pushed = _version(0.0, "mxfp8")
    sender = DeltaSender()
    sender._received("g", _Version("3"), pushed, [{"weight_version": "3", "serving": True}])
    digests = {n: tensor_digest(t) for n, t in pushed}
    assert sender.held["g"].digest == version_digest(digests) and len(sender.held["g"].digest) == 32
    name, tensor = pushed[0]
    flipped = tensor.clone()
    flipped.view(torch.uint8).view(-1)[-1] ^= 1
    assert tensor_digest(flipped) != digests[name]
    assert tensor_digest(tensor.view(torch.uint8)) != digests[name]  # same bytes, another dtype
    assert tensor_digest(tensor.reshape(-1)) != digests[name]  # same bytes, another shape
    assert version_digest({**digests, name: tensor_digest(flipped)}) != version_digest(digests)
    assert version_digest({n: d for n, d in digests.items() if n != name}) != version_digest(digests)
    assert tensor_digest(tensor.t().contiguous().t()) == digests[name]  # the bytes in C order, however laid out
