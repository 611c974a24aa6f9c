"""Every recipe in ``examples/`` runs in slime's real loop for one rollout on this CPU, as written but for the
rewrites listed below.

``bash run.sh`` from a copy of the recipe's folder, with ``recipe_standin.py`` standing in for the cluster
(``ray`` on PATH), ``$SLIME_DIR/scripts/models`` and ``$BASE``: slime's own ``train.py``/``train_async.py``
runs the recipe's flags and YAML. What the recipes have runs as they have it: ``--colocate`` (train actors and
the engine share the host's bundles; slime's offload/onload of the engine; weights over slime's
``update_weights_from_tensor``), engines slime starts itself (its ``SGLangEngine`` actors, no
``--rollout-external``), the recipe's own weight transport (slime's default: ``update_weights_from_tensor`` when
colocated, ``update_weights_from_distributed`` over gloo otherwise; no recipe names one), ``--sequence-parallel``
at TP 2, and the MoE recipes' expert parallelism (EP 2, expert TP 1) on a tiny MoE model.

Inputs (the recipes read them; nothing of the recipe changes): ``NUM_NPUS=2`` (the devices of one node);
``INT4_GROUP_SIZE=32`` (the INT4 recipe's converter step: 128, its default, does not divide the tiny model's 64
inputs of a linear; the sync takes the group size from that checkpoint);
``$SLIME_DIR/scripts/models/qwen3-8B.sh`` is the tiny Qwen3 (``TINY_QWEN3_ARGS``) and ``glm4.5-106B-A12B.sh`` the
tiny Qwen3-MoE (``TINY_QWEN3_MOE_ARGS``: 4 experts, top 2, layer 0 dense; the MoE stand-in of GLM-4.5-Air, made
as ``test_slime_moe_cpu``'s); every checkpoint under ``$BASE`` is the matching tiny model (``_torch_dist`` too:
slime loads an HF directory there), the OPD teachers tiny dense models, the prompts a few with a label and a domain.

The rewrites, each with its reason; the test asserts that slime's command line differs from the recipe's in
exactly these flags (:data:`FLAG_REWRITES`), its YAML in exactly these keys (:func:`expected_yaml_changes`), its
plugins in exactly these (:data:`recipe_standin.PLUGIN_STANDINS`):

* every recipe, the sizes of one small rollout on 2 cores: ``--num-rollout`` 1, ``--rollout-batch-size`` 2,
  ``--n-samples-per-prompt`` at most 2, ``--rollout-max-response-len`` 8, ``--global-batch-size`` their product
  (one train step);
* every recipe, ``--custom-config-path``: the stand-in YAML (the recipe's, rewritten as below);
* every recipe, added: the cpu plugin's Megatron flags (``slime-ascend config cpu --flags``: Megatron's local
  transformer with the cpu plugin's layer spec, CPU initialisation, no fused CUDA kernels);
* the GLM-4.5-Air recipes (MoE, OPD), the one host: ``--actor-num-nodes`` 2 -> 1,
  ``--tensor-model-parallel-size`` 4 -> 2 and ``--expert-model-parallel-size`` 8 -> 2 (two ranks: TP 2 with the
  recipe's ``--sequence-parallel``, EP 2 folded onto the same two ranks, expert TP 1 as written; the tiny MoE's 4
  experts split 2 per rank), ``--rollout-num-gpus-per-engine`` 8 -> 2 (the engine spans the two colocated
  devices);
* the SAO recipe (``train_async.py``, not colocated: ``NUM_NPUS / 2`` devices each for the actor, the critic and
  the engine, so 1 each): ``--tensor-model-parallel-size`` 2 -> 1 (TP 2 would be four train ranks, actor and
  critic, beside the engine on 2 cores; Megatron then turns ``--sequence-parallel`` off itself, "Disabling
  sequence parallelism"), ``--rollout-num-gpus-per-engine`` 2 -> 1 (the engine's one device);
* plugins: ``npu`` runs as ``cpu,npu`` (the npu plugin's own code with the cpu accelerator's device operations),
  ``sglang-npu`` as ``torch-engine`` (slime's engine actors start the torch engine in place of SGLang's server);
  the YAML's ``ascend_plugins`` says so, sglang-npu's settings go and cpu's (``offload_train: false``:
  torch_memory_saver is CUDA-only, the host has no device memory to give back) and torch-engine's (defaults)
  come in;
* the OPD recipe's YAML: each teacher's ``checkpoint_dir`` and ``url`` and the ``ascend_opd_switch_engine_urls``
  are the tiny teachers' torch engines the stand-in starts (the recipe says to start them first);
* the job's environment (not the recipe's flags or YAML): ``SLIME_ASCEND_PLUGINS`` as above; the runtime env's
  ``PYTHONPATH`` (``/root/Megatron-LM/``) gives way to slime's tree and this package; Ray advertises ``NPU``
  (``RAY_OVERRIDE_RESOURCES``), as it does by itself on an Ascend host (``slime_job.job_env``).

Each run is checked from slime's own output: the plugins active in the train actor and the RolloutManager, a
train step, each recipe's feature evidence (:data:`EVIDENCE`), one engine slime started, the weight versions
pushed over the transport slime picked (versions 1 and 2: before training and after the step), the colocated
engine's memory released and resumed, and the layout Megatron built (its argument dump) with that many train
ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slime_ascend.demo.slime_job import (
    TINY_QWEN3_ARGS,
    TINY_QWEN3_MOE_ARGS,
    make_model,
    make_prompts,
    parse_rollout_metrics,
    plugin_flags,
    ray_start_timed_out,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STANDIN = Path(__file__).resolve().parent / "recipe_standin.py"
RECIPES = sorted(p.parent.name for p in EXAMPLES.glob("*/run.sh"))
GLM = ("glm4.5-air-moe-npu", "glm4.5-air-opd-npu")
# the weight-sync recipes: the checkpoint their first step converts (the engines serve it) and its format
SYNC_CHECKPOINTS = {"qwen3-8b-int8-sync-npu": ("Qwen3-8B-w8a8", "int8-w8a8"),
                    "qwen3-8b-fp8-sync-npu": ("Qwen3-8B-fp8", "fp8-block"),
                    "qwen3-8b-int4-sync-npu": ("Qwen3-8B-int4", "int4-group"),
                    "qwen3-8b-mxfp8-sync-npu": ("Qwen3-8B-mxfp8", "mxfp8")}
COLOCATED = ("glm4.5-air-moe-npu", "glm4.5-air-opd-npu", "qwen3-8b-compaction-npu", "qwen3-8b-grpo-npu",
             *SYNC_CHECKPOINTS)
# a chat template for the tiny model (the recipes apply the model's chat template)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# what each recipe's own feature leaves in slime's logged metrics of rollout 0
EVIDENCE = {
    "glm4.5-air-opd-npu": ("rollout/opd_",),
    "qwen3-8b-compaction-npu": ("compaction",),
    # skip-observation GAE's per-token lambdas, DIS's masked fraction, the critic's own steps
    "qwen3-8b-sao-npu": ("rollout/gae_lambdas", "train/dis_masked_frac", "train/critic-value_loss"),
}

# slime's flags against the recipe's: flag -> (the recipe's value, slime's); None = absent (module docstring)
_SIZES = {"--num-rollout": ("3000", "1"), "--rollout-batch-size": ("32", "2"),
          "--n-samples-per-prompt": ("8", "2"), "--rollout-max-response-len": ("8192", "8"),
          "--global-batch-size": ("256", "4")}
_GLM_HOST = {"--actor-num-nodes": ("2", "1"), "--tensor-model-parallel-size": ("4", "2"),
             "--expert-model-parallel-size": ("8", "2"), "--rollout-num-gpus-per-engine": ("8", "2")}
FLAG_REWRITES = {
    **{name: {**_SIZES, **(_GLM_HOST if name in GLM else {})} for name in COLOCATED},
    "qwen3-8b-sao-npu": {**{k: v for k, v in _SIZES.items() if k != "--n-samples-per-prompt"},  # 1 as written
                         "--global-batch-size": ("32", "2"), "--tensor-model-parallel-size": ("2", "1"),
                         "--rollout-num-gpus-per-engine": ("2", "1")},
}
# the layout Megatron built (its argument dump) and the train ranks slime started (actor, critic)
LAYOUTS = {
    **{name: ({"tensor_model_parallel_size": "2", "sequence_parallel": "True", "expert_model_parallel_size": "1"},
              2, 0) for name in COLOCATED if name not in GLM},
    **{name: ({"tensor_model_parallel_size": "2", "sequence_parallel": "True", "expert_model_parallel_size": "2",
               "expert_tensor_parallel_size": "1", "num_experts": "4"}, 2, 0) for name in GLM},
    "qwen3-8b-sao-npu": ({"tensor_model_parallel_size": "1", "sequence_parallel": "False"}, 1, 1),
}
SLIME_MANAGED = "torch-engine: slime-managed engine starting on "


def _model(path: Path, seed: int = 0, moe: bool = False) -> Path:
    make_model(path, seed=seed, moe=moe)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def standin_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("standin")
    tiny = _model(root / "tiny")
    _model(root / "tiny-moe", moe=True)
    teachers = root / "teachers"
    for i, name in enumerate(("math", "code"), start=1):
        _model(teachers / name, seed=i)
    shutil.copytree(tiny, teachers / "switch-engine-start")
    models = root / "slime" / "scripts" / "models"
    models.mkdir(parents=True)
    for script, args in (("qwen3-8B.sh", TINY_QWEN3_ARGS), ("glm4.5-106B-A12B.sh", TINY_QWEN3_MOE_ARGS)):
        (models / script).write_text(f"MODEL_ARGS=(\n   {args}\n)\n")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    ray = bin_dir / "ray"
    ray.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    ray.chmod(0o755)
    return root


def _base(root: Path, work: Path) -> Path:
    """``$BASE``: every checkpoint a recipe names is the tiny model of its family (``_torch_dist`` too: slime
    loads an HF directory there); the prompts carry a label and a domain."""
    base = work / "base"
    base.mkdir()
    for name, model in (("Qwen3-8B", "tiny"), ("GLM-4.5-Air", "tiny-moe")):
        (base / name).symlink_to(root / model)
        (base / f"{name}_torch_dist").symlink_to(root / model)
    (base / "teachers").symlink_to(root / "teachers")
    (base / "dapo-math-17k").mkdir()
    make_prompts(base / "dapo-math-17k" / "dapo-math-17k.jsonl", domains=("math", "code"))
    return base


def _run_recipe(name: str, root: Path, work: Path, extra_env: dict[str, str] | None = None):
    recipe = work / name
    shutil.copytree(EXAMPLES / name, recipe)
    env = {k: v for k, v in os.environ.items() if k != "SLIME_ASCEND_PLUGINS"}
    env.update({"SLIME_DIR": str(root / "slime"), "BASE": str(_base(root, work)), "NUM_NPUS": "2",
                "INT4_GROUP_SIZE": "32",
                "STANDIN_WORK": str(work),
                # the recipe calls slime-ascend and python: this interpreter's (its venv need not be activated)
                "PATH": os.pathsep.join([str(root / "bin"), str(Path(sys.executable).parent), env["PATH"]]),
                **(extra_env or {})})
    done = subprocess.run(["bash", str(recipe / "run.sh")], env=env, cwd=str(work), capture_output=True, text=True,
                          timeout=1200, check=False)
    (work / "run.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    return recipe, done


def _flag_values(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """``--flag [value ...]`` words as flag -> values (a flag once: a repeated one would hide a rewrite)."""
    out: dict[str, tuple[str, ...]] = {}
    flag = None
    for word in argv:
        if word.startswith("--"):
            assert word not in out, f"{word} twice on the command line"
            flag, out[word] = word, ()
        else:
            assert flag is not None, f"{word!r} before any flag"
            out[flag] += (word,)
    return out


def flag_changes(recipe_argv: list[str], slime_argv: list[str]) -> dict[str, tuple]:
    """Every flag whose value differs between the recipe's command line and slime's: flag -> (recipe's, slime's),
    a value a string (one word), a tuple (several), ``()`` (a switch) or None (absent)."""
    def value(words):
        return words[0] if len(words) == 1 else words

    before, after = _flag_values(recipe_argv), _flag_values(slime_argv)
    out = {}
    for flag in sorted(before.keys() | after.keys()):
        b = value(before[flag]) if flag in before else None
        a = value(after[flag]) if flag in after else None
        if b != a:
            out[flag] = (b, a)
    return out


def expected_flag_changes(name: str, work: Path) -> dict[str, tuple]:
    out = {**FLAG_REWRITES[name]}
    recipe_config = str(work / name / "ascend.yaml")
    out["--custom-config-path"] = (recipe_config, str(work / "ascend.standin.yaml"))
    for flag, words in _flag_values(plugin_flags(("cpu",))).items():
        out[flag] = (None, words[0] if len(words) == 1 else words)
    return out


def _settings_keys(*plugins: str) -> set[str]:
    from slime_ascend import config

    keys = set(yaml.safe_load(config.build(list(plugins)).yaml_text))
    return keys - {"ascend_plugins"}


def expected_yaml_changes(recipe_yaml: dict) -> set[str]:
    """The keys the stand-in's YAML differs in: ``ascend_plugins``, sglang-npu's settings (gone), cpu's and
    torch-engine's (added), and the OPD recipe's teacher engines."""
    # npu's own keys stay (npu still runs; offload_train: false is cpu's value too)
    npu_keys = _settings_keys("npu")
    keys = {"ascend_plugins"} | ((_settings_keys("sglang-npu") | _settings_keys("cpu")) - npu_keys) | \
        _settings_keys("torch-engine")
    if "opd" in recipe_yaml["ascend_plugins"]:
        keys |= {"ascend_opd_teachers", "ascend_opd_switch_engine_urls"}
    return keys


def _megatron_args(log: str, name: str) -> set[str]:
    """``name``'s values in Megatron's argument dumps (``_print_args``: the name, dots, the value)."""
    found = set(re.findall(rf"\b{name} \.+ (\S+)$", log, re.MULTILINE))
    assert found, f"{name} not in Megatron's argument dump"
    return found


def test_the_rewrites_of_the_docstring_are_the_ones_checked():
    """Every flag the test lets differ is named, with its reason, in the module docstring."""
    for name, rewrites in FLAG_REWRITES.items():
        assert name in RECIPES, name
        for flag in rewrites:
            assert f"``{flag}``" in __doc__, (name, flag)
    assert set(FLAG_REWRITES) == set(RECIPES) == set(LAYOUTS)
    # a weight-sync recipe is one of SYNC_CHECKPOINTS (its engines' checkpoint and format are checked)
    synced = {n for n in RECIPES if re.search(r"^export SLIME_ASCEND_PLUGINS=\S*-sync\b",
                                              (EXAMPLES / n / "run.sh").read_text(), re.M)}
    assert synced == set(SYNC_CHECKPOINTS), synced ^ set(SYNC_CHECKPOINTS)
    assert "``INT4_GROUP_SIZE=32``" in __doc__
    assert "``slime-ascend config cpu --flags``" in __doc__ and "``--custom-config-path``" in __doc__


@pytest.mark.slime
@pytest.mark.slow
@pytest.mark.slime_loop
@pytest.mark.slime_managed_engines
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_one_rollout_in_slimes_loop(name, standin_root, tmp_path):
    recipe, done = _run_recipe(name, standin_root, tmp_path)
    log = done.stdout + done.stderr
    if done.returncode != 0 and ray_start_timed_out(log):
        # Ray's raylet has a fixed 30 s to register on the job's first Ray call; on a loaded 2-core host it can miss
        # it before anything of slime's job ran (as slime_job.run_slime does: the recipe once more, from scratch)
        print(f"{name}: Ray's local cluster did not start within its fixed 30 s (a loaded host); running it again")
        tmp_path = tmp_path / "again"
        tmp_path.mkdir()
        recipe, done = _run_recipe(name, standin_root, tmp_path)
        log = done.stdout + done.stderr
    assert done.returncode == 0, log[-8000:]
    check_recipe_run(name, recipe, tmp_path, log)


def check_recipe_run(name: str, recipe: Path, tmp_path: Path, log: str) -> None:
    """What one recipe's run left: the stand-in's record, the YAML it wrote and slime's log."""
    recipe_yaml = yaml.safe_load((EXAMPLES / name / "ascend.yaml").read_text())
    plugins = recipe_yaml["ascend_plugins"]

    # the rewrites: exactly the module docstring's
    standin = json.loads((tmp_path / "standin.json").read_text())
    assert standin["recipe_plugins"] == plugins
    want_plugins = ["cpu", "npu", "torch-engine"] + [p for p in plugins if p not in ("npu", "sglang-npu")]
    assert standin["plugins"] == want_plugins, standin["plugins"]
    assert flag_changes(standin["recipe_flags"], standin["flags"]) == expected_flag_changes(name, tmp_path)
    standin_yaml = yaml.safe_load((tmp_path / "ascend.standin.yaml").read_text())
    changed = {k for k in recipe_yaml.keys() | standin_yaml.keys() if recipe_yaml.get(k, KeyError) !=
               standin_yaml.get(k, KeyError)}
    assert changed == expected_yaml_changes(recipe_yaml), sorted(changed ^ expected_yaml_changes(recipe_yaml))
    assert standin_yaml["ascend_plugins"] == want_plugins

    # the plugins ran in slime's processes, and a train step ran
    active = ", ".join(want_plugins)
    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and f"slime-ascend plugins active: {active}" in line for line in log.splitlines()), \
            (role, active)
    by_rollout = parse_rollout_metrics(log)
    assert 0 in by_rollout and any(k.startswith("train/") for k in by_rollout[0]), by_rollout
    for evidence in EVIDENCE.get(name, ()):
        assert any(evidence in k for k in by_rollout[0]), (evidence, sorted(by_rollout[0]))

    # slime started the one engine itself and pushed versions 1 (before training) and 2 (after the step) over the
    # transport the recipe gives it (a disk version is a whole checkpoint: the engine validates it before switching)
    assert log.count(SLIME_MANAGED) == 1, log.count(SLIME_MANAGED)
    flags = dict(zip(standin["flags"], standin["flags"][1:]))
    tensor_pushes = re.findall(r"loaded weight version (\d+) from \d+ buckets of update_weights_from_tensor", log)
    broadcasts = re.findall(r"switched to weight version (\d+) from \d+ buckets of update_weights_from_distributed",
                            log)
    if name in COLOCATED:  # --release-train: every version a checkpoint the engine loads whole from the disk dir
        sync_dir = re.escape(flags["--update-weight-disk-dir"].rstrip("/"))
        disk_loads = re.findall(rf"loaded weight version (\d+) from {sync_dir}/weight_v0*(\d+) \(([^)]*)\)", log)
        # the sync recipes' feature: each version the engine loads is a checkpoint of their format the sync wrote
        # (perf/weight_sync_* is not logged here: the train actor that pushed ends before its next log)
        served = SYNC_CHECKPOINTS[name][1] if name in SYNC_CHECKPOINTS else "unquantised"
        assert disk_loads == [("1", "1", served), ("2", "2", served)] and not tensor_pushes and not broadcasts, \
            (disk_loads, tensor_pushes, broadcasts)
        assert "Creating placement group with 2 GPUs" in log  # train actors and the engine in the same bundles
        # slime's offload of the colocated engine: released for the step, resumed before the next push
        assert "released memory occupation: " in log and "resumed memory occupation: " in log
    else:
        assert broadcasts == ["1", "2"] and not tensor_pushes, (broadcasts, tensor_pushes)

    # the layout Megatron built, with that many train ranks
    layout, actor_ranks, critic_ranks = LAYOUTS[name]
    for arg, value in layout.items():
        assert _megatron_args(log, arg) == {value}, (arg, _megatron_args(log, arg))
    # --release-train: the actors started at launch end after the first push and start again for the step
    assert log.count("slime accelerator in the actor train actor") == actor_ranks * (2 if name in COLOCATED else 1)
    assert log.count("slime accelerator in the critic train actor") == critic_ranks
    if layout["tensor_model_parallel_size"] == "1":  # the recipe's --sequence-parallel, turned off by Megatron
        assert "--sequence-parallel" in standin["flags"]
        assert "Disabling sequence parallelism because tensor model parallelism is disabled" in log

    if name in SYNC_CHECKPOINTS:  # the recipe's own first step made the engines' checkpoint, in its format
        from slime_ascend.quant.hf_config import format_from_checkpoint

        checkpoint, fmt = SYNC_CHECKPOINTS[name]
        assert format_from_checkpoint(tmp_path / "base" / checkpoint) == fmt
        assert flags["--hf-checkpoint"] == str(tmp_path / "base" / checkpoint)
    if name == "qwen3-8b-sao-npu":  # ... and the critic role file, beside its YAML; K critic updates a step
        assert (recipe / "sao_megatron.yaml").is_file()
        iters = recipe_yaml["ascend_sao_critic_iters"]
        assert log.count("critic-step 0: {") == iters, log.count("critic-step 0: {")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_refuses_to_stop_a_running_ray_cluster(name, standin_root, tmp_path):
    """A Ray cluster already on the node may hold other jobs: the recipe stops with a Fix, before any work."""
    _, done = _run_recipe(name, standin_root, tmp_path, {"STANDIN_RAY_RUNNING": "1"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "a Ray cluster is already running" in done.stderr and "Fix:" in done.stderr
    assert "stand-in: ray" not in done.stdout  # neither stopped nor started
