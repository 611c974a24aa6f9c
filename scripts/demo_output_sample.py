#!/usr/bin/env python
"""Regenerate the Quick start page's sample output of ``slime-ascend demo`` from a real run.

    python scripts/demo_output_sample.py            # run the demo (defaults), rewrite the page's block
    python scripts/demo_output_sample.py --from LOG # rewrite it from a saved demo output instead

The block sits between ``<!-- demo-output:start -->`` and ``<!-- demo-output:end -->`` in docs/quickstart.md. It
keeps the demo's own lines: the set-up lines, the first, middle and last step, the contract verdict, what
each plugin showed and the closing summary. ``tests/demo/test_demo_e2e.py`` checks that every line shown has the shape of a
line the demo prints today.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"
START, END = "<!-- demo-output:start -->", "<!-- demo-output:end -->"
STEP = re.compile(r"^step +(\d+)/(\d+) \|")


def select(lines: list[str]) -> list[str]:
    """The lines the page shows, in the demo's order."""
    lines = [line.rstrip() for line in lines if line.strip()]
    steps = [line for line in lines if STEP.match(line)]
    out = [line for line in lines
           if line.startswith(("slime-ascend demo:", "prepared ", "ray:", "verifier gate:", "engines:"))][:5]
    if steps:
        total = int(STEP.match(steps[-1]).group(2))
        wanted = {1, (total + 1) // 2, total}
        out += [line for line in steps if int(STEP.match(line).group(1)) in wanted]
    out.append("...")
    out += [line for line in lines if line.startswith(("ALL PASS", "FAIL"))][-1:]
    if "what each plugin showed:" in lines:  # the closing lines, one per plugin
        at = lines.index("what each plugin showed:")
        out += [lines[at]] + [line for line in lines[at + 1:] if line.startswith("  ")]
    out += [line for line in lines if line.startswith("reward ") and " -> " in line][-1:]
    out += [line for line in lines if line.startswith("wrote ")][-1:]
    return out


def shape(line: str) -> str:
    """A line with its numbers and paths masked: what must not drift."""
    line = re.sub(r"(?<=output )\S+$", "PATH", line)  # the output directory, however it was named
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"[\w.\-]*/[\w./\-:]*", "PATH", line))


def rewrite(page: str, shown: list[str]) -> str:
    if START not in page or END not in page:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no {START} ... {END} block")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n```\n" + "\n".join(shown) + f"\n```\n{END}\n\n" + tail.lstrip("\n")


def shown_on_page(page: str) -> list[str]:
    block = page.split(START, 1)[1].split(END, 1)[0]
    return [line for line in block.strip().strip("`").strip().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--from", dest="source", type=Path, help="a saved demo output (stdout) to use")
    args = parser.parse_args(argv)
    if args.source:
        text = args.source.read_text()
    else:
        with tempfile.TemporaryDirectory() as cwd:  # the Quick start's own command: --out demo-out
            t0 = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "demo", "--out", "demo-out"],
                                  capture_output=True, text=True, cwd=cwd)
            print(f"demo: exit {done.returncode} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            if done.returncode != 0:
                print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            text = done.stdout
    shown = select(text.splitlines())
    PAGE.write_text(rewrite(PAGE.read_text(), shown))
    print("\n".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
