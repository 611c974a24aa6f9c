"""The Layout on the Contributing page (docs/contributing.md) names every module of the package, so it answers
"where does a change to X go"."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layout() -> str:
    page = (ROOT / "docs" / "contributing.md").read_text()
    start = page.index("## Layout")
    end = page.find("\n## ", start + 1)
    return page[start:] if end < 0 else page[start:end]


def test_layout_names_every_module():
    layout = _layout()
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "slime_ascend").rglob("*.py")
                     if p.name != "__init__.py")
    missing = [m for m in modules if not re.search(rf"\b{re.escape(Path(m).stem)}\b", layout)]
    assert not missing, f"the Layout in docs/contributing.md does not name: {missing}"


def test_layout_names_every_package_folder():
    layout = _layout()
    folders = sorted({p.parent.relative_to(ROOT / "slime_ascend").parts[0]
                      for p in (ROOT / "slime_ascend").rglob("*.py") if p.parent != ROOT / "slime_ascend"})
    assert [f for f in folders if f"{f}/" not in layout] == []
