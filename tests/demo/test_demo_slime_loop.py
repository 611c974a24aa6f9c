"""The demo's slime mode, without running slime: reading slime's logged metrics, per-plugin evidence,
and how ``slime-ascend demo`` chooses (or refuses) slime's loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo import slime_job, slime_loop

ESC = "\x1b"
LOG = f"""\
{ESC}[36m(RolloutManager pid=1){ESC}[0m [2026-12-01 02:07:25] rollout_metrics.py:268 - perf 0: {{'rollout/response_len/mean': 8.0, 'perf/rollout_time': 0.6}}
{ESC}[36m(MegatronTrainRayActor pid=2){ESC}[0m [2026-12-01 02:07:25] train_metric_utils.py:135 - rollout 0: {{'rollout/raw_reward': 0.75, 'rollout/advantages': 0.1}}
(MegatronTrainRayActor pid=2) [..] model.py:918 - step 0: {{'train/loss': 0.5, 'train/dis_masked_frac': 0.25, 'train/train_rollout_logprob_abs_diff': 0.001, 'train/step': 0}}
(MegatronTrainRayActor pid=2) [..] train_metric_utils.py:401 - perf 0: {{'perf/update_weights_time': 0.05}}
a line that is not a metric: {{'not/labelled': 1}}
(MegatronTrainRayActor pid=2) [..] train_metric_utils.py:135 - rollout 1: {{'rollout/raw_reward': 0.25}}
(RolloutManager pid=1) [..] staleness_hook.py:80 - staleness 1: {{'rollout/staleness_dropped': 2.0}}
(RolloutManager pid=1) [..] staleness_hook.py:80 - staleness -: {{'rollout/staleness_dropped': 9.0}}
(MegatronTrainRayActor pid=2) actor train: 100%|####| 8/8 [2026-12-01 02:07:52] model.py:918 - step 1: {{'train/loss': 0.4, 'train/step': 1}}
(MegatronTrainRayActor pid=2) [..] applied runtime patch train.cpu_streams (x)
(MegatronTrainRayActor pid=2) [..] step 2: {{'train/loss': nan_is_not_a_literal}}
"""


def test_parse_rollout_metrics_merges_by_rollout():
    steps = slime_job.parse_rollout_metrics(LOG)
    assert list(steps) == [0, 1]  # the unparsable dict of step 2 is skipped, the unlabelled one ignored
    assert steps[0] == {"rollout/response_len/mean": 8.0, "perf/rollout_time": 0.6, "rollout/raw_reward": 0.75,
                        "rollout/advantages": 0.1, "train/loss": 0.5, "train/dis_masked_frac": 0.25,
                        "train/train_rollout_logprob_abs_diff": 0.001, "train/step": 0,
                        "perf/update_weights_time": 0.05}
    assert steps[1] == {"rollout/raw_reward": 0.25, "rollout/staleness_dropped": 2.0, "train/loss": 0.4,
                        "train/step": 1}


def test_history_row_uses_the_miniature_keys():
    steps = slime_job.parse_rollout_metrics(LOG)
    row = slime_loop._history_row(0, steps[0])
    assert row["step"] == 0 and row["reward"] == 0.75 and row["masked_frac"] == 0.25 and row["mismatch"] == 0.001
    assert row["slime"] is steps[0]
    assert slime_loop._history_row(1, steps[1])["masked_frac"] is None


def test_plugin_evidence_reports_what_slime_logged():
    steps = slime_job.parse_rollout_metrics(LOG)
    engine_log = ("loaded weight version 1 from /w/weight_v000001 (int8-w8a8)\n"
                  "loaded weight version 2 from /w/weight_v000002 (bf16)\n")
    critic = "x critic-step 0: {'train/critic-value_loss': 1.0}\ny critic-step 0: {'a/b': 2}\nz critic-step 1: {'a/b': 3}\n"
    ev = slime_loop.plugin_evidence(("cpu", "dis", "icepop", "int8-sync", "fp8-sync", "sao"), steps, LOG + critic,
                                    engine_log)
    assert ev["dis"]["found"] and ev["dis"]["metrics"] == {"train/dis_masked_frac": [0.25]}
    assert ev["cpu"]["found"] and ev["cpu"]["log"] == ["applied runtime patch train.cpu_streams"]
    assert ev["icepop"] == {"metrics": {}, "log": [], "found": False}
    # the engine served a version in the plugin's format; slime's own perf keys are not evidence
    assert ev["int8-sync"]["log"] == ["loaded weight version 1 from /w/weight_v000001 (int8-w8a8)"]
    assert ev["int8-sync"]["metrics"] == {} and not ev["fp8-sync"]["found"]
    assert ev["sao"]["critic_passes_per_rollout"] == {0: 2, 1: 1}


def _fake_tree(root: Path) -> Path:
    (root / "slime" / "utils" / "accelerator").mkdir(parents=True)
    (root / "slime" / "utils" / "accelerator" / "__init__.py").write_text("")
    (root / "train.py").write_text("")
    return root


def test_slime_src_explicit_env_and_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIME_SRC", raising=False)
    tree = _fake_tree(tmp_path / "slime-tree")
    assert slime_job.slime_src(str(tree)) == tree.resolve()
    with pytest.raises(slime_job.SlimeNotFound, match=r"--slime-src=.*not a THUDM/slime source tree"):
        slime_job.slime_src(str(tmp_path))
    monkeypatch.setenv("SLIME_SRC", str(tmp_path / "missing"))
    with pytest.raises(slime_job.SlimeNotFound, match=r"SLIME_SRC=.*missing"):
        slime_job.slime_src()
    monkeypatch.setenv("SLIME_SRC", str(tree))
    assert slime_job.slime_src() == tree.resolve()


def test_resolve_slime_names_missing_dependencies(tmp_path, monkeypatch):
    tree = _fake_tree(tmp_path / "slime-tree")
    monkeypatch.setattr(slime_loop, "SLIME_DEPENDENCIES", ("json", "surely_not_a_module_xyz"))
    src, why = slime_loop.resolve_slime(str(tree))
    assert src is None and "surely_not_a_module_xyz" in why and "json" not in why.split("needs")[1].split("(")[0]
    monkeypatch.setattr(slime_loop, "SLIME_DEPENDENCIES", ("json",))
    assert slime_loop.resolve_slime(str(tree)) == (tree.resolve(), "")


def _demo(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_ascend.cli", "demo", *argv], capture_output=True, text=True,
                          cwd=str(cwd), timeout=120)


def test_cli_refuses_a_bad_slime_src_in_one_line(tmp_path):
    proc = _demo("--slime-src", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --slime-src=") and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    proc = _demo("--slime-src", str(tmp_path), "--loop", "mini", cwd=tmp_path)
    assert proc.returncode == 2 and "drop --loop mini" in proc.stderr


def test_streaming_announces_slimes_start_up_once_each_and_writes_the_rows(tmp_path):
    """While slime starts (a minute or more before the first metrics) the demo says where it is."""
    import sys

    from slime_ascend.demo.slime_loop import _run_streaming

    lines = [
        "Creating placement group with 2 GPUs...",
        "(RolloutManager pid=1) slime-ascend plugins active: cpu, sao",
        "(RolloutManager pid=1) more from the rollout manager",
        "(MegatronTrainRayActor pid=2) slime accelerator in the actor train actor: cpu (process groups gloo, ...)",
        "(MegatronTrainRayActor pid=3) slime accelerator in the critic train actor: cpu (process groups gloo, ...)",
        "[2026-12-01 05:22:30] rollout.py:1 - rollout 0: {'rollout/raw_reward': 0.5}",
        "[2026-12-01 05:22:40] train.py:90 - step 0: {'train/step': 0, 'train/loss': 1.0}",
    ]
    script = tmp_path / "fake_slime.py"
    script.write_text("for line in %r:\n    print(line, flush=True)\n" % (lines,))
    said: list[str] = []
    rc = _run_streaming([sys.executable, str(script)], dict(__import__("os").environ), tmp_path, tmp_path / "run.log",
                        tmp_path / "metrics.jsonl", 1, said.append)
    assert rc == 0
    announced = [s.split("slime: ", 1)[1].rsplit(" (", 1)[0] for s in said if s.startswith("  slime: ")]
    assert announced == ["Ray placement group requested", "rollout manager started", "policy train actor up",
                         "critic train actor up", "first rollout generated"]
    assert (tmp_path / "run.log").read_text().splitlines() == lines
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_job_env_adds_an_extra_pythonpath_to_the_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/callers/path")
    env = slime_job.job_env(("cpu",), {"PYTHONPATH": "/tests/helpers", "X": "1"}, src=tmp_path)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), str(slime_job.PACKAGE_ROOT), "/tests/helpers",
                                            "/callers/path"]
    assert env["X"] == "1" and env["SLIME_ASCEND_PLUGINS"] == "cpu"
    monkeypatch.delenv("PYTHONPATH")
    assert slime_job.job_env(("cpu",), src=tmp_path)["PYTHONPATH"].split(":") == [
        str(tmp_path), str(slime_job.PACKAGE_ROOT)]


# Megatron's argument dump as slime's driver prints it (two dumps: the critic role prints its own), and the cpu
# plugin's glm5 patches as the train actors log them
GLM5_LOG = """\
  seq_length ...................................... 512
  spec ............................................ ['slime_plugins.models.glm5.glm5', 'get_glm5_spec']
  spec ............................................ ['slime_plugins.models.glm5.glm5', 'get_glm5_spec']
(MegatronTrainRayActor pid=2) [..] base.py:197 - applied runtime patch train.glm5_host_spec
(MegatronTrainRayActor pid=2) [..] base.py:197 - applied runtime patch train.glm5_kernels
(MegatronTrainRayActor pid=3) [..] base.py:197 - applied runtime patch train.glm5_host_spec
(MegatronTrainRayActor pid=2) [..] base.py:197 - applied runtime patch train.dsa_deterministic_topk
"""


def test_model_evidence_reads_the_spec_megatron_printed():
    ev = slime_loop.model_evidence("glm5", GLM5_LOG)
    assert ev == {"name": "glm5", "spec": ["slime_plugins.models.glm5.glm5", "get_glm5_spec"],
                  "logged_specs": [["slime_plugins.models.glm5.glm5", "get_glm5_spec"]], "spec_in_log": True,
                  "glm5_patches": ["train.glm5_host_spec", "train.glm5_kernels"]}
    # the same log is not evidence of the qwen3 job's spec; a job that trained two specs is evidence of neither
    assert not slime_loop.model_evidence("qwen3", GLM5_LOG)["spec_in_log"]
    mixed = GLM5_LOG + "  spec ........ ['slime_ascend.cpu.spec', 'get_layer_spec']\n"
    assert not slime_loop.model_evidence("glm5", mixed)["spec_in_log"]
    assert slime_loop.model_evidence("glm5", "no dump here")["logged_specs"] == []
    ev = slime_loop.plugin_evidence(("dsa-determinism",), {}, GLM5_LOG)
    assert ev["dsa-determinism"]["log"] == ["applied runtime patch train.dsa_deterministic_topk"]


def _command(model: str, plugins: tuple[str, ...], tmp_path: Path) -> list[str]:
    from slime_ascend import config

    own = {"--hf-checkpoint": "/m", "--bf16": None, "--megatron-config-path": "/sao.yaml", "--lr": "1e-3"}
    return slime_loop.slime_command(tmp_path, model, own, config.build(list(plugins)).flags_line().split(),
                                    tmp_path / "ascend.yaml")


def test_glm5_command_trains_slimes_glm5_spec_in_fp32(tmp_path):
    from slime_ascend.glm5.tiny import TINY_GLM5_ARGS

    cmd = _command("glm5", ("cpu", "sao", "dsa-determinism"), tmp_path)
    assert cmd[1] == str(tmp_path / "train_async.py") and cmd[-2:] == ["--custom-config-path", str(tmp_path / "ascend.yaml")]
    at = cmd.index("--spec")
    assert cmd.count("--spec") == 1 and cmd[at + 1:at + 3] == ["slime_plugins.models.glm5.glm5", "get_glm5_spec"]
    assert "slime_ascend.cpu.spec" not in cmd and "--bf16" not in cmd
    # every architecture flag of the tiny GLM-5, the demo's own values (not the generated ones), the cpu plugin's
    arch = [w for w in TINY_GLM5_ARGS if w not in ("--spec", "slime_plugins.models.glm5.glm5", "get_glm5_spec")]
    assert cmd[2:2 + len(arch)] == arch and "--multi-latent-attention" in arch
    assert cmd[cmd.index("--megatron-config-path") + 1] == "/sao.yaml" and cmd.count("--megatron-config-path") == 1
    assert "--transformer-impl" in cmd and "--use-cpu-initialization" in cmd
    qwen = _command("qwen3", ("cpu", "sao"), tmp_path)
    assert qwen[qwen.index("--spec") + 1:qwen.index("--spec") + 3] == ["slime_ascend.cpu.spec", "get_layer_spec"]
    assert "--bf16" in qwen and "--multi-latent-attention" not in qwen
    assert qwen[2:2 + len(slime_job.TINY_QWEN3_ARGS.split())] == slime_job.TINY_QWEN3_ARGS.split()


def test_write_yaml_appends_plain_slime_args(tmp_path):
    import yaml

    from slime_ascend.demo.loop import write_yaml

    write_yaml(("cpu", "staleness"), {"ascend_staleness_tau": 1}, tmp_path / "a.yaml",
               dict(slime_loop.MODEL_JOBS["glm5"].slime_args))
    values = yaml.safe_load((tmp_path / "a.yaml").read_text())
    assert values["bf16"] is False and values["ascend_staleness_tau"] == 1
    with pytest.raises(RuntimeError, match="keys the generated YAML does not have"):
        write_yaml(("cpu",), {"bf16": False}, tmp_path / "b.yaml")  # edits stay the generated keys
