"""Weight-sync transports side by side: one model pushed through disk, distributed and tensor hand-off,
plain (bf16) and quantised on the train side (int8-w8a8, fp8-block, mxfp8), each as a ratio to a memcpy
of the model's bytes measured in the same run, plus seconds per GB of the model.

The model is synthetic: a stack of Qwen-shaped decoder layers (q/k/v/o, gate/up/down, norms) in bf16,
as many layers as ``--size`` MB asks for. It is cut into buckets of ``--bucket-mb`` (slime's
``--update-weight-buffer-size``); each transport sends bucket by bucket, quantising each bucket first as
slime's ``convert_to_hf`` -> ``quantize_params`` funnel does (the quantisation time is part of the push):

* disk: each bucket written with safetensors (``--dir``, default a temporary directory) and read back,
  as slime's disk transport writes and the engine loads (the page cache is warm: on this host that is
  what a disk push costs);
* distributed: a receiver process joins a 2-rank gloo group on localhost; per bucket the sender hands
  over names/dtypes/shapes (a pipe, where slime makes an HTTP call) and broadcasts each tensor, float8 as
  its bytes (gloo has no float8), and the receiver acknowledges the bucket. This is a plain gloo
  broadcast into freshly allocated buffers, the receiving half of the torch engine's
  ``/update_weights_from_distributed`` without its checks and switch;
* tensor: the sender puts each bucket's tensors on a ``torch.multiprocessing`` queue (the shared-memory
  reductions slime's ``MultiprocessingSerializer`` uses for ``update_weights_from_tensor``); the
  receiver rebuilds them and copies them into its own memory, as an engine loads them into its model.

A last row pushes the model again after a small step (``--delta-frac`` of the values moved by 1%) as an
MXFP8 delta on the distributed path (``weight_sync.quant_delta``: only the changed 32-value blocks and
changed scale bytes, with their indices, applied into a copy on the receiver), with its density (bytes
over a full MXFP8 push's) and its time over the full push's.

The time of a push is the sender's, from the first bucket to the last acknowledgement (best of
``--repeat``). Goals: the distributed push of bf16 within 2x of memcpy; each quantised push not slower
than the bf16 push of the same transport.

Run: python benchmarks/bench_weight_sync.py [--size MB] [--hidden H] [--bucket-mb MB] [--repeat N]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _host import describe as host  # noqa: E402

VARIANTS: tuple[tuple[str, str | None], ...] = (("bf16", None), ("int8", "int8-w8a8"), ("fp8-block", "fp8-block"),
                                                ("mxfp8", "mxfp8"))
Named = list[tuple[str, torch.Tensor]]


# ------------------------------------------------------------------------------------------------ model
def layer_shapes(hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    ffn = max(128, (hidden * 11 // 4) // 128 * 128)
    kv = max(32, hidden // 4)
    return [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (ffn, hidden)), ("mlp.up_proj.weight", (ffn, hidden)),
            ("mlp.down_proj.weight", (hidden, ffn)), ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,))]


def synthetic_model(size_mb: float, hidden: int, seed: int = 0) -> Named:
    shapes = layer_shapes(hidden)
    per_layer = sum(math.prod(s) for _, s in shapes) * 2
    layers = max(1, round(size_mb * 2**20 / per_layer))
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.{name}", (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
            for i in range(layers) for name, shape in shapes]


def small_step(model: Named, frac: float, seed: int = 1) -> Named:
    """The model after a small update: a fraction `frac` of the values moved by 1% of themselves."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in model:
        x = t.float()
        x += (torch.rand(t.shape, generator=g) < frac) * x * 0.01
        out.append((name, x.to(t.dtype)))
    return out


def nbytes(named: Named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def buckets(named: Named, limit_bytes: int) -> list[Named]:
    out: list[Named] = [[]]
    size = 0
    for name, t in named:
        b = t.numel() * t.element_size()
        if out[-1] and size + b > limit_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += b
    return out


def prepare(bucket: Named, fmt: str | None) -> Named:
    """The train side's funnel: the bucket in the engine's format (the same call the sync plugins make)."""
    if fmt is None:
        return bucket
    from slime_ascend.quant import make_spec, quantize_named_params

    return quantize_named_params(bucket, make_spec(fmt))


def wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


# ------------------------------------------------------------------------------------------------ receivers
def _dist_receiver(port: int, conn) -> None:
    from slime_ascend.weight_sync.quant_delta import Delta, TensorDelta, apply_delta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    held: dict[str, torch.Tensor] = {}  # the last version, for deltas
    while (msg := conn.recv()) is not None:
        kind, items = msg
        if kind == "full":
            got = {}
            for name, dtype, shape in items:
                buf = torch.empty(shape, dtype=dtype)
                dist.broadcast(wire(buf), 0)
                got[name] = buf
            held.update(got)
            conn.send(nbytes(list(got.items())))
            continue
        block_bytes, parts = items  # a delta: per tensor its block indices and blocks, or the whole tensor
        delta = Delta(block_bytes)
        for name, dtype, shape, n in parts:
            if n < 0:
                buf = torch.empty(shape, dtype=dtype)
                dist.broadcast(wire(buf), 0)
                delta.tensors[name] = TensorDelta(dtype, shape, None, buf)
            else:
                index, payload = torch.empty(n, dtype=torch.int64), torch.empty(n, block_bytes, dtype=torch.uint8)
                dist.broadcast(index, 0)
                dist.broadcast(payload, 0)
                delta.tensors[name] = TensorDelta(dtype, shape, index, payload)
        held.update(apply_delta({k: held[k] for k in held if k in delta.tensors}, delta))
        conn.send(delta.payload_bytes)
    dist.destroy_process_group()


def _tensor_receiver(inbox, outbox) -> None:
    torch.set_num_threads(1)
    while (item := inbox.get()) is not None:
        got = [(n, t.clone()) for n, t in item]  # into the engine's own memory
        del item
        outbox.put(nbytes(got))


# ------------------------------------------------------------------------------------------------ transports
class Disk:
    name = "disk"

    def __init__(self, root: str) -> None:
        self.root = root

    def push(self, bs: list[Named], fmt: str | None) -> int:
        d = tempfile.mkdtemp(dir=self.root, prefix="push-")
        got = 0
        try:
            for i, b in enumerate(bs):
                path = os.path.join(d, f"bucket{i:04d}.safetensors")
                save_file({n: t.contiguous() for n, t in prepare(b, fmt)}, path)
                got += nbytes(list(load_file(path).items()))
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return got

    def close(self) -> None:
        pass


class Distributed:
    name = "distributed"

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_dist_receiver, args=(port, child), daemon=True)
        self.proc.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)

    def push(self, bs: list[Named], fmt: str | None, keep: list[dict[str, torch.Tensor]] | None = None) -> int:
        got = 0
        for b in bs:
            out = [(n, t.contiguous()) for n, t in prepare(b, fmt)]
            self.conn.send(("full", [(n, t.dtype, tuple(t.shape)) for n, t in out]))
            for _, t in out:
                dist.broadcast(wire(t), 0)
            got += self.conn.recv()
            if keep is not None:
                keep.append(dict(out))
        return got

    def push_delta(self, bs: list[Named], fmt: str, sent: list[dict[str, torch.Tensor]], block_bytes: int) -> int:
        """Quantise each bucket, diff it against the version last sent, broadcast only the changed blocks."""
        from slime_ascend.weight_sync.quant_delta import block_delta

        got = 0
        for b, old in zip(bs, sent):
            d = block_delta(old, dict(prepare(b, fmt)), block_bytes)
            self.conn.send(("delta", (block_bytes, [(n, x.dtype, x.shape, -1 if x.index is None else x.index.numel())
                                                    for n, x in d.tensors.items()])))
            for x in d.tensors.values():
                if x.index is None:
                    dist.broadcast(wire(x.payload), 0)
                else:
                    dist.broadcast(x.index, 0)
                    dist.broadcast(x.payload, 0)
            got += self.conn.recv()
        return got

    def close(self) -> None:
        self.conn.send(None)
        dist.destroy_process_group()
        self.proc.join(30)


class Tensor:
    name = "tensor"

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_tensor_receiver, args=(self.inbox, self.outbox), daemon=True)
        self.proc.start()

    def push(self, bs: list[Named], fmt: str | None) -> int:
        got = 0
        for b in bs:
            self.inbox.put(prepare(b, fmt))
            got += self.outbox.get()
        return got

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(30)


# ------------------------------------------------------------------------------------------------ run
def best_of(repeat: int, fn: Callable[[], object]) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def memcpy_seconds(total: int, repeat: int) -> float:
    src = torch.empty(total, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched
    return best_of(max(3, repeat), lambda: dst.copy_(src))[0]


def wire_bytes(bs: list[Named], fmt: str | None) -> int:
    return sum(nbytes(prepare(b, fmt)) for b in bs)


def run(size_mb: float, hidden: int, bucket_mb: float, repeat: int, root: str | None,
        delta_frac: float = 0.01) -> dict[tuple[str, str], float]:
    model = synthetic_model(size_mb, hidden)
    total = nbytes(model)
    bs = buckets(model, int(bucket_mb * 2**20))
    gb = total / 1e9
    print(f"host: {host()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model: {len(model)} tensors, "
          f"{total / 2**20:.1f} MiB bf16 (hidden {hidden}), {len(bs)} buckets of <= {bucket_mb:g} MiB")
    t_mem = memcpy_seconds(total, repeat)
    print(f"memcpy of the model's bytes: {t_mem:.4f} s ({t_mem / gb:.3f} s/GB)")
    wires = {label: wire_bytes(bs, fmt) for label, fmt in VARIANTS}
    tmp = tempfile.mkdtemp(prefix="bench-ws-", dir=root)
    times: dict[tuple[str, str], float] = {}
    print(f"{'transport':<12} {'format':<10} {'wire MiB':>9} {'seconds':>9} {'s/GB':>8} {'x memcpy':>9}")
    try:
        for make in (lambda: Disk(tmp), Distributed, Tensor):
            tr = make()
            try:
                for label, fmt in VARIANTS:
                    tr.push(bs[:1], fmt)  # warm-up: first-use kernel checks, receiver allocations
                    t, got = best_of(repeat, lambda: tr.push(bs, fmt))
                    if got != wires[label]:
                        raise RuntimeError(f"{tr.name} {label}: received {got} bytes, sent {wires[label]}")
                    times[(tr.name, label)] = t
                    print(f"{tr.name:<12} {label:<10} {wires[label] / 2**20:>9.1f} {t:>9.4f} {t / gb:>8.3f} "
                          f"{t / t_mem:>9.2f}", flush=True)
                if isinstance(tr, Distributed):  # item 8: the changed MXFP8 blocks only, after a small step
                    sent: list[dict[str, torch.Tensor]] = []
                    tr.push(bs, "mxfp8", keep=sent)  # the version the engine holds
                    stepped = buckets(small_step(model, delta_frac), int(bucket_mb * 2**20))
                    t, got = best_of(repeat, lambda: tr.push_delta(stepped, "mxfp8", sent, 32))
                    times[(tr.name, "mxfp8-delta")] = t
                    delta_line = (f"delta push (mxfp8, {delta_frac:g} of the values moved by 1%): density "
                                  f"{got / wires['mxfp8']:.3f} of a full mxfp8 push's bytes, time "
                                  f"{t / times[(tr.name, 'mxfp8')]:.2f}x the full mxfp8 push (diff included)")
                    print(f"{tr.name:<12} {'mxfp8-delta':<10} {got / 2**20:>9.1f} {t:>9.4f} {t / gb:>8.3f} "
                          f"{t / t_mem:>9.2f}", flush=True)
            finally:
                tr.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(delta_line)
    ratio = times[("distributed", "bf16")] / t_mem
    print(f"goal distributed bf16 <= 2x memcpy: {ratio:.2f}x -> {'met' if ratio <= 2 else 'NOT met'}")
    for tr_name in ("disk", "distributed", "tensor"):
        plain = times[(tr_name, "bf16")]
        cells = [f"{label} {times[(tr_name, label)] / plain:.2f}" for label, fmt in VARIANTS if fmt]
        ok = all(times[(tr_name, label)] <= plain for label, fmt in VARIANTS if fmt)
        print(f"goal quantised <= bf16 on {tr_name} (time / bf16 time): {', '.join(cells)} -> "
              f"{'met' if ok else 'NOT met'}")
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=256.0, help="model size in MiB of bf16 weights (default 256)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size of the synthetic layers (default 2048)")
    p.add_argument("--bucket-mb", type=float, default=128.0,
                   help="bucket size in MiB, slime's --update-weight-buffer-size (default 128)")
    p.add_argument("--repeat", type=int, default=2, help="pushes per row, the best is printed (default 2)")
    p.add_argument("--dir", default=None, help="where the disk transport writes (default: the temp directory)")
    p.add_argument("--delta-frac", type=float, default=0.01,
                   help="fraction of the values a small step moves, for the delta row (default 0.01)")
    ns = p.parse_args(argv)
    if ns.size <= 0 or ns.hidden < 32 or ns.hidden % 32 or ns.bucket_mb <= 0 or ns.repeat < 1:
        p.error("--size and --bucket-mb must be positive, --hidden a multiple of 32 (>= 32), --repeat >= 1")
    run(ns.size, ns.hidden, ns.bucket_mb, ns.repeat, ns.dir, ns.delta_frac)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
