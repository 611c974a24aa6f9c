"""``slime-ascend demo --model glm5 --slime-src DIR``: the demo's plugins, with ``dsa-determinism``, in slime's
own ``train_async.py`` on the tiny GLM-5 (MoE, MLA, DSA with IndexShare) built by slime's own spec
(``slime_plugins.models.glm5.glm5 get_glm5_spec``).

The command is run as a user runs it; the assertions read what it wrote (``summary.json``, ``metrics.jsonl``,
``command.txt``, ``ascend.yaml``), which the demo takes from slime's own logged metrics and log, and slime's log
itself for the model it built. The int8 weight sync serves the rollouts int8 weights while Megatron trains fp32
ones, so slime's train/rollout log-prob gate is not on here (``tests/e2e/test_slime_glm5_cpu.py`` holds the
same spec to it with an fp32 sync; here the logged gap was 0.050 and 0.23 in the two steps).

SAO's frozen critic is read from slime's saved critic checkpoint (the critic's own ``--save``, beside the actor's):
its MLA and DSA-indexer tensors are bit for bit what slime's converter loaded from the initial policy, its routed
and shared experts trained (:func:`saved_critic_froze_its_attention`; on the run before the critic had its own
directory, 38 frozen and 30 trained tensors, read from the checkpoint the critic had written over the actor's).

Every default plugin runs on GLM-5: the one that did not, SAO's frozen-critic check, read Megatron's
``ChainedOptimizer`` (an MoE model's dense and expert optimizers) through its ``optimizer`` property, which asserts
that it chains one (fixed in ``slime_ascend.sao.freeze``). One run of slime's loop, 2.5 min on the 2-core host
(the GLM-5 policy and teachers fine-tuned in about 70 s of it).

This is the demo's one run in slime's loop in the suite: the same command on the default tiny Qwen3 (its own
module until the eighteenth session, 1.8 min of CI) asserted a subset of what this run asserts (every plugin's
evidence, K critic passes, int8 versions served, a trained compaction segment, teacher switches, the verifier
gate's passes at parse_args, the curves and the echoed lines); the Qwen3 model itself runs in slime's loop in every
recipe of ``tests/examples/test_recipes_in_slime.py`` and the demo's default model, without slime, in CI's README
command 1 and ``tests/demo``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slime_ascend.demo.loop import default_plugins
from slime_ascend.demo.slime_job import job_env, slime_src

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(2400)]

STEPS = 2
GLM5_SPEC = ["slime_plugins.models.glm5.glm5", "get_glm5_spec"]


def saved_critic_froze_its_attention(critic_dir: Path, policy_hf: Path) -> dict[str, int]:
    """SAO's frozen critic, read from slime's own saved critic checkpoint (the critic's ``--save``): every tensor
    of its attention (MLA's down and up projections and latent norms, the output projection, the DSA indexer's
    ``wq_b`` / ``wk`` / ``k_norm`` / ``weights_proj`` where a layer has one) is bit for bit what slime's converter
    loaded from the initial policy (``deepseek_hf_tensor``: the indexer's RoPE halves reordered), while every
    routed expert of every MoE layer and each shared expert trained; the value head is slime's (one output).
    Returns the counts of frozen and trained tensors checked."""
    import torch
    from slime.backends.megatron_utils.hf_to_megatron.common import SafetensorReader
    from slime.backends.megatron_utils.hf_to_megatron.deepseek import deepseek_hf_tensor
    from transformers import AutoConfig

    from parallel_evidence import read_dist_checkpoint

    critic = read_dist_checkpoint(critic_dir)
    reader, config = SafetensorReader(policy_hf), AutoConfig.from_pretrained(str(policy_hf))
    assert critic["output_layer.weight"].shape == (1, config.hidden_size)  # the value head, not the LM head
    frozen = [k for k in critic if ".self_attention." in k]
    for name in frozen:
        want = deepseek_hf_tensor(name, reader, config).float()
        assert torch.equal(critic[name], want), f"the critic's {name} changed: SAO freezes its attention"
    assert {k.rsplit(".", 2)[-2] for k in frozen} >= {"linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj",
                                                     "linear_kv_up_proj", "linear_proj", "wq_b", "wk",
                                                     "weights_proj", "k_norm"}
    trained = 0
    for name, tensor in critic.items():
        match = re.fullmatch(r"(decoder\.layers\.\d+\.mlp)\.experts\.experts\.(linear_fc[12])\.weight", name)
        if match:
            for e in range(tensor.shape[0]):
                start = deepseek_hf_tensor(f"{match[1]}.experts.{match[2]}.weight{e}", reader, config).float()
                assert not torch.equal(tensor[e], start), f"the critic's expert {e} of {name} did not train"
                trained += 1
        elif ".mlp.shared_experts." in name:
            assert not torch.equal(tensor, deepseek_hf_tensor(name, reader, config).float()), name
            trained += 1
    assert trained >= 2 * config.n_routed_experts * (config.num_hidden_layers - config.first_k_dense_replace)
    return {"frozen": len(frozen), "trained": trained}


def test_demo_runs_its_plugins_on_slimes_glm5_spec(tmp_path):
    src = slime_src()
    out = tmp_path / "demo"
    env = job_env(())
    env.pop("SLIME_ASCEND_PLUGINS")
    proc = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "demo", "--model", "glm5", "--slime-src",
                           str(src), "--steps", str(STEPS), "--batch", "8", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=2300)
    assert (out / "summary.json").exists(), f"rc {proc.returncode}\n" + proc.stdout[-4000:] + proc.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    print(f"\ndemo --model glm5: rc {proc.returncode}, {summary.get('elapsed_s', 0) / 60:.2f} min")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert summary["loop"] == "slime" and summary["returncode"] == 0 and summary["model"] == "glm5"
    assert summary["plugins"] == ["cpu", *default_plugins("glm5"), "verifier-gate"]
    assert summary["steps_done"] == STEPS
    assert summary["plugins_without_evidence"] == [], summary["evidence"]

    # the model: slime's own glm5 spec (Megatron's argument dump), fp32, on the cpu plugin's host parts
    log = (out / "train_async.log").read_text(errors="replace")
    model = summary["model_evidence"]
    assert model["spec_in_log"] and model["logged_specs"] == [GLM5_SPEC]
    assert re.search(r"\bspec \.+ \['slime_plugins\.models\.glm5\.glm5', 'get_glm5_spec'\]\s*$", log, re.MULTILINE)
    assert re.search(r"\bbf16 \.+ False\s*$", log, re.MULTILINE)  # fp32 training (the YAML's bf16: false)
    assert yaml.safe_load((out / "ascend.yaml").read_text())["bf16"] is False
    assert {"train.glm5_host_spec", "train.glm5_thd_rope", "train.glm5_index_topk"} <= set(model["glm5_patches"])
    command = (out / "command.txt").read_text()
    assert "--multi-latent-attention" in command and "slime_ascend.cpu.spec" not in command

    # SAO's critic, from slime's own checkpoints: the critic saved in its own directory (not over the actor's:
    # the actor's holds the LM head), its MLA and indexer frozen, its experts trained
    from parallel_evidence import read_dist_checkpoint

    words = command.split()
    policy = Path(words[words.index("--load") + 1])
    actor = read_dist_checkpoint(out / "slime_ckpt")
    assert actor["output_layer.weight"].shape[0] > 1  # the policy's LM head, not the critic's value head
    counts = saved_critic_froze_its_attention(out / "slime_ckpt_critic", policy)
    print(f"saved critic: {counts['frozen']} attention tensors frozen, {counts['trained']} expert tensors trained")

    evidence = summary["evidence"]
    k = yaml.safe_load((out / "ascend.yaml").read_text())["ascend_sao_critic_iters"]
    # JSON keys are strings: rollout id -> critic updates slime logged for it
    assert evidence["sao"]["critic_passes_per_rollout"] == {str(i): k for i in range(STEPS)}
    assert any("(int8" in line for line in evidence["int8-sync"]["log"])  # the engine served int8 versions
    assert max(evidence["compaction"]["metrics"]["rollout/round_number"]) > 0  # later segments were trained
    assert sum(evidence["opd"]["metrics"]["rollout/opd_pool/switches"]) >= 1
    assert any(len(v) == STEPS for v in evidence["staleness"]["metrics"].values()), evidence["staleness"]
    # the train side's indexer selected with the deterministic top-k
    assert evidence["dsa-determinism"]["log"] == ["applied runtime patch train.dsa_deterministic_topk"]
    # the verifier gate ran in slime's processes at parse_args, over the verifiers the job trains with
    assert evidence["verifier-gate"]["log"] and all("passes oracle, no_action and unfinished" in line
                                                     for line in evidence["verifier-gate"]["log"]), evidence

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["reward"] is not None and "train/step" in r["slime"] for r in rows)
    assert all(r["slime"]["train/grad_norm"] > 0 for r in rows)
    assert (out / "curves.png").stat().st_size > 0
    assert sum(line.startswith("rollout ") for line in proc.stdout.splitlines()) == STEPS
