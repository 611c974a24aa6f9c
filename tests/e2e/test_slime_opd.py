"""The ``opd`` plugin (multi-teacher on-policy distillation) inside slime's own ``train.py`` on this CPU.

Two teachers, each a tiny Qwen3 made with its own seed and served by ``slime-ascend serve-torch``
on 127.0.0.1:

* ``math`` (coef 1.0) behind a URL: an engine started on the math teacher's checkpoint;
* ``code`` (coef 0.5) without a URL: the *switched* engine, started on the student's checkpoint, which
  the plugin's TeacherPool stages into ``ascend_opd_stage_dir`` in the background and switches in
  with ``/update_weights_from_disk``.

A third job puts three teachers (``math``, ``code``, ``chat``) on the switched engine alone, every rollout needing
all three, switched over the engine's weight-update group (``ascend_opd_switch_transport: distributed``: staged in
host memory, pushed with ``/update_weights_from_distributed``): the engine's own log shows each pushed at most once
a rollout.

Prompts alternate between the ``math`` and ``code`` domains (``metadata.domain``). The task reward is
slime's own ``--rm-type random`` (through ``ascend_opd_task_rm_path: slime_rule_reward``), so the
GRPO part of the advantage is not identically zero.

Evidence, all from slime's output and the teacher engines: slime's rollout and train dumps
(``--save-debug-rollout-data`` / ``--save-debug-train-data``), the metric dicts slime's processes log
(the rollout manager's ``opd <id>: {'rollout/opd_*': ...}`` on slime's rollout metric path, the train
actor's ``rollout <id>: {...}`` and ``step <id>: {...}``), the switched engine's log, and the engines'
``/get_model_info`` and ``/generate``.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_model, make_prompts, run_slime, slime_flags, start_engine, stop

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

PLUGINS = ("cpu", "opd")
COEFS = {"math": 1.0, "code": 0.5}
DOMAIN_TEACHER = {"math": "math", "code": "code"}
NUM_ROLLOUT = 2


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _teacher_log_probs(engine_url: str, tokens: list[int], response_length: int) -> list[float]:
    """Score ``tokens`` at a teacher engine the way an SGLang OPD teacher is asked (no generation)."""
    out = _post(engine_url + "/generate", {
        "input_ids": list(tokens), "sampling_params": {"temperature": 1.0, "max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0})
    values = [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]
    return values[len(values) - response_length:]


def _write_config(tmp_path: Path, teachers: list[dict], switch_url: str, stage: Path | None,
                  transport: str = "disk") -> Path:
    import yaml

    out = tmp_path / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    cfg = yaml.safe_load(out.read_text())
    cfg.update({
        "ascend_opd_teachers": teachers,
        "ascend_opd_domain_key": "domain",
        "ascend_opd_switch_engine_urls": [switch_url],
        "ascend_opd_switch_transport": transport,
        "ascend_opd_stage_dir": None if stage is None else str(stage),
        "ascend_opd_prefetch": True,
        "ascend_opd_task_rm_path": "slime_ascend.opd.hooks.slime_rule_reward",
    })
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _run_train_py(models, engines, tmp_path: Path, config: Path, domains: tuple[str, ...] = ("math", "code"),
                  batch: int = 4, n_samples: int = 2):
    """slime's train.py on the student with ``config``, prompts cycling through ``domains``, slime's rollout and
    train dumps kept; returns (run, dump folder)."""
    prompts = make_prompts(tmp_path / "prompts.jsonl", domains=domains)
    dumps = tmp_path / "dumps"
    flags = slime_flags(models["student"], prompts, [engines["rollout"]], tmp_path, num_rollout=NUM_ROLLOUT,
                        batch=batch, n_samples=n_samples)
    flags += ["--save-debug-rollout-data", str(dumps / "rollout_{rollout_id}.pt"),
              "--save-debug-train-data", str(dumps / "train_{rollout_id}.pt")]
    run = run_slime("train.py", flags, tmp_path, PLUGINS, custom_config=config)
    assert run.returncode == 0, run.log[-6000:]
    return run, dumps


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"student": make_model(root / "student", seed=0), "math": make_model(root / "teacher-math", seed=1),
            "code": make_model(root / "teacher-code", seed=2), "chat": make_model(root / "teacher-chat", seed=3)}


@pytest.fixture
def engines(models, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    # the switched engine starts on another checkpoint (the student's): the pool must switch it
    plan = {"rollout": models["student"], "math": models["math"], "switch": models["student"]}
    with ThreadPoolExecutor(len(plan)) as pool:  # three engine start-ups overlap
        futures = {k: pool.submit(start_engine, d, tmp_path / f"engine-{k}.log") for k, d in plan.items()}
    started = {k: f.result() for k, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            if f.exception() is not None:
                raise f.exception()
        yield started
    finally:
        for eng in started.values():
            stop(eng.proc)


def test_train_py_opd_two_teachers_url_and_switched(models, engines, tmp_path):
    import torch

    stage = tmp_path / "teacher-stage"
    teachers = [
        {"name": "math", "checkpoint_dir": str(models["math"]), "domains": ["math"], "coef": COEFS["math"],
         "url": engines["math"].url},
        {"name": "code", "checkpoint_dir": str(models["code"]), "domains": ["code"], "coef": COEFS["code"]},
    ]
    config = _write_config(tmp_path, teachers, engines["switch"].url, stage)
    run, dumps = _run_train_py(models, engines, tmp_path, config)
    print(f"slime train.py with cpu+opd: {run.seconds:.1f} s")

    # both roles ran the plugins; the per-teacher coefficients reach the trainer through the ledger patch
    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and "slime-ascend plugins active: cpu, opd" in line
                   for line in run.log.splitlines()), role
    assert "applied runtime patch rollout.forward_metadata" in run.log

    # ---- the switched engine: staged copy in the stage dir, switched in by update_weights_from_disk
    staged = stage / "code"
    assert (staged / ".slime-ascend-staged").is_file()
    assert sorted(p.name for p in staged.glob("*.safetensors")) == sorted(
        p.name for p in models["code"].glob("*.safetensors"))
    switch_info = _get(engines["switch"].url + "/get_model_info")
    assert switch_info["model_path"] == str(staged), switch_info
    assert switch_info["weight_version"] == "1", switch_info  # one switch: student -> code teacher, once
    switch_log = engines["switch"].log.read_text()
    assert switch_log.count("loaded weight version") == 1 and f"loaded weight version 1 from {staged}" in switch_log
    math_info = _get(engines["math"].url + "/get_model_info")
    assert math_info["model_path"] == str(models["math"]) and math_info["weight_version"] == "default"

    # ---- routing and switching, as the rollout manager reported them on slime's rollout metric path each
    # step: 4 samples per teacher, one switch (student -> code teacher), staged by the background prefetch
    # (never a cold load in the scoring path), nothing failed
    opd_steps = [m for m in run.metrics() if "rollout/opd_samples/math" in m]
    assert len(opd_steps) == NUM_ROLLOUT, run.metric_keys()
    for m in opd_steps:
        assert (m["rollout/opd_samples/math"], m["rollout/opd_samples/code"]) == (4, 4), m
        assert m["rollout/opd_kl_k3/math"] > 0 and m["rollout/opd_kl_k3/code"] > 0, m
        assert m["rollout/opd_pool/switches"] == 1 and m["rollout/opd_pool/prefetch_started"] == 1, m
        assert m["rollout/opd_pool/prefetch_hits"] + m["rollout/opd_pool/prefetch_late"] == 1, m
        assert m["rollout/opd_pool/cold_loads"] == 0 and m["rollout/opd_pool/failed_teachers"] == 0, m
    # ... and the same numbers at slime's rollout steps in its trackers (TensorBoard here; wandb gets the same
    # calls): per-teacher KL, switches, prefetch hits and the switch stall
    tracked = run.tracked()
    for tag in ("rollout/opd_kl_k3/math", "rollout/opd_kl_k3/code", "rollout/opd_pool/switches",
                "rollout/opd_pool/prefetch_hits", "rollout/opd_pool/stall_s"):
        assert [step for step, _ in tracked.get(tag, [])] == list(range(NUM_ROLLOUT)), (tag, sorted(tracked))
    assert [v for _, v in tracked["rollout/opd_kl_k3/math"]] == pytest.approx(
        [m["rollout/opd_kl_k3/math"] for m in opd_steps])

    # ---- slime's own dumps: each sample's domain, teacher, teacher log-probs and advantages
    raw_rewards = []
    for rollout_id in range(NUM_ROLLOUT):
        rollout = torch.load(dumps / f"rollout_{rollout_id}.pt", weights_only=False)["samples"]
        train = torch.load(dumps / f"train_{rollout_id}.pt", weights_only=False)["samples"]
        assert len(rollout) == len(train) == 8
        by_teacher = {"math": 0, "code": 0}
        for position, t in enumerate(train):
            assert t["rollout_position"] == position
            r = rollout[position]
            assert t["sample_index"] == r["index"]
            teacher = DOMAIN_TEACHER[r["metadata"]["domain"]]
            # routed by the sample's domain, to that teacher, with that teacher's coefficient
            assert r["metadata"]["opd_teacher"] == teacher
            assert t["metadata"] == {"opd_teacher": teacher, "opd_coef": COEFS[teacher]}
            by_teacher[teacher] += 1
            n = t["response_lengths"]
            tokens = r["tokens"]
            teacher_lp = t["teacher_log_probs"].float()
            assert teacher_lp.numel() == n
            # the teacher log-probs slime trained on are what that teacher's engine gives for the tokens
            url = engines["math"].url if teacher == "math" else engines["switch"].url
            expected = torch.tensor(_teacher_log_probs(url, tokens, n))
            assert torch.allclose(teacher_lp, expected, atol=1e-4), (teacher, teacher_lp, expected)
            # ... and not the student's that sampled them (the switched engine started on the student checkpoint)
            assert (teacher_lp - t["rollout_log_probs"].float()).abs().max() > 1e-2, teacher
            # advantage = GRPO task advantage (the normalised random reward, per token) + coef_t * (logp_T - logp_S)
            adv = t["advantages"].float()
            opd_term = teacher_lp - t["log_probs"].float()
            task = adv - COEFS[teacher] * opd_term
            assert torch.allclose(task, torch.full_like(task, float(t["rewards"])), atol=1e-4), (teacher, task)
            # the coefficient is the routed teacher's and no other
            other = COEFS["code" if teacher == "math" else "math"]
            assert not torch.allclose(adv - other * opd_term, task, atol=1e-4)
        assert by_teacher == {"math": 4, "code": 4}
        raw_rewards += [s["reward"] for s in rollout]
    # the task reward is slime's --rm-type random (through slime_rule_reward), not opd's 0.0 default
    assert sorted(set(raw_rewards)) == [0, 1], raw_rewards

    # ---- slime's metric dicts: the train side reports, per step, the routing share of each teacher, the
    # mean coefficient applied (half the samples at 1.0, half at 0.5) and the distillation signal
    train_rollout = [m for m in run.metrics() if "rollout/opd_reverse_kl" in m]
    assert len(train_rollout) == NUM_ROLLOUT, run.metric_keys()
    for m in train_rollout:
        assert math.isfinite(m["rollout/opd_reverse_kl"]) and m["rollout/opd_reverse_kl"] != 0
        assert m["rollout/opd_share/math"] == pytest.approx(0.5) and m["rollout/opd_share/code"] == pytest.approx(0.5)
        assert m["rollout/opd_coef"] == pytest.approx(0.5 * COEFS["math"] + 0.5 * COEFS["code"])
    train_steps = [m for m in run.metrics() if "train/step" in m]
    assert [m["train/step"] for m in train_steps] == list(range(NUM_ROLLOUT))
    assert all(m["train/grad_norm"] > 0 for m in train_steps), train_steps


def test_train_py_opd_three_switched_teachers_pushed_once_per_rollout_each(models, engines, tmp_path):
    """Three teachers on the one switched engine, every rollout needing all three, switched over the engine's
    weight-update group: each is staged in host memory while another scores and pushed with
    ``/update_weights_from_distributed``. The engine switches to each at most once a rollout, the last one carried
    over into the next (counted from the engine's own log, not the pool's counters: 3 switches, then 2, where
    scoring in completion order switched per sample); the pool held at most one teacher in host memory; switch
    stall, staging seconds and bytes read reach slime's tracking; every sample's teacher log-probs are its teacher
    checkpoint's."""
    import torch

    from slime_ascend.opd.safetensors_dir import read_safetensors_dir
    from slime_ascend.rollout.torch_engine.model import load_model, score_tokens

    names = ("math", "code", "chat")
    teachers = [{"name": n, "checkpoint_dir": str(models[n]), "domains": [n], "coef": 1.0} for n in names]
    config = _write_config(tmp_path, teachers, engines["switch"].url, None, transport="distributed")
    run, dumps = _run_train_py(models, engines, tmp_path, config, domains=names, batch=6, n_samples=1)

    # the engine's own record of what it switched to, in order: rollout 0 pushes all three (it started on the
    # student's checkpoint), rollout 1 starts with the teacher still resident and takes the other two
    engine_log = engines["switch"].log.read_text()
    pushed = re.findall(r"switched to weight version opd:(\w+):\d+ from \d+ buckets of update_weights_from_distributed",
                        engine_log)
    assert len(pushed) == 5 and sorted(pushed[:3]) == sorted(names), pushed
    assert sorted(pushed[3:]) == sorted(set(names) - {pushed[2]}), pushed  # the resident one carried over
    assert "loaded weight version" not in engine_log  # no disk reload
    one_teacher = read_safetensors_dir(models["math"])[1]
    opd_steps = [m for m in run.metrics() if "rollout/opd_samples/math" in m]
    assert [m["rollout/opd_pool/switches"] for m in opd_steps] == [3, 5], opd_steps  # the pool agrees
    for m in opd_steps:
        assert all(m[f"rollout/opd_samples/{n}"] == 2 for n in names), m
        assert m["rollout/opd_pool/failed_teachers"] == 0 and m["rollout/opd_pool/read_bytes"] > 0, m
        assert m["rollout/opd_pool/stage_s"] > 0 and m["rollout/opd_pool/last_stall_s"] > 0, m
        assert 0 < m["rollout/opd_pool/peak_host_bytes"] <= one_teacher, m  # one staged copy at most
    tracked = run.tracked()
    for tag in ("rollout/opd_pool/stall_s", "rollout/opd_pool/stage_s", "rollout/opd_pool/read_bytes"):
        assert [step for step, _ in tracked.get(tag, [])] == list(range(NUM_ROLLOUT)), (tag, sorted(tracked))

    # each sample's teacher log-probs are what its teacher's checkpoint gives for the sample's tokens
    checkpoints = {n: load_model(models[n]) for n in names}
    for rollout_id in range(NUM_ROLLOUT):
        rollout = torch.load(dumps / f"rollout_{rollout_id}.pt", weights_only=False)["samples"]
        train = torch.load(dumps / f"train_{rollout_id}.pt", weights_only=False)["samples"]
        assert sorted(r["metadata"]["opd_teacher"] for r in rollout) == sorted(names * 2)
        for t in train:
            r = rollout[t["rollout_position"]]
            teacher, n = r["metadata"]["opd_teacher"], t["response_lengths"]
            assert teacher == r["metadata"]["domain"]
            expected = score_tokens(checkpoints[teacher], r["tokens"])[-n:]
            assert torch.allclose(t["teacher_log_probs"].float(), expected, atol=1e-4), teacher
