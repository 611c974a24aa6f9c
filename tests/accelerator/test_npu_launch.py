"""The ``npu`` plugin's launch checks (:mod:`slime_ascend.accelerator.launch`) in slime's own ``parse_args``.

Colocated offload: slime's ``offload_train`` LD_PRELOADs torch_memory_saver's preload hook into the train actors, a
mode the NPU build does not support; the plugin's YAML turns it off and colocation needs ``--release-train``.
Allocator variables: torch_npu refuses to start with both ``PYTORCH_NPU_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF``.
Each mistake is one line before Ray starts; the fixes the lines name parse."""

from __future__ import annotations

import types

import pytest
import yaml

from slime_ascend import config
from slime_ascend.accelerator import launch

RELEASE = ("--release-train", "--update-weight-transport", "disk", "--update-weight-disk-dir", "SYNC", "--save", "CKPT")
SPLIT = ("--rollout-num-gpus", "1")  # replaces --colocate: the engine on an NPU of its own


PPO = (*SPLIT, "--advantage-estimator", "ppo", "--save", "CKPT", "--save-interval", "10")
ALLOC_CONF = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}
# this module's command lines for slime's parse_args (npu plugin) after the tiny command of ``slime_parse_args``:
# name -> (argv, keep its --colocate, the plugin's YAML (else without offload_train), the job's environment)
CASES = {
    "colocate": ((), True, True, {}),
    "release": (RELEASE, True, True, {}),
    "split": (SPLIT, False, True, {}),
    "yaml-without-offload": ((), True, False, {}),
    "ppo-yaml-without-offload": (PPO, False, False, {}),
    "ppo": (PPO, False, True, {}),
    "alloc-job": (RELEASE, True, True, {**ALLOC_CONF, "PYTORCH_ALLOC_CONF": ""}),
    "alloc-train-env-vars": ((*RELEASE, "--train-env-vars", '{"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}'), True,
                             True, ALLOC_CONF),
}


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """name -> slime's parse_args on ``CASES[name]``, each in a folder of its own, all at once
    (:func:`slime_parse_args.parse_args_each`: a process per case, the imports shared)."""
    import slime_parse_args

    root = tmp_path_factory.mktemp("npu-launch")
    assert "--colocate" in slime_parse_args.TINY_FLAGS
    cases = []
    for name, (argv, colocate, plugin_yaml, env) in CASES.items():
        where = root / name
        where.mkdir()
        if not plugin_yaml:
            (where / "ascend.yaml").write_text(_yaml_without_offload(["npu"]))
        flags = [w for w in slime_parse_args.TINY_FLAGS if colocate or w != "--colocate"]
        argv = [str(where / w) if w in ("SYNC", "CKPT") else w for w in argv]
        cases.append(slime_parse_args.Case(argv, where, flags, env))
    return dict(zip(CASES, slime_parse_args.parse_args_each(root, ["npu"], cases)))


def _refusal(proc) -> str:
    from slime_parse_args import error_lines

    lines = error_lines(proc)
    assert proc.returncode == 2 and "PARSED" not in proc.stdout and len(lines) == 1, (lines, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    return lines[0]


def _parsed(proc) -> None:
    assert proc.returncode == 0 and "PARSED" in proc.stdout, proc.stderr[-3000:]


def _yaml_without_offload(plugins) -> str:
    lines = config.build(plugins).yaml_text.splitlines()
    return "\n".join(line for line in lines if not line.startswith("offload_train:")) + "\n"


def test_the_npu_yaml_turns_train_offload_off():
    data = yaml.safe_load(config.build(["npu", "sglang-npu"]).yaml_text)
    assert data["offload_train"] is False
    assert yaml.safe_load(config.build(["cpu", "npu"]).yaml_text)["offload_train"] is False  # the same value


@pytest.mark.slime
def test_colocate_without_release_train_is_refused_and_release_train_parses(parsed):
    line = _refusal(parsed["colocate"])
    assert line.startswith("slime-ascend: error: npu: --colocate without --release-train")
    assert "torch_memory_saver's NPU build has no preload hook" in line
    assert "Fix: add --release-train --update-weight-transport disk --update-weight-disk-dir DIR" in line
    _parsed(parsed["release"])  # the first fix the line names
    _parsed(parsed["split"])  # the second


@pytest.mark.slime
def test_offload_train_left_on_by_a_yaml_without_it_is_refused(parsed):
    """What slime would do without the plugin's YAML: preload torch_memory_saver into the train actors."""
    line = _refusal(parsed["yaml-without-offload"])
    assert "npu: offload_train is on (--colocate turns it on)" in line
    assert "LD_PRELOAD torch_memory_saver's preload hook" in line and "NPU build does not support" in line
    assert "Fix: offload_train: false in the YAML given to --custom-config-path" in line
    assert "with --release-train" in line  # colocated: the YAML alone is not enough


@pytest.mark.slime
def test_ppo_critic_offload_is_mapped_by_the_yaml(parsed):
    """slime forces offload_train for PPO's critic whatever the flags: only the YAML turns it off."""
    line = _refusal(parsed["ppo-yaml-without-offload"])
    assert "npu: offload_train is on (slime forces it for PPO's critic (--advantage-estimator ppo))" in line
    assert "with --release-train" not in line  # not colocated
    _parsed(parsed["ppo"])


@pytest.mark.slime
@pytest.mark.parametrize("where", ["job", "train-env-vars"])
def test_both_allocator_variables_are_refused(where, parsed):
    line = _refusal(parsed[f"alloc-{where}"])
    assert line.startswith("slime-ascend: error: npu: both allocator variables are set for the train actors")
    assert "Fix: unset PYTORCH_ALLOC_CONF before `ray start`" in line
    if where == "train-env-vars":
        assert "PYTORCH_ALLOC_CONF='max_split_size_mb:64' (--train-env-vars)" in line


def _args(**kw):
    base = dict(train_backend="megatron", colocate=False, offload_train=False, use_critic=False, release_train=False,
                rollout_num_gpus=None, train_env_vars={})
    return types.SimpleNamespace(**{**base, **kw})


def test_offload_rules_in_words():
    assert launch.offload_problem(_args()) is None
    assert launch.offload_problem(_args(colocate=True, release_train=True)) is None
    assert launch.offload_problem(_args(colocate=True, rollout_num_gpus=0)) is None  # no engine shares the NPUs
    assert launch.offload_problem(_args(colocate=True, rollout_external_engine_addrs=["h:1"])) is None
    assert launch.offload_problem(_args(colocate=True, offload_train=True, train_backend="fsdp")) is None
    assert "--offload-train / --offload" in launch.offload_problem(_args(offload_train=True))
    assert "--colocate without --release-train" in launch.offload_problem(_args(colocate=True))


def test_allocator_clash_in_words():
    assert launch.alloc_conf_problem({"PYTORCH_NPU_ALLOC_CONF": "x"}) is None
    assert launch.alloc_conf_problem({"PYTORCH_ALLOC_CONF": "x"}) is None
    assert launch.alloc_conf_problem({"PYTORCH_NPU_ALLOC_CONF": "x"}, {"PYTORCH_ALLOC_CONF": ""}) is not None
    # on the host (cpu,npu) only the allocator rule applies
    assert launch.problems(_args(colocate=True), {}, on_device=False) == []
    both = {"PYTORCH_NPU_ALLOC_CONF": "a", "PYTORCH_ALLOC_CONF": "b"}
    assert len(launch.problems(_args(colocate=True), both)) == 2
