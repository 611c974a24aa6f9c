"""Every recipe in ``examples/`` passes ``slime-ascend dryrun`` as its ``run.sh`` submits it (the OPD recipe but for
the teachers' engines it says to start first, which the dry run names): slime's own
``parse_args`` on the recipe's real command line (slime's ``scripts/models`` for Qwen3-8B and GLM-4.5-Air, the
recipe's YAML, its ``--runtime-env-json``), the plugins' checks and the placement on the cluster the recipe is
written for (8 NPUs per node). ``bash run.sh`` runs as written, with a ``ray`` on PATH that answers ``status`` with
"no cluster", does nothing for ``start``, and hands ``job submit ...`` to the dry run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need, slime_src

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(p.parent.name for p in EXAMPLES.glob("*/run.sh"))

# the fields of each model's config.json that slime's parse_args compares with the model script's flags
QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36,
            "intermediate_size": 12288, "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 1000000}
GLM45_AIR = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 4096,
             "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 46,
             "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128,
             "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "vocab_size": 151552,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 1000000, "partial_rotary_factor": 0.5}


# the weight-sync recipes: the engines' checkpoint under $BASE (its first step makes it) and its format
SYNC_CHECKPOINTS = {"qwen3-8b-int8-sync-npu": ("Qwen3-8B-w8a8", "int8-w8a8"),
                    "qwen3-8b-fp8-sync-npu": ("Qwen3-8B-fp8", "fp8-block"),
                    "qwen3-8b-int4-sync-npu": ("Qwen3-8B-int4", "int4-group"),
                    "qwen3-8b-mxfp8-sync-npu": ("Qwen3-8B-mxfp8", "mxfp8")}
HF_CONFIG = {"glm4.5-air-moe-npu": "glm4.5-air", "glm4.5-air-opd-npu": "glm4.5-air",
             **{name: f"qwen3-8b-{fmt}" for name, (_, fmt) in SYNC_CHECKPOINTS.items()}}


def _quantised_config(root: Path, fmt: str) -> None:
    """``root``: Qwen3-8B's config.json as `slime-ascend quantize --format fmt` writes it (``quantization_config``,
    or msModelSlim's description for the Ascend formats): what each sync plugin's start-up check reads."""
    import json

    from slime_ascend.quant import hf_config

    cfg = dict(QWEN3_8B)
    if fmt in hf_config.ASCEND_QUANT_TYPES:
        kind = hf_config.ASCEND_QUANT_TYPES[fmt]
        (root / hf_config.ASCEND_DESCRIPTION_FILE).write_text(
            json.dumps(hf_config.ascend_quant_description({"model.layers.0.mlp.down_proj.weight": kind}, kind)))
    else:
        cfg["quantization_config"] = {"fp8-block": hf_config.fp8_block_quantization_config,
                                      "int4-group": hf_config.ct_int4_quantization_config}[fmt]()
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``ray`` on PATH handing the submitted job to the dry run; the two models' config.json."""
    import json

    need("slime.utils.arguments")
    root = tmp_path_factory.mktemp("dryrun-cluster")
    for name, cfg in (("qwen3-8b", QWEN3_8B), ("glm4.5-air", GLM45_AIR)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    # the weight-sync recipes' engines serve the checkpoint `slime-ascend quantize --format F` writes
    for _, fmt in SYNC_CHECKPOINTS.values():
        (root / f"qwen3-8b-{fmt}").mkdir()
        _quantised_config(root / f"qwen3-8b-{fmt}", fmt)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    ray = bin_dir / "ray"
    ray.write_text("#!/bin/sh\ncase \"$1\" in\n  status) exit 1;;\n  start|stop) exit 0;;\n"
                   f"  job) exec {sys.executable} -m slime_ascend.cli dryrun --hf-config \"$DRYRUN_HF_CONFIG\" -- "
                   "ray \"$@\";;\nesac\nexit 2\n")
    ray.chmod(0o755)
    return root


def _path(cluster: Path) -> str:
    """The stand-in ``ray`` first, then this interpreter's folder (the recipes' ``python -m`` / ``slime-ascend``
    steps), then the rest."""
    return os.pathsep.join([str(cluster / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]])


def _base(tmp_path: Path) -> Path:
    """``$BASE`` with what slime's parse_args finds on the cluster: the ``--ref-load`` directories, and the sync
    recipes' converted checkpoints (made once before, by their first step)."""
    base = tmp_path / "base"
    for name in ("Qwen3-8B_torch_dist", "GLM-4.5-Air_torch_dist"):
        (base / name).mkdir(parents=True)
    for checkpoint, _ in SYNC_CHECKPOINTS.values():
        (base / checkpoint).mkdir(parents=True)
        (base / checkpoint / "config.json").write_text("{}")
    return base


def test_every_weight_sync_recipe_has_its_engines_checkpoint():
    """The dry run stands in the converted checkpoint each sync recipe names (its --hf-checkpoint, in its plugin's
    format): a new sync recipe must be listed in SYNC_CHECKPOINTS."""
    import re

    from slime_ascend.weight_sync.funnel import PLUGIN_FORMATS

    for name in RECIPES:
        script = (EXAMPLES / name / "run.sh").read_text()
        sync = [p for p in PLUGIN_FORMATS if re.search(rf"^export SLIME_ASCEND_PLUGINS=\S*\b{p}\b", script, re.M)]
        if not sync:
            assert name not in SYNC_CHECKPOINTS
            continue
        checkpoint, fmt = SYNC_CHECKPOINTS[name]
        assert f"--hf-checkpoint ${{BASE}}/{checkpoint}\n" in script and fmt == PLUGIN_FORMATS[sync[0]][0], name


@pytest.mark.slime
@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_passes_the_dry_run(name, cluster, tmp_path):
    recipe = tmp_path / name
    shutil.copytree(EXAMPLES / name, recipe)
    base = _base(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_ASCEND_PLUGINS", "PYTORCH_ALLOC_CONF")}
    env.update({"SLIME_DIR": str(slime_src()), "BASE": str(base), "PATH": _path(cluster),
                "DRYRUN_HF_CONFIG": str(cluster / HF_CONFIG.get(name, "qwen3-8b"))})
    done = subprocess.run(["bash", str(recipe / "run.sh")], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=900, check=False)
    if name == "glm4.5-air-opd-npu":  # the recipe says to start the teachers' engines first: none runs here
        lines = done.stdout.splitlines()
        assert done.returncode == 1 and len(lines) == 1, (done.stdout[-3000:], done.stderr[-3000:])
        assert lines[0].startswith("opd teacher 'math': http://127.0.0.1:30010 did not answer /model_info")
        return
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    report = [line for line in done.stdout.splitlines() if line.startswith("ok: ")]
    assert len(report) == 1, done.stdout[-3000:]
    want = {"glm4.5-air-moe-npu": 16, "glm4.5-air-opd-npu": 16, "qwen3-8b-sao-npu": 8}.get(name, 8)
    assert f"it asks Ray for {want} NPUs" in report[0]


@pytest.mark.slime
@pytest.mark.slow
def test_the_dry_run_catches_a_recipe_without_release_train(cluster, tmp_path):
    """The same launch with the recipe's --release-train removed: the one line the npu plugin refuses it with."""
    name = "qwen3-8b-grpo-npu"
    recipe = tmp_path / name
    shutil.copytree(EXAMPLES / name, recipe)
    script = (recipe / "run.sh").read_text()
    assert "   --release-train  # [ascend:npu]" in script
    (recipe / "run.sh").write_text(script.replace("   --release-train  # [ascend:npu]", "   # [ascend:npu]"))
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_ASCEND_PLUGINS", "PYTORCH_ALLOC_CONF")}
    env.update({"SLIME_DIR": str(slime_src()), "BASE": str(_base(tmp_path)), "DRYRUN_HF_CONFIG": str(cluster / "qwen3-8b"),
                "PATH": _path(cluster)})
    done = subprocess.run(["bash", str(recipe / "run.sh")], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=900, check=False)
    lines = done.stdout.splitlines()
    assert done.returncode == 1 and len(lines) == 1, (done.stdout[-3000:], done.stderr[-3000:])
    assert lines[0].startswith("npu: --colocate without --release-train")
