"""``/update_weights_from_tensor`` on the torch engine: slime's colocated weight push (``--colocate``).

What slime sends (``slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py``,
``_send_to_colocated_engine``): one call per bucket of HF tensors, each with
``serialized_named_tensors`` (one base64 string per engine rank, ``MultiprocessingSerializer`` =
``ForkingPickler``), ``load_format="flattened_bucket"`` (each string a dict ``{"flattened_tensor":
uint8 tensor, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}``;
without it, a list of ``(name, tensor)``) and ``weight_version=str(n)``. The tensors themselves are
torch's shared-memory handles: on the host the train side must pickle them with torch's
``file_system`` sharing strategy (:func:`use_file_system_sharing`), since a ``file_descriptor`` handle
can only be opened by a child of the sender.

The engine is one unsharded process, so it reads the first rank's string only (every rank of slime's
gather group holds the same full HF tensors; the others are not opened). Unpickling is restricted to torch's tensor-rebuild functions and plain
containers (:class:`TensorUnpickler`); sglang's metadata class is read into a stand-in, so the engine
needs no sglang.

Each bucket is checked (known names, shapes, dtype kind, finite values) in place in the sender's shared
memory, and staged in the engine's own memory under its version (a bucket that completes the version is copied
straight into the model: a whole model in one call costs one copy); the version switches, atomically, once its staged tensors cover every
weight of the model (slime pushes the full model every update). A bucket of a new version drops what
was staged for another. So a version serves only when all of it has arrived and been checked, and the
engine reports it (``/get_weight_version``, each answer's ``meta_info.weight_version``) exactly as after
``/update_weights_from_disk``.

A quantised checkpoint (the ``fp8-sync`` / ``int8-sync`` / ``int4-sync`` plugins quantise on the train side, so
slime's colocated push carries the names and bytes ``slime-ascend quantize`` writes): the names are those of the
served checkpoint's safetensors, each tensor's shape and dtype must be the one the served checkpoint holds
(the bytes are kept as received, no cast), and the complete version is dequantised with the checkpoint's scheme
and checked like the disk path's; its tensors as received become what ``/get_weights_by_name`` answers
(:mod:`.weight_read`), as on the distributed path.

``donate_tensors: true`` (this engine's field; SGLang's request has none and ignores it) says the sender hands the
tensors over: it keeps no reference it will write (the ``opd`` pool's staged teacher, dropped once pushed). An
unquantised version's tensors that have the parameter's device, dtype and shape then become the model's weights in
place of a copy (:func:`~slime_ascend.rollout.torch_engine.model.apply_state_dict`): the sender's shared memory
itself, or the engine's own conversion of a tensor of another dtype; still checked like any other. slime's own colocated push never sets it: its buckets are the train side's memory.
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
from typing import Any

import torch

from ..sglang_protocol import RequestError, check_weight_version
from slime_ascend.weight_sync.tensor_sharing import use_file_system_sharing
from . import model as reference_model

__all__ = ["TensorUpdate", "TensorUnpickler", "decode_named_tensors", "use_file_system_sharing"]

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "flattened_bucket", "direct")


class FlattenedTensorMetadata:
    """Stand-in for ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` (a dataclass pickled
    by its fields)."""

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError("FlattenedTensorMetadata state is not a dict")
        self.__dict__.update(state)


_METADATA_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"),
}
# What ForkingPickler writes for CPU tensors under the file_system strategy (listed by unpickling sglang's
# FlattenedTensorBucket and (name, tensor) lists, every pickle protocol, with torch 2.14): no path to an arbitrary
# callable. Not here, on purpose: torch.storage._load_from_bytes (torch.load(weights_only=False) of bytes from the
# wire: any code; torch only writes it for plain pickle.dumps of a storage, never for ForkingPickler's shared
# handles), and an unrestricted builtins.getattr (getattr chains reach every module: see _torch_dtype).
_ALLOWED_GLOBALS = {
    ("builtins", "list"), ("builtins", "dict"), ("builtins", "tuple"), ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("torch", "Size"), ("torch", "Tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
}
_FD_GLOBALS = {("torch.multiprocessing.reductions", "rebuild_storage_fd"), ("multiprocessing.resource_sharer", "DupFd")}


def _torch_dtype(obj: Any, name: Any) -> torch.dtype:
    """What an old-protocol pickle's ``getattr(torch, "bfloat16")`` may fetch: a dtype of torch, nothing else."""
    value = getattr(torch, name, None) if obj is torch and isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        what = getattr(obj, "__name__", type(obj).__name__)
        raise RequestError(f"update_weights_from_tensor: refusing getattr({what}, {str(name)[:40]!r}) (only "
                           "getattr(torch, <dtype name>) is accepted)")
    return value


class TensorUnpickler(pickle.Unpickler):
    """Unpickles what slime's ``MultiprocessingSerializer`` writes for CPU tensors, nothing else: torch's
    rebuild functions, dtypes, plain containers, and sglang's metadata (into :class:`FlattenedTensorMetadata`).
    No path to an arbitrary callable: ``torch.storage._load_from_bytes`` is refused and ``getattr`` fetches
    torch's dtypes only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _torch_dtype
        if (module, name) in _METADATA_CLASSES:
            return FlattenedTensorMetadata
        if (module, name) in _FD_GLOBALS:
            raise RequestError("the tensors were pickled as file descriptors (torch's default sharing strategy), "
                               "which only the sender's children can open; the train side must use "
                               "torch.multiprocessing.set_sharing_strategy('file_system') (the torch-engine plugin "
                               "sets it in slime's train actors)")
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RequestError(f"update_weights_from_tensor: refusing to unpickle {module}.{name} (only tensors, their "
                           "metadata and plain containers are accepted)")


def _loads(text: Any) -> Any:
    if not isinstance(text, str):
        raise RequestError("serialized_named_tensors must hold base64 strings (MultiprocessingSerializer with "
                           f"output_str=True), got {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise RequestError(f"serialized_named_tensors: not base64 ({exc})") from None
    try:
        return TensorUnpickler(io.BytesIO(data)).load()
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken or expired payload is the client's error
        raise RequestError(f"serialized_named_tensors: cannot unpickle ({type(exc).__name__}: {exc}); a shared "
                           "tensor must stay alive on the sender until the call returns") from None


def decode_named_tensors(serialized: Any, load_format: str | None, copy: bool = True
                         ) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of the first rank's string of ``serialized_named_tensors``, copied out of the
    sender's shared memory (``copy=False``: views of it, valid only until the call returns)."""
    if load_format not in LOAD_FORMATS:
        raise RequestError(f"load_format={load_format!r} is not supported by update_weights_from_tensor (use "
                           "'flattened_bucket', as slime sends, or leave it out)")
    if not isinstance(serialized, list) or not serialized:
        raise RequestError("serialized_named_tensors must be a non-empty list (one string per engine rank)")
    obj = _loads(serialized[0])
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
            raise RequestError("a flattened_bucket payload must be {'flattened_tensor': tensor, 'metadata': [...]}")
        flat, metadata = obj["flattened_tensor"], obj["metadata"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise RequestError("flattened_tensor must be a 1-D uint8 tensor")
        out = []
        for meta in metadata:
            try:
                name, dtype, shape = meta.name, meta.dtype, tuple(meta.shape)
                start, end = int(meta.start_idx), int(meta.end_idx)
            except AttributeError as exc:
                raise RequestError(f"flattened_bucket metadata entry lacks a field ({exc})") from None
            if not (0 <= start <= end <= flat.numel()):
                raise RequestError(f"{name}: bytes [{start}, {end}) are outside the bucket of {flat.numel()} bytes")
            piece = flat[start:end]
            if piece.storage_offset() % dtype.itemsize:
                piece = piece.clone()  # a tensor after an odd-sized one (int8, bool) starts unaligned for its dtype
            try:
                tensor = piece.view(dtype).reshape(shape)
            except RuntimeError as exc:
                raise RequestError(f"{name}: {end - start} bytes are not a {dtype} tensor of shape {shape} ({exc})"
                                   ) from None
            out.append((name, tensor.clone() if copy else tensor))
        return out
    if not isinstance(obj, list | tuple) or not all(
            isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj):
        raise RequestError("a payload without load_format must be a list of (name, tensor) pairs")
    return [(name, tensor.detach().clone() if copy else tensor.detach()) for name, tensor in obj]


class TensorUpdate:
    """Mixin of :class:`~slime_ascend.rollout.torch_engine.engine.TorchEngine`: SGLang's
    ``update_weights_from_tensor`` (module docstring). Uses the engine's locks and drain state, and for a
    quantised checkpoint its ``quantization``, ``model_path`` and ``_served_checkpoint``."""

    def update_weights_from_tensor(self, serialized_named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = False, weight_version: Any = None,
                                   donate_tensors: Any = False, **_: Any) -> dict[str, Any]:
        version = check_weight_version(weight_version)
        if not isinstance(donate_tensors, bool):
            raise RequestError(f"update_weights_from_tensor: donate_tensors must be true or false, got "
                               f"{donate_tensors!r}")
        check_released = getattr(self, "_check_weights_present", None)
        if check_released is not None:
            check_released("update_weights_from_tensor")
        quantization = getattr(self, "quantization", None)
        # unquantised: the bucket is read in place from the sender's shared memory and copied once, into the
        # model when it completes the version (a whole model in one call: no copy beside the model's), else into
        # the version's staged tensors; quantised: kept as received (they become /get_weights_by_name's answer)
        named = decode_named_tensors(serialized_named_tensors, load_format, copy=quantization is not None)
        with self._update_lock:
            staged = self.__dict__.setdefault("_staged_tensors", {})
            key = version if version is not None else "<next>"
            if staged.get("version") != key:  # a new version: what was staged for another one is dropped
                if staged.get("tensors"):
                    logger.warning("dropping %d staged tensors of weight version %s: version %s started",
                                   len(staged["tensors"]), staged["version"], key)
                staged.clear()
                staged.update(version=key, tensors={}, buckets=0)
            bucket = {name: tensor for name, tensor in named}
            if quantization is None:
                own = self.model.state_dict()
                self._check_bucket(bucket, own)
                converted = {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in bucket.items()}
                staged["tensors"].update(converted)
                # what stays staged past this call is copied out of the sender's memory, unless it was donated
                shared = {} if donate_tensors else {
                    n: t for n, t in converted.items() if t.data_ptr() == bucket[n].data_ptr()}
                try:
                    state, served = self._complete_state(staged["tensors"], own), None
                except BaseException:
                    staged["tensors"].update({n: t.clone() for n, t in shared.items()})
                    raise
                if state is None:
                    staged["tensors"].update({n: t.clone() for n, t in shared.items()})
            else:
                self._check_quantised_bucket(bucket)
                staged["tensors"].update(bucket)  # the bytes as received
                served = self._complete_quantised(staged["tensors"])
                state = None if served is None else self._dequantised_state(served)
            staged["buckets"] = staged.get("buckets", 0) + 1
            if state is None:
                return {"success": True, "message": f"staged {len(bucket)} tensors of weight version {key} "
                        f"({len(staged['tensors'])} so far)", "num_paused_requests": 0}
            buckets = staged["buckets"]
            staged.clear()
            # unquantised: the model's own tensors are what serve now; quantised: the tensors as received
            # (/get_weights_by_name, weight_read.py)
            adopted = self._switch_to(state, version, source="update_weights_from_tensor",
                                      adopt=donate_tensors and quantization is None, _served_checkpoint=served)
        logger.info("loaded weight version %s from %d buckets of update_weights_from_tensor (%d tensors, %s)%s",
                    self.weight_version, buckets, len(served if served is not None else state),
                    quantization or "unquantised",
                    f"; donated: {adopted} bytes adopted as the model's weights, not copied" if donate_tensors else "")
        return {"success": True, "message": f"weight version {self.weight_version} loaded from tensors",
                "num_paused_requests": 0}

    def _check_bucket(self, bucket: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> None:
        import re

        expert = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
        for name, tensor in bucket.items():
            match = expert.fullmatch(name)
            if match is not None and f"{match.group(1)}.down_proj" in own:  # stacked in the model; checked whole
                target = None
            elif name in own:
                target = own[name]
            else:
                raise RequestError(f"update_weights_from_tensor: {name!r} is not a weight of the served model")
            if target is not None and tuple(tensor.shape) != tuple(target.shape):
                raise RequestError(f"update_weights_from_tensor: {name!r} has shape {tuple(tensor.shape)}, the model "
                                   f"holds {tuple(target.shape)}")
            if target is not None and tensor.is_floating_point() != target.is_floating_point():
                raise RequestError(f"update_weights_from_tensor: {name!r} is {tensor.dtype}, the model holds "
                                   f"{target.dtype}")
            if tensor.is_floating_point() and not reference_model.all_finite(tensor):
                raise RequestError(f"update_weights_from_tensor: {name!r} has non-finite (NaN/inf) values; refusing "
                                   "to load them")

    def _complete_state(self, staged: dict[str, torch.Tensor], own: dict[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor] | None:
        """The staged tensors in the model's layout once they cover every weight (tied ones may be absent),
        else None."""
        tied: set[str] = set()
        if getattr(self.model.config, "tie_word_embeddings", False):
            tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        try:
            state = reference_model.to_model_layout(self.model, staged)
        except ValueError:  # experts still incomplete
            return None
        if any(k not in state and k not in tied for k in own):
            return None
        try:
            # every received tensor was checked finite bucket by bucket (_check_bucket)
            reference_model.validate_state_dict(self.model, state, source="update_weights_from_tensor",
                                                check_finite=False)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        return state

    # ------------------------------------------------------------------ a quantised checkpoint
    def _check_quantised_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        """Each tensor named, shaped and typed as the served quantised checkpoint's (``_served_checkpoint``: the
        tensors of the version serving now, loaded or received, always in the checkpoint's layout)."""
        served = self._served_checkpoint
        for name, tensor in bucket.items():
            if name not in served:
                raise RequestError(f"update_weights_from_tensor: {name!r} is not a tensor of the served "
                                   f"{self.quantization} checkpoint")
            dtype, shape = served[name].dtype, tuple(served[name].shape)
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise RequestError(f"update_weights_from_tensor: {name!r} is {str(tensor.dtype)[6:]} "
                                   f"{tuple(tensor.shape)}, the served {self.quantization} checkpoint holds "
                                   f"{str(dtype)[6:]} {shape} (the train side must quantise to the served format: "
                                   "the matching sync plugin)")

    def _complete_quantised(self, staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The staged tensors once they cover every tensor of the served checkpoint (tied ones may be absent),
        else None."""
        tied: set[str] = set()
        if getattr(self.model.config, "tie_word_embeddings", False):
            tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if any(k not in staged and k not in tied for k in self._served_checkpoint):
            return None
        return dict(staged)

    def _dequantised_state(self, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``received`` dequantised with the served checkpoint's scheme and checked like a checkpoint on disk."""
        from slime_ascend.quant.hf_config import spec_from_checkpoint
        from slime_ascend.quant.params import dequantize_named_params

        source = "update_weights_from_tensor"
        try:
            state = dequantize_named_params(received, spec_from_checkpoint(self.model_path), self.dtype)
            reference_model.validate_state_dict(self.model, state, source=source)
        except (ValueError, TypeError, KeyError) as exc:
            raise RequestError(f"{source}: the {self.quantization} version is refused: {exc}; version "
                               f"{self.weight_version} keeps serving") from None
        return state
