"""slime's own ``train.py`` on this CPU with an MoE model: the tiny Qwen3-MoE (4 experts, top 2, layer 0 dense;
``slime_job.TINY_QWEN3_MOE_ARGS``) at one rank and in two layouts compared with it: expert parallelism 2 (two
ranks) and tensor x expert parallelism 2 x 2 (four ranks, with sequence parallelism), with the plugin families
whose contracts are about MoE weights: ``sao`` (its critic is the MoE model too: SAO freezes the critic's attention
and trains only its MLPs, experts included) and ``fp8-sync`` (every expert gathered from the EP ranks, converted and
quantised for the weight push).

The job: slime's PPO path with its critic role (``--advantage-estimator ppo``, one sample per prompt, 8 prompts a
rollout, K = 2 critic passes per rollout, ``--megatron-config-path`` from ``slime-ascend config``, whose critic role
freezes ``self_attention``), the engine serving ``slime-ascend quantize --format fp8-block`` of the checkpoint,
fp32 training, per-sample sampling seeds, a reward of the response (``parity_reward``), ``--save-debug-train-data``
(the actor's: slime's critic writes no dump, its values reach the actor's), 2 rollouts, disk weight pushes. The critic
gets the actor's layout (slime places both in one group). The one-rank run is made once per module. Each layout must
reproduce, from slime's own output:

* the actor's dump, per sample: its tokens exactly, train-side log-probs and the engine's (2e-5 absolute), loss
  masks and rewards exactly, the critic's values (2e-5, a forward like the log-probs), SAO's skip-observation GAE
  advantages and returns (1e-4: GAE sums a response's TD residuals, each from two values within 2e-5) and its
  length-adaptive lambdas exactly;
* per step: the actor's loss, SAO's DIS loss and grad norm (1e-4 relative; 1e-7 absolute), DIS's masked fraction,
  slime's mean |train - engine| log-prob (2e-5 absolute); the critic's value loss and grad norm of each of its K
  passes (1e-4 relative);
* the critic's Megatron checkpoint (slime's ``--save``, the critic's own directory, read whole by
  torch.distributed.checkpoint: the EP ranks' experts and TP shards put together): its attention bit-identical to
  the HF checkpoint it loaded, in every layout (frozen), every expert's fc1 and fc2 changed (trained), and every
  tensor within 1e-4 relative / 1e-6 absolute of the one-rank run's;
* the first weight push (``weight_v000001``: the loaded weights, every expert gathered by slime's weight iterator
  from the EP ranks, quantised in the train actor) byte-identical to ``slime-ascend quantize --format fp8-block`` of
  those weights in the fp32 the job trains in (``parallel_evidence.fp32_copy``) and to the one-rank run's; the
  later pushes (trained weights) the one-rank run's, unquantised tensors and scales within 1e-4 relative / 1e-6
  absolute and fp8 codes equal except those one e4m3 step apart (a weight on a rounding boundary), at most 0.1% of
  them; the engine loaded every push in fp8-block.

CI runs the one-rank run and TP 2 x EP 2 (:data:`CI_LAYOUTS`); EP 2 alone passed the same checks (numbers below) and
runs with ``SLIME_ASCEND_ALL_CASES=1``: the four-rank layout runs expert parallelism 2 too, and CI's time is
spent where the evidence is new.

The experts live on two EP ranks and Megatron's all-to-all dispatcher moves the tokens over gloo; at TP 2 x EP 2 the
attention, the dense MLP and the vocabulary are split over TP and the sequence too (``--sequence-parallel``:
Megatron's ``MoELayer`` refuses MoE with TP in training without it), each expert whole on one rank of its EP group
(``--expert-tensor-parallel-size 1``, what every MoE script of slime passes; the cpu plugin refuses more: gloo cannot
do the dispatcher's uneven expert-TP gather), experts replicated over expert data parallelism 2. fp32 routing has
no ties here: the router's top-2 over 4 experts of random weights is decided by margins far above fp32 rounding.
The critic's value head is not in the HF checkpoint: slime draws it after building the model, the same draw in
every layout because the cpu spec's experts draw their initial weights for all experts in every layout
(``cpu.spec.LocalGroupedLinear``). The layouts' flags are what ``slime-ascend config ... --flags --ep 2`` /
``--tp 2 --ep 2 --sp`` prints (``parallel_layout.Layout``).

``dis`` (and ``staleness``, ``tito``, ``reward-mix``, ``int8-sync``) run in the dense layouts of
``test_slime_parallel_cpu.py``: ``dis`` cannot share a job with ``sao`` (sao applies DIS itself, on the engine's
log-probs).

Measured on the 2-core Intel Xeon host (AVX-512), 2026-12-03, the host shared with other jobs: slime's train.py one
rank 0.81 min and EP 2 1.03 min (1-minute load 2-5; pytest: 57 s setup, 69 s call), TP 2 x EP 2 2.69 min (load
8-11); before sao and fp8-sync joined: 0.79, 0.67 and 1.02 min (pytest: 46 s, 49 s, 71 s). The critic's train
processes start after the actor's (slime's log: 19 s, 17 s and 35 s later) and save their checkpoint after the
actor's (2 s, 4 s, 11 s). Largest gaps to the one-rank run, EP 2 / TP 2 x EP 2: train-side and
engine log-probs 4.8e-7 / 4.8e-7, values 1.2e-7 / 1.2e-7, advantages 1.3e-7 / 1.5e-7, returns 1.2e-7 / 1.8e-7,
loss 9.3e-8 / 9.3e-8 and grad norm 1.5e-7 / 9.7e-7 relative, critic value loss 1.2e-7 / 1.2e-7 and grad norm 2.0e-7
/ 1.5e-7 relative, the critic checkpoint 4.3e-8 / 8.9e-8 absolute, trained pushes: no fp8 code flipped (of 73728),
unquantised tensors 2.2e-8 / 5.6e-7 absolute. SAO's DIS band (maths) masked no token (the fp8 engine's log-probs
are 3.5e-3 from the fp32 trainer's on average): DIS with a band that masks is checked in
``test_slime_parallel_cpu.py``.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest

from e2e_fixtures import moe_model_dir  # noqa: F401  (pytest fixture)
from parallel_evidence import megatron_args as _megatron_args, pushes as _pushes, train_ranks as _ranks
from conftest import all_cases
from slime_ascend.demo.slime_job import TINY_QWEN3_MOE_ARGS, make_prompts, run_slime, slime_flags, start_engine, stop
from slime_ascend.parallel_layout import Layout

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1800)]

PLUGINS = ("cpu", "sao", "fp8-sync")
QUANT_FORMAT = "fp8-block"
HERE = Path(__file__).parent
LOGPROB_ATOL = 2e-5
VALUE_ATOL = 2e-5
GAE_ATOL = 1e-4
METRIC_RTOL = 1e-4
LOSS_ATOL = 1e-7
PUSH_ATOL = 1e-6
MAX_FLIPPED = 1e-3  # fp8 codes of a trained push one step from the one-rank run's
BATCH, N_SAMPLES, NUM_ROLLOUT = 8, 1, 2  # SAO: one sample per prompt
SAO_K = 2

# later flags win: replaces the dense architecture of slime_flags; keep every push (slime deletes each once loaded)
MOE = shlex.split(TINY_QWEN3_MOE_ARGS) + ["--update-weight-disk-keep-files"]
EXPERTS = 4


def _cli(*argv: str) -> None:
    """``slime-ascend ARGV``: the command's own ``main``, in this process (a subprocess costs a Python start and a
    torch import, 3-15 s on a 2-core host)."""
    import contextlib
    import io

    from slime_ascend.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(list(argv))
    assert rc == 0, (argv, out.getvalue())


def _config(work: Path) -> tuple[Path, Path]:
    """The plugins' YAML and sao's role config beside it (``slime-ascend config`` writes both), the critic given its
    own checkpoint directory."""
    import yaml

    from slime_ascend.sao.role_config import write_megatron_role_config

    out, role = work / "ascend.yaml", work / "sao_megatron.yaml"
    _cli("config", *PLUGINS, "--set", f"ascend_sao_critic_iters={SAO_K}", "-o", str(out))
    cfg = yaml.safe_load(out.read_text())
    cfg["bf16"] = False  # fp32 training (the layouts are compared to 2e-5); see test_slime_parallel_cpu.py
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    write_megatron_role_config(str(role), merge_from=str(role), save=str(work / "critic_ckpt"))
    return out, role


def _run(model: Path, quantized: Path, work: Path, layout: list[str]):
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(work / "prompts.jsonl")
    config, role = _config(work)
    engine = start_engine(quantized, work / "engine.log")
    flags = [f for f in slime_flags(model, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES) if f != "--bf16"]  # fp32: see _config
    at = flags.index("--rm-type")
    del flags[at:at + 2]
    # the engine's (quantised) checkpoint is --hf-checkpoint: its format is what fp8-sync pushes; Megatron loads
    # the BF16 weights from --load
    flags[flags.index("--hf-checkpoint") + 1] = str(quantized)
    # later flags win in slime's argparse: the layout replaces the one-rank defaults of slime_flags
    flags += ["--custom-rm-path", "parity_reward.reward", "--sglang-enable-deterministic-inference",
              "--advantage-estimator", "ppo", "--megatron-config-path", str(role),
              "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"), *layout]
    try:
        run = run_slime("train.py", flags, work, PLUGINS, custom_config=config, extra_env={"PYTHONPATH": str(HERE)})
    finally:
        stop(engine.proc)
    print(f"\n{work.name}: {' '.join(layout)}: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    assert "bf16 " + "." * 44 + " False" in run.log  # Megatron's argument dump: this run trained in fp32
    assert run.log.count("slime-ascend plugins active: " + ", ".join(PLUGINS)) >= 2
    return run


def _dump(work: Path, rollout_id: int) -> dict:
    import torch

    return torch.load(work / "dump" / f"train_{rollout_id}.pt", weights_only=False)


def _samples(work: Path, rollout_id: int) -> dict[int, dict]:
    return {s["sample_index"]: s for s in _dump(work, rollout_id)["samples"]}


def _steps(run, key: str = "train/grad_norm") -> list[dict]:
    return [m for m in run.metrics() if key in m]


@pytest.fixture(scope="module")
def quantized(moe_model_dir, tmp_path_factory) -> Path:
    """``slime-ascend quantize --format fp8-block`` of the MoE checkpoint: the engine's."""
    from parallel_evidence import quantize

    return quantize(moe_model_dir, tmp_path_factory.mktemp("quantized") / f"tiny-qwen3-moe-{QUANT_FORMAT}",
                    QUANT_FORMAT)


@pytest.fixture(scope="module")
def first_push(moe_model_dir, tmp_path_factory) -> Path:
    """What the first push must equal (``parallel_evidence.first_push_reference``)."""
    from parallel_evidence import first_push_reference

    return first_push_reference(moe_model_dir, tmp_path_factory.mktemp("first-push"), QUANT_FORMAT)


@pytest.fixture(scope="module")
def moe_reference(moe_model_dir, quantized, tmp_path_factory):
    work = tmp_path_factory.mktemp("moe-one-rank")
    return work, _run(moe_model_dir, quantized, work, MOE)


EXPERT_WEIGHTS = {f"model.layers.1.mlp.experts.{e}.{p}_proj.{w}" for e in range(EXPERTS)
                  for p in ("gate", "up", "down") for w in ("weight", "weight_scale_inv")}


def _assert_pushes(work: Path, first_push: Path, engine_log: str) -> list[Path]:
    """Every version pushed holds every expert in fp8-block and the engine loaded it; the first is
    ``slime-ascend quantize`` of the loaded weights byte for byte."""
    import torch

    from parallel_evidence import assert_same_tensors, hf_weights

    pushes = _pushes(work)
    assert [p.name for p in pushes] == [f"weight_v{v:06d}" for v in range(1, NUM_ROLLOUT + 2)], pushes
    for push in pushes:
        state = hf_weights(push)
        assert {n for n in state if ".mlp.experts." in n} == EXPERT_WEIGHTS
        assert state["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
        assert re.search(rf"loaded weight version \S+ from \S*{push.name}/? \({QUANT_FORMAT}\)", engine_log), push
    assert_same_tensors(pushes[0], first_push)  # names, dtypes, shapes and bytes
    return pushes


def _assert_critic_checkpoint(work: Path, hf: dict) -> dict:
    """The critic's attention is the HF checkpoint's bit for bit (frozen); every expert's fc1 and fc2 trained.
    Returns the critic checkpoint's model tensors."""
    import torch

    from parallel_evidence import attention_from_hf, experts_from_hf, read_dist_checkpoint

    critic = read_dist_checkpoint(work / "critic_ckpt")
    assert critic["output_layer.weight"].shape == (1, 64)  # slime's value head, not the LM head
    for layer in range(2):
        for name, want in attention_from_hf(hf, layer).items():
            got = critic[name]
            assert got.dtype == torch.float32 and got.shape == want.shape, (name, got.dtype, got.shape)
            assert torch.equal(got, want.float()), f"critic {name} changed: its attention is frozen"
    for name, want in experts_from_hf(hf, 1, EXPERTS).items():
        got = critic[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        for e in range(EXPERTS):
            assert not torch.equal(got[e], want[e].float()), f"critic expert {e} {name} did not train"
    assert not torch.equal(critic["decoder.layers.0.mlp.linear_fc2.weight"],
                           hf["model.layers.0.mlp.down_proj.weight"].float())  # the dense MLP trains too
    return critic


def test_moe_one_rank_runs_slimes_loop_and_pushes_every_expert(moe_model_dir, first_push, moe_reference):
    from parallel_evidence import hf_weights

    work, run = moe_reference
    assert (_ranks(run), _ranks(run, "critic")) == (1, 1)
    for patch_id in ("train.critic_train_iters", "train.critic_advantage_function", "train.critic_hf_value_head",
                     "train.quantize_params"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    steps, critic_steps = _steps(run), _steps(run, "train/critic-grad_norm")
    assert [m["train/step"] for m in steps] == list(range(NUM_ROLLOUT)) and all(m["train/grad_norm"] > 0
                                                                                 for m in steps)
    assert [m["train/step"] for m in critic_steps] == [r for r in range(NUM_ROLLOUT) for _ in range(SAO_K)]
    assert all(m["train/critic-grad_norm"] > 0 for m in critic_steps)
    pushes = _assert_pushes(work, first_push, (work / "engine.log").read_text())
    # the push after the last step carries trained experts, not the checkpoint's
    first, last = hf_weights(pushes[0]), hf_weights(pushes[-1])
    assert any(not first[n].equal(last[n]) for n in EXPERT_WEIGHTS)
    _assert_critic_checkpoint(work, hf_weights(moe_model_dir))
    # the actor's dump: the critic's values, SAO's length-adaptive lambdas (< 1), and the train-side log-probs
    # sao's loss hands to it (sao.loss.capture_train_log_probs)
    for rollout_id in range(NUM_ROLLOUT):
        actor = _samples(work, rollout_id)
        assert len(actor) == BATCH * N_SAMPLES
        for index, s in actor.items():
            assert 0 < float(s["gae_lambdas"]) < 1 and "log_probs" in s and "values" in s, index
            assert s["log_probs"].shape == s["rollout_log_probs"].shape == s["loss_masks"].shape, index
        assert len({float(s["rewards"]) for s in actor.values()}) == 2  # the reward varies: advantages move


def _largest_gap(ref_work: Path, work: Path, key: str) -> float:
    import torch

    return max(float((torch.as_tensor(s[key]).float()
                      - torch.as_tensor(_samples(work, r)[i][key]).float()).abs().max())
               for r in range(NUM_ROLLOUT) for i, s in _samples(ref_work, r).items())


def _assert_like_reference(reference, hf: dict, work: Path, run, dp: int) -> dict:
    import torch

    from parallel_evidence import assert_samples_alike

    ref_work, ref_run = reference
    tolerances = {"log_probs": LOGPROB_ATOL, "rollout_log_probs": LOGPROB_ATOL, "loss_masks": None, "rewards": None,
                  "values": VALUE_ATOL, "gae_lambdas": None, "advantages": GAE_ATOL, "returns": GAE_ATOL}
    for rollout_id in range(NUM_ROLLOUT):
        assert len(_dump(work, rollout_id)["dp_shards"]) == dp
        ref = _samples(ref_work, rollout_id)
        assert len(ref) == BATCH * N_SAMPLES, (rollout_id, sorted(ref))
        assert_samples_alike(ref, _samples(work, rollout_id), tolerances, rollout_id)
        assert any(float(abs(torch.as_tensor(s["advantages"])).max()) > 0 for s in ref.values())
    steps, ref_steps = _steps(run), _steps(ref_run)
    assert [m["train/step"] for m in steps] == [m["train/step"] for m in ref_steps] == list(range(NUM_ROLLOUT))
    for ref_m, m in zip(ref_steps, steps, strict=True):
        for name in ("train/loss", "train/pg_loss", "train/grad_norm", "train/dis_masked_frac"):
            assert math.isclose(m[name], ref_m[name], rel_tol=METRIC_RTOL, abs_tol=LOSS_ATOL), (name, m, ref_m)
        assert abs(m["train/train_rollout_logprob_abs_diff"] - ref_m["train/train_rollout_logprob_abs_diff"]) \
            <= LOGPROB_ATOL, (m, ref_m)
    critic_steps, ref_critic = _steps(run, "train/critic-grad_norm"), _steps(ref_run, "train/critic-grad_norm")
    assert len(critic_steps) == len(ref_critic) == NUM_ROLLOUT * SAO_K
    for ref_m, m in zip(ref_critic, critic_steps, strict=True):
        for name in ("train/critic-value_loss", "train/critic-grad_norm"):
            assert math.isclose(m[name], ref_m[name], rel_tol=METRIC_RTOL, abs_tol=LOSS_ATOL), (name, m, ref_m)
    # the critic's checkpoint: attention frozen here too, experts trained, every tensor the one-rank run's
    critic, ref_critic_ckpt = _assert_critic_checkpoint(work, hf), _assert_critic_checkpoint(ref_work, hf)
    assert sorted(critic) == sorted(ref_critic_ckpt)
    ckpt_gap = 0.0
    for name, tensor in ref_critic_ckpt.items():
        torch.testing.assert_close(critic[name], tensor, rtol=METRIC_RTOL, atol=PUSH_ATOL,
                                   msg=lambda m: f"critic checkpoint {name}: {m}")
        ckpt_gap = max(ckpt_gap, float((critic[name] - tensor).abs().max()))
    return {key: _largest_gap(ref_work, work, key) for key in
            ("log_probs", "rollout_log_probs", "values", "advantages", "returns")} | {"critic_ckpt": ckpt_gap}


# the flags `slime-ascend config cpu sao fp8-sync --flags --ep 2` (--tp 2 --ep 2 --sp) prints after the plugins'
# (later flags win over slime_flags' one-rank sizes); ranks and data parallelism each layout must have
LAYOUTS = {
    # Megatron's all-to-all dispatcher over gloo (its split sizes made host values by train.cpu_moe_splits)
    "ep2": (Layout(ep=2), {"tensor_model_parallel_size": "1", "expert_model_parallel_size": "2",
                           "expert_tensor_parallel_size": "1", "sequence_parallel": "False"}),
    # four ranks: TP 2 with sequence parallelism, EP 2 carved out of DP 2, expert TP 1 (so expert DP 2)
    "tp2-ep2": (Layout(tp=2, ep=2, sp=True), {"tensor_model_parallel_size": "2", "expert_model_parallel_size": "2",
                                               "expert_tensor_parallel_size": "1", "sequence_parallel": "True"}),
}


# CI runs the four-rank layout, which runs EP 2 too (EP 2 carved out of DP 2, TP 2 beside it); EP 2 alone (two ranks)
# passed the same checks (module docstring) and runs with SLIME_ASCEND_ALL_CASES=1 (CI time: 71 s a run)
CI_LAYOUTS = list(LAYOUTS) if all_cases() else ["tp2-ep2"]


@pytest.mark.parametrize("layout", CI_LAYOUTS)
def test_moe_layout_matches_the_one_rank_moe_run(moe_model_dir, quantized, first_push, moe_reference, tmp_path,
                                                 layout):
    work = tmp_path / layout
    run = _run(moe_model_dir, quantized, work, MOE + LAYOUTS[layout][0].flags())
    _assert_layout_like_reference(moe_model_dir, first_push, moe_reference, work, run, layout)


def _assert_layout_like_reference(moe_model_dir: Path, first_push: Path, moe_reference, work: Path, run,
                                  layout: str) -> None:
    from parallel_evidence import assert_quantised_close, assert_same_tensors, hf_weights

    shape, megatron_args = LAYOUTS[layout]
    assert (_ranks(run), _ranks(run, "critic")) == (shape.world, shape.world), (_ranks(run), _ranks(run, "critic"))
    for name, value in megatron_args.items():  # the layout Megatron built, from its own argument dump
        assert _megatron_args(run, name) == {value}, (name, _megatron_args(run, name))
    gaps = _assert_like_reference(moe_reference, hf_weights(moe_model_dir), work, run, dp=shape.data_parallel)
    # pushes: all experts, gathered over EP and quantised; the first byte-identical to one rank's and to
    # `slime-ascend quantize`; the trained ones the one-rank run's but for fp8 codes on a rounding boundary
    ref_pushes, pushes = _pushes(moe_reference[0]), _assert_pushes(work, first_push, (work / "engine.log").read_text())
    assert [p.name for p in pushes] == [p.name for p in ref_pushes]
    assert_same_tensors(pushes[0], ref_pushes[0])
    trained = [assert_quantised_close(push, ref_push, rtol=METRIC_RTOL, atol=PUSH_ATOL, max_flipped=MAX_FLIPPED)
               for push, ref_push in zip(pushes[1:], ref_pushes[1:], strict=True)]
    print(f"{layout} vs one rank, largest differences: {gaps}; trained pushes: {trained}")
