"""``/release_memory_occupation`` and ``/resume_memory_occupation`` on the torch engine (slime's offload/onload
around training under ``--colocate``: ``offload_rollout``).

Release waits for in-flight requests to finish, writes the weights to a spill file (``torch.save`` in a
private temporary directory), frees every parameter's storage and hands the freed pages back to the
operating system (glibc ``malloc_trim``), so the process's resident memory goes down by the size of the
weights. The KV cache: each request's cache lives while it runs, and the one cache kept across requests, the
prefix cache (``prefix_cache.py``, off unless ``--prefix-cache-tokens``), is emptied at every release
(``engine.py``); ``kv_cache`` is accepted as a tag and only clears its flag; so does ``cuda_graph`` (the engine captures no graphs), which slime's ``onload_kv``
sends with ``kv_cache`` (SGLang's ``GPU_MEMORY_TYPE_CUDA_GRAPH``). While the weights are released,
``/generate`` and ``/update_weights_*`` answer 503 naming the fix, and ``/health_generate`` reports unhealthy
(slime pauses its health monitor meanwhile).

Resume (``tags`` ``None``, or a list of ``weights`` / ``kv_cache`` / ``cuda_graph``, SGLang's
``GPU_MEMORY_ALL_TYPES``) reads the spill file back into fresh storage and deletes it (a quantised version's checkpoint tensors, which ``/get_weights_by_name``
answers, are spilled and restored with them); the next generation is the one before the release, bit for bit.
A weight push after resume (slime's ``update_weights``) then overwrites them as usual.

Both log one line with the process's resident memory (``/proc/self/statm``) before and after, the evidence
slime's own log carries for a slime-managed engine under ``--colocate``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..sglang_protocol import RequestError
from . import device as engine_device

__all__ = ["TAGS", "MemoryOccupation", "resident_bytes", "trim_heap"]

logger = logging.getLogger(__name__)

# SGLang's GPU_MEMORY_ALL_TYPES: GPU_MEMORY_TYPE_WEIGHTS / _KV_CACHE / _CUDA_GRAPH (slime's onload_kv sends the last two)
TAGS = ("weights", "kv_cache", "cuda_graph")


def resident_bytes() -> int | None:
    """The process's resident set size (``/proc/self/statm``), None where there is no procfs."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return None


def _page_size() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


def _mb(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**20:.1f}"


def trim_heap() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim(0)``); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


class MemoryOccupation:
    """Mixin of :class:`~slime_ascend.rollout.torch_engine.engine.TorchEngine` (module docstring). Uses the
    engine's ``model``, ``_state``, ``_running``, ``_update_lock`` and ``_compute_lock``."""

    _released: frozenset[str] = frozenset()
    _spill_dir: Path | None = None

    def _check_weights_present(self, what: str) -> None:
        """RequestError(503) while the weights are released."""
        if "weights" in self._released:
            raise RequestError(f"{what}: the weights are released (release_memory_occupation); call "
                               "resume_memory_occupation first", status=503)

    def release_memory_occupation(self) -> dict[str, Any]:
        rss_before = resident_bytes()
        device_before = engine_device.memory_allocated(self.device)
        with self._update_lock:
            if "weights" in self._released:
                return {"success": True, "message": "memory already released"}
            with self._state:
                self._released = frozenset(TAGS)  # refuses new requests from here on
                self._state.wait_for(lambda: not self._running, timeout=120.0)
                if self._running:
                    self._released = frozenset()
                    raise RequestError("release_memory_occupation: requests still running after 120 s; pause or "
                                       "abort them first", status=409)
            with self._compute_lock:
                spill = Path(tempfile.mkdtemp(prefix="torch-engine-weights-"))
                try:
                    params = dict(self.model.named_parameters())  # tied weights once
                    torch.save({name: p.detach().cpu() for name, p in params.items()}, spill / "weights.pt")
                    served = getattr(self, "_served_checkpoint", None)  # a quantised version's tensors (weight_read)
                    if served is not None:
                        torch.save(served, spill / "checkpoint.pt")
                except BaseException:
                    shutil.rmtree(spill, ignore_errors=True)
                    with self._state:
                        self._released = frozenset()
                    raise
                nbytes = 0
                for p in params.values():
                    nbytes += p.numel() * p.element_size()
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                if served is not None:
                    nbytes += sum(t.numel() * t.element_size() for t in served.values())
                    self._served_checkpoint = None
                self._spill_dir = spill
            gc.collect()
            trim_heap()
            engine_device.empty_cache(self.device)  # a device's cached blocks back to it (device.py)
        rss_after = resident_bytes()
        device_after = engine_device.memory_allocated(self.device)
        on_device = ("" if device_before is None else
                     f"; {self.device} allocated {_mb(device_before)} -> {_mb(device_after)} MB")
        logger.info("released memory occupation: %d bytes of weights spilled to %s (resident %s -> %s MB%s)", nbytes,
                    spill, _mb(rss_before), _mb(rss_after), on_device)
        answer = {"success": True, "message": f"released {nbytes} bytes of weights (the prefix cache, if any, "
                  "is emptied)", "resident_bytes_before": rss_before, "resident_bytes_after": rss_after}
        if device_before is not None:
            answer.update(device_bytes_before=device_before, device_bytes_after=device_after)
        return answer

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        wanted = set(TAGS if tags is None else tags)
        unknown = sorted(wanted - set(TAGS))
        if unknown:
            raise RequestError(f"resume_memory_occupation: unknown tags {unknown}; use {list(TAGS)} or leave tags out")
        rss_before = resident_bytes()
        with self._update_lock:
            restored = "weights" in wanted and "weights" in self._released
            if restored:
                with self._compute_lock:
                    spill = self._spill_dir
                    state = torch.load(spill / "weights.pt", weights_only=True)
                    for name, p in self.model.named_parameters():
                        p.data = state[name].to(self.device)
                    if (spill / "checkpoint.pt").exists():
                        self._served_checkpoint = torch.load(spill / "checkpoint.pt", weights_only=True)
                    self._spill_dir = None
                    shutil.rmtree(spill, ignore_errors=True)
            with self._state:
                self._released = frozenset(self._released - wanted)
                self._state.notify_all()
        if restored:
            nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            served = getattr(self, "_served_checkpoint", None)
            if served is not None:
                nbytes += sum(t.numel() * t.element_size() for t in served.values())
            logger.info("resumed memory occupation: %d bytes of weights restored (resident %s -> %s MB)", nbytes,
                        _mb(rss_before), _mb(resident_bytes()))
        return {"success": True, "message": f"resumed {sorted(wanted)}"}
