"""Reference rollout engine: SGLang's ``/generate`` semantics on a torch + transformers CPU model.

The engine is transport-free (dicts in, dicts out; it implements
:class:`slime_ascend.rollout.sglang_protocol.SGLangEngine`); :mod:`slime_ascend.rollout.http_server` serves it
over HTTP with SGLang's endpoint names so slime can attach it via ``--rollout-external-engine-addrs``.

Semantics mirrored from SGLang (checked against the installed ``sglang`` sources):

* ``temperature < 1e-6`` means greedy (SGLang rewrites it to ``temperature=1, top_k=1``).
* ``output_token_logprobs`` are ``log_softmax(logits / T)`` over the full vocabulary, before top-p /
  top-k / min-p filtering; when greedy (``top_k == 1``) ``T`` is 1. ``return_original_logprob``
  (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``) reports ``T = 1`` log-probs always.
* ``input_token_logprobs`` are raw (``T = 1``) log-probs of ``input_ids[logprob_start_len:]``; the
  first entry's log-prob is ``None``. ``logprob_start_len = -1`` (default) returns none.
* ``top_logprobs_num = k`` (with ``return_logprob``) adds ``input_top_logprobs``: per input position
  of ``input_token_logprobs``, ``None`` for the first, then the ``k`` largest raw log-probs of the
  distribution that predicts that position, each ``[logprob, token_id, text]``, largest first
  (SGLang 0.5.x's ``detokenize_top_logprobs_tokens`` shape); and ``output_top_logprobs``: the same for
  each generated token, from the distribution its ``output_token_logprobs`` entry was read from.
* ``finish_reason``: ``{"type": "stop", "matched": id_or_str}``, ``{"type": "length", "length": n}``,
  or ``{"type": "abort", "message": ...}``.
* ``/pause_generation`` with ``mode="abort"`` (default) aborts in-flight requests (partial output,
  ``finish_reason.type == "abort"``) and holds new ones until ``/continue_generation``;
  ``"in_place"`` / ``"retract"`` park in-flight requests between decode steps instead.
* A weight update waits for in-flight requests (a request parked by an ``in_place``/``retract`` pause
  counts as drained, as in SGLang); weights are never swapped inside a decode step. A checkpoint is
  fully loaded and checked (names, shapes, dtypes, no NaN/inf) before the engine is drained, and a
  refused one leaves the old weights and version serving.
* ``return_routed_experts: true`` (an MoE model only) adds ``meta_info["routed_experts"]``: SGLang's
  base64 of int32 ``[len(input_ids) + completion_tokens - 1, num_layers, top_k]``, each fed token's experts
  in each layer (zeros in dense layers; :class:`~slime_ascend.rollout.torch_engine.model.RouteRecorder`).
  An engine started with ``enable_return_routed_experts`` (SGLang's server flag, which slime passes to the
  engines it starts under ``--use-rollout-routing-replay``; ``serve-torch --enable-return-routed-experts``)
  adds them to every answer, asked or not. Deviation: SGLang returns them only when the request asks too, and
  slime's router as PyPI ships it (sglang-router 0.3.2) re-serialises each body without that field (slime's
  Dockerfile installs a fork of it that keeps it), so behind that router no request asks.
* ``meta_info["cached_tokens"]``: the prompt tokens reused from the cross-request prefix cache
  (:mod:`.prefix_cache`: off unless ``prefix_cache_tokens``; reused only under the weight version that computed
  them, dropped at every switch; ``/server_info``'s ``prefix_cache`` counts what reuse saved and switches dropped).
* slime's sglang router re-serialises each body with ``background``, ``model``, ``no_logs``,
  ``return_bytes``, ``return_entropy`` and ``log_metrics``; those are accepted at their neutral
  values only.

Bounded work: per request, at most ``max_batch_size`` prompts, ``max_prompt_tokens`` prompt tokens in
all, ``max_new_tokens`` new tokens per prompt and ``max_top_logprobs`` top-k entries in its answer, and at most
``max_weight_values`` values and ``max_weight_answer_bytes`` bytes in a ``/get_weights_by_name`` answer
(:mod:`.weight_read`: SGLang's values of one served tensor, and with ``return_raw`` its exact bytes) (413/400
beyond, naming the limit: a small request cannot ask for a huge answer), and at most ``max_weight_bytes_in_flight``
bytes of such answers at once over all connections (503 beyond); a request whose
client has disconnected is aborted at the next decode step; ``abort_request`` and an aborting pause
also abort the prompts of a batch still queued behind the running one.

Deviations: ``output_ids`` always include a matched stop token (only ``text`` is trimmed);
``update_weights_from_disk`` without ``weight_version`` increments a numeric version (SGLang keeps it).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import inspect
import itertools
import logging
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slime_ascend.rollout.torch_engine import device as engine_device
from slime_ascend.rollout.torch_engine import model as reference_model
from slime_ascend.rollout.torch_engine.dump_dir import check_dump_dir, write_file
from slime_ascend.rollout.torch_engine.glm5 import IndexSetRecorder
from slime_ascend.rollout.torch_engine.memory import MemoryOccupation
from slime_ascend.rollout.torch_engine.prefix_cache import (DEFAULT_MAX_ENTRIES, DEFAULT_MAX_TOKENS, PrefixCache,
                                                             unsupported)
from slime_ascend.rollout.torch_engine.tensor_update import TensorUpdate
from slime_ascend.rollout.torch_engine.weight_group import WeightGroup
from slime_ascend.rollout.torch_engine.weight_read import (DEFAULT_MAX_WEIGHT_ANSWER_BYTES,
                                                           DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT,
                                                           DEFAULT_MAX_WEIGHT_VALUES, WeightRead)
from slime_ascend.rollout.http_server import make_server
from slime_ascend.rollout.sglang_protocol import (ONE_SERVER_INFO, RequestError, abort_matches, check_generate_keys,
                                                  check_positive_ints, check_weight_version, legacy_load,
                                                  next_weight_version)
from slime_ascend.rollout.speculative import categorical, keep_mask, sampling_distribution, verify
from slime_ascend.rollout.torch_engine.mtp import MTPDraft, MTPDraftState

__all__ = ["TorchEngine", "RequestError", "SamplingConfig", "checkpoint_quantization", "parse_sampling_params"]

logger = logging.getLogger("slime_ascend.rollout.engine")

_GREEDY_EPS = 1e-6
_DEFAULT_MAX_NEW_TOKENS = 128

from . import (  # noqa: E402
    DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS_LIMIT, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOP_LOGPROBS)
_DUMP_NAME_TRIES = 100  # record names tried past ones that exist (never opened: dump_dir.py)
_DISCONNECT_POLL_S = 0.25  # how often a request held by pause/update checks its client

# sampling_params keys SGLang accepts that this engine honours.
_SUPPORTED_SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    "custom_params",
    "stream_interval",
}
# SGLang keys accepted only at their neutral value (anything else is a 400: not implemented here).
_NEUTRAL_SAMPLING_VALUES: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "stop_regex": None,
    "watermark": None,
}

# Top-level /generate keys honoured (sglang_protocol.check_generate_keys refuses the rest).
_SUPPORTED_REQUEST_KEYS = {
    "input_ids",
    "text",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "return_text_in_logprobs",
    "rid",
    "top_logprobs_num",
}
def checkpoint_quantization(model_dir: str | os.PathLike | None) -> str | None:
    """The quantised format (``slime-ascend quantize --format`` name) of the checkpoint in ``model_dir``:
    what ``/server_info`` and ``/model_info`` report as ``quantization`` (SGLang's field); None when the
    checkpoint is unquantised (or there is none: the tiny random model)."""
    if model_dir is None or not reference_model.is_quantized_checkpoint(model_dir):
        return None
    from slime_ascend.quant.hf_config import format_from_checkpoint

    try:
        fmt = format_from_checkpoint(model_dir)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{str(model_dir)!r}: cannot read its quantization config: {exc}") from exc
    return fmt or "unknown"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, int | float)) and not isinstance(x, bool)


@dataclass
class SamplingConfig:
    """Validated sampling parameters of one request (SGLang names and defaults)."""

    max_new_tokens: int = _DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_strs: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    return_top_p_token_ids: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def parse_sampling_params(params: Any, vocab_size: int) -> SamplingConfig:
    """Validate a ``sampling_params`` dict into a :class:`SamplingConfig`; raise :class:`RequestError`."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError(f"sampling_params must be a JSON object, got {type(params).__name__}")
    unknown = sorted(set(params) - _SUPPORTED_SAMPLING_KEYS - set(_NEUTRAL_SAMPLING_VALUES))
    if unknown:
        raise RequestError(f"unknown sampling_params keys {unknown}")
    for key, neutral in _NEUTRAL_SAMPLING_VALUES.items():
        value = params.get(key)
        if value is not None and value != neutral:
            raise RequestError(
                f"sampling_params.{key}={value!r} is not supported by the torch engine (only {neutral!r})"
            )
    cfg = SamplingConfig()

    def get(key: str, default: Any, valid: Callable[[Any], bool], what: str) -> Any:
        value = params.get(key)
        if value is None:
            return default
        if not valid(value):
            raise RequestError(f"sampling_params.{key} must be {what}, got {value!r}")
        return value

    def number(key: str, default: float) -> float:
        return float(get(key, default, lambda v: _is_number(v) and math.isfinite(v), "a finite number"))

    def boolean(key: str, default: bool) -> bool:
        return get(key, default, lambda v: isinstance(v, bool), "true or false")

    cfg.max_new_tokens = get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS, _is_int, "an integer")
    if cfg.max_new_tokens < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be >= 0, got {cfg.max_new_tokens}")
    cfg.temperature = number("temperature", 1.0)
    if cfg.temperature < 0:
        raise RequestError(f"sampling_params.temperature must be >= 0, got {cfg.temperature}")
    cfg.top_p = number("top_p", 1.0)
    if not 0.0 < cfg.top_p <= 1.0:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {cfg.top_p}")
    cfg.top_k = get("top_k", -1, _is_int, "an integer")
    if cfg.top_k != -1 and cfg.top_k < 1:
        raise RequestError(f"sampling_params.top_k must be -1 (disabled) or >= 1, got {cfg.top_k}")
    cfg.min_p = number("min_p", 0.0)
    if not 0.0 <= cfg.min_p <= 1.0:
        raise RequestError(f"sampling_params.min_p must be in [0, 1], got {cfg.min_p}")
    if cfg.temperature < _GREEDY_EPS:  # SGLang: greedy == temperature 1 with top_k 1
        cfg.temperature, cfg.top_k = 1.0, 1

    stop = get("stop", [], lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
               "a string or a list of strings")
    cfg.stop_strs = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
    stop_ids = get("stop_token_ids", [], lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                   "a list of integers")
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"sampling_params.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    cfg.stop_token_ids = set(stop_ids)

    cfg.ignore_eos = boolean("ignore_eos", False)
    cfg.skip_special_tokens = boolean("skip_special_tokens", True)
    cfg.spaces_between_special_tokens = boolean("spaces_between_special_tokens", True)
    cfg.no_stop_trim = boolean("no_stop_trim", False)
    cfg.sampling_seed = get("sampling_seed", None, lambda v: _is_int(v) and -(2**63) <= v < 2**63, "a 64-bit integer")
    get("stream_interval", None, _is_int, "an integer")
    custom = get("custom_params", {}, lambda v: isinstance(v, dict), "an object")
    cfg.return_top_p_token_ids = bool(custom.get("return_top_p_token_ids", False))
    return cfg


@dataclass
class _Request:
    """One sequence being generated (a batch request holds several)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingConfig
    return_logprob: bool
    logprob_start_len: int
    return_text_in_logprobs: bool
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    abort_message: str | None = None
    is_disconnected: Callable[[], bool] | None = None  # the HTTP client went away


def _choose_token(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator, original_logprob: bool
) -> tuple[int, float, list[int] | None]:
    """Pick the next token from float32 ``logits [V]``; return (token, reported log-prob, kept top-p ids)."""
    if cfg.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        kept = [token] if cfg.return_top_p_token_ids else None
        return token, float(logprobs[token]), kept
    scaled_logprobs = torch.log_softmax(logits / cfg.temperature, dim=-1)
    probs = scaled_logprobs.exp()
    sorted_probs, sorted_ids = torch.sort(probs, descending=True)
    keep = keep_mask(sorted_probs, cfg.top_k, cfg.top_p, cfg.min_p)  # SGLang's top-k / top-p / min-p rules
    filtered = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    choice = int(torch.multinomial(filtered / filtered.sum(), 1, generator=generator))
    token = int(sorted_ids[choice])
    kept = sorted_ids[keep].tolist() if cfg.return_top_p_token_ids else None
    logprob = float(torch.log_softmax(logits, dim=-1)[token]) if original_logprob else float(scaled_logprobs[token])
    return token, logprob, kept


class _HiddenTap:
    """The served model's final hidden states of the last forward (a forward hook on its final norm):
    ``[fed tokens, hidden]``, what MTP speculation reads."""

    def __init__(self, norm: torch.nn.Module):
        self._last: torch.Tensor | None = None
        norm.register_forward_hook(self._hook)

    def _hook(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
        self._last = output.detach()[0]

    def take(self) -> torch.Tensor:
        last, self._last = self._last, None
        if last is None:
            raise RuntimeError("the served model's final norm did not run in this forward")
        return last


@dataclass
class _DraftState:
    """One request's draft state: the draft model's KV cache and how many of its tokens it holds, or the MTP
    layer's (``mtp``)."""

    past: Any = None
    length: int = 0
    mtp: MTPDraftState | None = None


class TorchEngine(MemoryOccupation, TensorUpdate, WeightGroup, WeightRead):
    """A CPU rollout engine with SGLang's request/response semantics (see the module docstring).

    Args:
        model_path: HF checkpoint directory, or None for the tiny random Qwen3.
        dtype: model dtype (float32 makes reported log-probs match :func:`score_tokens` tightly).
        seed: seeds the tiny random model and the per-request seeds of unseeded requests.
        return_original_logprob: report temperature-1 log-probs (default: env
            ``SGLANG_RETURN_ORIGINAL_LOGPROB``).
        weight_version: initial version string (SGLang's default is ``"default"``).
        max_batch_size: most prompts in one ``/generate`` request (413 beyond).
        max_prompt_tokens: most prompt tokens in one request, summed over its prompts (413 beyond).
        max_top_logprobs: most top-k log-prob entries one answer may hold, ``top_logprobs_num`` times the
            scored prompt positions and new tokens, summed over a batch (413 beyond).
        max_new_tokens: highest ``sampling_params.max_new_tokens`` accepted (400 beyond).
        max_weight_values: most values one ``/get_weights_by_name`` answer may hold (413 beyond;
            :mod:`.weight_read`).
        max_weight_answer_bytes: most bytes one ``/get_weights_by_name`` answer may take (its worst-case JSON size;
            413 beyond).
        max_weight_bytes_in_flight: most bytes of ``/get_weights_by_name`` answers built or being sent at once,
            over all connections (503 with ``Retry-After`` beyond).
        prefix_cache_tokens: most KV positions the cross-request prefix cache keeps (:mod:`.prefix_cache`:
            reused only under the weight version that computed them); 0 (default) turns it off.
        prefix_cache_entries: most prefixes it keeps.
        enable_return_routed_experts: every answer carries its routes (an MoE model).
        dump_dsa_index_sets: a directory where each request's DSA key sets are written (a GLM-5 model): the
            rollout record of :mod:`slime_ascend.dsa.index_sets`, ``rollout-<pid>-<n>.pt``, for comparing the
            rollout side's selections with the train side's. Each file is created new, never through a link
            (:mod:`.dump_dir`); a directory of another user, or world-writable without the sticky bit, is refused;
            a write that fails (a full disk) stops dumping with one warning while generation goes on.
    """

    engine_name = "the torch engine"  # in the HTTP surface's messages

    def __init__(
        self,
        model_path: str | None = None,
        dtype: torch.dtype | str = torch.float32,
        seed: int = 0,
        return_original_logprob: bool | None = None,
        weight_version: str = "default",
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS_LIMIT,
        max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS,
        max_weight_values: int = DEFAULT_MAX_WEIGHT_VALUES,
        max_weight_answer_bytes: int = DEFAULT_MAX_WEIGHT_ANSWER_BYTES,
        max_weight_bytes_in_flight: int = DEFAULT_MAX_WEIGHT_BYTES_IN_FLIGHT,
        prefix_cache_tokens: int = DEFAULT_MAX_TOKENS,
        prefix_cache_entries: int = DEFAULT_MAX_ENTRIES,
        enable_return_routed_experts: bool = False,
        dump_dsa_index_sets: str | os.PathLike | None = None,
        device: str = "cpu",
        max_total_tokens: int | None = None,
        speculative_draft_model_path: str | os.PathLike | None = None,
        speculative_num_steps: int = 0,
        speculative_algorithm: str | None = None,
    ) -> None:
        check_positive_ints(max_batch_size=max_batch_size, max_prompt_tokens=max_prompt_tokens,
                            max_new_tokens=max_new_tokens, max_top_logprobs=max_top_logprobs,
                            max_weight_values=max_weight_values, max_weight_answer_bytes=max_weight_answer_bytes,
                            max_weight_bytes_in_flight=max_weight_bytes_in_flight)
        self._init_weight_read(max_weight_answer_bytes, max_weight_bytes_in_flight)
        self.device = engine_device.resolve(str(device))  # device.py: checked before the model loads
        # the dump directory is checked before the model loads: refused at start, in one line (dump_dir.py)
        index_dump = (None if dump_dsa_index_sets is None
                      else check_dump_dir(dump_dsa_index_sets, "--dump-dsa-index-sets"))
        self.max_weight_values = max_weight_values
        self.max_top_logprobs = max_top_logprobs
        self.max_batch_size = max_batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.model_path = None if model_path is None else str(model_path)
        self.dtype = reference_model._resolve_dtype(dtype)
        self.seed = seed
        self.quantization = checkpoint_quantization(self.model_path)
        # a quantised checkpoint is read once: its dense weights load the model, its own tensors are served
        checkpoint = (reference_model.read_checkpoint(self.model_path, self.dtype)
                      if self.quantization is not None else None)
        self.model = reference_model.load_model(self.model_path, self.dtype, seed=seed, checkpoint=checkpoint)
        self.model.to(self.device)  # loaded on the host (the seeded init, the checkpoint's tensors), served here
        self.tokenizer = reference_model.load_tokenizer(self.model_path)
        if return_original_logprob is None:
            return_original_logprob = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true")
        self.return_original_logprob = bool(return_original_logprob)
        self.weight_version = str(weight_version)
        self._prefix_cache = PrefixCache(prefix_cache_tokens, prefix_cache_entries, version=self.weight_version)
        refusal = unsupported(self.model) if self._prefix_cache.enabled else None
        if refusal:
            raise ValueError(f"prefix cache: {refusal}; serve this model without --prefix-cache-tokens")
        self.vocab_size = int(self.model.config.vocab_size)
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 4096) or 4096)
        self.eos_token_ids = self._eos_ids()
        # transformers >= 5.2x names the KV cache argument/output ``cache``; older ones ``past_key_values``.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._routes = reference_model.RouteRecorder.for_model(self.model)  # None: a dense model
        if enable_return_routed_experts and self._routes is None:
            raise ValueError("enable_return_routed_experts needs an MoE model; this checkpoint is a dense one (drop "
                             "--enable-return-routed-experts, or drop --use-rollout-routing-replay)")
        # every answer carries its routes (see the module docstring: slime's router from PyPI drops the request's
        # return_routed_experts, so the server's setting decides, as slime sets it under routing replay)
        self.enable_return_routed_experts = bool(enable_return_routed_experts)
        self._index_sets = None  # the DSA key sets of each forward, where dump_dsa_index_sets asks for them
        self._index_dump: Path | None = None
        if dump_dsa_index_sets is not None:
            self._index_sets = IndexSetRecorder.for_model(self.model)
            if self._index_sets is None:
                raise ValueError(f"dump_dsa_index_sets needs a DSA model (GLM-5, glm_moe_dsa); this checkpoint is a "
                                 f"{self.model.config.model_type}. Fix: drop --dump-dsa-index-sets, or serve a GLM-5 "
                                 "checkpoint")
            self._index_dump = index_dump
            self._index_dump_count = itertools.count()
        self._index_dump_lock = threading.Lock()  # the one warning when a dump write fails (dumping stops)

        # speculative decoding: a draft proposes speculative_num_steps tokens, one forward of the served model
        # verifies them (speculative.py: the kept tokens follow its distribution). SGLang's algorithms: STANDALONE (a
        # draft model of its own), NEXTN / EAGLE (the checkpoint's own MTP layer, mtp.py; SGLang resolves NEXTN to
        # EAGLE), which every weight update switches with the model
        self.draft_model = None
        self._mtp_draft: MTPDraft | None = None
        self._hidden_tap: _HiddenTap | None = None
        self.speculative_algorithm: str | None = None
        self.speculative_draft_model_path: str | None = None
        self.speculative_num_steps = int(speculative_num_steps)
        self._spec_stats: dict[str, list[int]] = {}  # weight version -> [verify forwards, tokens they emitted]
        algorithm = speculative_algorithm or ("STANDALONE" if speculative_draft_model_path is not None else None)
        algorithm = None if algorithm is None else str(algorithm).upper()
        if algorithm == "STANDALONE":
            if speculative_draft_model_path is None:
                raise ValueError("the STANDALONE algorithm needs a draft model (--speculative-draft-model-path)")
            self._load_draft(str(speculative_draft_model_path))
        elif algorithm in ("NEXTN", "EAGLE"):
            if speculative_draft_model_path is not None and str(speculative_draft_model_path) != self.model_path:
                raise ValueError(f"{algorithm} drafts with the served checkpoint's own MTP layer; "
                                 f"--speculative-draft-model-path {speculative_draft_model_path} is another model "
                                 "(drop it, or use STANDALONE)")
            self._load_mtp_draft()
        elif algorithm is not None:
            raise ValueError(f"speculative algorithm {algorithm} is not supported (STANDALONE, NEXTN, EAGLE)")
        elif self.speculative_num_steps:
            raise ValueError("speculative_num_steps needs a draft model (--speculative-draft-model-path)")

        # a checkpoint of this architecture holds at most 8 bytes a parameter (float64), plus headers
        numel = sum(t.numel() for t in self.model.state_dict().values())
        self._max_checkpoint_bytes = 8 * numel + (64 << 20)
        # a quantised checkpoint's own tensors, as /get_weights_by_name answers them (weight_read.py)
        self._served_checkpoint = None if checkpoint is None else checkpoint.stored

        self._compute_lock = threading.Lock()  # one forward step at a time; weight swaps take it too
        self._update_lock = threading.Lock()  # one weight update at a time
        self._state = threading.Condition()  # guards everything below
        self._paused: str | None = None  # None or the pause mode
        self._updating = False
        self._live: dict[int, _Request] = {}  # every prompt of every request not yet answered
        self._running: dict[int, _Request] = {}  # admitted (between admission and answer)
        self._parked = 0  # running requests parked by an in_place/retract pause
        # the KV budget (SGLang's --max-total-tokens): the running requests reserve their prompt plus max_new_tokens
        # and the next request in arrival order waits until its reservation fits (one above the whole budget runs
        # alone); /v1/loads reports it as SGLang does (max_total_num_tokens, num_used_tokens)
        if max_total_tokens is not None:
            check_positive_ints(max_total_tokens=max_total_tokens)
        self.max_total_tokens = max_total_tokens
        self._kv_reserved = 0
        self._kv_queue: collections.deque[int] = collections.deque()  # waiting requests, in arrival order
        self._seed_rng = random.Random(seed)

    def _check_speculation(self) -> None:
        if self.speculative_num_steps < 1:
            raise ValueError("speculative decoding needs speculative_num_steps >= 1 (--speculative-num-steps)")
        if self._prefix_cache.enabled:
            raise ValueError("speculative decoding is not supported here: the prefix cache is on (drop "
                             "--prefix-cache-tokens)")

    def _load_mtp_draft(self) -> None:
        """Speculation with the served checkpoint's own MTP layer (NEXTN / EAGLE): the served model's final hidden
        states are kept per request (a hook on its final norm) for the layer to read."""
        self._check_speculation()
        self._mtp_draft = MTPDraft(self.model)
        self._hidden_tap = _HiddenTap(self.model.model.norm)
        self.speculative_algorithm = "EAGLE"

    def _load_draft(self, path: str) -> None:
        """The draft model of speculative decoding, checked against the served one before it serves. An MoE or DSA
        served model is verified like a dense one: of the verifying forward, only the kept tokens' routes and key
        sets are recorded (``_speculate``)."""
        self._check_speculation()
        draft = reference_model.load_model(path, self.dtype)
        if int(draft.config.vocab_size) != self.vocab_size:
            raise ValueError(f"the draft model {path} has vocab_size {draft.config.vocab_size}, the served model "
                             f"{self.vocab_size}: speculative decoding needs one vocabulary")
        self.draft_model = draft.to(self.device)
        self.speculative_draft_model_path = path
        self.speculative_algorithm = "STANDALONE"

    @property
    def speculating(self) -> bool:
        return self.draft_model is not None or self._mtp_draft is not None

    # ------------------------------------------------------------------ info
    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, list | tuple) else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return {int(i) for i in ids}

    def server_info(self) -> dict[str, Any]:
        """What ``/server_info`` reports (the fields slime's external-engine discovery reads)."""
        with self._state:
            running, waiting = len(self._running), len(self._live) - len(self._running)
        return {
            "engine": "slime_ascend.torch_engine",
            "model_path": self.model_path or "tiny-random-qwen3",
            "tokenizer_path": self.model_path,
            "served_model_name": self.model_path or "tiny-random-qwen3",
            "weight_version": self.weight_version,
            "quantization": self.quantization,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "random_seed": self.seed,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "tp_size": 1,
            **ONE_SERVER_INFO,
            "skip_tokenizer_init": self.tokenizer is None,
            "paused": self._paused is not None,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "max_batch_size": self.max_batch_size,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
            "max_top_logprobs": self.max_top_logprobs,
            "max_weight_values": self.max_weight_values,
            "max_total_num_tokens": self.max_total_tokens,  # the KV budget (--max-total-tokens; None: none)
            "donate_tensors": True,  # /update_weights_from_tensor takes donated tensors (tensor_update.py)
            **self.weight_read_info(),  # weight_read.py: the answer limits and the bytes of answers in flight
            "enable_return_routed_experts": self.enable_return_routed_experts,  # slime checks it under replay
            "routed_experts_in_every_answer": self.enable_return_routed_experts,  # rollout.replay_routes reads it
            "disable_radix_cache": not self._prefix_cache.enabled,  # SGLang's field
            "prefix_cache": self._prefix_cache.stats(),  # prefix_cache.py: tokens saved, entries invalidated
            **self._spec_info(),
        }

    def _spec_info(self) -> dict[str, Any]:
        if not self.speculating:
            return {"speculative_algorithm": None}
        with self._state:
            stats = {v: list(c) for v, c in self._spec_stats.items()}
        return {"speculative_algorithm": self.speculative_algorithm, "speculative_num_steps": self.speculative_num_steps,
                "speculative_draft_model_path": self.speculative_draft_model_path or self.model_path,
                # per weight version: tokens emitted per verifying forward (SGLang's accept length), and the counts
                "spec_accept_length_by_version": {v: c[1] / c[0] for v, c in stats.items() if c[0]},
                "spec_verify_ct_by_version": {v: c[0] for v, c in stats.items()}}

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path or "tiny-random-qwen3",
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "quantization": self.quantization,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
        }

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang 0.5.15's ``POST /tokenize``: ``{"prompt": str | [str], "add_special_tokens": true}`` or
        ``{"messages": [...], "chat_template_kwargs": {...}}`` -> ``{"tokens", "count", "max_model_len"}``.

        As sglang/srt/entrypoints/openai: protocol.py:1225-1267 (TokenizeRequest/Response: exactly one of
        ``prompt`` / ``messages``), serving_tokenize.py:39-115 (a prompt is ``tokenizer.encode(text,
        add_special_tokens=...)``, a list one such list each; ``max_model_len`` is the tokenizer's
        ``model_max_length``), serving_chat.py:235-275 and 855-875 (messages: a final assistant turn becomes
        a user turn, the chat template is rendered with ``add_generation_prompt=True`` and encoded without
        added special tokens when the tokenizer adds some; a message's other keys are not passed on).
        Not implemented (400): ``tools``, ``continue_final_message``, content given as parts. Bounded: at most ``max_prompt_tokens``
        characters a request (each prompt counts at least one; 413 beyond)."""
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer (its model directory has none); /tokenize needs one")
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise RequestError("Exactly one of 'prompt' or 'messages' must be provided.")
        for key in ("tools", "continue_final_message"):
            if body.get(key):
                raise RequestError(f"/tokenize field {key!r} is not supported by {self.engine_name}")
        add_special = body.get("add_special_tokens", True)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(add_special, bool) or not isinstance(kwargs, dict):
            raise RequestError("add_special_tokens must be true or false and chat_template_kwargs an object")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if messages is not None:
            ok = isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str | None)
                for m in messages)
            if not ok:
                raise RequestError("messages must be a non-empty list of {role, content} objects with string content")
            texts = [m.get("content") or "" for m in messages]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"Invalid prompt type: {type(prompt).__name__}. Expected str or List[str].")
        size = sum(max(1, len(t)) for t in texts)
        if size > self.max_prompt_tokens:
            raise RequestError(f"/tokenize request of {size} characters is above this server's limit "
                               f"max_prompt_tokens={self.max_prompt_tokens} (split it, or raise it with "
                               "serve-torch --max-prompt-tokens)", status=413)
        max_model_len = getattr(self.tokenizer, "model_max_length", -1)
        if messages is None:
            tokens = [self.tokenizer.encode(t, add_special_tokens=add_special) for t in texts]
            if isinstance(prompt, str):
                return {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": max_model_len}
            return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": max_model_len}
        turns = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        if turns[-1]["role"] == "assistant":
            turns[-1]["role"] = "user"
        if not self.tokenizer.chat_template:
            raise RequestError("the tokenizer has no chat template; /tokenize with messages needs one")
        try:
            rendered = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages is a client error
            raise RequestError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
        auto_specials = len(self.tokenizer.encode("")) > 0
        ids = self.tokenizer.encode(rendered, **({"add_special_tokens": False} if auto_specials else {}))
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    def loads(self) -> dict[str, Any]:
        """SGLang's ``/v1/loads`` (GetLoadsReqOutput's fields this engine has): requests, and KV tokens as
        reservations (a running request's prompt plus its ``max_new_tokens``): ``num_used_tokens`` the running
        requests', ``num_total_tokens`` those plus the waiting requests' (SGLang: used plus pending); the budget
        (``max_total_num_tokens``, ``token_usage``) under ``--max-total-tokens``."""
        with self._state:
            running, waiting = len(self._running), len(self._live) - len(self._running)
            used = self._kv_reserved
            pending = sum(self._kv_cost(req) for key, req in self._live.items() if key not in self._running)
        load: dict[str, Any] = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                                "num_total_reqs": running + waiting, "num_used_tokens": used,
                                "num_total_tokens": used + pending}
        if self.max_total_tokens is not None:
            load.update(max_total_num_tokens=self.max_total_tokens, token_usage=used / self.max_total_tokens)
        return {"loads": [load]}

    def get_load(self) -> list[dict[str, Any]]:
        """SGLang's legacy ``/get_load``, which sglang-router's load monitor polls for its ``power_of_two`` policy
        (it reads ``num_tokens``): :meth:`loads` projected as SGLang projects its own."""
        return legacy_load(self.loads()["loads"])

    # ------------------------------------------------------------------ control
    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """SGLang ``/pause_generation``: hold new requests; ``abort`` also aborts in-flight ones
        (``in_place`` / ``retract`` park them between decode steps)."""
        with self._state:
            self._paused = mode
            if mode == "abort":
                for req in self._live.values():  # queued prompts of a batch too
                    req.abort_message = "Aborted by pause_generation"
                self._state.notify_all()
                self._state.wait_for(lambda: not self._running, timeout=60.0)
            self._state.notify_all()
        return {"success": True, "message": f"paused (mode={mode})"}

    def continue_generation(self) -> dict[str, Any]:
        with self._state:
            self._paused = None
            self._state.notify_all()
        return {"success": True, "message": "continued"}

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        """SGLang ``/abort_request``: abort one request id (prefix match for batch ids) or all, running
        or queued behind the running prompt of a batch."""
        with self._state:
            hits = [r for r in self._live.values() if r.abort_message is None and abort_matches(r.rid, rid, abort_all)]
            for req in hits:
                req.abort_message = "Aborted by abort_request"
            self._state.notify_all()
        return {"success": True, "num_aborted": len(hits)}

    def flush_cache(self) -> dict[str, Any]:
        dropped = self._prefix_cache.clear()
        if self._prefix_cache.enabled:
            logger.info("flush_cache: dropped %d cached prefixes", dropped)
        return {"success": True, "message": f"flushed {dropped} cached prefixes"}

    def release_memory_occupation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """:mod:`.memory`'s release, then the cached prefixes dropped (SGLang flushes at a ``kv_cache`` release);
        requests drained and refused from there on, so none is inserted after."""
        answer = super().release_memory_occupation(*args, **kwargs)
        self._prefix_cache.clear()
        return answer

    def health(self) -> bool:
        return True

    def health_generate(self) -> bool:
        """One forward step on a single token (not blocked by pause); unhealthy while the weights are released."""
        if "weights" in self._released:
            return False
        with self._compute_lock, torch.no_grad():
            logits = self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                                use_cache=False).logits
        return bool(torch.isfinite(logits.float()).all())

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, load_format: str | None = None, **_: Any
    ) -> dict[str, Any]:
        """Reload weights from an HF safetensors dir of the same architecture, then set/bump the version.

        Raises :class:`RequestError` on a bad path or a different architecture; the model is left unchanged.
        """
        if not isinstance(model_path, str) or not model_path:
            raise RequestError("model_path must be a non-empty string naming an HF checkpoint directory")
        check_weight_version(weight_version)  # refused before anything loads
        self._check_weights_present("update_weights_from_disk")
        if load_format not in (None, "auto", "safetensors"):
            raise RequestError(f"load_format={load_format!r} is not supported (use 'auto' or 'safetensors')")
        if not Path(model_path).is_dir():
            raise RequestError(f"model_path {model_path!r} is not a directory")
        with self._update_lock:
            try:  # load and check everything while the old weights keep serving
                reference_model.check_same_architecture(self.model, model_path)
                quantization = checkpoint_quantization(model_path)
                checkpoint = reference_model.read_checkpoint(model_path, self.dtype, self._max_checkpoint_bytes)
                state, served = checkpoint.state, checkpoint.stored
                reference_model.validate_state_dict(self.model, state, source=model_path)
            except (ValueError, OSError) as exc:
                raise RequestError(str(exc)) from exc
            self._switch_to(state, weight_version, source=model_path, model_path=model_path,
                            quantization=quantization, _served_checkpoint=served)
            logger.info("loaded weight version %s from %s (%s)", self.weight_version, model_path,
                        quantization or "unquantised")
        return {"success": True, "message": f"loaded weights from {model_path}", "num_paused_requests": 0}

    def _switch_to(self, state: dict, version: str | None, source: str, adopt: bool = False, **fields: Any) -> int:
        """The one weight swap of every transport (disk, tensor, distributed): like SGLang, wait until in-flight
        requests drained (parked ones count as drained), then apply ``state``, set ``fields`` (e.g. the served
        ``model_path``) and the next weight version under the compute lock. ``adopt``: ``state``'s tensors were
        handed over (:func:`~slime_ascend.rollout.torch_engine.model.apply_state_dict`); returns the bytes adopted."""
        with self._state:
            self._updating = True
            try:
                self._state.wait_for(lambda: len(self._running) == self._parked)
            except BaseException:
                self._updating = False
                self._state.notify_all()
                raise
        try:
            with self._compute_lock:
                old = self.weight_version
                try:
                    adopted = reference_model.apply_state_dict(self.model, state, source=source, adopt=adopt)
                    for name, value in fields.items():
                        setattr(self, name, value)
                    self.weight_version = next_weight_version(self.weight_version, version)
                finally:  # even a swap that failed half-way: no KV of the weights before it is reused
                    entries, tokens = self._prefix_cache.switch(self.weight_version)
                if self._prefix_cache.enabled:
                    logger.info("weight version %s -> %s: dropped %d cached prefixes (%d tokens)", old,
                                self.weight_version, entries, tokens)
                counts = self._spec_stats.get(old) if self.speculating else None
                if counts and counts[0]:  # how well the draft (a draft model: no push changes it; the MTP layer:
                    # switched with the model) kept up with that version
                    logger.info("speculative decoding under weight version %s: accept length %.2f tokens a verifying "
                                "forward (%d forwards)", old, counts[1] / counts[0], counts[0])
        finally:
            with self._state:
                self._updating = False
                self._state.notify_all()
        return adopted

    # ------------------------------------------------------------------ generate
    def generate(
        self, payload: Any, is_disconnected: Callable[[], bool] | None = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang ``/generate``: one response dict, or a list of them for a batched request.

        ``is_disconnected`` (the HTTP layer passes one) is polled between decode steps; once it
        returns True the request and its queued batch prompts are aborted.
        """
        requests_, batched = self._parse_generate(payload)
        with self._state:
            for req in requests_:
                req.is_disconnected = is_disconnected
                self._live[id(req)] = req
        try:
            outputs = [self._run(req) for req in requests_]
        finally:
            with self._state:
                for req in requests_:
                    self._live.pop(id(req), None)
                self._state.notify_all()
        return outputs if batched else outputs[0]

    def _client_gone(self, req: _Request) -> bool:
        """Mark ``req`` aborted when its client has disconnected; True when it is aborted for any reason."""
        if req.abort_message is None and req.is_disconnected is not None and req.is_disconnected():
            req.abort_message = "client disconnected"
        return req.abort_message is not None

    def _parse_generate(self, payload: Any) -> tuple[list[_Request], bool]:
        # return_routed_experts is one of sglang_protocol's neutral keys (refused unless false) for engines
        # without routes; this one honours it for an MoE model
        routed = payload.get("return_routed_experts", False) if isinstance(payload, dict) else False
        if not isinstance(routed, bool):
            raise RequestError(f"return_routed_experts must be true or false, got {routed!r}")
        routed = routed or self.enable_return_routed_experts
        if routed and self._routes is None:
            raise RequestError("return_routed_experts needs an MoE model; this engine serves a dense one (leave "
                               "it out, or drop --use-rollout-routing-replay)")
        check_generate_keys({k: v for k, v in payload.items() if k != "return_routed_experts"}
                            if isinstance(payload, dict) else payload, _SUPPORTED_REQUEST_KEYS, "the torch engine")
        has_ids, has_text = payload.get("input_ids") is not None, payload.get("text") is not None
        if has_ids == has_text:
            raise RequestError("give exactly one of 'input_ids' or 'text'")
        if has_ids:
            ids = payload["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise RequestError("input_ids must be a non-empty list of token ids or a list of such lists")
            batched = isinstance(ids[0], list)
            prompts = ids if batched else [ids]
            self._check_batch_limits(len(prompts), sum(len(p) if isinstance(p, list) else 1 for p in prompts))
            for i, prompt in enumerate(prompts):
                if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
                    raise RequestError(f"input_ids[{i}] must be a non-empty list of integers" if batched else "input_ids must be a non-empty list of integers")
                bad = [t for t in prompt if not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestError(f"input_ids contain out-of-vocabulary ids {bad[:5]} (vocab size {self.vocab_size})")
        else:
            text = payload["text"]
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("text must be a string or a non-empty list of strings")
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; send input_ids instead of text")
            self._check_batch_limits(len(texts), 0)
            prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
            self._check_batch_limits(len(prompts), sum(len(p) for p in prompts))
            if any(not p for p in prompts):
                raise RequestError("text tokenizes to an empty prompt")
        n = len(prompts)

        def per_item(key: str, default: Any) -> list[Any]:
            value = payload.get(key, default)
            if isinstance(value, list):  # per-prompt values are only valid for a batch, one per prompt
                if not batched or len(value) != n:
                    raise RequestError(f"{key} given as a list must be a batch request with one entry per prompt ({n})")
                return value
            return [value] * n

        samplings = [parse_sampling_params(p, self.vocab_size) for p in per_item("sampling_params", None)]
        for sampling in samplings:
            if sampling.max_new_tokens > self.max_new_tokens:
                raise RequestError(
                    f"sampling_params.max_new_tokens={sampling.max_new_tokens} is above this server's limit "
                    f"max_new_tokens={self.max_new_tokens} (raise it with serve-torch --max-new-tokens)"
                )
        return_logprobs = per_item("return_logprob", False)
        start_lens = per_item("logprob_start_len", -1)
        top_nums = per_item("top_logprobs_num", 0)
        rids = per_item("rid", None)
        text_in_lp = payload.get("return_text_in_logprobs", False)
        if not isinstance(text_in_lp, bool):
            raise RequestError("return_text_in_logprobs must be true or false")
        base = uuid.uuid4().hex
        requests_: list[_Request] = []
        for i in range(n):
            if not isinstance(return_logprobs[i], bool):
                raise RequestError(f"return_logprob must be true or false, got {return_logprobs[i]!r}")
            start = start_lens[i] if start_lens[i] is not None else -1
            top_num = top_nums[i] if top_nums[i] is not None else 0
            if not _is_int(top_num) or not 0 <= top_num <= self.vocab_size:
                raise RequestError(f"top_logprobs_num must be an integer in [0, {self.vocab_size}] (the vocabulary "
                                   f"size), got {top_num!r}")
            if not _is_int(start) or start < -1:
                raise RequestError(f"logprob_start_len must be an integer >= -1, got {start!r}")
            if start > len(prompts[i]):
                raise RequestError(f"logprob_start_len={start} is higher than the number of input tokens {len(prompts[i])}")
            if len(prompts[i]) >= self.context_length:
                raise RequestError(f"prompt has {len(prompts[i])} tokens; the context length is {self.context_length}")
            if samplings[i].stop_strs and self.tokenizer is None:
                raise RequestError("sampling_params.stop needs a tokenizer; this engine has none (use stop_token_ids)")
            rid = rids[i]
            if rid is not None and not isinstance(rid, str):
                raise RequestError(f"rid must be a string, got {rid!r}")
            rid = rid or (f"{base}_{i}" if batched else base)
            requests_.append(
                _Request(
                    rid=rid,
                    input_ids=list(prompts[i]),
                    sampling=samplings[i],
                    return_logprob=return_logprobs[i],
                    logprob_start_len=start if return_logprobs[i] else -1,
                    return_text_in_logprobs=text_in_lp,
                    top_logprobs_num=top_num if return_logprobs[i] else 0,
                    return_routed_experts=routed,
                )
            )
        entries = sum(r.top_logprobs_num * (r.sampling.max_new_tokens + (
            len(r.input_ids) - r.logprob_start_len if r.logprob_start_len >= 0 else 0)) for r in requests_)
        if entries > self.max_top_logprobs:
            raise RequestError(
                f"the answer would hold {entries} top-k log-prob entries (top_logprobs_num x scored and new "
                f"positions), above this server's limit max_top_logprobs={self.max_top_logprobs} (lower "
                "top_logprobs_num or split the batch, or raise it with serve-torch --max-top-logprobs)",
                status=413,
            )
        return requests_, batched

    def _check_batch_limits(self, num_prompts: int, num_tokens: int) -> None:
        if num_prompts > self.max_batch_size:
            raise RequestError(
                f"batch of {num_prompts} prompts is above this server's limit max_batch_size={self.max_batch_size} "
                "(split the batch, or raise it with serve-torch --max-batch-size)",
                status=413,
            )
        if num_tokens > self.max_prompt_tokens:
            raise RequestError(
                f"request has {num_tokens} prompt tokens, above this server's limit "
                f"max_prompt_tokens={self.max_prompt_tokens} (split the batch, or raise it with "
                "serve-torch --max-prompt-tokens)",
                status=413,
            )

    def _wait(self, req: _Request) -> None:
        """One wait on ``_state`` (held); wakes periodically to poll a request's client."""
        self._state.wait(timeout=_DISCONNECT_POLL_S if req.is_disconnected is not None else None)

    def _kv_cost(self, req: _Request) -> int:
        return len(req.input_ids) + int(req.sampling.max_new_tokens)

    def _kv_blocked(self, req: _Request) -> bool:
        """Under a KV budget: ``req`` is not first in line, or its reservation does not fit beside the running
        requests' (``_state`` held)."""
        if self.max_total_tokens is None:
            return False
        if self._kv_queue and self._kv_queue[0] != id(req):
            return True
        return bool(self._running) and self._kv_reserved + self._kv_cost(req) > self.max_total_tokens

    @contextlib.contextmanager
    def _admitted(self, req: _Request) -> Iterator[None]:
        cost = self._kv_cost(req)  # reserved whether or not a budget holds requests back: /v1/loads reports it
        with self._state:
            self._check_weights_present("generate")
            if self.max_total_tokens is not None:
                self._kv_queue.append(id(req))
            try:
                while not self._client_gone(req) and (self._paused is not None or self._updating
                                                      or self._kv_blocked(req)):
                    self._wait(req)
            finally:
                if self.max_total_tokens is not None:
                    self._kv_queue.remove(id(req))
                    self._state.notify_all()  # the next in line may fit now
            self._running[id(req)] = req
            self._kv_reserved += cost
        try:
            yield
        finally:
            with self._state:
                self._running.pop(id(req), None)
                self._kv_reserved -= cost
                self._state.notify_all()

    def _check_step(self, req: _Request) -> str | None:
        """Between decode steps: park while paused in place, return an abort message if aborted."""
        self._client_gone(req)
        with self._state:
            parked = False
            try:
                while req.abort_message is None and self._paused not in (None, "abort"):
                    if not parked:
                        parked = True
                        self._parked += 1
                        self._state.notify_all()  # a weight update waiting for the drain
                    self._wait(req)
                    self._client_gone(req)
            finally:
                if parked:
                    self._parked -= 1
            return req.abort_message

    def _forward(self, past: Any, ids: list[int], routes: list[torch.Tensor] | None = None,
                 index_sets: list[dict[int, torch.Tensor]] | None = None,
                 hiddens: list[torch.Tensor] | None = None) -> tuple[Any, torch.Tensor]:
        """Feed ``ids`` after the KV cache ``past``; returns the new cache and float32 logits ``[len(ids), V]``.
        ``routes`` (an MoE model): gets the experts of the fed tokens appended; ``index_sets`` (a DSA model
        dumping them): the key sets each layer read; ``hiddens`` (MTP speculation): the final hidden states."""
        with self._compute_lock:
            return self._forward_locked(past, ids, routes, index_sets, hiddens)

    def _forward_locked(self, past: Any, ids: list[int], routes: list[torch.Tensor] | None,
                        index_sets: list[dict[int, torch.Tensor]] | None = None,
                        hiddens: list[torch.Tensor] | None = None) -> tuple[Any, torch.Tensor]:
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self.device), **{self._cache_kwarg: past},
                use_cache=True,
            )
            if routes is not None:
                routes.append(self._routes.take(len(ids)))
            if self._index_sets is not None:
                sets = self._index_sets.take()
                if index_sets is not None:
                    index_sets.append(sets)
            if self._hidden_tap is not None:
                hidden = self._hidden_tap.take()
                if hiddens is not None:
                    hiddens.append(hidden)
        # sampled and scored on the host (device.py): the same answer from the same logits on any device
        return out.get(self._cache_kwarg), out.logits[0].float().cpu()

    def _prefill(self, req: _Request, limit: int, routes: list[torch.Tensor] | None,
                 index_sets: list[dict[int, torch.Tensor]] | None = None, hiddens: list[torch.Tensor] | None = None
                 ) -> tuple[Any, torch.Tensor, int, int, str | None]:
        """The prompt's forward after the longest cached prefix of it (at most ``limit`` tokens) that the serving
        weights computed: lookup and forward under one hold of the compute lock (a weight switch takes it).
        Returns (cache, logits of the fed positions, tokens reused, the prefix cache's generation, the version label
        of the reused prefix or None)."""
        with self._compute_lock:
            generation = self._prefix_cache.generation
            hit = self._prefix_cache.match(req.input_ids, limit, need_routes=routes is not None)
            reused = hit.length if hit is not None else 0
            if routes is not None and hit is not None:
                routes.append(hit.routes)
            past, logits = self._forward_locked(None if hit is None else hit.kv, req.input_ids[reused:], routes,
                                                index_sets, hiddens)
        return past, logits, reused, generation, None if hit is None else hit.version

    def _entries(self, values: list[Any], ids: list[int], req: _Request) -> list[list[Any]]:
        """SGLang's log-prob entries ``[logprob, token_id, text]`` (text with ``return_text_in_logprobs``)."""
        text = req.return_text_in_logprobs and self.tokenizer is not None
        return [[v, t, self.tokenizer.decode([t]) if text else None] for v, t in zip(values, ids, strict=True)]

    def _run(self, req: _Request) -> dict[str, Any]:
        started = time.perf_counter()
        cfg = req.sampling
        seed = cfg.sampling_seed
        if seed is None:
            with self._state:
                seed = self._seed_rng.getrandbits(63)
        generator = torch.Generator().manual_seed(seed % (2**63))
        max_new = min(cfg.max_new_tokens, self.context_length - len(req.input_ids))
        out_ids: list[int] = []
        out_lps: list[float] = []
        kept_ids: list[int] = []
        kept_offsets: list[int] = [0]
        input_lps: list[list[Any]] | None = None
        input_top: list[Any] | None = None
        out_top: list[Any] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        trim_text_to: int | None = None
        stop_trim_token = False
        # an MoE model's routes are kept with its cached prefixes, whether this request asks for them or not
        keep_routes = req.return_routed_experts or (self._prefix_cache.enabled and self._routes is not None)
        routes: list[torch.Tensor] | None = [] if keep_routes else None
        past, reused, generation, cached_version = None, 0, None, None
        index_sets: list[dict[int, torch.Tensor]] | None = [] if self._index_dump is not None else None
        spec_verify_ct = spec_drafted = spec_accepted = 0  # each verifying forward emits its kept drafts + 1
        speculate = self.speculating and not req.top_logprobs_num and not cfg.return_top_p_token_ids
        # MTP speculation: the served model's final hidden state at every fed position (what the MTP layer reads)
        hiddens: list[torch.Tensor] | None = [] if speculate and self._mtp_draft is not None else None

        with self._admitted(req):
            input_logprobs = 0 <= req.logprob_start_len < len(req.input_ids)  # -1 unless return_logprob
            abort = self._check_step(req)
            if abort is None and (max_new > 0 or input_logprobs):
                # reuse leaves the last prompt token to feed, and every scored position (SGLang's radix match)
                limit = min(len(req.input_ids) - 1, req.logprob_start_len if input_logprobs else len(req.input_ids))
                past, logits, reused, generation, cached_version = self._prefill(req, limit, routes, index_sets,
                                                                                 hiddens)
                if input_logprobs:
                    start = req.logprob_start_len
                    targets = torch.tensor(req.input_ids[start + 1 :], dtype=torch.long)
                    rows = torch.log_softmax(logits[start - reused:-1], dim=-1)
                    lps = rows.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                    input_lps = self._entries([None] + lps.tolist(), req.input_ids[start:], req)
                    if req.top_logprobs_num:
                        input_top = [None] + [self._top_entries(row, req) for row in rows]
            drafted = _DraftState(mtp=MTPDraftState() if self._mtp_draft is not None else None)
            pending: list[tuple[int, float]] = []  # tokens a speculative step emitted, not yet taken
            for step in range(max_new):
                abort = abort or self._check_step(req)
                if abort is not None:
                    break
                kept = None
                if pending:
                    token, logprob = pending.pop(0)
                elif step > 0 and speculate:
                    k = min(self.speculative_num_steps, max_new - step - 1)
                    past, emitted = self._speculate(past, req.input_ids + out_ids, drafted, k, cfg, generator,
                                                    routes, index_sets, hiddens)
                    spec_verify_ct += 1
                    spec_drafted += k
                    spec_accepted += len(emitted) - 1
                    (token, logprob), pending = emitted[0], emitted[1:]
                else:
                    if step > 0:
                        past, logits = self._forward(past, [out_ids[-1]], routes, index_sets, hiddens)
                    token, logprob, kept = _choose_token(logits[-1], cfg, generator, self.return_original_logprob)
                if req.top_logprobs_num:  # 0 unless return_logprob
                    # the distribution output_token_logprobs reports: T = 1 when greedy or original, else 1/T
                    t = self._reported_temperature(cfg)
                    out_top.append(self._top_entries(torch.log_softmax(logits[-1] / t, dim=-1), req))
                out_ids.append(token)
                out_lps.append(logprob)
                if kept is not None:
                    kept_ids.extend(kept)
                    kept_offsets.append(len(kept_ids))
                if (not cfg.ignore_eos and token in self.eos_token_ids) or token in cfg.stop_token_ids:
                    finish = {"type": "stop", "matched": token}
                    stop_trim_token = not cfg.no_stop_trim
                    break
                if cfg.stop_strs:
                    decoded = self._decode(out_ids, cfg)
                    hit = min(((decoded.find(s), s) for s in cfg.stop_strs if s in decoded), default=None)
                    if hit is not None:
                        finish = {"type": "stop", "matched": hit[1]}
                        if not cfg.no_stop_trim:
                            trim_text_to = hit[0]
                        break
            if abort is not None:
                finish = {"type": "abort", "message": abort}
            weight_version = self.weight_version  # the weights that produced the last token
            fed_routes = torch.cat(routes) if routes else None  # [fed tokens, layers, top_k]
            # the fed tokens: the prompt, the outputs but the last
            fed = (req.input_ids + out_ids)[: len(req.input_ids) + max(len(out_ids) - 1, 0)]
            if past is not None and self._prefix_cache.enabled:
                self._prefix_cache.insert(fed, past, fed_routes, generation)
            if index_sets:
                self._dump_index_sets(fed, reused, weight_version, index_sets)

        text_ids = out_ids[:-1] if stop_trim_token else out_ids
        text = self._decode(text_ids, cfg) if self.tokenizer is not None else ""
        if trim_text_to is not None:
            text = text[:trim_text_to]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": reused,
            "cached_weight_version": cached_version,  # the reused prefix's version (prefix_cache.py), None: none
            "weight_version": weight_version,
            "e2e_latency": time.perf_counter() - started,
        }
        if self.speculating:  # SGLang's names (slime's rollout metrics read them), and tokens per forward
            meta["spec_verify_ct"] = spec_verify_ct
            meta["spec_accept_token_num"] = spec_accepted  # SGLang's names: the draft tokens kept, and proposed
            meta["spec_draft_token_num"] = spec_drafted
            spec_tokens = spec_accepted + spec_verify_ct
            meta["spec_accept_length"] = spec_tokens / spec_verify_ct if spec_verify_ct else 0.0
            if spec_verify_ct:
                with self._state:
                    counts = self._spec_stats.setdefault(weight_version, [0, 0])
                    counts[0] += spec_verify_ct
                    counts[1] += spec_tokens
        if req.return_logprob:
            meta["input_token_logprobs"] = input_lps or []
            meta["output_token_logprobs"] = self._entries(out_lps, out_ids, req)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = input_top or []
                meta["output_top_logprobs"] = out_top
        if req.return_routed_experts:  # SGLang's layout: base64 of int32 [fed tokens, layers, top_k]
            flat = fed_routes if fed_routes is not None else torch.zeros(0, dtype=torch.int32)
            meta["routed_experts"] = base64.b64encode(flat.contiguous().numpy().tobytes()).decode("ascii")
        if cfg.return_top_p_token_ids:
            meta["top_p_token_ids"] = kept_ids
            meta["top_p_token_offsets"] = kept_offsets
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    def _reported_temperature(self, cfg: SamplingConfig) -> float:
        """The temperature of the distribution output log-probs are reported from: 1 when greedy or original, else
        the request's."""
        return 1.0 if cfg.greedy or self.return_original_logprob else cfg.temperature

    def _reported_logprob(self, row: torch.Tensor, token: int, cfg: SamplingConfig) -> float:
        """The log-prob ``_choose_token`` reports for ``token`` from the logits ``row``: the target's, unscaled when
        greedy or original, else at the request's temperature."""
        return float(torch.log_softmax(row / self._reported_temperature(cfg), dim=-1)[token])

    def _speculate(self, past: Any, seq: list[int], drafted: _DraftState, k: int, cfg: SamplingConfig,
                   generator: torch.Generator, routes: list[torch.Tensor] | None = None,
                   index_sets: list[dict[int, torch.Tensor]] | None = None,
                   hiddens: list[torch.Tensor] | None = None) -> tuple[Any, list[tuple[int, float]]]:
        """One speculative step after ``seq`` (its last token not yet fed to the served model): the draft (a draft
        model, or the checkpoint's MTP layer reading ``hiddens``) proposes ``k`` tokens, one forward of the served
        model over the last token and the drafts verifies them (:func:`slime_ascend.rollout.speculative.verify`);
        the caches are cut back to the kept tokens, and so are the verifying forward's records (``routes``,
        ``index_sets``, ``hiddens``): what the request keeps is what feeding the kept tokens one by one records.
        Returns the served model's cache and the emitted tokens with the served model's log-probs."""

        def dist(row: torch.Tensor) -> torch.Tensor:
            return sampling_distribution(row, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)

        def choose(row: torch.Tensor) -> int:
            if cfg.greedy:
                return int(torch.argmax(row))
            q = dist(row)
            q_rows.append(q)
            return categorical(q, float(torch.rand(1, generator=generator, dtype=torch.float64)))

        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        with self._compute_lock, torch.no_grad():  # the model and its draft at one weight version (a switch locks)
            if self._mtp_draft is not None:
                assert hiddens is not None and drafted.mtp is not None
                if k:  # positions 0 .. len(seq) - 2: every fed token's hidden state, kept as one tensor (the
                    # list grows by one piece a forward; joined once here, not again over its whole length each step)
                    hiddens[:] = [torch.cat(hiddens)]
                    tokens = self._mtp_draft.draft(drafted.mtp, hiddens[0], seq, k, lambda row: choose(row.cpu()))
            else:
                feed = seq[drafted.length:]
                for _ in range(k):
                    out = self.draft_model(input_ids=torch.tensor([feed], dtype=torch.long, device=self.device),
                                           **{self._cache_kwarg: drafted.past}, use_cache=True)
                    drafted.past, drafted.length = out.get(self._cache_kwarg), drafted.length + len(feed)
                    token = choose(out.logits[0, -1].float().cpu())
                    tokens.append(token)
                    feed = [token]
            past, logits = self._forward_locked(past, [seq[-1]] + tokens, routes, index_sets, hiddens)
            if cfg.greedy:
                emitted = verify(logits, tokens)
            else:
                uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64)
                emitted = verify(torch.stack([dist(row) for row in logits]), tokens,
                                 torch.stack(q_rows) if q_rows else torch.zeros(0, logits.shape[1]), uniforms)
            kept = len(seq) + len(emitted) - 1  # the prompt, the outputs and the kept drafts: what both have seen
            past.crop(kept)
            fed = len(emitted)  # of the verifying forward: the last token and the kept drafts
            if routes:
                routes[-1] = routes[-1][:fed]
            if index_sets:
                index_sets[-1] = {layer: sets[:fed] for layer, sets in index_sets[-1].items()}
            if hiddens:
                hiddens[-1] = hiddens[-1][:fed]
            if drafted.past is not None and drafted.length > kept:
                drafted.past.crop(kept)
                drafted.length = kept
        return past, [(t, self._reported_logprob(logits[i], t, cfg)) for i, t in enumerate(emitted)]

    def _dump_index_sets(self, fed: list[int], reused: int, weight_version: str,
                         index_sets: list[dict[int, torch.Tensor]]) -> None:
        """One request's rollout record (:mod:`slime_ascend.dsa.index_sets`): per layer the key sets of its fed
        positions after the ``reused`` ones, every forward's rows padded with -1 to one width."""
        layers = {}
        for layer in index_sets[0]:
            parts = [sets[layer] for sets in index_sets]
            width = max(p.shape[1] for p in parts)
            layers[layer] = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])
        record = {"tokens": list(fed), "start": int(reused), "weight_version": weight_version, "layers": layers}
        directory = self._index_dump
        if directory is None:  # dumping stopped meanwhile
            return
        try:
            for _ in range(_DUMP_NAME_TRIES):
                name = f"rollout-{os.getpid()}-{next(self._index_dump_count):06d}.pt"
                try:  # a new file, never through a link planted under its name (dump_dir.py)
                    write_file(directory, name, lambda f: torch.save(record, f))
                    return
                except FileExistsError:
                    logger.warning("--dump-dsa-index-sets: %s already exists in %s (not ours: left alone); the record "
                                   "takes the next number", name, directory)
            raise FileExistsError(f"{_DUMP_NAME_TRIES} record names in a row already exist")
        except (OSError, RuntimeError) as exc:  # a full disk (torch.save's C++ writer raises RuntimeError)
            self._stop_dumping(directory, exc)

    def _stop_dumping(self, directory: Path, exc: BaseException) -> None:
        """A dump write failed: one warning, no more dumping; generation goes on."""
        with self._index_dump_lock:
            if self._index_dump is None:
                return
            self._index_dump = None
        logger.warning("--dump-dsa-index-sets %s: writing a record failed (%s); dumping stops, generation goes on. "
                       "Fix: free space there (or name another directory) and restart the engine to dump again",
                       directory, " ".join(f"{type(exc).__name__}: {exc}".split())[:300])

    def _top_entries(self, log_probs: torch.Tensor, req: _Request) -> list[list[Any]]:
        """The ``top_logprobs_num`` largest of one position's log-probs ``[V]``, ``[logprob, id, text]`` each."""
        values, ids = torch.topk(log_probs, req.top_logprobs_num)
        return self._entries(values.tolist(), ids.tolist(), req)

    def _decode(self, ids: list[int], cfg: SamplingConfig) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=cfg.skip_special_tokens)

    # ------------------------------------------------------------------ serving
    @contextlib.contextmanager
    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0, **server_kwargs: Any) -> Iterator[str]:
        """Serve this engine over HTTP from a daemon thread; yields the bound base URL ``http://host:port``.

        ``server_kwargs`` go to :func:`slime_ascend.rollout.http_server.make_server` (timeout, backlog, ...).
        """
        server = make_server(self, host=host, port=port, **server_kwargs)
        thread = threading.Thread(target=server.serve_forever, name="torch-engine-http", daemon=True)
        thread.start()
        try:
            bound_host, bound_port = server.server_address[:2]
            yield f"http://{bound_host}:{bound_port}"
        finally:
            with self._state:  # release anyone parked on pause so the server can stop
                self._paused = None
                for req in self._live.values():
                    req.abort_message = "engine shutting down"
                self._state.notify_all()
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
