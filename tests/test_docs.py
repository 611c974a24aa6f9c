"""The documentation site (docs/, mkdocs.yml) and the README: every page in the nav, the generated pages current,
every command in a code block real (``slime-ascend`` subcommands and options from our parsers; the flags given to
slime's ``train.py`` / ``train_async.py`` from slime's own parsers and our plugins' declared flags), every
``examples/`` recipe on the Recipes page, the README within 12 KB, and ``mkdocs build --strict`` clean."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml

from conftest import need

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_LIMIT = 12288  # bytes (issue 45: the README is an entry point, the reference lives in docs/)
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[^\s`]*)")
TERMINATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
SUBCOMMAND = re.compile(r"[a-z][a-z0-9-]*")
SLIME_SCRIPT = re.compile(r"(^|/)train(_async)?\.py$")
SUBSTITUTION = re.compile(r"\$\((slime-ascend [^()]*)\)")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the pages and their code blocks -------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    page: str
    line: str  # the logical line as written (continuations joined)
    words: tuple[str, ...]  # one shell command: no ;, &&, |, & inside


def code_blocks(text: str) -> list[str]:
    """The contents of every fenced code block (a fence indented under a list item included, dedented)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        i += 1
        if not opening:
            continue
        fence, body = opening.group("fence"), []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        blocks.append(textwrap.dedent("\n".join(body)))
    return blocks


def _words(line: str) -> list[str]:
    """``line`` as the shell splits it (operators apart, comments dropped); a line that is not shell (output with an
    apostrophe, a quote left open on another line) split at white space."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError:
        return line.split()


def commands(page: str, text: str) -> list[Command]:
    """Every shell command in the page's code blocks, ``$(slime-ascend ...)`` substitutions as commands of their own."""
    found = []
    for block in code_blocks(text):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            pieces = [m.group(1) for m in SUBSTITUTION.finditer(line)] + [SUBSTITUTION.sub(" SUBSTITUTED ", line)]
            for piece in pieces:
                command: list[str] = []
                for word in [*_words(piece), ";"]:
                    if word in TERMINATORS:
                        if command:
                            found.append(Command(page, line.strip(), tuple(command)))
                        command = []
                    else:
                        command.append(word)
    return found


def all_commands() -> list[Command]:
    return [c for path in PAGES for c in commands(path.relative_to(ROOT).as_posix(), path.read_text())]


def _options(words) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and len(w) > 1 and not re.match(r"-[\d.]", w)]


def slime_ascend_calls(command: Command) -> tuple[str, list[str]] | None:
    """``(subcommand, options)`` of a ``slime-ascend SUBCOMMAND ...`` command (options up to a bare ``--``)."""
    words = command.words
    at = next((i for i, w in enumerate(words) if w == "slime-ascend" or w.endswith("/slime-ascend")), None)
    if at is None or at + 1 >= len(words) or not SUBCOMMAND.fullmatch(words[at + 1]):
        return None  # not a call (e.g. ``slime-ascend demo: plugins ...`` in printed output)
    rest = list(words[at + 2:])
    return words[at + 1], _options(rest[:rest.index("--")] if "--" in rest else rest)


def slime_script_flags(command: Command) -> list[str]:
    """The ``--flags`` given to slime's ``train.py`` / ``train_async.py`` in ``command`` (none when it runs neither)."""
    at = next((i for i, w in enumerate(command.words) if SLIME_SCRIPT.search(w)), None)
    return [] if at is None else [o for o in _options(command.words[at + 1:]) if o.startswith("--")]


# ---- what our command line and slime's know ------------------------------------------------------------------
class _Parsed(BaseException):
    """Raised in place of parsing: the parser was captured."""


def _parser_of(function) -> argparse.ArgumentParser:
    """The parser a subcommand's function builds (captured as it parses, so nothing runs)."""
    captured = []

    def capture(self, args=None, namespace=None):
        captured.append(self)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            function(["--help"])
        except _Parsed:
            pass
    assert captured, f"{function} parsed no arguments when given --help"
    return captured[0]


def cli_options() -> dict[str, set[str]]:
    """``slime-ascend``'s subcommands, each with its option strings, from the parsers the CLI builds."""
    from slime_ascend import cli
    from slime_ascend.plugins.base import resolve

    main = cli.build_parser()
    (sub,) = [a for a in main._actions if isinstance(a, argparse._SubParsersAction)]
    known = {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}
    for name, (path, _) in cli.PASSTHROUGH.items():
        known[name] = set(_parser_of(resolve(path))._option_string_actions)
    return known


SLIME_PARSERS = textwrap.dedent("""
    import argparse, json, sys
    from slime_ascend.compat import typing_override
    typing_override.ensure()
    seen = set()
    original = argparse.ArgumentParser.parse_known_args
    class Done(BaseException):
        pass
    def parse_known_args(self, args=None, namespace=None):
        seen.update(self._option_string_actions)
        if "--actor-num-nodes" in self._option_string_actions:  # Megatron's parser with slime's: the last one
            raise Done
        return original(self, args, namespace)
    argparse.ArgumentParser.parse_known_args = parse_known_args
    sys.argv = ["train.py"]
    from slime.utils.arguments import parse_args
    try:
        parse_args()
    except Done:
        print(json.dumps(sorted(seen)))
""")


@pytest.fixture(scope="module")
def slime_flags() -> set[str]:
    """Every option of every parser slime's ``parse_args`` runs (its phase one, SGLang's, Megatron's with slime's),
    read in a fresh interpreter, plus the options our plugins ask for on slime's command line. (Its one user is marked
    ``slime``: it skips, naming what is missing, where slime's stack is not installed.)"""
    from slime_ascend.plugins import registry

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("SLIME_ASCEND_PLUGINS", None)
    done = subprocess.run([sys.executable, "-c", SLIME_PARSERS], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    known = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"--hf-checkpoint", "--custom-config-path", "--tensor-model-parallel-size", "--sglang-mem-fraction-static",
            "--debug-train-only"} <= known, "slime's parsers were not all read"
    for plugin in registry.available().values():
        for flag in plugin.command_line:
            known.update(w for w in shlex.split(flag.flag) if w.startswith("--"))
    return known


# ---- the tests -----------------------------------------------------------------------------------------------
def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return [p for item in nav for p in _nav_pages(item)]


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries without a page"
    assert len(nav) == len(set(nav)), "a page listed twice in the nav"
    assert config["site_dir"] == "site" and "/site/" in (ROOT / ".gitignore").read_text().splitlines()


def test_generated_pages_equal_what_the_code_gives_now():
    generator = _script("gen_docs")
    stale = [path.relative_to(ROOT).as_posix() for path, text in generator.generated().items()
             if not path.exists() or path.read_text() != text]
    assert stale == [], f"out of date: {stale}. Fix: python scripts/gen_docs.py"


def test_every_plugin_is_documented_on_a_page_of_its_own_with_its_declaration():
    from slime_ascend.plugins import registry

    generator = _script("gen_docs")
    declared = {m.group("name") for p in (DOCS / "plugins").glob("*.md") for m in generator.BLOCK.finditer(p.read_text())}
    assert sorted(set(registry.available()) - declared) == [], "plugins without a declaration block in docs/plugins/"


def test_the_patch_ledger_page_names_every_ledger_entry():
    from slime_ascend.patch import LEDGER

    page = (DOCS / "patch-ledger.md").read_text()
    assert [patch_id for patch_id in LEDGER if f"| `{patch_id}` |" not in page] == []


def test_every_slime_ascend_command_names_a_real_subcommand_and_options():
    known = cli_options()
    calls = [(c, slime_ascend_calls(c)) for c in all_commands()]
    calls = [(c, call) for c, call in calls if call]
    assert len(calls) >= 20, "the extraction found too few slime-ascend commands"
    wrong = [f"{c.page}: {c.line!r}: no subcommand {sub!r}" for c, (sub, _) in calls if sub not in known]
    wrong += [f"{c.page}: {c.line!r}: `slime-ascend {sub}` has no option {opt}"
              for c, (sub, options) in calls if sub in known for opt in options if opt not in known[sub]]
    assert wrong == []


def test_the_command_check_can_fail():
    known = cli_options()
    (bad,) = commands("x.md", "```bash\nslime-ascend config npu --flgas && slime-ascend dryrn -- python train.py\n```")[:1]
    sub, options = slime_ascend_calls(bad)
    assert sub == "config" and "--flgas" in options and "--flgas" not in known["config"]
    calls = commands("x.md", "```bash\npython train.py --lr 1 $(slime-ascend config cpu --flags --tp 2) --bogus\n```")
    assert [slime_ascend_calls(c) for c in calls] == [("config", ["--flags", "--tp"]), None]
    assert slime_script_flags(calls[1]) == ["--lr", "--bogus"]
    printed = commands("x.md", "```\nslime-ascend demo: plugins sao; seed 0\nslime-ascend: error: it's wrong\n```")
    assert [slime_ascend_calls(c) for c in printed] == [None] * len(printed)


@pytest.mark.slime
def test_every_flag_given_to_slimes_train_scripts_is_one_slime_or_a_plugin_knows(slime_flags):
    used = [(c, flag) for c in all_commands() for flag in slime_script_flags(c)]
    assert len(used) >= 30, "the extraction found too few train.py flags"
    assert [f"{c.page}: {flag} in {c.line!r}" for c, flag in used if flag not in slime_flags] == []
    assert "--no-such-slime-flag" not in slime_flags


def test_every_recipe_is_named_on_the_recipes_page():
    recipes = sorted(p.parent.name for p in (ROOT / "examples").glob("*/run.sh"))
    page = (DOCS / "recipes.md").read_text()
    assert recipes, "no examples/*/run.sh found"
    missing = [name for name in recipes if f"examples/{name}" not in page]
    assert missing == [], f"docs/recipes.md does not name the recipe(s) {missing}: add a row `examples/<name>` for each"


def test_readme_stays_an_entry_point():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move reference material to docs/"


def test_quickstart_shows_the_readmes_two_commands_and_a_demo_sample():
    readme_command = _script("readme_command")
    quickstart = (DOCS / "quickstart.md").read_text()
    assert readme_command.commands(quickstart) == readme_command.commands((ROOT / "README.md").read_text())
    assert len(_script("demo_output_sample").shown_on_page(quickstart)) >= 8


def test_mkdocs_build_strict_passes(tmp_path):
    need("mkdocs", "pip install -e '.[docs]'")
    need("material", "pip install -e '.[docs]' (mkdocs-material)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
