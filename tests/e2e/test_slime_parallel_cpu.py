"""slime's own ``train.py`` on this CPU above one rank: tensor, pipeline and data parallelism of the tiny dense Qwen3, each against the one-rank run of the same job.

Every run is stock slime with the ``cpu``, ``dis`` and ``staleness`` plugins, the reference engine and disk
weight updates, 2 rollouts. The runs are made comparable: fp32 training (no ``--bf16``), the engine's
sampling seeded per sample (``--sglang-enable-deterministic-inference``: slime sends
``sampling_seed = --rollout-seed + i``), and a reward that is a function of the response
(``parity_reward.reward``). The one-rank run is made once per module; each layout must then reproduce,
from slime's own output, the tokens of every sample and its train-side log-probs (``--save-debug-train-data``:
slime gathers them from every DP rank on the last pipeline stage), and the loss and grad norm slime logs for
each train step. The second rollout is generated with the weights the first step trained, so its tokens and
log-probs also check the optimizer step of each layout.

Tolerances are for fp32 summed in another order (TP splits the matmuls, DP all-reduces the gradients, PP
sends activations): log-probs to 2e-5 absolute, grad norm and loss to 1e-4 relative (loss also 1e-7 absolute;
GRPO's loss here is ~1e-5).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags, start_engine, stop
from e2e_fixtures import engine, model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1800)]

PLUGINS = ("cpu", "dis", "staleness")
HERE = Path(__file__).parent
LOGPROB_ATOL = 2e-5
METRIC_RTOL = 1e-4
LOSS_ATOL = 1e-7
BATCH, N_SAMPLES, NUM_ROLLOUT = 4, 2, 2


def _config(work: Path) -> Path:
    out = work / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    return out


def _flags(model: Path, prompts: Path, engines, work: Path, layout: list[str]) -> list[str]:
    flags = [f for f in slime_flags(model, prompts, engines, work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES) if f != "--bf16"]  # fp32: layouts compared to 1e-5
    at = flags.index("--rm-type")
    del flags[at:at + 2]
    # later flags win in slime's argparse: the layout replaces the one-rank defaults of slime_flags
    return flags + ["--custom-rm-path", "parity_reward.reward", "--sglang-enable-deterministic-inference",
                    "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"), *layout]


def _run(model: Path, work: Path, layout: list[str], env: dict[str, str] | None = None):
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(model, work / "engine.log")
    try:
        run = run_slime("train.py", _flags(model, prompts, [engine], work, layout), work, PLUGINS,
                        custom_config=_config(work), extra_env={"PYTHONPATH": str(HERE), **(env or {})})
    finally:
        stop(engine.proc)
    print(f"\n{work.name}: {' '.join(layout) or 'one rank'}: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    return run


def _train_dump(work: Path, rollout_id: int) -> dict:
    import torch

    return torch.load(work / "dump" / f"train_{rollout_id}.pt", weights_only=False)


def _samples(work: Path, rollout_id: int) -> dict[int, dict]:
    return {s["sample_index"]: s for s in _train_dump(work, rollout_id)["samples"]}


def _steps(run) -> list[dict]:
    return [m for m in run.metrics() if "train/step" in m]


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("one-rank")
    return work, _run(model_dir, work, [])


def _assert_like_reference(reference, work: Path, run, dp: int) -> None:
    import torch

    ref_work, ref_run = reference
    for rollout_id in range(NUM_ROLLOUT):
        ref, got = _samples(ref_work, rollout_id), _samples(work, rollout_id)
        assert sorted(got) == sorted(ref) and len(ref) == BATCH * N_SAMPLES, (rollout_id, sorted(got), sorted(ref))
        assert len(_train_dump(work, rollout_id)["dp_shards"]) == dp
        for index, sample in ref.items():
            assert torch.equal(torch.as_tensor(got[index]["tokens"]), torch.as_tensor(sample["tokens"])), \
                (rollout_id, index)  # the same rollout: the engine served the same weights
            torch.testing.assert_close(torch.as_tensor(got[index]["log_probs"]),
                                       torch.as_tensor(sample["log_probs"]), rtol=0, atol=LOGPROB_ATOL)
    ref_steps, steps = _steps(ref_run), _steps(run)
    assert [m["train/step"] for m in steps] == [m["train/step"] for m in ref_steps] == list(range(NUM_ROLLOUT))
    for ref_m, m in zip(ref_steps, steps):
        assert math.isclose(m["train/grad_norm"], ref_m["train/grad_norm"], rel_tol=METRIC_RTOL), (m, ref_m)
        assert math.isclose(m["train/loss"], ref_m["train/loss"], rel_tol=METRIC_RTOL, abs_tol=LOSS_ATOL), (m, ref_m)
        assert m["train/dis_masked"] == ref_m["train/dis_masked"]
    assert any(m["train/grad_norm"] > 0 for m in ref_steps)  # the reward varied: the comparison has gradients
    # the plugins ran in every train rank and judged every rollout
    assert run.log.count("slime-ascend plugins active: cpu, dis, staleness") >= 2
    kept = [m["rollout/staleness_kept"] for m in run.metrics() if "rollout/staleness_kept" in m]
    assert kept == [BATCH * N_SAMPLES] * NUM_ROLLOUT, kept


def _ranks(run) -> int:
    """Train actors slime started: one device line per actor (plugins.early)."""
    return run.log.count("slime accelerator in the actor train actor")


LAYOUTS = {
    "tp2": ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"],
    "pp2": ["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"],
    "dp2": ["--actor-num-gpus-per-node", "2"],
}
DATA_PARALLEL = {"tp2": 1, "pp2": 1, "dp2": 2}
# TP 2 runs slime's loop to the end, but its train-side log-probs of rollout 0 (same tokens, same initial
# weights) are up to 2.6e-3 off the one-rank run's, where PP 2 and DP 2 are bit-identical: a real TP bug
# (the spec's TP layout or slime's HF->Megatron sharding of it), not fp32 reordering. Strict: it must fail until fixed.
TP_MISMATCH = pytest.mark.xfail(strict=True, raises=AssertionError, reason="TP 2 log-probs differ from one rank by 2.6e-3 (open bug)")


@pytest.mark.parametrize("layout", [pytest.param(n, marks=TP_MISMATCH) if n.startswith("tp") else n for n in LAYOUTS])
def test_layout_matches_the_one_rank_run(model_dir, reference, tmp_path, layout):
    # TP > 1 is refused by the cpu plugin until it matches; the switch runs it here so the mismatch stays tracked
    run = _run(model_dir, tmp_path / layout, LAYOUTS[layout],
               {"SLIME_ASCEND_CPU_ALLOW_TP": "1"} if layout.startswith("tp") else None)
    assert _ranks(run) == int(LAYOUTS[layout][1]), _ranks(run)
    assert "applied runtime patch train.cpu_device_properties" in run.log
    _assert_like_reference(reference, tmp_path / layout, run, DATA_PARALLEL[layout])


# each refusal in slime's own driver once per kind (TP, CP, MoE); every refused flag's line is unit-tested in
# tests/cpu/test_cpu_layouts.py (each run here starts an engine and slime's imports: about a minute)
REFUSED = {
    "--tensor-model-parallel-size": ["--tensor-model-parallel-size", "2"],
    "--context-parallel-size": ["--context-parallel-size", "2"],
    "--expert-model-parallel-size": ["--num-experts", "4", "--moe-ffn-hidden-size", "64",
                                     "--expert-model-parallel-size", "2"],
}


@pytest.mark.parametrize("flag", list(REFUSED))
def test_unsupported_layout_is_refused_in_the_drivers_parse_args(model_dir, engine, tmp_path, flag):
    """No Ray, no train actor: slime's driver stops in parse_args with the cpu plugin's one line (slime's
    parse_args asks the external engine for its server info, so one is running)."""
    from slime_ascend.demo.slime_job import job_env, plugin_flags, slime_src

    prompts = make_prompts(tmp_path / "prompts.jsonl")
    flags = _flags(model_dir, prompts, [engine], tmp_path, ["--actor-num-gpus-per-node", "2", *REFUSED[flag]])
    cmd = [sys.executable, str(slime_src() / "train.py"), *flags, "--custom-config-path", str(_config(tmp_path)),
           *plugin_flags(PLUGINS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=job_env(PLUGINS), cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 2, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slime-ascend: error:")]
    assert len(errors) == 1 and f"cpu: {flag}" in errors[0] and "Fix:" in errors[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stdout + proc.stderr
