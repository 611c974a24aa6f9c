"""The torch engine's receiver of slime's weight broadcast: SGLang's ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group`` over gloo.

slime's sender (``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``) joins the
training rank 0 and every engine in one process group (rank 0 sends; engine ``i`` is rank ``rank_offset``), then
pushes the HF tensors of one weight version in buckets of ``--update-weight-buffer-size`` bytes: for each
bucket, one ``/update_weights_from_distributed`` call with its ``names``, ``dtypes``, ``shapes`` and
``weight_version``, and one ``broadcast`` per tensor, in that order. The backend is what slime's accelerator
maps ``nccl`` to: gloo on the ``cpu`` plugin (HCCL on ``npu``, which this CPU engine cannot join: refused).

Receiving, unlike SGLang (which loads each bucket into the serving model at once and sets the version at each
call): the buckets of a version are **staged** and the version serves only when all of them have arrived and
been checked, with the same checks and the same switch as ``update_weights_from_disk``
(names, shapes, dtypes, no NaN/inf; the engine drained, the weights swapped, the version set, atomically):

* a version is complete when every tensor name of the checkpoint the engine serves has arrived (tied weights
  may be absent), the same names ``slime-ascend quantize`` writes for a quantised one; a quantised version
  is dequantised with the served checkpoint's scheme, as the disk path dequantises what it loads;
* a broadcast that breaks off (the sender killed, the connection closed, a bucket's tensors not arriving
  within ``timeout_s``) drops its staged version and the group, and answers 503; a bucket missing from a
  version leaves it incomplete, and the first bucket of another version drops it. Either way the old version
  keeps serving, and the next ``init_weights_update_group`` and update work;
* gloo carries no float8: a float8 tensor travels as its bytes (``uint8``, same count), as the train side
  sends it (:mod:`slime_ascend.weight_sync.wire`; runtime patch ``train.gloo_float8_broadcast``);
* a **delta** bucket (``load_format`` ``slime_ascend.quant_delta:<block_bytes>:<base>:<digest>``, sent with a sync
  plugin's ``distributed_delta`` setting: :mod:`slime_ascend.weight_sync.distributed_delta`) carries only the changed
  blocks of a quantised version; they are applied into copies of the served version's tensors and the result is
  staged, checked and switched to as a full bucket would be (byte-identical). A delta against a version this
  engine does not serve, or against other bytes than it serves under that version (the delta's base digest is not
  the served version's), is answered ``{"success": false, "delta_refused": true}`` (its bytes taken, nothing
  staged) and the sender pushes the version whole; a full bucket of a version staged from deltas restarts it.
  Every answer names ``weight_version`` and whether it now ``serving`` (the sender keeps its base by it);
* ``keep_dir`` (``serve-torch --keep-received-weights DIR``): each version that served is also written, as
  received (the bytes on the wire), to ``DIR/weight_v{version:06d}/model.safetensors`` (never through a link; a
  directory of another user, or world-writable without the sticky bit, is refused at start: :mod:`.dump_dir`);
* ``timeout_s`` (``serve-torch --weight-group-timeout``, > 0) is one deadline for the whole of
  ``init_weights_update_group`` (waiting for the master's store, connecting, the group's rendezvous) and the time
  one bucket's tensors may take to arrive.

API (a benchmark may drive it directly): ``WeightGroupReceiver(engine, timeout_s=..., keep_dir=...)`` then
:meth:`~WeightGroupReceiver.init_group`, :meth:`~WeightGroupReceiver.receive`,
:meth:`~WeightGroupReceiver.destroy_group`, each with SGLang's request fields and answer
``{"success": True, "message": ...}``; refusals raise :class:`RequestError`. :class:`WeightGroup` is the
engine's mixin (the three endpoints, taking the request body; ``engine.weight_group`` is its receiver). The
engine supplies ``model``, ``model_path``, ``dtype``, ``quantization``, ``weight_version``,
``_max_checkpoint_bytes``, ``_update_lock`` and ``_switch_to(state, version, source, **fields)`` (the drained
swap of :mod:`.engine`, shared by every transport). A quantised version's tensors, as received, stay with it
(``_served_checkpoint``): ``/get_weights_by_name`` answers them (:mod:`.weight_read`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from slime_ascend.rollout.sglang_protocol import RequestError, check_weight_version
from slime_ascend.weight_sync.distributed_delta import (WIRE_NAMES, decode_delta, parse_delta_format,
                                                       tensor_digest, version_digest)
from slime_ascend.weight_sync.update_group import DEFAULT_TIMEOUT_S, join_group
from slime_ascend.weight_sync.wire import wire_view

from .dump_dir import check_dump_dir, private_subdir, replace_file
from .model import refuse_non_finite

__all__ = ["DEFAULT_TIMEOUT_S", "WIRE_DTYPES", "WeightGroup", "WeightGroupReceiver", "join_group", "wire_view"]

logger = logging.getLogger("slime_ascend.rollout.engine")

# dtype names slime sends (str(torch.dtype) without "torch.") -> dtype; others are refused
WIRE_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2")}
SUPPORTED_BACKENDS = ("gloo",)


def _keeps_finite(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every finite ``src`` value is finite in ``dst`` (bf16/fp16 -> fp32, fp16 -> bf16): the check can run on the
    received tensor, and the model's copy converts it."""
    return src == dst or (src.is_floating_point and dst.is_floating_point
                          and torch.finfo(src).max <= torch.finfo(dst).max)


def _leave(group: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception as exc:  # noqa: BLE001 - a broken group is dropped anyway
        logger.warning("leaving a weight-update group: %s", exc)


def _checkpoint_names(model_path: str | None, model: torch.nn.Module) -> set[str]:
    """The tensor names of the checkpoint the engine serves (its safetensors headers; the model's own state
    for the tiny random model): what one full weight push sends."""
    if model_path is None:
        return set(model.state_dict())
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


@dataclass
class _Staged:
    """The buckets of one version received so far."""

    version: str
    required: set[str]
    allowed: set[str]
    base: str | None = None  # a delta push: the version its blocks are applied to
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0
    buckets: int = 0
    last: float = field(default_factory=time.monotonic)

    def missing(self) -> int:
        return len(self.required - set(self.tensors))


class WeightGroupReceiver:
    """The receiving side of slime's ``update_weights_from_distributed`` for one engine (module docstring)."""

    def __init__(self, engine: Any, timeout_s: float = DEFAULT_TIMEOUT_S, keep_dir: str | None = None) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.engine = engine
        self.timeout_s = float(timeout_s)
        # created and checked now: refused at start, in one line (dump_dir.py)
        self.keep_dir = None if keep_dir is None else check_dump_dir(keep_dir, "--keep-received-weights")
        self._lock = threading.Lock()  # one group call at a time
        self._groups: dict[str, tuple[Any, str]] = {}  # name -> (process group, backend)
        self._staged: _Staged | None = None
        self._served_digest: tuple[dict[str, torch.Tensor], str] | None = None  # (served tensors, their digest)

    # ------------------------------------------------------------------ group
    def init_group(self, master_address: Any, master_port: Any, rank_offset: Any, world_size: Any,
                   group_name: Any, backend: Any = "nccl") -> dict[str, Any]:
        """SGLang's ``/init_weights_update_group``: join ``group_name`` as rank ``rank_offset`` (one engine rank:
        this engine is one unsharded server). Blocks until every rank joined, at most ``timeout_s``."""
        if not isinstance(master_address, str) or not master_address:
            raise RequestError("master_address must be a non-empty string")
        for key, value, low in (("master_port", master_port, 1), ("rank_offset", rank_offset, 1),
                                ("world_size", world_size, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise RequestError(f"{key} must be an integer >= {low}, got {value!r}")
        if master_port > 65535 or rank_offset >= world_size:
            raise RequestError(f"master_port must be <= 65535 and rank_offset < world_size, got {master_port}, "
                               f"{rank_offset}, {world_size}")
        if not isinstance(group_name, str) or not group_name:
            raise RequestError("group_name must be a non-empty string")
        if backend not in SUPPORTED_BACKENDS:
            raise RequestError(f"backend={backend!r}: {self.engine.engine_name} runs on the host CPU and joins gloo "
                               "groups only (slime asks for gloo under the cpu plugin; an npu/cuda job needs its "
                               "device engine)")
        with self._lock:
            old = self._groups.pop(group_name, None)
            if old is not None:  # slime reconnecting (e.g. after restarting engines): the old group is gone
                self._drop_staged("its group was re-initialised")
                _leave(old[0])
            try:
                group = join_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                                   self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a rendezvous that fails is the sender's problem: say it
                raise RequestError(f"could not join weight-update group {group_name!r} at {master_address}:"
                                   f"{master_port} as rank {rank_offset} of {world_size} within {self.timeout_s:g}s: "
                                   f"{type(exc).__name__}: {exc}", status=503) from None
            self._groups[group_name] = (group, backend)
        logger.info("joined weight-update group %s (%s, rank %d of %d)", group_name, backend, rank_offset, world_size)
        return {"success": True, "message": f"joined weight-update group {group_name!r} as rank {rank_offset}"}

    def destroy_group(self, group_name: Any) -> dict[str, Any]:
        """SGLang's ``/destroy_weights_update_group``; a version still staged on it is dropped."""
        with self._lock:
            entry = self._groups.pop(group_name, None) if isinstance(group_name, str) else None
            if entry is None:
                raise RequestError(f"no weight-update group {group_name!r} to destroy")
            self._drop_staged(f"group {group_name!r} was destroyed")
            _leave(entry[0])
        return {"success": True, "message": f"left weight-update group {group_name!r}"}

    def close(self) -> None:
        """Leave every group (a group's name is registered once per process) and drop what is staged."""
        with self._lock:
            self._drop_staged("the receiver was closed")
            for group, _ in self._groups.values():
                _leave(group)
            self._groups.clear()

    # ------------------------------------------------------------------ buckets
    def receive(self, names: Any, dtypes: Any, shapes: Any, group_name: Any, weight_version: Any = None,
                load_format: Any = None, flush_cache: Any = False) -> dict[str, Any]:
        """SGLang's ``/update_weights_from_distributed``: receive one bucket of ``weight_version`` and, when it
        completes the version, check it and switch to it (module docstring)."""
        with self._lock:
            entry = self._groups.get(group_name) if isinstance(group_name, str) else None
            if entry is None:
                raise RequestError(f"no weight-update group {group_name!r}; call /init_weights_update_group first")
            group, backend = entry
            try:
                delta = parse_delta_format(load_format)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
            if load_format is not None and delta is None:
                raise RequestError(f"load_format={load_format!r} is not supported (slime's bucketed broadcast "
                                   "sends none; a quantised delta sends 'slime_ascend.quant_delta:...')")
            if not isinstance(flush_cache, bool):
                raise RequestError("flush_cache must be true or false")
            version = check_weight_version(weight_version)
            if version is None:
                raise RequestError("weight_version is required: the buckets of one version are staged under it and "
                                   "it serves when all have arrived (slime sends str(version))")
            specs = self._specs(names, dtypes, shapes)
            if delta is None:
                buffers = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape in specs]
                wire = buffers
            else:
                entries, buffers = self._delta_specs(specs)
                if buffers[2][1].shape[1] != delta[0]:
                    raise RequestError(f"{WIRE_NAMES[2]} has blocks of {buffers[2][1].shape[1]} bytes, load_format "
                                       f"says {delta[0]}")
                wire = [(n, t) for n, t in buffers if t.numel()]  # the sender skips empty ones too
            staged, refusal, delta_refusal, base_tensors = None, None, None, None
            if delta is not None:
                delta_refusal, base_tensors = self._delta_base(delta[1], delta[2])
            if delta_refusal is None:
                try:
                    staged = self._stage_for(version, None if delta is None else delta[1])
                except RequestError as exc:  # still take the bytes, so the sender's broadcast completes and it hears why
                    refusal = exc
            received = 0
            try:
                from torch.distributed import BroadcastOptions

                opts = BroadcastOptions()
                opts.rootRank = 0
                opts.timeout = timedelta(seconds=self.timeout_s)
                works = [group.broadcast([wire_view(t, backend)], opts) for _, t in wire]
                for work in works:
                    work.wait()
                    received += 1
            except Exception as exc:  # noqa: BLE001 - the sender died, the group broke, a timeout
                self._drop_staged(f"its broadcast broke off after {received} of {len(wire)} tensors of a bucket")
                self._groups.pop(group_name, None)
                _leave(group)
                raise RequestError(
                    f"the broadcast of weight version {version} broke off ({type(exc).__name__}: "
                    f"{' '.join(str(exc).split())[:200]}); it is dropped and version {self.engine.weight_version} "
                    f"keeps serving. Fix: re-initialise the group (/init_weights_update_group) and push again",
                    status=503) from None
            if refusal is not None:
                raise refusal
            if delta_refusal is not None:  # the sender pushes this version whole instead
                if self._staged is not None and self._staged.version == version:
                    self._drop_staged("a delta bucket of it was refused")
                logger.info("weight version %s: delta refused (%s)", version, delta_refusal)
                return {"success": False, "delta_refused": True, "weight_version": version, "serving": False,
                        "message": f"delta refused: {delta_refusal}; push version {version} whole"}
            try:
                if delta is not None:
                    try:
                        bucket = decode_delta(base_tensors, entries, *(t for _, t in buffers), block_bytes=delta[0])
                    except ValueError as exc:
                        raise RequestError(f"weight version {version}: the delta bucket does not apply: {exc}; the "
                                           f"version is dropped and version {self.engine.weight_version} keeps "
                                           "serving") from None
                else:
                    bucket = buffers
                return self._add(staged, bucket)
            except RequestError:
                self._drop_staged("it was refused")
                raise

    def _delta_base(self, base: str, digest: str) -> tuple[str | None, dict[str, torch.Tensor] | None]:
        """``(why a delta against base cannot be applied here, None)`` or ``(None, the tensors of base)``: the
        engine must serve ``base`` as quantised tensors (``_served_checkpoint``, read under its update lock) whose
        :func:`version_digest` is ``digest`` (the bytes the sender acknowledged under that label; computed once per
        served version)."""
        engine = self.engine
        with engine._update_lock:
            served, version = getattr(engine, "_served_checkpoint", None), engine.weight_version
        if engine.quantization is None:
            return "this engine serves an unquantised checkpoint (deltas are of quantised versions)", None
        if served is None:
            return "this engine holds no quantised version now (its weights are released)", None
        if str(version) != base:
            return f"this engine serves weight version {version}, not the delta's base {base}", None
        if self._served_digest is None or self._served_digest[0] is not served:
            self._served_digest = (served, version_digest({n: tensor_digest(t) for n, t in served.items()}))
        if self._served_digest[1] != digest:
            return (f"this engine serves other bytes under weight version {base} than the sender acknowledged (base "
                    f"digest {self._served_digest[1]} here, {digest} in the delta)"), None
        return None, served

    @staticmethod
    def _delta_specs(specs: list[tuple[str, torch.dtype, list[int]]]
                     ) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], list[tuple[str, torch.Tensor]]]:
        """A delta bucket's metadata: its tensors' entries (not broadcast) and the three wire tensors' buffers."""
        entries, wire = specs[:-3], specs[-3:]
        want = [(WIRE_NAMES[0], torch.int64, 1), (WIRE_NAMES[1], torch.int64, 1), (WIRE_NAMES[2], torch.uint8, 2)]
        if not entries or [(n, d, len(s)) for n, d, s in wire] != want or wire[0][2] != [len(entries)]:
            raise RequestError(f"a delta bucket lists its tensors, then {', '.join(WIRE_NAMES)} (int64 "
                               f"[{len(entries)}], int64 [n], uint8 [m, block_bytes]); got "
                               f"{[(n, str(d)[6:], s) for n, d, s in wire]}")
        if any(n in WIRE_NAMES for n, _, _ in entries):
            raise RequestError(f"{WIRE_NAMES} name the delta's wire tensors, not weights")
        return ([(n, d, tuple(s)) for n, d, s in entries],
                [(n, torch.empty(s, dtype=d)) for n, d, s in wire])

    def _specs(self, names: Any, dtypes: Any, shapes: Any) -> list[tuple[str, torch.dtype, list[int]]]:
        """One bucket's metadata, refused (before any byte is received) when it is malformed or larger than a
        checkpoint of this architecture."""
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise RequestError("names, dtypes and shapes must be lists")
        if not names or not len(names) == len(dtypes) == len(shapes):
            raise RequestError(f"names, dtypes and shapes must be non-empty lists of one length, got {len(names)}, "
                               f"{len(dtypes)}, {len(shapes)}")
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise RequestError("names must be distinct non-empty strings")
        out, total = [], 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if dtype not in WIRE_DTYPES:
                raise RequestError(f"{name}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                    for d in shape)):
                raise RequestError(f"{name}: shape must be a list of non-negative integers, got {shape!r}")
            numel = math.prod(shape)
            total += numel * WIRE_DTYPES[dtype].itemsize
            if total > self.engine._max_checkpoint_bytes:
                raise RequestError(f"bucket of {len(names)} tensors holds more than {self.engine._max_checkpoint_bytes} "
                                   "bytes, more than a checkpoint of the loaded architecture", status=413)
            out.append((name, WIRE_DTYPES[dtype], shape))
        return out

    def _stage_for(self, version: str, base: str | None = None) -> _Staged:
        staged = self._staged
        if staged is not None and staged.version == version and staged.base != base:
            kinds = ("full" if staged.base is None else "delta", "full" if base is None else "delta")
            self._drop_staged(f"a {kinds[1]} bucket of it arrived after {kinds[0]} ones (the sender fell back)")
            staged = None
        if staged is not None and staged.version == version and time.monotonic() - staged.last > self.timeout_s:
            self._drop_staged(f"no bucket arrived for {self.timeout_s:g}s")
            staged = None
        if staged is not None and staged.version != version:
            self._drop_staged(f"a bucket of version {version} arrived before it was complete")
            staged = None
        if staged is None:
            if version == self.engine.weight_version:
                raise RequestError(f"weight version {version} is already serving; a push needs a new version")
            required = _checkpoint_names(self.engine.model_path, self.engine.model)
            tied = set(getattr(self.engine.model, "_tied_weights_keys", None) or ()) if getattr(
                self.engine.model.config, "tie_word_embeddings", False) else set()
            staged = self._staged = _Staged(version, required - tied, required | tied, base)
        return staged

    def _add(self, staged: _Staged, buffers: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        unknown = [n for n, _ in buffers if n not in staged.allowed]
        again = [n for n, _ in buffers if n in staged.tensors]
        if unknown or again:
            raise RequestError(f"weight version {staged.version}: names not in the served checkpoint {unknown[:5]} "
                               f"(total {len(unknown)}), sent twice {again[:5]} (total {len(again)}); the version is "
                               f"dropped and version {self.engine.weight_version} keeps serving")
        staged.tensors.update(buffers)
        staged.nbytes += sum(t.numel() * t.element_size() for _, t in buffers)
        staged.buckets += 1
        staged.last = time.monotonic()
        if staged.nbytes > self.engine._max_checkpoint_bytes:
            raise RequestError(f"weight version {staged.version} holds more than {self.engine._max_checkpoint_bytes} "
                               "bytes, more than a checkpoint of the loaded architecture", status=413)
        missing = staged.missing()
        if missing:
            return {"success": True, "weight_version": staged.version, "serving": False,
                    "message": f"staged bucket {staged.buckets} of weight version {staged.version} "
                               f"({len(staged.tensors)} tensors, {missing} to come)"}
        self._staged = None
        self._commit(staged)
        return {"success": True, "weight_version": staged.version, "serving": True,
                "message": f"weight version {staged.version} complete ({staged.buckets} buckets, "
                           f"{len(staged.tensors)} tensors) and serving"}

    def _commit(self, staged: _Staged) -> None:
        """Check the complete version like a checkpoint on disk and switch to it."""
        engine = self.engine
        source = f"weight version {staged.version} (update_weights_from_distributed)"
        state = staged.tensors
        try:
            if engine.quantization is not None:
                from slime_ascend.quant.hf_config import spec_from_checkpoint
                from slime_ascend.quant.params import dequantize_named_params

                state = dequantize_named_params(state, spec_from_checkpoint(engine.model_path), engine.dtype)
            else:  # converted where the model's dtype is narrower (checked as it will hold them), else as received
                state = {k: v.to(engine.dtype) if v.is_floating_point() and not _keeps_finite(v.dtype, engine.dtype)
                         else v for k, v in state.items()}
            from . import model as reference_model

            # finiteness on the tensors as pushed (per expert), not on the model's stacked layout
            reference_model.validate_state_dict(engine.model, state, source=source, check_finite=False)
            refuse_non_finite(state, source)
            with engine._update_lock:
                check_released = getattr(engine, "_check_weights_present", None)
                if check_released is not None:  # the weights were released (--colocate offload): no swap into them
                    check_released("update_weights_from_distributed")
                # a quantised version's tensors as received: what /get_weights_by_name answers (weight_read.py)
                served = dict(staged.tensors) if engine.quantization is not None else None
                engine._switch_to(state, staged.version, source="update_weights_from_distributed",
                                  _served_checkpoint=served)
        except (ValueError, TypeError, KeyError) as exc:
            raise RequestError(f"{source} refused: {exc}; version {engine.weight_version} keeps serving") from None
        logger.info("switched to weight version %s from %d buckets of update_weights_from_distributed (%s%s)",
                    staged.version, staged.buckets, engine.quantization or "unquantised",
                    "" if staged.base is None else f", a delta against version {staged.base}")
        if self.keep_dir is not None:
            try:
                self._keep(staged)
            except (OSError, ValueError) as exc:  # a full disk: the version serves anyway; say it once per version
                logger.warning("--keep-received-weights: weight version %s serves but was not kept in %s (%s)",
                               staged.version, self.keep_dir, " ".join(str(exc).split())[:300])

    def _keep(self, staged: _Staged) -> None:
        from safetensors.torch import save

        name = f"weight_v{int(staged.version):06d}" if staged.version.isdigit() else f"weight_{staged.version}"
        out = private_subdir(self.keep_dir, name)  # never a link, never another user's (dump_dir.py)
        data = save({k: v.contiguous() for k, v in staged.tensors.items()})
        replace_file(out, "model.safetensors", lambda f: f.write(data))

    def _drop_staged(self, why: str) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            logger.warning("weight version %s dropped after %d buckets (%d tensors, %d missing): %s; version %s "
                           "keeps serving", staged.version, staged.buckets, len(staged.tensors), staged.missing(),
                           why, self.engine.weight_version)


_INIT_KEYS = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
_UPDATE_KEYS = ("names", "dtypes", "shapes", "group_name", "weight_version", "load_format", "flush_cache")


def _fields(body: Any, keys: tuple[str, ...], required: tuple[str, ...], what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"{what}: the request body must be a JSON object")
    unknown = sorted(set(body) - set(keys))
    missing = [k for k in required if k not in body]
    if unknown or missing:
        raise RequestError(f"{what}: unknown fields {unknown}, missing fields {missing} (SGLang's fields: "
                           f"{', '.join(keys)})")
    return {k: body[k] for k in keys if k in body}


class WeightGroup:
    """Mixin of :class:`~slime_ascend.rollout.torch_engine.engine.TorchEngine`: SGLang's three weight-group
    endpoints, each taking the request body, served by :attr:`weight_group` (a :class:`WeightGroupReceiver`;
    ``serve-torch --keep-received-weights`` sets its ``keep_dir``)."""

    @property
    def weight_group(self) -> WeightGroupReceiver:
        receiver = self.__dict__.get("_weight_group")
        if receiver is None:
            receiver = self.__dict__["_weight_group"] = WeightGroupReceiver(self)
        return receiver

    def configure_weight_group(self, timeout_s: float | None = None, keep_dir: str | None = None) -> None:
        """A new receiver with these settings (``timeout_s`` None: :data:`DEFAULT_TIMEOUT_S`); before any group."""
        self.__dict__["_weight_group"] = WeightGroupReceiver(
            self, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, keep_dir=keep_dir)

    def init_weights_update_group(self, body: Any) -> dict[str, Any]:
        return self.weight_group.init_group(**_fields(body, _INIT_KEYS, _INIT_KEYS[:5], "init_weights_update_group"))

    def update_weights_from_distributed(self, body: Any) -> dict[str, Any]:
        return self.weight_group.receive(**_fields(body, _UPDATE_KEYS, _UPDATE_KEYS[:4],
                                                   "update_weights_from_distributed"))

    def destroy_weights_update_group(self, body: Any) -> dict[str, Any]:
        return self.weight_group.destroy_group(**_fields(body, ("group_name",), ("group_name",),
                                                         "destroy_weights_update_group"))
