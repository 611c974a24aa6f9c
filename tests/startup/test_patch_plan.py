"""The runtime installs the enabled plugins' declared patches (slime_ascend.startup.patch_plan)."""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

import pytest

from slime_ascend import _import_hooks, patch
from slime_ascend.plugins import registry
from slime_ascend.plugins.base import PatchUse, Plugin
from slime_ascend.startup import patch_plan

PACKAGE = Path(patch_plan.__file__).resolve().parents[1]


def _plugin(name, *uses):
    return Plugin(name=name, description="test", patches=uses)


def test_every_declared_patch_is_in_the_ledger_and_in_a_consistent_order():
    plugins = list(registry.available().values())
    uses = patch_plan.planned(plugins)
    ids = [u.patch for u in uses]
    assert ids == [pid for pid in patch.LEDGER if pid in ids]  # ledger order
    declared = {u.patch for p in plugins for u in p.patches}
    assert declared == set(ids)
    # every ledger entry is declared by some plugin or by the runtime itself: nothing is installed by hand
    from slime_ascend.startup import early

    runtime_own = {u.patch for u in early.PATCHES}
    assert not declared & runtime_own
    assert declared | runtime_own == set(patch.LEDGER)


def test_bare_ids_are_import_moment_and_moments_are_checked():
    plugin = _plugin("x", "train.cpu_streams", PatchUse("train.quantize_params", "train"))
    assert [(u.patch, u.moment) for u in plugin.patches] == [("train.cpu_streams", "import"),
                                                           ("train.quantize_params", "train")]
    assert plugin.patch_ids == ("train.cpu_streams", "train.quantize_params")
    assert PatchUse("a", "import:megatron.core").trigger == "megatron.core"
    for bad in ("later", "train:x", "import:", "rollout:y"):
        with pytest.raises(ValueError, match="moment"):
            PatchUse("a", bad)
    with pytest.raises(ValueError, match="declares a patch twice"):
        _plugin("y", "train.cpu_streams", PatchUse("train.cpu_streams", "train"))


def test_plan_refuses_unknown_ids_two_moments_and_an_after_the_ledger_contradicts():
    with pytest.raises(ValueError, match="not in the ledger"):
        patch_plan.planned([_plugin("x", "train.nope")])
    with pytest.raises(ValueError, match="two moments"):
        patch_plan.planned([_plugin("x", "train.cpu_streams"), _plugin("y", PatchUse("train.cpu_streams", "train"))])
    later, earlier = "train.cpu_tensor_type", "train.cpu_streams"  # ledger order: streams before tensor_type
    with pytest.raises(ValueError, match="comes later in the ledger"):
        patch_plan.planned([_plugin("x", PatchUse(earlier, after=(later,)), later)])
    assert [u.patch for u in patch_plan.planned([_plugin("x", PatchUse(later, after=(earlier,)), earlier)])] == [
        earlier, later]


_ALWAYS = types.SimpleNamespace(yes=lambda args: True, no=lambda args: False)


@pytest.mark.parametrize(("first", "second", "installed"), [
    ("ppc.no", "ppc.yes", True),  # the second plugin needs it: installed although the first's condition fails
    ("ppc.yes", "ppc.no", True),
    ("ppc.no", "ppc.no", False),
    (None, "ppc.no", True),  # one plugin needs it unconditionally
])
def test_two_plugins_declaring_one_patch_combine_their_conditions(monkeypatch, first, second, installed):
    """Two plugins (e.g. reward-mix and opd on rollout.forward_metadata) declaring the same patch: it is
    installed where either needs it, not only where the first-listed plugin's condition holds."""
    monkeypatch.setitem(sys.modules, "ppc", _ALWAYS)
    done = []
    monkeypatch.setattr(patch, "install", lambda patch_id, args=None: done.append(patch_id))
    a = _plugin("a", PatchUse("rollout.forward_metadata", "rollout", when=first, after=("train.cpu_streams",)))
    b = _plugin("b", PatchUse("rollout.forward_metadata", "rollout", when=second))
    (use,) = patch_plan.planned([a, b])
    assert use.after == ("train.cpu_streams",)
    assert patch_plan.install_for_role(object(), "rollout", [a, b]) == (["rollout.forward_metadata"] if installed else [])
    assert done == (["rollout.forward_metadata"] if installed else [])


@pytest.mark.slime  # the ledger's patch modules are imported: they need slime's stack
def test_role_patches_install_in_ledger_order_with_their_condition(monkeypatch):
    calls = []
    monkeypatch.setattr(patch, "install", lambda pid, args=None: calls.append((pid, args)))
    fake = types.ModuleType("patch_plan_conditions")
    fake.yes = lambda args: True
    fake.no = lambda args: False
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    plugin = _plugin(
        "x",
        PatchUse("train.weight_sync_metrics", "train", when="patch_plan_conditions.no"),
        PatchUse("train.quant_post_process", "train", when="patch_plan_conditions.yes"),
        PatchUse("train.quantize_params", "train"),
        PatchUse("rollout.forward_metadata", "rollout"),
        "train.cpu_streams",
    )
    args = object()
    assert patch_plan.install_for_role(args, "train", [plugin]) == ["train.quantize_params", "train.quant_post_process"]
    assert calls == [("train.quantize_params", args), ("train.quant_post_process", args)]
    calls.clear()
    assert patch_plan.install_for_role(args, "rollout", [plugin]) == ["rollout.forward_metadata"]


@pytest.mark.slime  # the ledger's patch modules are imported: they need slime's stack
def test_import_moment_waits_for_the_trigger_and_asks_its_condition_once(monkeypatch, tmp_path):
    installed, asked = [], []
    monkeypatch.setattr(patch, "install", lambda pid, args=None: installed.append(pid))
    fake = types.ModuleType("patch_plan_conditions2")
    fake.once = lambda: asked.append(1) or True
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    trigger = "patch_plan_trigger_module"
    (tmp_path / f"{trigger}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = _plugin("x", PatchUse("train.cpu_streams", f"import:{trigger}", when="patch_plan_conditions2.once"),
                     PatchUse("train.quantize_params", "train"))
    try:
        assert patch_plan.install_at_process_start([plugin]) == ["train.cpu_streams"]
        assert installed == [] and asked == []  # nothing until the trigger is imported
        importlib.import_module(trigger)
        assert installed == ["train.cpu_streams"] and asked == [1]
    finally:
        _import_hooks.clear(trigger)
        sys.modules.pop(trigger, None)


def _imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


# modules that may import the ledger: its users by design (the runtime's plan, the doctor)
LEDGER_USERS = {"startup/patch_plan.py", "doctor.py"}


def test_no_feature_imports_the_patch_ledger():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("patch/") or rel in LEDGER_USERS:
            continue
        bad = sorted(m for m in _imports_of(path) if m == "slime_ascend.patch" or m.startswith("slime_ascend.patch."))
        if bad:
            offenders.append(f"{rel}: {', '.join(bad)}")
    assert not offenders, "declare the patch in the plugin instead (PatchUse):\n" + "\n".join(offenders)


def test_a_stand_in_for_slimes_actor_installs_one_patch_on_args_alone():
    """The demo's trainer without slime: the plan checks and installs train.critic_advantage_function on the
    critic's args only (no slime module to patch), and nothing for a plugin that does not declare it."""
    import argparse

    sao = registry.available()["sao"]
    critic_args = argparse.Namespace(custom_advantage_function_path=None)
    try:
        assert patch_plan.install_for_role(critic_args, "train", [registry.available()["dis"]],
                                           only=("train.critic_advantage_function",), modules={}) == []
        assert critic_args.custom_advantage_function_path is None
        assert patch_plan.install_for_role(critic_args, "train", [sao], only=("train.critic_advantage_function",),
                                           modules={}) == ["train.critic_advantage_function"]
        assert critic_args.custom_advantage_function_path == "slime_ascend.hooks.advantage_function"
        assert patch_plan.applied("train.critic_advantage_function")
    finally:
        patch.get("train.critic_advantage_function").remove()
    assert critic_args.custom_advantage_function_path is None
