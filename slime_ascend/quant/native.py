"""Native CPU kernels for the quantisers' bulk passes (`native_kernels.c`), built on first use.

The eager torch path makes several memory passes per weight (fp32 staging, |max|, divide,
clamp, cast) and torch's fp32 -> e4m3fn cast is scalar code on CPU. These kernels do the
|max| pass and the divide/round/clamp/cast pass each in one vectorised sweep over the bf16 /
fp16 / fp32 weight, on torch's own OpenMP thread pool. INT scales are computed by the eager code
on the reduced |max| (one formula, with its dtype rounding rules); the FP8 kernel is one pass
that also applies FP8's scale rule, max(amax, floor) / fmax in fp32, which `fp8_block._scale_of`
states for the eager path (the self-check and the tests hold the two to the same bits).

Build: the system C compiler (`$CC`, else `cc`) with OpenMP, `-O3 -ffp-contract=off` (no
contraction: results must equal torch's IEEE ops) and `-march=native` when the compiler takes
it. The shared object is cached under `$SLIME_ASCEND_CACHE_DIR` (default
`$XDG_CACHE_HOME/slime_ascend` or `~/.cache/slime_ascend`), keyed by the source, the
compiler, the flags and the host CPU, and written atomically (concurrent builders are safe).

Trust (the cache supplies code we load, so a library planted there would run in this process):
- the directory holding the libraries (`<cache>/native`) must be owned by this user and not
  group/world-writable; every directory above it up to `/` (on the path as given and with symlinks
  resolved) owned by this user or root, and not group/world-writable unless sticky (like /tmp,
  where others cannot rename or remove our entries): ssh's StrictModes rule. The directories the
  cache creates are 0700. Otherwise the private per-user temporary directory is used (with one
  warning naming the directory, why, and the fix), and it must pass the same check.
- each library has its sha256 recorded next to it (`<name>.so.sha256`, written atomically); the
  library and the record must be regular files owned by this user and not group/world-writable,
  and the library's bytes must match the record before it is loaded. Otherwise (a planted, stale,
  damaged or truncated file: dlopen of a truncated library can SIGBUS) it is rebuilt, not loaded;
  a library that still fails to load is rebuilt once. The digest catches damage; keeping others
  out is the directory check's job (whoever can write the library can write its record).

`auto`'s timed choice between these kernels and eager (`fused.faster_than_eager`) is stored beside
the library it was timed with, as `<name>.so.auto.json` (data, not code; read only when it passes
the same file check, and a damaged or foreign record is ignored and the choice timed again).

Any failure (no compiler, no OpenMP, a load error) makes `available()` False with the reason
in `unavailable_reason()`; the callers then use the eager path. The callers also self-check
a build bit for bit against the eager path before trusting it (see `fused.verified`).

Only CPU tensors whose last dim is contiguous are accepted; the functions raise ValueError
otherwise (the callers only pass such views).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_kernels.c")
ABI_VERSION = 3
CACHE_ENV = "SLIME_ASCEND_CACHE_DIR"
_BASE_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8_MAX_SUPPORTED = 448.0  # the kernel's e4m3 rounding covers |y| <= 448 (e4m3fn's max)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None  # the loaded library (auto's timed choices are stored beside it)
_reason: str | None = None  # why the kernels are unavailable (None: not tried yet, or loaded)
_tried = False

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "sa_abi_version": ([], _int),
    "sa_openmp": ([], _int),
    "sa_group_absmax": ([_ptr, _int, _i64, _i64, _i64, _i64, _ptr, _i64, _int], None),
    "sa_fp8_block_quantize": ([_ptr, _int, _i64, _i64, _i64, _i64, _i64, _float, _float, _ptr, _i64, _ptr, _i64, _int],
                              _int),
    "sa_int_quantize": ([_ptr, _int, _i64, _i64, _i64, _ptr, _i64, _i64, _int, _float, _float, _ptr, _i64, _int],
                        None),
}


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slime_ascend"


def _host_cpu() -> str:
    """What -march=native depends on: the CPU model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo") as f:
            keep = [ln for ln in f if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


def _mkdir_private(d: Path) -> None:
    """`mkdir -p` with 0700 for every directory it creates (a umask of 002 must not make the cache
    group-writable, which the trust check would then refuse on every run)."""
    try:
        d.mkdir(mode=0o700, exist_ok=True)
    except FileNotFoundError:
        if d.parent == d:
            raise
        _mkdir_private(d.parent)
        d.mkdir(mode=0o700, exist_ok=True)


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & 0o022)


def _untrusted_dir(d: Path) -> str | None:
    """Why `d` must not hold code we load (see the module docstring), or None."""
    uid = os.getuid()
    try:
        st = os.stat(d)
        if st.st_uid != uid:
            return f"{d} is owned by uid {st.st_uid}, not by this user (uid {uid})"
        if _writable_by_others(st):
            return f"{d} is group/world-writable (mode {stat.S_IMODE(st.st_mode):o}; fix: chmod go-w {d})"
        seen = set()
        for path in (Path(os.path.abspath(d)), d.resolve()):
            for up in path.parents:
                if up in seen:
                    continue
                seen.add(up)
                st = os.stat(up)
                if st.st_uid not in (uid, 0):
                    return f"{up} (above {d}) is owned by uid {st.st_uid}, neither this user (uid {uid}) nor root"
                if _writable_by_others(st) and not st.st_mode & stat.S_ISVTX:
                    return (f"{up} (above {d}) is group/world-writable without the sticky bit "
                            f"(mode {stat.S_IMODE(st.st_mode):o}; fix: chmod go-w {up})")
    except OSError as e:
        return f"cannot check {e.filename}: {e.strerror}"
    return None


def _untrusted_file(p: Path) -> str | None:
    """Why the file `p` (in a trusted directory) must not be used, or None."""
    st = os.lstat(p)
    if not stat.S_ISREG(st.st_mode):
        return f"{p} is not a regular file"
    if st.st_uid != os.getuid():
        return f"{p} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if _writable_by_others(st):
        return f"{p} is group/world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _writable_dir() -> Path:
    """`cache_dir()/native` when it can be written and trusted, else a private per-user temporary
    directory (owned by this user and writable by nobody else: a shared /tmp must not supply the
    code we load), with one warning saying why."""
    d = cache_dir() / "native"
    try:
        _mkdir_private(d)
        why = _untrusted_dir(d) or (None if os.access(d, os.W_OK) else f"{d} is not writable by this user")
    except OSError as e:
        why = f"{d} cannot be created ({e.strerror or e})"
    if why is None:
        return d
    private = Path(tempfile.gettempdir()) / f"slime_ascend-{os.getuid()}"
    try:
        private.mkdir(mode=0o700, exist_ok=True)
        private_why = _untrusted_dir(private)
        if private_why is None:
            (private / "native").mkdir(mode=0o700, exist_ok=True)
            private_why = _untrusted_dir(private / "native")
    except OSError as e:
        private_why = f"{private} cannot be created ({e.strerror or e})"
    if private_why is None:
        warnings.warn(f"slime_ascend.quant: native kernel cache {d} not used: {why}; building in {private / 'native'} "
                      f"instead (or set {CACHE_ENV} to a directory of your own)", RuntimeWarning, stacklevel=3)
        return private / "native"
    raise RuntimeError(f"no trusted writable directory for the compiled kernels ({why}; {private_why}); set "
                       f"{CACHE_ENV} to a directory owned by you and writable by nobody else")


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _unusable(lib: Path) -> str | None:
    """Why the cached `lib` must not be loaded, or None; "" when it is simply not there yet (or has no
    recorded digest: a cache from before digests)."""
    record = _digest_path(lib)
    if not os.path.lexists(lib) or not os.path.lexists(record):
        return ""
    try:
        why = _untrusted_file(lib) or _untrusted_file(record)
        if why:
            return why
        with open(record) as f:
            recorded = f.read(200).strip()
        if recorded != _sha256(lib):
            return f"{lib} does not match its recorded sha256 ({record})"
    except OSError as e:
        return f"cannot check {e.filename}: {e.strerror}"
    return None


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc.split()[0]) and cc


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _build(cc: str, rebuild: bool = False) -> Path:
    """The cached library for `cc` (verified against its recorded digest), built when it is missing,
    untrusted or does not match; `rebuild`: build it even when it verifies."""
    source = SOURCE.read_bytes()
    version = _run([*cc.split(), "--version"]).stdout.splitlines()[:1]
    directory = _writable_dir()
    errors = []
    for extra in (["-march=native"], []):
        flags = _BASE_FLAGS + extra
        key = hashlib.sha256(repr((source, cc, version, flags, _host_cpu(), ABI_VERSION)).encode()).hexdigest()[:20]
        target = directory / f"quant_kernels_{key}.so"
        if not rebuild:
            why = _unusable(target)
            if why is None:
                return target
            if why:
                warnings.warn(f"slime_ascend.quant: {why}; rebuilding it", RuntimeWarning, stacklevel=3)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            res = _run([*cc.split(), *flags, str(SOURCE), "-o", tmp])
            if res.returncode == 0:
                os.chmod(tmp, 0o755)  # the linker may have made it group-writable (umask 002)
                digest = _sha256(Path(tmp))
                os.replace(tmp, target)  # atomic: a concurrent builder's identical file is fine too
                _write_atomic(_digest_path(target), digest + "\n")
                return target
            errors.append(f"{' '.join(flags)}: {res.stderr.strip()[-400:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("could not compile " + SOURCE.name + ": " + " | ".join(errors))


def _load() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found (set CC, or install gcc/clang); looked for {os.environ.get('CC', 'cc')!r}")
    path = _build(cc)
    try:
        return _open(path)
    except (OSError, RuntimeError, AttributeError) as e:
        warnings.warn(f"slime_ascend.quant: {path} failed to load ({e}); rebuilding it", RuntimeWarning, stacklevel=2)
    return _open(_build(cc, rebuild=True))


def _open(path: Path) -> ctypes.CDLL:
    global _lib_path
    lib = ctypes.CDLL(str(path))  # after `import torch`: its libgomp (same soname) serves OpenMP
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    if lib.sa_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.sa_abi_version()} != {ABI_VERSION}")
    if not lib.sa_openmp():
        raise RuntimeError(f"{path}: built without OpenMP (single-threaded kernels would be slower than eager)")
    _lib_path = path
    return lib


def available() -> bool:
    """Build (or find in the cache) and load the kernels once per process."""
    global _lib, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _load()
            # Warning: a cache warning turned into an error (-W error) makes the kernels unavailable, with it as reason
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError, Warning) as e:
                _lib, _reason = None, f"{type(e).__name__}: {e}"
        return _lib is not None


def unavailable_reason() -> str | None:
    return _reason


def _choices_path() -> Path | None:
    return None if _lib_path is None else _lib_path.with_name(_lib_path.name + ".auto.json")


def _read_choices(p: Path) -> dict:
    try:
        if not os.path.lexists(p) or _untrusted_file(p):
            return {}
        with open(p) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def stored_choice(key: str) -> bool | None:
    """`fused.faster_than_eager`'s stored choice for `key` with the loaded library (which is keyed by
    the source, compiler, flags and host CPU): True native, False eager, None not stored (or the
    record is missing, damaged or not this user's own)."""
    p = _choices_path()
    entry = _read_choices(p).get(key) if p is not None else None
    choice = entry.get("native") if isinstance(entry, dict) else None
    return choice if isinstance(choice, bool) else None


def store_choice(key: str, native: bool, detail: dict) -> None:
    """Record `key`'s choice beside the loaded library (atomic replace; best effort: on any error the
    choice is simply timed again by the next process)."""
    p = _choices_path()
    if p is None:
        return
    with _lock:
        try:
            data = _read_choices(p)
            data[key] = {"native": bool(native), **detail}
            _write_atomic(p, json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError:
            pass


def _reset_for_tests() -> None:
    global _lib, _lib_path, _reason, _tried
    with _lock:
        _lib, _lib_path, _reason, _tried = None, None, None, False


def supports(weight: torch.Tensor) -> bool:
    """A CPU weight of a dtype the kernels read (bf16 / fp16 / fp32)."""
    return weight.device.type == "cpu" and weight.dtype in _DTYPES


def _lib_or_raise() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"native quantisation kernels unavailable: {_reason}")
    return _lib


def _check_2d(x: torch.Tensor, what: str) -> tuple[int, int, int]:
    if x.dim() != 2 or x.device.type != "cpu" or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{what}: expected a 2-D CPU tensor with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()} on {x.device}")
    return x.shape[0], x.shape[1], x.stride(0)


def _check_out(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> int:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu" or (t.dim() == 2 and shape[1] > 1
                                                                                   and t.stride(1) != 1):
        raise ValueError(f"{what}: expected a CPU {dtype} tensor of shape {shape} with a contiguous last dim, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def _dt(x: torch.Tensor) -> int:
    try:
        return _DTYPES[x.dtype]
    except KeyError:
        raise ValueError(f"native kernels read bf16/fp16/fp32 weights, got {x.dtype}") from None


def group_absmax(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 [rows, ceil(cols / group)]: max |x| per row and group of `group` columns (last partial)."""
    lib = _lib_or_raise()
    rows, cols, xs = _check_2d(x, "group_absmax")
    ng = -(-cols // group) if cols else 0
    out = torch.empty(rows, ng, dtype=torch.float32)
    if rows and cols:
        lib.sa_group_absmax(x.data_ptr(), _dt(x), rows, cols, xs, group, out.data_ptr(), ng, torch.get_num_threads())
    return out


def fp8_block_quantize(x: torch.Tensor, bn: int, bk: int, amax_floor: float, fmax: float, q: torch.Tensor,
                       scale: torch.Tensor) -> None:
    """One pass: scale[b, j] = max(|max| of block (b, j), amax_floor) / fmax (fp32; edge blocks partial)
    and q = e4m3(clamp(x / scale[r // bn, c // bk], ±fmax)) (float8_e4m3fn, x's shape); fmax <= 448."""
    lib = _lib_or_raise()
    rows, cols, xs = _check_2d(x, "fp8_block_quantize")
    if not 0 < fmax <= FP8_MAX_SUPPORTED:
        raise ValueError(f"fp8_block_quantize: fmax {fmax} outside (0, {FP8_MAX_SUPPORTED}]")
    nb, kb = -(-rows // bn), -(-cols // bk)
    ss = _check_out(scale, (nb, kb), torch.float32, "fp8_block_quantize scale")
    qs = _check_out(q, (rows, cols), torch.float8_e4m3fn, "fp8_block_quantize q")
    if rows and cols and lib.sa_fp8_block_quantize(x.data_ptr(), _dt(x), rows, cols, xs, bn, bk, amax_floor, fmax,
                                                   scale.data_ptr(), ss, q.data_ptr(), qs, torch.get_num_threads()):
        raise MemoryError(f"fp8_block_quantize: could not allocate {kb} accumulators per thread")


_QUOTIENT_MODE = {None: 0, torch.float32: 0, torch.bfloat16: 2, torch.float16: 4}  # native_kernels.c INT_ROUND_*


def int_quantize(x: torch.Tensor, div: torch.Tensor, group: int, qmin: float, qmax: float, reciprocal: bool,
                 out: torch.Tensor, quotient_dtype: torch.dtype | None = None) -> None:
    """out (int8, x's shape) = clamp(round_half_even(y), qmin, qmax), y = x / div[r, c // group]
    (x * div when `reciprocal`), first rounded to `quotient_dtype` (bf16 / fp16; None or fp32: not
    rounded) as torch's cast rounds; -128 <= qmin <= qmax <= 127."""
    lib = _lib_or_raise()
    if quotient_dtype not in _QUOTIENT_MODE:
        raise ValueError(f"int_quantize: quotient_dtype must be bf16, fp16, fp32 or None, got {quotient_dtype}")
    rows, cols, xs = _check_2d(x, "int_quantize")
    if not -128 <= qmin <= qmax <= 127:
        raise ValueError(f"int_quantize: range [{qmin}, {qmax}] does not fit int8")
    ng = -(-cols // group) if cols else 0
    ds = _check_out(div, (rows, ng), torch.float32, "int_quantize div")
    qs = _check_out(out, (rows, cols), torch.int8, "int_quantize out")
    if rows and cols:
        lib.sa_int_quantize(x.data_ptr(), _dt(x), rows, cols, xs, div.data_ptr(), ds, group,
                            int(reciprocal) | _QUOTIENT_MODE[quotient_dtype], float(qmin), float(qmax),
                            out.data_ptr(), qs, torch.get_num_threads())
