"""slime's own ``train.py`` on this CPU above one rank: tensor (with and without sequence), pipeline, data and context
(zig-zag and ``--allgather-cp``) parallelism of the tiny dense Qwen3, each against the one-rank run of the same job
(DIS and staleness then judge CP-split sequences as one rank judges them whole).

Every run is stock slime with the ``cpu``, ``dis`` and ``staleness`` plugins, the torch engine and disk
weight updates, 2 rollouts. The runs are made comparable: fp32 training (``bf16: false`` in the
``--custom-config-path`` YAML: slime's ``_set_default_megatron_args`` sets ``args.bf16 = not args.fp16``
whatever the command line says, and in bf16 TP 2's split matmuls round differently: up to 2.6e-3 in the
log-probs), the engine's
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
    with out.open("a") as f:  # applied after slime forces bf16 and before Megatron's validate_args picks the dtype
        f.write("\nbf16: false  # fp32 training: the layouts are compared to 2e-5\n")
    return out


def _flags(model: Path, prompts: Path, engines, work: Path, layout: list[str]) -> list[str]:
    flags = [f for f in slime_flags(model, prompts, engines, work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES) if f != "--bf16"]  # fp32: see _config
    at = flags.index("--rm-type")
    del flags[at:at + 2]
    # later flags win in slime's argparse: the layout replaces the one-rank defaults of slime_flags
    return flags + ["--custom-rm-path", "parity_reward.reward", "--sglang-enable-deterministic-inference",
                    "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"), *layout]


def _run(model: Path, work: Path, layout: list[str]):
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(model, work / "engine.log")
    try:
        run = run_slime("train.py", _flags(model, prompts, [engine], work, layout), work, PLUGINS,
                        custom_config=_config(work), extra_env={"PYTHONPATH": str(HERE)})
    finally:
        stop(engine.proc)
    print(f"\n{work.name}: {' '.join(layout) or 'one rank'}: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    assert "bf16 " + "." * 44 + " False" in run.log  # Megatron's argument dump: this run trained in fp32
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
    """Train actors slime started: one device line per actor (train.validate_at_actor_init)."""
    return run.log.count("slime accelerator in the actor train actor")


LAYOUTS = {
    "tp2": ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"],
    "tp2-sp": ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"],
    "dp2": ["--actor-num-gpus-per-node", "2"],
    # slime's zig-zag split (each sequence in 4 chunks, rank r holds chunks r and 3 - r), and --allgather-cp (the
    # packed stream in 2 contiguous pieces; slime allows it for DSA models only, the cpu spec attends in it itself)
    "cp2": ["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"],
    "cp2-allgather": ["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2", "--allgather-cp"],
}
DATA_PARALLEL = {"tp2": 1, "tp2-sp": 1, "pp2": 1, "dp2": 2, "cp2": 1, "cp2-allgather": 1}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_the_one_rank_run(model_dir, reference, tmp_path, layout):
    run = _run(model_dir, tmp_path / layout, LAYOUTS[layout])
    assert _ranks(run) == int(LAYOUTS[layout][1]), _ranks(run)
    assert "applied runtime patch train.cpu_device_properties" in run.log
    if layout == "cp2-allgather":
        assert "applied runtime patch driver.allgather_cp_local_spec" in run.log, run.log[-4000:]
    _assert_like_reference(reference, tmp_path / layout, run, DATA_PARALLEL[layout])


# one refusal in slime's own driver (the mechanism: the cpu plugin's line at parse_args, before Ray); every
# refused flag's line is unit-tested in tests/cpu/test_cpu_layouts*.py (each run here costs about a minute)
REFUSED = {
    "--moe-grouped-gemm": ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-grouped-gemm"],
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
