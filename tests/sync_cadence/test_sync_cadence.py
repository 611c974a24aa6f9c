"""sync-cadence: the optimizer reset (same operations as slime's), the patch on slime's real actor class."""

from __future__ import annotations

import types

import pytest
import torch

from slime_ascend import patch
from slime_ascend.sync_cadence.optimizer import reset_optimizer_states


def _trained_adam():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        (p * torch.arange(3.0)).sum().backward()
        opt.step()
    return p, opt


def test_reset_zeroes_step_and_moments_in_place():
    p, opt = _trained_adam()
    state = opt.state[p]
    exp_avg = state["exp_avg"]
    assert float(state["step"]) == 2 and exp_avg.abs().sum() > 0
    assert reset_optimizer_states(opt) == 1
    assert float(state["step"]) == 0 and state["exp_avg"] is exp_avg  # same buffer
    assert exp_avg.abs().sum() == 0 and state["exp_avg_sq"].abs().sum() == 0
    # after a reset the next step is Adam's first step again: the update is lr * sign(grad) where grad != 0
    before = p.detach().clone()
    opt.zero_grad()
    (p * torch.arange(3.0)).sum().backward()
    opt.step()
    assert torch.allclose(before - p.detach(), torch.tensor([0.0, 0.1, 0.1]), atol=1e-6)


def test_reset_walks_megatrons_chained_optimizers_and_counts_nothing_before_training():
    p, opt = _trained_adam()
    empty = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=opt),
                                                        types.SimpleNamespace(optimizer=empty)])
    assert reset_optimizer_states(chained) == 1
    assert float(opt.state[p]["step"]) == 0
    assert reset_optimizer_states(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=empty)])) == 0


@pytest.mark.slime
def test_patch_resets_before_the_first_train_call_after_a_push():
    import slime.backends.megatron_utils.actor as actor_mod
    from slime.backends.megatron_utils.update_weight import update_weight_from_disk

    from slime_ascend.patch.train import reset_optimizer_on_push as mod

    p = patch.get("train.reset_optimizer_on_push")
    modules = {name: __import__(name, fromlist=["_"]) for name in p.target_modules}
    assert p.check(modules) == []
    original_train, original_update = actor_mod.train, update_weight_from_disk.UpdateWeightFromDisk.update_weights
    seen = []
    p.install(modules=modules)
    try:
        mod.reset_state()
        assert actor_mod.train.__wrapped__ is original_train
        # slime's functions stubbed below the wrappers (the real ones need Megatron and engines)
        train = mod._wrap_train(lambda rollout_id, model, optimizer, scheduler: seen.append(
            [float(st["step"]) for st in optimizer.state.values()]))
        push = mod._wrap_update(lambda self: None)
        param, opt = _trained_adam()
        train(0, None, opt, None)
        assert seen[-1] == [2.0]  # no push yet: untouched
        push(object())
        train(1, None, opt, None)
        assert seen[-1] == [0.0]  # reset before the first training after the push
        param2, opt2 = _trained_adam()
        train(2, None, opt2, None)
        assert seen[-1] == [2.0]  # only once per push
    finally:
        p.remove()
    assert actor_mod.train is original_train
    assert update_weight_from_disk.UpdateWeightFromDisk.update_weights is original_update


def test_a_changed_target_is_refused():
    p = patch.get("train.reset_optimizer_on_push")

    def train(rollout_id, model):  # lost its optimizer argument
        return None

    fake_actor = types.SimpleNamespace(__name__="slime.backends.megatron_utils.actor", train=train)
    modules = {name: types.SimpleNamespace(__name__=name) for name in p.target_modules}
    modules["slime.backends.megatron_utils.actor"] = fake_actor
    problems = p.check(modules)
    assert any("optimizer" in problem for problem in problems), problems
    assert any("UpdateWeightFromDisk.update_weights is missing" in problem for problem in problems), problems


def test_reset_zeroes_every_state_tensor_sgd_momentum_and_amsgrad_included():
    """slime's reset knows Adam's two moments only; SGD's momentum buffer and AMSGrad's running maximum are
    accumulated moments too: after the reset the next SGD step is the plain first step (lr * grad)."""
    p = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    for _ in range(3):
        sgd.zero_grad()
        (p * torch.arange(3.0)).sum().backward()
        sgd.step()
    buf = sgd.state[p]["momentum_buffer"]
    assert buf.abs().sum() > 0
    assert reset_optimizer_states(sgd) == 1
    assert sgd.state[p]["momentum_buffer"] is buf and buf.abs().sum() == 0
    before = p.detach().clone()
    sgd.zero_grad()
    (p * torch.arange(3.0)).sum().backward()
    sgd.step()
    # momentum 0.9 on a zeroed buffer: buf = 0.9 * 0 + grad, the update is lr * grad = [0, 0.1, 0.2]
    assert torch.allclose(before - p.detach(), torch.tensor([0.0, 0.1, 0.2]), atol=1e-6)

    q = torch.nn.Parameter(torch.ones(2))
    ams = torch.optim.Adam([q], lr=0.1, amsgrad=True)
    ams.zero_grad()
    (q * torch.tensor([1.0, 2.0])).sum().backward()
    ams.step()
    assert reset_optimizer_states(ams) == 1
    assert all(float(v.abs().sum()) == 0 for v in ams.state[q].values())
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # no momentum: nothing held
    plain.state[plain.param_groups[0]["params"][0]] = {"momentum_buffer": None}
    assert reset_optimizer_states(plain) == 0


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("no", False), (False, False), ("true", True),
                                                 (None, True)])
def test_patch_condition_reads_the_coerced_setting(value, expected):
    """A quoted "false" in the YAML validates as False and must also switch the reset off."""
    from slime_ascend.sync_cadence.plugin import RESET_ARG, resets

    args = types.SimpleNamespace() if value is None else types.SimpleNamespace(**{RESET_ARG: value})
    assert resets(args) is expected


def test_plugin_refuses_slimes_per_rollout_reset_alongside():
    from slime_ascend.plugins.settings import SettingsError
    from slime_ascend.sync_cadence.plugin import validate

    # a SettingsError: the driver's parse_args prints it as one line and exits 2 (no traceback)
    with pytest.raises(SettingsError, match="Fix: drop --reset-optimizer-states"):
        validate(types.SimpleNamespace(reset_optimizer_states=True),
                 types.SimpleNamespace(reset_optimizer_on_push=True))
