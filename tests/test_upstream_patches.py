"""The upstream patch series in ``patches/``: each patch is documented in ``patches/README.md``
(naming the runtime patch it retires) and applies to the importable slime with ``git apply``."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import skip_outside_ci
from slime_ascend.patch import LEDGER, get

REPO = Path(__file__).resolve().parents[1]
PATCH_DIR = REPO / "patches"
README = PATCH_DIR / "README.md"
PATCHES = sorted(PATCH_DIR.glob("*.patch"))

LEDGER_ID = re.compile(r"`((?:driver|train|rollout|engine)\.[a-z0-9_]+)`")
DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
PLAIN_HEADER = re.compile(r"^\+\+\+ b/(\S+)", re.MULTILINE)


def readme_sections() -> dict[str, str]:
    """``## <heading>`` -> the text up to the next such heading."""
    sections: dict[str, str] = {}
    heading = None
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            sections[heading] = ""
        elif heading is not None:
            sections[heading] += line + "\n"
    return sections


def touched_paths(patch: Path) -> list[str]:
    text = patch.read_text()
    paths = [b for _, b in DIFF_HEADER.findall(text)] or PLAIN_HEADER.findall(text)
    return sorted(set(paths))


def slime_root() -> Path:
    spec = importlib.util.find_spec("slime")
    assert spec is not None and spec.submodule_search_locations, "slime is not importable"
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def source_checkout() -> Path:
    """The importable slime's source tree, which the patches are written against."""
    root = slime_root()
    if not (root / "setup.py").is_file():
        skip_outside_ci(f"the importable slime at {root} is not a source checkout (no setup.py): put slime's "
                        "source tree on PYTHONPATH")
    return root


def git_apply(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        skip_outside_ci("git is not installed (git apply checks the patches)")
    # Inside an enclosing repository git apply resolves paths from its top level and silently
    # skips files outside cwd; stop repository discovery above the slime root.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent))
    return subprocess.run(["git", "apply", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_series_exists():
    assert PATCHES, f"no .patch files in {PATCH_DIR}"
    assert README.is_file(), f"{README} is missing"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_is_a_unified_diff_with_prefixes(patch: Path):
    text = patch.read_text()
    assert touched_paths(patch), f"{patch.name} has no 'diff --git a/... b/...' or '+++ b/...' headers"
    assert "\n@@ " in text, f"{patch.name} has no hunks"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_readme_entry_names_patch_ledger_id_and_version(patch: Path):
    sections = readme_sections()
    assert patch.name in sections, f"patches/README.md has no '## {patch.name}' entry"
    entry = sections[patch.name]
    ids = LEDGER_ID.findall(entry)
    assert ids, f"the README entry of {patch.name} names no runtime patch id (e.g. `train.fc1_gather_layout`)"
    assert "Retires" in entry, f"the README entry of {patch.name} does not say what it retires"
    assert "Applies to" in entry and "0.3.1" in entry, f"the README entry of {patch.name} names no slime version"


def test_ledger_entries_pointing_at_a_patch_are_named_in_its_entry():
    sections = readme_sections()
    checked = 0
    for patch_id in LEDGER:
        upstream = Path(get(patch_id).upstream).name
        if not (PATCH_DIR / upstream).is_file():
            continue  # proposal not written yet
        checked += 1
        assert upstream in sections, f"{patch_id} is retired by {upstream}, which has no README entry"
        assert f"`{patch_id}`" in sections[upstream], f"the README entry of {upstream} does not name `{patch_id}`"
    assert checked, "no ledger entry points at an existing patch"


@pytest.mark.slime
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_applies_to_importable_slime(patch: Path):
    root = source_checkout()
    result = git_apply(["--check", "--verbose", str(patch)], cwd=root)
    assert result.returncode == 0, f"{patch.name} does not apply to {root}:\n{result.stderr}"
    checked = set(re.findall(r"^Checking patch (\S+?)\.\.\.$", result.stderr + result.stdout, re.MULTILINE))
    missing = set(touched_paths(patch)) - checked
    assert not missing, f"git apply did not examine {sorted(missing)} of {patch.name}"


@pytest.mark.slime
def test_series_applies_in_order(tmp_path: Path):
    root = source_checkout()
    for path in sorted({p for patch in PATCHES for p in touched_paths(patch)}):
        if (root / path).is_file():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / path, tmp_path / path)
    for patch in PATCHES:
        result = git_apply([str(patch)], cwd=tmp_path)
        assert result.returncode == 0, f"{patch.name} does not apply after the patches before it:\n{result.stderr}"
