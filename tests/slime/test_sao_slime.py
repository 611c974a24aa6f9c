"""The ``sao`` plugin against real slime (CPU, single-process gloo + Megatron parallel state):

* our advantage function through slime's ``compute_advantages_and_returns`` (actor and critic);
* the patched ``train_critic`` of slime's real ``MegatronTrainRayActor`` runs ``train`` K times, holds
  the LR schedule after the first pass, and removal restores slime;
* slime's per-role override nulls the critic's advantage path; the patch restores it;
* DIS and the critic's value loss through slime's ``loss_function``;
* slime's freeze rule on a real Megatron GPTModel with the generated critic role config.
"""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from conftest import single_process_megatron
import torch

from slime_ascend.algorithms.gae import cp_skip_observation_gae, length_adaptive_lambdas
from slime_ascend.algorithms.masks import DIS_PRESETS
from slime_ascend.patch.train import critic_advantage_function as caf
from slime_ascend.patch.train import critic_train_iters as cti
from slime_ascend.sao import critic, freeze
from slime_ascend.sao import loss as sao_loss
from slime_ascend.sao.plugin import PLUGIN

pytestmark = pytest.mark.slime

DISPATCH = "slime_ascend.hooks."


@pytest.fixture(scope="module")
def mpu():
    with single_process_megatron() as state:
        yield state


@pytest.fixture
def actor_module():
    """slime's actor module."""
    import slime.backends.megatron_utils.actor as actor

    return actor


@pytest.fixture
def args(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(dict(PLUGIN.slime_args))
    values.update(
        ascend_plugins=["sao"], advantage_estimator="ppo", n_samples_per_prompt=1, use_tis=False, kl_coef=0.0,
        kl_loss_type="k1", use_opd=False, normalize_advantages=False, gamma=1.0, lambd=1.0, value_clip=0.2,
        megatron_config_path=None, freeze_params_name_list=None, ascend_sao_freeze_critic_attention=False,
        custom_advantage_function_path=DISPATCH + "advantage_function",
        custom_loss_function_path=DISPATCH + "loss_function", loss_type="custom_loss",
        rollout_temperature=1.0, log_probs_chunk_size=-1, allgather_cp=False, recompute_loss_function=False,
        entropy_coef=0.0,
    )
    yield argparse.Namespace(**values)
    cti.PATCH.remove()
    caf.PATCH.remove()


def rollout_data(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    resp = [int(x) for x in torch.randint(2, 30, (n,), generator=g)]
    totals = [r + int(p) for r, p in zip(resp, torch.randint(1, 6, (n,), generator=g))]
    return dict(
        values=[torch.randn(m, generator=g) for m in resp],
        rollout_log_probs=[-torch.rand(m, generator=g) for m in resp],
        loss_masks=[(torch.rand(m, generator=g) < 0.7).to(torch.int32) for m in resp],
        rewards=[float(x) for x in torch.randn(n, generator=g)],
        total_lengths=totals, response_lengths=resp,
    )


def direct(data, lambdas):
    zeros = [torch.zeros_like(v) for v in data["values"]]
    return cp_skip_observation_gae(data["values"], zeros, data["rewards"], data["loss_masks"],
                                   data["total_lengths"], data["response_lengths"], gamma=1.0, lambdas=lambdas)


def test_advantage_through_slimes_compute_advantages_and_returns(mpu, actor_module, args):
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    caf.PATCH.install(args)
    data = rollout_data(1)
    compute_advantages_and_returns(args, data)  # the actor: length-adaptive lambda
    adv, ret = direct(data, length_adaptive_lambdas(data["loss_masks"], 1.5))
    for a, b in zip(adv, data["advantages"]):
        torch.testing.assert_close(b, a)
    data = rollout_data(2)
    with caf.critic_pass():  # the critic: lambda 1
        compute_advantages_and_returns(args, data)
    _, ret = direct(data, 1.0)
    for a, b in zip(ret, data["returns"]):
        torch.testing.assert_close(b, a)


class CountingTrain:
    def __init__(self):
        self.calls = []

    def __call__(self, rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches,
                 global_batch_sizes):
        opt_param_scheduler.step(increment=global_batch_sizes[0])
        self.calls.append(type(opt_param_scheduler).__name__)


class Scheduler:
    def __init__(self):
        self.num_steps = 0

    def step(self, increment):
        self.num_steps += increment


@pytest.mark.parametrize("k,schedule,advance", [(2, "per_rollout", 1), (3, "per_pass", 3), (1, "per_rollout", 1)])
def test_patched_train_critic_runs_train_k_times(mpu, actor_module, args, monkeypatch, k, schedule, advance):
    from slime_ascend.sao import critic as sao_critic
    from slime_ascend.startup import early

    counting = CountingTrain()
    monkeypatch.setattr(actor_module, "train", counting)
    monkeypatch.setattr(actor_module, "get_data_iterator", lambda data: [data])
    values = rollout_data(3)["values"]
    monkeypatch.setattr(actor_module, "forward_only", lambda fn, a, m, it, n: {"values": [v.clone() for v in values]})
    original = actor_module.MegatronTrainRayActor.train_critic
    args.ascend_sao_critic_iters, args.ascend_sao_critic_lr_schedule = k, schedule
    args.custom_advantage_function_path = None  # as slime's critic role override leaves it
    early.validate_now(args, "train")  # what the critic process runs as it starts: sao's train patches
    sao_critic.megatron_init(args)  # then K onto its args
    assert args.custom_advantage_function_path == DISPATCH + "advantage_function"

    data = rollout_data(3)
    data.update(num_microbatches=[1], global_batch_sizes=[8])
    stub = types.SimpleNamespace(args=args, model=None, optimizer=None, opt_param_scheduler=Scheduler())
    out = actor_module.MegatronTrainRayActor.train_critic(stub, 0, data)
    assert len(counting.calls) == k and cti.last_passes == k
    if schedule == "per_rollout":
        assert counting.calls == ["Scheduler"] + ["HeldSchedule"] * (k - 1)
    assert stub.opt_param_scheduler.num_steps == 8 * advance
    assert args.loss_type == "value_loss"
    for a, b in zip(out["values"], values):  # pre-update values go back to the actor
        torch.testing.assert_close(a, b)
    _, ret = direct(data, 1.0)  # the critic's targets: our GAE with the critic lambda
    for a, b in zip(ret, data["returns"]):
        torch.testing.assert_close(b, a)

    cti.PATCH.remove()
    caf.PATCH.remove()
    assert actor_module.MegatronTrainRayActor.train_critic is original
    assert actor_module.train is counting
    assert args.custom_advantage_function_path is None


def test_role_override_nulls_the_path_and_the_patch_restores_it(actor_module, args, tmp_path):
    from slime.utils.arguments import parse_megatron_role_args

    path = tmp_path / "sao_megatron.yaml"
    critic.write_megatron_role_config(str(path), lr=5e-6)
    args.megatron_config_path = str(path)
    args.lr, args.untie_embeddings_and_output_weights = 1e-6, False
    critic_args = parse_megatron_role_args(args, str(path), role="critic")
    assert critic_args.custom_advantage_function_path is None  # the conflict
    assert critic_args.freeze_params_name_list == ["self_attention"] and critic_args.lr == 5e-6
    freeze.check_freeze_config(critic_args, ["self_attention"])
    caf.PATCH.install(critic_args)
    assert critic_args.custom_advantage_function_path == DISPATCH + "advantage_function"
    actor_args = parse_megatron_role_args(args, str(path), role="actor")
    assert not actor_args.freeze_params_name_list
    freeze.check_freeze_config(actor_args, ["self_attention"])  # the actor sees it in the file
    caf.PATCH.remove()
    assert critic_args.custom_advantage_function_path is None


def packed_batch(data, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (t,), generator=g) for t in data["total_lengths"]]
    total = sum(data["total_lengths"])
    batch = dict(unconcat_tokens=tokens, total_lengths=data["total_lengths"],
                 response_lengths=data["response_lengths"], loss_masks=data["loss_masks"], rollout_mask_sums=None)
    return batch, total


def test_dis_loss_through_slimes_loss_function(mpu, args):
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, loss_function

    data = rollout_data(4)
    vocab = 11
    batch, total = packed_batch(data, vocab, 4)
    batch.update(rollout_log_probs=data["rollout_log_probs"],
                 advantages=[torch.randn(len(m)) for m in data["loss_masks"]])
    logits = torch.randn(1, total, vocab, requires_grad=True)
    loss, normalizer, log = loss_function(args, batch, num_microbatches=1, step_global_batch_size=5, logits=logits)

    _, out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"])
    mask = torch.cat(data["loss_masks"])
    ref, _ = sao_loss.dis_loss(torch.cat(out["log_probs"]), torch.cat(data["rollout_log_probs"]),
                               torch.cat(batch["advantages"]), mask, lambda x: (x * mask).sum(),
                               DIS_PRESETS["maths"])
    torch.testing.assert_close(loss, ref)  # per-token mode: token sum, slime divides by the token count
    assert int(normalizer) == int(mask.sum())
    assert "dis_masked_frac" in log["keys"]
    loss.backward()
    assert logits.grad is not None


def test_critic_value_loss_routed_through_our_dispatcher_equals_slimes(mpu, actor_module, args):
    from slime.backends.megatron_utils import loss as slime_loss

    data = rollout_data(5)
    batch, total = packed_batch(data, 3, 5)
    g = torch.Generator().manual_seed(0)
    batch.update(values=data["values"], returns=[v + torch.randn(len(v), generator=g) for v in data["values"]])
    logits = torch.randn(1, total, 1, generator=g)
    args.loss_type = "value_loss"
    theirs = slime_loss.loss_function(args, batch, 1, 5, logits)
    calls = []
    caf.PATCH.install(args)
    import slime_ascend.sao.loss as mod

    original = mod.value_loss

    def spy(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    mod.value_loss = spy
    try:
        with caf.critic_pass():
            ours = slime_loss.loss_function(args, batch, 1, 5, logits)
    finally:
        mod.value_loss = original
    assert calls, "the critic's value loss did not go through our dispatcher"
    torch.testing.assert_close(ours[0], theirs[0])
    assert ours[2]["keys"] == theirs[2]["keys"] == ["value_loss", "value_clipfrac"]
    torch.testing.assert_close(ours[2]["values"], theirs[2]["values"])


def test_freeze_on_a_real_megatron_model(mpu, tmp_path, args, monkeypatch):
    """slime's freeze rule with the generated critic config on a tiny Megatron GPTModel: attention gets no
    optimizer state and no update, everything else trains."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from slime.backends.megatron_utils.model_provider import freeze_model_params
    from slime.utils.arguments import parse_megatron_role_args

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    path = tmp_path / "sao_megatron.yaml"
    critic.write_megatron_role_config(str(path))
    args.untie_embeddings_and_output_weights = False
    critic_args = parse_megatron_role_args(args, str(path), role="critic")
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            use_cpu_initialization=True, qk_layernorm=True, normalization="RMSNorm",
                            attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True,
                                                                                  normalization="RMSNorm"),
                     vocab_size=64, max_sequence_length=16, pre_process=True, post_process=True)
    freeze_model_params(model, critic_args)
    names = [n for n, _ in model.named_parameters()]
    frozen = freeze.matching_names(names, ["self_attention"])
    assert any("linear_qkv" in n for n in frozen) and any("linear_proj" in n for n in frozen)
    assert any("q_layernorm" in n for n in frozen) and any("k_layernorm" in n for n in frozen)
    assert any("mlp.linear_fc1" in n for n in names if n not in frozen)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    freeze.verify_frozen(model, opt, ["self_attention"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, 64, (1, 16))
    pos = torch.arange(16)[None]
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    for _ in range(2):
        out = model(tokens, pos, attention_mask=causal)
        opt.zero_grad()
        out.float().pow(2).mean().backward()
        opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, before[n]) and p not in opt.state, n
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "mlp" in n)


@pytest.mark.slow
def test_generated_configs_configure_stock_slime(tmp_path):
    """`slime-ascend config sao` YAML + the role config + the printed flags through slime's parse_args."""
    import json
    import os
    import subprocess

    from transformers import Qwen3Config

    from conftest import REPO
    from slime_ascend import config

    Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                tie_word_embeddings=False).save_pretrained(tmp_path / "hf")
    (tmp_path / "sao.yaml").write_text(config.build(["sao"]).yaml_text)
    critic.write_megatron_role_config(str(tmp_path / "sao_megatron.yaml"), lr=5e-6)
    flags = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 2 --kv-channels 16 --qk-layernorm --seq-length 256 --max-position-embeddings 256 "
             "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear "
             "--untie-embeddings-and-output-weights --position-embedding-type rope --vocab-size 1024 "
             "--micro-batch-size 1 --rollout-batch-size 4 --global-batch-size 4 --actor-num-nodes 1 "
             "--actor-num-gpus-per-node 1 --num-rollout 2 --advantage-estimator ppo --n-samples-per-prompt 1 "
             "--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async").split()
    script = f"""
import sys, typing, typing_extensions, json
typing.override = getattr(typing, "override", typing_extensions.override)
sys.argv = ["train_async.py", "--hf-checkpoint", {str(tmp_path / 'hf')!r}, *{flags!r},
            "--megatron-config-path", {str(tmp_path / 'sao_megatron.yaml')!r},
            "--custom-config-path", {str(tmp_path / 'sao.yaml')!r}]
from slime.utils.arguments import parse_args, parse_megatron_role_args
from slime_ascend.plugins import runtime
args = parse_args()
actor = runtime.active(args).selection.names
critic = parse_megatron_role_args(args, args.megatron_config_path, "critic")
runtime.reset()
runtime.active(critic)
print("RESULT", json.dumps([list(actor), args.use_critic, args.calculate_per_token_loss, args.loss_type,
      args.custom_advantage_function_path, critic.freeze_params_name_list, critic.lr,
      critic.custom_advantage_function_path]))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", SLIME_ASCEND_PLUGINS="sao")
    import importlib.util

    slime_root = os.path.dirname(next(iter(importlib.util.find_spec("slime").submodule_search_locations)))
    env["PYTHONPATH"] = os.pathsep.join([slime_root, str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    assert json.loads(line.split(" ", 1)[1]) == [
        ["sao"], True, True, "custom_loss", DISPATCH + "advantage_function", ["self_attention"], 5e-6, None,
    ]  # the critic's path is None until the runtime installs train.critic_advantage_function in the critic
