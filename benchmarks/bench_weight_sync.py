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

Each quantised row is pushed twice: as slime's own loop does (each bucket quantised, then sent) and
*overlapped*, as the sync plugins' ``pipelined_send`` setting (on by default) runs slime's push: bucket k sent on a
sender thread while bucket k+1 is quantised, with the package's own ``BucketPipeline``
(``weight_sync.pipelined_send``; the runtime patch ``train.pipelined_weight_send`` hands slime's bucket send to it).
The quantisation alone is printed too: it is the train side's share.

After the table: the torch engine's own side of a bf16 push once its buckets arrived (its checks and the
switch into the model: ``WeightGroupReceiver._commit`` on a stub model in the engine's dtype), which a
real push adds to the distributed row's time. After the distributed rows: the gloo broadcast of the bf16 buckets into buffers the receiver already
holds (no allocation: the floor of this transport here), and the model pushed again after a small step
(``--delta-frac`` of the values moved by 1%) as an MXFP8 delta on the distributed path, encoded and
applied by ``weight_sync.distributed_delta`` as the sync plugins' ``distributed_delta`` setting sends it
(the changed 32-byte blocks, i.e. OCP blocks, and changed scale bytes, with their indices, in three
broadcasts per bucket; applied into copies on the receiver), with its density (bytes over a full MXFP8
push's) and its time over the full push's.

The time of a push is the sender's, from the first bucket to the last acknowledgement (best of
``--repeat``). Goals: the distributed push of bf16 within 2x of memcpy; each quantised push as the sync plugins
send it (overlapped) not slower than the bf16 push of the same transport (slime's own loop, no plugin).

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


def pushed(bs: list[Named], fmt: str | None, overlap: bool, send: Callable[[int, Named], int]) -> int:
    """Each bucket in the engine's format (:func:`prepare`) handed to ``send(index, bucket)``, which returns the bytes
    the receiver took; their sum. ``overlap``: as the sync plugins' ``pipelined_send`` runs slime's push, with the
    package's own :class:`~slime_ascend.weight_sync.pipelined_send.BucketPipeline`: bucket k is sent on a
    sender thread while bucket k+1 is quantised here (torch's ops and gloo release the GIL)."""
    if not overlap or fmt is None:
        return sum(send(i, prepare(b, fmt)) for i, b in enumerate(bs))
    from slime_ascend.weight_sync.pipelined_send import BucketPipeline

    got: list[int] = []
    pipeline = BucketPipeline()
    try:
        for i, b in enumerate(bs):
            out = prepare(b, fmt)
            pipeline.submit(lambda i=i, out=out: got.append(send(i, out)))
        pipeline.drain()
    finally:
        pipeline.close()
    return sum(got)


def wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


# ------------------------------------------------------------------------------------------------ receivers
def _dist_receiver(port: int, conn) -> None:
    from slime_ascend.weight_sync.distributed_delta import decode_delta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    held: dict[str, torch.Tensor] = {}  # the last version, for deltas
    while (msg := conn.recv()) is not None:
        kind, items = msg
        if kind in ("full", "into-held"):  # into-held: into the buffers of the last push (no allocation)
            got = {}
            for name, dtype, shape in items:
                buf = held[name] if kind == "into-held" else torch.empty(shape, dtype=dtype)
                dist.broadcast(wire(buf), 0)
                got[name] = buf
            held.update(got)
            conn.send(nbytes(list(got.items())))
            continue
        # a delta bucket as the torch engine receives it: its tensors' entries, then counts, index and blocks
        # broadcast (the empty ones skipped), applied into copies of the version held
        block_bytes, entries, (k, n, m) = items
        wire_tensors = [torch.empty(k, dtype=torch.int64), torch.empty(n, dtype=torch.int64),
                        torch.empty(m, block_bytes, dtype=torch.uint8)]
        for t in wire_tensors:
            if t.numel():
                dist.broadcast(t, 0)
        held.update(decode_delta(held, entries, *wire_tensors, block_bytes=block_bytes))
        conn.send(sum(t.numel() * t.element_size() for t in wire_tensors))
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

    def push(self, bs: list[Named], fmt: str | None, overlap: bool = False) -> int:
        d = tempfile.mkdtemp(dir=self.root, prefix="push-")

        def send(i: int, out: Named) -> int:
            path = os.path.join(d, f"bucket{i:04d}.safetensors")
            save_file({n: t.contiguous() for n, t in out}, path)
            return nbytes(list(load_file(path).items()))

        try:
            return pushed(bs, fmt, overlap, send)
        finally:
            shutil.rmtree(d, ignore_errors=True)

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

    def push(self, bs: list[Named], fmt: str | None, keep: list[dict[str, torch.Tensor]] | None = None,
             overlap: bool = False, kind: str = "full") -> int:
        def send(_i: int, out: Named) -> int:
            out = [(n, t.contiguous()) for n, t in out]
            self.conn.send((kind, [(n, t.dtype, tuple(t.shape)) for n, t in out]))
            for _, t in out:
                dist.broadcast(wire(t), 0)
            if keep is not None:
                keep.append(dict(out))
            return self.conn.recv()

        return pushed(bs, fmt, overlap, send)

    def push_delta(self, bs: list[Named], fmt: str, sent: list[dict[str, torch.Tensor]], block_bytes: int) -> int:
        """Quantise each bucket, diff it against the version last sent and broadcast only the changed blocks, as
        ``weight_sync.distributed_delta`` (the sync plugins' ``distributed_delta`` setting) sends them."""
        from slime_ascend.weight_sync.distributed_delta import encode_delta

        got = 0
        for b, old in zip(bs, sent):
            new = prepare(b, fmt)
            counts, index, blocks = encode_delta(old, new, block_bytes)
            self.conn.send(("delta", (block_bytes, [(n, t.dtype, tuple(t.shape)) for n, t in new],
                                      (counts.numel(), index.numel(), blocks.shape[0]))))
            for t in (counts, index, blocks):
                if t.numel():
                    dist.broadcast(t, 0)
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

    def push(self, bs: list[Named], fmt: str | None, overlap: bool = False) -> int:
        def send(_i: int, out: Named) -> int:
            self.inbox.put(out)
            return self.outbox.get()

        return pushed(bs, fmt, overlap, send)

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(30)


# ------------------------------------------------------------------------------------------------ engine side
class _StubModel:
    """What the torch engine's checks and swap read of a model: its state dict (zeros in ``dtype``), its config."""

    def __init__(self, named: Named, dtype: torch.dtype) -> None:
        import types

        self._own = {n: torch.zeros(t.shape, dtype=dtype) for n, t in named}
        self.config = types.SimpleNamespace(tie_word_embeddings=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._own


class _StubEngine:
    """The fields ``WeightGroupReceiver._commit`` uses; ``_switch_to`` copies into the model as the engine's does
    (``model.apply_state_dict``), without the drain (no requests here)."""

    quantization = None
    _max_checkpoint_bytes = 1 << 62

    def __init__(self, named: Named, dtype: torch.dtype) -> None:
        import threading

        self.model, self.dtype, self.weight_version = _StubModel(named, dtype), dtype, "0"
        self._update_lock = threading.Lock()

    def _switch_to(self, state, version, source, **fields) -> None:
        from slime_ascend.rollout.torch_engine import model as reference_model

        reference_model.apply_state_dict(self.model, state, source=source)
        self.weight_version = version


def engine_commit_seconds(model: Named, dtype: torch.dtype, repeat: int) -> float:
    """The torch engine's side of a bf16 push once every bucket arrived: ``WeightGroupReceiver._commit`` (names,
    shapes, no NaN/inf, the copy into the model), with a stub model in the engine's ``dtype``."""
    from slime_ascend.rollout.torch_engine.weight_group import WeightGroupReceiver, _Staged

    receiver, versions = WeightGroupReceiver(_StubEngine(model, dtype)), iter(range(1, 1 << 30))
    staged = [_Staged(str(next(versions)), set(), set(), tensors=dict(model)) for _ in range(max(2, repeat) + 1)]
    receiver._commit(staged[0])  # the model's pages touched
    return best_of(max(2, repeat), lambda: receiver._commit(staged.pop()))[0]


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
    overlapped: dict[tuple[str, str], float] = {}
    t_quant = {label: best_of(repeat, lambda: [prepare(b, fmt) for b in bs])[0] for label, fmt in VARIANTS if fmt}
    print("quantisation alone (the train side's share of a quantised push): "
          + ", ".join(f"{label} {t:.4f} s ({t / t_mem:.2f}x memcpy)" for label, t in t_quant.items()))
    print(f"{'transport':<12} {'format':<10} {'wire MiB':>9} {'seconds':>9} {'s/GB':>8} {'x memcpy':>9} "
          f"{'overlapped s':>12} {'x memcpy':>9}")
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
                    cells = f"{'-':>12} {'-':>9}"
                    if fmt is not None:  # the quantisation of bucket k+1 overlapped with the sending of bucket k
                        t_ovl, got = best_of(repeat, lambda: tr.push(bs, fmt, overlap=True))
                        if got != wires[label]:
                            raise RuntimeError(f"{tr.name} {label} overlapped: received {got} bytes, sent "
                                               f"{wires[label]}")
                        overlapped[(tr.name, label)] = t_ovl
                        cells = f"{t_ovl:>12.4f} {t_ovl / t_mem:>9.2f}"
                    print(f"{tr.name:<12} {label:<10} {wires[label] / 2**20:>9.1f} {t:>9.4f} {t / gb:>8.3f} "
                          f"{t / t_mem:>9.2f} {cells}", flush=True)
                if isinstance(tr, Distributed):  # the floor: gloo alone, into buffers the receiver holds
                    tr.push(bs, None)
                    t_floor = best_of(repeat, lambda: tr.push(bs, None, kind="into-held"))[0]
                    floor_line = (f"gloo broadcast of the bf16 buckets into buffers the receiver already holds (no "
                                  f"allocation, no page faults: the floor of this transport on this host): "
                                  f"{t_floor:.4f} s, {t_floor / t_mem:.2f}x memcpy")
                    print(floor_line, flush=True)
                    # item 8: the changed MXFP8 blocks only, after a small step
                    sent: list[dict[str, torch.Tensor]] = []
                    tr.push(bs, "mxfp8", keep=sent)  # the version the engine holds
                    stepped = buckets(small_step(model, delta_frac), int(bucket_mb * 2**20))
                    t, got = best_of(repeat, lambda: tr.push_delta(stepped, "mxfp8", sent, 32))
                    times[(tr.name, "mxfp8-delta")] = t
                    delta_line = (f"delta push (mxfp8, {delta_frac:g} of the values moved by 1%): density "
                                  f"{got / wires['mxfp8']:.3f} of a full mxfp8 push's bytes, time "
                                  f"{t / times[(tr.name, 'mxfp8')]:.2f}x the full mxfp8 push (diff included)")
                    print(f"{tr.name:<12} {'mxfp8-delta':<10} {got / 2**20:>9.1f} {t:>9.4f} {t / gb:>8.3f} "
                          f"{t / t_mem:>9.2f} {'-':>12} {'-':>9}", flush=True)
            finally:
                tr.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(delta_line)
    for dtype in (torch.bfloat16, torch.float32):  # where the rest of a real engine's push goes
        t = engine_commit_seconds(model, dtype, repeat)
        print(f"torch engine's side of the bf16 push once received (checks + switch into a {str(dtype)[6:]} model, "
              f"WeightGroupReceiver._commit): {t:.4f} s, {t / t_mem:.2f}x memcpy")
    ratio = times[("distributed", "bf16")] / t_mem
    print(floor_line)
    print(f"goal distributed bf16 <= 2x memcpy: {ratio:.2f}x -> {'met' if ratio <= 2 else 'NOT met'}")
    for tr_name in ("disk", "distributed", "tensor"):
        plain = times[(tr_name, "bf16")]
        best = {label: overlapped[(tr_name, label)] for label, fmt in VARIANTS if fmt}  # what the plugins send
        cells = [f"{label} {times[(tr_name, label)] / plain:.2f} (overlapped {overlapped[(tr_name, label)] / plain:.2f})"
                 for label in best]
        ok = all(t <= plain for t in best.values())
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
