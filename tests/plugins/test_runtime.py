"""runtime.check: every ascend_* key on args must be a declared setting (a misspelling is an error
that names the closest real key); a key of an installed plugin that is not enabled only warns."""

import argparse
import logging

import pytest

from slime_ascend.plugins import registry, runtime
from slime_ascend.plugins.base import Plugin
from slime_ascend.plugins.settings import Setting, SettingsError


@pytest.fixture
def two_plugins(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    registry.register(Plugin(name="k-one", description="x", settings=(
        Setting("ascend_kone_critic_iters", int, 2, "iterations"),
        Setting("ascend_kone_mode", str, "a", "mode", choices=("a", "b")),
    )))
    registry.register(Plugin(name="k-two", description="x", settings=(Setting("ascend_ktwo_beta", float, 2.0, "b"),)))


def args(**kw):
    return argparse.Namespace(ascend_plugins=["k-one"], **kw)


def test_declared_keys_pass(two_plugins):
    state = runtime.check(args(ascend_kone_critic_iters=3, ascend_kone_mode="b"))
    assert state.settings["k-one"].critic_iters == 3


def test_misspelled_key_is_an_error_naming_the_closest_key(two_plugins):
    with pytest.raises(SettingsError, match=r"unknown setting 'ascend_kone_critic_iter' .*did you mean "
                                            r"'ascend_kone_critic_iters'\?.*Fix:"):
        runtime.check(args(ascend_kone_critic_iter=3))
    with pytest.raises(SettingsError, match="did you mean"):
        runtime.active(args(ascend_kone_mdoe="b"))  # the cached path checks keys too


def test_unknown_key_without_a_close_match_still_fails(two_plugins):
    with pytest.raises(SettingsError) as err:
        runtime.check(args(ascend_zzzzzz=1))
    assert "'ascend_zzzzzz'" in str(err.value) and "did you mean" not in str(err.value)


def test_key_of_an_installed_plugin_that_is_not_enabled_warns(two_plugins, caplog):
    with caplog.at_level(logging.WARNING, logger="slime_ascend"):
        runtime.check(args(ascend_ktwo_beta=3.0))
    assert "ascend_ktwo_beta belongs to plugin 'k-two', which is not enabled" in caplog.text


def test_args_without_dict_are_not_scanned(two_plugins):
    class Slots:
        __slots__ = ("ascend_plugins",)

    a = Slots()
    a.ascend_plugins = ["k-one"]
    assert runtime.check(a).selection.names == ("k-one",)


def test_validation_is_cached_per_args_not_per_plugin_names(two_plugins):
    """Two roles in one process (slime's actor and critic args) enable the same plugins with different
    values: each args object gets its own validated settings, and a repeat call is served from the cache."""
    actor, critic = args(ascend_kone_critic_iters=3), args(ascend_kone_critic_iters=5)
    first = runtime.active(actor)
    assert first.settings["k-one"].critic_iters == 3
    assert runtime.active(critic).settings["k-one"].critic_iters == 5
    assert runtime.settings(actor, "k-one").critic_iters == 3
    assert runtime.active(actor) is first
