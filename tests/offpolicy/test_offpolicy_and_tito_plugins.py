"""dis / icepop / staleness / tito plugins with slime-shaped inputs (no slime needed)."""

from __future__ import annotations

import json
import math
import os
import socket
import types

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend import hooks
from slime_ascend.algorithms.cp import cp_slice
from slime_ascend.algorithms.masks import DIS_PRESETS, dis_policy_loss, token_mean
from slime_ascend.compat.sample import get_sample_class
from slime_ascend.offpolicy import hooks as staleness_hook
from slime_ascend.tito import hooks as tito
from slime_ascend.offpolicy.plugin import DIS, ICEPOP, STALENESS
from slime_ascend.tito.plugin import TITO
from slime_ascend.offpolicy.hooks import CPContext, dis_apply, icepop_apply, validate_dis, validate_icepop
from slime_ascend.plugins import registry, runtime
from slime_ascend.plugins.settings import SettingsError

Sample = get_sample_class()
PLUGINS = {p.name: p for p in (DIS, ICEPOP, STALENESS, TITO)}


@pytest.fixture(autouse=True)
def _clean(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    staleness_hook.reset_state()
    tito.reset_state()
    yield
    staleness_hook.reset_state()
    tito.reset_state()


def make_args(plugins, **overrides):
    values = {}
    for name in plugins:
        values.update({s.key: s.default for s in PLUGINS[name].settings})
        values.update(dict(PLUGINS[name].slime_args))
    values.update(ascend_plugins=list(plugins), use_rollout_logprobs=False, get_mismatch_metrics=False,
                  custom_tis_function_path="slime_ascend.hooks.tis_function", loss_type="policy_loss",
                  hf_checkpoint=None, reward_key=None, advantage_estimator="grpo", rewards_normalization=True,
                  grpo_std_normalization=True, n_samples_per_prompt=4)
    values.update(overrides)
    return types.SimpleNamespace(**values)


# ---------------------------------------------------------------------------------------------- data
def batch(seed, n=3, noise=0.4, lengths=None):
    g = torch.Generator().manual_seed(seed)
    rl = lengths or [int(x) for x in torch.randint(1, 9, (n,), generator=g)]
    tl = [r + int(torch.randint(1, 6, (1,), generator=g)) for r in rl]
    old = [-torch.rand(r, generator=g) * 2 for r in rl]
    rollout = [o + noise * torch.randn(r, generator=g) for o, r in zip(old, rl)]
    masks = [(torch.rand(r, generator=g) > 0.2).to(torch.int32) for r in rl]
    pg = torch.randn(sum(rl), generator=g)
    return pg, old, rollout, masks, tl, rl


def ref_dis(pg, old, rollout, masks, eps_low, eps_high, reweight=True):
    """Slow reference: token loop."""
    out, new_masks, masked = [], [], []
    k = 0
    for o, r, m in zip(old, rollout, masks):
        nm = []
        for t in range(len(o)):
            w = math.exp(float(o[t]) - float(r[t]))
            keep = 1 - eps_low < w < 1 + eps_high
            out.append(float(pg[k]) * (w if reweight else 1.0) if keep else 0.0)
            nm.append(int(m[t]) if keep else 0)
            masked.append(0.0 if keep else 1.0)
            k += 1
        new_masks.append(nm)
    return out, new_masks, masked


# ---------------------------------------------------------------------------------------------- plugins
def test_plugins_declare_slots_orders_and_load_from_entry_points():
    assert {c.slot: c.order for c in DIS.contributions} == {"tis": 100}
    assert {c.slot: c.order for c in ICEPOP.contributions} == {"tis": 200}
    assert {c.slot: c.order for c in STALENESS.contributions} == {"reward_post_process": 100}
    assert {c.slot for c in TITO.contributions} == {"rollout_sample_hook", "reward_post_process", "megatron_init",
                                                    "rollout_data_postprocess"}
    for p in PLUGINS.values():
        for c in p.contributions:
            assert callable(c.load())
    available = registry.available()
    for name in PLUGINS:
        assert available[name] is PLUGINS[name]


# ---------------------------------------------------------------------------------------------- DIS
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), preset=st.sampled_from(sorted(DIS_PRESETS)), reweight=st.booleans())
def test_dis_matches_token_loop(seed, preset, reweight):
    pg, old, rollout, masks, tl, rl = batch(seed)
    lo, hi = DIS_PRESETS[preset]
    loss, new_masks, metrics = dis_apply(pg, old, rollout, masks, tl, rl, eps_low=lo, eps_high=hi, reweight=reweight,
                                         cp=CPContext())
    ref_loss, ref_masks, ref_masked = ref_dis(pg, old, rollout, masks, lo, hi, reweight)
    torch.testing.assert_close(loss, torch.tensor(ref_loss), rtol=1e-5, atol=1e-6)
    assert [m.tolist() for m in new_masks] == ref_masks
    assert all(m.dtype == torch.int32 for m in new_masks)
    assert metrics["dis_masked"].tolist() == ref_masked
    for key in ("dis_masked", "dis_ratio", "dis_k3_kl", "dis_logratio_abs", "dis_low", "dis_high"):
        assert metrics[key].shape == pg.shape
    assert torch.equal(metrics["dis_low"] + metrics["dis_high"], metrics["dis_masked"])


def test_dis_band_edges_are_strict():
    # w exactly 1 + eps_high or 1 - eps_low is masked (f(x) = x only for 1-eps_l < x < 1+eps_h)
    old = [torch.tensor([math.log(1.5), math.log(0.5), 0.0], dtype=torch.float64)]
    rollout = [torch.zeros(3, dtype=torch.float64)]
    loss, masks, _ = dis_apply(torch.ones(3, dtype=torch.float64), old, rollout, [torch.ones(3)], [5], [3],
                               eps_low=0.5, eps_high=0.5, cp=CPContext())
    assert loss.tolist() == [0.0, 0.0, 1.0]
    assert masks[0].tolist() == [0.0, 0.0, 1.0]


def ppo_loss(logp, old, adv, eps=0.2, eps_high=0.28):
    ratio = torch.exp(logp - old)
    return torch.maximum(-ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv)


@pytest.mark.parametrize("seed", range(5))
def test_dis_gradient_equals_paper_dis_at_first_step(seed):
    """At θ = θ_old the DIS-weighted PPO loss has the gradient of -sg[f(r)]·A·logπθ (token mean)."""
    pg, old, rollout, masks, tl, rl = batch(seed, n=4, noise=0.3)
    g = torch.Generator().manual_seed(seed + 100)
    adv = torch.randn(sum(rl), generator=g)
    lo, hi = DIS_PRESETS["glm5"]

    logp = torch.cat(old).clone().requires_grad_(True)
    per_token = ppo_loss(logp, logp.detach(), adv)
    loss, new_masks, _ = dis_apply(per_token, [o.clone() for o in old], rollout, masks, tl, rl,
                                   eps_low=lo, eps_high=hi, cp=CPContext())
    denom = torch.cat(masks).sum()
    ours = (loss * torch.cat(new_masks)).sum() / denom  # slime: modified masks, pre-mask denominator
    (grad_ours,) = torch.autograd.grad(ours, logp)

    logp_ref = torch.cat(old).clone().requires_grad_(True)
    ref_tok, _, _ = dis_policy_loss(logp_ref, torch.cat(rollout), adv, torch.cat(masks), lo, hi)
    (grad_ref,) = torch.autograd.grad(token_mean(ref_tok, torch.cat(masks)), logp_ref)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-5, atol=1e-7)


def test_dis_rejects_bad_shapes_and_missing_rollout_log_probs():
    pg, old, rollout, masks, tl, rl = batch(1)
    with pytest.raises(ValueError, match="CP-local length"):
        dis_apply(pg, old, [r[:-1] for r in rollout], masks, tl, rl, eps_low=0.2, eps_high=0.2, cp=CPContext())
    with pytest.raises(ValueError, match="rollout_log_probs is missing"):
        dis_apply(pg, old, None, masks, tl, rl, eps_low=0.2, eps_high=0.2, cp=CPContext())
    with pytest.raises(ValueError, match="full length"):
        dis_apply(pg, old, rollout, [m[:-1] for m in masks], tl, rl, eps_low=0.2, eps_high=0.2, cp=CPContext())


# ---------------------------------------------------------------------------------------------- IcePop
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), beta=st.sampled_from([1.5, 2.0, 5.0]), reweight=st.booleans())
def test_icepop_matches_token_loop(seed, beta, reweight):
    pg, old, rollout, masks, tl, rl = batch(seed)
    loss, new_masks, metrics = icepop_apply(pg, old, rollout, masks, tl, rl, beta=beta, reweight=reweight,
                                            cp=CPContext())
    ref, k = [], 0
    for o, r in zip(old, rollout):
        for t in range(len(o)):
            rho = math.exp(float(o[t]) - float(r[t]))
            keep = 1 / beta <= rho <= beta
            ref.append(float(pg[k]) * (rho if reweight else 1.0) if keep else 0.0)
            k += 1
    torch.testing.assert_close(loss, torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert all(a is b for a, b in zip(new_masks, masks))  # IcePop keeps masks (and denominators)
    ref_masked = [0.0 if 1 / beta <= math.exp(float(o) - float(r)) <= beta else 1.0
                  for o, r in zip(torch.cat(old), torch.cat(rollout))]
    assert metrics["icepop_masked"].tolist() == ref_masked
    assert set(metrics) == {"icepop_masked", "icepop_ratio", "icepop_k3_kl", "icepop_logratio_abs"}


# ---------------------------------------------------------------------------------------------- dispatcher
def test_tis_dispatcher_chains_dis_then_icepop(fresh_runtime):
    pg, old, rollout, masks, tl, rl = batch(7, n=5)
    args = make_args(["dis", "icepop"], ascend_dis_weight="mask", ascend_dis_preset="maths")
    loss, new_masks, metrics = hooks.tis_function(args, pg_loss=pg, train_log_probs=old, rollout_log_probs=rollout,
                                                  loss_masks=masks, total_lengths=tl, response_lengths=rl)
    lo, hi = DIS_PRESETS["maths"]
    d_loss, d_masks, _ = dis_apply(pg, old, rollout, masks, tl, rl, eps_low=lo, eps_high=hi, reweight=False,
                                   cp=CPContext())
    i_loss, i_masks, _ = icepop_apply(d_loss, old, rollout, d_masks, tl, rl, beta=2.0, cp=CPContext())
    torch.testing.assert_close(loss, i_loss)
    assert [m.tolist() for m in new_masks] == [m.tolist() for m in d_masks]
    assert {k.split("_")[0] for k in metrics} == {"dis", "icepop"}


def test_validation_errors_name_the_fix(fresh_runtime):
    s = types.SimpleNamespace
    dis_settings = s(preset="maths", eps_low=None, eps_high=None, weight="ratio")
    with pytest.raises(SettingsError, match="--use-tis"):
        validate_dis(make_args(["dis"], use_tis=False), dis_settings)
    with pytest.raises(SettingsError, match="use-rollout-logprobs"):
        validate_dis(make_args(["dis"], use_rollout_logprobs=True), dis_settings)
    with pytest.raises(SettingsError, match="custom_tis_function_path"):
        validate_dis(make_args(["dis"], custom_tis_function_path="x.y"), dis_settings)
    with pytest.raises(SettingsError, match="loss_type"):
        validate_dis(make_args(["dis"], loss_type="custom_loss"), dis_settings)
    with pytest.raises(SettingsError, match="preset: custom"):
        validate_dis(make_args(["dis"]), s(preset="maths", eps_low=0.1, eps_high=None, weight="ratio"))
    with pytest.raises(SettingsError, match="ascend_dis_eps_high"):
        validate_dis(make_args(["dis"]), s(preset="custom", eps_low=0.1, eps_high=None, weight="ratio"))
    with pytest.raises(SettingsError, match="twice"):
        validate_dis(make_args(["dis", "icepop"]), dis_settings)
    validate_dis(make_args(["dis", "icepop"]), s(preset="maths", eps_low=None, eps_high=None, weight="mask"))
    with pytest.raises(SettingsError, match="ascend_icepop_low"):
        validate_icepop(make_args(["icepop"]), s(beta=2.0, low=3.0, reweight=True))


# ---------------------------------------------------------------------------------------------- CP (gloo)
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cp_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pg, old, rollout, masks, tl, rl = batch(11, lengths=[1, 7, 12, 3])
        tl = [r + p for r, p in zip(rl, [9, 2, 5, 1])]  # prompt-heavy sample: a rank may own no token of it

        def local(xs):
            return [cp_slice(x, rank, world, t, r) for x, t, r in zip(xs, tl, rl)]

        pg_local = torch.cat(local(list(pg.split(rl))))
        loss, new_masks, metrics = dis_apply(pg_local, local(old), local(rollout), masks, tl, rl, eps_low=0.2,
                                             eps_high=0.28, cp=CPContext(rank, world, dist.group.WORLD))
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"loss": loss.tolist(), "masks": [m.tolist() for m in new_masks],
                       "masked": metrics["dis_masked"].tolist()}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_dis_under_cp_matches_no_cp(tmp_path, world):
    mp.spawn(_cp_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    pg, old, rollout, masks, tl, rl = batch(11, lengths=[1, 7, 12, 3])
    tl = [r + p for r, p in zip(rl, [9, 2, 5, 1])]
    loss, new_masks, metrics = dis_apply(pg, old, rollout, masks, tl, rl, eps_low=0.2, eps_high=0.28, cp=CPContext())
    for rank in range(world):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["masks"] == [m.tolist() for m in new_masks]  # every rank returns the full masks
        expect = torch.cat([cp_slice(x, rank, world, t, r) for x, t, r in zip(loss.split(rl), tl, rl)])
        torch.testing.assert_close(torch.tensor(got["loss"]), expect)
        expect_m = torch.cat([cp_slice(x, rank, world, t, r)
                              for x, t, r in zip(metrics["dis_masked"].split(rl), tl, rl)])
        assert got["masked"] == expect_m.tolist()


# ---------------------------------------------------------------------------------------------- staleness
def sample(index, group, versions, status="COMPLETED", reward=0.0, rollout_id=None):
    s = Sample(index=index, group_index=group, tokens=[1, 2, 3, 4], response_length=2, reward=reward,
               rollout_id=rollout_id)
    s.weight_versions = [str(v) for v in versions]
    s.status = Sample.Status[status]
    return s


def test_staleness_drops_lag_above_tau_without_group_rule():
    args = make_args(["staleness"], ascend_staleness_tau=2, ascend_staleness_group_rule=False)
    samples = [sample(0, 0, [5]), sample(1, 0, [3, 5]), sample(2, 1, [2, 4]), sample(3, 1, [7])]
    raw, rew = [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]
    out_raw, out_rew = staleness_hook.staleness_post_process(args, samples, raw, rew)
    assert out_raw == raw and out_rew == rew
    # trainer version = newest seen = 7; lags 2, 4, 5, 0
    assert [s.remove_sample for s in samples] == [False, True, True, False]
    assert [s.metadata["ascend_staleness"]["lag"] for s in samples] == [2, 4, 5, 0]
    report = staleness_hook.last_staleness_report()
    assert report["trainer_version"] == 7 and report["stale"] == report["dropped"] == 2 and report["kept"] == 2
    assert report["lag_histogram"] == {0: 1, 2: 1, 4: 1, 5: 1}


def test_staleness_counts_reach_slimes_rollout_metrics(monkeypatch, caplog):
    """Each call reports rollout/staleness_* as one ``staleness <rollout_id>: {...}`` line (the shape of slime's
    own rollout metric line) and, with a tracker on, through slime's logging_utils.log at the rollout step."""
    import ast
    import sys

    logged = []
    fake_hooks = types.SimpleNamespace(_current_rollout_id=3)
    fake_logging = types.SimpleNamespace(log=lambda a, metrics, step_key: logged.append((metrics, step_key)))
    fake_metric_utils = types.SimpleNamespace(compute_rollout_step=lambda a, rid: rid * 10)
    monkeypatch.setitem(sys.modules, "slime.rollout.sample_hooks", fake_hooks)
    monkeypatch.setitem(sys.modules, "slime.observability.logging_utils", fake_logging)
    monkeypatch.setitem(sys.modules, "slime.observability.metric_utils", fake_metric_utils)
    monkeypatch.setitem(sys.modules, "slime.observability", types.SimpleNamespace(logging_utils=fake_logging,
                                                                                  metric_utils=fake_metric_utils))
    args = make_args(["staleness"], ascend_staleness_tau=0, ascend_staleness_group_rule=False, use_tensorboard=True)
    samples = [sample(0, 0, [5]), sample(1, 0, [4]), sample(2, 1, [5])]
    with caplog.at_level("INFO", logger="slime_ascend.staleness"):
        staleness_hook.staleness_post_process(args, samples, [0.0] * 3, [0.0] * 3)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("staleness 3: {"))
    metrics = ast.literal_eval(line.split(": ", 1)[1])
    assert metrics["rollout/staleness_dropped"] == metrics["rollout/staleness_stale"] == 1.0
    assert metrics["rollout/staleness_kept"] == 2.0 and metrics["rollout/staleness_max_lag"] == 1.0
    assert metrics["rollout/staleness_trainer_version"] == 5.0
    assert logged == [({**metrics, "rollout/step": 30}, "rollout/step")]
    # no tracker: the log line only
    logged.clear()
    staleness_hook.staleness_post_process(make_args(["staleness"]), [sample(3, 0, [5])], [0.0], [0.0])
    assert logged == []


def test_staleness_trainer_version_is_a_high_water_mark():
    args = make_args(["staleness"], ascend_staleness_tau=1, ascend_staleness_group_rule=False)
    staleness_hook.staleness_post_process(args, [sample(0, 0, [9])], [0.0], [0.0])
    later = [sample(1, 0, [7]), sample(2, 0, ["000008"])]
    staleness_hook.staleness_post_process(args, later, [0.0, 0.0], [0.0, 0.0])
    assert [s.remove_sample for s in later] == [True, False]


def test_group_rule_pads_and_drops_and_baseline_uses_valid_rollouts_only(fresh_runtime):
    args = make_args(["staleness"], ascend_staleness_tau=2)
    samples = [
        # group 0: one failed, one stale, two valid -> 2 of 4 valid: kept, two padded
        sample(0, 0, [10], reward=1.0), sample(1, 0, [], status="FAILED", reward=0.0),
        sample(2, 0, [6], reward=0.3), sample(3, 0, [9], reward=0.0),
        # group 1: three stale -> 1 of 4 valid: dropped whole
        sample(4, 1, [1], reward=1.0), sample(5, 1, [2], reward=0.0),
        sample(6, 1, [3], reward=1.0), sample(7, 1, [10], reward=0.5),
    ]
    raw = [s.reward for s in samples]
    out_raw, out_rew = hooks.reward_post_process(args, samples)
    assert out_raw == raw
    assert [s.metadata["ascend_staleness"]["action"] for s in samples] == [
        "keep", "pad", "pad", "keep", "drop_stale", "drop_stale", "drop_stale", "drop_group"]
    assert [samples[i].metadata["ascend_staleness"]["reason"] for i in (1, 2)] == ["env_failed", "stale"]
    assert [s.remove_sample for s in samples] == [False, True, True, False, True, True, True, True]
    # the padded slots alias a valid rollout, so group normalisation sees only the valid rewards 1 and 0
    # (mean 0.5, unbiased std sqrt(0.5))
    valid = [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)]
    assert out_rew[0] == pytest.approx(valid[0], rel=1e-5) and out_rew[3] == pytest.approx(valid[1], rel=1e-5)
    assert samples[1].rollout_id == samples[0].rollout_id and samples[2].rollout_id == samples[3].rollout_id
    assert len({samples[0].rollout_id, samples[3].rollout_id}) == 2
    report = staleness_hook.last_staleness_report()
    assert (report["kept"], report["padded"], report["dropped"]) == (2, 2, 4)
    counts = ("stale", "env_failed", "dropped_groups", "dropped_group_members")
    assert tuple(report[k] for k in counts) == (4, 1, 1, 1)


def test_unversioned_samples_kept_or_refused():
    args = make_args(["staleness"], ascend_staleness_group_rule=False)
    samples = [sample(0, 0, []), sample(1, 0, [3])]
    staleness_hook.staleness_post_process(args, samples, [0.0, 0.0], [0.0, 0.0])
    assert staleness_hook.last_staleness_report()["unversioned"] == 1
    assert not samples[0].remove_sample
    runtime.reset()  # settings are validated once per process and selection
    with pytest.raises(ValueError, match="no weight_versions"):
        staleness_hook.staleness_post_process(
            make_args(["staleness"], ascend_staleness_unversioned="error"), [sample(0, 0, [])], [0.0], [0.0])
    runtime.reset()
    with pytest.raises(ValueError, match="index=0"):
        staleness_hook.staleness_post_process(args, [sample(0, 0, ["v1"])], [0.0], [0.0])


# ---------------------------------------------------------------------------------------------- tito
def tokenizer_dir(path, template="{{ messages }}", vocab=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab or {"a": 0, "b": 1}}}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "b"}))
    return str(path)


def test_tokenizer_fingerprint_separates_vocab_and_template(tmp_path):
    a = tito.tokenizer_fingerprint(tokenizer_dir(tmp_path / "a"))
    b = tito.tokenizer_fingerprint(tokenizer_dir(tmp_path / "b", template="{{ other }}"))
    c = tito.tokenizer_fingerprint(tokenizer_dir(tmp_path / "c", vocab={"a": 0, "c": 1}))
    same = tito.tokenizer_fingerprint(tokenizer_dir(tmp_path / "d"))
    assert a["revision"] == same["revision"]
    assert a["tokenizer"] == b["tokenizer"] and a["chat_template"] != b["chat_template"]
    assert a["tokenizer"] != c["tokenizer"] and a["chat_template"] == c["chat_template"]
    with pytest.raises(tito.TitoError, match="no tokenizer files"):
        tito.tokenizer_fingerprint(str(tmp_path))


def test_tito_fingerprint_command_prints_the_revision_to_pin(tmp_path, capsys):
    from slime_ascend import cli

    path = tokenizer_dir(tmp_path / "a")
    assert cli.main(["tito-fingerprint", path]) == 0
    assert capsys.readouterr().out.strip() == tito.tokenizer_fingerprint(path)["revision"]
    assert cli.main(["tito-fingerprint", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err


def test_tito_passes_untouched_tokens_and_names_the_changed_sample(tmp_path, caplog):
    args = make_args(["tito"], hf_checkpoint=tokenizer_dir(tmp_path / "tok"))
    samples = [hooks.rollout_sample_hook(args, Sample(index=i, tokens=[5, 6, 7, 8 + i], response_length=2))
               for i in range(3)]
    assert samples[0].metadata["ascend_tito"]["tokenizer"].startswith("tok:")
    with caplog.at_level("INFO", logger="slime_ascend.tito"):
        hooks.reward_post_process(types.SimpleNamespace(**{**vars(args), "advantage_estimator": "ppo"}), samples)
    # the check's counts on slime's rollout metric line (no rollout id outside slime's RolloutManager)
    assert ("tito -: {'rollout/tito_checked_samples': 3.0, 'rollout/tito_unrecorded_samples': 0.0}"
            in caplog.messages)
    samples[1].tokens[-1] = 99  # e.g. a re-encode of the response text
    with pytest.raises(tito.TitoError, match=r"sample index=1: token IDs changed after generation"):
        tito.check_samples(args, samples, [0.0] * 3, [0.0] * 3)
    samples[1].tokens[-1] = 9
    samples[2].loss_mask = [1, 1, 1]
    with pytest.raises(tito.TitoError, match="loss_mask has 3 entries"):
        tito.check_samples(args, samples, [0.0] * 3, [0.0] * 3)


def test_tito_requires_the_record_unless_disabled():
    args = make_args(["tito"])
    s = Sample(index=4, tokens=[1, 2], response_length=1)
    with pytest.raises(tito.TitoError, match="no tito record"):
        tito.check_samples(args, [s], [0.0], [0.0])
    runtime.reset()
    tito.check_samples(make_args(["tito"], ascend_tito_require_record=False), [s], [0.0], [0.0])
    runtime.reset()
    s.status = Sample.Status.ABORTED  # aborted samples skip slime's sample hooks
    tito.check_samples(args, [s], [0.0], [0.0])


def test_tito_tokenizer_revisions_compared_with_pin_and_other_side(tmp_path):
    rollout = tito.tokenizer_fingerprint(tokenizer_dir(tmp_path / "r"))
    train = tito.tokenizer_fingerprint(tokenizer_dir(tmp_path / "t", template="{{ changed }}"))
    tito.compare_fingerprints("train", train, None, None)
    with pytest.raises(tito.TitoError, match="chat_template") as e:
        tito.compare_fingerprints("train", train, None, rollout)
    assert rollout["revision"] in str(e.value) and train["revision"] in str(e.value)
    with pytest.raises(tito.TitoError, match="pinned"):
        tito.compare_fingerprints("rollout", rollout, train["revision"], None)
    args = make_args(["tito"], hf_checkpoint=str(tmp_path / "t"), ascend_tito_tokenizer_revision=rollout["revision"])
    with pytest.raises(tito.TitoError, match="train side"):
        hooks.megatron_init(args)
