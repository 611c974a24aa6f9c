import types

import pytest

from slime_ascend.patch.base import (
    AttributeStack, PatchConflictError, PatchTargetError, RuntimePatch, missing_source, param_mismatch,
)


def make_module():
    m = types.ModuleType("fake_target")

    def f(x):
        return x + 1

    m.f = f
    return m


class Wrap(RuntimePatch):
    def __init__(self, pid, factor, problems=()):
        super().__init__(id=pid, targets=("fake_target:f",), why="w", how="h", upstream="patches/x.patch",
                         checked_on=("0.3.1",))
        self.factor, self.problems = factor, list(problems)

    def check(self, modules):
        return self.problems

    def apply(self, modules, args=None):
        factor = self.factor
        self.wrap(modules["fake_target"], "f", lambda orig: (lambda x: orig(x) * factor))


class Replace(RuntimePatch):
    def __init__(self, pid):
        super().__init__(id=pid, targets=("fake_target:f",), why="w", how="h", upstream="patches/x.patch",
                         checked_on=("0.3.1",))

    def apply(self, modules, args=None):
        self.replace(modules["fake_target"], "f", lambda x: 100 * x)


def test_wrappers_stack_and_remove_in_any_order():
    m = make_module()
    a, b = Wrap("train.a", 2), Wrap("train.b", 3)
    a.install(modules={"fake_target": m})
    b.install(modules={"fake_target": m})
    assert m.f(1) == 12  # ((1 + 1) * 2) * 3
    a.remove()  # remove the inner wrapper first: the outer one stays
    assert m.f(1) == 6
    assert not a.applied and b.applied
    b.remove()
    assert m.f(1) == 2 and not b.applied


def test_replacement_under_wrappers_and_conflict():
    m = make_module()
    w, r1, r2 = Wrap("train.w", 2), Replace("train.r1"), Replace("train.r2")
    w.install(modules={"fake_target": m})
    r1.install(modules={"fake_target": m})
    assert m.f(1) == 200  # the replacement is the base; the wrapper stays on top
    with pytest.raises(PatchConflictError, match="train.r1.*train.r2"):
        r2.install(modules={"fake_target": m})
    r1.remove()
    w.remove()
    assert m.f(1) == 2


def test_target_mismatch_fails_loudly_and_changes_nothing():
    m = make_module()
    bad = Wrap("train.bad", 2, problems=["f no longer takes x"])
    with pytest.raises(PatchTargetError) as info:
        bad.install(modules={"fake_target": m})
    text = str(info.value)
    assert "train.bad" in text and "f no longer takes x" in text and "Checked on slime 0.3.1" in text
    assert "running slime" in text and "patches/x.patch" in text
    assert m.f(1) == 2 and not bad.applied


def test_shape_helpers():
    def g(args, rollout_id, data):
        return "needle"

    assert param_mismatch(g, ["args", "rollout_id"]) == []
    assert param_mismatch(g, ["args", "x"])
    assert missing_source(g, ["needle"]) == []
    assert missing_source(g, ["haystack"])


def test_patch_id_must_name_process():
    with pytest.raises(ValueError, match="must start with"):
        Wrap("bogus", 1)


def test_stack_forgets_fully_removed_attributes():
    m = make_module()
    p = Wrap("train.tmp", 2)
    p.install(modules={"fake_target": m})
    p.remove()
    assert not AttributeStack.owned_by("train.tmp")
