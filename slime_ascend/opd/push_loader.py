"""A switched teacher engine fed pushed weights: the teacher's weights are staged in host memory while the current
teacher scores, and the switch *pushes* them to the engine over one of SGLang's update paths instead of asking it to
reload a checkpoint from disk. Two transports, one staging and hand-over:

* :class:`DistributedPushLoader` (``ascend_opd_switch_transport: distributed``): the engine's weight-update group,
  ``/init_weights_update_group`` + ``/update_weights_from_distributed``, the path slime's own weight sync takes.
  The switch joins the group with the engines once (this process is rank 0, engine ``i`` rank ``i + 1``, as slime's
  trainer joins it), then sends the staged tensors in buckets of ``bucket_bytes``: per bucket one
  ``/update_weights_from_distributed`` call to every engine (names, dtypes, shapes, a weight version naming the
  teacher) and one broadcast per tensor. Every byte crosses the group during the switch. ``backend``: ``gloo``
  (default) broadcasts from host memory; ``nccl`` / ``hccl`` need this process on the device.
* :class:`TensorPushLoader` (``ascend_opd_switch_transport: tensor``): ``/update_weights_from_tensor``, the path of
  slime's colocated push. The teacher is staged in shared memory (torch's ``file_system`` sharing: named
  shared-memory files another process on the host opens), and each bucket is one call carrying handles to it, as
  slime's ``MultiprocessingSerializer`` writes them: the engine reads the bytes in place and copies them into its
  weights, so the switch costs one memory copy of the teacher. Engines on the same host as the pool only.

Common to both:

* ``stage`` (the pool's background thread, during scoring): every tensor of the teacher's checkpoint read into
  fresh host memory (:func:`..safetensors_dir.read_safetensors_dir`; pinned where an accelerator is present for
  ``distributed``, shared for ``tensor``). That is the only host copy: the pool holds at most one staged teacher
  (its memory bound) and drops it after the push, off the switch's path.
* ``activate`` (the switch): the buckets, each sent to every engine at once; an engine switches when it has the
  whole version, and every engine must answer ``success`` for every bucket, else the switch fails (the pool marks
  the teacher failed). The whole tensors go out; an engine of tensor-parallel ranks shards them as it does
  slime's pushes.
* The weight version of a push is ``opd:<teacher>:<n>`` (n counts this loader's switches), so the engine's log
  and ``/get_weight_version`` name the teacher it serves.

Teachers that share an engine are checked at ``parse_args`` to be one architecture (:mod:`.shared_engine`), so
every push has the names and shapes the engine serves.
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

__all__ = ["BACKENDS", "DistributedPushLoader", "TensorPushLoader", "buckets"]

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


class _PushLoader(TeacherLoader):
    """What both transports share: the engines, the buckets, one call per engine at once, the versions."""

    def __init__(self, engine_urls: str | Sequence[str], bucket_bytes: int, timeout_s: float,
                 post: Callable[[str, dict[str, Any], float], Mapping[str, Any]] | None) -> None:
        urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
        if not urls:
            raise ValueError("engine_urls is empty; give the teacher engine URL(s)")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._post = post or (lambda url, payload, timeout_s: request_json(url, payload, timeout_s=timeout_s))
        self._pushes = itertools.count(1)
        self.pushed_bytes = 0  # bytes pushed by every switch so far

    def _version(self, spec: TeacherSpec) -> str:
        return f"opd:{spec.name}:{next(self._pushes)}"

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


class DistributedPushLoader(_PushLoader):
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
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        super().__init__(engine_urls, bucket_bytes, timeout_s, post)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.pin = accelerator_available() if pin_memory is None else bool(pin_memory) and accelerator_available()
        self._group: Any = None

    def stage(self, spec: TeacherSpec) -> Staged:
        state, nbytes = read_safetensors_dir(spec.checkpoint_dir, pin_memory=self.pin)
        return Staged(spec.name, state, nbytes, nbytes)


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
        version = self._version(spec)
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


class TensorPushLoader(_PushLoader):
    """Switch HTTP teacher engines on this host by handing them the staged teacher in shared memory
    (``/update_weights_from_tensor``, the path of slime's colocated push; module docstring)."""

    # a call carries handles, not bytes (about 240 bytes of JSON a tensor): by default the whole teacher goes in one
    # call, so that the engine copies it straight into its weights; at most this many tensors a call keeps the
    # request under the engine's body limit (the torch engine's 4 MiB, http_server.DEFAULT_MAX_BODY_BYTES)
    MAX_TENSORS_PER_CALL = 8192

    def __init__(
        self,
        engine_urls: str | Sequence[str],
        *,
        bucket_bytes: int = 1 << 62,
        timeout_s: float = 1800.0,
        post: Callable[[str, dict[str, Any], float], Mapping[str, Any]] | None = None,
        donate: bool = True,
    ) -> None:
        super().__init__(engine_urls, bucket_bytes, timeout_s, post)
        self.donate = donate  # False: every engine copies the teacher, as SGLang does (bench_teacher_switch's control)
        self._ranks: list[int] | None = None  # each engine's tensor-parallel ranks: one string each
        self._donates: list[bool] = []  # each engine's: whether it takes donated tensors (the torch engine)
        self._serving: dict[str, torch.Tensor] | None = None  # the teacher the engines adopted, while they serve it

    def stage(self, spec: TeacherSpec) -> Staged:
        from slime_ascend.weight_sync.tensor_sharing import use_file_system_sharing

        use_file_system_sharing()  # before the tensors are shared: named files the engine can open
        state, nbytes = read_safetensors_dir(spec.checkpoint_dir, share_memory=True)
        return Staged(spec.name, state, nbytes, nbytes)

    def _engine_ranks(self) -> list[int]:
        if self._ranks is None:
            ranks = []
            for url in self.urls:
                try:
                    info = self._post(f"{url}/get_server_info", None, min(self.timeout_s, 60.0))
                except JSONRequestError as exc:
                    raise RuntimeError(f"{url}/get_server_info: {exc}") from None
                ranks.append(int(info.get("tp_size", 1) or 1) if isinstance(info, Mapping) else 1)
                # the staged teacher is never written again once pushed: an engine that says it takes donated
                # tensors (the torch engine, tensor_update.py) may serve it in place of a copy; SGLang copies it, and
                # gets no such field
                self._donates.append(self.donate and isinstance(info, Mapping) and info.get("donate_tensors") is True)
            self._ranks = ranks
        return self._ranks

    def activate(self, spec: TeacherSpec, staged: Staged) -> int:
        from slime_ascend.weight_sync.tensor_sharing import serialize_named_tensors

        state: dict[str, torch.Tensor] = staged.payload
        ranks = self._engine_ranks()
        version = self._version(spec)
        calls = [names[i:i + self.MAX_TENSORS_PER_CALL] for names in buckets(state, self.bucket_bytes)
                 for i in range(0, len(names), self.MAX_TENSORS_PER_CALL)]
        for names in calls:
            text = serialize_named_tensors([(n, state[n]) for n in names])
            payloads = [{"serialized_named_tensors": [text] * r, "flush_cache": True, "weight_version": version,
                         **({"donate_tensors": True} if donates else {})} for r, donates in zip(ranks, self._donates)]
            threads, answers = self._calls("/update_weights_from_tensor", payloads)
            try:
                self._finish("/update_weights_from_tensor", threads, answers, f"teacher {spec.name!r} ({version})")
            except RuntimeError as exc:
                if "unpickle" not in str(exc):
                    raise
                raise RuntimeError(f"{exc} (ascend_opd_switch_transport: tensor hands the engines shared memory of "
                                   "this host: they must run on the pool's host; else use 'distributed')") from None
            self.pushed_bytes += sum(state[n].numel() * state[n].element_size() for n in names)
        # freed by the pool off the switch's path. A teacher the engines adopted (donate_tensors) is their weights:
        # held here until they switched away from it, so that their switch only unmaps its pages (0.02 s for
        # 1 GiB on this host) and the freeing of them (0.12-0.2 s) falls to the pool's background thread
        held, self._serving = self._serving, (state if any(self._donates) else None)
        self._garbage = [held] if self._serving is not None else [held, state]
        staged.payload = None
        return 0  # what the pool holds of the served teacher is the engines' own memory
