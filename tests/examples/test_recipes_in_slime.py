"""Every recipe in ``examples/`` runs in slime's real loop for one rollout on this CPU.

``bash run.sh`` as written, from a copy of the recipe's folder, with ``recipe_standin.py`` standing in
for the cluster (``ray`` on PATH), ``$SLIME_DIR/scripts/models`` (the tiny Qwen3) and ``$BASE`` (its
checkpoints and prompts): slime's own ``train.py``/``train_async.py`` runs the recipe's flags and YAML
with ``cpu,npu`` in place of ``npu`` and the torch engine in place of SGLang on NPU.

What the stand-in cannot give: the MoE recipe's experts (the cpu plugin refuses MoE layers; its tiny
stand-in model is dense, so that run checks the recipe's flags, YAML and script, not expert parallelism).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slime_ascend.demo.slime_job import TINY_QWEN3_ARGS, make_model, make_prompts, parse_rollout_metrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STANDIN = Path(__file__).resolve().parent / "recipe_standin.py"
RECIPES = sorted(p.parent.name for p in EXAMPLES.glob("*/run.sh"))
# a chat template for the tiny model (the recipes apply the model's chat template)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# what each recipe's own feature leaves in slime's logged metrics of rollout 0
EVIDENCE = {
    "glm4.5-air-opd-npu": ("rollout/opd_",),
    "qwen3-8b-compaction-npu": ("compaction",),
    "qwen3-8b-int8-sync-npu": ("perf/weight_sync_",),
    # skip-observation GAE's per-token lambdas, DIS's masked fraction, the critic's own steps
    "qwen3-8b-sao-npu": ("rollout/gae_lambdas", "train/dis_masked_frac", "train/critic-value_loss"),
}


def _model(path: Path, seed: int = 0) -> Path:
    make_model(path, seed=seed)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def standin_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("standin")
    tiny = _model(root / "tiny")
    teachers = root / "teachers"
    for i, name in enumerate(("math", "code"), start=1):
        _model(teachers / name, seed=i)
    shutil.copytree(tiny, teachers / "switch-engine-start")
    models = root / "slime" / "scripts" / "models"
    models.mkdir(parents=True)
    for script in ("qwen3-8B.sh", "glm4.5-106B-A12B.sh"):
        (models / script).write_text(f"MODEL_ARGS=(\n   {TINY_QWEN3_ARGS}\n)\n")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    ray = bin_dir / "ray"
    ray.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    ray.chmod(0o755)
    return root


def _base(root: Path, work: Path) -> Path:
    """``$BASE``: every checkpoint a recipe names is the tiny model (``_torch_dist`` too: slime loads an HF
    directory there); the prompts carry a label and a domain."""
    base = work / "base"
    base.mkdir()
    for name in ("Qwen3-8B", "GLM-4.5-Air"):
        (base / name).symlink_to(root / "tiny")
        (base / f"{name}_torch_dist").symlink_to(root / "tiny")
    (base / "teachers").symlink_to(root / "teachers")
    (base / "dapo-math-17k").mkdir()
    make_prompts(base / "dapo-math-17k" / "dapo-math-17k.jsonl", domains=("math", "code"))
    return base


def _run_recipe(name: str, root: Path, work: Path, extra_env: dict[str, str] | None = None):
    recipe = work / name
    shutil.copytree(EXAMPLES / name, recipe)
    env = {k: v for k, v in os.environ.items() if k != "SLIME_ASCEND_PLUGINS"}
    env.update({"SLIME_DIR": str(root / "slime"), "BASE": str(_base(root, work)), "NUM_NPUS": "2",
                "STANDIN_WORK": str(work), "PATH": f"{root / 'bin'}{os.pathsep}{env['PATH']}",
                **(extra_env or {})})
    done = subprocess.run(["bash", str(recipe / "run.sh")], env=env, cwd=str(work), capture_output=True, text=True,
                          timeout=1200)
    (work / "run.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    return recipe, done


@pytest.mark.slime
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_one_rollout_in_slimes_loop(name, standin_root, tmp_path):
    recipe, done = _run_recipe(name, standin_root, tmp_path)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-8000:]
    plugins = yaml.safe_load((EXAMPLES / name / "ascend.yaml").read_text())["ascend_plugins"]
    active = ", ".join(["cpu", "npu"] + [p for p in plugins if p not in ("npu", "sglang-npu")])
    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and f"slime-ascend plugins active: {active}" in line for line in log.splitlines()), \
            (role, active)
    by_rollout = parse_rollout_metrics(log)
    assert 0 in by_rollout and any(k.startswith("train/") for k in by_rollout[0]), by_rollout  # a train step ran
    for evidence in EVIDENCE.get(name, ()):
        assert any(evidence in k for k in by_rollout[0]), (evidence, sorted(by_rollout[0]))
    if name == "qwen3-8b-int8-sync-npu":  # the recipe's own first step made the engines' W8A8 checkpoint
        assert (tmp_path / "base" / "Qwen3-8B-w8a8" / "config.json").is_file()
    if name == "qwen3-8b-sao-npu":  # ... and the critic role file, beside its YAML; K critic updates a step
        assert (recipe / "sao_megatron.yaml").is_file()
        iters = yaml.safe_load((EXAMPLES / name / "ascend.yaml").read_text())["ascend_sao_critic_iters"]
        assert log.count("critic-step 0: {") == iters, log.count("critic-step 0: {")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_refuses_to_stop_a_running_ray_cluster(name, standin_root, tmp_path):
    """A Ray cluster already on the node may hold other jobs: the recipe stops with a Fix, before any work."""
    recipe, done = _run_recipe(name, standin_root, tmp_path, {"STANDIN_RAY_RUNNING": "1"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "a Ray cluster is already running" in done.stderr and "Fix:" in done.stderr
    assert "stand-in: ray" not in done.stdout  # neither stopped nor started
