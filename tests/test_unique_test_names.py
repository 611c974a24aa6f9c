"""pytest imports test modules by basename (rootdir-relative, no packages): two test files with one name
in different folders stop the whole collection ("import file mismatch")."""

from collections import Counter
from pathlib import Path


def test_every_test_module_name_is_unique():
    names = Counter(p.name for p in Path(__file__).parent.rglob("*.py"))
    assert [n for n, c in names.items() if c > 1 and n not in ("__init__.py", "conftest.py")] == []
