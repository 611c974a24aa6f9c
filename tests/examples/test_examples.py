"""examples/: every recipe's YAML loads, its SLIME_ASCEND_PLUGINS matches ascend_plugins, its run.sh
is valid bash that adds --custom-config-path and names each plugin it enables, and (when all its
plugins load) the YAML is exactly what `slime-ascend config` generates, apart from settings the
example marks as edited (each of which must still be a valid value)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(p.parent.name for p in EXAMPLES.glob("*/run.sh"))
EDITED = "# ^ edited for this example"


def load(name: str) -> tuple[dict, str, str]:
    d = EXAMPLES / name
    text = (d / "ascend.yaml").read_text()
    return yaml.safe_load(text), text, (d / "run.sh").read_text()


def test_there_are_recipes_for_each_documented_feature():
    assert len(RECIPES) >= 6
    readme = (EXAMPLES / "README.md").read_text()
    for name in RECIPES:
        assert name in readme, f"examples/README.md does not mention {name}"


@pytest.mark.parametrize("name", RECIPES)
def test_yaml_loads_and_env_matches(name):
    data, _, script = load(name)
    plugins = data["ascend_plugins"]
    assert isinstance(plugins, list) and plugins and plugins[0] == "npu"
    exports = re.findall(r"^export SLIME_ASCEND_PLUGINS=(\S+)$", script, flags=re.M)
    assert exports == [",".join(plugins)], f"{name}: SLIME_ASCEND_PLUGINS {exports} vs ascend_plugins {plugins}"


@pytest.mark.parametrize("name", RECIPES)
def test_run_sh_is_valid_and_names_what_it_adds(name):
    data, _, script = load(name)
    if shutil.which("bash"):
        done = subprocess.run(["bash", "-n", str(EXAMPLES / name / "run.sh")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert script.count("--custom-config-path") >= 1
    assert re.search(r'--custom-config-path "\$\{HERE\}/ascend.yaml"\s+# \[ascend\]', script)
    for plugin in data["ascend_plugins"]:
        assert re.search(rf"^#\s+{re.escape(plugin)}\s+\S", script, flags=re.M), f"{name}: header does not explain {plugin}"
    for line in script.splitlines():  # every plugin-specific line says which plugin wants it
        if "[ascend:" in line:
            plugin = line.split("[ascend:", 1)[1].split("]", 1)[0]
            assert plugin in data["ascend_plugins"], f"{name}: {line!r} tags a plugin the YAML does not enable"


def _edited_keys(text: str) -> set[str]:
    lines = text.splitlines()
    return {lines[i - 1].split(":", 1)[0] for i, line in enumerate(lines) if line.startswith(EDITED) and i}


@pytest.mark.parametrize("name", RECIPES)
def test_yaml_equals_fresh_config(name):
    from slime_ascend import config
    from slime_ascend.plugins import registry
    from slime_ascend.plugins.settings import coerce

    data, text, _ = load(name)
    broken = {p: why for p, why in registry.broken().items() if p in data["ascend_plugins"]}
    assert not broken, f"{name}: plugin(s) do not load, the YAML cannot be compared: {broken}"
    fresh = config.build(data["ascend_plugins"])
    expected = yaml.safe_load(fresh.yaml_text)
    assert set(data) == set(expected), f"{name}: keys differ from `slime-ascend config` (regenerate ascend.yaml)"
    edited = _edited_keys(text)
    differing = {k for k in data if data[k] != expected[k]}
    assert differing <= edited, f"{name}: {sorted(differing - edited)} differ from the generated YAML without an edit mark"
    settings = {s.key: s for p in registry.resolve_selection(data["ascend_plugins"]).plugins for s in p.settings}
    for key in edited:
        assert key in settings, f"{name}: only plugin settings may be edited, not {key!r}"
        coerce(settings[key], data[key])
    stripped = "\n".join(line for line in text.splitlines() if not line.startswith(EDITED))
    fresh_lines = [line for line in fresh.yaml_text.splitlines() if line.split(":", 1)[0] not in edited]
    ours = [line for line in stripped.splitlines() if line.split(":", 1)[0] not in edited]
    assert ours == fresh_lines, f"{name}: comments or order drifted from `slime-ascend config` (regenerate)"


@pytest.mark.parametrize("name", RECIPES)
def test_ray_dashboard_listens_on_loopback_only(name):
    """The dashboard is also Ray's job-submission API: on 0.0.0.0 anyone on the network can run code."""
    script = (EXAMPLES / name / "run.sh").read_text()
    heads = [line for line in script.splitlines() if re.match(r"\s*ray start\b.*--head\b", line)]
    assert heads, f"{name}: run.sh starts no Ray head"
    for line in heads:
        hosts = re.findall(r"--dashboard-host[= ](\S+)", line)
        assert hosts == ["127.0.0.1"], f"{name}: {line.strip()!r} must pass --dashboard-host=127.0.0.1"
    assert "0.0.0.0" not in script, f"{name}: run.sh binds something to every interface"


def test_generator_template_keeps_the_dashboard_on_loopback():
    template = (EXAMPLES / "make_examples.py").read_text()
    assert "--dashboard-host=127.0.0.1" in template and "0.0.0.0" not in template


def test_generated_recipes_are_in_sync_with_the_generator():
    """`python examples/make_examples.py --check`: every ascend.yaml and run.sh is exactly what the generator
    writes today (a template or plugin change without regenerating fails here)."""
    import runpy

    from slime_ascend.plugins import registry

    generator = runpy.run_path(str(EXAMPLES / "make_examples.py"))  # not __main__: defines, writes nothing
    broken = {p: why for p, why in registry.broken().items() if any(p in r[2] for r in generator["RECIPES"])}
    assert not broken, f"plugin(s) do not load, the generator would write placeholders: {broken}"
    assert generator["main"](["--check"]) == 0


def _args_of(name: str):
    """slime's args as far as the recipe fixes them: its YAML plus the ``--flag value`` lines of run.sh."""
    import argparse

    data, _, script = load(name)
    flags = dict(re.findall(r"^\s+--([a-z0-9-]+) ([^\s\\]+)", script, flags=re.M))
    args = argparse.Namespace(**{k.replace("-", "_"): v for k, v in flags.items()}, **data)
    for key in ("n_samples_per_prompt", "rollout_batch_size", "global_batch_size"):
        if hasattr(args, key):
            setattr(args, key, int(getattr(args, key)))
    return args


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_passes_the_plugins_own_start_up_validation(name):
    """What each plugin checks as slime starts (settings and plugin rules; e.g. an OPD teacher with neither a
    URL nor a switch engine) holds for the recipe as written."""
    from slime_ascend.plugins import runtime

    with runtime.ignoring_environment():
        runtime.check(_args_of(name), command_line=False)


def _sync_plugin(name: str) -> str | None:
    from slime_ascend.weight_sync.plugin import NAMES

    found = [p for p in load(name)[0]["ascend_plugins"] if p in NAMES]
    assert len(found) <= 1, f"{name}: {found}: the sync plugins conflict"
    return found[0] if found else None


def test_every_weight_sync_plugin_has_a_recipe():
    from slime_ascend.weight_sync.plugin import NAMES

    covered = {_sync_plugin(name) for name in RECIPES} - {None}
    assert covered == set(NAMES), f"no recipe in examples/ for {sorted(set(NAMES) - covered)}"


def test_recipes_that_need_a_prepared_checkpoint_or_file_make_it_themselves():
    from slime_ascend.quant.names import FORMATS
    from slime_ascend.weight_sync.funnel import PLUGIN_FORMATS

    for name in RECIPES:  # the engines' checkpoint, in the format the sync plugin's start-up check asks of it
        sync = _sync_plugin(name)
        if sync is None:
            continue
        script = load(name)[2]
        target = re.search(r"--hf-checkpoint (\S+)", script).group(1)
        steps = re.findall(rf'^\[ -f "{re.escape(target)}/config.json" \] \|\| slime-ascend quantize '
                           rf'"\$\{{BASE\}}/Qwen3-8B" "{re.escape(target)}" --format (\S+)', script, flags=re.M)
        assert steps == [PLUGIN_FORMATS[sync][0]], (name, steps)
        assert steps[0] in FORMATS  # a choice `slime-ascend quantize --format` has
    int4 = load("qwen3-8b-int4-sync-npu")[2]
    assert "--format int4-group --group-size ${INT4_GROUP_SIZE:-128}\n" in int4
    sao = (EXAMPLES / "qwen3-8b-sao-npu" / "run.sh").read_text()
    assert re.search(r"python -m slime_ascend.sao.critic -o \S+ --force", sao)  # a second launch under set -e
    for name in RECIPES:  # never stops a Ray cluster it did not start, unless asked
        script = (EXAMPLES / name / "run.sh").read_text()
        assert 'if [ "${RESTART_RAY:-0}" = 1 ]; then ray stop' in script and script.index("ray status") < script.index(
            "ray start --head")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_passes_the_npu_launch_checks(name):
    """Offload and environment as the npu plugin checks them at start (slime.accelerator.launch): the recipe's
    switches (--colocate, --release-train), its YAML (offload_train), PPO's critic, and the variables run.sh
    exports with PYTORCH_ALLOC_CONF unset; the same recipe without --release-train is refused."""
    from slime_ascend.accelerator import launch

    data, _, script = load(name)
    args = _args_of(name)
    words = set(re.findall(r"^\s+(--[a-z0-9-]+)", script, flags=re.M))
    args.colocate, args.release_train = "--colocate" in words, "--release-train" in words
    args.use_critic = getattr(args, "advantage_estimator", None) == "ppo"
    args.offload_train = data.get("offload_train", True if (args.colocate or args.use_critic) else None)
    exported = dict(re.findall(r"^export ([A-Z_]+)=(\S+)$", script, flags=re.M))
    start = re.search(r"^ray start --head", script, flags=re.M).start()
    assert 0 <= script.find("\nunset PYTORCH_ALLOC_CONF\n") < start  # gone from ray's environment, and the job's
    assert launch.problems(args, exported) == []
    if args.colocate:
        args.release_train = False
        assert launch.problems(args, exported)[0].startswith("npu: --colocate without --release-train")
