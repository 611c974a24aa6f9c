"""The one advantage base: the dispatcher runs slime's estimator once, at the advantage chain's base
order, only when no plugin computed a base; sao and compaction share one checked skip-observation GAE."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slime_ascend import advantage_base, hooks
from slime_ascend.opd import hooks as opd_hooks
from slime_ascend.patch.train import critic_advantage_function as caf
from slime_ascend.plugins import registry
from slime_ascend.plugins.base import Contribution, Plugin
from slime_ascend.plugins.slots import get_slot

CALLS: list[str] = []


def reference_gae(values, reward, kl, mask, gamma, lam, kl_coef):
    """Slow, obviously right: walk the action tokens backwards, skipping observations; the reward on
    the last action token, bootstrap 0 after it."""
    r = [-kl_coef * float(k) for k in kl]
    acts = [t for t, m in enumerate(mask) if m]
    if acts:
        r[acts[-1]] += reward
    adv, ret, a = [0.0] * len(mask), [0.0] * len(mask), 0.0
    for j in reversed(range(len(acts))):
        t = acts[j]
        nxt = float(values[acts[j + 1]]) if j + 1 < len(acts) else 0.0
        a = r[t] + gamma * nxt - float(values[t]) + gamma * lam * a
        adv[t], ret[t] = a, a + float(values[t])
    return adv, ret


def rollout_data(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    resp = [int(x) for x in torch.randint(2, 20, (n,), generator=g)]
    masks = [(torch.rand(m, generator=g) < 0.7).to(torch.int32) for m in resp]
    for m in masks:
        m[0] = 1
    log_probs = [-torch.rand(m, generator=g) for m in resp]
    return {
        "rollout_ids": list(range(n)), "round_number": [0] * n, "loss_masks": masks,
        "response_lengths": resp, "total_lengths": [m + 3 for m in resp],
        "rewards": [float(x) for x in torch.randn(n, generator=g)],
        "values": [torch.randn(m, generator=g) for m in resp],
        "kl": [torch.randn(m, generator=g).abs() * 0.1 for m in resp],
        "log_probs": log_probs, "teacher_log_probs": [lp + 0.2 for lp in log_probs],
    }


def make_args(names, **kw):
    """slime-like args for the enabled plugins: their setting defaults and slime arguments."""
    values = {}
    for name in names:
        plugin = registry.available().get(name)
        if plugin is not None:
            values.update({s.key: s.default for s in plugin.settings})
            values.update(dict(plugin.slime_args))
    values.update(
        ascend_plugins=list(names), advantage_estimator="grpo", gamma=1.0, lambd=1.0, kl_coef=0.0,
        n_samples_per_prompt=1, use_tis=bool({"dis", "icepop"} & set(names)), rollout_temperature=1.0,
        use_rollout_logprobs=False,
        custom_advantage_function_path="slime_ascend.hooks.advantage_function",
    )
    if "sao" in names:
        values.update(ascend_sao_freeze_critic_attention=False)
    if "opd" in names:
        values.update(opd_teacher_load=None, hf_checkpoint=None, ascend_opd_teachers=[
            {"name": "t", "checkpoint_dir": "/nonexistent/t", "domains": ["math"], "coef": 0.5,
             "url": "http://127.0.0.1:1"}])
    values.update(kw)
    return SimpleNamespace(**values)


@pytest.fixture
def counted_base(fresh_runtime, monkeypatch):
    """slime's estimator replaced by a counting stand-in (slime's GRPO: the reward on every token)."""
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    monkeypatch.setattr(type(caf.PATCH), "applied", property(lambda self: True))
    opd_hooks.reset_state()
    CALLS.clear()

    def slime_estimator(args, data):
        CALLS.append("slime")
        assert data.get("advantages") is None
        adv = [torch.ones_like(k) * r for r, k in zip(data["rewards"], data["kl"])]
        data["advantages"], data["returns"] = adv, list(adv)

    monkeypatch.setattr(advantage_base, "slime_estimator", slime_estimator)
    yield
    opd_hooks.reset_state()


# ---- the dispatcher: one base, at the declared order ----------------------------------------------


def prepare(args, data):
    CALLS.append("prepare50")
    assert data.get("advantages") is None


def own_base(args, data):
    CALLS.append("base100")
    data["advantages"] = [torch.zeros(len(m)) for m in data["loss_masks"]]
    data["returns"] = list(data["advantages"])


def at_base_order(args, data):
    CALLS.append("transform200")
    assert data["advantages"] is not None


def late(args, data):
    CALLS.append("transform500")
    data["advantages"] = [a + 1 for a in data["advantages"]]


def _register(name, *contributions):
    registry.register(Plugin(name=name, description="x", contributions=tuple(
        Contribution("advantage", f"{__name__}.{fn}", order=order) for fn, order in contributions)))


def test_advantage_chain_declares_its_base_order():
    """A plugin's own base runs below the base order, every transform at or above it."""
    assert get_slot("advantage").base_order == 200
    orders = {c.target.rsplit(".", 1)[-1]: c.order for name in ("sao", "compaction", "opd")
              for c in registry.available()[name].contributions if c.slot == "advantage"}
    assert orders == {"prepare_segments": 50, "skip_observation_advantages": 100, "base_advantages": 150,
                      "decay_advantages": 300, "opd_advantage": 500}


def test_dispatcher_runs_slimes_base_once_between_preparation_and_transforms(counted_base):
    _register("t-prep", ("prepare", 50))
    _register("t-late", ("at_base_order", 200), ("late", 500))
    data = rollout_data()
    hooks.advantage_function(make_args(["t-prep", "t-late"]), data)
    assert CALLS == ["prepare50", "slime", "transform200", "transform500"]
    assert data["advantages"][0].tolist() == pytest.approx([data["rewards"][0] + 1] * data["response_lengths"][0])


def test_dispatcher_runs_slimes_base_at_the_end_when_every_step_is_below_it(counted_base):
    _register("t-prep", ("prepare", 50))
    hooks.advantage_function(make_args(["t-prep"]), rollout_data())
    assert CALLS == ["prepare50", "slime"]


def test_dispatcher_skips_slimes_base_when_a_plugin_computed_one(counted_base):
    _register("t-own", ("own_base", 100))
    _register("t-late", ("late", 500))
    data = rollout_data()
    hooks.advantage_function(make_args(["t-own", "t-late"]), data)
    assert CALLS == ["base100", "transform500"]
    assert data["advantages"][0].tolist() == [1.0] * data["response_lengths"][0]


@pytest.mark.parametrize("names,estimator,slime_runs", [
    (["opd"], "grpo", 1),
    (["compaction"], "grpo", 1),
    (["compaction"], "reinforce_plus_plus", 1),
    (["compaction", "opd"], "grpo", 1),
    (["compaction"], "ppo", 0),
    (["compaction", "opd"], "ppo", 0),
    (["sao"], "ppo", 0),
    (["sao", "opd"], "ppo", 0),
    (["sao", "compaction"], "ppo", 0),
    (["sao", "compaction", "opd"], "ppo", 0),
    (["opd", "dis"], "grpo", 1),
    (["compaction", "icepop"], "grpo", 1),
])
def test_real_plugins_run_slimes_base_once_exactly_when_none_computes_one(counted_base, names, estimator,
                                                                           slime_runs):
    data = rollout_data(5)
    hooks.advantage_function(make_args(names, advantage_estimator=estimator), data)
    assert CALLS.count("slime") == slime_runs
    assert len(data["advantages"]) == len(data["returns"]) == len(data["loss_masks"])
    if "opd" in names:
        assert "opd_reverse_kl" in data
    if "compaction" in names:
        assert data["compaction_decay"] == [1.0] * len(data["loss_masks"])  # one segment per rollout


def test_opd_term_needs_a_base_before_it(counted_base):
    with pytest.raises(RuntimeError, match="no base advantages"):
        opd_hooks.opd_advantage(make_args(["opd"]), rollout_data())


# ---- one checked skip-observation GAE for sao and compaction --------------------------------------


def _sao_critic_args():
    return make_args(["sao"], advantage_estimator="ppo", gamma=0.5, ascend_sao_gamma=0.95,
                     ascend_sao_critic_lambda=0.9, kl_coef=0.3)


def _compaction_args():
    return make_args(["compaction"], advantage_estimator="ppo", gamma=0.95, lambd=0.9, kl_coef=0.3)


def _run_sao(data):
    with caf.critic_pass():
        hooks.advantage_function(_sao_critic_args(), data)


def _run_compaction(data):
    hooks.advantage_function(_compaction_args(), data)


RUNNERS = {"sao": _run_sao, "compaction": _run_compaction}


@pytest.mark.parametrize("plugin", sorted(RUNNERS))
def test_sao_and_compaction_bases_equal_the_slow_reference(counted_base, plugin):
    """Same gamma (0.95), lambda (0.9) and KL coefficient: both plugins' bases are the one GAE."""
    data = rollout_data(7)
    RUNNERS[plugin](data)
    assert CALLS == []
    for i, mask in enumerate(data["loss_masks"]):
        adv, ret = reference_gae(data["values"][i], data["rewards"][i], data["kl"][i], mask.tolist(), 0.95, 0.9, 0.3)
        assert data["advantages"][i].dtype == torch.float32
        torch.testing.assert_close(data["advantages"][i], torch.tensor(adv), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(data["returns"][i], torch.tensor(ret), rtol=1e-4, atol=1e-5)
    assert data["gae_lambdas"] == [0.9] * len(data["loss_masks"])


def _drop(key):
    def edit(data):
        data[key] = data[key][:-1]
    return edit


def _long_mask(data):
    data["loss_masks"][1] = torch.ones(data["response_lengths"][1] + 1, dtype=torch.int32)


def _no_values(data):
    del data["values"]


BAD_INPUTS = {
    "no critic values": (_no_values, ValueError, r"no critic 'values'.*--advantage-estimator ppo"),
    "kl count": (_drop("kl"), ValueError, "kl has 3 entries, values has 4"),
    "rewards count": (_drop("rewards"), ValueError, "rewards has 3 entries, values has 4"),
    "total_lengths count": (_drop("total_lengths"), ValueError, "total_lengths has 3 entries, values has 4"),
    "response_lengths count": (_drop("response_lengths"), ValueError, "response_lengths has 3 entries"),
    "loss mask not full length": (_long_mask, ValueError, "loss_masks must be full response length"),
}


@pytest.mark.parametrize("plugin", sorted(RUNNERS))
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_every_check_of_the_shared_gae_guards_both_plugins(counted_base, plugin, case):
    """Each check of the shared skip-observation GAE, through each plugin: removing one fails here."""
    edit, error, match = BAD_INPUTS[case]
    data = rollout_data(3)
    edit(data)
    with pytest.raises(error, match=match):
        RUNNERS[plugin](data)


@pytest.mark.parametrize("plugin", sorted(RUNNERS))
def test_cp_local_pieces_of_the_wrong_length_are_rejected_for_both_plugins(counted_base, monkeypatch, plugin):
    monkeypatch.setattr(advantage_base, "cp_state", lambda: (0, 2, lambda x: [x, x]))
    data = rollout_data(3)  # full-length values where rank 0 of 2 owns a piece
    with pytest.raises(ValueError, match="CP rank 0 owns"):
        RUNNERS[plugin](data)


def test_compaction_decay_continues_the_gae_sao_ran_with_saos_gamma(counted_base):
    """sao's base runs with ascend_sao_gamma, not slime's --gamma: the cross-segment decay uses the same
    gamma * lambda, so a rollout split into segments is credited as if it were one GAE."""
    data = {"rollout_ids": [3, 3], "round_number": [1, 0],
            "loss_masks": [torch.tensor([1, 0, 1]), torch.tensor([1, 1])],
            "response_lengths": [3, 2], "total_lengths": [5, 4], "rewards": [1.0, 1.0],
            "values": [torch.zeros(3), torch.zeros(2)], "kl": [torch.zeros(3), torch.zeros(2)]}
    args = make_args(["sao", "compaction"], advantage_estimator="ppo", gamma=1.0, ascend_sao_gamma=0.5)
    with caf.critic_pass():  # lambda = ascend_sao_critic_lambda = 1
        hooks.advantage_function(args, data)
    assert data["gae_gammas"] == [0.5, 0.5] and data["gae_lambdas"] == [1.0, 1.0]
    # segment 0 (second entry) has 2 trainable tokens after it: (0.5 * 1) ** 2
    assert data["compaction_decay"] == pytest.approx([1.0, 0.25])
    # V = 0, reward 1 at the rollout's last action: 0.5 ** (actions after the token in the whole rollout)
    assert data["advantages"][1].tolist() == pytest.approx([0.5**3, 0.5**2])
