#!/usr/bin/env python
"""Print one of the README's "Two commands" exactly as written (``python scripts/readme_command.py 1``).

``.ci/run`` runs command 1 this way in its fresh venv before anything else is installed, so the README's first
contact is what CI checks, not a copy of it; ``tests/test_readme_commands.py`` checks the block's shape.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(readme: str) -> list[str]:
    """The command lines of the first bash block under '## Two commands', comments dropped."""
    section = readme.split("## Two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    if block is None:
        raise SystemExit("README.md: no ```bash block under '## Two commands'")
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def main(argv: list[str]) -> int:
    found = commands(README.read_text())
    if len(argv) != 1 or argv[0] not in {str(i + 1) for i in range(len(found))}:
        print(f"usage: readme_command.py N (1..{len(found)})", file=sys.stderr)
        return 2
    print(found[int(argv[0]) - 1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
