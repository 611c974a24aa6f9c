"""sglang-npu: the HCCL port ranges reach every process of the weight-update communicator.

CANN: if one card of an HCCL communicator sets ``HCCL_HOST_SOCKET_PORT_RANGE`` / ``HCCL_NPU_SOCKET_PORT_RANGE``, all
must. The launch bridge sets them in the engines slime launches; the train actors, which join those engines in
slime's weight-update group, get the same values as they start (``train.hccl_port_env``, train moment), and a
``--train-env-vars`` that would give them another value is refused at ``parse_args``."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest

from slime_ascend.plugins import registry
from slime_ascend.plugins.settings import SettingsError
from slime_ascend.rollout.backends import sglang_npu

HOST, NPU = sglang_npu.HCCL_PORT_ENVS


def _args(**kw):
    return types.SimpleNamespace(ascend_plugins="npu,sglang-npu", **kw)


def _engine_env(args, job: dict[str, str]) -> dict[str, str]:
    """What the launch bridge leaves in an engine whose job environment is ``job``."""
    env = dict(job)
    sglang_npu.apply_env(sglang_npu.BACKEND.env(sglang_npu.BACKEND.options_from_args(args)), env)
    return env


@pytest.mark.parametrize("job", [{}, {HOST: "40000-40100"}, {HOST: "40000-40100", NPU: "41000-41100"}])
@pytest.mark.parametrize("settings", [{}, {"ascend_rollout_hccl_host_port_range": "50000-50010",
                                           "ascend_rollout_hccl_npu_port_range": "51000-51010"}])
def test_train_actors_get_the_engines_values(job, settings):
    args = _args(**settings)
    train = dict(job)
    set_here = sglang_npu.apply_train_env(args, train)
    engine = _engine_env(args, job)
    assert {k: train[k] for k in (HOST, NPU)} == {k: engine[k] for k in (HOST, NPU)}
    assert set(set_here) == {HOST, NPU} - set(job)  # the job's own value wins
    assert all(train[k] == v for k, v in job.items())
    assert sglang_npu.hccl_problem(args, job) is None


def test_nothing_where_slime_launches_no_engine():
    for args in (_args(rollout_external_engine_addrs=["h:1"]), _args(debug_train_only=True)):
        env: dict[str, str] = {}
        assert sglang_npu.apply_train_env(args, env) == {} and env == {}
        assert sglang_npu.hccl_problem(args, {}) is None


def test_train_env_vars_giving_another_range_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv(HOST, raising=False)
    args = _args(train_env_vars={HOST: "40000-40100"})
    problem = sglang_npu.hccl_problem(args, {})
    assert problem.startswith(f"sglang-npu: {HOST} would be '40000-40100' in the train actors (--train-env-vars) but "
                              "'60000-60050' in the engines")
    assert f"Fix: drop {HOST} from --train-env-vars" in problem and "\n" not in problem
    assert sglang_npu.hccl_problem(_args(train_env_vars={HOST: "60000-60050"}), {}) is None  # the same value
    monkeypatch.setattr(sglang_npu.BACKEND, "validate", lambda options: [])  # whatever the installed SGLang says
    with pytest.raises(SettingsError, match=f"sglang-npu: {HOST} would be"):
        sglang_npu.validate_plugin(args, None)


def test_declared_by_sglang_npu_at_the_train_moment():
    uses = {u.patch: u for u in registry.resolve_selection(["sglang-npu"]).get("sglang-npu").patches}
    use = uses["train.hccl_port_env"]
    assert use.moment == "train" and use.when == "slime_ascend.rollout.backends.sglang_npu.launches_engines"


@pytest.mark.slime
def test_the_train_patch_sets_them_in_a_train_actor_before_its_process_group():
    """The runtime's own train-moment install (``patch_plan.install_for_role``) against slime's real
    ``TrainRayActor.init`` (checked: its ``dist.init_process_group`` comes after this moment)."""
    from slime_ascend.startup import patch_plan

    saved = {k: os.environ.pop(k, None) for k in (HOST, NPU)}
    try:
        os.environ[NPU] = "41000-41100"  # the job's value stays
        plugins = registry.resolve_selection(["sglang-npu"]).plugins
        installed = patch_plan.install_for_role(_args(ascend_rollout_hccl_host_port_range="50000-50010"), "train",
                                                plugins, only=("train.hccl_port_env",))
        assert installed == ["train.hccl_port_env"]
        assert os.environ[HOST] == "50000-50010" and os.environ[NPU] == "41000-41100"
        external = _args(rollout_external_engine_addrs=["h:1"])
        del os.environ[HOST]
        assert patch_plan.install_for_role(external, "train", plugins, only=("train.hccl_port_env",)) == []
        assert HOST not in os.environ
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


@pytest.mark.slime
def test_the_patch_refuses_a_train_actor_whose_process_group_moved():
    from slime_ascend import patch

    p = patch.get("train.hccl_port_env")
    assert p.verify() == []
    fake = types.ModuleType("slime.ray.train_actor")

    class TrainRayActor:
        def init(self, args, role):
            return None

    fake.TrainRayActor = TrainRayActor
    assert any("dist.init_process_group(" in problem for problem in p.check({"slime.ray.train_actor": fake}))


def _emulated_group(scenario: str, out: "Path") -> dict[int, dict]:
    """The two ranks of :mod:`sglang_npu_hccl_workers` (an engine and a train actor) forming an hccl group on the
    emulated Ascend device."""
    import json

    import sglang_npu_hccl_workers
    import zygote

    if importlib.util.find_spec("slime_ascend.npu_emulation") is None:
        pytest.skip("slime_ascend.npu_emulation is not in this checkout")
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_ASCEND_PLUGINS", *sglang_npu.HCCL_PORT_ENVS)}
    out.mkdir()
    zygote.spawn(sglang_npu_hccl_workers.worker, args=(scenario, zygote.free_port(), str(out)), nprocs=2, env=env,
                 timeout=300)
    # one file per rank: two ranks' lines on one stdout can interleave
    results = {int(f.stem.removeprefix("rank")): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    assert set(results) == {0, 1}, sorted(out.iterdir())
    return results


def test_engine_and_train_actor_form_one_hccl_group_on_the_emulated_device(tmp_path):
    """Through the emulated hccl backend: with the train side's ranges (train.hccl_port_env) the weight-update group
    forms and reduces; with the bridge alone (the engine's ranges only, as before) it fails at creation, as CANN's
    all-cards rule makes the real one fail."""
    ok = _emulated_group("train_actor_starts", tmp_path / "ok")
    assert ok[0]["env"] == ok[1]["env"] == {HOST: "60000-60050", NPU: "61000-61050"}
    assert ok[0]["error"] is None and ok[1]["error"] is None and ok[0]["all_reduce"] == [2.0, 2.0]
    before = _emulated_group("bridge_only", tmp_path / "before")
    assert before[1]["env"] == {HOST: None, NPU: None}
    refusal = "HcclEnvError: HCCL_NPU_SOCKET_PORT_RANGE is set on rank(s) [0] but not on rank(s) [1]"
    errors = [before[rank]["error"] for rank in (0, 1)]
    assert all(errors) and any(e.startswith(refusal) for e in errors), errors  # the other may see the store close
