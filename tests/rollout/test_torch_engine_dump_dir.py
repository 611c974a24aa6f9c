"""The directories the torch engine writes into on a user's word (torch_engine/dump_dir.py): ``serve-torch
--dump-dsa-index-sets DIR`` and ``--keep-received-weights DIR``. A link planted under a file's name is never
written through, a directory another user owns or anyone may write (without the sticky bit) is refused at start in
one line, and a full disk under the DSA dump stops the dumping with one warning while ``/generate`` goes on."""

from __future__ import annotations

import errno
import logging
import os
import stat

import httpx
import pytest
import torch

from slime_ascend.rollout.torch_engine import dump_dir
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model

HTTP = httpx.Client(trust_env=False, timeout=120)
PROMPT = [5, 17, 300, 42, 99, 1000, 44, 7, 7, 512, 3, 80]
GENERATE = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory):
    return save_model(load_model(None, glm5=True, seed=1), tmp_path_factory.mktemp("glm5") / "m")


def _foreign_dir(tmp_path):
    """A directory owned by another user: made and given away when this test runs as root, else ``/``."""
    if os.geteuid() != 0:
        return "/"
    path = tmp_path / "foreign"
    path.mkdir()
    os.chown(path, 65534, 65534)
    return str(path)


def test_a_link_planted_in_the_dump_dir_is_not_written_through(glm5_dir, tmp_path):
    """Before the fix the engine's ``torch.save`` followed a link named like its next record and overwrote the
    link's target with the record."""
    dump = tmp_path / "sets"
    dump.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = dump / f"rollout-{os.getpid()}-000000.pt"
    planted.symlink_to(victim)
    engine = TorchEngine(str(glm5_dir), dump_dsa_index_sets=dump)
    engine.generate(dict(GENERATE))
    assert victim.read_text() == "precious"
    assert planted.is_symlink() and os.readlink(planted) == str(victim)  # left alone: not ours
    written = dump / f"rollout-{os.getpid()}-000001.pt"  # the record took the next name, private to this user
    assert stat.S_IMODE(written.lstat().st_mode) == 0o600
    record = torch.load(written, weights_only=True)
    assert record["tokens"][: len(PROMPT)] == PROMPT


@pytest.mark.parametrize("flag", ["--dump-dsa-index-sets", "--keep-received-weights"])
def test_a_world_writable_or_foreign_dump_dir_is_refused_in_one_line(tmp_path, flag):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: others may create files, never rename or remove ours

    def start(path):
        if flag == "--dump-dsa-index-sets":
            return TorchEngine(None, dump_dsa_index_sets=path)  # refused before the model loads
        return TorchEngine(None).configure_weight_group(keep_dir=str(path))

    for bad, words in ((shared, "world-writable without the sticky bit"), (_foreign_dir(tmp_path), "owned by uid")):
        with pytest.raises(ValueError) as info:
            start(bad)
        message = str(info.value)
        assert message.startswith(f"{flag} ") and words in message and "Fix:" in message and "\n" not in message
    assert dump_dir.check_dump_dir(sticky, flag) == sticky
    made = dump_dir.check_dump_dir(tmp_path / "new" / "deeper", flag)  # made private, each level it creates
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and stat.S_IMODE(made.parent.stat().st_mode) == 0o700


def test_kept_versions_never_write_through_a_planted_link(tmp_path):
    """``--keep-received-weights``: the file is renamed over a planted link (the link replaced, its target
    untouched) and a link planted as the version's directory is refused."""
    keep = dump_dir.check_dump_dir(tmp_path / "kept", "--keep-received-weights")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    sub = dump_dir.private_subdir(keep, "weight_v000001")
    (sub / "model.safetensors").symlink_to(victim)
    dump_dir.replace_file(sub, "model.safetensors", lambda f: f.write(b"new"))
    assert victim.read_text() == "precious" and (sub / "model.safetensors").read_bytes() == b"new"
    assert not (sub / "model.safetensors").is_symlink() and os.listdir(sub) == ["model.safetensors"]
    (keep / "weight_v000002").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        dump_dir.private_subdir(keep, "weight_v000002")
    with pytest.raises(FileExistsError):
        dump_dir.create_file(sub, "model.safetensors")


def test_a_full_dump_disk_stops_dumping_with_one_warning_and_generation_goes_on(glm5_dir, tmp_path, monkeypatch,
                                                                               caplog):
    """Before the fix the failed write (a C++ enforce from torch.save's writer, or this OSError) was the answer
    to ``/generate``: HTTP 500."""
    engine = TorchEngine(str(glm5_dir), dump_dsa_index_sets=tmp_path / "sets")
    calls = []

    def disk_full(obj, f, *args, **kwargs):
        calls.append(f)
        if not isinstance(f, str | os.PathLike):
            f.write(b"PK partial")  # some bytes made it before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with caplog.at_level(logging.WARNING, logger="slime_ascend.rollout.engine"), engine.start_in_thread() as url:
        first = HTTP.post(f"{url}/generate", json=GENERATE)
        second = HTTP.post(f"{url}/generate", json=GENERATE)
    assert first.status_code == 200 and second.status_code == 200, first.text
    assert first.json()["output_ids"] == second.json()["output_ids"] and len(first.json()["output_ids"]) == 3
    assert len(calls) == 1  # dumping stopped after the failure
    warnings = [r.getMessage() for r in caplog.records if "dump-dsa-index-sets" in r.getMessage()]
    assert len(warnings) == 1 and "dumping stops, generation goes on" in warnings[0] and "No space left" in warnings[0]
    assert list((tmp_path / "sets").iterdir()) == []  # the partial record removed: the engine created it
