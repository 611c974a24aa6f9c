"""GLM-5's multi-token-prediction (MTP) layer trained in slime's own ``train.py`` and used for speculative rollouts in
the same job (issue 43), on this CPU with slime's own GLM-5 spec.

The model: the tiny GLM-5 with one MTP layer (:func:`slime_ascend.rollout.torch_engine.tiny_mtp.save_tiny_glm5_with_mtp`:
``model.layers.4.*``, ``num_nextn_predict_layers: 1``). slime loads it with ``--mtp-num-layers 1`` through its own
GLM-5 converters and trains it with ``--enable-mtp-training`` (MTP loss scale 0.1), with two runtime patches a
stock Megatron-core 0.19 needs: ``train.mtp_layer_name`` (Megatron's ``mtp_model_layer`` spelled as slime's
converters read it) and ``train.mtp_training`` (slime's ``mtp_kwargs`` and its MTP loss tracker). The engine: the
torch engine serving the same checkpoint with ``--speculative-algorithm NEXTN --speculative-num-steps 3``
(drafting with the checkpoint's own MTP layer, verified by one forward of the model); slime's command line carries
its GLM-5 script's speculative flags (``--sglang-speculative-algorithm EAGLE``, 3 steps, top-k 1, 4 draft tokens),
from which slime computes its ``rollout/spec_accept_length``. Every weight push (disk) carries the MTP layer and
the engine switches it with the model in one version. GRPO with a reward of the response
(``parity_reward.reward``), fp32, 2 rollouts.

Checked from slime's own output and the engine's:

* slime's MTP loss (``train/mtp_loss``, ``train/mtp_1_loss``) in every step;
* slime's train/rollout log-prob gap, the figure its 1e-6 gate compares (``train/train_rollout_logprob_abs_diff``),
  at most 1e-6 in every step (measured 1.6e-7), and every token's gap within 2e-6 (slime's dumps; measured
  9.5e-7, two float32 ulps at |log p| ~ 7): the speculative rollout's log-probs are the served model's. The gate's flag (``--ci-test``) is not on: with
  ``--enable-mtp-training`` it also asserts slime's GPU CI scenario (only MTP parameters receive gradients, the MTP
  loss below 1.0, which a trained GLM-5 meets and a random tiny one, about ln 1024, cannot); the test asserts the
  same bound on the same figure;
* speculation in the rollout: slime's ``rollout/spec_accept_length`` above 1 in every rollout (measured 3.5 and
  3.53 of at most 4: the untrained MTP layer and the random tiny model are both near uniform at temperature 1), and
  the engine's acceptance per weight version in its log;
* every pushed version holds the MTP layer (its 35 tensors), the engine loaded each, and training moved the MTP
  layer between the first push and the last (29 of its 35 tensors). One slime job, 0.83 min alone on the 2-core
  host.

slime's rollout routing replay is off here: its ``fill_routing_replay`` records the engine's routes into every
router Megatron built, the MTP layer's too, for which the engine returns none (slime's own assertion stops the
step); the engine-side contract (a speculative answer's routes are those of its kept tokens) is unit-tested in
``tests/rollout/test_torch_engine_mtp.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags, start_engine, stop
from slime_ascend.rollout.torch_engine.tiny_mtp import save_tiny_glm5_with_mtp
from test_slime_glm5_cpu import HERE, _config, _glm5_flags

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1800)]

PLUGINS = ("cpu", "dsa-determinism")
NUM_ROLLOUT, BATCH, N_SAMPLES, MAX_RESPONSE, STEPS = 2, 4, 2, 16, 3
LOGPROB_GATE = 1e-6  # slime's bound for GLM-5, on its mean gap of a step
TOKEN_GAP = 2e-6  # one token's gap: a few float32 ulps at |log p| ~ 7 (measured 9.5e-7, two of them)
MTP_PREFIX = "model.layers.4."
# slime's scripts/run-glm5-744B-A40B.sh
SPECULATIVE = ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", str(STEPS),
               "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", str(STEPS + 1)]


@pytest.fixture(scope="module")
def mtp_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("glm5-mtp")
    model = save_tiny_glm5_with_mtp(work / "tiny-glm5-mtp")
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(model, work / "engine.log", ready=False,
                          engine_args=("--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(STEPS)))
    flags = _glm5_flags(slime_flags(model, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES, max_response=MAX_RESPONSE, save=False))
    at = flags.index("--rm-type")
    del flags[at:at + 2]
    flags += ["--custom-rm-path", "parity_reward.reward", "--sglang-enable-deterministic-inference",
              "--update-weight-disk-keep-files",
              "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"),
              "--save-debug-rollout-data", str(work / "dump" / "rollout_{rollout_id}.pt"),
              "--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.1", *SPECULATIVE]
    try:
        run = run_slime("train.py", flags, work, PLUGINS, custom_config=_config(work, PLUGINS, {}), timeout=1500,
                        extra_env={"PYTHONPATH": str(HERE)})
    finally:
        stop(engine.proc)
    print(f"\nglm5 mtp: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-8000:]
    return work, run, (work / "engine.log").read_text(errors="replace")


def _mtp_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update({k: v for k, v in load_file(str(path)).items() if k.startswith(MTP_PREFIX)})
    return out


def test_train_py_trains_glm5s_mtp_layer_and_rolls_out_speculatively_with_it(mtp_job):
    import torch

    work, run, engine_log = mtp_job
    for patch_id in ("train.mtp_layer_name", "train.mtp_training"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    steps = [m for m in run.metrics() if "train/step" in m]
    assert [m["train/step"] for m in steps] == list(range(NUM_ROLLOUT)), steps
    # slime's MTP loss, every step (a random tiny model: about ln 1024 nats)
    for m in steps:
        assert 0 < m["train/mtp_loss"] == m["train/mtp_1_loss"] and math.isfinite(m["train/mtp_loss"]), m
    gaps = [m["train/train_rollout_logprob_abs_diff"] for m in steps]
    print("train/rollout log-prob gap per step:", gaps, "MTP loss:", [m["train/mtp_loss"] for m in steps])
    assert all(0 <= g <= LOGPROB_GATE for g in gaps), gaps
    # every sample's own largest gap: the speculative rollout's log-probs are the served model's
    worst = 0.0
    for rollout_id in range(NUM_ROLLOUT):
        rollout = {tuple(s["tokens"]): torch.as_tensor(s["rollout_log_probs"]).float()
                   for s in torch.load(work / "dump" / f"rollout_{rollout_id}.pt", weights_only=False)["samples"]}
        for sample in torch.load(work / "dump" / f"train_{rollout_id}.pt", weights_only=False)["samples"]:
            have = torch.as_tensor(sample["log_probs"]).float()
            want = rollout[tuple(map(int, sample["tokens"]))]
            worst = max(worst, float((have - want).abs().max()))
    print("largest per-token train/rollout gap:", worst)
    assert worst <= TOKEN_GAP, worst

    # speculation: slime's own metric from the engines' meta-info, and the engine's account per weight version
    spec = [m for m in run.metrics() if "rollout/spec_accept_length" in m]
    print("rollout/spec_accept_length:", [m["rollout/spec_accept_length"] for m in spec])
    assert len(spec) == NUM_ROLLOUT and all(m["rollout/spec_accept_length"] > 1 for m in spec), spec
    for version in range(1, NUM_ROLLOUT + 1):
        assert f"speculative decoding under weight version {version}: accept length" in engine_log, version

    # every push carries the MTP layer; the engine loaded each version; training moved the layer
    pushed = sorted((work / "weights").glob("weight_v*"))
    assert [p.name for p in pushed] == [f"weight_v{v:06d}" for v in range(1, NUM_ROLLOUT + 2)], pushed
    layers = [_mtp_tensors(p) for p in pushed]
    assert all(len(layer) == len(layers[0]) >= 30 for layer in layers), [len(layer) for layer in layers]
    assert {MTP_PREFIX + n for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                                     "shared_head.norm.weight")} <= set(layers[0])
    for version in range(1, NUM_ROLLOUT + 2):
        assert f"loaded weight version {version} from" in engine_log, version
    moved = [n for n in layers[0] if not torch.equal(layers[0][n], layers[-1][n])]
    print(f"MTP tensors moved by training: {len(moved)} of {len(layers[0])}")
    assert MTP_PREFIX + "eh_proj.weight" in moved and len(moved) >= len(layers[0]) // 2, moved
