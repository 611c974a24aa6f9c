"""``slime-ascend quantize`` (offline converter) and ``slime-ascend verify-quant`` (bit-exact check).

    slime-ascend quantize HF_DIR OUT_DIR --format FORMAT [--force]     (FORMAT: one of quant.names.FORMATS)
    slime-ascend verify-quant OFFLINE_DIR ONLINE_DIR_OR_FILE [--names NAME ...] [--partial]

``verify-quant`` compares tensors an online sync produced (a disk-sync directory such as
``{--update-weight-disk-dir}/weight_v000001``, or one safetensors file dumped from a sync bucket)
with the offline converter's checkpoint, byte for byte, and prints one row per tensor. Exit 0
when every compared tensor is identical (and, for a directory without ``--names``/``--partial``,
both sides hold the same tensor names); exit 1 otherwise; exit 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..command import ArgumentParser
from ._outdir import check_out_dir
from ._source import check_source
from .names import FORMATS, INT4_NUMERICS


def _quantize_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="slime-ascend quantize",
                                description="Quantise an HF BF16 safetensors checkpoint for a rollout engine.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR",
                   help="output directory (created; must be empty unless --force; never HF_DIR, inside it or "
                        "above it)")
    p.add_argument("--format", required=True, dest="fmt", metavar="FORMAT",
                   help=f"one of: {', '.join(FORMATS)}")
    p.add_argument("--force", action="store_true",
                   help="replace a previous checkpoint in OUT_DIR (config.json + *.safetensors), only once the new "
                        "one is complete; any other non-empty OUT_DIR is refused")
    p.add_argument("--block-size", type=int, nargs=2, default=(128, 128), metavar=("N", "K"),
                   help="fp8-block tile (default 128 128)")
    p.add_argument("--group-size", type=int, default=128, help="int4-group group size (default 128)")
    p.add_argument("--asymmetric", action="store_true", help="int4-group: asymmetric (with zero points)")
    p.add_argument("--numerics", default="compressed-tensors", choices=INT4_NUMERICS,
                   help="int4-group scale/rounding rule (must match the int4-sync plugin's setting)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest output shard in GB (default 5)")
    return p


class Progress:
    """Tensors, bytes and rate on stderr as a command goes: one line rewritten in place on a terminal,
    else a line about every ``interval`` seconds (and the last one always)."""

    def __init__(self, label: str, stream=None, interval: float = 5.0):
        import time

        self.label, self.stream = label, stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.2 if self.tty else interval
        self._clock = time.monotonic
        self.start = self.last = self._clock()

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        now = self._clock()
        if done < total and now - self.last < self.interval:
            return
        self.last = now
        rate = nbytes / max(now - self.start, 1e-9) / 1e6
        text = f"{self.label}: {done}/{total} tensors, {nbytes / 1e9:.2f} GB, {rate:.0f} MB/s"
        if self.tty:
            self.stream.write("\r" + text + ("\n" if done >= total else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _fail(msg: str, fix: str = "correct it (`slime-ascend quantize --help` / `verify-quant --help`)") -> int:
    print(f"error: {msg}" if "Fix:" in msg else f"error: {msg.rstrip('.')}. Fix: {fix}", file=sys.stderr)
    return 2


def main_quantize(argv: Sequence[str] | None = None) -> int:
    ns = _quantize_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.fmt not in FORMATS:
        return _fail(f"--format {ns.fmt!r} is not supported", f"use one of {', '.join(FORMATS)}")
    if not os.path.isdir(ns.hf_dir):
        return _fail(f"HF_DIR {ns.hf_dir!r} is not a directory", "pass the HF checkpoint directory")
    try:  # before anything in HF_DIR is opened: no link out of it, no FIFO or device
        check_source(ns.hf_dir)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    if not os.path.isfile(os.path.join(ns.hf_dir, "config.json")):
        return _fail(f"HF_DIR {ns.hf_dir!r} has no config.json", "pass an HF checkpoint directory")
    if not any(f.endswith(".safetensors") for f in os.listdir(ns.hf_dir)):
        return _fail(f"HF_DIR {ns.hf_dir!r} has no *.safetensors files", "convert the checkpoint to safetensors "
                     "(only safetensors checkpoints are read)")
    try:  # nothing is deleted here: OUT_DIR is replaced only after the new checkpoint is complete
        check_out_dir(ns.hf_dir, ns.out_dir, ns.force)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    if ns.max_shard_gb <= 0:
        return _fail(f"--max-shard-gb {ns.max_shard_gb} is not positive", "pass a size in GB above 0")

    import torch  # noqa: F401  (heavy imports only after the arguments are checked)

    from .checkpoint import convert_checkpoint
    from .schemes import make_spec

    try:
        spec = make_spec(ns.fmt, block_size=tuple(ns.block_size), group_size=ns.group_size,
                         symmetric=not ns.asymmetric, numerics=ns.numerics)
        report = convert_checkpoint(ns.hf_dir, ns.out_dir, spec, max_shard_bytes=int(ns.max_shard_gb * 1024**3),
                                    overwrite=ns.force, progress=Progress(f"quantize {ns.fmt}"),
                                    names=("HF_DIR", "OUT_DIR", "--force"))
    except ValueError as exc:
        return _fail(str(exc))
    except OSError as exc:  # a full disk: named, with its own Fix
        from ..command import fix_for, one_line

        return _fail(f"{one_line(exc)}; OUT_DIR {ns.out_dir!r} was left as it was", fix_for(exc))
    except KeyboardInterrupt:
        print(f"error: interrupted; OUT_DIR {ns.out_dir!r} was left as it was", file=sys.stderr)
        return 130
    print(f"{report.fmt}: {len(report.quantized)} tensors quantised, {len(report.kept)} kept -> {report.out_dir}")
    return 0


def _verify_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="slime-ascend verify-quant",
                                description="Check online-synced tensors against the offline converter's files, "
                                            "bit for bit.")
    p.add_argument("offline", metavar="OFFLINE_DIR", help="checkpoint written by `slime-ascend quantize`")
    p.add_argument("online", metavar="ONLINE_DIR_OR_FILE",
                   help="a disk-sync directory or a .safetensors file with synced tensors")
    p.add_argument("--names", nargs="+", default=None, help="compare only these tensor names")
    p.add_argument("--partial", action="store_true",
                   help="do not fail when the offline checkpoint has tensors the online side lacks")
    p.add_argument("--quiet", action="store_true", help="print only mismatches and the summary")
    return p


def _online_tensors(path: str):
    from .checkpoint import CheckpointReader, open_safetensors

    if os.path.isdir(path):
        return CheckpointReader(path)
    if not path.endswith(".safetensors") or not os.path.isfile(path):
        raise ValueError(f"ONLINE {path!r} must be a directory or a .safetensors file")
    handle = open_safetensors(path)

    class _File:
        def keys(self):
            return list(handle.keys())

        def get(self, name):
            return handle.get_tensor(name)

        def __contains__(self, name):
            return name in set(handle.keys())

    return _File()


def main_verify(argv: Sequence[str] | None = None) -> int:
    ns = _verify_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not os.path.isdir(ns.offline):
        return _fail(f"OFFLINE_DIR {ns.offline!r} is not a directory", "pass the directory `slime-ascend quantize` wrote")
    if not os.path.exists(ns.online):
        return _fail(f"ONLINE {ns.online!r} does not exist", "pass the directory or file the weight sync wrote")

    from .checkpoint import CheckpointReader, verify_tensor

    try:
        offline = CheckpointReader(ns.offline)
        online = _online_tensors(ns.online)
    except ValueError as exc:
        return _fail(str(exc))
    online_names = online.keys()
    names = list(ns.names) if ns.names else online_names
    rows: list[tuple[str, str, str, str]] = []
    ok = bool(names)
    progress, read = Progress("verify-quant"), 0
    for done, name in enumerate(names, 1):
        if name not in online:
            rows.append((name, "-", "-", "MISSING online"))
            ok = False
            progress(done, len(names), read)
            continue
        t = online.get(name)
        read += t.numel() * t.element_size()
        progress(done, len(names), read)
        check = verify_tensor(offline, name, t)
        ok &= check.ok
        rows.append((name, str(t.dtype).removeprefix("torch."), "x".join(map(str, t.shape)) or "scalar",
                     "OK" if check.ok else f"FAIL: {check.reason}"))
    missing_online: list[str] = []
    if not ns.names and not ns.partial and os.path.isdir(ns.online):
        missing_online = sorted(set(offline.keys()) - set(online_names))
        ok &= not missing_online
    width = max([len(r[0]) for r in rows] + [6])
    print(f"{'tensor':<{width}}  {'dtype':<14} {'shape':<18} result")
    for r in rows:
        if ns.quiet and r[3] == "OK":
            continue
        print(f"{r[0]:<{width}}  {r[1]:<14} {r[2]:<18} {r[3]}")
    for name in missing_online[:50]:
        print(f"{name:<{width}}  {'-':<14} {'-':<18} MISSING online (in offline checkpoint)")
    failed = sum(1 for r in rows if r[3] != "OK")
    print(f"{'OK' if ok else 'FAIL'}: {len(rows) - failed}/{len(rows)} identical"
          + (f", {len(missing_online)} offline tensors not synced" if missing_online else "")
          + ("" if names else " (nothing to compare)"))
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main_quantize())
