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
a rollout. The top-k job switches its one switched teacher over ``ascend_opd_switch_transport: tensor`` (staged in
shared memory, handed over by ``/update_weights_from_tensor``).

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


TOPK = 4


def _teacher_top_k(engine_url: str, tokens: list[int], response_length: int, k: int) -> tuple[list, list]:
    """The teacher's top-k ids and log-probs per response position, asked as the opd plugin asks (top_logprobs_num)."""
    out = _post(engine_url + "/generate", {
        "input_ids": list(tokens), "sampling_params": {"temperature": 1.0, "max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k})
    rows = out["meta_info"]["input_top_logprobs"][1:]
    rows = rows[len(rows) - response_length:]
    return [[e[1] for e in row] for row in rows], [[e[0] for e in row] for row in rows]


def _student_log_softmax(model, tokens, response_length: int):
    """The student's full-vocabulary log-softmax at each response position ``[n, V]``: a plain Hugging Face
    forward of the student checkpoint (not Megatron, not slime-ascend) over the dumped tokens; row ``p``
    predicts response token ``p`` (``--rollout-temperature 1.0``: the logits are not rescaled)."""
    import torch

    ids = torch.as_tensor(tokens, dtype=torch.long)
    length = ids.numel()
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
    return torch.log_softmax(logits[length - response_length - 1:length - 1], dim=-1)


def _slow_topk_kl(student_lp, ids, teacher_lp) -> list[float]:
    """Per response position, one entry at a time: sum over the teacher's top-k ids v of
    P_S(v) (log P_S(v) - log P_T(v)) - P_S(v) + P_T(v), P_S the student's full-vocabulary probability (not
    renormalised over the k ids); a padding id (-1) or a non-finite teacher log-prob is skipped."""
    out = []
    for row, row_ids, row_t in zip(student_lp.tolist(), ids.tolist(), teacher_lp.tolist()):
        total = 0.0
        for v, lt in zip(row_ids, row_t):
            if v < 0 or not math.isfinite(lt):
                continue
            ls = row[v]
            total += math.exp(ls) * (ls - lt) - math.exp(ls) + math.exp(lt)
        out.append(total)
    return out


def _slime_step_mean(samples, per_token: dict[int, list[float]]) -> float:
    """slime's reported value of a per-token loss term (``sum_of_sample_mean`` over the micro-batches, divided
    by the step's rollout count): sum over samples of sum_t x_t * mask_t / (the loss-mask total of the sample's
    rollout), over the number of rollouts."""
    rollout_mask = {}
    for t in samples:
        rollout_mask[t["rollout_ids"]] = rollout_mask.get(t["rollout_ids"], 0.0) + float(t["loss_masks"].sum())
    total = 0.0
    for i, t in enumerate(samples):
        masked = sum(x * float(m) for x, m in zip(per_token[i], t["loss_masks"].tolist()))
        total += masked / max(rollout_mask[t["rollout_ids"]], 1.0)
    return total / len(rollout_mask)


def test_train_py_opd_topk_mode(models, engines, tmp_path):
    """``ascend_opd_mode: topk``: the teacher's top-k ids and log-probs travel from the RolloutManager to the
    train actor in each sample's train_metadata (rollout.forward_metadata), into slime's loss batch
    (train.loss_batch_metadata), and the loss adds coef_t * the top-k corrected reverse KL; the advantage is
    the task term only. Two teachers of one checkpoint with different coefficients (1.0 and 0.5): ``math`` behind
    its URL, ``code`` on the switched engine (started on the student's checkpoint), which the pool switches over
    ``ascend_opd_switch_transport: tensor`` (staged in shared memory, handed over by
    ``/update_weights_from_tensor``); both engines then serve the same weights, so every top-k is checked against
    the math engine."""
    import torch

    teachers = [
        {"name": "math", "checkpoint_dir": str(models["math"]), "domains": ["math"], "coef": COEFS["math"],
         "url": engines["math"].url},
        {"name": "code", "checkpoint_dir": str(models["math"]), "domains": ["code"], "coef": COEFS["code"]},
    ]
    config = _write_config(tmp_path, teachers, engines["switch"].url, None, transport="tensor")
    import yaml

    cfg = yaml.safe_load(config.read_text())
    assert cfg["loss_type"] == "custom_loss" and cfg["custom_loss_function_path"] == "slime_ascend.hooks.loss_function"
    cfg.update({"ascend_opd_mode": "topk", "ascend_opd_topk": TOPK})
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run, dumps = _run_train_py(models, engines, tmp_path, config)
    print(f"slime train.py with cpu+opd (topk): {run.seconds:.1f} s")
    for patch_id in ("rollout.forward_metadata", "train.rollout_log_metadata", "train.loss_batch_metadata"):
        assert f"applied runtime patch {patch_id}" in run.log, patch_id
    # the switched engine took the code teacher once, handed over in shared memory, never from disk
    switch_log = engines["switch"].log.read_text()
    loads = re.findall(r"loaded weight version (\S+) from ([^\n]*)", switch_log)  # every load, disk ones too
    assert len(loads) == 1 and loads[0][0] == "opd:code:1", switch_log[-3000:]
    assert re.match(r"\d+ buckets of update_weights_from_tensor", loads[0][1]), loads
    assert re.search(r"; donated: [1-9]\d* bytes adopted as the model's weights, not copied", loads[0][1]), loads

    # ---- slime's train dump: each sample's payload is the routed teacher's top-k for exactly its tokens,
    # and the advantage is the GRPO task advantage alone (the teacher signal is in the loss)
    for rollout_id in range(NUM_ROLLOUT):
        rollout = torch.load(dumps / f"rollout_{rollout_id}.pt", weights_only=False)["samples"]
        train = torch.load(dumps / f"train_{rollout_id}.pt", weights_only=False)["samples"]
        assert len(train) == 8
        for position, t in enumerate(train):
            r = rollout[position]
            teacher = DOMAIN_TEACHER[r["metadata"]["domain"]]
            md = t["metadata"]
            assert (md["opd_teacher"], md["opd_coef"]) == (teacher, COEFS[teacher])
            payload = md["opd_topk"]
            n = t["response_lengths"]
            assert payload["format"] == "opd_topk_v1" and payload["k"] == TOPK
            assert tuple(payload["ids"].shape) == tuple(payload["log_probs"].shape) == (n, TOPK)
            ids, lps = _teacher_top_k(engines["math"].url, r["tokens"], n, TOPK)
            assert payload["ids"].tolist() == ids
            assert torch.allclose(payload["log_probs"], torch.tensor(lps), atol=1e-4)
            adv = t["advantages"].float()
            assert torch.allclose(adv, torch.full_like(adv, float(t["rewards"])), atol=1e-5), adv

    # ---- slime's step metrics: the top-k KL and its loss term every step
    steps = [m for m in run.metrics() if "train/opd_topk_kl" in m]
    assert len(steps) == NUM_ROLLOUT, run.metric_keys()
    for m in steps:
        assert math.isfinite(m["train/opd_topk_kl"]) and m["train/opd_topk_kl"] > 0, m
        assert 0 < m["train/opd_topk_loss"] < m["train/opd_topk_kl"], m  # mean coef 0.75
        assert math.isfinite(m["train/grad_norm"]) and m["train/grad_norm"] > 0, m

    # ---- step 0, recomputed here from slime's train dump: one optimizer step per rollout (global batch 8 =
    # the rollout), so step 0 trained the student checkpoint itself (step 1's weights are not kept). The
    # student's full-vocabulary log-probs come from a Hugging Face forward of that checkpoint in bf16 (slime
    # trains with --bf16), the loss from the slow loop above on each sample's dumped teacher top-k.
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(str(models["student"]), dtype=torch.bfloat16).eval()
    train = torch.load(dumps / "train_0.pt", weights_only=False)["samples"]
    kl_tokens, loss_tokens, pg_tokens = {}, {}, {}
    for i, t in enumerate(train):
        n = t["response_lengths"]
        student_lp = _student_log_softmax(student, t["tokens"], n)
        # the recomputation sees what slime trained with: its sampled-token log-probs are slime's (Megatron's)
        # log_probs (measured: max |diff| 4.8e-7 on the Intel Xeon host; an fp32 forward is off by 2.2e-3)
        sampled = student_lp.gather(-1, torch.as_tensor(t["tokens"][-n:]).long()[:, None]).squeeze(-1)
        assert torch.allclose(sampled, t["log_probs"].float(), rtol=0, atol=2e-5), (i, sampled, t["log_probs"])
        payload = t["metadata"]["opd_topk"]
        kl_tokens[i] = _slow_topk_kl(student_lp, payload["ids"], payload["log_probs"])
        loss_tokens[i] = [COEFS[t["metadata"]["opd_teacher"]] * x for x in kl_tokens[i]]
        # slime's policy loss on step 0 is on-policy (ratio 1, ppo_kl 0): -A_t per token
        pg_tokens[i] = [-a for a in t["advantages"].tolist()]
    want_kl, want_loss = _slime_step_mean(train, kl_tokens), _slime_step_mean(train, loss_tokens)
    want_pg = _slime_step_mean(train, pg_tokens)
    m = steps[0]
    assert m["train/step"] == 0 and m["train/ppo_kl"] == 0, m
    # measured: slime's kl and loss agree with the recomputation to 1.3e-7 relative (an fp32 forward: 2e-4;
    # a top-k renormalised KL is 5.09, i.e. 9000x, and dropping the -P_S + P_T correction makes it negative)
    assert m["train/opd_topk_kl"] == pytest.approx(want_kl, rel=2e-5), (m, want_kl)
    assert m["train/opd_topk_loss"] == pytest.approx(want_loss, rel=2e-5), (m, want_loss)
    # slime's reported loss: the policy loss plus the coefficient-weighted top-k term (entropy coef 0, no KL
    # loss). The GRPO advantages of each prompt's two samples cancel, so the step's policy loss is ~0, but each
    # one-sample micro-batch's is ~±0.09: its float32 sum with the 5e-5 term rounds (measured |diff| 6.9e-9 on
    # a loss of 4.5e-4; a missing term is off by 4.5e-4, an uncoefficiented one by 1.3e-4)
    assert m["train/pg_loss"] == pytest.approx(want_pg, abs=1e-7), (m, want_pg)
    assert m["train/loss"] == pytest.approx(want_pg + want_loss, rel=0, abs=2e-8), (m, want_pg, want_loss)


def test_train_py_refuses_a_teacher_with_another_vocabulary(models, tmp_path):
    """Teacher/student compatibility at start: slime's own ``train.py`` with a teacher whose vocabulary differs
    from the student's stops in the driver (slime's ``parse_args``, before Ray or any rollout) with one line
    naming the teacher and the field."""
    import json
    import shutil

    code = shutil.copytree(models["code"], tmp_path / "teacher-code-bigger-vocab")
    cfg = json.loads((code / "config.json").read_text())
    student_vocab = cfg["vocab_size"]
    cfg["vocab_size"] = student_vocab + 512
    (code / "config.json").write_text(json.dumps(cfg))
    nowhere = "http://127.0.0.1:9"  # never reached: the driver refuses first
    teachers = [
        {"name": "math", "checkpoint_dir": str(models["math"]), "domains": ["math"], "url": nowhere},
        {"name": "code", "checkpoint_dir": str(code), "domains": ["code"]},
    ]
    config = _write_config(tmp_path, teachers, nowhere, tmp_path / "teacher-stage")
    prompts = make_prompts(tmp_path / "prompts.jsonl", domains=("math", "code"))
    # slime's parse_args asks the rollout engine for its server info (external engine discovery) before it
    # returns, so the student's engine runs; the teachers' are never asked
    rollout = start_engine(models["student"], tmp_path / "engine-rollout.log", ready=False)
    try:
        flags = slime_flags(models["student"], prompts, [rollout], tmp_path, num_rollout=1)
        run = run_slime("train.py", flags, tmp_path, PLUGINS, custom_config=config, timeout=300)
    finally:
        stop(rollout.proc)
    print(f"slime train.py refused the teacher in {run.seconds:.1f} s")
    assert run.returncode == 2, run.log[-4000:]
    errors = [line for line in run.log.splitlines() if line.startswith("slime-ascend: error:")]
    assert len(errors) == 1, run.log[-4000:]
    print(errors[0])
    assert errors[0].startswith(
        f"slime-ascend: error: opd teacher 'code': vocab_size {student_vocab + 512} differs from the student's "
        f"{student_vocab} (--hf-checkpoint"), errors[0]
    assert "Fix:" in errors[0] and "compat_check: warn" in errors[0]
    # before any rollout: Ray never started, no engine was asked
    assert "Started a local Ray instance" not in run.log and "RolloutManager" not in run.log
    assert not (tmp_path / "teacher-stage").exists()
