"""Quantisation throughput.

(a) INT8 / FP8 quantisation of a 4096x14336 BF16 weight vs a plain `copy_` of the same
    tensor: ratio = copy_time / quant_time, target >= 0.5. Every kernel choice is timed side
    by side in one interleaved loop: eager (torch ops), native (the C kernels, the CPU
    default), compile (torch.compile, opt-in). The target rows time the default call
    (`fused=None` with SLIME_ASCEND_QUANT_FUSED unset: `auto`, which keeps the native kernels
    only where its first-use timing finds them not slower than eager) and name the backend it
    ran; the per-path rows are informational, and one checked row holds every native and
    compiled path to at least eager's speed (ratio = min over them of eager time / path time).
    Every row names the CPU model and its vector extensions.
(b) INT8 (compressed-tensors numerics) and INT4 group quantise+pack vs the compressed-tensors
    library's own path (calculate_qparams + compressor.compress) on the same tensor:
    ratio = library_time / ours, target >= 2, and the outputs must be identical.
    The library is fed the bf16 weight as it is (min/max per channel or group in bf16, then
    `calculate_qparams` and `compress`, every step in bf16), as llm-compressor runs it on a
    bf16 model; ours reproduces that arithmetic byte for byte.

Run: python benchmarks/bench_quant.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from slime_ascend.quant import fused as _fused
from slime_ascend.quant import make_spec, quantize_param
from slime_ascend.quant.fp8_block import quantize_fp8_block
from slime_ascend.quant.int_quant import quantize_int
from slime_ascend.quant.schemes import FP8BlockScheme

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _host import describe as host  # noqa: E402

NAME = "model.layers.0.mlp.down_proj.weight"


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _ct_reference(w: torch.Tensor, bits: int, group_size: int | None):
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    if bits == 8:
        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        comp = IntQuantizationCompressor
    else:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
        comp = PackedQuantizationCompressor
    scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def run():
        g = w.shape[1] if group_size is None else group_size
        wg = w.view(w.shape[0], -1, g)
        mn, mx = torch.aminmax(wg, dim=-1)
        scale, zp = calculate_qparams(mn, mx, args)
        return comp.compress({"weight": w, "weight_scale": scale}, scheme), scale

    return run


def run(quick: bool = False) -> list[dict]:
    os.environ.pop(_fused.ENV_VAR, None)  # the target rows time the default choice
    torch.manual_seed(0)
    n, k = (1024, 4096) if quick else (4096, 14336)
    repeats = 3 if quick else 9
    w = torch.randn(n, k, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
    dst = torch.empty_like(w)
    schemes = {"int8_ascend": make_spec("int8-w8a8").int_scheme, "int8_ct": make_spec("int8-ct").int_scheme,
               "fp8": FP8BlockScheme()}
    kinds = {"eager": False, "native": "native", "compile": "compile", "default": None}
    rows: list[dict] = []

    def call(fmt: str, fused, out=None):
        if fmt == "fp8":
            return quantize_fp8_block(w, schemes[fmt], out=out, fused=fused)
        return quantize_int(w, schemes[fmt], out=out, fused=fused)

    # quantisers write into preallocated outputs, as copy_ does (a sync loop reuses its buffers);
    # the allocating default call is timed too and reported in the detail (fresh pages cost page faults).
    outs, ran = {}, {}
    for fmt in schemes:
        ref = call(fmt, False)
        for kind, fused in kinds.items():
            got = call(fmt, fused)  # builds / compiles and self-checks here, outside the timing
            if not all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(ref, got) if a is not None):
                raise AssertionError(f"{fmt}: the {kind} path differs from eager on the benchmark weight")
            outs[fmt, kind] = got
            chosen = _fused.backend(fused, w)
            key = ("fp8" if fmt == "fp8" else "int", chosen, schemes[fmt], w.dtype, w.device.type)
            ran[fmt, kind] = (chosen if chosen and _fused.verdict(key) and (kind != "default" or
                                                                      _fused.auto_choice(key) is not False)
                              else "eager")
    fns: dict[str, Callable[[], object]] = {"copy": lambda: dst.copy_(w), "clone": lambda: w.clone()}
    for fmt in schemes:
        for kind, fused in kinds.items():
            fns[f"{fmt}/{kind}"] = lambda fmt=fmt, kind=kind, fused=fused: call(fmt, fused, outs[fmt, kind])
        fns[f"{fmt}/alloc"] = lambda fmt=fmt: call(fmt, None)
    t = _interleaved(fns, repeats)
    labels = {"int8_ascend": "quant_int8_w8a8_vs_copy", "int8_ct": "quant_int8_ct_vs_copy",
              "fp8": "quant_fp8_block_vs_copy"}
    cpu = host()
    slowest = (float("inf"), "")
    for fmt, label in labels.items():
        head = f"{cpu}; {n}x{k} bf16, {torch.get_num_threads()} threads: copy_ {t['copy'] * 1e3:.1f} ms"
        for kind in ("native", "compile"):
            if ran[fmt, kind] == kind:
                slowest = min(slowest, (t[f"{fmt}/eager"] / t[f"{fmt}/{kind}"], f"{fmt} {kind}"))
        for kind in ("eager", "native", "compile"):
            r = t["copy"] / t[f"{fmt}/{kind}"]
            note = "" if ran[fmt, kind] == kind else f" (UNAVAILABLE: {ran[fmt, kind]} ran)"
            rows.append({"name": f"{label}_{kind}", "ratio": r, "target": "info", "passed": None,
                         "detail": f"{head}, {kind}{note} into reused buffers {t[f'{fmt}/{kind}'] * 1e3:.1f} ms"})
        r = t["copy"] / t[f"{fmt}/default"]
        rows.append({"name": label, "ratio": r, "target": ">=0.5", "passed": r >= 0.5,
                     "detail": f"{head}, default path ({ran[fmt, 'default']}) into reused buffers "
                               f"{t[f'{fmt}/default'] * 1e3:.1f} ms; allocating its outputs {t[f'{fmt}/alloc'] * 1e3:.1f} "
                               f"ms vs an allocating clone() {t['clone'] * 1e3:.1f} ms (ratio "
                               f"{t['clone'] / t[f'{fmt}/alloc']:.2f})"})
    if slowest[1]:
        rows.append({"name": "quant_fast_paths_vs_eager", "ratio": slowest[0], "target": ">=1", "passed": slowest[0] >= 1.0,
                     "detail": f"{cpu}; the slowest native or compiled path relative to eager: {slowest[1]} "
                               f"(eager time / its time)"})

    # (b) vs compressed-tensors
    try:
        ref8, ref4 = _ct_reference(w, 8, None), _ct_reference(w, 4, 128)
    except ImportError as e:  # pragma: no cover
        print(f"compressed-tensors not importable, skipping (b): {e}", file=sys.stderr)
        ref8 = ref4 = None
    if ref8 is not None:
        ours8 = lambda: quantize_param(NAME, w, make_spec("int8-ct"))  # noqa: E731
        ours4 = lambda: quantize_param(NAME, w, make_spec("int4-group"))  # noqa: E731
        (c8, s8), o8 = ref8(), dict(ours8())
        same8 = torch.equal(c8["weight"], o8[NAME]) and torch.equal(s8.to(torch.bfloat16),
                                                                     o8[NAME[:-6] + "weight_scale"])
        (c4, s4), o4 = ref4(), dict(ours4())
        same4 = torch.equal(c4["weight_packed"], o4[NAME[:-6] + "weight_packed"]) and torch.equal(
            s4.to(torch.bfloat16), o4[NAME[:-6] + "weight_scale"])
        if not (same8 and same4):
            raise AssertionError(f"values differ from compressed-tensors: int8 same={same8}, int4 same={same4}")
        t2 = _interleaved({"ct8": ref8, "ours8": ours8, "ct4": ref4, "ours4": ours4}, repeats)
        for a, b, label in (("ct8", "ours8", "int8_vs_compressed_tensors"),
                            ("ct4", "ours4", "int4_vs_compressed_tensors")):
            ratio = t2[a] / t2[b]
            rows.append({"name": label, "ratio": ratio, "target": ">=2", "passed": ratio >= 2.0,
                         "detail": f"{n}x{k}: library {t2[a] * 1e3:.1f} ms, ours {t2[b] * 1e3:.1f} ms, "
                                   "identical values"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU {host()}")
    for r in run(args.quick):
        print(f"  {r['detail']}")
        verdict = "INFO" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        print(f"RESULT {r['name']} ratio={r['ratio']:.2f} target={r['target']} {verdict}")


if __name__ == "__main__":
    main()
