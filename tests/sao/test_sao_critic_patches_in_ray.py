"""Bugs slime's real loop found in the sao plugin's critic patches (tests/e2e/test_slime_sao.py).

1. Ray's worker turns an actor class into a subclass holding copies of every method (tracing span
   wrappers around the original functions) before the actor's ``init`` runs; the critic patches are
   installed from ``init`` (megatron_init), so wrapping ``MegatronTrainRayActor.train_critic`` alone
   never reached the live critic: one value-loss pass instead of K, slime's own value loss and GAE.
2. With ``--load`` an HF checkpoint, slime's HF loader asked the model converter for the critic value
   head's ``output_layer.bias`` and the critic died (``train.critic_hf_value_head``).
"""

from __future__ import annotations

import functools
from argparse import Namespace

import pytest
import torch

from slime_ascend import patch
from slime_ascend.patch.train import critic_hf_value_head


def _ray_span(method):
    """What ray.util.tracing.tracing_helper._inject_tracing_into_class puts on Ray's actor class."""

    @functools.wraps(method)
    def span_wrapper(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    return span_wrapper


@pytest.mark.slime
def test_critic_patches_reach_the_ray_actor_class(monkeypatch):
    import slime.backends.megatron_utils.actor as actor_mod

    from slime_ascend.patch.train import critic_advantage_function, critic_train_iters

    seen = []

    def fake_train(rollout_id, model, optimizer, opt_param_scheduler, *args, **kwargs):
        seen.append((critic_advantage_function.in_critic_pass(), type(opt_param_scheduler).__name__))

    monkeypatch.setattr(actor_mod, "train", fake_train)

    def train_critic_body(self, rollout_id, rollout_data):  # stands in for slime's train_critic
        actor_mod.train(rollout_id, None, None, object())
        return {"values": []}

    # the class Ray's worker creates before init: a subclass with its own copy of each method
    ray_class = type("Class", (actor_mod.MegatronTrainRayActor,), {"train_critic": _ray_span(train_critic_body)})
    args = Namespace(critic_train_iters=3, critic_train_iters_lr_schedule="per_rollout",
                     custom_advantage_function_path=None)
    try:
        patch.install("train.critic_train_iters", args)
        patch.install("train.critic_advantage_function", args)
        critic = ray_class.__new__(ray_class)
        critic.args = args
        assert critic.train_critic(0, {}) == {"values": []}
        # K passes, all inside a critic pass; the LR schedule advances in the first only
        assert seen == [(True, "object"), (True, "HeldSchedule"), (True, "HeldSchedule")]
        assert critic_train_iters.last_passes == 3
        assert args.custom_advantage_function_path == "slime_ascend.hooks.advantage_function"
    finally:
        patch.get("train.critic_advantage_function").remove()
        patch.get("train.critic_train_iters").remove()
    assert ray_class.__dict__["train_critic"].__wrapped__ is train_critic_body


def test_with_ray_actor_classes_lists_subclasses_holding_the_method():
    from slime_ascend.patch.train.critic_advantage_function import with_ray_actor_classes

    class Base:
        def m(self):
            return 1

    class Plain(Base):
        pass

    ray_copy = type("Class", (Plain,), {"m": _ray_span(Base.m)})
    assert with_ray_actor_classes(Base, "m") == [Base, ray_copy]


# ---- train.critic_hf_value_head ----------------------------------------------------------------
def _converter(name, reader, config):
    if name == "output_layer.bias":
        raise KeyError(f"Unsupported Megatron parameter {name!r}")
    if name == "boom":
        raise ValueError("other errors pass through")
    return torch.ones(2)


def test_value_head_bias_keeps_its_initial_value():
    head_bias = torch.nn.Parameter(torch.zeros(1))
    named = [("decoder.final_layernorm.weight", torch.nn.Parameter(torch.ones(4))),
             ("output_layer.bias", head_bias)]
    heads = critic_hf_value_head.value_head_biases(named, lambda n: n)
    assert heads == {"output_layer.bias": head_bias}
    get = critic_hf_value_head.keep_value_head_bias(_converter, heads)
    got = get("output_layer.bias", None, None)
    assert got.equal(torch.zeros(1)) and got is not head_bias
    assert get("decoder.final_layernorm.weight", None, None).equal(torch.ones(2))
    with pytest.raises(ValueError):
        get("boom", None, None)


def test_an_lm_head_bias_is_not_a_value_head():
    named = [("output_layer.bias", torch.nn.Parameter(torch.zeros(1024)))]
    heads = critic_hf_value_head.value_head_biases(named, lambda n: n)
    assert heads == {}
    with pytest.raises(KeyError):
        critic_hf_value_head.keep_value_head_bias(_converter, heads)("output_layer.bias", None, None)


@pytest.mark.slime
def test_hf_value_head_patch_wraps_slimes_loader(monkeypatch):
    import slime.backends.megatron_utils.hf_to_megatron as hf

    p = patch.get("train.critic_hf_value_head")
    assert p.verify() == []
    p.remove()  # an earlier test may have left it installed over slime's real loader: start from slime's own
    calls = []

    def fake_load(args, model, path, config, get_hf_tensor):
        calls.append(get_hf_tensor("module.output_layer.bias", None, config))

    monkeypatch.setattr(hf, "load_model_hf_weights", fake_load)
    monkeypatch.setattr("slime.backends.megatron_utils.update_weight.common.named_params_and_buffers",
                        lambda args, model: [("module.output_layer.bias", torch.nn.Parameter(torch.full((1,), 0.5)))])
    try:
        p.install()
        hf.load_model_hf_weights(Namespace(), [], "/nowhere", None, _converter_with_prefix)
    finally:
        p.remove()
    assert len(calls) == 1 and calls[0].equal(torch.full((1,), 0.5))


def _converter_with_prefix(name, reader, config):
    raise KeyError(f"Unsupported Megatron parameter {name!r}")
