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


@pytest.fixture
def parse(monkeypatch):
    """slime's parse_args on the tiny command of ``slime_parse_args`` (which colocates), in a subprocess:
    ``parse(dir, plugins, *argv, colocate=True, yaml_text=None, env=None)``."""
    import slime_parse_args

    def run(where, plugins, *argv, colocate=True, yaml_text=None, env=None):
        where.mkdir(parents=True, exist_ok=True)
        argv = [str(where / w) if w in ("SYNC", "CKPT") else w for w in argv]
        if yaml_text is not None:
            (where / "ascend.yaml").write_text(yaml_text)
        with monkeypatch.context() as m:
            assert "--colocate" in slime_parse_args.TINY_FLAGS
            if not colocate:
                m.setattr(slime_parse_args, "TINY_FLAGS", tuple(w for w in slime_parse_args.TINY_FLAGS
                                                                if w != "--colocate"))
            for name, value in (env or {}).items():
                m.setenv(name, value)
            return slime_parse_args.parse_args(where, plugins, *argv)

    return run


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
def test_colocate_without_release_train_is_refused_and_release_train_parses(tmp_path, parse):
    line = _refusal(parse(tmp_path, ["npu"]))
    assert line.startswith("slime-ascend: error: npu: --colocate without --release-train")
    assert "torch_memory_saver's NPU build has no preload hook" in line
    assert "Fix: add --release-train --update-weight-transport disk --update-weight-disk-dir DIR" in line
    _parsed(parse(tmp_path, ["npu"], *RELEASE))  # the first fix the line names
    _parsed(parse(tmp_path, ["npu"], *SPLIT, colocate=False))  # the second


@pytest.mark.slime
def test_offload_train_left_on_by_a_yaml_without_it_is_refused(tmp_path, parse):
    """What slime would do without the plugin's YAML: preload torch_memory_saver into the train actors."""
    line = _refusal(parse(tmp_path, ["npu"], yaml_text=_yaml_without_offload(["npu"])))
    assert "npu: offload_train is on (--colocate turns it on)" in line
    assert "LD_PRELOAD torch_memory_saver's preload hook" in line and "NPU build does not support" in line
    assert "Fix: offload_train: false in the YAML given to --custom-config-path" in line
    assert "with --release-train" in line  # colocated: the YAML alone is not enough


@pytest.mark.slime
def test_ppo_critic_offload_is_mapped_by_the_yaml(tmp_path, parse):
    """slime forces offload_train for PPO's critic whatever the flags: only the YAML turns it off."""
    argv = (*SPLIT, "--advantage-estimator", "ppo", "--save", "CKPT", "--save-interval", "10")
    line = _refusal(parse(tmp_path / "bare", ["npu"], *argv, colocate=False, yaml_text=_yaml_without_offload(["npu"])))
    assert "npu: offload_train is on (slime forces it for PPO's critic (--advantage-estimator ppo))" in line
    assert "with --release-train" not in line  # not colocated
    _parsed(parse(tmp_path / "yaml", ["npu"], *argv, colocate=False))


@pytest.mark.slime
@pytest.mark.parametrize("where", ["job", "train-env-vars"])
def test_both_allocator_variables_are_refused(tmp_path, where, parse):
    if where == "job":
        proc = parse(tmp_path, ["npu"], *RELEASE, env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False",
                                                        "PYTORCH_ALLOC_CONF": ""})
    else:
        proc = parse(tmp_path, ["npu"], *RELEASE, "--train-env-vars", '{"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}',
                      env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"})
    line = _refusal(proc)
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
