"""Our YAML and dispatchers through slime's own code: its argument flow and its contract tests."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slime


def slime_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("slime")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("SLIME_ASCEND_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(slime_root()), str(REPO), env.get("PYTHONPATH", "")])
    return env


TINY_FLAGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --kv-channels 16 --qk-layernorm --seq-length 256 --max-position-embeddings 256 "
    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type rope --vocab-size 1024 --micro-batch-size 1 "
    "--rollout-batch-size 4 --n-samples-per-prompt 1 --global-batch-size 4 --actor-num-nodes 1 "
    "--actor-num-gpus-per-node 1 --colocate --num-rollout 2"
).split()


@pytest.mark.slow
def test_generated_yaml_through_slime_parse_args(tmp_path):
    from transformers import Qwen3Config

    from slime_ascend import config

    Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                tie_word_embeddings=False).save_pretrained(tmp_path / "hf")
    generated = config.build(["npu", "tito"])  # tito contributes to slime's megatron-init hook
    (tmp_path / "ascend.yaml").write_text(generated.yaml_text)
    # npu refuses --colocate without --release-train (torch_memory_saver's NPU build cannot offload the train actors)
    flags = [f for f in TINY_FLAGS if f != "--colocate"] + ["--rollout-num-gpus", "1"]
    script = textwrap.dedent(f"""
        import sys, typing, typing_extensions, json
        typing.override = getattr(typing, "override", typing_extensions.override)
        sys.argv = ["train.py", "--hf-checkpoint", {str(tmp_path / 'hf')!r}, *{flags!r},
                    "--custom-config-path", {str(tmp_path / 'ascend.yaml')!r}]
        from slime.utils.arguments import parse_args
        args = parse_args()
        from slime_ascend.plugins import runtime
        state = runtime.active(args)
        print("RESULT", json.dumps([args.ascend_plugins, args.custom_megatron_init_path, list(state.selection.names)]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    import json

    plugins, init_path, active = json.loads(line.split(" ", 1)[1])
    assert plugins == ["npu", "tito"] and active == ["npu", "tito"]
    assert init_path == "slime_ascend.hooks.megatron_init"


def test_slime_runtime_hook_contract_for_reward_post_process():
    root = slime_root()
    proc = subprocess.run(
        [sys.executable, "tests/plugin_contracts/test_plugin_runtime_hook_contracts.py",
         "--custom-reward-post-process-path", "slime_ascend.hooks.reward_post_process",
         "-q", "-p", "no:cacheprovider", "-k", "reward_post_process"],
        capture_output=True, text=True, env=_env(), cwd=root, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


def test_reward_post_process_equals_slime_default_for_one_sample_rollouts():
    """Our normalisation (rollouts counted once) equals slime's default when each rollout is one sample."""
    import argparse

    import torch
    from slime.ray.rollout import RolloutManager
    from slime.utils.types import Sample

    from slime_ascend import hooks

    gen = torch.Generator().manual_seed(0)
    for estimator, std in [("grpo", True), ("grpo", False), ("reinforce_plus_plus_baseline", False)]:
        args = argparse.Namespace(advantage_estimator=estimator, rewards_normalization=True, grpo_std_normalization=std,
                                  n_samples_per_prompt=4, rollout_batch_size=3, reward_key=None, ascend_plugins=[],
                                  custom_reward_post_process_path=None)
        samples = []
        for g in range(3):
            for k in range(4):
                s = Sample(index=g * 4 + k, group_index=g, reward=float(torch.rand(1, generator=gen)))
                samples.append(s)
        stub = type("RM", (), {"args": args, "custom_reward_post_process_func": None})()
        expected = getattr(RolloutManager, '__ray_actor_class__', RolloutManager)._post_process_rewards(stub, samples)
        ours = hooks.reward_post_process(args, samples)
        assert ours[0] == expected[0]
        assert ours[1] == expected[1], estimator
