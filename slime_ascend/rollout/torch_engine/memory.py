"""``/release_memory_occupation`` and ``/resume_memory_occupation`` on the torch engine (slime's offload/onload
around training under ``--colocate``: ``offload_rollout``).

Release waits for in-flight requests to finish, writes the weights to a spill file (``torch.save`` in a
private temporary directory), frees every parameter's storage and hands the freed pages back to the
operating system (glibc ``malloc_trim``), so the process's resident memory goes down by the size of the
weights. The KV cache: the engine keeps none across requests (each request's cache lives while it
runs), so once requests have drained there is none left to drop; ``kv_cache`` is accepted as a tag and
only clears its flag. While the weights are released, ``/generate`` and ``/update_weights_*`` answer 503
naming the fix, and ``/health_generate`` reports unhealthy (slime pauses its health monitor meanwhile).

Resume (``tags`` ``None``, or a list of ``weights`` / ``kv_cache``, SGLang's names) reads the spill file
back into fresh storage and deletes it (a quantised version's checkpoint tensors, which ``/get_weights_by_name``
answers, are spilled and restored with them); the next generation is the one before the release, bit for bit.
A weight push after resume (slime's ``update_weights``) then overwrites them as usual.
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

__all__ = ["MemoryOccupation", "TAGS", "trim_heap"]

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")  # SGLang's GPU_MEMORY_TYPE_WEIGHTS / GPU_MEMORY_TYPE_KV_CACHE


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
                    torch.save({name: p.detach() for name, p in params.items()}, spill / "weights.pt")
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
        logger.info("released memory occupation: %.1f MB of weights spilled to %s", nbytes / 2**20, spill)
        return {"success": True, "message": f"released {nbytes} bytes of weights (no KV cache is held between "
                "requests)"}

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        wanted = set(TAGS if tags is None else tags)
        unknown = sorted(wanted - set(TAGS))
        if unknown:
            raise RequestError(f"resume_memory_occupation: unknown tags {unknown}; use {list(TAGS)} or leave tags out")
        with self._update_lock:
            restored = "weights" in wanted and "weights" in self._released
            if restored:
                with self._compute_lock:
                    spill = self._spill_dir
                    state = torch.load(spill / "weights.pt", weights_only=True)
                    for name, p in self.model.named_parameters():
                        p.data = state[name]
                    if (spill / "checkpoint.pt").exists():
                        self._served_checkpoint = torch.load(spill / "checkpoint.pt", weights_only=True)
                    self._spill_dir = None
                    shutil.rmtree(spill, ignore_errors=True)
            with self._state:
                self._released = frozenset(self._released - wanted)
                self._state.notify_all()
        if restored:
            logger.info("resumed memory occupation: weights restored")
        return {"success": True, "message": f"resumed {sorted(wanted)}"}
