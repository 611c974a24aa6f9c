"""quant._source: which HF_DIR files the converter reads (no link out of HF_DIR, no FIFO or device, checked
before opening), and copies never wider than their source."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from slime_ascend.quant._source import check_source, copy_no_wider, open_checked, publish_mode


def _hf(d):
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_text("w")
    return d


def _in_thread(fn, timeout=10.0):
    """fn()'s result or exception; fails when it blocks (a FIFO opened)."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except Exception as exc:  # noqa: BLE001
            out.append(("raised", exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert out, "blocked"
    return out[0]


def test_a_link_out_of_hf_dir_is_refused_naming_the_file_and_the_fix(tmp_path):
    hf = _hf(tmp_path / "hf")
    secret = tmp_path / "secret"
    secret.write_text("token")
    secret.chmod(0o600)
    (hf / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ValueError) as err:
        check_source(str(hf))
    msg = str(err.value)
    assert "\n" not in msg and "tokenizer.json" in msg and str(secret) in msg and "outside HF_DIR" in msg
    assert "Fix: replace the link with a copy" in msg


def test_links_that_stay_inside_are_read_as_their_targets(tmp_path):
    hf = _hf(tmp_path / "hf")
    (hf / "extra").mkdir()
    (hf / "extra" / "tok.json").write_text("tok")
    (hf / "tokenizer.json").symlink_to("extra/tok.json")
    files = check_source(str(hf))
    assert sorted(files) == ["config.json", "model.safetensors", "tokenizer.json"]  # the directory is not read
    assert files["tokenizer.json"].path == str(hf / "extra" / "tok.json")


def test_a_hugging_face_cache_snapshot_may_link_to_its_blobs(tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for name, blob in [("config.json", "c0ffee"), ("model.safetensors", "beef")]:
        (repo / "blobs" / blob).write_text(name)
        (snap / name).symlink_to(f"../../blobs/{blob}")
    assert sorted(check_source(str(snap))) == ["config.json", "model.safetensors"]
    (repo / "blobs" / "evil").symlink_to(tmp_path / "secret")  # a blob that is itself a link out: refused
    (tmp_path / "secret").write_text("s")
    (snap / "tokenizer.json").symlink_to("../../blobs/evil")
    with pytest.raises(ValueError, match="tokenizer.json.*outside HF_DIR"):
        check_source(str(snap))


def test_files_not_read_are_not_checked(tmp_path):
    hf = _hf(tmp_path / "hf")
    (hf / "pytorch_model.bin").symlink_to(tmp_path / "elsewhere.bin")  # other weight formats are never read
    os.mkfifo(hf / "model.safetensors.index.json")  # nor the index
    assert sorted(check_source(str(hf))) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model-00002.safetensors"])
def test_a_fifo_is_refused_without_opening_it(name, tmp_path):
    hf = _hf(tmp_path / "hf")
    if name == "config.json":
        (hf / name).unlink()
    os.mkfifo(hf / name)
    kind, exc = _in_thread(lambda: check_source(str(hf)))
    assert kind == "raised" and isinstance(exc, ValueError)
    assert f"{name}' is a FIFO, not a regular file" in str(exc) and "Fix: remove it" in str(exc)


def test_a_device_is_refused(tmp_path):
    hf = _hf(tmp_path / "hf")
    try:
        os.mknod(hf / "tokenizer.json", 0o644 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    with pytest.raises(ValueError, match="tokenizer.json' is a character device"):
        check_source(str(hf))


def test_a_link_to_a_device_outside_is_refused(tmp_path):
    hf = _hf(tmp_path / "hf")
    (hf / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="link to '/dev/zero', outside HF_DIR"):
        check_source(str(hf))


@pytest.mark.parametrize("src_mode,umask,expected", [(0o600, 0o022, 0o600), (0o640, 0o022, 0o640),
                                                     (0o644, 0o077, 0o600), (0o755, 0o022, 0o644),
                                                     (0o444, 0o022, 0o444)])
def test_a_copy_is_never_wider_than_its_source(src_mode, umask, expected, tmp_path):
    hf = _hf(tmp_path / "hf")
    (hf / "tokenizer.json").write_text("tok")
    (hf / "tokenizer.json").chmod(src_mode)
    source = check_source(str(hf))["tokenizer.json"]
    old = os.umask(umask)
    try:
        copy_no_wider(source, str(tmp_path / "out.json"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out.json").st_mode) == expected
    assert (tmp_path / "out.json").read_text() == "tok"


@pytest.mark.parametrize("source_mode,umask,expected", [(0o640, 0o022, 0o640), (0o644, 0o027, 0o640),
                                                        (0o755, 0o022, 0o644), (0o600, 0o000, 0o600)])
def test_publish_mode_is_a_new_files_mode_masked_by_the_sources(source_mode, umask, expected, tmp_path):
    f = tmp_path / "shard"
    f.write_text("x")
    f.chmod(0o600)  # what safetensors writes, whatever the umask
    old = os.umask(umask)
    try:
        publish_mode(str(f), source_mode)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(f).st_mode) == expected


def test_a_file_swapped_after_the_check_is_not_read(tmp_path):
    hf = _hf(tmp_path / "hf")
    (hf / "tokenizer.json").write_text("tok")
    source = check_source(str(hf))["tokenizer.json"]
    (tmp_path / "secret").write_text("secret")
    (hf / "tokenizer.json").unlink()
    (hf / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(OSError):  # O_NOFOLLOW: the swapped-in link is not followed
        open_checked(source)
    (hf / "tokenizer.json").unlink()
    os.link(tmp_path / "secret", hf / "tokenizer.json")  # another file under the same name
    with pytest.raises(ValueError, match="changed while the checkpoint was being read"):
        open_checked(source)
