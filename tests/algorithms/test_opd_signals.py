"""OPD sampled-token advantages and the MOPD top-k generalised reverse KL vs slow references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.opd import (
    opd_advantages,
    opd_advantages_per_sample,
    pack_topk_payload,
    topk_payload_from_sglang,
    topk_reverse_kl,
    topk_reverse_kl_gathered,
    topk_student_log_probs,
    unpack_topk_payload,
)


# ------------------------------------------------------------------ slow references
def ref_topk_loss(logits, ids, t_lp, mask):
    """Loop over tokens and kept entries; full softmax per token in float64."""
    T, V = logits.shape
    out = []
    for t in range(T):
        z = logits[t].double()
        logp = [float(z[v] - torch.logsumexp(z, 0)) for v in range(V)]
        acc = 0.0
        for j in range(ids.shape[1]):
            v = int(ids[t, j])
            lt = float(t_lp[t, j])
            if v < 0 or not math.isfinite(lt):
                continue
            ps, pt = math.exp(logp[v]), math.exp(lt)
            # 0 * log 0 = 0: a student log-prob of -inf (P_S = 0) leaves only + P_T
            acc += pt if logp[v] == -math.inf else ps * (logp[v] - lt) - ps + pt
        out.append(acc * float(mask[t]))
    return torch.tensor(out, dtype=torch.float64)


def make_case(T, V, k, seed, pad_frac=0.2, neg_inf_frac=0.0):
    """Random student logits, the teacher's top-k (some padded), a 0/1 mask; with ``neg_inf_frac``, that
    share of the teacher's top-k ids get a -inf student logit (never a whole row)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * 2
    teacher_logits = torch.randn(T, V, generator=g) * 2
    t_lp_full = torch.log_softmax(teacher_logits, -1)
    t_lp, ids = t_lp_full.topk(k, dim=-1)
    if neg_inf_frac:
        hit = torch.rand(T, k, generator=g) < neg_inf_frac
        for t in range(T):
            cols = ids[t][hit[t]].tolist()
            if len(set(cols)) < V:  # keep one finite logit per row (an all -inf row has no softmax)
                logits[t, cols] = float("-inf")
    pad = torch.rand(T, k, generator=g) < pad_frac
    ids = torch.where(pad, torch.full_like(ids, -1), ids)
    t_lp = torch.where(pad, torch.full_like(t_lp, float("-inf")), t_lp)
    mask = (torch.rand(T, generator=g) > 0.25).float()
    return logits, ids, t_lp, mask


@settings(max_examples=80, deadline=None)
@given(T=st.integers(1, 6), V=st.integers(2, 12), k=st.integers(1, 12), seed=st.integers(0, 10_000),
       neg_inf_frac=st.sampled_from([0.0, 0.3, 1.0]))
def test_topk_loss_matches_reference(T, V, k, seed, neg_inf_frac):
    k = min(k, V)
    logits, ids, t_lp, mask = make_case(T, V, k, seed, neg_inf_frac=neg_inf_frac)
    x = logits.clone().requires_grad_(True)
    loss, metrics = topk_reverse_kl(x, ids, t_lp, mask)
    ref = ref_topk_loss(logits, ids, t_lp, mask)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-4)
    assert float(metrics["topk_kl"]) == pytest.approx(float(ref.sum() / mask.sum().clamp(min=1)), abs=1e-5)
    assert all(bool(torch.isfinite(v)) for v in metrics.values())
    loss.sum().backward()
    assert bool(torch.isfinite(x.grad).all())


def test_topk_loss_accepts_log_probs_and_batch_dims():
    logits, ids, t_lp, mask = make_case(8, 20, 5, 0)
    a, _ = topk_reverse_kl(logits, ids, t_lp, mask)
    b, _ = topk_reverse_kl(torch.log_softmax(logits, -1), ids, t_lp, mask, student_is_log_probs=True)
    c, _ = topk_reverse_kl(logits.view(2, 4, 20), ids.view(2, 4, 5), t_lp.view(2, 4, 5), mask.view(2, 4))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c.reshape(-1))


def test_topk_loss_no_renormalisation():
    # student mass on the teacher's top-1 is 0.5; a renormalised implementation would see 1.0
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    ids = torch.tensor([[0]])
    t_lp = torch.log(torch.tensor([[0.5]]))
    loss, m = topk_reverse_kl(logits, ids, t_lp)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    assert float(m["student_topk_mass"]) == pytest.approx(0.5, abs=1e-6)


def test_topk_loss_stationary_where_student_equals_teacher():
    torch.manual_seed(0)
    logits = torch.randn(6, 30, requires_grad=True)
    # teacher = student on its own top-k support (truncated: the top-k do not sum to 1)
    with torch.no_grad():
        s_lp = torch.log_softmax(logits, -1)
        t_lp, ids = s_lp.topk(4, dim=-1)
    loss, _ = topk_reverse_kl(logits, ids, t_lp)
    loss.sum().backward()
    assert float(loss.detach().abs().max()) < 1e-6
    assert float(logits.grad.abs().max()) < 1e-6
    # without the -P_S + P_T correction the same point is NOT stationary
    logits2 = logits.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(logits2, -1).gather(-1, ids)
    (lp.exp() * (lp - t_lp)).sum().backward()
    assert float(logits2.grad.abs().max()) > 1e-3


def test_topk_loss_gradient_matches_autograd_reference():
    logits, ids, t_lp, mask = make_case(5, 9, 4, 3)
    x = logits.clone().double().requires_grad_(True)
    loss, _ = topk_reverse_kl(x, ids, t_lp, mask)
    loss.sum().backward()
    # reference gradient: dL/dlogp_S(v) = P_S(v) (log P_S(v) - log P_T(v)), chain through log-softmax
    with torch.no_grad():
        lp = torch.log_softmax(logits.double(), -1)
        g_lp = torch.zeros_like(lp)
        for t in range(5):
            if mask[t] == 0:
                continue
            for j in range(4):
                v = int(ids[t, j])
                if v < 0 or not math.isfinite(float(t_lp[t, j])):
                    continue
                g_lp[t, v] += math.exp(lp[t, v]) * (lp[t, v] - float(t_lp[t, j]))
        ref = g_lp - lp.exp() * g_lp.sum(-1, keepdim=True)
    torch.testing.assert_close(x.grad, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_topk_loss_finite_with_neg_inf_student_logit_at_teacher_id(masked):
    """A -inf student logit at a teacher top-k id (e.g. a vocabulary entry the student masks): P_S = 0 and
    0 * log 0 = 0, so the entry adds P_T; loss, metrics and gradients stay finite whether or not the token
    is masked, and the other tokens of the batch keep their exact values (they used to turn NaN)."""
    logits, ids, t_lp, _ = make_case(4, 12, 3, 7, pad_frac=0.0)
    mask = torch.ones(4)
    clean_loss, _ = topk_reverse_kl(logits, ids, t_lp, mask)
    bad = logits.clone()
    bad[1, int(ids[1, 0])] = float("-inf")  # the teacher's top-1 at token 1
    bad[1, int(ids[1, 2])] = float("-inf")
    if masked:
        mask[1] = 0.0
    x = bad.clone().requires_grad_(True)
    loss, metrics = topk_reverse_kl(x, ids, t_lp, mask)
    assert bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(v)) for v in metrics.values())
    torch.testing.assert_close(loss.double(), ref_topk_loss(bad, ids, t_lp, mask), atol=1e-5, rtol=1e-4)
    for t in (0, 2, 3):  # untouched tokens: exactly as without the -inf
        torch.testing.assert_close(loss[t], clean_loss[t])
    if masked:
        assert float(loss[1]) == 0.0
    else:  # P_S = 0 at the two -inf ids: their terms are P_T; the third id is the usual term
        lp = torch.log_softmax(bad[1].double(), -1)
        j = int(ids[1, 1])
        expected = (t_lp[1, 0].exp() + t_lp[1, 2].exp()).double() + (
            lp[j].exp() * (lp[j] - t_lp[1, 1].double()) - lp[j].exp() + t_lp[1, 1].double().exp())
        assert float(loss[1]) == pytest.approx(float(expected), abs=1e-6)
    (loss.sum() + metrics["topk_kl"]).backward()
    assert bool(torch.isfinite(x.grad).all())
    assert float(x.grad[1, int(ids[1, 0])]) == 0.0 and float(x.grad[1, int(ids[1, 2])]) == 0.0
    if masked:
        assert float(x.grad[1].abs().max()) == 0.0
    # the same through the log-probs entry point (student_is_log_probs), float64 log-probs in
    lp_in = torch.log_softmax(bad.double(), -1).requires_grad_(True)
    loss2, _ = topk_reverse_kl(lp_in, ids, t_lp, mask, student_is_log_probs=True)
    loss2.sum().backward()
    assert bool(torch.isfinite(loss2).all()) and bool(torch.isfinite(lp_in.grad).all())
    torch.testing.assert_close(loss2, loss, atol=1e-5, rtol=1e-5)


def test_topk_loss_nan_student_logit_is_not_hidden():
    """Only -inf means P_S = 0: a NaN logit is a real fault and stays visible in the loss."""
    logits, ids, t_lp, mask = make_case(3, 8, 2, 5, pad_frac=0.0)
    logits[0, 3] = float("nan")
    mask[:] = 1.0
    loss, _ = topk_reverse_kl(logits, ids, t_lp, mask)
    assert bool(torch.isnan(loss[0]))


@pytest.mark.parametrize("neg_inf_frac", [0.0, 0.4])
def test_gathered_path_equals_full_log_softmax_path(neg_inf_frac):
    """logit[id] - logsumexp (what the slime loss uses: no [T, V] log-softmax kept) gives the same loss,
    metrics and logit gradients as the full log-softmax path, -inf student logits included."""
    logits, ids, t_lp, mask = make_case(7, 15, 5, 11, neg_inf_frac=neg_inf_frac)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    la, ma = topk_reverse_kl(a, ids, t_lp, mask)
    lb, mb = topk_reverse_kl_gathered(topk_student_log_probs(b, ids), ids, t_lp, mask, vocab_size=15)
    torch.testing.assert_close(lb, la, atol=1e-6, rtol=1e-5)
    for key in ma:
        torch.testing.assert_close(mb[key], ma[key], atol=1e-6, rtol=1e-5)
    la.sum().backward()
    lb.sum().backward()
    assert bool(torch.isfinite(b.grad).all())
    torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5)


def test_vocab_parallel_shards_match_the_full_vocabulary():
    """Tensor parallelism: each rank holds a vocabulary shard; the all-reduce sums with identity backward
    (Megatron's reduce_from_tensor_model_parallel_region), emulated in-process: rank r's graph sees the
    other ranks' contributions as constants. Every rank gets the full-vocabulary loss, and the gradient on
    its shard is the full-vocabulary gradient's slice."""
    logits, ids, t_lp, mask = make_case(6, 12, 4, 3, neg_inf_frac=0.3)
    full = logits.clone().requires_grad_(True)
    ref, _ = topk_reverse_kl(full, ids, t_lp, mask)
    ref.sum().backward()
    tp, width = 3, 4
    shards = [logits[:, r * width:(r + 1) * width].clone().requires_grad_(True) for r in range(tp)]

    for rank in range(tp):
        def reduce_sum(x):
            # x is this rank's local value; the others' values come from the same computation on their shards
            return x + sum(o.detach() for o in _others.pop(0))

        def reduce_max(x):
            return torch.stack([x] + [s.detach().max(-1, keepdim=True).values
                                      for q, s in enumerate(shards) if q != rank]).max(0).values

        # the other ranks' values of the two reduced quantities, in call order (sum_exp, then picked)
        with torch.no_grad():
            m = torch.stack([s.max(-1, keepdim=True).values for s in shards]).max(0).values
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            others_sum = [(s - m).exp().sum(-1, keepdim=True) for q, s in enumerate(shards) if q != rank]
            others_pick = []
            for q, s in enumerate(shards):
                if q == rank:
                    continue
                rel = ids.long() - q * width
                own = (rel >= 0) & (rel < width)
                picked = torch.gather(s, -1, torch.where(own, rel, torch.zeros_like(rel)))
                others_pick.append(torch.where(own, picked, torch.zeros_like(picked)))
        _others = [others_sum, others_pick]
        lp = topk_student_log_probs(shards[rank], ids, vocab_start=rank * width, reduce_sum=reduce_sum,
                                    reduce_max=reduce_max)
        loss, _ = topk_reverse_kl_gathered(lp, ids, t_lp, mask, vocab_size=12)
        torch.testing.assert_close(loss, ref.detach(), atol=1e-6, rtol=1e-5)
        loss.sum().backward()
    for r in range(tp):
        torch.testing.assert_close(shards[r].grad, full.grad[:, r * width:(r + 1) * width], atol=1e-6, rtol=1e-5)


def test_topk_loss_input_errors():
    logits, ids, t_lp, mask = make_case(4, 10, 3, 1)
    with pytest.raises(ValueError, match="teacher_topk_ids shape"):
        topk_reverse_kl(logits, ids[:, :2], t_lp)
    with pytest.raises(TypeError, match="integer"):
        topk_reverse_kl(logits, ids.float(), t_lp)
    with pytest.raises(ValueError, match="leading shape"):
        topk_reverse_kl(logits[:3], ids, t_lp)
    with pytest.raises(ValueError, match="loss_mask"):
        topk_reverse_kl(logits, ids, t_lp, mask[:2])


# ------------------------------------------------------------------ sampled-token advantage
@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 5), seed=st.integers(0, 1000), use_task=st.booleans())
def test_advantages_per_sample_matches_slime_formula(n, seed, use_task):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 7, (n,), generator=g).tolist()
    s = [torch.randn(L, generator=g) for L in lens]
    t = [torch.randn(L, generator=g) for L in lens]
    task = [torch.randn(L, generator=g) for L in lens] if use_task else None
    coefs = torch.rand(n, generator=g).tolist()
    adv, rkl = opd_advantages_per_sample(t, s, coefs, task)
    for i in range(n):
        for j in range(lens[i]):
            base = float(task[i][j]) if use_task else 0.0
            # slime: A - coef * (logp_S - logp_T)
            assert float(adv[i][j]) == pytest.approx(base - coefs[i] * (float(s[i][j]) - float(t[i][j])), abs=1e-5)
            assert float(rkl[i][j]) == pytest.approx(float(s[i][j]) - float(t[i][j]), abs=1e-6)


def test_advantages_are_detached_and_broadcast_coef():
    s = torch.randn(2, 5, requires_grad=True)
    t = torch.randn(2, 5)
    coef = torch.tensor([[0.5], [2.0]])
    a = opd_advantages(t, s, coef, task_advantages=torch.ones(2, 5), task_weight=0.3, clip=1.0)
    assert not a.requires_grad
    ref = 0.3 + (coef * (t - s.detach())).clamp(-1, 1)
    torch.testing.assert_close(a, ref)
    with pytest.raises(ValueError, match="shape"):
        opd_advantages(t[:, :3], s)
    with pytest.raises(ValueError, match="one per sample"):
        opd_advantages_per_sample([t[0]], [s[0]], [1.0, 2.0])
    with pytest.raises(ValueError, match="response length"):
        opd_advantages_per_sample([t[0, :3]], [s[0]])


# ------------------------------------------------------------------ payloads
def test_topk_payload_roundtrip_and_refuses_full_vocab():
    logits, ids, t_lp, _ = make_case(4, 50, 5, 2)
    p = pack_topk_payload(ids, t_lp)
    assert p["ids"].dtype == torch.int32 and p["log_probs"].dtype == torch.float32
    ids2, lp2 = unpack_topk_payload(p)
    assert torch.equal(ids2, ids) and torch.equal(lp2, t_lp)
    with pytest.raises(ValueError, match="full-vocabulary"):
        pack_topk_payload(torch.zeros(2, 2000, dtype=torch.long), torch.zeros(2, 2000))
    with pytest.raises(ValueError, match="opd_topk_v1"):
        unpack_topk_payload({"ids": ids})


def test_topk_payload_from_sglang_meta():
    # 1 prompt token + 3 scored positions; keep last 2 (response); rows of (logprob, id, text)
    meta = [
        None,
        [(-0.1, 5, None), (-2.0, 6, None)],
        [(-0.2, 7, None), (-1.9, 8, None)],
        [(-0.3, 9, None)],
    ]
    p = topk_payload_from_sglang(meta, response_length=2, k=2)
    ids, lps = unpack_topk_payload(p)
    assert ids.tolist() == [[7, 8], [9, -1]]
    assert lps[0].tolist() == pytest.approx([-0.2, -1.9])
    assert lps[1, 1] == float("-inf")
    with pytest.raises(ValueError, match="response_length"):
        topk_payload_from_sglang(meta, response_length=5)
