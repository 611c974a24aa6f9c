"""Per-sync weight-sync metrics: bytes sent, quantisation time and throughput.

The funnel records every parameter it handles (:func:`record_quantization`); the
``train.weight_sync_metrics`` patch times each ``update_weights`` call (:func:`sync_timer`) and
merges :func:`drain` into the updater's ``pop_metrics()``, which slime's actor logs with its perf
metrics (``log_perf_data``, on the TP0 / DP0 / last-PP rank). Values are this process's:
counters accumulate over the syncs since the last drain.

Keys (slime's ``perf/`` namespace):
  perf/weight_sync_bytes            bytes of the tensors the funnel returned (what goes on the wire)
  perf/weight_sync_source_bytes     bytes of the HF tensors it was given (model dtype)
  perf/weight_sync_quant_time       seconds spent quantising
  perf/weight_sync_quant_gbps       source GB quantised per second of quantisation time
  perf/weight_sync_quantized_params HF weights quantised
  perf/weight_sync_time             seconds in update_weights (all syncs since the last drain)
  perf/weight_sync_gbps             sent GB per second of update_weights time
  perf/weight_sync_count            syncs since the last drain
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

PREFIX = "perf/weight_sync_"
_lock = threading.RLock()
_local = threading.local()


class _Meter:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bytes_out = 0
        self.bytes_in = 0
        self.quant_seconds = 0.0
        self.quantized = 0
        self.sync_seconds = 0.0
        self.syncs = 0


_meter = _Meter()


def record_quantization(bytes_in: int, bytes_out: int, seconds: float, quantized: int) -> None:
    with _lock:
        _meter.bytes_in += int(bytes_in)
        _meter.bytes_out += int(bytes_out)
        _meter.quant_seconds += float(seconds)
        _meter.quantized += int(quantized)


@contextlib.contextmanager
def sync_timer() -> Iterator[None]:
    """Time one ``update_weights``; nested calls (a subclass calling its parent) count once."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            with _lock:
                _meter.sync_seconds += time.perf_counter() - start
                _meter.syncs += 1


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def snapshot() -> dict[str, float]:
    with _lock:
        m = _meter
        if not m.syncs and not m.bytes_out:
            return {}
        return {
            PREFIX + "bytes": float(m.bytes_out),
            PREFIX + "source_bytes": float(m.bytes_in),
            PREFIX + "quant_time": m.quant_seconds,
            PREFIX + "quant_gbps": _gbps(m.bytes_in, m.quant_seconds),
            PREFIX + "quantized_params": float(m.quantized),
            PREFIX + "time": m.sync_seconds,
            PREFIX + "gbps": _gbps(m.bytes_out, m.sync_seconds),
            PREFIX + "count": float(m.syncs),
        }


def drain() -> dict[str, float]:
    """The metrics since the last drain (empty when nothing was synced); resets the counters."""
    with _lock:
        out = snapshot()
        _meter.reset()
        return out


def reset() -> None:
    with _lock:
        _meter.reset()
