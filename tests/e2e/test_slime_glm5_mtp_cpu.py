"""GLM-5's multi-token-prediction (MTP) layer trained in slime's own ``train.py`` and used for speculative rollouts in
the same job (issue 43), on this CPU with slime's own GLM-5 spec.

The model: the tiny GLM-5 with one MTP layer (:func:`slime_ascend.rollout.torch_engine.tiny_mtp.save_tiny_glm5_with_mtp`:
``model.layers.4.*``, ``num_nextn_predict_layers: 1``), made confident with an MTP layer that agrees
(:func:`~slime_ascend.rollout.torch_engine.tiny_mtp.make_next_token_confident`: each token's successor scores a
logit margin of 14, the layers' residual writes scaled by 0.02), as a trained GLM-5 and its trained MTP layer are:
slime's ``--ci-test`` bounds presuppose one (a rollout's mean log-prob in (-1, 0), its entropy in (0, 1), the MTP
loss below 1.0), which the random tiny GLM-5, about ln 1024 nats a token, cannot meet. slime loads it with
``--mtp-num-layers 1`` through its own GLM-5 converters and trains it with ``--enable-mtp-training`` (MTP loss scale
0.1), with two runtime patches a stock Megatron-core 0.19 needs: ``train.mtp_layer_name`` (Megatron's
``mtp_model_layer`` spelled as slime's converters read it) and ``train.mtp_training`` (slime's ``mtp_kwargs`` and
its MTP loss tracker). The engine: the torch engine serving the same checkpoint with ``--speculative-algorithm NEXTN
--speculative-num-steps 3`` (drafting with the checkpoint's own MTP layer, verified by one forward of the model);
slime's command line carries its GLM-5 script's speculative flags (``--sglang-speculative-algorithm EAGLE``, 3
steps, top-k 1, 4 draft tokens), from which slime computes its ``rollout/spec_accept_length``. Every weight push
(disk) carries the MTP layer and the engine switches it with the model in one version. fp32, 2 rollouts.

slime's gate is on: ``--ci-test --ci-train-rollout-logprob-abs-diff-threshold 1e-6``. With ``--enable-mtp-training``
``--ci-test`` also asserts slime's own MTP CI scenario in every step (``slime/backends/megatron_utils/ci_utils.py``:
only the MTP parameters get a gradient, and they do; the MTP loss below 1.0), which slime's CI sets up by
truncating every response (``tests/test_mimo_7B_mtp_only_grad.py``) and this job by one reward for every sample
(``constant_reward.reward``: GRPO's advantages all zero), with the MTP layers' inputs detached from the model as
slime's Megatron patch detaches them (``train.mtp_training`` sets Megatron's ``mtp_detach_heads``). The MTP loss is
counted at the positions slime's loss mask means (``train.mtp_training`` corrects a one-position shift slime's patch
and Megatron's RL path share: before it, this job's MTP loss was 1.31, all of it the prompt's last token's
prediction that the shift counts). The model itself still moves between versions (the optimizer's weight decay),
and the MTP layer trains.

Checked from slime's own output and the engine's:

* slime's assertions in every step (a failed one stops the job): the train/rollout log-prob gap
  (``train/train_rollout_logprob_abs_diff``) at most 1e-6, the MTP loss below 1.0, its gradient check (its log line,
  read back: MTP parameters with a gradient, none other), the rollout's log-prob and entropy bounds, and each engine
  at the pushed weight version;
* every token's gap within 2e-6 (slime's dumps): the speculative rollout's log-probs are the served model's;
* speculation in the rollout: slime's ``rollout/spec_accept_length`` above 1 in every rollout, and the engine's
  acceptance per weight version in its log;
* every pushed version holds the MTP layer (its 35 tensors), the engine loaded each, and training moved the MTP
  layer between the first push and the last.

Measured 2026-12-07 on the 2-core Xeon host, alone: slime's gap 1.6e-7 and 1.2e-7, the largest token's 5.9e-7, the MTP
loss 0.0038 (slime's bound 1.0), 23 and 24 MTP parameters with a gradient and none other, accept length 4.0 of 4 in
both rollouts (the MTP layer agrees by construction), 29 of the MTP layer's 35 tensors moved; 0.55 min for the job.

slime's rollout routing replay is on (``--use-rollout-routing-replay``, the engine started with
``--enable-return-routed-experts``): every speculative answer carries the routes of its kept tokens, and the train
side replays them in the decoder's MoE layers while the MTP layer's router routes by its own logits
(``train.routing_replay``: slime's ``fill_routing_replay`` fills the decoder's layers only and asserts they are
every replay registered, which a replay for the MTP router broke at the first step). The engine-side contract is
unit-tested in ``tests/rollout/test_torch_engine_mtp.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags, start_engine, stop
from slime_ascend.rollout.torch_engine.tiny_mtp import make_next_token_confident, save_tiny_glm5_with_mtp
from test_slime_glm5_cpu import HERE, _assert_routes_replayed, _config, _glm5_flags

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1800)]

PLUGINS = ("cpu", "dsa-determinism")
NUM_ROLLOUT, BATCH, N_SAMPLES, MAX_RESPONSE, STEPS = 2, 4, 2, 16, 3
LOGPROB_GATE = 1e-6  # slime's bound for GLM-5, on its mean gap of a step
# slime's gate, asserted by slime in every step (with --enable-mtp-training, --ci-test also asserts its MTP scenario:
# only MTP parameters get a gradient, the MTP loss below 1.0)
CI_GATE = ["--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", str(LOGPROB_GATE)]
MTP_LOSS_BOUND = 1.0  # slime's check_mtp_loss
TOKEN_GAP = 2e-6  # one token's gap: a few float32 ulps at |log p| ~ 7 (measured 9.5e-7, two of them)
MTP_PREFIX = "model.layers.4."
# slime's scripts/run-glm5-744B-A40B.sh
SPECULATIVE = ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", str(STEPS),
               "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", str(STEPS + 1)]


@pytest.fixture(scope="module")
def mtp_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("glm5-mtp")
    model = make_next_token_confident(save_tiny_glm5_with_mtp(work / "tiny-glm5-mtp"))
    prompts = make_prompts(work / "prompts.jsonl")
    engine = start_engine(model, work / "engine.log", ready=False,
                          engine_args=("--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(STEPS),
                                       "--enable-return-routed-experts"))
    flags = _glm5_flags(slime_flags(model, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES, max_response=MAX_RESPONSE, save=False))
    at = flags.index("--rm-type")
    del flags[at:at + 2]
    flags += ["--custom-rm-path", "constant_reward.reward", "--sglang-enable-deterministic-inference", *CI_GATE,
              "--update-weight-disk-keep-files",
              "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"),
              "--save-debug-rollout-data", str(work / "dump" / "rollout_{rollout_id}.pt"),
              "--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.1",
              "--use-rollout-routing-replay", *SPECULATIVE]
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
    for patch_id in ("train.mtp_layer_name", "train.mtp_training", "train.routing_replay"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    _assert_routes_replayed(work, run)  # the engine's routes of every speculative sample, replayed by slime
    steps = [m for m in run.metrics() if "train/step" in m]
    assert [m["train/step"] for m in steps] == list(range(NUM_ROLLOUT)), steps
    # slime's MTP loss, every step, under slime's own bound (which --ci-test asserted too); slime's MTP scenario checked
    # in every step: only MTP parameters had a gradient, and they had one
    for m in steps:
        assert 0 < m["train/mtp_loss"] == m["train/mtp_1_loss"] < MTP_LOSS_BOUND, m
    checks = re.findall(r"\[CI MTP Grad Check\] Step (\d+): MTP params with non-zero grad: (\d+), "
                        r"non-MTP params with non-zero grad: (\d+)", run.log)
    print("slime's MTP gradient checks (step, MTP, non-MTP):", checks)
    assert len(checks) == NUM_ROLLOUT and all(int(mtp) > 0 and int(rest) == 0 for _, mtp, rest in checks), checks
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
