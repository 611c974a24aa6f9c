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
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import (TINY_QWEN3_MOE_ARGS, make_model, make_prompts, run_slime, slime_flags,
                                         start_engine, stop)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1200)]

PLUGINS = ("cpu", "int4-sync")
HERE = Path(__file__).parent
LOGPROB_ATOL = 2e-5
OWN_ROUTES_GAP = 1e-4
NUM_ROLLOUT, BATCH, N_SAMPLES = 2, 4, 2
MOE = shlex.split(TINY_QWEN3_MOE_ARGS) + ["--moe-layer-freq", "[1,1]"]  # later flags win: both layers MoE


def _config(work: Path) -> Path:
    import yaml

    from slime_ascend.cli import main

    out = work / "ascend.yaml"
    assert main(["config", *PLUGINS, "-o", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    cfg["bf16"] = False  # fp32 training: the reference forward is compared to 2e-5
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def all_moe_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with an MoE MLP in both layers (bf16 weights, as ``slime_job.make_model`` saves)."""
    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3-all-moe", moe=True,
                      config_overrides={"mlp_only_layers": []})


@pytest.fixture(scope="module")
def int4_engine_checkpoint(all_moe_model_dir, tmp_path_factory) -> Path:
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("quantized") / "tiny-qwen3-all-moe-int4"
    done = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "quantize", str(all_moe_model_dir), str(out),
                           "--format", "int4-group", "--group-size", "32"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def replay_job(all_moe_model_dir, int4_engine_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("routing-replay")
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(int4_engine_checkpoint, work / "engine.log", ready=False,
                          engine_args=("--enable-return-routed-experts",))
    flags = [f for f in slime_flags(all_moe_model_dir, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES, save=False) if f != "--bf16"]
    flags[flags.index("--hf-checkpoint") + 1] = str(int4_engine_checkpoint)  # the format int4-sync pushes
    flags += [*MOE, "--use-rollout-routing-replay", "--sglang-enable-deterministic-inference",
              "--save-debug-rollout-data", str(work / "dump" / "rollout_{rollout_id}.pt"),
              "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt")]
    try:
        run = run_slime("train.py", flags, work, PLUGINS, custom_config=_config(work))
    finally:
        stop(engine.proc)
    print(f"\nrouting replay: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    return work, run


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
