"""The role-entry patches (driver.validate_at_parse_args, rollout.validate_at_http_client,
train.validate_at_actor_init): each checks its slime target, wraps it to report the role's args, and refuses a
target that no longer looks as expected (nothing changed), on stand-ins of slime's three modules."""

from __future__ import annotations

import linecache
import types

import pytest

from slime_ascend import patch
from slime_ascend.patch import PatchTargetError
from slime_ascend.plugins import roles


def _module(name, source, monkeypatch):
    """A stand-in module whose source inspect can read (the checks read the target's source)."""
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    monkeypatch.setitem(linecache.cache, module.__file__, (len(source), None, source.splitlines(True), module.__file__))
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


ARGUMENTS = "def parse_args(add_custom_arguments=None):\n    args = {'parsed': True}\n    return args\n"
HTTP_UTILS = "def init_http_client(args):\n    return ('client', args)\n"
TRAIN_ACTOR = ("class TrainRayActor:\n"
               "    def init(self, args, role, with_ref=False):\n"
               "        return ('initialised', role)\n")


@pytest.fixture
def seen(monkeypatch):
    calls = []
    monkeypatch.setattr(roles, "_entry", lambda args, role: calls.append((role, args, roles.train_role())))
    yield calls
    for patch_id in ("driver.validate_at_parse_args", "rollout.validate_at_http_client", "train.validate_at_actor_init"):
        patch.get(patch_id).remove()
    roles.set_train_role(None)


def _install(patch_id, name, source, monkeypatch):
    module = _module(name, source, monkeypatch)
    patch.get(patch_id).install(modules={name: module})
    return module


def test_driver_reports_what_parse_args_returns(seen, monkeypatch):
    module = _install("driver.validate_at_parse_args", "slime.utils.arguments", ARGUMENTS, monkeypatch)
    assert module.parse_args() == {"parsed": True}
    assert seen == [("driver", {"parsed": True}, None)]
    assert patch.get("driver.validate_at_parse_args").applied


def test_rollout_reports_before_the_client_starts(monkeypatch):
    order = []
    monkeypatch.setattr(roles, "_entry", lambda args, role: order.append((role, args)))
    source = "ORDER = []\ndef init_http_client(args):\n    ORDER.append('client')\n    return 'client'\n"
    module = _install("rollout.validate_at_http_client", "slime.utils.http_utils", source, monkeypatch)
    try:
        module.ORDER.append("start")
        order.append("before")
        assert module.init_http_client("A") == "client" and module.init_http_client(args="B") == "client"
        assert order == ["before", ("rollout", "A"), ("rollout", "B")] and module.ORDER == ["start", "client", "client"]
    finally:
        patch.get("rollout.validate_at_http_client").remove()


def test_train_records_the_role_then_reports_its_args(seen, monkeypatch):
    module = _install("train.validate_at_actor_init", "slime.ray.train_actor", TRAIN_ACTOR, monkeypatch)
    actor = module.TrainRayActor()
    assert actor.init("critic-args", "critic") == ("initialised", "critic")
    assert actor.init(args="actor-args", role="actor") == ("initialised", "actor")
    assert seen == [("train", "critic-args", "critic"), ("train", "actor-args", "actor")]


@pytest.mark.parametrize("patch_id,name,source,problem", [
    ("driver.validate_at_parse_args", "slime.utils.arguments", "def parse(argv=None):\n    return argv\n",
     "slime.utils.arguments.parse_args is missing"),
    ("driver.validate_at_parse_args", "slime.utils.arguments", "def parse_args():\n    return make()\n",
     "no longer contains 'return args'"),
    ("rollout.validate_at_http_client", "slime.utils.http_utils", "def init_http_client(config):\n    pass\n",
     "takes ['config'], expected it to start with ['args']"),
    ("train.validate_at_actor_init", "slime.ray.train_actor",
     "class TrainRayActor:\n    def init(self, role, args):\n        pass\n",
     "expected it to start with ['self', 'args', 'role']"),
    ("train.validate_at_actor_init", "slime.ray.train_actor", "class RayActor:\n    pass\n",
     "slime.ray.train_actor.TrainRayActor.init is missing"),
])
def test_a_changed_target_is_refused_and_left_alone(patch_id, name, source, problem, monkeypatch):
    module = _module(name, source, monkeypatch)
    before = dict(vars(module))
    with pytest.raises(PatchTargetError, match=f"{patch_id!r} was not applied") as info:
        patch.get(patch_id).install(modules={name: module})
    assert problem in str(info.value) and "0016-role-entry-hook.patch" in str(info.value)
    assert dict(vars(module)) == before and not patch.get(patch_id).applied


def test_entered_without_the_runtime_says_so(monkeypatch):
    monkeypatch.setattr(roles, "_entry", None)
    with pytest.raises(RuntimeError, match="slime_ascend.startup.early.install"):
        roles.entered(object(), "driver")
