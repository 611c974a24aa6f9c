"""The plugin families that cannot share the runs of ``test_slime_parallel_cpu.py`` (``dis`` + ``staleness`` +
``tito`` + ``reward-mix`` + ``int8-sync``), each in slime's own ``train.py`` on this CPU at the one layout its
numerical contract lives in, against the one-rank run of the same job (same seed, data, flags and YAML).

* ``opd`` top-k at TP 2: the student's log-probs at the teacher's top-k ids are ``logit - logsumexp`` over the
  vocabulary-parallel logits, all-reduced (sum and max) over the tensor-parallel group (``opd/hooks.py``
  ``opd_topk_loss``); the top-k KL and its loss term are compared per step, with the log-probs, masks,
  advantages, loss and grad norm.

Why one layout per family: CI time (each slime-loop run costs 1.5-4 min on 2 cores) does not allow a cross
product of families and layouts; a family runs at the layout its contract is about (``opd`` top-k: TP, where
the vocabulary is split), and families that compose share a pair of runs where their evidence stays separable
(``test_slime_parallel_cpu.py``). ``opd`` in sampled mode is not run above one rank here: its advantage is
per-token arithmetic on the train-side log-probs, which every layout of ``test_slime_parallel_cpu.py`` compares.

Every run trains in fp32 (``bf16: false``: see ``test_slime_parallel_cpu.py``), samples with per-sample seeds
(``--sglang-enable-deterministic-inference``) and rewards with ``parity_reward.reward`` (a function of the
response, through ``ascend_opd_task_rm_path``). Tolerances (fp32 summed in another order): log-probs 2e-5
absolute; GRPO advantages 1e-6 absolute (the same rewards, another sum order of the group statistics); loss,
grad norm, the top-k KL and its loss term 1e-4 relative (also 1e-7 absolute); masks, tokens, rewards and the
teacher payload exactly.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slime_ascend.demo.slime_job import make_model, make_prompts, run_slime, slime_flags, start_engine, stop
from e2e_fixtures import model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1800)]

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
         domains: tuple[str, ...] = ()):
    """slime's train.py on ``model`` (the engine on ``engine_checkpoint``; a teacher engine on ``teacher``, whose
    URL goes to every teacher of ``ascend_opd_teachers``); slime's train dumps under ``work/dump``."""
    work.mkdir(parents=True, exist_ok=True)
    engines = {"rollout": start_engine(engine_checkpoint, work / "engine.log")}
    try:
        if teacher is not None:
            engines["teacher"] = start_engine(teacher, work / "engine-teacher.log")
            settings = {**settings, "ascend_opd_teachers": [{**t, "url": engines["teacher"].url}
                                                            for t in settings["ascend_opd_teachers"]]}
        prompts = make_prompts(work / "prompts.jsonl", domains=domains)
        flags = [f for f in slime_flags(model, prompts, [engines["rollout"]], work, num_rollout=NUM_ROLLOUT,
                                        batch=batch, n_samples=n_samples) if f != "--bf16"]
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
    import torch

    for rollout_id in range(NUM_ROLLOUT):
        ref, got = _samples(ref_work, rollout_id), _samples(work, rollout_id)
        assert sorted(got) == sorted(ref) and ref, (rollout_id, sorted(got), sorted(ref))
        for position, sample in ref.items():
            assert torch.equal(torch.as_tensor(got[position]["tokens"]), torch.as_tensor(sample["tokens"])), \
                (rollout_id, position)  # the same rollout: the engine served the same weights
            for key, atol in tolerances.items():
                want, have = torch.as_tensor(sample[key]).float(), torch.as_tensor(got[position][key]).float()
                if atol is None:
                    assert torch.equal(have, want), (rollout_id, position, key, have, want)
                else:
                    torch.testing.assert_close(have, want, rtol=0, atol=atol, msg=lambda m: f"{key} "
                                               f"(rollout {rollout_id}, sample {position}): {m}")
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


def _ranks(run, role: str = "actor") -> int:
    """Train processes slime started for ``role`` (actor or critic): one device line each."""
    return run.log.count(f"slime accelerator in the {role} train actor")


# ---- opd top-k at TP 2 -------------------------------------------------------------------------------------

TOPK = 4
OPD_COEFS = {"math": 1.0, "code": 0.5}


def test_opd_topk_at_tp2_matches_the_one_rank_run(model_dir, tmp_path_factory):
    """Two teachers on one teacher engine (coefficients 1.0 and 0.5, routed by the prompt's domain); the top-k KL
    of every step is reduced over the vocabulary-parallel logits of the TP group."""
    teacher = make_model(tmp_path_factory.mktemp("teacher") / "teacher-math", seed=1)
    settings = {
        "ascend_opd_teachers": [{"name": name, "checkpoint_dir": str(teacher), "domains": [name], "coef": coef}
                                for name, coef in OPD_COEFS.items()],
        "ascend_opd_domain_key": "domain", "ascend_opd_switch_engine_urls": [],
        "ascend_opd_task_rm_path": "parity_reward.reward", "ascend_opd_mode": "topk", "ascend_opd_topk": TOPK,
    }
    kwargs = dict(model=model_dir, engine_checkpoint=model_dir, plugins=("cpu", "opd"), settings=settings,
                  batch=4, n_samples=2, teacher=teacher, domains=("math", "code"))
    runs = {}
    for name, layout in (("one-rank", []), ("tp2", TP2)):
        work = tmp_path_factory.mktemp(f"opd-topk-{name}")
        runs[name] = (work, _run(work, layout=layout, **kwargs))
    (ref_work, ref_run), (work, run) = runs["one-rank"], runs["tp2"]
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
