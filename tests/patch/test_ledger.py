"""Every ledger entry is a documented, loadable patch whose upstream proposal exists."""

from pathlib import Path

import pytest

from slime_ascend import patch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("patch_id", sorted(patch.LEDGER))
def test_entry_is_documented(patch_id):
    p = patch.get(patch_id)
    assert p.id == patch_id
    assert p.why and p.how and p.targets and p.checked_on
    assert (REPO / p.upstream).is_file(), f"{p.upstream} missing for {patch_id}"
    assert patch_id in patch.__doc__, "the ledger table in slime_ascend/patch/__init__.py must list it"
    module_file = Path(__import__(patch.LEDGER[patch_id], fromlist=["PATCH"]).__file__)
    assert module_file.parent.name == p.process, "patches live in the folder of the process that runs them"


def test_each_patch_file_holds_one_patch():
    files = sorted(patch.LEDGER.values())
    assert len(files) == len(set(files))


def test_unknown_id():
    with pytest.raises(KeyError, match="no runtime patch"):
        patch.get("train.nope")
