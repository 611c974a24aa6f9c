"""opd's top-k loss term inside slime's loss path: slime's own get_responses cuts the micro-batch's logits,
slime's own get_sum_of_sample_mean reduces, slime's own policy_loss_function is the base the loss
dispatcher adds the term to. Compared with a slow reference (per sample: the full log-softmax path of the
pure algorithm, token mean, coefficient) and checked finite with -inf student logits at teacher ids."""

import argparse

import pytest
import torch

from slime_ascend.algorithms.opd import pack_topk_payload, topk_reverse_kl

pytestmark = pytest.mark.slime

V, K = 11, 3


@pytest.fixture
def one_rank(monkeypatch):
    from megatron.core import mpu

    for name, value in (("get_context_parallel_world_size", 1), ("get_context_parallel_rank", 0),
                        ("get_tensor_model_parallel_world_size", 1), ("get_tensor_model_parallel_rank", 0)):
        monkeypatch.setattr(mpu, name, lambda value=value: value)
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_group", lambda: None)


def _batch(seed=0, neg_inf=False):
    g = torch.Generator().manual_seed(seed)
    totals, resps, coefs = [5, 4, 6], [3, 2, 4], [1.0, 0.5, 1.0]
    logits = torch.randn(1, sum(totals), V, generator=g)
    tokens, metadata, masks = [], [], []
    for i, (t, r) in enumerate(zip(totals, resps, strict=True)):
        tokens.append(torch.randint(0, V, (t,), generator=g))
        t_lp, ids = torch.log_softmax(torch.randn(r, V, generator=g), -1).topk(K, dim=-1)
        ids[0, -1] = -1  # a padded entry
        metadata.append({"opd_teacher": "t", "opd_coef": coefs[i], "opd_topk": pack_topk_payload(ids, t_lp)})
        masks.append(torch.tensor([1] * (r - 1) + [0], dtype=torch.int))
    if neg_inf:  # the teacher's top-1 of sample 0's first response row, and of sample 1's masked last row
        start0 = totals[0] - resps[0] - 1
        logits[0, start0, int(metadata[0]["opd_topk"]["ids"][0, 0])] = float("-inf")
        start1 = totals[0] + totals[1] - 2
        logits[0, start1, int(metadata[1]["opd_topk"]["ids"][-1, 0])] = float("-inf")
    batch = {"unconcat_tokens": tokens, "total_lengths": totals, "response_lengths": resps, "loss_masks": masks,
             "metadata": metadata}
    return batch, logits


def _args(**kw):
    values = dict(ascend_plugins=["opd"], rollout_temperature=1.0, loss_type="custom_loss",
                  custom_loss_function_path="slime_ascend.hooks.loss_function", use_opd=True, opd_type="sglang",
                  opd_kl_coef=0.0, opd_teacher_load=None, allgather_cp=False, ascend_opd_mode="topk",
                  ascend_opd_teachers=[{"name": "t", "checkpoint_dir": "/x", "domains": ["d"], "url": "http://h:1"}])
    values.update(kw)
    return argparse.Namespace(**values)


def _reference(batch, logits, temperature=1.0):
    out, start = torch.zeros((), dtype=torch.float64), 0
    for i, (t, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"], strict=True)):
        rows = logits[0, start + t - r - 1: start + t - 1].double() / temperature
        payload = batch["metadata"][i]["opd_topk"]
        mask = batch["loss_masks"][i].float()
        per_token, _ = topk_reverse_kl(rows, payload["ids"].long(), payload["log_probs"], mask)
        out = out + batch["metadata"][i]["opd_coef"] * per_token.double().sum() / mask.sum().clamp(min=1)
        start += t
    return out


@pytest.mark.parametrize("neg_inf", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_term_matches_reference_through_slimes_loss_helpers(fresh_runtime, one_rank, neg_inf, temperature):
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean

    from slime_ascend.opd import hooks

    hooks.reset_state()
    batch, logits = _batch(neg_inf=neg_inf)
    x = logits.clone().requires_grad_(True)
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"])
    term, metrics = hooks.opd_topk_loss(_args(rollout_temperature=temperature), batch, x, reducer)
    ref = _reference(batch, logits, temperature)
    assert float(term) == pytest.approx(float(ref), rel=1e-5, abs=1e-6)
    assert float(metrics["opd_topk_loss"]) == pytest.approx(float(term), rel=1e-6)
    assert metrics["opd_topk_kl"] > 0 and torch.isfinite(metrics["opd_topk_kl"])
    term.backward()
    assert bool(torch.isfinite(x.grad).all())
    hooks.reset_state()


def test_missing_metadata_names_the_patches(fresh_runtime, one_rank):
    from slime_ascend.opd import hooks

    hooks.reset_state()
    batch, logits = _batch()
    del batch["metadata"]
    with pytest.raises(RuntimeError, match="rollout.forward_metadata.*train.loss_batch_metadata"):
        hooks.opd_topk_loss(_args(), batch, logits, None)
    hooks.reset_state()


def test_loss_dispatcher_adds_the_term_to_slimes_policy_loss(fresh_runtime, one_rank, monkeypatch):
    """No plugin provides the loss slot: the dispatcher runs slime's policy_loss_function and adds opd's term;
    the reported loss is the sum."""
    from slime.backends.megatron_utils import loss as slime_loss
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean

    from slime_ascend import hooks as dispatch
    from slime_ascend.opd import hooks

    hooks.reset_state()
    batch, logits = _batch(seed=3)
    base_calls = []

    def policy_loss_function(args, b, lg, reducer):  # slime's signature; its body needs Megatron's TP group
        base_calls.append(args.loss_type)
        value = (lg.float() ** 2).mean()
        return value, {"loss": value.detach(), "pg_loss": value.detach()}

    monkeypatch.setattr(slime_loss, "policy_loss_function", policy_loss_function)
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"])
    args = _args()
    loss, metrics = dispatch.loss_function(args, batch, logits, reducer)
    assert base_calls == ["custom_loss"]
    assert float(loss) == pytest.approx(float((logits ** 2).mean() + _reference(batch, logits)), rel=1e-5)
    assert float(metrics["loss"]) == pytest.approx(float(metrics["pg_loss"] + metrics["opd_topk_loss"]), rel=1e-5)
    # sampled mode: the dispatcher is slime's policy loss, unchanged
    hooks.reset_state()
    loss2, metrics2 = dispatch.loss_function(_args(ascend_opd_mode="sampled"), batch, logits, reducer)
    assert float(loss2) == pytest.approx(float((logits ** 2).mean())) and "opd_topk_kl" not in metrics2
    hooks.reset_state()
