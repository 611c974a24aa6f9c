"""Every ``slime-ascend`` help text names only options that exist: each ``--option`` in a description, epilog, group
title or argument help of a subcommand (and in its one-line help in ``slime-ascend --help``) is an option of that
subcommand, or of another subcommand the same text names (``serve-torch --dump-dsa-index-sets``), or a flag of the
slime launch (slime's, Megatron's or SGLang's parsers, read from their source) in a text that says it is slime's."""

from __future__ import annotations

import argparse
import re

import pytest

from slime_ascend import cli

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
# a text that names a flag of the slime launch says whose it is
LAUNCH_WORDS = re.compile(r"slime|megatron|sglang|train\.py|launch", re.IGNORECASE)


class _Parser(BaseException):
    """Raised with the parser a subcommand builds, before it parses anything (BaseException: past the CLI's
    one-line error handler)."""

    def __init__(self, parser):
        self.parser = parser


def _parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: a passthrough command builds its own (caught as it parses)."""
    def catch(self, args=None, namespace=None):
        raise _Parser(self)

    with monkeypatch.context() as patched:
        patched.setattr(argparse.ArgumentParser, "parse_known_args", catch)
        try:
            cli.main([name, "--help"])
        except _Parser as caught:
            return caught.parser
    raise AssertionError(f"slime-ascend {name} parsed no arguments")


def _subcommands(monkeypatch) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """name -> (its parser, its one-line help in ``slime-ascend --help``)."""
    top = cli.build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in subs._choices_actions}
    return {name: (_parser_of(name, monkeypatch) if name in cli.PASSTHROUGH else parser, helps.get(name, ""))
            for name, parser in subs.choices.items()}


def _texts(parser: argparse.ArgumentParser):
    """(where, text) of every help text of ``parser`` and its own subcommands, ``%(default)s`` expanded."""
    formatter = parser._get_formatter()
    yield "description", parser.description or ""
    yield "epilog", parser.epilog or ""
    for group in parser._action_groups:
        yield f"group {group.title!r}", f"{group.title or ''} {group.description or ''}"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _texts(sub)
        elif action.help and action.help is not argparse.SUPPRESS:
            yield "/".join(action.option_strings) or action.dest, formatter._expand_help(action)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    out = {o for a in parser._actions for o in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _options(sub)
    return out


def _launch_flags() -> set[str]:
    """Every flag of the slime launch: Megatron's, slime's and the SGLang ones slime forwards (``--sglang-*``), from
    the parsers slime's ``parse_args`` builds."""
    from conftest import need

    need("slime.utils.arguments")
    from slime_ascend.compat import typing_override

    typing_override.ensure()  # slime's modules import typing.override (Python 3.12)
    from megatron.training.arguments import add_megatron_arguments
    from slime.backends.sglang_utils.arguments import add_sglang_arguments
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = argparse.ArgumentParser(add_help=False, conflict_handler="resolve")
    add_megatron_arguments(parser)
    get_slime_extra_args_provider()(parser)
    add_sglang_arguments(parser)
    return {o for a in parser._actions for o in a.option_strings}


def _launch_flag(option: str, launch: set[str]) -> bool:
    """``option`` is a flag of the launch, or SGLang's own server flag that slime forwards as ``--sglang-*``."""
    return option in launch or "--sglang-" + option.removeprefix("--") in launch


def _unknown_options(commands) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(each option a help text names that is no option of its command nor of a command it names, in a text that
    does not say it is the slime launch's; the options of texts that do: (command, where, option))."""
    options = {name: _options(parser) for name, (parser, _) in commands.items()}
    wrong, launch_named = [], []
    for name, (parser, one_line) in commands.items():
        for where, text in [("slime-ascend --help", one_line), *_texts(parser)]:
            others = [n for n in commands if n != name and re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
            for option in dict.fromkeys(OPTION.findall(text)):
                if option in options[name] or any(option in options[n] for n in others):
                    continue
                if LAUNCH_WORDS.search(text):
                    launch_named.append((name, where, option))
                else:
                    wrong.append(f"slime-ascend {name}: {where}: {option} is not an option of {name}")
    return wrong, launch_named


def test_every_option_a_help_text_names_exists(monkeypatch):
    wrong, _ = _unknown_options(_subcommands(monkeypatch))
    assert not wrong, "\n".join(wrong)


@pytest.mark.slime
def test_every_slime_flag_a_help_text_names_exists(monkeypatch):
    """The flags help texts name as the slime launch's are flags of slime's parsers (or of SGLang's server)."""
    _, launch_named = _unknown_options(_subcommands(monkeypatch))
    assert launch_named  # e.g. dryrun's --nodes: the launch command's --actor-num-nodes
    launch = _launch_flags()
    wrong = [f"slime-ascend {name}: {where}: {option} is no flag of slime's launch (slime, Megatron, SGLang) nor of "
             f"{name}" for name, where, option in launch_named if not _launch_flag(option, launch)]
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_an_option_a_command_lacks(monkeypatch):
    """The demo's layout group once said ``--flags`` (an option of ``config`` only): such a text is caught; a text
    that names a flag as slime's goes to the check against slime's parsers."""
    commands = _subcommands(monkeypatch)
    demo = commands["demo"][0]
    assert "--flags" not in _options(demo) and "--flags" in _options(commands["config"][0])
    group = next(g for g in demo._action_groups if "parallel layout" in (g.title or ""))
    group.title = "parallel layout (with --flags: the flags for it)"
    wrong, _ = _unknown_options(commands)
    assert wrong == ["slime-ascend demo: group 'parallel layout (with --flags: the flags for it)': --flags is not an "
                     "option of demo"]
    group.title = "parallel layout (slime's --no-such-flag)"
    wrong, launch_named = _unknown_options(commands)
    assert not wrong and ("demo", f"group {group.title!r}", "--no-such-flag") in launch_named


@pytest.mark.slime
def test_a_slime_flag_that_does_not_exist_is_caught():
    launch = _launch_flags()
    assert not _launch_flag("--no-such-flag", launch) and not _launch_flag("--flags", launch)
    assert _launch_flag("--hf-checkpoint", launch) and _launch_flag("--tensor-model-parallel-size", launch)
    assert _launch_flag("--sglang-mem-fraction-static", launch) and _launch_flag("--mem-fraction-static", launch)
