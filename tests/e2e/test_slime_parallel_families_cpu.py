"""The plugin families that cannot share the runs of ``test_slime_parallel_cpu.py`` (``dis`` + ``staleness`` +
``tito`` + ``reward-mix`` + ``int8-sync``), each in slime's own ``train.py`` on this CPU at the one layout its
numerical contract lives in, against the one-rank run of the same job (same seed, data, flags and YAML).

* ``opd`` top-k at TP 2: the student's log-probs at the teacher's top-k ids are ``logit - logsumexp`` over the
  vocabulary-parallel logits, all-reduced (sum and max) over the tensor-parallel group (``opd/hooks.py``
  ``opd_topk_loss``); the top-k KL and its loss term are compared per step, with the log-probs, masks,
  advantages, loss and grad norm.
* ``icepop`` at CP 2 (with ``int8-sync``, so that the engine serves W8A8 weights and IcePop's band has tokens on
  both sides): each CP rank masks and reweights its own zig-zag shard of every response, and slime reduces
  IcePop's metrics and the loss over the CP group. Compared: IcePop's decision for every token (from slime's
  dumped train-side and engine log-probs, with the plugin's own ``icepop_weights``), its step metrics
  (``train/icepop_masked``, ``_ratio``, ``_k3_kl``, ``_logratio_abs``), log-probs, masks, advantages, loss, grad
  norm, and the first pushed weights (byte-identical).
* ``sao`` with ``compaction`` at CP 2, composed as in the demo, in one pair of runs (the critic gets the actor's
  layout): every rollout is two segments of ~800 tokens. Compaction's evidence (per segment: the rollout's
  trainable tokens, N_after, the decay factor of the earlier segment) is compared exactly, then SAO's: the critic's
  values, the actor's skip-observation GAE (``advantage_base.skip_observation_advantages``: values gathered over
  the CP group, GAE on the full response, sliced back) with its length-adaptive lambdas, the decayed advantages
  and returns, the critic's K = 2 value-loss passes and SAO's DIS loss.

Context parallelism is slime's zig-zag split (``--context-parallel-size 2``) for these families, not
``--allgather-cp``: in both layouts slime hands the plugins' hooks zig-zag shards (``_allgather_cp_redistribute``
re-slices the log-probs and values that ``--allgather-cp`` computes contiguously, the actor slices the engine's
log-probs zig-zag in both, and the masks stay full length), so the plugins' own CP code (``cp_slice``,
``cp_full_vectors``, the CP-local masks of their losses) runs the same; zig-zag is slime's default, and
``--allgather-cp`` adds only slime's own conversion, which ``test_slime_parallel_cpu.py``'s ``cp2-allgather`` run
checks. Each response lies across both CP ranks (IcePop's are 16 tokens long for that: ``MAX_RESPONSE``).

Why one layout per family: CI time (each slime-loop run costs 1.5-4 min on 2 cores) does not allow a cross
product of families and layouts; a family runs at the layout its contract is about (``opd`` top-k: TP, where
the vocabulary is split), and families that compose share a pair of runs where their evidence stays separable
(``test_slime_parallel_cpu.py``). ``opd`` in sampled mode at TP 2 passed the same kind of checks and runs with
``SLIME_ASCEND_ALL_CASES=1`` (marked ``all_cases``; CI time: two runs, 4 min on 2 busy cores): its per-token teacher
term is arithmetic on the student's log-probs slime already computed from the vocabulary-parallel logits, and those
log-probs at TP 2 are compared with the one-rank run's in CI by the top-k run here and by
``test_slime_parallel_cpu.py``'s ``tp2-sp``; the term itself runs in slime's loop in ``test_slime_opd.py``.

Every run trains in fp32 (``bf16: false``: see ``test_slime_parallel_cpu.py``), samples with per-sample seeds
(``--sglang-enable-deterministic-inference``) and rewards with ``parity_reward.reward`` (a function of the
response, through ``ascend_opd_task_rm_path`` or ``--custom-rm-path``). Tolerances (fp32 summed in another order):
log-probs 2e-5 absolute; GRPO advantages 1e-6 absolute (the same rewards, another sum order of the group
statistics); loss, grad norm, the top-k KL and its loss term 1e-4 relative (also 1e-7 absolute); masks, tokens,
rewards and the teacher payload exactly. SAO's values 2e-5 absolute (the critic's forward, like the log-probs); its
advantages and returns 1e-4 absolute (GAE sums a rollout's TD residuals, each from two values within 2e-5; measured
2.7e-7, while a gather missing one CP shard moves them by 2.6e-2); the critic's value loss and grad norm 1e-4
relative; slime's mean |train - engine| log-prob of each step 2e-5 absolute (it moves by at most the log-probs' own
difference); IcePop's per-token decisions and compaction's segment bookkeeping exactly.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from parallel_evidence import OPD_COEFS, opd_settings, train_ranks as _ranks
from slime_ascend.demo.slime_job import make_model, make_prompts, run_slime, slime_flags, start_engine, stop
from e2e_fixtures import model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent
NUM_ROLLOUT = 2
LOGPROB_ATOL = 2e-5
GRPO_ADVANTAGE_ATOL = 1e-6
METRIC_RTOL = 1e-4
LOSS_ATOL = 1e-7
TP2 = ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"]


def _cli(*argv: str, cwd: Path | None = None) -> None:
    out = subprocess.run([sys.executable, "-m", "slime_ascend.cli", *argv], capture_output=True, text=True,
                         cwd=str(cwd) if cwd else None)
    assert out.returncode == 0, out.stdout + out.stderr


def _config(work: Path, plugins: tuple[str, ...], settings: dict) -> Path:
    out = work / "ascend.yaml"
    _cli("config", *plugins, "-o", str(out), cwd=work)
    cfg = yaml.safe_load(out.read_text())
    cfg.update(settings)
    cfg["bf16"] = False  # fp32 training (see test_slime_parallel_cpu.py)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _run(work: Path, *, model: Path, engine_checkpoint: Path, plugins: tuple[str, ...], settings: dict,
         layout: list[str], batch: int, n_samples: int, extra_flags: list[str] = (), teacher: Path | None = None,
         domains: tuple[str, ...] = (), save: bool = True):
    """slime's train.py on ``model`` (the engine on ``engine_checkpoint``; a teacher engine on ``teacher``, whose
    URL goes to every teacher of ``ascend_opd_teachers``); slime's train dumps under ``work/dump``. ``save``:
    slime's ``--save`` of the last rollout (``slime_flags``)."""
    work.mkdir(parents=True, exist_ok=True)
    engines = {"rollout": start_engine(engine_checkpoint, work / "engine.log", ready=False)}
    try:
        if teacher is not None:
            engines["teacher"] = start_engine(teacher, work / "engine-teacher.log")  # opd asks it at parse_args (10 s)
            settings = {**settings, "ascend_opd_teachers": [{**t, "url": engines["teacher"].url}
                                                            for t in settings["ascend_opd_teachers"]]}
        prompts = make_prompts(work / "prompts.jsonl", domains=domains)
        flags = [f for f in slime_flags(model, prompts, [engines["rollout"]], work, num_rollout=NUM_ROLLOUT,
                                        batch=batch, n_samples=n_samples, save=save) if f != "--bf16"]
        at = flags.index("--rm-type")
        del flags[at:at + 2]  # the reward is parity_reward.reward (--custom-rm-path or opd's task reward path)
        flags[flags.index("--hf-checkpoint") + 1] = str(engine_checkpoint)
        flags += ["--sglang-enable-deterministic-inference", "--update-weight-disk-keep-files",
                  "--save-debug-train-data", str(work / "dump" / "train_{rollout_id}.pt"), *extra_flags, *layout]
        run = run_slime("train.py", flags, work, plugins, custom_config=_config(work, plugins, settings),
                        extra_env={"PYTHONPATH": str(HERE)})
    finally:
        for engine in engines.values():
            stop(engine.proc)
    print(f"\n{work.name}: {' '.join(layout) or 'one rank'}: rc {run.returncode}, {run.seconds / 60:.2f} min")
    assert run.returncode == 0, run.log[-6000:]
    assert "bf16 " + "." * 44 + " False" in run.log  # Megatron's argument dump: this run trained in fp32
    assert run.log.count("slime-ascend plugins active: " + ", ".join(plugins)) >= 2, plugins
    return run


def _samples(work: Path, rollout_id: int) -> dict[int, dict]:
    """slime's train dump of one rollout: every sample (gathered over DP, CP fields restored), keyed by its
    position in the rollout (compaction's segments share a sample index)."""
    import torch

    dump = torch.load(work / "dump" / f"train_{rollout_id}.pt", weights_only=False)
    return {s["rollout_position"]: s for s in dump["samples"]}


def _assert_samples_alike(ref_work: Path, work: Path, tolerances: dict[str, float | None]) -> dict[int, dict]:
    """Every sample of every rollout: the same tokens, and each field of ``tolerances`` equal (None: exactly) or
    within its absolute tolerance. Returns the one-rank run's samples of the last rollout."""
    from parallel_evidence import assert_samples_alike

    for rollout_id in range(NUM_ROLLOUT):
        ref = _samples(ref_work, rollout_id)
        assert_samples_alike(ref, _samples(work, rollout_id), tolerances, rollout_id)
    return ref


def _steps(run, key: str) -> list[dict]:
    return [m for m in run.metrics() if key in m]


def _assert_steps_alike(ref_run, run, key: str, close: tuple[str, ...], exact: tuple[str, ...] = (),
                        count: int = NUM_ROLLOUT) -> list[dict]:
    """slime's step-metric dicts carrying ``key``: the same steps, ``close`` to 1e-4 relative, ``exact`` equal."""
    ref_steps, steps = _steps(ref_run, key), _steps(run, key)
    assert len(ref_steps) == len(steps) == count, (key, len(ref_steps), len(steps))
    assert [m["train/step"] for m in steps] == [m["train/step"] for m in ref_steps]
    for ref_m, m in zip(ref_steps, steps, strict=True):
        for name in close:
            assert math.isclose(m[name], ref_m[name], rel_tol=METRIC_RTOL, abs_tol=LOSS_ATOL), (name, m, ref_m)
        for name in exact:
            assert m[name] == ref_m[name], (name, m, ref_m)
    return ref_steps


# ---- opd top-k at TP 2 -------------------------------------------------------------------------------------

TOPK = 4


def _opd_pair(model_dir: Path, tmp_path_factory, mode: str, settings: dict | None = None):
    """The one-rank and the TP 2 run of one opd job in ``mode``: two teachers (coefficients :data:`OPD_COEFS`,
    routed by the prompt's domain) on one teacher engine; ``((work, run) one rank, (work, run) TP 2)``."""
    teacher = make_model(tmp_path_factory.mktemp(f"teacher-{mode}") / "teacher-math", seed=1)
    settings = opd_settings(teacher, mode, **(settings or {}))
    kwargs = dict(model=model_dir, engine_checkpoint=model_dir, plugins=("cpu", "opd"), settings=settings,
                  batch=4, n_samples=2, teacher=teacher, domains=("math", "code"))
    runs = []
    for name, layout in (("one-rank", []), ("tp2", TP2)):
        work = tmp_path_factory.mktemp(f"opd-{mode}-{name}")
        runs.append((work, _run(work, layout=layout, **kwargs)))
    return runs


def test_opd_topk_at_tp2_matches_the_one_rank_run(model_dir, tmp_path_factory):
    """Two teachers on one teacher engine (coefficients 1.0 and 0.5, routed by the prompt's domain); the top-k KL
    of every step is reduced over the vocabulary-parallel logits of the TP group."""
    (ref_work, ref_run), (work, run) = _opd_pair(model_dir, tmp_path_factory, "topk", {"ascend_opd_topk": TOPK})
    assert _ranks(run) == 2
    for patch_id in ("rollout.forward_metadata", "train.loss_batch_metadata"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    ref = _assert_samples_alike(ref_work, work, {"log_probs": LOGPROB_ATOL, "loss_masks": None,
                                                 "advantages": GRPO_ADVANTAGE_ATOL, "rewards": None})
    # the teacher payload the loss read is the same in both runs (the same tokens scored by the same teacher)
    import torch

    for rollout_id in range(NUM_ROLLOUT):
        for position, sample in _samples(ref_work, rollout_id).items():
            got = _samples(work, rollout_id)[position]["metadata"]
            assert got["opd_teacher"] == sample["metadata"]["opd_teacher"]
            for key in ("ids", "log_probs"):
                assert torch.equal(got["opd_topk"][key], sample["metadata"]["opd_topk"][key]), (rollout_id, key)
    assert any(float(abs(s["advantages"]).max()) > 0 for s in ref.values())
    ref_steps = _assert_steps_alike(ref_run, run, "train/opd_topk_kl",
                                    close=("train/opd_topk_kl", "train/opd_topk_loss", "train/loss",
                                           "train/grad_norm"))
    # the top-k term acts: positive, coefficient-weighted (mean coef 0.75), with gradients
    for m in ref_steps:
        assert 0 < m["train/opd_topk_loss"] < m["train/opd_topk_kl"] and m["train/grad_norm"] > 0, m


@pytest.mark.all_cases
def test_opd_sampled_at_tp2_matches_the_one_rank_run(model_dir, tmp_path_factory):
    """``opd`` in sampled mode (the default): the same two teachers; each response token's advantage carries the
    routed teacher's coefficient times (teacher - student) log-prob of the sampled token, the student's taken from
    the vocabulary-parallel log-probs of the TP group. Compared: the teacher's per-token log-probs (exactly: the
    same tokens scored by the same engine), the student's, the advantages (within the log-probs' own tolerance:
    the term moves with them), slime's loss and grad norm per step; the term acts (advantages vary within a
    response, where GRPO's alone are one value per sample)."""
    import torch

    (ref_work, ref_run), (work, run) = _opd_pair(model_dir, tmp_path_factory, "sampled")
    assert _ranks(run) == 2
    assert "applied runtime patch rollout.forward_metadata" in run.log
    # slime's train dump: the routed teacher's log-probs of the response (``teacher_log_probs``), exactly; the
    # per-token reverse KL the term is made of and the advantages, within the student log-probs' tolerance
    ref = _assert_samples_alike(ref_work, work, {"log_probs": LOGPROB_ATOL, "loss_masks": None, "rewards": None,
                                                 "teacher_log_probs": None, "opd_coef": None,
                                                 "opd_reverse_kl": LOGPROB_ATOL, "advantages": LOGPROB_ATOL})
    for rollout_id in range(NUM_ROLLOUT):
        for position, sample in _samples(ref_work, rollout_id).items():
            assert _samples(work, rollout_id)[position]["metadata"]["opd_teacher"] == sample["metadata"]["opd_teacher"]
    # the teacher term acts: within a response the advantages vary (GRPO's own are one value per sample)
    assert any(float(torch.as_tensor(s["advantages"]).float().std()) > 0 for s in ref.values())
    _assert_steps_alike(ref_run, run, "train/grad_norm", close=("train/loss", "train/grad_norm"))


# ---- icepop and sao at CP 2 --------------------------------------------------------------------------------

CP2 = ["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"]
# 16 response tokens: with the 21-23-byte prompts a sample is 37-39 tokens, slime's zig-zag chunks are 10 long and
# each response lies across chunk 2 (CP rank 1) and chunk 3 (CP rank 0), 10 and 6 tokens (with 8 it would mostly
# sit in chunk 3 alone)
MAX_RESPONSE = 16
REWARD_FLAGS = ["--custom-rm-path", "parity_reward.reward", "--rollout-max-response-len", str(MAX_RESPONSE)]
# the engine serves `slime-ascend quantize --format int8-w8a8` and int8-sync pushes every version in it, so the
# engine's log-probs differ from the fp32 trainer's (|log rho| ~ 1e-3: measured median 1.1e-3, max 2.8e-3 on the
# tiny model) and IcePop's band [1/beta, beta] with log beta = 1.5e-3 masks a part of the tokens, keeps the rest
ICEPOP_BETA = math.exp(1.5e-3)
ICEPOP_PLUGINS = ("cpu", "icepop", "int8-sync")


def _icepop_keep(sample: dict):
    """IcePop's decision (``algorithms.masks.icepop_weights``, the function the plugin applies) for each trainable
    token of a dumped sample, from its train-side log-probs (the old ones IcePop read: the loss reused the train
    forward's) and the engine's; and each token's distance of log rho to the band's edges."""
    import torch

    from slime_ascend.algorithms.masks import icepop_weights

    lp, rlp = torch.as_tensor(sample["log_probs"]).float(), torch.as_tensor(sample["rollout_log_probs"]).float()
    trainable = torch.as_tensor(sample["loss_masks"]).bool()
    _, keep = icepop_weights(lp, rlp, ICEPOP_BETA)
    edge = ((lp - rlp).abs() - math.log(ICEPOP_BETA)).abs()
    return keep[trainable], edge[trainable]


def test_icepop_at_cp2_matches_the_one_rank_run(model_dir, tmp_path_factory):
    """IcePop (tis chain) on slime's zig-zag CP shards: each CP rank masks and reweights its own tokens' PPO loss,
    and slime reduces the loss and IcePop's metrics over the CP group with the full-length masks."""
    quantized = tmp_path_factory.mktemp("quantized") / "tiny-qwen3-int8-w8a8"
    _cli("quantize", str(model_dir), str(quantized), "--format", "int8-w8a8")
    kwargs = dict(model=model_dir, engine_checkpoint=quantized, plugins=ICEPOP_PLUGINS,
                  settings={"ascend_icepop_beta": ICEPOP_BETA}, batch=4, n_samples=2, extra_flags=REWARD_FLAGS,
                  save=False)
    runs = {}
    for name, layout in (("one-rank", []), ("cp2", CP2)):
        work = tmp_path_factory.mktemp(f"icepop-{name}")
        runs[name] = (work, _run(work, layout=layout, **kwargs))
    (ref_work, ref_run), (work, run) = runs["one-rank"], runs["cp2"]
    assert _ranks(run) == 2 and _ranks(ref_run) == 1
    ref = _assert_samples_alike(ref_work, work, {"log_probs": LOGPROB_ATOL, "rollout_log_probs": LOGPROB_ATOL,
                                                 "loss_masks": None, "advantages": GRPO_ADVANTAGE_ATOL,
                                                 "rewards": None})
    assert any(float(abs(s["advantages"]).max()) > 0 for s in ref.values())
    import torch

    # IcePop's mask token by token: the same decisions in both runs, some tokens kept and some masked
    for rollout_id in range(NUM_ROLLOUT):
        got = _samples(work, rollout_id)
        kept = masked = 0
        for position, sample in _samples(ref_work, rollout_id).items():
            (want, edge), (have, _) = _icepop_keep(sample), _icepop_keep(got[position])
            # measured: the closest log rho lies 3.9e-6 from an edge, the log-probs differ by 4.8e-7 at most
            assert torch.equal(have, want), (rollout_id, position, have, want, float(edge.min()))
            kept, masked = kept + int(want.sum()), masked + int((~want).sum())
        # measured: 101 kept and 27 masked in rollout 0, 93 and 35 in rollout 1 (of 128); 16 and 24 of the masked
        # tokens lie on CP rank 1, so a mask applied on one shard only would change train/icepop_masked by > 50%
        print(f"icepop rollout {rollout_id}: {kept} tokens kept, {masked} masked")
        assert kept > 0 and masked > 0, (rollout_id, kept, masked)
    # the plugin's own reduction over the CP group: slime's step metrics of IcePop, the loss it reweighted and
    # the gradients (measured, relative: masked 0, ratio 6e-8, k3_kl 4e-5 (values ~8e-7: within the 1e-7
    # absolute floor), logratio_abs 3.2e-5 (3e-8 absolute), loss 1.7e-6, grad norm 1.1e-7)
    ref_steps = _assert_steps_alike(ref_run, run, "train/icepop_masked",
                                    close=("train/icepop_masked", "train/icepop_ratio", "train/icepop_k3_kl",
                                           "train/icepop_logratio_abs", "train/loss", "train/grad_norm"))
    for m in ref_steps:
        assert 0 < m["train/icepop_masked"] < 1 and m["train/grad_norm"] > 0, m
    # int8-sync: the first version pushed, gathered from the CP ranks and quantised, is the one-rank run's
    from parallel_evidence import assert_same_tensors

    assert_same_tensors(work / "weights" / "weight_v000001", ref_work / "weights" / "weight_v000001")


# ---- sao with compaction at CP 2 ---------------------------------------------------------------------------

# test_slime_compaction.py's episode: kv_lookup, 3 facts, a 1024-token budget that compacts after the first action,
# so every rollout comes back as two segments (two samples of 789-850 tokens sharing a rollout id); the reward is
# parity_reward.reward of the last segment (env_reward false; cp_parity_reward answers slime's batched call),
# shared by the segments of a rollout
SAO_COMPACTION_PLUGINS = ("cpu", "sao", "compaction")
SAO_K = 2
VALUE_ATOL = 2e-5
GAE_ATOL = 1e-4
COMPACTION_SETTINGS = {
    "ascend_compaction_env_reward": False,
    "ascend_compaction_env_kwargs": {"num_facts": 3, "noise_lines": 1, "answer_turns": 1},
    "ascend_compaction_context_budget": 1024, "ascend_compaction_trigger_tokens": 700,
    "ascend_compaction_max_compactions": 1, "ascend_compaction_keep_pairs": 1,
    "ascend_compaction_summary_max_tokens": 8, "ascend_compaction_use_chat_template": False,
}


def test_sao_with_compaction_at_cp2_matches_the_one_rank_run(model_dir, tmp_path_factory):
    """SAO and compaction, composed as in the demo, on slime's zig-zag CP shards: compaction gathers each rollout's
    segments (order 50: trainable tokens of the rollout, N_after per segment), SAO's skip-observation GAE runs on
    each CP-split segment with the rollout's length-adaptive lambda (order 100), compaction decays the earlier
    segments' advantages (order 300; returns shifted with them); the critic trains K passes on the same segments."""
    runs = {}
    for name, layout in (("one-rank", []), ("cp2", CP2)):
        work = tmp_path_factory.mktemp(f"sao-compaction-{name}")
        # (compaction's generate returns a list of segments, which slime rewards in one batched call)
        flags = ["--custom-rm-path", "cp_parity_reward.reward", "--seq-length", "2048", "--advantage-estimator", "ppo",
                 "--megatron-config-path", str(work / "sao_megatron.yaml")]
        runs[name] = (work, _run(work, model=model_dir, engine_checkpoint=model_dir,
                                 plugins=SAO_COMPACTION_PLUGINS,
                                 settings={"ascend_sao_critic_iters": SAO_K, **COMPACTION_SETTINGS}, layout=layout,
                                 batch=4, n_samples=1, extra_flags=flags, save=False))
    (ref_work, ref_run), (work, run) = runs["one-rank"], runs["cp2"]
    assert (_ranks(run), _ranks(run, "critic"), _ranks(ref_run), _ranks(ref_run, "critic")) == (2, 2, 1, 1)
    for patch_id in ("train.critic_train_iters", "train.critic_advantage_function", "train.critic_hf_value_head"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    # compaction's evidence: the same segments (two per rollout), rollout totals, N_after and decay factors; then
    # SAO's: the engine's log-probs, the critic's values, the length-adaptive lambdas, advantages and returns.
    # (the train-side log-probs are checked through slime's train_rollout_logprob_abs_diff below; sao's loss also
    # hands them to slime's dump, sao.loss.capture_train_log_probs, which test_slime_moe_cpu compares per token)
    ref = _assert_samples_alike(ref_work, work, {
        "round_number": None, "rollout_ids": None, "rollout_trainable_tokens": None,
        "trainable_tokens_after": None, "compaction_decay": None,
        "rollout_log_probs": LOGPROB_ATOL, "loss_masks": None, "rewards": None,
        "values": VALUE_ATOL, "gae_lambdas": None, "advantages": GAE_ATOL, "returns": GAE_ATOL})
    import torch

    for rollout_id in range(NUM_ROLLOUT):
        samples = _samples(ref_work, rollout_id).values()
        assert sorted(int(s["round_number"]) for s in samples) == [0] * 4 + [1] * 4, rollout_id  # 2 segments each
        for s in samples:  # measured: 0.668 = (1 - 1/(1.5 * 40)) ** 24 for every first segment
            decay = float(s["compaction_decay"])
            assert (0 < decay < 1) if int(s["round_number"]) == 0 else decay == 1.0, (rollout_id, s["round_number"])
            assert 0 < float(s["gae_lambdas"]) < 1  # SAO's 1 - 1/(1.5 l), l = the rollout's trainable tokens
    worst = {key: max(float((torch.as_tensor(s[key]).float()
                             - torch.as_tensor(_samples(work, r)[p][key]).float()).abs().max())
                      for r in range(NUM_ROLLOUT) for p, s in _samples(ref_work, r).items())
             for key in ("values", "advantages", "returns")}
    lengths = sorted(int(s["total_lengths"]) for s in ref.values())
    # measured: values 1.2e-7, advantages 2.7e-7, returns 2.4e-7 (|advantages| up to 1.3); segments of 789-850
    # tokens, 8 of each segment's 16 or 24 trainable tokens on CP rank 1. SAO's GAE on a CP rank without the
    # other rank's values (a gather that returned zeros) would move them by 2.6e-2.
    print(f"sao+compaction cp2 vs one rank, largest differences: {worst}; sample lengths {lengths}")
    assert any(float(abs(s["advantages"]).max()) > 0 for s in ref.values())
    assert len({float(s["rewards"]) for r in range(NUM_ROLLOUT) for s in _samples(ref_work, r).values()}) == 2
    ref_steps = _assert_steps_alike(ref_run, run, "train/grad_norm",
                                    close=("train/loss", "train/pg_loss", "train/grad_norm",
                                           "train/dis_masked_frac"), exact=("train/global_batch_size",))
    # measured, relative: loss and pg_loss 9e-8, grad norm 3.7e-8, dis_masked_frac 0 (the fp32 engine serves the
    # trainer's weights: nothing outside SAO's band); critic value loss 1.4e-7, critic grad norm 2.9e-7.
    # The mean |train - engine| log-prob of each step (~1e-7 here) moves by at most the train-side log-probs' own
    # difference; a shard paired with another position's engine log-probs would move it by ~1
    for ref_m, m in zip(ref_steps, _steps(run, "train/grad_norm"), strict=True):
        assert abs(m["train/train_rollout_logprob_abs_diff"] - ref_m["train/train_rollout_logprob_abs_diff"]) \
            <= LOGPROB_ATOL, (m, ref_m)
    critic_steps = _assert_steps_alike(ref_run, run, "train/critic-grad_norm",
                                       close=("train/critic-value_loss", "train/critic-grad_norm"),
                                       count=NUM_ROLLOUT * SAO_K)
    assert all(m["train/grad_norm"] > 0 for m in ref_steps) and all(m["train/critic-grad_norm"] > 0
                                                                     for m in critic_steps)
