"""The evidence readers and comparisons of the parallel-equivalence tests of slime's loop (``parallel_evidence``),
offline: each comparison passes on equal evidence and fails on the broken evidence it exists to catch (a byte of a
push, an fp8 code two steps off, a DIS mask computed on one CP shard only)."""

from __future__ import annotations

import math

import pytest
import torch

import parallel_evidence as ev


def _save(directory, tensors):
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_same_tensors_compares_names_dtypes_shapes_and_bytes(tmp_path):
    w = torch.randn(4, 8)
    ref = _save(tmp_path / "ref", {"a": w, "b": torch.ones(3, dtype=torch.bfloat16)})
    ev.assert_same_tensors(_save(tmp_path / "same", {"a": w.clone(), "b": torch.ones(3, dtype=torch.bfloat16)}), ref)
    nudged = w.clone()
    nudged[2, 3] = torch.nextafter(nudged[2, 3], torch.tensor(math.inf))  # one bit of one value
    for name, tensors in (("byte", {"a": nudged, "b": torch.ones(3, dtype=torch.bfloat16)}),
                          ("dtype", {"a": w, "b": torch.ones(3, dtype=torch.float16)}),
                          ("missing", {"a": w})):
        with pytest.raises(AssertionError):
            ev.assert_same_tensors(_save(tmp_path / name, tensors), ref)


def test_fp8_code_steps_counts_e4m3_spacings():
    codes = torch.tensor([1.0, 1.125, 240.0, 256.0, 2.0 ** -9, 0.0]).to(torch.float8_e4m3fn)
    assert codes.float().tolist() == [1.0, 1.125, 240.0, 256.0, 2.0 ** -9, 0.0]  # representable
    up = torch.tensor([1.125, 1.25, 256.0, 288.0, 2.0 ** -8, 2.0 ** -9]).to(torch.float8_e4m3fn)
    assert ev.fp8_code_steps(up, codes).tolist() == [1, 1, 1, 1, 1, 1]
    assert ev.fp8_code_steps(codes, codes).tolist() == [0] * 6
    two = torch.tensor([1.25, -2.0 ** -9]).to(torch.float8_e4m3fn)
    assert ev.fp8_code_steps(two, codes[[0, 4]]).tolist() == [2, 2]  # -2**-9 to 2**-9: through zero


def test_quantised_close_allows_codes_one_step_apart_and_no_more(tmp_path):
    torch.manual_seed(0)
    w = (torch.randn(32, 32) * 100).to(torch.float8_e4m3fn)
    w[0, 0] = 1.0  # code 0x38: the codes two above it are 1.125 and 1.25
    scale = torch.tensor([[3e-4]])
    ref = _save(tmp_path / "ref", {"w": w, "w_scale_inv": scale, "norm": torch.ones(32)})

    def push(name, codes, scale=scale, norm=torch.ones(32)):
        return _save(tmp_path / name, {"w": codes, "w_scale_inv": scale, "norm": norm})

    one = w.clone()
    one.view(torch.uint8)[0, 0] += 1  # the next code of the same sign
    got = ev.assert_quantised_close(push("one", one), ref, rtol=1e-4, atol=1e-6, max_flipped=1e-3)
    assert (got["codes"], got["flipped"]) == (1024, 1)
    with pytest.raises(AssertionError):  # more flipped codes than allowed
        ev.assert_quantised_close(push("one-b", one), ref, rtol=1e-4, atol=1e-6, max_flipped=1e-4)
    two = w.clone()
    two.view(torch.uint8)[0, 0] += 2
    with pytest.raises(AssertionError):
        ev.assert_quantised_close(push("two", two), ref, rtol=1e-4, atol=1e-6, max_flipped=1.0)
    with pytest.raises(AssertionError):  # a scale off
        ev.assert_quantised_close(push("scale", w, scale=scale * 1.01), ref, rtol=1e-4, atol=1e-6, max_flipped=1.0)


def _sample(lp_minus_rlp, total, mask=None):
    n = len(lp_minus_rlp)
    rlp = torch.linspace(-3.0, -1.0, n)
    return {"log_probs": rlp + torch.tensor(lp_minus_rlp), "rollout_log_probs": rlp, "total_lengths": total,
            "response_lengths": n, "loss_masks": torch.ones(n) if mask is None else torch.tensor(mask)}


def test_dis_decisions_and_the_one_cp_shard_bug_they_catch():
    from slime_ascend.algorithms.cp import cp_response_ranges

    eps = 1.5e-3
    # 8 response tokens after a 22-token prompt (total 30): slime's zig-zag split gives CP rank 1 response tokens
    # 0-2 and CP rank 0 tokens 3-7
    assert (cp_response_ranges(1, 2, 30, 8), cp_response_ranges(0, 2, 30, 8)) == (((0, 0), (0, 3)), ((0, 0), (3, 8)))
    samples = {0: _sample([3e-3, 0.0, -1e-4, 0.0, 0.0, -3e-3, 1e-3, 0.0], 30),
               1: _sample([0.0, -2e-3, 0.0, 0.0, 0.0, 0.0, 0.0, 5e-3], 30, mask=[1, 1, 1, 1, 1, 1, 1, 0])}
    want = ev.dis_decisions(samples, eps, eps)
    assert want[0].tolist() == [False, True, True, True, True, False, True, True]
    assert want[1].tolist() == [True, False, True, True, True, True, True, True]  # the last token is not trained
    assert ev.assert_same_decisions(ev.dis_decisions(samples, eps, eps), want) == (13, 3)
    assert math.isclose(ev.band_margin(samples, eps, eps), 5e-4, rel_tol=1e-2)  # 1e-3 to log(1 + eps)
    broken = ev.one_cp_shard_only(want, samples)  # CP rank 0's decisions only: rank 1's tokens all kept
    rank1 = [i for a, b in cp_response_ranges(1, 2, 30, 8) for i in range(a, b)]
    assert rank1 and all(broken[k][i] for k in broken for i in rank1)
    with pytest.raises(AssertionError):
        ev.assert_same_decisions(broken, want)
    # a layout whose log-probs moved by less than the margin keeps every decision
    moved = {k: {**s, "log_probs": s["log_probs"] + 4e-4} for k, s in samples.items()}
    ev.assert_same_decisions(ev.dis_decisions(moved, eps, eps), want)
