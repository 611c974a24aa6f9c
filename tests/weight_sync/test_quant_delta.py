"""Delta of two quantised versions: applying it to the old version gives the new one byte for byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.quant import make_spec, quantize_named_params
from slime_ascend.quant.checkpoint import tensors_bit_equal
from slime_ascend.weight_sync.quant_delta import apply_delta, block_delta


def _version(seed: int, fmt: str, changed: float, base_seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(base_seed)
    w = {f"model.layers.0.mlp.{n}.weight": torch.randn(64, 96, generator=g) * 0.05 for n in ("up_proj", "down_proj")}
    w["model.norm.weight"] = torch.randn(96, generator=g)
    g2 = torch.Generator().manual_seed(seed)
    for t in w.values():  # a small step on a fraction of the values
        mask = torch.rand(t.shape, generator=g2) < changed
        t += mask * torch.randn(t.shape, generator=g2) * 1e-2 * t.abs()
    named = [(k, v.to(torch.bfloat16)) for k, v in w.items()]
    return dict(quantize_named_params(named, make_spec(fmt)))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["mxfp8", "fp8-block", "int8-w8a8"]), st.integers(0, 2**16), st.floats(0.0, 1.0),
       st.sampled_from([1, 7, 32, 128]))
def test_apply_delta_equals_full_push(fmt, seed, changed, block_bytes):
    old, new = _version(1, fmt, 0.0), _version(seed, fmt, changed)
    delta = block_delta(old, new, block_bytes)
    got = apply_delta(old, delta)
    assert set(got) == set(new)
    for name, t in new.items():
        assert tensors_bit_equal(got[name], t), name
    if changed == 0.0:
        assert delta.tensors == {} and delta.payload_bytes == 0
    # at most every block of every tensor (the last one zero-padded) with its 8-byte index
    most = sum(-(-t.numel() * t.element_size() // block_bytes) * (block_bytes + 8) for t in new.values())
    assert 0 <= delta.payload_bytes <= most


def test_old_version_untouched_and_new_tensors_sent_whole():
    old, new = _version(1, "mxfp8", 0.0), _version(2, "mxfp8", 0.1)
    before = {k: v.clone() for k, v in old.items()}
    new["extra.weight"] = torch.ones(3, dtype=torch.bfloat16)
    new["model.norm.weight"] = new["model.norm.weight"].float()  # dtype changed: whole
    delta = block_delta(old, new)
    got = apply_delta(old, delta)
    assert delta.tensors["extra.weight"].index is None and delta.tensors["model.norm.weight"].index is None
    assert all(tensors_bit_equal(old[k], before[k]) for k in old)
    assert all(tensors_bit_equal(got[k], new[k]) for k in new)
    assert 0 < delta.density < 1


def test_small_step_is_sparse():
    old, new = _version(1, "mxfp8", 0.0), _version(3, "mxfp8", 0.01)
    assert block_delta(old, new).density < 0.5


def test_refuses_a_delta_for_another_shape():
    old, new = _version(1, "mxfp8", 0.0), _version(2, "mxfp8", 0.5)
    delta = block_delta(old, new)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="push this version whole"):
        apply_delta({**old, name: old[name][:32]}, delta)
