"""A switched teacher engine fed over its weight-update group: the teacher's weights are staged in host memory
while the current teacher scores, and the switch *pushes* them to the engine (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed``, the path slime's own weight sync takes)
instead of asking it to reload a checkpoint from disk.

* ``stage`` (the pool's background thread, during scoring): every tensor of the teacher's checkpoint read into
  fresh host memory, pinned where an accelerator is present (:func:`..safetensors_dir.read_safetensors_dir`).
  That is the only host copy: the pool holds at most one staged teacher (its memory bound) and drops it after the
  push, off the switch's path.
* ``activate`` (the switch): joins the group with the engines once (this process is rank 0, engine ``i`` rank
  ``i + 1``, as slime's trainer joins it), then sends the staged tensors in buckets of ``bucket_bytes``: per
  bucket one ``/update_weights_from_distributed`` call to every engine (names, dtypes, shapes, a weight version
  naming the teacher) and one broadcast per tensor. An engine switches when it has the whole version; every
  engine must answer ``success`` for every bucket, else the switch fails (the pool marks the teacher failed).
  The whole tensors go out; an engine of tensor-parallel ranks shards them as it does slime's pushes.
* The weight version of a push is ``opd:<teacher>:<n>`` (n counts this loader's switches), so the engine's log
  and ``/get_weight_version`` name the teacher it serves.

``backend``: ``gloo`` (default) broadcasts from host memory; ``nccl`` / ``hccl`` need this process on the device
(the pool in a Ray actor with a GPU/NPU). Teachers that share an engine are checked at ``parse_args`` to be one
architecture (:mod:`.shared_engine`), so every push has the names and shapes the engine serves.
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from slime_ascend.json_client import JSONRequestError, request_json
from slime_ascend.opd.loaders import Staged, TeacherLoader, accelerator_available
from slime_ascend.opd.safetensors_dir import read_safetensors_dir
from slime_ascend.opd.teachers import TeacherSpec

__all__ = ["BACKENDS", "DistributedPushLoader", "buckets"]

BACKENDS = ("gloo", "nccl", "hccl")
GROUP_NAME = "slime_ascend_opd_teachers"


def buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Tensor names in ``state``'s order, cut into lists of at most ``bucket_bytes`` (a larger tensor alone)."""
    out: list[list[str]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out and out[-1] and size + nbytes <= bucket_bytes:
            out[-1].append(name)
            size += nbytes
        else:
            out.append([name])
            size = nbytes
    return out


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class DistributedPushLoader(TeacherLoader):
    """Switch HTTP teacher engines by pushing host-staged tensors over their weight-update group."""

    def __init__(
        self,
        engine_urls: str | Sequence[str],
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str = "gloo",
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 1800.0,
        pin_memory: bool | None = None,
        post: Callable[[str, dict[str, Any], float], Mapping[str, Any]] | None = None,
    ) -> None:
        urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
        if not urls:
            raise ValueError("engine_urls is empty; give the teacher engine URL(s)")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.pin = accelerator_available() if pin_memory is None else bool(pin_memory) and accelerator_available()
        self._post = post or (lambda url, payload, timeout_s: request_json(url, payload, timeout_s=timeout_s))
        self._group: Any = None
        self._pushes = itertools.count(1)
        self.pushed_bytes = 0  # bytes broadcast by every switch so far

    def stage(self, spec: TeacherSpec) -> Staged:
        state, nbytes = read_safetensors_dir(spec.checkpoint_dir, pin_memory=self.pin)
        return Staged(spec.name, state, nbytes, nbytes)

    def _calls(self, path: str, payloads: Sequence[dict[str, Any]]) -> tuple[list[threading.Thread], list[Any]]:
        """One POST ``path`` per engine (``payloads[i]`` to engine ``i``), each on a thread: the engines answer
        only once the broadcasts that follow have reached them."""
        answers: list[Any] = [None] * len(self.urls)

        def call(i: int) -> None:
            try:
                answers[i] = self._post(f"{self.urls[i]}{path}", payloads[i], self.timeout_s)
            except JSONRequestError as exc:
                answers[i] = {"success": False, "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - reported as that engine's refusal
                answers[i] = {"success": False, "message": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(self.urls))]
        for t in threads:
            t.start()
        return threads, answers

    def _finish(self, path: str, threads: list[threading.Thread], answers: list[Any], what: str) -> None:
        for t in threads:
            t.join(self.timeout_s)
        for url, answer in zip(self.urls, answers):
            if not isinstance(answer, Mapping) or not answer.get("success", False):
                why = answer.get("message", answer.get("error", answer)) if isinstance(answer, Mapping) else answer
                raise RuntimeError(f"{url}{path} refused {what}: {why}")

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        from slime_ascend.weight_sync.update_group import join_group

        port = self.master_port or _free_port(self.master_address)
        world = len(self.urls) + 1
        payloads = [{"master_address": self.master_address, "master_port": port, "rank_offset": i + 1,
                     "world_size": world, "group_name": GROUP_NAME, "backend": self.backend}
                    for i in range(len(self.urls))]
        threads, answers = self._calls("/init_weights_update_group", payloads)
        try:
            group = join_group(self.master_address, port, 0, world, GROUP_NAME, self.backend,
                               timeout_s=min(self.timeout_s, 600.0))
        finally:
            for t in threads:
                t.join(self.timeout_s)
        self._finish("/init_weights_update_group", [], answers, f"joining {GROUP_NAME!r}")
        self._group = group

    def activate(self, spec: TeacherSpec, staged: Staged) -> int:
        from slime_ascend.weight_sync.wire import wire_view

        state: dict[str, torch.Tensor] = staged.payload
        self._ensure_group()
        version = f"opd:{spec.name}:{next(self._pushes)}"
        device = torch.device("cpu") if self.backend == "gloo" else torch.accelerator.current_accelerator()
        for names in buckets(state, self.bucket_bytes):
            meta = {"names": names, "dtypes": [str(state[n].dtype).replace("torch.", "") for n in names],
                    "shapes": [list(state[n].shape) for n in names], "group_name": GROUP_NAME,
                    "weight_version": version, "flush_cache": True}
            threads, answers = self._calls("/update_weights_from_distributed", [meta] * len(self.urls))
            for name in names:
                tensor = state[name].contiguous()
                if tensor.device != device:
                    tensor = tensor.to(device, non_blocking=self.pin)
                torch.distributed.broadcast(wire_view(tensor, self.backend), 0, group=self._group)
                self.pushed_bytes += tensor.numel() * tensor.element_size()
            self._finish("/update_weights_from_distributed", threads, answers, f"teacher {spec.name!r} ({version})")
        self._garbage = state  # freed by the pool off the switch's path
        staged.payload = None
        return 0

    def close(self) -> None:
        """Leave the group (the engines drop it too)."""
        if self._group is None:
            return
        threads, answers = self._calls("/destroy_weights_update_group", [{"group_name": GROUP_NAME}] * len(self.urls))
        for t in threads:
            t.join(60)
        try:
            torch.distributed.destroy_process_group(self._group)
        except Exception:  # noqa: BLE001 - leaving is best effort
            pass
        self._group = None
