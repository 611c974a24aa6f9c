"""The ``opd`` plugin: settings validation, routing, teacher scoring hooks, switch gate, advantage term."""

from __future__ import annotations

import ast
import asyncio
import logging
import random
import re
import types

import pytest
import torch

from slime_ascend.compat.sample import get_sample_class
from slime_ascend.opd import hooks
from slime_ascend.opd.plugin import PLUGIN
from slime_ascend.opd.router import RoutingError
from slime_ascend.opd.switching import SwitchGate
from slime_ascend.plugins.settings import SettingsError

Sample = get_sample_class()

TEACHERS = [
    {"name": "math", "checkpoint_dir": "/nonexistent/math", "domains": ["math"], "coef": 1.0,
     "url": "http://127.0.0.1:1"},
    {"name": "code", "checkpoint_dir": "/nonexistent/code", "domains": ["code", "sql"], "coef": 0.5,
     "url": "http://127.0.0.1:2"},
]


pytestmark = pytest.mark.usefixtures("opd_state")


def make_args(**overrides):
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(dict(PLUGIN.slime_args))
    values.update(
        ascend_plugins=["opd"],
        ascend_opd_teachers=TEACHERS,
        opd_teacher_load=None,
        rollout_temperature=1.0,
        use_rollout_logprobs=False,
        hf_checkpoint=None,
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def make_sample(index, tokens, response_length, domain=None, rollout_log_probs=None):
    s = Sample(index=index, tokens=list(tokens), response_length=response_length)
    s.metadata = {} if domain is None else {"domain": domain}
    s.rollout_log_probs = rollout_log_probs
    return s


# ---------------------------------------------------------------------------------------------- plugin
def test_plugin_declares_slots_orders_and_slime_args():
    slots = {c.slot: c.order for c in PLUGIN.contributions}
    assert slots == {"reward_model": 500, "reward_post_process": 300, "advantage": 500, "loss_term": 500}
    assert dict(PLUGIN.slime_args) == {"use_opd": True, "opd_type": "sglang", "opd_kl_coef": 0.0}
    for c in PLUGIN.contributions:
        assert callable(c.load())


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"ascend_opd_teachers": []}, "ascend_opd_teachers is empty"),
        ({"ascend_opd_teachers": [{"name": "m", "checkpoint_dir": "/x", "domains": []}]},
         "teacher 'm': field 'domains'"),
        ({"ascend_opd_teachers": [{"name": "m", "checkpoint_dir": "/x", "domains": ["a"], "coef": "hi"}]},
         "teacher 'm': field 'coef'"),
        ({"ascend_opd_default_teacher": "physics"}, "ascend_opd_default_teacher='physics'"),
        ({"ascend_opd_mode": "topk", "loss_type": "policy_loss"}, "loss_type is 'policy_loss'. Fix: set loss_type: custom_loss"),
        ({"ascend_opd_mode": "topk", "loss_type": "custom_loss", "custom_loss_function_path": "my.loss"},
         "custom_loss_function_path is 'my.loss'. Fix: set custom_loss_function_path: slime_ascend.hooks.loss_function"),
        ({"opd_kl_coef": 1.0}, "opd_kl_coef must be 0"),
        ({"use_opd": False}, "use_opd must be true"),
        ({"opd_type": "megatron"}, "opd_type must be 'sglang'"),
        ({"opd_teacher_load": "/ckpt"}, "opd_teacher_load must be unset"),
        ({"ascend_opd_teachers": [{"name": "m", "checkpoint_dir": "/x", "domains": ["a"]}]}, "have no url"),
    ],
)
def test_validate_refuses_bad_configs(overrides, needle):
    from slime_ascend.plugins import runtime

    with pytest.raises(SettingsError) as e:
        runtime.settings(make_args(**overrides), "opd")
    assert needle in str(e.value)


def test_critic_role_args_pass_without_use_opd():
    """slime's critic gets its own args with use_opd off (_apply_megatron_role_overrides): found when
    sao (PPO critic) and opd ran together in slime's train_async.py."""
    from slime_ascend.plugins import roles, runtime

    critic_args = make_args(use_opd=False, kl_coef=0, custom_advantage_function_path=None)
    roles.set_train_role("critic")
    assert runtime.settings(critic_args, "opd") is not None
    runtime.reset()
    roles.set_train_role("actor")
    with pytest.raises(SettingsError, match="use_opd must be true"):
        runtime.settings(critic_args, "opd")


# ---------------------------------------------------------------------------------------------- routing
def test_routing_and_missing_route():
    ctx = hooks.get_context(make_args())
    assert ctx.router.route({"domain": "sql"}).name == "code"
    assert ctx.router.route({"domain": "math"}).name == "math"
    with pytest.raises(RoutingError, match="'bio' has no teacher"):
        ctx.router.route({"domain": "bio"}, sample_id=7)
    with pytest.raises(RoutingError, match="no 'domain' label"):
        ctx.router.route({})
    hooks.reset_state()
    from slime_ascend.plugins import runtime

    runtime.reset()
    ctx = hooks.get_context(make_args(ascend_opd_default_teacher="math"))
    assert ctx.router.route({"domain": "bio"}).name == "math"
    assert ctx.router.stats()["defaulted"] == 1


def test_reward_model_raises_on_missing_route_before_any_request():
    args = make_args()
    s = make_sample(0, [1, 2, 3, 4], 2, domain="bio")
    with pytest.raises(RoutingError, match="sample 0"):
        asyncio.run(hooks.teacher_reward(args, s))


# ---------------------------------------------------------------------------------------------- scoring
def _slice_like_slime(reply, response_length):
    # slime's post_process_rewards: item[0] of input_token_logprobs[1:], last response_length entries
    values = [item[0] for item in reply["meta_info"]["input_token_logprobs"][1:]]
    return values[-response_length:]


def test_response_teacher_log_probs_matches_slime_slicing_and_checks():
    reply = {"meta_info": {"input_token_logprobs": [[None, 5, None]] + [[-0.1 * i, i, None] for i in range(1, 8)]}}
    for rl in (1, 3, 7):
        assert hooks.response_teacher_log_probs(reply, rl) == pytest.approx(_slice_like_slime(reply, rl))
    with pytest.raises(ValueError, match="scored 7 positions"):
        hooks.response_teacher_log_probs(reply, 8, "math")
    with pytest.raises(ValueError, match="no meta_info"):
        hooks.response_teacher_log_probs({"text": ""}, 1, "math")


@pytest.fixture(scope="module")
def two_teacher_engines():
    from slime_ascend.rollout.torch_engine.engine import TorchEngine

    engines = [TorchEngine(seed=1), TorchEngine(seed=2)]
    with engines[0].start_in_thread() as url_a, engines[1].start_in_thread() as url_b:
        yield engines, url_a, url_b


def test_reward_hooks_fill_teacher_log_probs_from_the_routed_teacher(two_teacher_engines, caplog):
    from slime_ascend.rollout.torch_engine.model import score_tokens

    (eng_a, eng_b), url_a, url_b = two_teacher_engines
    teachers = [dict(TEACHERS[0], url=url_a), dict(TEACHERS[1], url=url_b)]
    args = make_args(ascend_opd_teachers=teachers, ascend_opd_same_origin_check=False)
    rng = random.Random(0)
    samples = []
    for i, dom in enumerate(["math", "code", "sql", "math", "code"]):
        prompt_len, resp_len = rng.randint(2, 6), rng.randint(1, 6)
        tokens = [rng.randrange(1000) for _ in range(prompt_len + resp_len)]
        samples.append(make_sample(i, tokens, resp_len, domain=dom))

    async def run_all():
        # one sample alone and the rest as slime's batched/group RM call (a list)
        first = await hooks.teacher_reward(args, samples[0])
        rest = await hooks.teacher_reward(args, samples[1:])
        return [first] + rest

    rewards = asyncio.run(run_all())
    assert rewards == [0.0] * 5  # no task RM configured: pure distillation
    for s in samples:
        s.reward = 0.0
    with caplog.at_level(logging.INFO, logger="slime_ascend.opd"):
        raw, norm = hooks.fill_teacher_log_probs(args, samples, [0.0] * 5, [0.0] * 5)
    assert raw == [0.0] * 5 and norm == [0.0] * 5
    assert "opd routing this step: {'math': 2, 'code': 3}" in caplog.text
    for s, dom in zip(samples, ["math", "code", "sql", "math", "code"]):
        engine = eng_a if dom == "math" else eng_b
        want = score_tokens(engine.model, s.tokens)[-s.response_length:]
        assert isinstance(s.teacher_log_probs, torch.Tensor) and s.teacher_log_probs.dtype == torch.float32
        assert s.teacher_log_probs.shape == (s.response_length,)
        torch.testing.assert_close(s.teacher_log_probs, want, atol=1e-5, rtol=1e-5)
        other = eng_b if dom == "math" else eng_a
        assert not torch.allclose(s.teacher_log_probs, score_tokens(other.model, s.tokens)[-s.response_length:])
        assert s.metadata["opd_teacher"] == ("math" if dom == "math" else "code")
        assert "opd_teacher_log_probs" not in s.metadata
        assert s.train_metadata == {"opd_teacher": s.metadata["opd_teacher"],
                                    "opd_coef": 1.0 if dom == "math" else 0.5}
    stats = hooks.opd_stats(args)
    assert stats["routing"]["counts"] == {"math": 2, "code": 3}
    assert stats["requests"] == {"math": 2, "code": 3}
    assert stats["last_step"]["counts"] == {"math": 2, "code": 3}
    assert hooks.coefs_differ(args)  # different coefs: the runtime installs the forward patches


def test_task_reward_path_is_used(two_teacher_engines, monkeypatch):
    _, url_a, url_b = two_teacher_engines
    teachers = [dict(TEACHERS[0], url=url_a), dict(TEACHERS[1], url=url_b)]
    mod = types.ModuleType("opd_task_rm_for_test")

    async def task_rm(args, sample, **kw):
        return {"score": float(len(sample.tokens))}

    mod.task_rm = task_rm
    monkeypatch.setitem(__import__("sys").modules, "opd_task_rm_for_test", mod)
    args = make_args(ascend_opd_teachers=teachers, ascend_opd_task_rm_path="opd_task_rm_for_test.task_rm")
    s = make_sample(0, [5, 6, 7, 8], 2, domain="math")
    assert asyncio.run(hooks.teacher_reward(args, s)) == {"score": 4.0}
    assert len(s.metadata["opd_teacher_log_probs"]) == 2


def test_post_process_refuses_unscored_samples_and_pads_removed_ones():
    args = make_args(ascend_opd_same_origin_check=False)
    s = make_sample(3, [1, 2, 3], 2, domain="math")
    with pytest.raises(ValueError, match="sample 3 has no teacher log-probs"):
        hooks.fill_teacher_log_probs(args, [s], [0.0], [0.0])
    s.remove_sample = True
    s.rollout_log_probs = [-0.5, -0.25]
    hooks.fill_teacher_log_probs(args, [s], [0.0], [0.0])
    assert s.teacher_log_probs.tolist() == [-0.5, -0.25]  # neutral: logp_T - logp_S = 0
    bad = make_sample(4, [1, 2, 3], 2, domain="math")
    bad.metadata.update(opd_teacher="math", opd_teacher_log_probs=[-1.0])
    with pytest.raises(ValueError, match="1 teacher log-probs for response_length 2"):
        hooks.fill_teacher_log_probs(args, [bad], [0.0], [0.0])


def test_topk_mode_carries_the_routed_teachers_top_k_in_train_metadata(two_teacher_engines):
    """topk mode, rollout side: the teacher request asks top_logprobs_num = k; the routed teacher's top-k of
    each response position (a slow no-cache forward of that teacher) lands in train_metadata['opd_topk']."""
    from slime_ascend.algorithms.opd import unpack_topk_payload

    (eng_a, eng_b), url_a, url_b = two_teacher_engines
    teachers = [dict(TEACHERS[0], url=url_a), dict(TEACHERS[1], url=url_b)]
    args = make_args(ascend_opd_teachers=teachers, ascend_opd_same_origin_check=False, ascend_opd_mode="topk",
                     ascend_opd_topk=3)
    samples = [make_sample(0, [5, 6, 7, 8, 9], 3, domain="math"), make_sample(1, [11, 12, 13, 14], 2, domain="code")]
    asyncio.run(hooks.teacher_reward(args, samples))
    hooks.fill_teacher_log_probs(args, samples, [0.0, 0.0], [0.0, 0.0])
    for s, eng in zip(samples, (eng_a, eng_b), strict=True):
        tm = s.train_metadata
        assert tm["opd_teacher"] == ("math" if eng is eng_a else "code") and "opd_topk" not in s.metadata
        ids, lps = unpack_topk_payload(tm["opd_topk"])
        with torch.no_grad():
            logits = eng.model(input_ids=torch.tensor([s.tokens]), use_cache=False).logits[0].float()
        ref_lps, ref_ids = torch.log_softmax(logits[:-1], -1)[-s.response_length:].topk(3, dim=-1)
        assert ids.tolist() == ref_ids.tolist()
        torch.testing.assert_close(lps, ref_lps, atol=1e-5, rtol=1e-5)
        # the sampled-token teacher log-prob is the same distribution's entry at the response token
        own = torch.log_softmax(logits[:-1], -1)[-s.response_length:].gather(
            -1, torch.tensor(s.tokens[-s.response_length:])[:, None])[:, 0]
        torch.testing.assert_close(s.teacher_log_probs, own, atol=1e-5, rtol=1e-5)


def test_topk_mode_post_process_pads_removed_samples_and_refuses_unscored_ones():
    from slime_ascend.algorithms.opd import pack_topk_payload, unpack_topk_payload

    args = make_args(ascend_opd_same_origin_check=False, ascend_opd_mode="topk", ascend_opd_topk=2)
    s = make_sample(3, [1, 2, 3], 2, domain="math")
    s.metadata.update(opd_teacher="math", opd_teacher_log_probs=[-1.0, -2.0])
    with pytest.raises(ValueError, match="sample 3 has no teacher top-k payload"):
        hooks.fill_teacher_log_probs(args, [s], [0.0], [0.0])
    s.metadata.update(opd_teacher="math", opd_teacher_log_probs=[-1.0, -2.0],
                      opd_topk=pack_topk_payload(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)))
    with pytest.raises(ValueError, match="3 rows for response_length 2"):
        hooks.fill_teacher_log_probs(args, [s], [0.0], [0.0])
    gone = make_sample(4, [1, 2, 3], 2, domain="math")
    gone.remove_sample = True
    gone.rollout_log_probs = [-0.5, -0.25]
    hooks.fill_teacher_log_probs(args, [gone], [0.0], [0.0])
    ids, lps = unpack_topk_payload(gone.train_metadata["opd_topk"])
    assert ids.tolist() == [[-1, -1], [-1, -1]] and bool(torch.isneginf(lps).all())  # no loss from it


def test_topk_mode_advantage_keeps_the_task_term_only():
    args = make_args(ascend_opd_task_weight=0.5, ascend_opd_mode="topk")
    data = _rollout_data()
    data["metadata"] = [{"opd_teacher": "math", "opd_coef": 1.0}] * 5
    before = [a.clone() for a in data["advantages"]]
    hooks.opd_advantage(args, data)
    for i in range(5):
        torch.testing.assert_close(data["advantages"][i], 0.5 * before[i])
        torch.testing.assert_close(data["opd_reverse_kl"][i], data["log_probs"][i] - data["teacher_log_probs"][i])


def test_topk_loss_term_is_nothing_in_sampled_mode_and_critic_passes():
    assert hooks.opd_topk_loss(make_args(), {}, None, None) is None
    assert hooks.opd_topk_loss(make_args(ascend_opd_mode="topk", loss_type="value_loss"), {}, None, None) is None


def test_validate_accepts_topk_with_the_loss_dispatcher():
    from slime_ascend.plugins import runtime

    args = make_args(ascend_opd_mode="topk", loss_type="custom_loss",
                     custom_loss_function_path="slime_ascend.hooks.loss_function")
    assert runtime.settings(args, "opd")["ascend_opd_mode"] == "topk"


def test_same_origin_check_flags_a_foreign_teacher_on_the_first_step(caplog):
    teachers = [
        {"name": n, "checkpoint_dir": f"/x/{n}", "domains": [n], "url": "http://h:1"}
        for n in ("a", "b", "c", "foreign")
    ]
    args = make_args(ascend_opd_teachers=teachers)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(16):
        name = teachers[i % 4]["name"]
        student = -torch.rand(20, generator=g) * 3
        noise = 2.0 if name == "foreign" else 0.3
        teacher = student + noise * torch.randn(20, generator=g)
        s = make_sample(i, list(range(25)), 20, domain=name, rollout_log_probs=student.tolist())
        s.metadata.update(opd_teacher=name, opd_teacher_log_probs=teacher.tolist())
        samples.append(s)
    with caplog.at_level(logging.WARNING, logger="slime_ascend.opd"):
        hooks.fill_teacher_log_probs(args, samples, [0.0] * 16, [0.0] * 16)
    report = hooks.opd_stats(args)["same_origin"]
    assert report["flagged"] == ["foreign"]
    assert "teacher 'foreign'" in caplog.text and "same-origin" in caplog.text
    # it runs once: the next step does not recompute the report
    for s in samples:
        s.metadata["opd_teacher_log_probs"] = s.teacher_log_probs.tolist()
    hooks.fill_teacher_log_probs(args, samples, [0.0] * 16, [0.0] * 16)
    assert hooks.opd_stats(args)["same_origin"] is report


def test_same_origin_error_action_stops():
    teachers = [{"name": n, "checkpoint_dir": f"/x/{n}", "domains": [n], "url": "http://h:1"} for n in ("a", "b", "c")]
    args = make_args(ascend_opd_teachers=teachers, ascend_opd_same_origin_action="error")
    samples = []
    for i, (name, gap) in enumerate([("a", 0.1), ("b", 0.1), ("c", 3.0)]):
        s = make_sample(i, [1, 2, 3, 4], 3, domain=name, rollout_log_probs=[-1.0, -1.0, -1.0])
        s.metadata.update(opd_teacher=name, opd_teacher_log_probs=[-1.0 - gap] * 3)
        samples.append(s)
    with pytest.raises(RuntimeError, match="same-origin check failed: teacher 'c'"):
        hooks.fill_teacher_log_probs(args, samples, [0.0] * 3, [0.0] * 3)


# ---------------------------------------------------------------------------------------------- switch gate
def test_switch_gate_never_serves_a_request_with_the_wrong_teacher():
    async def main():
        engine = {"resident": None, "busy": 0}
        log = []

        async def switch(name):
            assert engine["busy"] == 0, "switched while requests were in flight"
            await asyncio.sleep(0.002)
            engine["resident"] = name
            log.append(name)

        gate = SwitchGate(switch)
        rng = random.Random(1)
        served = []

        async def request(i, name):
            await asyncio.sleep(rng.random() * 0.01)
            async with gate.use(name):
                engine["busy"] += 1
                assert engine["resident"] == name
                await asyncio.sleep(rng.random() * 0.003)
                assert engine["resident"] == name
                engine["busy"] -= 1
                served.append(i)

        names = [rng.choice("ABC") for _ in range(120)]
        await asyncio.gather(*(request(i, n) for i, n in enumerate(names)))
        return names, served, log, gate

    names, served, log, gate = asyncio.run(main())
    assert sorted(served) == list(range(len(names)))
    assert gate.switches == len(log) and gate.inflight == 0
    assert len(log) < len(names) / 2  # batches: far fewer switches than requests
    assert all(a != b for a, b in zip(log, log[1:]))


def test_switch_gate_batches_queued_requests_and_reports_failures():
    async def main():
        log = []

        async def switch(name):
            if name == "bad":
                raise RuntimeError("teacher 'bad' (/ckpt/bad): corrupt")
            log.append(name)

        gate = SwitchGate(switch)
        order = ["A", "B", "A", "B", "B", "bad", "A"]

        async def request(name):
            async with gate.use(name):
                await asyncio.sleep(0.001)
                return name

        results = await asyncio.gather(*(request(n) for n in order), return_exceptions=True)
        return log, results

    log, results = asyncio.run(main())
    assert [r for r in results if isinstance(r, Exception)][0].args[0].startswith("teacher 'bad'")
    assert sum(isinstance(r, str) for r in results) == 6
    assert log[:2] == ["A", "B"] and len(log) <= 3  # A, then all queued B at once, then the late A


def test_switched_teachers_use_the_pool_and_engine(two_teacher_engines, tmp_path):
    """Teachers without url: a local TeacherPool switches one engine with /update_weights_from_disk."""
    from slime_ascend.rollout.torch_engine.model import save_model, score_tokens

    (eng_a, eng_b), url_a, _ = two_teacher_engines
    dirs = {}
    for name, eng in (("math", eng_a), ("code", eng_b)):
        dirs[name] = save_model(eng.model, tmp_path / name)
    from slime_ascend.rollout.torch_engine.engine import TorchEngine

    switched = TorchEngine(seed=3)
    teachers = [
        {"name": "math", "checkpoint_dir": str(dirs["math"]), "domains": ["math"]},
        {"name": "code", "checkpoint_dir": str(dirs["code"]), "domains": ["code"]},
    ]
    with switched.start_in_thread() as url:
        args = make_args(ascend_opd_teachers=teachers, ascend_opd_switch_engine_urls=[url],
                         ascend_opd_same_origin_check=False)
        rng = random.Random(5)
        samples = [make_sample(i, [rng.randrange(1000) for _ in range(8)], 4, domain=d)
                   for i, d in enumerate(["math", "code", "math", "code", "code"])]
        asyncio.run(hooks.teacher_reward(args, samples))
        hooks.fill_teacher_log_probs(args, samples, [0.0] * 5, [0.0] * 5)
        stats = hooks.opd_stats(args)
    for s in samples:
        ref = eng_a if s.metadata["opd_teacher"] == "math" else eng_b
        torch.testing.assert_close(s.teacher_log_probs, score_tokens(ref.model, s.tokens)[-4:], atol=1e-4, rtol=1e-4)
    assert stats["switches"] == 2  # grouped by teacher: math's samples, then code's (not in completion order)
    assert stats["pool"]["switches"] == stats["switches"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_switched_teacher_is_prefetched_before_its_first_switch(two_teacher_engines, tmp_path, caplog, prefetch):
    """One URL teacher and one switched teacher (found in slime's real loop: with a single switched teacher the
    gate never had a *next* teacher to prefetch, so the first switch was always a cold copy into the stage
    dir). The pool now stages the switched teachers in the background when it is created, and the rollout
    manager logs the pool's counters each step."""
    from slime_ascend.rollout.torch_engine.engine import TorchEngine
    from slime_ascend.rollout.torch_engine.model import save_model, score_tokens

    (eng_a, eng_b), url_a, _ = two_teacher_engines
    code_dir = save_model(eng_b.model, tmp_path / "code-ckpt")
    stage = tmp_path / "stage"
    teachers = [dict(TEACHERS[0], url=url_a), {"name": "code", "checkpoint_dir": str(code_dir), "domains": ["code"],
                                               "coef": 0.5}]
    switched = TorchEngine(seed=3)
    with switched.start_in_thread() as url:
        args = make_args(ascend_opd_teachers=teachers, ascend_opd_switch_engine_urls=[url],
                         ascend_opd_stage_dir=str(stage), ascend_opd_prefetch=prefetch,
                         ascend_opd_same_origin_check=False)
        ctx = hooks.get_context(args, rollout_side=True)
        pool = ctx.switcher._local
        if prefetch:
            assert pool.prefetched == "code"  # staging started before any request
            pool._slot.future.result(timeout=30)
        else:
            assert pool.prefetched is None
        rng = random.Random(7)
        samples = [make_sample(i, [rng.randrange(1000) for _ in range(8)], 4, domain=d)
                   for i, d in enumerate(["math", "code", "code", "math"])]
        asyncio.run(hooks.teacher_reward(args, samples))
        with caplog.at_level(logging.INFO, logger="slime_ascend.opd"):
            hooks.fill_teacher_log_probs(args, samples, [0.0] * 4, [0.0] * 4)
    for s in samples:
        ref = eng_a if s.metadata["opd_teacher"] == "math" else eng_b
        torch.testing.assert_close(s.teacher_log_probs, score_tokens(ref.model, s.tokens)[-4:], atol=1e-4, rtol=1e-4)
    m = pool.metrics()
    assert m["switches"] == 1
    assert (m["prefetch_hits"], m["cold_loads"]) == ((1, 0) if prefetch else (0, 1))
    assert (stage / "code" / ".slime-ascend-staged").is_file()
    # the rollout manager reports routing and the pool's counters on slime's rollout metric path
    lines = [re.fullmatch(r"opd (\S+): (\{'rollout/.*\})", r.getMessage()) for r in caplog.records]
    reported = ast.literal_eval(next(m for m in lines if m).group(2))
    assert {k: reported[k] for k in ("rollout/opd_samples/math", "rollout/opd_samples/code")} == {
        "rollout/opd_samples/math": 2, "rollout/opd_samples/code": 2}
    assert reported["rollout/opd_pool/switches"] == 1
    assert reported["rollout/opd_pool/prefetch_started"] == reported["rollout/opd_pool/prefetch_hits"] == int(prefetch)
    assert reported["rollout/opd_pool/cold_loads"] == int(not prefetch)
    assert reported["rollout/opd_pool/stall_s"] >= 0


def test_slime_rule_reward_uses_slimes_rm_type_not_the_dispatcher():
    pytest.importorskip("slime.rollout.rm_hub", reason="needs slime's reward models")
    args = make_args(rm_type="random", custom_rm_path="no.such.module.would_recurse")
    s = make_sample(0, [1, 2, 3], 1, domain="math")
    s.response, s.label, s.custom_rm_path = "x", "1", None
    rewards = {asyncio.run(hooks.slime_rule_reward(args, s)) for _ in range(40)}
    assert rewards == {0, 1}
    assert args.custom_rm_path == "no.such.module.would_recurse"  # the caller's args are not touched
    with pytest.raises(ValueError, match="--rm-type is not set"):
        asyncio.run(hooks.slime_rule_reward(make_args(rm_type=None, custom_rm_path="x.y"), s))


# ---------------------------------------------------------------------------------------------- advantage
def _rollout_data(n=5, seed=0, cp_local=True):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(1, 9, (n,), generator=g)]
    student = [-torch.rand(m, generator=g) * 2 for m in lens]  # CP-local pieces of any length
    teacher = [s + 0.3 * torch.randn(s.shape, generator=g) for s in student]
    adv = [torch.full((m,), float(torch.randn(1, generator=g))) for m in lens]
    return {"log_probs": student, "teacher_log_probs": teacher, "advantages": adv, "returns": list(adv),
            "rollout_log_probs": [s + 0.01 for s in student]}


def test_advantage_applies_per_teacher_coefficients_from_forwarded_metadata():
    args = make_args(ascend_opd_task_weight=0.5)
    data = _rollout_data()
    names = ["math", "code", "code", "math", "code"]
    data["metadata"] = [{"opd_teacher": n, "opd_coef": {"math": 1.0, "code": 0.5}[n]} for n in names]
    before = [a.clone() for a in data["advantages"]]
    hooks.opd_advantage(args, data)
    for i, n in enumerate(names):  # slow reference loop, token by token
        c = {"math": 1.0, "code": 0.5}[n]
        for t in range(len(before[i])):
            want = 0.5 * before[i][t] + c * (data["teacher_log_probs"][i][t] - data["log_probs"][i][t])
            assert abs(float(data["advantages"][i][t]) - float(want)) < 1e-6
            rkl = data["log_probs"][i][t] - data["teacher_log_probs"][i][t]
            assert abs(float(data["opd_reverse_kl"][i][t]) - float(rkl)) < 1e-6
    assert data["returns"][0] is not data["advantages"][0]
    # per-sample columns slime's train-side rollout logger averages into step metrics
    assert data["opd_coef"] == [1.0, 0.5, 0.5, 1.0, 0.5]
    assert data["opd_share/math"] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert data["opd_share/code"] == [0.0, 1.0, 1.0, 0.0, 1.0]


def test_advantage_uses_rollout_log_probs_when_slime_does():
    args = make_args(use_rollout_logprobs=True, ascend_opd_teachers=[dict(t, coef=2.0) for t in TEACHERS])
    data = _rollout_data()
    base = [a.clone() for a in data["advantages"]]
    hooks.opd_advantage(args, data)  # no metadata, uniform coef
    for i in range(5):
        want = base[i] + 2.0 * (data["teacher_log_probs"][i] - data["rollout_log_probs"][i])
        torch.testing.assert_close(data["advantages"][i], want)
    assert data["opd_coef"] == [2.0] * 5 and not any(k.startswith("opd_share/") for k in data)


def test_forward_patches_are_declared_where_coefficients_differ():
    uses = {u.patch: u for u in PLUGIN.patches}
    assert (uses["rollout.forward_metadata"].moment, uses["train.rollout_log_metadata"].moment) == ("rollout", "train")
    assert {p: u.when for p, u in uses.items()} == {
        "rollout.forward_metadata": "slime_ascend.opd.hooks.needs_metadata",
        "train.rollout_log_metadata": "slime_ascend.opd.hooks.needs_metadata",
        "train.loss_batch_metadata": "slime_ascend.opd.hooks.topk_mode",
    }
    assert uses["train.loss_batch_metadata"].moment == "train"
    same = make_args(ascend_opd_teachers=[dict(t, coef=2.0) for t in TEACHERS])
    assert not hooks.needs_metadata(same) and not hooks.topk_mode(same)
    topk = make_args(ascend_opd_mode="topk", ascend_opd_teachers=[dict(t, coef=2.0) for t in TEACHERS])
    assert hooks.needs_metadata(topk) and hooks.topk_mode(topk)  # the top-k payload travels in the metadata
    assert hooks.coefs_differ(make_args())  # TEACHERS: 1.0 and 0.5
    assert not hooks.coefs_differ(make_args(ascend_opd_teachers=[dict(t, coef=2.0) for t in TEACHERS]))
    assert not hooks.coefs_differ(make_args(ascend_opd_coef=0.5, ascend_opd_teachers=[
        {k: v for k, v in t.items() if k != "coef"} | ({"coef": 0.5} if t["name"] == "code" else {}) for t in TEACHERS]))


def test_advantage_without_metadata_and_different_coefs_fails_clearly():
    data = _rollout_data()
    with pytest.raises(RuntimeError, match="rollout.forward_metadata"):
        hooks.opd_advantage(make_args(), data)


def test_advantage_clip():
    args = make_args(ascend_opd_clip=0.1, ascend_opd_teachers=[dict(t, coef=1.0) for t in TEACHERS])
    data = _rollout_data()
    base = [a.clone() for a in data["advantages"]]
    hooks.opd_advantage(args, data)
    for i in range(5):
        assert float((data["advantages"][i] - base[i]).abs().max()) <= 0.1 + 1e-6

