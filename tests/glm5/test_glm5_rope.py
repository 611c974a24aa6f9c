"""THD RoPE (apex's fused_apply_rotary_pos_emb_thd) vs a loop transcription of the CUDA kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.glm5.ops.rope import fused_apply_rotary_pos_emb_thd


def loop_rope(t, cu_seqlens, freqs, interleaved=False):
    """Element by element, as apex's ``fused_rope_block_forward`` writes it (tokens past cu_seqlens copied)."""
    out = t.clone()
    d2 = freqs.shape[-1]
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        for tok in range(cu[b], cu[b + 1]):
            s = tok - cu[b]
            for h in range(t.shape[1]):
                for d in range(d2):
                    f = float(freqs[s, 0, 0, d])
                    x = float(t[tok, h, d])
                    if interleaved:
                        partner = -float(t[tok, h, d + 1]) if d % 2 == 0 else float(t[tok, h, d - 1])
                    else:
                        partner = -float(t[tok, h, d + d2 // 2]) if d < d2 // 2 else float(t[tok, h, d - d2 // 2])
                    out[tok, h, d] = x * torch.cos(torch.tensor(f, dtype=torch.float64)) + partner * torch.sin(
                        torch.tensor(f, dtype=torch.float64))
    return out


def megatron_freqs(max_s, d2, interleaved=False, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    f = torch.outer(torch.arange(max_s, dtype=torch.float64), inv)
    f = torch.stack((f, f), -1).flatten(-2) if interleaved else torch.cat((f, f), -1)
    return f[:, None, None, :]


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 5), min_size=1, max_size=3), d2=st.sampled_from([2, 4, 6]),
       extra=st.integers(0, 3), interleaved=st.booleans(), seed=st.integers(0, 99))
def test_matches_loop_reference(lengths, d2, extra, interleaved, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    t = torch.randn(total + 1, 2, d2 + extra, generator=gen, dtype=torch.float64)  # one token past cu_seqlens
    freqs = torch.randn(max(lengths) + 2, 1, 1, d2, generator=gen, dtype=torch.float64)  # arbitrary angles
    got = fused_apply_rotary_pos_emb_thd(t, cu(lengths), freqs, interleaved=interleaved)
    ref = loop_rope(t, cu(lengths), freqs, interleaved)
    assert got.shape == t.shape and (got - ref).abs().max() < 1e-12


def test_positions_restart_per_sequence_and_scores_depend_on_offsets_only():
    freqs = megatron_freqs(16, 8)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 8, generator=gen, dtype=torch.float64), torch.randn(1, 1, 8, generator=gen, dtype=torch.float64)

    def at(x, pos):  # x at position pos: a sequence of pos + 1 copies, last token
        seq = x.expand(pos + 1, 1, 8).contiguous()
        return fused_apply_rotary_pos_emb_thd(seq, cu([pos + 1]), freqs)[-1, 0]

    assert torch.allclose(at(q, 5) @ at(k, 2), at(q, 9) @ at(k, 6), atol=1e-12)
    packed = fused_apply_rotary_pos_emb_thd(torch.cat([q, q, q]), cu([1, 2]), freqs)
    assert torch.allclose(packed[0], q[0]) and torch.allclose(packed[1], q[0])  # position 0 twice: unrotated


@pytest.mark.parametrize("cp_size", [2, 3])
def test_context_parallel_shares_equal_the_full_sequences(cp_size):
    lengths = [2 * cp_size * 2, 2 * cp_size]
    full_cu = cu(lengths)
    gen = torch.Generator().manual_seed(2)
    t = torch.randn(sum(lengths), 3, 6, generator=gen, dtype=torch.float64)
    freqs = megatron_freqs(max(lengths), 4)
    full = fused_apply_rotary_pos_emb_thd(t, full_cu, freqs)
    for rank in range(cp_size):
        rows = []
        for b, n in enumerate(lengths):  # Megatron's load-balanced split: chunks rank and 2cp-1-rank
            c = n // (2 * cp_size)
            start = int(full_cu[b])
            rows += list(range(start + rank * c, start + (rank + 1) * c))
            rows += list(range(start + n - (rank + 1) * c, start + n - rank * c))
        local = fused_apply_rotary_pos_emb_thd(t[rows], full_cu, freqs, cp_size, rank)
        assert torch.allclose(local, full[rows], atol=1e-12)


@pytest.mark.slow  # importing megatron.core takes ~30 s on this host
@pytest.mark.parametrize("cp_size", [1, 2])
def test_agrees_with_megatrons_baseline_thd_rope(cp_size):
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

    class Group:  # the two methods Megatron's baseline reads from a process group
        def size(self):
            return cp_size

        def rank(self):
            return cp_size - 1

    lengths = [4 * cp_size, 2 * cp_size]
    t = torch.randn(sum(lengths) // cp_size, 2, 8, dtype=torch.float64)
    freqs = megatron_freqs(16, 6)
    ref = rope_utils._apply_rotary_pos_emb_thd(t, cu(lengths), freqs, cp_group=Group())
    got = fused_apply_rotary_pos_emb_thd(t, cu(lengths), freqs, cp_size, cp_size - 1)
    assert (got - ref).abs().max() < 1e-12


def test_bf16_rounds_cos_and_sin_to_the_input_dtype_first():
    t = torch.randn(5, 2, 8).bfloat16()
    freqs = megatron_freqs(8, 8).float()
    got = fused_apply_rotary_pos_emb_thd(t, cu([5]), freqs)
    f = freqs[:5]
    cos, sin = torch.cos(f).bfloat16()[:, 0], torch.sin(f).bfloat16()[:, 0]  # [5, 1, 8]
    rot = torch.cat((-t[..., 4:], t[..., :4]), -1)
    assert got.dtype == torch.bfloat16 and torch.equal(got, t * cos + rot * sin)


def test_gradcheck_float64():
    t = torch.randn(7, 2, 6, dtype=torch.float64, requires_grad=True)
    freqs = megatron_freqs(8, 4)
    assert torch.autograd.gradcheck(lambda x: fused_apply_rotary_pos_emb_thd(x, cu([3, 4]), freqs), (t,))
    assert torch.autograd.gradcheck(
        lambda x: fused_apply_rotary_pos_emb_thd(x, cu([4, 4]), freqs, 2, 1, interleaved=True), (t[:4].detach().requires_grad_(),))


def test_bad_input_is_refused_in_one_line():
    t = torch.randn(6, 1, 4)
    for call, field in (
        (lambda: fused_apply_rotary_pos_emb_thd(t, cu([6]), megatron_freqs(4, 4)), "max_s = 4"),
        (lambda: fused_apply_rotary_pos_emb_thd(t, cu([6]), megatron_freqs(8, 6)), "rotary dim 6"),
        (lambda: fused_apply_rotary_pos_emb_thd(t, cu([6]), megatron_freqs(8, 4)[:, 0]), "^freqs has shape"),
        (lambda: fused_apply_rotary_pos_emb_thd(t, cu([6]), megatron_freqs(8, 4), 2, 0), "divisible"),
        (lambda: fused_apply_rotary_pos_emb_thd(t, cu([6]), megatron_freqs(8, 4), 2, 2), "cp_rank"),
    ):
        with pytest.raises(ValueError, match=field) as err:
            call()
        assert "\n" not in str(err.value)
