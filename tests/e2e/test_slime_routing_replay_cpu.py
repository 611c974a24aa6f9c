"""slime's rollout routing replay (``--use-rollout-routing-replay``, R3) in slime's own ``train.py`` on this CPU:
the engine returns each token's routed experts, slime carries them to the train actor, and the train side routes
every token to the engine's experts, not to its own.

The job: the tiny Qwen3-MoE (4 experts, top 2) with both layers MoE (``--moe-layer-freq [1,1]``; in the usual tiny
MoE, layer 0 dense, a route changes only the log-prob of its own position, and the int4 engine moved only prompt
tokens' routes) at one rank, fp32 training, GRPO, 2 rollouts of 4 prompts x 2 samples, disk pushes. The engine
serves ``slime-ascend quantize --format int4-group --group-size 32`` of the checkpoint (``int4-sync`` keeps every
push in that format) and is started with ``--enable-return-routed-experts``: slime's router as PyPI ships it drops
the request's ``return_routed_experts`` (``rollout.replay_routes``), so the engine adds the routes to every answer,
as SGLang's server flag asks. The int4 engine routes differently from the fp32 trainer (its hidden states carry the
int4 rounding: in 7 of 8 sampled answers, measured offline, some tokens went to another expert set), which is what
makes the check decisive: replaying the engine's routes and routing by itself give train-side log-probs 5e-4 to 8e-3
apart.

From slime's own dumps (``--save-debug-rollout-data``: each sample's ``rollout_routed_experts``, what the engine
answered; ``--save-debug-train-data``: the train-side log-probs):

* every sample of both rollouts carries routes of shape ``[len(tokens) - 1, layers, top_k]`` (two distinct
  experts in each layer);
* rollout 0 (the loaded weights, known here): the train-side log-probs equal, within 2e-5, a slow reference
  forward of the same fp32 weights (transformers' own Qwen3-MoE) with its router's choice replaced by the dump's
  routes, the routing weights the router gives those experts (its softmax at them, renormalised);
* the teeth: the same reference routing by itself differs from the train-side log-probs by more than 1e-4 on at
  least one sample, and by more than 2e-5 only on samples whose engine routes differ from its own. A train side
  that ignored the replay (routing by itself) fails the first check on those samples.

The same job with the ``qat`` plugin (one more run, 1.6 min) closes the int4 loop: the trainer's forward uses
dequant(quant(W)) with the spec ``int4-sync`` pushes, i.e. the engine's weights, so every sample's train-side
log-probs equal the engine's within 1e-5 in both rollouts (measured 4.8e-7; slime's
``train/train_rollout_logprob_abs_diff`` 7e-8 and 1.6e-7), while the job above, without ``qat``, is 1.2e-2 to 4.7e-2
apart on every sample (slime's mean 1.3e-2). Both jobs run ``icepop`` with a tight band ([1/1.001, 1.001]): the
fraction of trained tokens it masks, in slime's trackers, is 0 under ``qat`` and above 0 in every step without it.

The FP8 loop (issue 44 item 3; one more run, 0.65 min alone): ``qat`` in fp8-block mode + ``fp8-sync`` against the
torch engine serving ``slime-ascend quantize --format fp8-block --block-size 32 32``: every sample's train-side
log-probs equal the engine's within 1e-5 in both rollouts (measured 4.8e-7; slime's figure 1.1e-7 and 1.3e-7), IcePop
masks nothing; the same engine's log-probs are 4.2e-3 to 1.1e-2 from the unquantised fp32 weights (engine routes
replayed), the gap QAT closes.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from parallel_evidence import quantize
from slime_ascend.demo.slime_job import (TINY_QWEN3_MOE_ARGS, make_model, make_prompts, run_slime, slime_flags,
                                         start_engine, stop)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

# the control job; the qat job adds "qat". Both run IcePop with a tight band, so the masked fraction it logs shows what
# the train/rollout gap costs in trained tokens (none under qat, some without it)
PLUGINS = ("cpu", "int4-sync", "icepop")
ICEPOP_BETA = 1.001  # tokens whose train/rollout ratio leaves [1/1.001, 1.001] are masked
HERE = Path(__file__).parent
LOGPROB_ATOL = 2e-5
OWN_ROUTES_GAP = 1e-4
QAT_ATOL = 1e-5  # qat: train-side vs engine log-prob, every token
CONTROL_GAP = 1e-3  # no qat: at least this far apart on some token of every sample
CONTROL_MEAN_GAP = 1e-3  # no qat: slime's mean |train - rollout| log-prob of each step
NUM_ROLLOUT, BATCH, N_SAMPLES = 2, 4, 2
MOE = shlex.split(TINY_QWEN3_MOE_ARGS) + ["--moe-layer-freq", "[1,1]"]  # later flags win: both layers MoE


def _config(work: Path, plugins: tuple[str, ...] = PLUGINS, settings: dict | None = None) -> Path:
    import yaml

    from slime_ascend.cli import main

    out = work / "ascend.yaml"
    assert main(["config", *plugins, "-o", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    cfg["bf16"] = False  # fp32 training: the reference forward is compared to 2e-5
    cfg["ascend_icepop_beta"] = ICEPOP_BETA
    cfg.update(settings or {})
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def all_moe_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with an MoE MLP in both layers (bf16 weights, as ``slime_job.make_model`` saves)."""
    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3-all-moe", moe=True,
                      config_overrides={"mlp_only_layers": []})


@pytest.fixture(scope="module")
def int4_engine_checkpoint(all_moe_model_dir, tmp_path_factory) -> Path:
    return quantize(all_moe_model_dir, tmp_path_factory.mktemp("quantized") / "tiny-qwen3-all-moe-int4",
                    "int4-group", "--group-size", "32")


@pytest.fixture(scope="module")
def fp8_engine_checkpoint(all_moe_model_dir, tmp_path_factory) -> Path:
    """FP8 blocks of 32 x 32 (the tiny model's 64-wide linears hold several: a block boundary inside each)."""
    return quantize(all_moe_model_dir, tmp_path_factory.mktemp("quantized") / "tiny-qwen3-all-moe-fp8",
                    "fp8-block", "--block-size", "32", "32")


def _run_job(model_dir: Path, engine_checkpoint: Path, work: Path, plugins: tuple[str, ...],
             settings: dict | None = None):
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(engine_checkpoint, work / "engine.log", ready=False,
                          engine_args=("--enable-return-routed-experts",))
    flags = [f for f in slime_flags(model_dir, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES, save=False) if f != "--bf16"]
    flags[flags.index("--hf-checkpoint") + 1] = str(engine_checkpoint)  # the format int4-sync pushes
    flags += [*MOE, "--use-rollout-routing-replay", "--sglang-enable-deterministic-inference",
              "--save-debug-rollout-data", str(work / "dump" / "rollout_{rollout_id}.pt"),
              "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt")]
    try:
        run = run_slime("train.py", flags, work, plugins, custom_config=_config(work, plugins, settings))
    finally:
        stop(engine.proc)
    print(f"\n{'+'.join(plugins)}: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    return work, run


@pytest.fixture(scope="module")
def replay_job(all_moe_model_dir, int4_engine_checkpoint, tmp_path_factory):
    return _run_job(all_moe_model_dir, int4_engine_checkpoint, tmp_path_factory.mktemp("routing-replay"), PLUGINS)


@pytest.fixture(scope="module")
def qat_job(all_moe_model_dir, int4_engine_checkpoint, tmp_path_factory):
    """The same job with ``qat``: the trainer's forward uses dequant(quant(W)) of int4-sync's spec."""
    return _run_job(all_moe_model_dir, int4_engine_checkpoint, tmp_path_factory.mktemp("qat"), (*PLUGINS, "qat"))


@pytest.fixture(scope="module")
def fp8_qat_job(all_moe_model_dir, fp8_engine_checkpoint, tmp_path_factory):
    """The FP8 loop: ``qat`` in fp8-block mode + ``fp8-sync`` against the torch engine serving the FP8 checkpoint."""
    return _run_job(all_moe_model_dir, fp8_engine_checkpoint, tmp_path_factory.mktemp("fp8-qat"),
                    ("cpu", "fp8-sync", "icepop", "qat"), {"ascend_qat_format": "fp8-block"})


def _dump(work: Path, kind: str, rollout_id: int) -> dict:
    import torch

    return torch.load(work / "dump" / f"{kind}_{rollout_id}.pt", weights_only=False)


def _reference_logprobs(model, tokens, routes=None):
    """Log-probs of ``tokens[1:]`` from one fp32 forward of transformers' Qwen3-MoE; ``routes`` (``[len - 1, layers,
    top_k]``) replace its routers' choices, each given the weights its router gives those experts."""
    import torch

    handles = []
    if routes is not None:
        for index, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(layer.mlp, "experts"):
                continue

            def hook(module, _inputs, output, forced=routes[:, index].long()):
                logits = output[0]
                weights = torch.softmax(logits.float(), dim=-1).gather(-1, forced)
                if module.norm_topk_prob:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                return logits, weights.to(logits.dtype), forced

            handles.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(tokens[:-1]).reshape(1, -1), use_cache=False).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.as_tensor(tokens[1:]).reshape(-1, 1)).squeeze(-1)


def _own_routes(model, tokens):
    from slime_ascend.rollout.torch_engine.model import RouteRecorder

    import torch

    recorder = RouteRecorder.for_model(model)
    with torch.no_grad():
        model(input_ids=torch.as_tensor(tokens[:-1]).reshape(1, -1), use_cache=False)
    return recorder.take(len(tokens) - 1)


def test_the_train_side_replays_the_engines_routes(replay_job, all_moe_model_dir):
    import torch

    from slime_ascend.rollout.torch_engine.model import load_model

    work, run = replay_job
    layers, top_k = 2, 2
    for rollout_id in range(NUM_ROLLOUT):
        samples = _dump(work, "rollout", rollout_id)["samples"]
        assert len(samples) == BATCH * N_SAMPLES, rollout_id
        for sample in samples:
            routes = torch.as_tensor(sample["rollout_routed_experts"])
            assert routes.shape == (len(sample["tokens"]) - 1, layers, top_k), (rollout_id, routes.shape)
            assert (routes[:, :, 0] != routes[:, :, 1]).all() and (routes >= 0).all() and (routes < 4).all()

    model = load_model(all_moe_model_dir, torch.float32)
    # reference self-check: forcing its own routes reproduces its own forward exactly
    first = _dump(work, "rollout", 0)["samples"][0]["tokens"]
    assert torch.equal(_reference_logprobs(model, first, _own_routes(model, first)), _reference_logprobs(model, first))

    routes_by_tokens = {tuple(s["tokens"]): torch.as_tensor(s["rollout_routed_experts"])
                        for s in _dump(work, "rollout", 0)["samples"]}
    train = _dump(work, "train", 0)["samples"]
    assert len(train) == BATCH * N_SAMPLES
    gaps = []
    for sample in train:
        tokens = list(map(int, sample["tokens"]))
        n = int(sample["response_lengths"])
        routes = routes_by_tokens[tuple(tokens)]
        have = torch.as_tensor(sample["log_probs"]).float()
        replayed = _reference_logprobs(model, tokens, routes)[-n:]
        torch.testing.assert_close(have, replayed, rtol=0, atol=LOGPROB_ATOL)
        gap = (have - _reference_logprobs(model, tokens)[-n:]).abs().max().item()
        own = _own_routes(model, tokens)
        moved = int((torch.sort(own, -1).values != torch.sort(routes, -1).values).any(-1).any(-1).sum())
        assert gap <= LOGPROB_ATOL or moved, (gap, "a gap to the own-route forward without a moved route")
        gaps.append((gap, moved))
    print("routing replay: own-route forward vs train side, per sample (max |diff|, fed tokens moved):",
          ", ".join(f"{g:.1e}/{m}" for g, m in gaps))
    assert sum(g > OWN_ROUTES_GAP for g, _ in gaps) >= 1, ("no sample's engine routes change its log-probs: "
                                                          "the check has no teeth", gaps)


def _gaps(work: Path, rollout_id: int) -> list[float]:
    """Per sample of ``rollout_id``: max |train-side log-prob - engine log-prob| over its response tokens, from
    slime's dumps (the train side's recomputed log-probs, the engine's ``rollout_log_probs``)."""
    import torch

    engine = {tuple(s["tokens"]): torch.as_tensor(s["rollout_log_probs"]).float()
              for s in _dump(work, "rollout", rollout_id)["samples"]}
    train = _dump(work, "train", rollout_id)["samples"]
    assert len(train) == len(engine) == BATCH * N_SAMPLES
    gaps = []
    for sample in train:
        have = torch.as_tensor(sample["log_probs"]).float()
        want = engine[tuple(map(int, sample["tokens"]))]
        assert have.shape == want.shape and have.numel() > 0
        gaps.append((have - want).abs().max().item())
    return gaps


def _tracked(run, tag: str) -> list[float]:
    values = [v for _, v in run.tracked().get(tag, [])]
    assert len(values) == NUM_ROLLOUT, (tag, sorted(run.tracked()))
    return values


def _tracked_gap(run) -> list[float]:
    """slime's own mismatch figure, ``train/train_rollout_logprob_abs_diff`` (mean |old - rollout| log-prob of
    each train step), as its trackers got it."""
    values = [v for _, v in run.tracked().get("train/train_rollout_logprob_abs_diff", [])]
    assert len(values) == NUM_ROLLOUT, run.tracked().keys()
    return values


def test_qat_makes_the_trainer_see_the_int4_engines_weights(qat_job, replay_job):
    """``qat`` + ``int4-sync`` against the int4 torch engine: every sample's train-side log-probs equal the engine's
    within QAT_ATOL in both rollouts (the trainer's forward uses dequant(quant(W)) with the spec int4-sync pushes:
    the engine's weights, exactly); the job without ``qat`` (the routing-replay job above) is the control: the fp32
    trainer against the int4 engine, more than CONTROL_GAP apart on every sample.

    The control is comparable: both jobs replay the engine's routes (``--use-rollout-routing-replay``), so neither
    gap has a route flip in it; what is left is the weights the two sides compute with (and fp32 rounding of two
    implementations, Megatron's and transformers'), which is what QAT changes."""
    qat_work, qat_run = qat_job
    control_work, control_run = replay_job
    assert "qat: fake-quantising" in qat_run.log and "qat: fake-quantising" not in control_run.log
    for rollout_id in range(NUM_ROLLOUT):
        qat, control = _gaps(qat_work, rollout_id), _gaps(control_work, rollout_id)
        print(f"rollout {rollout_id}: per-sample max |train - engine| log-prob, qat",
              ", ".join(f"{g:.1e}" for g in qat), "| control", ", ".join(f"{g:.1e}" for g in control))
        assert max(qat) <= QAT_ATOL, (rollout_id, qat)
        assert min(control) >= CONTROL_GAP, (rollout_id, control)
    qat_metric, control_metric = _tracked_gap(qat_run), _tracked_gap(control_run)
    print("train/train_rollout_logprob_abs_diff: qat", qat_metric, "control", control_metric)
    assert max(qat_metric) <= QAT_ATOL and min(control_metric) >= CONTROL_MEAN_GAP, (qat_metric, control_metric)
    # what the gap costs: IcePop (band [1/1.001, 1.001]) masks no trained token under qat, some in every step without
    qat_masked, control_masked = _tracked(qat_run, "train/icepop_masked"), _tracked(control_run, "train/icepop_masked")
    print("train/icepop_masked: qat", qat_masked, "control", control_masked)
    assert qat_masked == [0.0] * NUM_ROLLOUT and all(m > 0 for m in control_masked), (qat_masked, control_masked)


def test_fp8_block_qat_makes_the_trainer_see_the_fp8_engines_weights(fp8_qat_job, all_moe_model_dir):
    """Issue 44 item 3, the same loop for FP8 rollouts: ``qat`` in fp8-block mode + ``fp8-sync`` against the torch
    engine serving ``slime-ascend quantize --format fp8-block --block-size 32 32``: every sample's train-side
    log-probs equal the engine's within QAT_ATOL in both rollouts, slime's own mismatch figure too, and IcePop's
    tight band masks no trained token.

    The control, without a second slime job: the engine's rollout-0 log-probs (the loaded weights, known here)
    against a reference forward of the same fp32 master weights without fake quant (transformers' Qwen3-MoE, the
    engine's routes replayed, so only the weights differ): FP8's rounding moves them by more than CONTROL_GAP on
    some token of every sample, which is the gap QAT closes."""
    import torch

    from slime_ascend.rollout.torch_engine.model import load_model

    work, run = fp8_qat_job
    assert "qat: fake-quantising" in run.log and "fp8-block" in run.log
    assert "applied runtime patch train.quantize_params" in run.log
    for rollout_id in range(NUM_ROLLOUT):
        gaps = _gaps(work, rollout_id)
        print(f"fp8 qat, rollout {rollout_id}: per-sample max |train - engine| log-prob",
              ", ".join(f"{g:.1e}" for g in gaps))
        assert max(gaps) <= QAT_ATOL, (rollout_id, gaps)
    tracked = _tracked_gap(run)
    masked = _tracked(run, "train/icepop_masked")
    print("fp8 qat: train/train_rollout_logprob_abs_diff", tracked, "train/icepop_masked", masked)
    assert max(tracked) <= QAT_ATOL and masked == [0.0] * NUM_ROLLOUT, (tracked, masked)

    model = load_model(all_moe_model_dir, torch.float32)
    control = []
    for sample in _dump(work, "rollout", 0)["samples"]:
        tokens = list(map(int, sample["tokens"]))
        engine = torch.as_tensor(sample["rollout_log_probs"]).float()
        master = _reference_logprobs(model, tokens, torch.as_tensor(sample["rollout_routed_experts"]))[-len(engine):]
        control.append((engine - master).abs().max().item())
    print("fp8 control (the engine against the unquantised fp32 weights, rollout 0):",
          ", ".join(f"{g:.1e}" for g in control))
    assert min(control) >= CONTROL_GAP, control
