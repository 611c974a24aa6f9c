"""slime's own ``train.py`` on this CPU above one rank: tensor (with sequence parallelism), pipeline, data and context
(zig-zag and ``--allgather-cp``) parallelism of the tiny dense Qwen3, each against the one-rank run of the same job,
with the plugin families that compose in one job: ``dis`` + ``staleness`` + ``tito`` + ``reward-mix`` +
``int8-sync``. (The other families, which cannot share these runs, are checked at the one layout each of their
contracts lives in by ``test_slime_parallel_families_cpu.py``.)

Why one job carries five families: CI time (each slime-loop run costs 1.5-3 min on 2 cores) does not allow a
cross product of families and layouts, and the evidence of each family stays separable here: DIS's masked
fraction (``train/dis_masked``) and its decision for every token, staleness's and tito's per-rollout reports,
reward-mix's per-sample record and its failed samples (the grader ``reward_terms.flaky`` fails every fourth sample:
loss mask 0, the staleness group rule pads it), and int8-sync's pushed bytes. ``icepop`` cannot join (``dis`` in ratio mode and
IcePop apply the same ratio twice), nor ``opd`` (it owns slime's reward model as reward-mix does, and its
custom loss bypasses the TIS hook DIS acts in).

Every run is stock slime with the ``cpu`` plugin, the torch engine serving ``slime-ascend quantize --format
int8-w8a8`` of the tiny model (int8-sync pushes every version in that format) and disk weight updates, 2 rollouts.
The runs are made comparable: fp32 training (``bf16: false`` in the ``--custom-config-path`` YAML: slime's
``_set_default_megatron_args`` sets ``args.bf16 = not args.fp16`` whatever the command line says, and in bf16
TP 2's split matmuls round differently: up to 2.6e-3 in the log-probs), the engine's sampling seeded per sample
(``--sglang-enable-deterministic-inference``: slime sends ``sampling_seed = --rollout-seed + i``), and a reward
that is a function of the response (``parity_reward.reward``, reward-mix's ``parity`` component). The one-rank
run is made once per module; each layout must then reproduce, from slime's own output:

* per sample (``--save-debug-train-data``: slime gathers every DP rank on the last pipeline stage and restores
  CP-split fields): the tokens, the train-side log-probs, the loss mask, the advantages and the reward, and
  reward-mix's record (components, penalties, failure);
* per train step (slime's step metrics): loss, grad norm, DIS's masked fraction; per rollout: staleness's
  kept/padded/dropped counts and tito's checked samples;
* DIS's decision for every token (``parallel_evidence.dis_decisions``: the plugin's band test on the dumped
  train-side and engine log-probs). DIS's band (``DIS_EPS``) is set so that it masks real tokens: the engine serves
  W8A8 weights, the trainer fp32 ones, and |log w| ~ 1e-3 straddles the band's edges; some tokens are masked and
  some kept in every rollout (asserted). The same check refuses, on each run's own dump, the decisions a DIS mask
  computed on one CP shard only would give (CP rank 1's tokens of a CP 2 split all kept): the comparison has teeth;
* the first weights slime pushed (``weight_v000001``, gathered from the layout's shards and quantised in the
  train actor): byte-identical to the one-rank run's, and to ``slime-ascend quantize --format int8-w8a8`` of the
  checkpoint slime loaded, upcast to the fp32 it trains and pushes in (``parallel_evidence.fp32_copy``).

The second rollout is generated with the weights the first step trained, so its tokens and log-probs also check
the optimizer step of each layout.

Tolerances are for fp32 summed in another order (TP splits the matmuls, DP all-reduces the gradients, PP
sends activations, CP attends over gathered keys): log-probs to 2e-5 absolute; advantages to 1e-6 absolute
(GRPO's are computed from the same rewards: only the sum order of the group mean and std can differ); grad norm
and loss to 1e-4 relative (loss also 1e-7 absolute; GRPO's loss here is ~1e-5); DIS's masked fraction to 1e-6
relative (the same decisions averaged in another order); masks, DIS's decisions, tokens, rewards, counts and bytes
exactly.

Tensor parallelism without ``--sequence-parallel`` (``tp2``) passed the same checks and runs with
``SLIME_ASCEND_ALL_CASES=1``; CI runs ``tp2-sp`` in its place: the plugins of this job see TP 2 the same way with or
without sequence parallelism (the vocabulary-parallel logits their log-probs come from, the TP shards int8-sync gathers
and quantises), and TP 2 without it is checked against the one-rank run in slime's loop by the ``opd`` runs of
``test_slime_parallel_families_cpu.py`` (CI time: 1.9-2.8 min a run on 2 busy cores).

Context parallelism in slime's zig-zag split (``cp2``) passed the same checks and runs with
``SLIME_ASCEND_ALL_CASES=1``; CI runs ``cp2-allgather`` in its place: in both, slime hands these plugins' hooks the
same zig-zag shards (``--allgather-cp`` only adds slime's own re-slicing of what it computed contiguously), so their
CP code (DIS's CP-local decisions with the check that has teeth, staleness, tito, reward-mix, int8-sync's gathered
push) runs the same; and the zig-zag split itself, with the cpu spec's zig-zag attention, is checked against the
one-rank run in slime's loop by ``test_slime_parallel_families_cpu.py``'s two CP 2 runs (CI time: 2 min a run).

The refusal of an unsupported layout at slime's ``parse_args`` is unit-tested flag by flag in
``tests/cpu/test_cpu_layouts*.py``; its slime-loop run (about a minute) was dropped from this module to pay for
the family runs.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_evidence import train_ranks as _ranks
from conftest import all_cases
from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags, start_engine, stop
from e2e_fixtures import model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1800)]

PLUGINS = ("cpu", "dis", "staleness", "tito", "reward-mix", "int8-sync")
QUANT_FORMAT = "int8-w8a8"
HERE = Path(__file__).parent
LOGPROB_ATOL = 2e-5
ADVANTAGE_ATOL = 1e-6
METRIC_RTOL = 1e-4
LOSS_ATOL = 1e-7
BATCH, N_SAMPLES, NUM_ROLLOUT = 4, 2, 2
FAILED = BATCH * N_SAMPLES // 4  # reward_terms.flaky fails every fourth sample
TRAINED = BATCH * N_SAMPLES - FAILED
# DIS's band (ascend_dis_preset custom): keep 1 - eps < w < 1 + eps. The engine serves W8A8 weights (int8-sync),
# so |log w| = |train-side fp32 log-prob - engine log-prob| is ~1e-3 (IcePop's CP 2 run measured median 1.1e-3, max
# 2.8e-3 on the tiny model): this band masks a part of the tokens and keeps the rest, in every layout the same ones
# Measured (one rank, TP 2 the same): 10 of rollout 0's 48 trainable tokens masked, 15 of rollout 1's (4 and 9 of them
# on CP rank 1 of a CP 2 split); the closest log w lies 2.3e-5 from an edge, while TP 2's log-probs differ from one
# rank's by 4.8e-7 at most
DIS_EPS = 1.5e-3
DIS_RTOL = 1e-6  # train/dis_masked: the same decisions, averaged per sample and over samples in another order


# reward-mix: the parity reward, a judge that fails every fourth sample (an environment failure: loss mask 0)
# and a length penalty, so each sample's record has components, a penalty and sometimes a failure
REWARD_COMPONENTS = [{"name": "parity", "path": "parity_reward.reward", "weight": 1.0},
                     {"name": "judge", "path": "reward_terms.flaky", "weight": 0.5}]
REWARD_PENALTIES = [{"name": "length", "path": "slime_ascend.reward_mix.terms.response_length", "lambda": 0.25,
                     "kwargs": {"budget": 4}}]


def _config(work: Path) -> Path:
    import yaml

    out = work / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    cfg = yaml.safe_load(out.read_text())
    cfg["ascend_reward_components"] = REWARD_COMPONENTS
    cfg["ascend_reward_penalties"] = REWARD_PENALTIES
    cfg.update(ascend_dis_preset="custom", ascend_dis_eps_low=DIS_EPS, ascend_dis_eps_high=DIS_EPS)
    # fp32 training (the layouts are compared to 2e-5): applied after slime forces bf16 and before Megatron's
    # validate_args picks the dtype
    cfg["bf16"] = False
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _flags(model: Path, engine_checkpoint: Path, prompts: Path, engines, work: Path, layout: list[str]) -> list[str]:
    flags = [f for f in slime_flags(model, prompts, engines, work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES) if f != "--bf16"]  # fp32: see _config
    at = flags.index("--rm-type")
    del flags[at:at + 2]  # reward-mix owns slime's reward model (custom_rm_path in the YAML)
    # the engine's (quantised) checkpoint is --hf-checkpoint: its format is what int8-sync pushes; Megatron
    # loads the BF16 weights from --load
    flags[flags.index("--hf-checkpoint") + 1] = str(engine_checkpoint)
    # the judge fails 2 of the 8 samples of every rollout (sample index % 4 == 3); staleness pads them (no loss, no
    # rollout count), so a train step is the 6 rollouts left
    flags[flags.index("--global-batch-size") + 1] = str(TRAINED)
    # later flags win in slime's argparse: the layout replaces the one-rank defaults of slime_flags
    return flags + ["--sglang-enable-deterministic-inference", "--update-weight-disk-keep-files",
                    "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"), *layout]


def _run(model: Path, engine_checkpoint: Path, work: Path, layout: list[str]):
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(engine_checkpoint, work / "engine.log", ready=False)
    try:
        run = run_slime("train.py", _flags(model, engine_checkpoint, prompts, [engine], work, layout), work,
                        PLUGINS, custom_config=_config(work), extra_env={"PYTHONPATH": str(HERE)})
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
def quantized(model_dir, tmp_path_factory) -> Path:
    """``slime-ascend quantize`` of the tiny model: the engine's checkpoint."""
    from parallel_evidence import quantize

    return quantize(model_dir, tmp_path_factory.mktemp("quantized") / f"tiny-qwen3-{QUANT_FORMAT}", QUANT_FORMAT)


@pytest.fixture(scope="module")
def first_push(model_dir, tmp_path_factory) -> Path:
    """What the first push must equal (``parallel_evidence.first_push_reference``: the loaded weights in the fp32
    the job trains and pushes them in, quantised)."""
    from parallel_evidence import first_push_reference

    return first_push_reference(model_dir, tmp_path_factory.mktemp("first-push"), QUANT_FORMAT)


@pytest.fixture(scope="module")
def reference(model_dir, quantized, tmp_path_factory):
    work = tmp_path_factory.mktemp("one-rank")
    return work, _run(model_dir, quantized, work, [])


def _assert_like_reference(reference, quantized: Path, first_push: Path, work: Path, run, dp: int) -> None:
    import torch

    from parallel_evidence import assert_same_tensors

    ref_work, ref_run = reference
    for rollout_id in range(NUM_ROLLOUT):
        ref, got = _samples(ref_work, rollout_id), _samples(work, rollout_id)
        assert sorted(got) == sorted(ref) and len(ref) >= TRAINED, (rollout_id, sorted(got), sorted(ref))
        assert len(_train_dump(work, rollout_id)["dp_shards"]) == dp
        for index, sample in ref.items():
            assert torch.equal(torch.as_tensor(got[index]["tokens"]), torch.as_tensor(sample["tokens"])), \
                (rollout_id, index)  # the same rollout: the engine served the same weights
            torch.testing.assert_close(torch.as_tensor(got[index]["log_probs"]),
                                       torch.as_tensor(sample["log_probs"]), rtol=0, atol=LOGPROB_ATOL)
            assert torch.equal(torch.as_tensor(got[index]["loss_masks"]), torch.as_tensor(sample["loss_masks"])), \
                (rollout_id, index)
            torch.testing.assert_close(torch.as_tensor(got[index]["advantages"]),
                                       torch.as_tensor(sample["advantages"]), rtol=0, atol=ADVANTAGE_ATOL)
            assert float(got[index]["rewards"]) == float(sample["rewards"]), (rollout_id, index)
            # reward-mix's record travelled with the sample, the same in every layout (the judge's failures too)
            assert got[index]["metadata"]["reward_mix"] == sample["metadata"]["reward_mix"], (rollout_id, index)
        # the judge's failures train nothing (if slime keeps them in its train data at all), the others train
        for index, sample in ref.items():
            failed = sample["metadata"]["reward_mix"]["failure"] is not None
            assert failed == (index % 4 == 3) and (float(sample["loss_masks"].sum()) == 0) == failed, index
        assert any(float(abs(s["advantages"]).max()) > 0 for s in ref.values())
    ref_steps, steps = _steps(ref_run), _steps(run)
    assert [m["train/step"] for m in steps] == [m["train/step"] for m in ref_steps] == list(range(NUM_ROLLOUT))
    for ref_m, m in zip(ref_steps, steps):
        assert math.isclose(m["train/grad_norm"], ref_m["train/grad_norm"], rel_tol=METRIC_RTOL), (m, ref_m)
        assert math.isclose(m["train/loss"], ref_m["train/loss"], rel_tol=METRIC_RTOL, abs_tol=LOSS_ATOL), (m, ref_m)
        assert math.isclose(m["train/dis_masked"], ref_m["train/dis_masked"], rel_tol=DIS_RTOL), (m, ref_m)
        assert 0 < ref_m["train/dis_masked"] < 1, ref_m  # DIS masked real tokens and kept others
    assert any(m["train/grad_norm"] > 0 for m in ref_steps)  # the reward varied: the comparison has gradients
    _assert_dis_decisions_alike(ref_work, work)
    # the plugins ran in every train rank and judged every rollout, as the one-rank run did
    assert run.log.count("slime-ascend plugins active: " + ", ".join(PLUGINS)) >= 2
    for key in ("rollout/staleness_kept", "rollout/staleness_padded", "rollout/staleness_dropped",
                "rollout/tito_checked_samples", "rollout/reward_mix_failed"):
        counts, ref_counts = _reports(run, key), _reports(ref_run, key)
        assert counts == ref_counts and len(counts) == NUM_ROLLOUT, (key, counts, ref_counts)
    assert all(TRAINED <= n <= BATCH * N_SAMPLES for n in _reports(run, "rollout/tito_checked_samples"))
    assert _reports(run, "rollout/staleness_padded") == [FAILED] * NUM_ROLLOUT  # the failed samples were padded
    assert _reports(run, "rollout/staleness_kept") == [TRAINED] * NUM_ROLLOUT
    # int8-sync: the first version pushed (the loaded weights, gathered from this layout's shards, quantised in the
    # train actor) is byte-identical to `slime-ascend quantize` of those weights, and to the one-rank run's
    assert f"int8-sync: rollout checkpoint {quantized} is {QUANT_FORMAT}" in run.log
    assert_same_tensors(work / "weights" / "weight_v000001", first_push)
    assert_same_tensors(work / "weights" / "weight_v000001", ref_work / "weights" / "weight_v000001")
    versions = sorted(p.name for p in (work / "weights").iterdir())
    assert versions == [f"weight_v{v:06d}" for v in range(1, NUM_ROLLOUT + 2)], versions


def _assert_dis_decisions_alike(ref_work: Path, work: Path) -> None:
    """DIS's decision for every token of every rollout (from slime's dumped train-side and engine log-probs, with the
    plugin's own band test): the same in the layout as at one rank, some tokens masked and some kept. And the
    comparison's teeth, on this run's own evidence: the decisions a DIS mask computed on one CP shard only would
    leave (the tokens slime's zig-zag split gives CP rank 1 all kept) are refused."""
    from parallel_evidence import assert_same_decisions, band_margin, dis_decisions, one_cp_shard_only

    for rollout_id in range(NUM_ROLLOUT):
        ref, got = _samples(ref_work, rollout_id), _samples(work, rollout_id)
        want, have = dis_decisions(ref, DIS_EPS, DIS_EPS), dis_decisions(got, DIS_EPS, DIS_EPS)
        assert_same_decisions(have, want)
        trainable = sum(int(s["loss_masks"].sum()) for s in ref.values())
        masked = sum(int((~keep).sum()) for keep in want.values())
        broken = one_cp_shard_only(have, got)
        lost = masked - sum(int((~keep).sum()) for keep in broken.values())  # masked tokens on CP rank 1
        print(f"dis rollout {rollout_id}: {masked} of {trainable} trainable tokens masked ({lost} of them on CP "
              f"rank 1 of a CP 2 split); closest log w to the band's edges {band_margin(ref, DIS_EPS, DIS_EPS):.2e}")
        assert 0 < masked < trainable, (rollout_id, masked, trainable)
        assert lost > 0, rollout_id
        with pytest.raises(AssertionError):
            assert_same_decisions(broken, want)


def _reports(run, key: str) -> list:
    return [m[key] for m in run.metrics() if key in m]


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


# CI: every layout but tp2 and cp2 (module docstring); SLIME_ASCEND_ALL_CASES=1 runs them all
CI_LAYOUTS = [name for name in LAYOUTS
              if name not in ("tp2", "cp2") or all_cases()]


@pytest.mark.parametrize("layout", CI_LAYOUTS)
def test_layout_matches_the_one_rank_run(model_dir, quantized, first_push, reference, tmp_path, layout):
    run = _run(model_dir, quantized, tmp_path / layout, LAYOUTS[layout])
    assert _ranks(run) == int(LAYOUTS[layout][1]), _ranks(run)
    assert "applied runtime patch train.cpu_device_properties" in run.log
    if layout == "cp2-allgather":
        assert "applied runtime patch driver.allgather_cp_local_spec" in run.log, run.log[-4000:]
    _assert_like_reference(reference, quantized, first_push, tmp_path / layout, run, DATA_PARALLEL[layout])
