"""slime's own ``train.py`` on this CPU with slime's own GLM-5 spec (``slime_plugins.models.glm5.glm5
get_glm5_spec``: MLA, DSA with IndexShare, MoE with a shared expert) on the tiny GLM-5, and slime's train/rollout
alignment gate on: at one rank, and at tensor x expert parallelism 2 x 2 (four ranks, sequence parallelism)
compared with the one-rank run.

The ``cpu`` plugin (its glm5 patches give the spec host linears, torch ops and THD RoPE) with ``dis``, ``staleness``
and ``dsa-determinism``, and slime's rollout routing replay (``--use-rollout-routing-replay``: the engine, started
with ``--enable-return-routed-experts``, returns each token's experts in the three MoE layers, slime's rollout dump
carries them, and the train side routes by them; that replay changes the train side's routes is shown on an engine
that routes differently, in ``test_slime_routing_replay_cpu.py``: here the fp32 engine routes as the trainer does,
so the gate and the layout comparison hold with replay on); the torch engine serves the checkpoint (transformers'
``GlmMoeDsa`` aligned to GLM-5's checkpoint semantics: ``slime_ascend.rollout.torch_engine.glm5``); fp32 training; 2
rollouts with a weight push after each step (``--update-weight-transport disk``), so the second rollout is generated
with the trained weights. The prompts and responses are longer than ``index_topk`` (8): the DSA selection decides
the attention on both sides. The job's architecture flags, spec and fp32 rule are the demo's
(``slime_ascend.demo.slime_loop.MODEL_JOBS["glm5"]``). ``dsa-determinism`` is what makes the two sides select alike:
the indexer's ReLU scores have exact ties (zeros), which slime's ``torch.topk`` breaks in no fixed order; with the
plugin the train side breaks them to the lower index, as the torch engine always does (without it this job's first
step measured a gap of 7.9e-3).

slime's gate, ``--ci-test --ci-train-rollout-logprob-abs-diff-threshold``, asserts in every train step of every
run that the mean absolute gap between the train side's log-probs and the rollout's is within
:data:`LOGPROB_GATE`, slime's own bound for GLM-5 on 8 H100s (``tests/test_glm52_6layer_deterministic_e2e.py``);
the logged gap is checked too. The unit test (``tests/glm5/test_glm5_train_rollout_logprobs.py``) holds the
per-token gap under it.

The layout (:data:`LAYOUTS`; ``Layout(tp=2, ep=2, sp=True).flags()``, what ``slime-ascend config ... --flags --tp 2
--ep 2 --sp`` prints): the MLA heads, the dense MLP and the vocabulary split over TP 2 and the sequence too (MoE
with TP needs ``--sequence-parallel``); slime's duplicated down projections and indexer linears whole on each TP
rank, fed its sequence shard (their gradients summed over TP: ``slime_ascend.cpu.glm5_spec.HostDuplicatedLinear``
marks them as TE does, ``tests/glm5/test_glm5_tensor_parallel.py``); the experts of the three MoE layers on two EP
ranks carved out of data parallelism 2, Megatron's all-to-all dispatcher moving the tokens over gloo, each expert
whole (``--expert-tensor-parallel-size 1``). It must reproduce the one-rank run (made once per module, same seed,
data and flags; a reward of the response, ``parity_reward.reward``, and per-sample sampling seeds make the two
comparable) as ``test_slime_moe_cpu`` holds Qwen3-MoE: from slime's own output (``--save-debug-train-data``), the
tokens of every sample exactly, its train-side log-probs (2e-5 absolute), loss masks and rewards exactly,
advantages (1e-6 absolute), loss and grad norm of each step (1e-4 relative; loss also 1e-7 absolute), DIS's masked
count exactly; every expert of every MoE layer in every push (gathered from the EP ranks by slime's weight
iterator), the first push byte-identical to the one-rank run's, the later (trained) ones within 1e-4 relative,
1e-6 absolute. Both runs write the DSA key sets each side attended to (``dsa-determinism``'s
``ascend_dsa_index_dump_dir``, the engine's ``--dump-dsa-index-sets``): in every layer and at every fed position they
are the engine's (``slime_ascend.dsa.index_sets``; measured: 576 positions a layer, none differing, at both layouts).

``opd`` in top-k mode (MOPD's reverse KL over the teacher's top-k ids, a loss term) and ``fp8-sync`` run on the
same spec at one rank in a job of their own (``dis`` acts inside slime's policy loss, which opd's top-k custom loss
replaces; the fp8 engine's log-probs are 1e-2 from the fp32 trainer's, so slime's fp32 gate is off there): the
teacher payload of every sample equals a forward of the teacher checkpoint (ids exactly, log-probs within 2e-5),
the top-k KL and its loss term act in every step, and the first push (MLA, the DSA indexer and every expert
quantised in the train actor) is byte-identical to ``slime-ascend quantize --format fp8-block``. Measured
2026-12-03: 0.83 min, KL 5.7e-4 and 6.1e-4, train/rollout gaps 1.6e-2 and 1.2e-2.

Measured on the 2-core Intel Xeon host (AVX-512), 2026-12-03, shared with other jobs (1-minute load 5): one rank
0.81 min, gate gaps 1.4e-7 and 1.9e-7 (steps 0, 1); TP 2 x EP 2 1.00 min, gate gaps 1.4e-7 and 1.5e-7, largest gaps
to one rank: log-probs 9.5e-7, advantages 0, grad norm 1.3e-6 relative, loss 1.5e-8, trained push 3.7e-6
absolute (the module 2.2 min). EP 2 alone (two ranks, ``Layout(ep=2)``; left out of CI, the four-rank layout runs
EP 2 too) passed the same checks: log-probs 9.5e-7, grad norm 7.3e-8 relative, loss 0, trained push 8.4e-7.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_evidence import hf_weights as _pushed_tensors, megatron_args as _megatron_args, pushes as _pushes
from parallel_evidence import OPD_COEFS, opd_settings, train_ranks as _ranks
from slime_ascend.demo.slime_job import TINY_QWEN3_ARGS, make_prompts, run_slime, slime_flags, start_engine, stop
from slime_ascend.demo.slime_loop import MODEL_JOBS
from slime_ascend.parallel_layout import Layout

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1800)]

PLUGINS = ("cpu", "dis", "staleness", "dsa-determinism")
# opd's top-k loss is a custom loss, which dis (inside slime's policy loss) cannot share a job with: its own run, which
# pushes fp8 (fp8-sync; the engine serves fp8-block, so the 1e-6 gate, an fp32 bound, is not asserted in it)
OPD_PLUGINS = ("cpu", "staleness", "dsa-determinism", "opd", "fp8-sync")
QUANT_FORMAT = "fp8-block"
HERE = Path(__file__).parent
GLM5 = MODEL_JOBS["glm5"]  # the tiny GLM-5's flags less --spec, slime's glm5 spec, fp32 (bf16: false)
LOGPROB_GATE = 1e-6
# slime's gate, in the fp32 runs (--ci-test also bounds the rollout's mean train-side log-prob to (-1, 0) where slime
# logs it, as with opd: a sanity bound for a trained checkpoint that the random tiny GLM-5, mean log-prob -6.9 over
# its 1024-token vocabulary, cannot meet; one more reason the opd run goes without it)
CI_GATE = ["--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", str(LOGPROB_GATE)]
LOGPROB_ATOL = 2e-5
ADVANTAGE_ATOL = 1e-6
METRIC_RTOL = 1e-4
LOSS_ATOL = 1e-7
BATCH, N_SAMPLES, NUM_ROLLOUT, MAX_RESPONSE = 4, 2, 2, 16
OPD_TOPK = 4
MOE_LAYERS, EXPERTS = (1, 2, 3), 4  # tiny GLM-5: layer 0 dense, layers 1-3 MoE with 4 routed experts
EXPERT_TENSORS = {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for layer in MOE_LAYERS
                  for e in range(EXPERTS) for p in ("gate", "up", "down")}

# layout -> (its flags, the values Megatron's argument dump must show). One layout, one slime-loop run: TP 2 x EP 2
# (four ranks) runs EP 2 too; EP 2 alone (Layout(ep=2), two ranks) passed the same checks (module docstring)
LAYOUTS = {
    "tp2-ep2": (Layout(tp=2, ep=2, sp=True), {"tensor_model_parallel_size": "2", "expert_model_parallel_size": "2",
                                               "expert_tensor_parallel_size": "1", "sequence_parallel": "True"}),
}


def _tiny_glm5(out: Path, seed: int) -> Path:
    """The tiny GLM-5 drawn from ``seed`` (fp32) with the byte tokenizer, as an HF directory."""
    import torch

    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model, save_model

    return save_model(load_model(None, dtype=torch.float32, seed=seed, glm5=True), out, build_byte_tokenizer())


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory) -> Path:
    """The tiny GLM-5 (fp32) with the byte tokenizer, as an HF directory."""
    return _tiny_glm5(tmp_path_factory.mktemp("model") / "tiny-glm5", seed=0)


@pytest.fixture(scope="module")
def glm5_teacher_dir(tmp_path_factory) -> Path:
    """opd's teacher: the tiny GLM-5 drawn from another seed (fp32)."""
    return _tiny_glm5(tmp_path_factory.mktemp("teacher") / "tiny-glm5-teacher", seed=1)


def _config(work: Path, plugins: tuple[str, ...], opd: dict) -> Path:
    out = work / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *plugins, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    with out.open("a") as f:  # applied after the command line (the plugin flags' --spec) and slime's bf16 rule
        f.write("\n# the glm5 model job's plain slime arguments (bf16: false, fp32 training: the gate's bound is an "
                "fp32 one) and slime's own GLM-5 spec in place of the cpu plugin's local one\n")
        for name, value in (*GLM5.slime_args, ("spec", list(GLM5.spec)), *opd.items()):
            f.write(f"{name}: {json.dumps(value)}\n")
    return out


def _glm5_flags(flags: list[str]) -> list[str]:
    """slime_flags' job with the tiny Qwen3's architecture flags replaced by the tiny GLM-5's (less its --spec,
    which the YAML sets) and the glm5 job's dropped flags (--bf16) removed."""
    qwen = TINY_QWEN3_ARGS.split()
    at = next(i for i in range(len(flags)) if flags[i:i + len(qwen)] == qwen)
    flags = flags[:at] + list(GLM5.arch) + flags[at + len(qwen):]
    return [f for f in flags if f not in GLM5.drop_flags]


def _run(model: Path, work: Path, layout: list[str], plugins: tuple[str, ...] = PLUGINS, teacher: Path | None = None,
         engine_checkpoint: Path | None = None, dump_index_sets: bool = False):
    """slime's train.py on the tiny GLM-5 with ``plugins`` and slime's gate (:data:`CI_GATE`); with ``teacher``,
    opd's teacher engine serves it (``parallel_evidence.opd_settings``, top-k) and the reward goes through opd's task
    reward path;
    with ``engine_checkpoint`` (a quantised one: its format is what the sync plugin pushes) the engine serves it and
    slime's gate is off; with ``dump_index_sets``, both sides write the DSA key sets they attended to
    (``dsa-determinism``'s ``ascend_dsa_index_dump_dir`` and ``serve-torch --dump-dsa-index-sets``) under
    ``work / "dsa"``."""
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(work / "prompts.jsonl", domains=tuple(OPD_COEFS) if teacher else ())
    served = engine_checkpoint or model
    dump = ("--dump-dsa-index-sets", str(work / "dsa" / "rollout")) if dump_index_sets else ()
    engine = start_engine(served, work / "engine.log", ready=False,
                          engine_args=("--enable-return-routed-experts", *dump))
    engines = [engine]
    opd = {"ascend_dsa_index_dump_dir": str(work / "dsa" / "train")} if dump_index_sets else {}
    if teacher is not None:
        engines.append(start_engine(teacher, work / "engine-teacher.log"))  # opd asks it at parse_args
        opd = {**opd, **opd_settings(teacher, "topk", url=engines[-1].url, ascend_opd_topk=OPD_TOPK)}
    flags = _glm5_flags(slime_flags(model, prompts, [engine], work, num_rollout=NUM_ROLLOUT, batch=BATCH,
                                    n_samples=N_SAMPLES, max_response=MAX_RESPONSE, save=False))
    at = flags.index("--rm-type")
    del flags[at:at + 2]  # the reward is parity_reward.reward
    flags[flags.index("--hf-checkpoint") + 1] = str(served)  # Megatron loads --load (fp32)
    # later flags win in slime's argparse: the layout replaces the one-rank sizes of slime_flags
    flags += [*([] if teacher else ["--custom-rm-path", "parity_reward.reward"]),
              "--sglang-enable-deterministic-inference", "--update-weight-disk-keep-files",
              "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"), "--use-rollout-routing-replay",
              "--save-debug-rollout-data", str(work / "dump" / "rollout_{rollout_id}.pt"),
              *(CI_GATE if engine_checkpoint is None else []), *layout]
    try:
        run = run_slime("train.py", flags, work, plugins, custom_config=_config(work, plugins, opd), timeout=1500,
                        extra_env={"PYTHONPATH": str(HERE)})
    finally:
        for each in engines:
            stop(each.proc)
    print(f"\nglm5 {work.name}: {' '.join(layout) or 'one rank'}: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-8000:]
    assert "bf16 " + "." * 44 + " False" in run.log  # Megatron's argument dump: this run trained in fp32
    assert re.search(r"^\s*spec \.+ \['slime_plugins\.models\.glm5\.glm5', 'get_glm5_spec'\]$", run.log, re.MULTILINE)
    steps = _steps(run)
    assert [m["train/step"] for m in steps] == list(range(NUM_ROLLOUT)), steps
    gaps = [m["train/train_rollout_logprob_abs_diff"] for m in steps]  # slime's --ci-test asserted each already
    print(f"train/rollout log-prob gap per step: {gaps}; grad norm {[m['train/grad_norm'] for m in steps]}")
    assert all(0 <= g <= (LOGPROB_GATE if engine_checkpoint is None else 1.0) for g in gaps), gaps
    _assert_routes_replayed(work, run)
    return run


def _assert_same_key_sets(work: Path, tp: int) -> None:
    """The train side's DSA key sets (``train.dsa_index_dump``) equal the engine's (``--dump-dsa-index-sets``) at every
    fed position of every sample in each of the four layers. Each sample is met once per TP rank of its data-parallel
    group (the indexer runs whole on each), in its rollout's train step: one step a rollout, so slime reuses that
    forward's log-probs (``actor.py`` ``can_reuse_log_probs_in_loss``) and runs no separate log-prob pass."""
    from slime_ascend.dsa.index_sets import compare_dirs

    result = compare_dirs(work / "dsa" / "train", work / "dsa" / "rollout")
    print("\n".join(result.lines()))
    samples = BATCH * N_SAMPLES * NUM_ROLLOUT
    assert result.train_samples == samples and result.unmatched == 0, result.lines()
    assert sorted(result.layers) == [0, 1, 2, 3], result.lines()
    assert all(c.samples == tp * samples and c.differing == 0 for c in result.layers.values()), result.lines()
    assert result.equal


def _assert_routes_replayed(work: Path, run) -> None:
    """Routing replay: every sample of every rollout carried the engine's routed experts ([fed tokens, layers,
    top_k]: zeros in the dense layer 0, two distinct experts in each MoE layer), and every train rank wired slime's
    replay into Megatron (train.routing_replay)."""
    import torch

    for rollout_id in range(NUM_ROLLOUT):
        samples = torch.load(work / "dump" / f"rollout_{rollout_id}.pt", weights_only=False)["samples"]
        assert len(samples) == BATCH * N_SAMPLES
        for sample in samples:
            routes = torch.as_tensor(sample["rollout_routed_experts"])
            assert routes.shape == (len(sample["tokens"]) - 1, 1 + len(MOE_LAYERS), 2), routes.shape
            moe = routes[:, list(MOE_LAYERS)]
            assert not routes[:, 0].any() and (moe[..., 0] != moe[..., 1]).all() and (moe < EXPERTS).all()
    assert run.log.count("applied runtime patch train.routing_replay") >= _ranks(run)


def _steps(run) -> list[dict]:
    return [m for m in run.metrics() if "train/step" in m]


def _dump(work: Path, rollout_id: int) -> dict:
    import torch

    return torch.load(work / "dump" / f"train_{rollout_id}.pt", weights_only=False)


@pytest.fixture(scope="module")
def glm5_reference(glm5_dir, tmp_path_factory):
    """The one-rank run, shared by every test of the module: (its work dir, its Run)."""
    work = tmp_path_factory.mktemp("glm5-one-rank")
    return work, _run(glm5_dir, work, [], dump_index_sets=True)


def test_train_py_trains_slimes_glm5_spec_within_slimes_logprob_gate(glm5_dir, glm5_reference):
    from slime_ascend.rollout.torch_engine.model import load_model, validate_state_dict

    work, run = glm5_reference
    assert _ranks(run) == 1
    steps = _steps(run)
    assert any(m["train/grad_norm"] > 0 for m in steps)
    pushes = _pushes(work)
    assert len(pushes) >= NUM_ROLLOUT, pushes  # the initial weights, then a push after the first step
    first, last = _pushed_tensors(pushes[0]), _pushed_tensors(pushes[-1])
    assert {n for n in last if ".mlp.experts." in n} == EXPERT_TENSORS
    validate_state_dict(load_model(glm5_dir), last, source=str(pushes[-1]))  # the engine loads it
    assert any(not first[n].equal(last[n]) for n in EXPERT_TENSORS)  # the last push carries trained experts
    # and trained MLA down projections (slime's duplicated TELinears: at TP 2 their gradients are summed over TP)
    down = [n for n in first if n.endswith(("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"))]
    assert len(down) == 8 and all(not first[n].equal(last[n]) for n in down), down


def test_train_and_rollout_attend_to_the_same_dsa_key_sets_in_every_layer(glm5_reference):
    """dsa-determinism's contract read off slime's loop: the train-side forward of every sample of both rollouts
    attended, in each of the four layers (IndexShare's two reusing layers included), to the key sets the engine
    attended to at every fed position. Records from ``train.dsa_index_dump``
    and the engine's ``--dump-dsa-index-sets``; compared by ``slime-ascend dsa-index-sets``, the command a user
    runs."""
    work, _ = glm5_reference
    _assert_same_key_sets(work, tp=1)
    cli = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "dsa-index-sets", str(work / "dsa" / "train"),
                          str(work / "dsa" / "rollout")], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "the same key sets on both sides" in cli.stdout, cli.stdout + cli.stderr


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_glm5_layout_matches_the_one_rank_glm5_run(glm5_dir, glm5_reference, tmp_path, layout):
    import torch

    from parallel_evidence import assert_same_tensors

    shape, megatron_args = LAYOUTS[layout]
    work = tmp_path / layout
    run = _run(glm5_dir, work, shape.flags(), dump_index_sets=True)  # slime's gate asserted in each step too
    assert _ranks(run) == shape.world, _ranks(run)
    _assert_same_key_sets(work, tp=shape.tp)  # the key sets at this layout, read off its own run
    for name, value in megatron_args.items():  # the layout Megatron built, from its own argument dump
        assert _megatron_args(run, name) == {value}, (name, _megatron_args(run, name))
    ref_work, ref_run = glm5_reference
    worst = {"log_probs": 0.0, "advantages": 0.0, "grad_norm": 0.0, "loss": 0.0, "push": 0.0}
    for rollout_id in range(NUM_ROLLOUT):
        ref_dump, dump = _dump(ref_work, rollout_id), _dump(work, rollout_id)
        assert len(dump["dp_shards"]) == shape.data_parallel
        ref = {s["sample_index"]: s for s in ref_dump["samples"]}
        got = {s["sample_index"]: s for s in dump["samples"]}
        assert sorted(got) == sorted(ref) and len(ref) == BATCH * N_SAMPLES, (rollout_id, sorted(got), sorted(ref))
        for index, sample in ref.items():
            for field in ("tokens", "loss_masks"):
                assert torch.equal(torch.as_tensor(got[index][field]), torch.as_tensor(sample[field])), \
                    (rollout_id, index, field)
            assert float(got[index]["rewards"]) == float(sample["rewards"]), (rollout_id, index)
            for field, atol in (("log_probs", LOGPROB_ATOL), ("advantages", ADVANTAGE_ATOL)):
                a, b = torch.as_tensor(got[index][field]).float(), torch.as_tensor(sample[field]).float()
                where = f"rollout {rollout_id} sample {index} {field}"
                torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m, w=where: f"{w}: {m}")
                worst[field] = max(worst[field], float((a - b).abs().max()))
        assert any(float(abs(torch.as_tensor(s["advantages"])).max()) > 0 for s in ref.values())
    ref_steps, steps = _steps(ref_run), _steps(run)
    for ref_m, m in zip(ref_steps, steps):
        assert math.isclose(m["train/grad_norm"], ref_m["train/grad_norm"], rel_tol=METRIC_RTOL), (m, ref_m)
        assert math.isclose(m["train/loss"], ref_m["train/loss"], rel_tol=METRIC_RTOL, abs_tol=LOSS_ATOL), (m, ref_m)
        assert m["train/dis_masked"] == ref_m["train/dis_masked"]
        worst["grad_norm"] = max(worst["grad_norm"], abs(m["train/grad_norm"] / ref_m["train/grad_norm"] - 1))
        worst["loss"] = max(worst["loss"], abs(m["train/loss"] - ref_m["train/loss"]))
    assert any(m["train/grad_norm"] > 0 for m in ref_steps)  # the reward varied: the comparison has gradients
    # pushes: every expert, gathered over EP; the first (before any step) byte-identical to one rank's
    ref_pushes, pushes = _pushes(ref_work), _pushes(work)
    assert [p.name for p in pushes] == [p.name for p in ref_pushes]
    for ref_push, push in zip(ref_pushes, pushes):
        ref_state, state = _pushed_tensors(ref_push), _pushed_tensors(push)
        assert sorted(state) == sorted(ref_state)
        assert {n for n in state if ".mlp.experts." in n} == EXPERT_TENSORS
    assert_same_tensors(pushes[0], ref_pushes[0])  # names, dtypes, shapes and bytes
    for ref_push, push in zip(ref_pushes[1:], pushes[1:]):  # trained weights: fp32 sums in another order
        ref_state, state = _pushed_tensors(ref_push), _pushed_tensors(push)
        for name, tensor in ref_state.items():
            torch.testing.assert_close(state[name].float(), tensor.float(), rtol=METRIC_RTOL, atol=1e-6,
                                       msg=lambda m, w=f"{push.name} {name}": f"{w}: {m}")
            worst["push"] = max(worst["push"], float((state[name].float() - tensor.float()).abs().max()))
    print(f"{layout}: largest gaps to one rank: {worst}")


def test_opd_topk_and_fp8_sync_train_glm5(glm5_dir, glm5_teacher_dir, tmp_path_factory):
    """``opd`` in top-k mode (MOPD: the reverse KL over the teacher's top-k ids, a loss term) and ``fp8-sync`` on
    slime's GLM-5 spec at one rank. Two teachers on one engine serving a GLM-5 of another seed; the rollout engine
    serves ``slime-ascend quantize --format fp8-block`` of the checkpoint. Checked, from slime's train dump: each
    sample's teacher payload is its routed teacher's top-k of the response (ids exactly, log-probs within 2e-5 of a
    forward of the teacher checkpoint, transformers' ``GlmMoeDsa`` aligned as the engine serves it); per step, the
    top-k KL is positive and its loss term coefficient-weighted (mean coefficient 0.75), with gradients. From the
    pushes: the first (the loaded weights, MLA, DSA indexer and every expert quantised in the train actor) is
    byte-identical to ``slime-ascend quantize --format fp8-block`` of those weights, every push is fp8-block with
    every expert, and the engine loaded each in fp8."""
    import torch

    from parallel_evidence import assert_same_tensors, first_push_reference, quantize
    from slime_ascend.rollout.torch_engine.model import load_model

    quantized = quantize(glm5_dir, tmp_path_factory.mktemp("glm5-fp8") / "tiny-glm5-fp8", QUANT_FORMAT)
    work = tmp_path_factory.mktemp("glm5-opd-topk-fp8")
    run = _run(glm5_dir, work, [], plugins=OPD_PLUGINS, teacher=glm5_teacher_dir, engine_checkpoint=quantized)
    reference = first_push_reference(glm5_dir, tmp_path_factory.mktemp("glm5-first-push"), QUANT_FORMAT)
    pushes = _pushes(work)
    assert len(pushes) >= NUM_ROLLOUT, pushes
    assert_same_tensors(pushes[0], reference)  # names, dtypes, shapes and bytes
    engine_log = (work / "engine.log").read_text()
    for push in pushes:
        state = _pushed_tensors(push)
        assert {n for n in state if ".mlp.experts." in n and n.endswith(".weight")} == EXPERT_TENSORS, push
        assert all(state[n].dtype == torch.float8_e4m3fn for n in EXPERT_TENSORS), push
        assert any(n.endswith("indexer.wk.weight") and state[n].dtype == torch.float8_e4m3fn for n in state), push
        assert re.search(rf"loaded weight version \S+ from \S*{push.name}/? \({QUANT_FORMAT}\)", engine_log), push
    for patch_id in ("rollout.forward_metadata", "train.loss_batch_metadata"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    teacher = load_model(glm5_teacher_dir, torch.float32)
    checked = 0
    for rollout_id in range(NUM_ROLLOUT):
        for sample in _dump(work, rollout_id)["samples"]:
            meta, tokens = sample["metadata"], torch.as_tensor(sample["tokens"]).long()
            n = int(sample["response_lengths"])
            assert meta["opd_teacher"] in OPD_COEFS
            with torch.no_grad():
                logits = teacher(input_ids=tokens[:-1].reshape(1, -1), use_cache=False).logits[0, -n:].float()
            want = torch.log_softmax(logits, dim=-1).topk(OPD_TOPK, dim=-1)
            ids, log_probs = meta["opd_topk"]["ids"], meta["opd_topk"]["log_probs"]
            assert torch.equal(torch.as_tensor(ids).long().reshape(n, OPD_TOPK), want.indices), (rollout_id, n)
            torch.testing.assert_close(torch.as_tensor(log_probs).float().reshape(n, OPD_TOPK), want.values,
                                       rtol=0, atol=LOGPROB_ATOL)
            checked += 1
    assert checked == NUM_ROLLOUT * BATCH * N_SAMPLES
    steps = [m for m in run.metrics() if "train/opd_topk_kl" in m]
    assert len(steps) == NUM_ROLLOUT, steps
    for m in steps:
        assert 0 < m["train/opd_topk_loss"] < m["train/opd_topk_kl"] and m["train/grad_norm"] > 0, m
    print(f"opd top-k on GLM-5: KL {[m['train/opd_topk_kl'] for m in steps]}, loss term "
          f"{[m['train/opd_topk_loss'] for m in steps]}")
