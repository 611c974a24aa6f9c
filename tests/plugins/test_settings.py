import pytest
from hypothesis import given, strategies as st

from slime_ascend.plugins.settings import Setting, SettingsError, SettingsView, coerce


def test_key_prefix_required():
    with pytest.raises(ValueError, match="must start with 'ascend_'"):
        Setting("eps", float, 0.2, "x")


def test_bad_default_fails_at_declaration():
    with pytest.raises(SettingsError):
        Setting("ascend_k", int, "two", "x")


@pytest.mark.parametrize(
    "setting,value,expected",
    [
        (Setting("ascend_flag", bool, False, "x"), "true", True),
        (Setting("ascend_flag", bool, False, "x"), False, False),
        (Setting("ascend_k", int, 2, "x", minimum=1), "3", 3),
        (Setting("ascend_eps", float, 0.2, "x"), 1, 1.0),
        (Setting("ascend_names", list, [], "x"), "a, b", ["a", "b"]),
        (Setting("ascend_mode", str, "a", "x", choices=("a", "b")), "b", "b"),
        (Setting("ascend_teachers", dict, [], "x"), [{"name": "t"}], [{"name": "t"}]),
        (Setting("ascend_opt", float, None, "x", optional=True), None, None),
    ],
)
def test_coerce_accepts(setting, value, expected):
    assert coerce(setting, value) == expected


@pytest.mark.parametrize(
    "setting,value,problem",
    [
        (Setting("ascend_k", int, 2, "critic passes", minimum=1), 0, "below the minimum"),
        (Setting("ascend_k", int, 2, "critic passes"), 2.5, "not an integer"),
        (Setting("ascend_k", int, 2, "critic passes"), True, "not an integer"),
        (Setting("ascend_eps", float, 0.2, "x"), "abc", "not a number"),
        (Setting("ascend_eps", float, 0.2, "x"), float("nan"), "NaN"),
        (Setting("ascend_icepop_beta", float, 2.0, "x", minimum=1.0000001), "inf", "infinite"),
        (Setting("ascend_icepop_beta", float, 2.0, "x", minimum=1.0000001), float("inf"), "infinite"),
        (Setting("ascend_opd_clip", float, None, "x", optional=True), float("-inf"), "infinite"),
        (Setting("ascend_mode", str, "a", "x", choices=("a", "b")), "c", "not an allowed choice"),
        (Setting("ascend_flag", bool, False, "x"), "maybe", "not a boolean"),
        (Setting("ascend_k", int, 2, "x"), None, "a value is required"),
        (Setting("ascend_d", dict, {}, "x"), 3, "not a mapping"),
    ],
)
def test_errors_name_key_value_and_fix(setting, value, problem):
    with pytest.raises(SettingsError) as info:
        coerce(setting, value)
    text = str(info.value)
    assert setting.key in text and repr(value) in text and problem in text
    assert "Fix: set" in text and "--custom-config-path" in text


@given(st.integers(min_value=-10**6, max_value=10**6))
def test_int_roundtrip_through_strings(n):
    s = Setting("ascend_n", int, 0, "x")
    assert coerce(s, str(n)) == n == coerce(s, n)


def test_view_short_and_full_names():
    view = SettingsView("sao", {"ascend_sao_critic_iters": 2, "ascend_sao_alpha": 1.5})
    assert view.critic_iters == 2 and view["ascend_sao_alpha"] == 1.5
    with pytest.raises(AttributeError, match="no setting"):
        view.nothing


def test_every_command_a_help_text_names_exists():
    """A setting's help (or a plugin's description or command-line reason) that tells the user to run
    `slime-ascend NAME` names a real subcommand."""
    import re

    from slime_ascend import cli
    from slime_ascend.plugins import registry

    commands = set(cli.PASSTHROUGH) | {
        name for action in cli.build_parser()._subparsers._group_actions for name in action.choices
    }
    named = []
    for plugin in registry.available().values():
        texts = [plugin.description, *(s.help for s in plugin.settings), *(f.why for f in plugin.command_line)]
        named += [(plugin.name, m) for text in texts for m in re.findall(r"`slime-ascend ([a-z][\w-]*)", text)]
    assert named, "no help text names a command: the pattern no longer matches"
    missing = [(p, c) for p, c in named if c not in commands]
    assert not missing, f"help texts name commands the CLI does not have: {missing}"
