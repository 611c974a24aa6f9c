"""slime's own ``train.py`` on this CPU with an MoE model: the tiny Qwen3-MoE (4 experts, top 2, layer 0 dense;
``slime_job.TINY_QWEN3_MOE_ARGS``) at one rank and in two layouts compared with it: expert parallelism 2 (two
ranks) and tensor x expert parallelism 2 x 2 (four ranks, with sequence parallelism).

The same seeded, deterministic job as ``test_slime_parallel_cpu`` (its helpers: fp32 training, per-sample
sampling seeds, a reward of the response, ``--save-debug-train-data``, 2 rollouts), on the MoE checkpoint the
torch engine serves. The one-rank run is made once per module. Each layout must reproduce, from slime's own
output, its tokens of every sample exactly, its train-side log-probs (2e-5 absolute), loss masks and rewards
exactly, advantages (1e-6 absolute: GRPO's group mean and std summed in another order), and loss and grad norm of
each step (1e-4 relative; loss also 1e-7 absolute) and DIS's masked count exactly. The experts live on two EP
ranks and Megatron's all-to-all dispatcher moves the tokens over gloo; at TP 2 x EP 2 the attention, the dense MLP
and the vocabulary are split over TP and the sequence too (``--sequence-parallel``: Megatron's ``MoELayer`` refuses
MoE with TP in training without it), each expert whole on one rank of its EP group (``--expert-tensor-parallel-size
1``, what every MoE script of slime passes; the cpu plugin refuses more: gloo cannot do the dispatcher's uneven
expert-TP gather), experts replicated over expert data parallelism 2. fp32 routing has no ties here: the router's
top-2 over 4 experts of random weights is decided by margins far above fp32 rounding. The layouts' flags are what
``slime-ascend config ... --flags --ep 2`` / ``--tp 2 --ep 2 --sp`` prints (``parallel_layout.Layout``).

The weight pushes (``--update-weight-transport disk``: slime writes one HF directory per update) of each layout
hold every expert, gathered by slime's own weight iterator from the EP ranks, and the
first push is the one-rank run's byte for byte; the later ones (trained weights) within 1e-4 relative, 1e-6
absolute.

Measured on the 2-core Intel Xeon host (AVX-512), 2026-12-03: one rank 0.79 min, EP 2 0.67 min, TP 2 x EP 2 1.02 min
(slime's train.py each; the module 2.9 min). Largest gaps to the one-rank run, EP 2 / TP 2 x EP 2: log-probs 4.8e-7 /
4.8e-7, advantages 0 / 0, grad norm 9.5e-8 / 2.7e-6 relative, loss 1.5e-8 / 7.5e-9 absolute (GRPO's loss here is
~1e-8), trained pushes 5.4e-8 / 5.2e-7 absolute; DIS masked no token in any run (``train/dis_masked`` 0).
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_fixtures import moe_model_dir  # noqa: F401  (pytest fixture)
from slime_ascend.demo.slime_job import TINY_QWEN3_MOE_ARGS, make_prompts, run_slime, slime_flags, start_engine, stop
from slime_ascend.parallel_layout import Layout

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1800)]

# the job of test_slime_parallel_cpu at HEAD 0b89654, its helpers kept here (that file's helpers now take other
# arguments)
PLUGINS = ("cpu", "dis", "staleness")
HERE = Path(__file__).parent
LOGPROB_ATOL = 2e-5
ADVANTAGE_ATOL = 1e-6
METRIC_RTOL = 1e-4
LOSS_ATOL = 1e-7
BATCH, N_SAMPLES, NUM_ROLLOUT = 4, 2, 2

# later flags win: replaces the dense architecture of slime_flags; keep every push (slime deletes each once loaded)
MOE = shlex.split(TINY_QWEN3_MOE_ARGS) + ["--update-weight-disk-keep-files"]
EXPERTS = 4


def _config(work: Path) -> Path:
    out = work / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    with out.open("a") as f:  # applied after slime forces bf16 and before Megatron's validate_args picks the dtype
        f.write("\nbf16: false  # fp32 training: the layouts are compared to 2e-5\n")
    return out


def _run(model: Path, work: Path, layout: list[str]):
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(model, work / "engine.log")
    flags = [f for f in slime_flags(model, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES) if f != "--bf16"]  # fp32: see _config
    at = flags.index("--rm-type")
    del flags[at:at + 2]
    # later flags win in slime's argparse: the layout replaces the one-rank defaults of slime_flags
    flags += ["--custom-rm-path", "parity_reward.reward", "--sglang-enable-deterministic-inference",
              "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"), *layout]
    try:
        run = run_slime("train.py", flags, work, PLUGINS, custom_config=_config(work),
                        extra_env={"PYTHONPATH": str(HERE)})
    finally:
        stop(engine.proc)
    print(f"\n{work.name}: {' '.join(layout)}: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    assert "bf16 " + "." * 44 + " False" in run.log  # Megatron's argument dump: this run trained in fp32
    return run


def _samples(work: Path, rollout_id: int) -> dict[int, dict]:
    import torch

    dump = torch.load(work / "dump" / f"train_{rollout_id}.pt", weights_only=False)
    return {s["sample_index"]: s for s in dump["samples"]}


def _dp_shards(work: Path, rollout_id: int) -> int:
    import torch

    return len(torch.load(work / "dump" / f"train_{rollout_id}.pt", weights_only=False)["dp_shards"])


def _steps(run) -> list[dict]:
    return [m for m in run.metrics() if "train/step" in m]


def _ranks(run) -> int:
    """Train actors slime started: one device line per actor (train.validate_at_actor_init)."""
    return run.log.count("slime accelerator in the actor train actor")


def _assert_like_reference(reference, work: Path, run, dp: int) -> None:
    """Tokens and train-side log-probs of every sample of every rollout, and loss, grad norm and DIS mask count
    of every step, as the reference run's."""
    import torch

    ref_work, ref_run = reference
    for rollout_id in range(NUM_ROLLOUT):
        ref, got = _samples(ref_work, rollout_id), _samples(work, rollout_id)
        assert sorted(got) == sorted(ref) and len(ref) == BATCH * N_SAMPLES, (rollout_id, sorted(got), sorted(ref))
        assert _dp_shards(work, rollout_id) == dp
        for index, sample in ref.items():
            assert torch.equal(torch.as_tensor(got[index]["tokens"]), torch.as_tensor(sample["tokens"])), \
                (rollout_id, index)
            torch.testing.assert_close(torch.as_tensor(got[index]["log_probs"]),
                                       torch.as_tensor(sample["log_probs"]), rtol=0, atol=LOGPROB_ATOL)
            assert torch.equal(torch.as_tensor(got[index]["loss_masks"]), torch.as_tensor(sample["loss_masks"])), \
                (rollout_id, index)
            assert float(got[index]["rewards"]) == float(sample["rewards"]), (rollout_id, index)
            torch.testing.assert_close(torch.as_tensor(got[index]["advantages"]),
                                       torch.as_tensor(sample["advantages"]), rtol=0, atol=ADVANTAGE_ATOL)
        assert any(float(abs(torch.as_tensor(s["advantages"])).max()) > 0 for s in ref.values())
    ref_steps, steps = _steps(ref_run), _steps(run)
    assert [m["train/step"] for m in steps] == [m["train/step"] for m in ref_steps] == list(range(NUM_ROLLOUT))
    for ref_m, m in zip(ref_steps, steps):
        assert math.isclose(m["train/grad_norm"], ref_m["train/grad_norm"], rel_tol=METRIC_RTOL), (m, ref_m)
        assert math.isclose(m["train/loss"], ref_m["train/loss"], rel_tol=METRIC_RTOL, abs_tol=LOSS_ATOL), (m, ref_m)
        assert m["train/dis_masked"] == ref_m["train/dis_masked"]
    assert any(m["train/grad_norm"] > 0 for m in ref_steps)  # the reward varied: the comparison has gradients


def _pushes(work: Path) -> list[Path]:
    return sorted(p for p in (work / "weights").iterdir() if p.is_dir())


def _pushed_tensors(push: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(push.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.fixture(scope="module")
def moe_reference(moe_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("moe-one-rank")
    return work, _run(moe_model_dir, work, MOE)


def test_moe_one_rank_runs_slimes_loop_and_pushes_every_expert(moe_model_dir, moe_reference):
    from slime_ascend.rollout.torch_engine.model import load_model, validate_state_dict

    work, run = moe_reference
    assert _ranks(run) == 1
    steps = _steps(run)
    assert [m["train/step"] for m in steps] == [0, 1] and any(m["train/grad_norm"] > 0 for m in steps)
    pushes = _pushes(work)
    assert pushes, "slime pushed no weights"
    state = _pushed_tensors(pushes[-1])
    experts = {n for n in state if ".mlp.experts." in n}
    assert experts == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(EXPERTS)
                       for p in ("gate", "up", "down")}
    validate_state_dict(load_model(moe_model_dir), state, source=str(pushes[-1]))  # the engine loads it
    # the push after the last step carries trained weights, not the checkpoint's
    first, last = _pushed_tensors(pushes[0]), state
    assert any(not first[n].equal(last[n]) for n in experts)


def _megatron_args(run, name: str) -> set[str]:
    """``name``'s values in Megatron's argument dumps (``_print_args`` after ``validate_args``, the driver's and any
    other process's: the name, dots to column 48, the value)."""
    import re

    found = set(re.findall(rf"\b{name} \.+ (\S+)$", run.log, re.MULTILINE))
    assert found, f"{name} not in Megatron's argument dump"
    return found


# the flags `slime-ascend config cpu dis staleness --flags --ep 2` (--tp 2 --ep 2 --sp) prints after the plugins'
# (later flags win over slime_flags' one-rank sizes); ranks and data parallelism each layout must have
LAYOUTS = {
    # Megatron's all-to-all dispatcher over gloo (its split sizes made host values by train.cpu_moe_splits)
    "ep2": (Layout(ep=2), {"tensor_model_parallel_size": "1", "expert_model_parallel_size": "2",
                           "expert_tensor_parallel_size": "1", "sequence_parallel": "False"}),
    # four ranks: TP 2 with sequence parallelism, EP 2 carved out of DP 2, expert TP 1 (so expert DP 2)
    "tp2-ep2": (Layout(tp=2, ep=2, sp=True), {"tensor_model_parallel_size": "2", "expert_model_parallel_size": "2",
                                               "expert_tensor_parallel_size": "1", "sequence_parallel": "True"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_the_one_rank_moe_run(moe_model_dir, moe_reference, tmp_path, layout):
    import torch

    from parallel_evidence import assert_same_tensors

    shape, megatron_args = LAYOUTS[layout]
    work = tmp_path / layout
    run = _run(moe_model_dir, work, MOE + shape.flags())
    assert _ranks(run) == shape.world, _ranks(run)
    for name, value in megatron_args.items():  # the layout Megatron built, from its own argument dump
        assert _megatron_args(run, name) == {value}, (name, _megatron_args(run, name))
    _assert_like_reference(moe_reference, work, run, dp=shape.data_parallel)  # EP 2 carved out of DP 2
    # pushes: all experts, gathered over EP; the first (before any step) byte-identical to one rank's
    ref_pushes, pushes = _pushes(moe_reference[0]), _pushes(work)
    assert [p.name for p in pushes] == [p.name for p in ref_pushes]
    for ref_push, push in zip(ref_pushes, pushes):
        ref_state, state = _pushed_tensors(ref_push), _pushed_tensors(push)
        assert sorted(state) == sorted(ref_state)
        assert len([n for n in state if ".mlp.experts." in n]) == 3 * EXPERTS
    assert_same_tensors(pushes[0], ref_pushes[0])  # names, dtypes, shapes and bytes
    for ref_push, push in zip(ref_pushes[1:], pushes[1:]):  # trained weights: fp32 sums in another order
        ref_state, state = _pushed_tensors(ref_push), _pushed_tensors(push)
        for name, tensor in ref_state.items():
            torch.testing.assert_close(state[name].float(), tensor.float(), rtol=METRIC_RTOL, atol=1e-6)
