"""The native-kernel cache (`quant/native.py`) must not load a library it cannot trust: one planted
by another user, one whose bytes differ from the digest recorded at build time, a truncated one
(which used to SIGBUS every later run), one that does not load. Each is rebuilt or bypassed.

One real build per module (`prebuilt`); the tests that rebuild use `fake_cc`, which copies that
build to the compiler's output instead of compiling (and counts the compiles). The truncated-file
case runs in a fresh interpreter with the real compiler, since before the fix it crashed the process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from conftest import run_python
from slime_ascend.quant import native as N

pytestmark = pytest.mark.skipif(N._compiler() is None, reason="no C compiler: the native kernels are not built here")

OTHER_UID = 54321
PLANTED_C = textwrap.dedent("""
    #include <stdio.h>
    #include <stdlib.h>
    /* what a planted library does: run code at load time, before any symbol is looked up */
    __attribute__((constructor)) static void planted(void) {
        const char *p = getenv("SA_PLANTED_MARKER");
        FILE *f = p ? fopen(p, "w") : NULL;
        if (f) { fputs("planted code ran", f); fclose(f); }
    }
    int sa_abi_version(void) { return 2; }
    int sa_openmp(void) { return 1; }
""")

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid (os.chown)")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """(file name the cache uses, bytes of a real build), built once with the real compiler."""
    d = tmp_path_factory.mktemp("prebuilt")
    mp = pytest.MonkeyPatch()
    mp.setenv(N.CACHE_ENV, str(d))
    try:
        path = N._build(N._compiler())
    finally:
        mp.undo()
    return path.name, path.read_bytes()


@pytest.fixture(scope="module")
def planted_lib(tmp_path_factory):
    """Bytes of a library whose constructor writes $SA_PLANTED_MARKER when it is loaded."""
    d = tmp_path_factory.mktemp("planted")
    (d / "planted.c").write_text(PLANTED_C)
    subprocess.run([*N._compiler().split(), "-shared", "-fPIC", str(d / "planted.c"), "-o", str(d / "planted.so")],
                   check=True, timeout=60)
    return (d / "planted.so").read_bytes()


@pytest.fixture
def fake_cc(monkeypatch, prebuilt):
    """Compiles become a copy of the module's real build; returns the list of outputs written."""
    real_run, outputs = N._run, []

    def run(cmd):
        if "-o" not in cmd:
            return real_run(cmd)  # `cc --version`, part of the cache key
        out = Path(cmd[cmd.index("-o") + 1])
        out.write_bytes(prebuilt[1])
        outputs.append(out)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(N, "_run", run)
    return outputs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache dir (`<tmp>/cache`, its `native/` made) and a fresh private temp dir (`<tmp>/tmp`)."""
    monkeypatch.setenv(N.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("SA_PLANTED_MARKER", str(tmp_path / "PLANTED_CODE_RAN"))
    (tmp_path / "tmp").mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    native = tmp_path / "cache" / "native"
    native.mkdir(parents=True, mode=0o700)
    return native


def _plant(native: Path, name: str, data: bytes, digest: str | None) -> Path:
    lib = native / name
    lib.write_bytes(data)
    if digest is not None:
        (native / (name + ".sha256")).write_text(digest + "\n")
    return lib


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _loaded_path(lib) -> Path:
    return Path(lib._name)


def test_planted_library_in_a_world_writable_cache_dir_is_not_loaded(cache, prebuilt, planted_lib, fake_cc, tmp_path):
    """Anyone could have written that library (and its digest): the cache is not used at all."""
    _plant(cache, prebuilt[0], planted_lib, _sha(planted_lib))
    cache.chmod(0o777)
    with pytest.warns(RuntimeWarning, match=rf"{cache}.*group/world-writable.*chmod go-w"):
        lib = N._load()
    assert not (tmp_path / "PLANTED_CODE_RAN").exists(), "the planted library was loaded"
    assert _loaded_path(lib).parent == tmp_path / "tmp" / f"slime_ascend-{os.getuid()}" / "native"
    assert lib.sa_abi_version() == N.ABI_VERSION and len(fake_cc) == 1


@as_root
def test_planted_library_in_a_cache_dir_owned_by_another_user_is_not_loaded(cache, prebuilt, planted_lib, fake_cc,
                                                                            tmp_path):
    _plant(cache, prebuilt[0], planted_lib, _sha(planted_lib))
    os.chown(cache, OTHER_UID, -1)
    with pytest.warns(RuntimeWarning, match=rf"{cache}.*owned by uid {OTHER_UID}"):
        lib = N._load()
    assert not (tmp_path / "PLANTED_CODE_RAN").exists(), "the planted library was loaded"
    assert cache not in _loaded_path(lib).parents and len(fake_cc) == 1


@as_root
def test_planted_library_file_owned_by_another_user_is_rebuilt(cache, prebuilt, planted_lib, fake_cc, tmp_path):
    """The directory is ours, the file (and its matching digest) is not: rebuilt over, never loaded."""
    lib_path = _plant(cache, prebuilt[0], planted_lib, _sha(planted_lib))
    os.chown(lib_path, OTHER_UID, -1)
    with pytest.warns(RuntimeWarning, match=rf"{lib_path}.*owned by uid {OTHER_UID}.*rebuilding"):
        lib = N._load()
    assert not (tmp_path / "PLANTED_CODE_RAN").exists(), "the planted library was loaded"
    assert _loaded_path(lib) == lib_path and lib_path.stat().st_uid == os.getuid() and len(fake_cc) == 1


@pytest.mark.parametrize("digest", ["0" * 64, None], ids=["wrong-digest", "no-digest"])
def test_library_not_matching_its_recorded_digest_is_rebuilt_not_loaded(cache, prebuilt, planted_lib, fake_cc,
                                                                         tmp_path, digest):
    lib_path = _plant(cache, prebuilt[0], planted_lib, digest)
    if digest is None:
        lib = N._load()  # no record (a cache from before digests): rebuilt quietly
    else:
        with pytest.warns(RuntimeWarning, match=rf"{lib_path}.*sha256.*rebuilding"):
            lib = N._load()
    assert not (tmp_path / "PLANTED_CODE_RAN").exists(), "a library not matching its digest was loaded"
    assert len(fake_cc) == 1 and _loaded_path(lib) == lib_path
    assert lib_path.read_bytes() == prebuilt[1]
    assert (cache / (prebuilt[0] + ".sha256")).read_text().strip() == _sha(prebuilt[1])


def test_library_that_fails_to_load_is_rebuilt(cache, prebuilt, fake_cc):
    """Bytes that match their digest but are not a library (a damaged build): dlopen fails, one rebuild."""
    junk = b"not an ELF file" * 100
    lib_path = _plant(cache, prebuilt[0], junk, _sha(junk))
    with pytest.warns(RuntimeWarning, match=rf"{lib_path}.*failed to load.*rebuilding"):
        lib = N._load()
    assert lib.sa_abi_version() == N.ABI_VERSION and len(fake_cc) == 1 and lib_path.read_bytes() == prebuilt[1]


def test_truncated_library_is_rebuilt_not_loaded(tmp_path):
    """A build cut short (disk full, killed copy) used to SIGBUS every later run at dlopen. In a fresh
    interpreter, with the real compiler: the digest check catches it before dlopen, and it is rebuilt."""
    env = {N.CACHE_ENV: str(tmp_path / "cache")}
    code = ("from slime_ascend.quant import native as N\n"
            "assert N.available(), N.unavailable_reason()\nprint(N._lib._name)")
    first = run_python(code, env, timeout=180)
    assert first.returncode == 0, first.stderr[-2000:]
    lib_path = Path(first.stdout.strip())
    full = lib_path.read_bytes()
    with open(lib_path, "r+b") as f:
        f.truncate(len(full) // 2)
    second = run_python(code, env, timeout=180)
    assert second.returncode == 0, f"rc {second.returncode} (-7 is SIGBUS): {second.stderr[-2000:]}"
    assert Path(second.stdout.strip()) == lib_path and lib_path.read_bytes() == full
    assert "rebuilding" in second.stderr


@pytest.mark.parametrize("where", ["cache-dir", "ancestor"])
def test_group_writable_cache_dir_falls_back_to_the_private_temp_dir(cache, tmp_path, where):
    """The cache dir, or a directory above it without the sticky bit, writable by others: the private
    per-user temp dir is used, with one warning naming the directory, why, and the fix."""
    bad = cache if where == "cache-dir" else tmp_path / "cache"
    bad.chmod(0o770)
    with pytest.warns(RuntimeWarning, match=rf"{bad}.*group/world-writable.*{tmp_path / 'tmp'}"):
        got = N._writable_dir()
    assert got == tmp_path / "tmp" / f"slime_ascend-{os.getuid()}" / "native"
    assert not os.stat(got).st_mode & 0o077
    if where == "ancestor":
        bad.chmod(0o1777)  # sticky, like /tmp: others cannot rename or remove our entries
        assert N._writable_dir() == cache


def test_private_temp_dir_that_is_not_private_is_an_error(cache, tmp_path):
    cache.chmod(0o777)
    shared = tmp_path / "tmp" / f"slime_ascend-{os.getuid()}"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)  # as if another user had made it for us
    with pytest.raises(RuntimeError, match=rf"{cache}.*group/world-writable.*{shared}.*group/world-writable.*"
                                           rf"{N.CACHE_ENV}"):
        N._writable_dir()


def test_cache_dirs_are_created_private_under_a_permissive_umask(tmp_path, monkeypatch):
    """Under umask 002 a plain mkdir would make the cache group-writable, and every run would then
    fall back: the directories the cache creates are 0700."""
    monkeypatch.setenv(N.CACHE_ENV, str(tmp_path / "a" / "b"))
    old = os.umask(0o002)
    try:
        got = N._writable_dir()
    finally:
        os.umask(old)
    assert got == tmp_path / "a" / "b" / "native"
    for d in (tmp_path / "a", tmp_path / "a" / "b", got):
        assert d.stat().st_mode & 0o777 == 0o700, d
    shutil.rmtree(tmp_path / "a")
