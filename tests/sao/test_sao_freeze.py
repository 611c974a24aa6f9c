"""Frozen critic attention: config check, model check, role config writer."""

from __future__ import annotations

import argparse
import types

import pytest
import torch
import yaml

from slime_ascend.plugins.settings import SettingsError
from slime_ascend.sao import critic, freeze, role_config


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention = torch.nn.ModuleDict({"linear_qkv": torch.nn.Linear(4, 12),
                                                   "linear_proj": torch.nn.Linear(4, 4)})
        self.mlp = torch.nn.ModuleDict({"linear_fc1": torch.nn.Linear(4, 8), "linear_fc2": torch.nn.Linear(8, 4)})


def toy_model():
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.decoder = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([Block(), Block()])})
    m.output_layer = torch.nn.Linear(4, 1)
    return m


def freeze_like_slime(model, patterns):
    for name in freeze.matching_names([n for n, _ in model.named_parameters()], patterns):
        dict(model.named_parameters())[name].requires_grad = False


def test_verify_frozen_accepts_a_correct_setup_and_rejects_wrong_ones():
    model = toy_model()
    freeze_like_slime(model, ["self_attention"])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    names = freeze.verify_frozen(model, opt, ["self_attention"])
    assert len(names) == 8 and all("self_attention" in n for n in names)
    with pytest.raises(RuntimeError, match="match no parameter"):
        freeze.verify_frozen(model, opt, ["attn_nope"])
    all_opt = torch.optim.Adam(model.parameters())
    with pytest.raises(RuntimeError, match="is in the optimizer"):
        freeze.verify_frozen(model, all_opt, ["self_attention"])
    with pytest.raises(RuntimeError, match="requires_grad is True"):
        freeze.verify_frozen(toy_model(), opt, ["self_attention"])


def test_snapshot_detects_a_single_bit_change():
    model = toy_model()
    snap = freeze.FrozenSnapshot(model.named_parameters())
    assert snap.changed(model.named_parameters()) == []
    w = model.decoder["layers"][0].self_attention["linear_qkv"].weight
    with torch.no_grad():
        w.view(torch.int32)[0, 0] ^= 1
    assert snap.changed(model.named_parameters()) == ["decoder.layers.0.self_attention.linear_qkv.weight"]


def test_role_config_writer_merge_and_check(tmp_path):
    path = tmp_path / "m.yaml"
    role_config.write_megatron_role_config(str(path), lr=5e-6, lr_warmup_iters=10)
    data = yaml.safe_load(path.read_text())
    (entry,) = data["megatron"]
    assert entry["role"] == "critic"
    assert entry["overrides"] == {"lr": 5e-6, "lr_warmup_iters": 10, "freeze_params_name_list": ["self_attention"]}
    with pytest.raises(FileExistsError):
        role_config.write_megatron_role_config(str(path))
    mine = tmp_path / "mine.yaml"
    critic_entry = {"name": "default", "role": "critic",
                    "overrides": {"lr": 1e-5, "freeze_params_name_list": ["embedding"]}}
    actor_entry = {"name": "default", "role": "actor", "overrides": {"lr": 1e-6}}
    mine.write_text(yaml.safe_dump({"megatron": [actor_entry, critic_entry]}))
    out = tmp_path / "merged.yaml"
    assert critic.main(["-o", str(out), "--merge", str(mine), "--set", "save=/ck"]) == 0
    merged = yaml.safe_load(out.read_text())["megatron"]
    assert merged[0] == {"name": "default", "role": "actor", "overrides": {"lr": 1e-6}}
    assert merged[1]["overrides"] == {"lr": 1e-5, "freeze_params_name_list": ["embedding", "self_attention"],
                                      "save": "/ck"}
    assert role_config.critic_overrides(str(out))["freeze_params_name_list"] == ["embedding", "self_attention"]

    args = argparse.Namespace(megatron_config_path=str(out), freeze_params_name_list=None)
    freeze.check_freeze_config(args, ["self_attention"])  # the actor process: the file has it
    with pytest.raises(SettingsError, match="missing"):
        freeze.check_freeze_config(args, ["self_attention", "mlp"])
    with pytest.raises(SettingsError, match="no --megatron-config-path"):
        freeze.check_freeze_config(argparse.Namespace(megatron_config_path=None), ["self_attention"])
    freeze.check_freeze_config(argparse.Namespace(megatron_config_path=None,
                                                  freeze_params_name_list=["self_attention"]), ["self_attention"])


@pytest.fixture
def sao_args(fresh_runtime, monkeypatch):
    from slime_ascend.sao.plugin import PLUGIN

    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    freeze._state.clear()
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(ascend_plugins=["sao"], advantage_estimator="ppo", n_samples_per_prompt=1, use_tis=False,
                  megatron_config_path="/nonexistent/sao_megatron.yaml", freeze_params_name_list=["self_attention"])
    yield argparse.Namespace(**values)
    freeze._state.clear()


def test_before_train_step_checks_the_critic_and_catches_a_global_list(sao_args):
    model = toy_model()
    freeze_like_slime(model, ["self_attention"])
    model.role = "critic"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    freeze.before_train_step(sao_args, 0, 0, [model], opt, None)
    loss = sum(p.sum() for p in model.parameters() if p.requires_grad)
    loss.backward()
    opt.step()
    freeze.before_train_step(sao_args, 0, 1, [model], opt, None)  # unchanged: passes
    # an update that touches the frozen weights is caught
    freeze._state.clear()
    freeze.before_train_step(sao_args, 0, 0, [model], opt, None)
    with torch.no_grad():
        model.decoder["layers"][1].self_attention["linear_proj"].bias.add_(1.0)
    with pytest.raises(RuntimeError, match="changed after an optimizer step"):
        freeze.before_train_step(sao_args, 0, 1, [model], opt, None)
    # the actor process with the same (global) list
    actor = toy_model()
    actor.role = "actor"
    with pytest.raises(RuntimeError, match="global"):
        freeze.before_train_step(sao_args, 0, 0, [actor], opt, None)


def test_validate(sao_args, tmp_path):
    from slime_ascend.plugins import runtime

    s = runtime.settings(sao_args, "sao")
    critic.validate(sao_args, s)
    sao_args.use_tis = True
    with pytest.raises(SettingsError, match="use-tis"):
        critic.validate(sao_args, s)
    sao_args.use_tis = False
    sao_args.freeze_params_name_list = None
    critic.validate(sao_args, s)  # file not readable here: left to the check on the model
    sao_args.megatron_config_path = None
    with pytest.raises(SettingsError, match="megatron-config-path"):
        critic.validate(sao_args, s)
    bad = types.SimpleNamespace(dis_preset="custom", dis_eps_low=None, dis_eps_high=None, freeze_critic_attention=False)
    with pytest.raises(SettingsError, match="custom"):
        critic.validate(sao_args, bad)


def test_validate_refuses_a_critic_saving_over_the_actors_checkpoint(sao_args, tmp_path):
    """slime saves each role to its own args.save; without a critic `save` in the role config the critic's
    checkpoint lands on the actor's (the demo's log showed both saved to one dir, the critic second)."""
    from slime_ascend.plugins import roles, runtime

    s = runtime.settings(sao_args, "sao")
    config = tmp_path / "sao_megatron.yaml"
    role_config.write_megatron_role_config(str(config))
    vars(sao_args).update(megatron_config_path=str(config), use_critic=True, save=str(tmp_path / "ckpt"))
    with pytest.raises(SettingsError, match="over the actor's checkpoint") as err:
        critic.validate(sao_args, s)
    message = str(err.value)
    assert "\n" not in message and f"--merge {config} -o {config}" in message
    assert f"--set save={tmp_path / 'ckpt'}_critic" in message

    # the fix the message names: the file is merged (its freeze list kept), and the job passes
    assert critic.main(["--merge", str(config), "-o", str(config), "--set", f"save={tmp_path / 'ckpt'}_critic"]) == 0
    assert role_config.critic_overrides(str(config))["freeze_params_name_list"] == ["self_attention"]
    critic.validate(sao_args, s)
    # an actor entry that saves elsewhere also separates them; the same path spelt another way does not
    role_config.write_megatron_role_config(str(config), force=True)
    data = yaml.safe_load(config.read_text())
    data["megatron"].append({"name": "default", "role": "actor", "overrides": {"save": str(tmp_path / "actor")}})
    config.write_text(yaml.safe_dump(data))
    critic.validate(sao_args, s)
    data["megatron"][-1]["overrides"]["save"] = str(tmp_path / "x" / ".." / "ckpt")
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(SettingsError, match="over the actor's checkpoint"):
        critic.validate(sao_args, s)
    # not checked where slime already applied the role's overrides (a train actor), nor without --save / a critic
    roles.set_train_role("critic")
    try:
        critic.validate(sao_args, s)
    finally:
        roles.set_train_role(None)
    sao_args.save = None
    critic.validate(sao_args, s)
    sao_args.save, sao_args.use_critic = str(tmp_path / "ckpt"), False
    critic.validate(sao_args, s)
