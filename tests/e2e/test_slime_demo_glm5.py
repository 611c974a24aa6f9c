"""``slime-ascend demo --model glm5 --slime-src DIR``: the demo's plugins, with ``dsa-determinism``, in slime's
own ``train_async.py`` on the tiny GLM-5 (MoE, MLA, DSA with IndexShare) built by slime's own spec
(``slime_plugins.models.glm5.glm5 get_glm5_spec``).

The command is run as a user runs it; the assertions read what it wrote (``summary.json``, ``metrics.jsonl``,
``command.txt``, ``ascend.yaml``), which the demo takes from slime's own logged metrics and log, and slime's log
itself for the model it built. The int8 weight sync serves the rollouts int8 weights while Megatron trains fp32
ones, so slime's train/rollout log-prob gate is not on here (``tests/e2e/test_slime_glm5_cpu.py`` holds the
same spec to it with an fp32 sync; here the logged gap was 0.050 and 0.23 in the two steps).

Every default plugin runs on GLM-5: the one that did not, SAO's frozen-critic check, read Megatron's
``ChainedOptimizer`` (an MoE model's dense and expert optimizers) through its ``optimizer`` property, which asserts
that it chains one (fixed in ``slime_ascend.sao.freeze``). One run of slime's loop, 2.5 min on the 2-core host
(the GLM-5 policy and teachers fine-tuned in about 70 s of it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from slime_ascend.demo.loop import default_plugins
from slime_ascend.demo.slime_job import job_env, slime_src

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 2
GLM5_SPEC = ["slime_plugins.models.glm5.glm5", "get_glm5_spec"]


def test_demo_runs_its_plugins_on_slimes_glm5_spec(tmp_path):
    src = slime_src()
    out = tmp_path / "demo"
    env = job_env(())
    env.pop("SLIME_ASCEND_PLUGINS")
    proc = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "demo", "--model", "glm5", "--slime-src",
                           str(src), "--steps", str(STEPS), "--batch", "8", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=2300)
    summary = json.loads((out / "summary.json").read_text())
    print(f"\ndemo --model glm5: rc {proc.returncode}, {summary.get('elapsed_s', 0) / 60:.2f} min")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert summary["loop"] == "slime" and summary["returncode"] == 0 and summary["model"] == "glm5"
    assert summary["plugins"] == ["cpu", *default_plugins("glm5")]
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

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["reward"] is not None and "train/step" in r["slime"] for r in rows)
    assert all(r["slime"]["train/grad_norm"] > 0 for r in rows)
    assert (out / "curves.png").stat().st_size > 0
    assert sum(line.startswith("rollout ") for line in proc.stdout.splitlines()) == STEPS
