"""SGLang's ``/get_weights_by_name`` on the torch engine: the values of one served tensor, and (our extension)
its exact bytes.

SGLang (0.5.15, ``GetWeightsByNameReqInput`` in ``sglang/srt/managers/io_struct.py``; ``http_server.py``
``/get_weights_by_name``, GET or POST; ``LlamaForCausalLM.get_weights_by_name``): the request is
``{"name": str, "truncate_size": int = 100}`` and the answer is the parameter as a JSON list,
``weight.to(float32).tolist()[:truncate_size]`` (the first ``truncate_size`` rows); a name it cannot find is a
400. The torch engine answers the same, and adds one request field of its own:

* ``"return_raw": true`` makes the answer an object: ``parameter`` (SGLang's list, unchanged; the field name of
  SGLang's ``GetWeightsByNameReqOutput``), ``name``, ``weight_version`` (the version these bytes belong to: read
  together with them, under the lock every weight swap takes), ``dtype`` (torch's name without ``torch.``,
  e.g. ``float8_e4m3fn``), ``shape`` (the whole tensor's), ``raw_shape`` (the returned rows: the first
  ``min(truncate_size, shape[0])``) and ``raw_base64`` (those rows' bytes, C order, the host's byte order:
  little-endian on x86 and Arm). A float32 list cannot say a tensor was float8 or bfloat16, nor carry
  packed ``uint8`` int4 as what it is; the bytes can, so a test compares them with ``slime-ascend quantize``.

What "the served tensor" is: for an unquantised version, the model's own parameter or buffer (in the engine's
dtype, as SGLang returns its own parameter). For a quantised version the model computes with dequantised
weights, so the engine also keeps the checkpoint tensors of the version it serves, as they were loaded or
received (float8 / int8 / packed weights with their scales; the rest in the checkpoint's dtype), and answers
from them: at start (``--model`` a quantised checkpoint), after ``update_weights_from_disk`` of a quantised
checkpoint and after a complete ``update_weights_from_distributed`` version. That copy is the size of the
quantised checkpoint. A ``--colocate`` release (:mod:`.memory`) spills it with the weights.

Names are the checkpoint's (HF) names; a name the served version does not hold is a 400 naming it. MoE experts
of an unquantised model are held stacked (``...experts.down_proj``), so their per-expert checkpoint names are
not found: ask for the stacked name. 0-d tensors answer their value as a one-element list (SGLang fails on them).

Bounded work, per request and across connections (a 70-byte request could ask for a 90 MB answer, and clients that
never read held 1.8 GB):

* an answer holds at most ``max_weight_values`` values (``serve-torch --max-weight-values``) and at most
  ``max_weight_answer_bytes`` bytes (``--max-weight-answer-bytes``, default 32 MiB): its worst-case JSON size
  (:func:`answer_bytes_bound`: 25 bytes a value, the raw bytes' base64, the fields) is checked before anything is
  copied; beyond either, a 413 naming the limit and its flag (ask for fewer rows: a lower ``truncate_size``);
* the answers being built or sent at once, over all connections, hold at most ``max_weight_bytes_in_flight``
  bytes (``--max-weight-bytes-in-flight``, default 128 MiB): each answer reserves its bound until the server has
  sent it (a client that does not read holds it at most the server's ``--timeout``); beyond, a 503 with
  ``Retry-After``.
"""

from __future__ import annotations

import base64
import json
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..sglang_protocol import HeldAnswer, RequestError
from . import DEFAULT_MAX_WEIGHT_ANSWER_BYTES, DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT, DEFAULT_MAX_WEIGHT_VALUES

__all__ = ["DEFAULT_MAX_WEIGHT_ANSWER_BYTES", "DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT", "DEFAULT_MAX_WEIGHT_VALUES",
           "ByteBudget", "WeightRead", "answer_bytes_bound", "decode_raw"]

_FIELDS = ("name", "truncate_size", "return_raw")
# the longest JSON of one float32 value as a Python float, and its separator: "-1.2345678901234567e-38, "
_VALUE_BYTES = 25
_RETRY_AFTER_S = 1


def answer_bytes_bound(part_shape: Sequence[int], shape: Sequence[int], itemsize: int, name: str,
                       return_raw: bool) -> int:
    """An upper bound of the JSON bytes of an answer holding rows ``part_shape`` of a tensor of ``shape``
    (``itemsize`` bytes a value): 25 bytes a value, 4 a nested list, and with ``return_raw`` the rows' base64 and
    the object's fields."""
    numel = math.prod(part_shape)
    lists = sum(math.prod(part_shape[:d]) for d in range(len(part_shape))) or 1  # a 0-d tensor answers [value]
    size = numel * _VALUE_BYTES + lists * 4 + 2
    if return_raw:
        size += 4 * -(-numel * itemsize // 3) + 2 * len(json.dumps(name)) + 24 * (len(shape) + len(part_shape)) + 256
    return size


class ByteBudget:
    """Bytes reserved at once, at most ``limit``: :meth:`take` reserves (False when they do not fit),
    :meth:`give` returns them."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class WeightRead:
    """Mixin of :class:`~slime_ascend.rollout.torch_engine.engine.TorchEngine`: ``/get_weights_by_name`` (module
    docstring). The engine supplies ``model``, ``weight_version``, ``max_weight_values``, ``_compute_lock`` and
    ``_check_weights_present``, and calls :meth:`_init_weight_read` with its answer limits; ``_served_checkpoint``
    is the quantised version's checkpoint tensors (None when the served version is unquantised), set with the
    version by every swap."""

    _served_checkpoint: dict[str, torch.Tensor] | None = None

    def _init_weight_read(self, max_weight_answer_bytes: int = DEFAULT_MAX_WEIGHT_ANSWER_BYTES,
                          max_weight_bytes_in_flight: int = DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT) -> None:
        if max_weight_bytes_in_flight < max_weight_answer_bytes:
            raise ValueError(f"max_weight_bytes_in_flight={max_weight_bytes_in_flight} is below "
                             f"max_weight_answer_bytes={max_weight_answer_bytes}: an answer at the limit could never "
                             "be sent. Fix: raise --max-weight-bytes-in-flight or lower --max-weight-answer-bytes")
        self.max_weight_answer_bytes = max_weight_answer_bytes
        self._weight_answers = ByteBudget(max_weight_bytes_in_flight)

    def weight_read_info(self) -> dict[str, int]:
        """The limits and the bytes of answers in flight now (``/server_info``)."""
        return {"max_weight_answer_bytes": self.max_weight_answer_bytes,
                "max_weight_bytes_in_flight": self._weight_answers.limit,
                "weight_answer_bytes_in_flight": self._weight_answers.used}

    def get_weights_by_name(self, body: Any) -> HeldAnswer:
        if not isinstance(body, dict):
            raise RequestError("get_weights_by_name: the request body must be a JSON object")
        unknown = sorted(set(body) - set(_FIELDS))
        if unknown:
            raise RequestError(f"get_weights_by_name: unknown fields {unknown} (fields: {', '.join(_FIELDS)})")
        name = body.get("name")
        truncate_size = body.get("truncate_size", 100)
        return_raw = body.get("return_raw", False)
        if not isinstance(name, str) or not name:
            raise RequestError("get_weights_by_name: name must be a non-empty string (a checkpoint tensor name)")
        if not isinstance(truncate_size, int) or isinstance(truncate_size, bool) or truncate_size < 0:
            raise RequestError(f"get_weights_by_name: truncate_size must be an integer >= 0 (rows returned), got "
                               f"{truncate_size!r}")
        if not isinstance(return_raw, bool):
            raise RequestError("get_weights_by_name: return_raw must be true or false")
        self._check_weights_present("get_weights_by_name")
        with self._compute_lock:  # every swap sets the tensors and the version under it: one version's bytes
            served = self._served_checkpoint
            tensor = (served if served is not None else self.model.state_dict()).get(name)
            version = self.weight_version
            if tensor is None:
                what = "quantised checkpoint" if served is not None else "model"
                raise RequestError(f"get_weights_by_name: {name!r} is not a tensor of the served {what} (weight "
                                   f"version {version}); use a checkpoint (HF) tensor name")
            part = tensor.detach() if tensor.dim() == 0 else tensor.detach()[:truncate_size]
            asked = f"(shape {list(tensor.shape)}, truncate_size={truncate_size})"
            if part.numel() > self.max_weight_values:
                raise RequestError(
                    f"get_weights_by_name: {name!r} would answer {part.numel()} values {asked}, above this server's "
                    f"limit max_weight_values={self.max_weight_values} (ask for fewer rows with a lower truncate_size, "
                    "or raise it with serve-torch --max-weight-values)", status=413)
            nbytes = answer_bytes_bound(part.shape, tensor.shape, tensor.element_size(), name, return_raw)
            if nbytes > self.max_weight_answer_bytes:
                raise RequestError(
                    f"get_weights_by_name: {name!r} would answer up to {nbytes} bytes {asked}, above this server's "
                    f"limit max_weight_answer_bytes={self.max_weight_answer_bytes} (ask for fewer rows with a lower "
                    "truncate_size, or raise it with serve-torch --max-weight-answer-bytes)", status=413)
            budget = self._weight_answers
            if not budget.take(nbytes):
                raise RequestError(
                    f"get_weights_by_name: answers of {budget.used} bytes are being sent, and this one's {nbytes} "
                    f"would pass this server's limit max_weight_bytes_in_flight={budget.limit} (serve-torch "
                    f"--max-weight-bytes-in-flight); retry in {_RETRY_AFTER_S} s, or ask for fewer rows",
                    status=503, retry_after=_RETRY_AFTER_S)
            try:
                part = part.contiguous().clone()
            except BaseException:
                budget.give(nbytes)
                raise
        try:
            answer = _answer(part, tensor, name, version, return_raw)
        except BaseException:
            budget.give(nbytes)
            raise
        return HeldAnswer(answer, lambda: budget.give(nbytes))  # released by the server once sent


def _answer(part: torch.Tensor, tensor: torch.Tensor, name: str, version: str, return_raw: bool) -> Any:
    part = part.cpu()  # an engine on a device (device.py): the answer is made on the host
    values = part.to(torch.float32).tolist()
    parameter = [values] if part.dim() == 0 else values
    if not return_raw:
        return parameter
    raw = part.reshape(-1).view(torch.uint8) if part.numel() else torch.zeros(0, dtype=torch.uint8)
    return {
        "parameter": parameter,
        "name": name,
        "weight_version": version,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "raw_shape": list(part.shape),
        "raw_base64": base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
    }


def decode_raw(answer: dict[str, Any]) -> torch.Tensor:
    """The tensor of a ``return_raw`` answer (its ``raw_shape`` rows, in its ``dtype``): what a client does."""
    dtype = getattr(torch, answer["dtype"])
    data = bytearray(base64.b64decode(answer["raw_base64"]))
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    shape = answer["raw_shape"]
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype)
    return flat.view(dtype).reshape(shape)
