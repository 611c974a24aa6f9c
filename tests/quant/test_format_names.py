"""The converter's formats have one list, ``quant.names.FORMATS``: what ``slime-ascend --help``, ``slime-ascend
quantize --help`` and a wrong ``--format`` print comes from it, and no text in the package, the recipes, the scripts,
the benchmarks or the docs lists the converter's formats by hand with one missing (``mxfp8`` once was)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slime_ascend import cli
from slime_ascend.quant.cli import _quantize_parser, main_quantize
from slime_ascend.quant.names import FORMATS

REPO = Path(__file__).resolve().parents[2]
# where the converter is described
SCANNED = ("slime_ascend", "examples", "scripts", "benchmarks", "docs", "README.md")
# a line about the converter: its command, or its --format option (not --sync-format, --qat-format, ...)
CONVERTER = re.compile(r"slime-ascend quantize|(?<![\w-])--format\b")


def _named(line: str) -> list[str]:
    return [f for f in FORMATS if re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", line)]


def test_the_help_texts_list_every_format(capsys):
    top = cli.build_parser()
    subs = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction")
    one_line = next(c.help for c in subs._choices_actions if c.dest == "quantize")
    assert one_line.endswith("--format " + "|".join(FORMATS))
    option = next(a for a in _quantize_parser()._actions if "--format" in a.option_strings)
    assert option.help == f"one of: {', '.join(FORMATS)}"


def test_a_wrong_format_names_every_format(tmp_path, capsys):
    assert main_quantize([str(tmp_path), str(tmp_path / "out"), "--format", "fp4"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: --format 'fp4' is not supported. Fix: use one of {', '.join(FORMATS)}"


def _converter_lists(text: str) -> list[tuple[int, list[str]]]:
    """(line number, the formats it names) of each line about the converter that names two or more."""
    return [(i, named) for i, line in enumerate(text.splitlines(), 1)
            if CONVERTER.search(line) and len(named := _named(line)) >= 2]


def test_no_text_lists_the_converter_formats_with_one_missing():
    stale = []
    for root in SCANNED:
        for path in [REPO / root] if (REPO / root).is_file() else sorted((REPO / root).rglob("*")):
            if path.suffix not in (".py", ".md", ".sh", ".yaml", ".txt") or not path.is_file():
                continue
            for line, named in _converter_lists(path.read_text(errors="replace")):
                if set(named) != set(FORMATS):
                    stale.append(f"{path.relative_to(REPO)}:{line}: lists {named}, missing "
                                 f"{sorted(set(FORMATS) - set(named))} (take the list from quant.names.FORMATS)")
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("line", [
    "| `slime-ascend quantize HF_DIR OUT_DIR --format F` | offline converter (`fp8-block`, `int8-w8a8`, `int8-ct`, "
    "`int4-group`) |",
    "    slime-ascend quantize HF_DIR OUT_DIR --format {fp8-block,int8-w8a8,int8-ct,int4-group} [--force]",
])
def test_the_scan_finds_a_list_with_a_format_missing(line):
    """The README's command table and the converter's docstring as they were before mxfp8 was listed."""
    [(_, named)] = _converter_lists(line)
    assert set(FORMATS) - set(named) == {"mxfp8"}
    assert _converter_lists("[--sync-format none|fp8-block|int8-w8a8|int4-group]") == []  # the memory ledger's own
