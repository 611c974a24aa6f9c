import pytest

from slime_ascend.plugins.base import Contribution, Plugin
from slime_ascend.plugins.registry import PluginError, available, parse_names, resolve_selection


def P(name, **kw):
    return Plugin(name=name, description=name, **kw)


def test_parse_names():
    assert parse_names(" npu, SAO ,,npu") == ["npu", "sao"]
    assert parse_names(["a", "b"]) == ["a", "b"]
    assert parse_names(["a,b", "c"]) == ["a", "b", "c"]
    assert parse_names(None) == []


def test_requires_are_added_before_dependents():
    known = {"a": P("a"), "b": P("b", requires=("a",)), "c": P("c", requires=("b",))}
    assert resolve_selection(["c"], known).names == ("a", "b", "c")


def test_unknown_plugin_names_the_fix():
    with pytest.raises(PluginError, match=r"unknown plugin 'x' \(required by 'b'\).*Known plugins: a, b"):
        resolve_selection(["b"], {"a": P("a"), "b": P("b", requires=("x",))})


def test_conflict_names_both():
    known = {"a": P("a", conflicts=("b",)), "b": P("b")}
    with pytest.raises(PluginError, match="'a' and 'b' cannot be enabled together"):
        resolve_selection(["b", "a"], known)


def test_exclusive_slot_clash_names_both_plugins():
    known = {
        "a": P("a", contributions=(Contribution("loss", "m.f"),)),
        "b": P("b", contributions=(Contribution("loss", "m.g"),)),
    }
    with pytest.raises(PluginError, match=r"'loss'.*'a' and 'b'"):
        resolve_selection(["a", "b"], known)


def test_chain_without_declared_order_is_an_error():
    known = {
        "a": P("a", contributions=(Contribution("advantage", "m.f", order=200),)),
        "b": P("b", contributions=(Contribution("advantage", "m.g", order=200),)),
    }
    with pytest.raises(PluginError, match="order 200"):
        resolve_selection(["a", "b"], known)


def test_chain_runs_in_declared_order_not_load_order():
    known = {
        "late": P("late", contributions=(Contribution("advantage", "m.late", order=300),)),
        "early": P("early", contributions=(Contribution("advantage", "m.early", order=100),)),
    }
    sel = resolve_selection(["late", "early"], known)
    assert [c.target for _, c in sel.slots["advantage"]] == ["m.early", "m.late"]


def test_all_skips_alternatives():
    known = {"a": P("a"), "x": P("x", conflicts=("y",)), "y": P("y", conflicts=("x",))}
    assert resolve_selection(["all"], known).names == ("a",)
    assert resolve_selection(["all", "x"], known).names == ("a", "x")


def test_unknown_slot_fails_at_declaration():
    with pytest.raises(KeyError, match="unknown hook slot"):
        Contribution("no-such-slot", "m.f")


def test_installed_entry_points_load():
    plugins = available()
    assert "npu" in plugins
    for name, plugin in plugins.items():
        assert plugin.name == name
        for c in plugin.contributions:
            assert callable(c.load()), c.target
        for path in plugin.process_start:
            from slime_ascend.plugins.base import resolve

            assert callable(resolve(path))


def test_no_installed_plugin_is_broken():
    from slime_ascend.plugins import registry

    assert registry.broken() == {}
