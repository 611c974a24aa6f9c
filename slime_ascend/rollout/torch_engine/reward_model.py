"""The torch engine serving an outcome reward model: SGLang's ``POST /classify``.

A checkpoint whose ``config.json`` names a ``*ForSequenceClassification`` architecture (an HF reward model: the
language model with a ``score`` head, e.g. Skywork-Reward's ``LlamaForSequenceClassification``) is served by
:class:`RewardModelEngine` instead of the generating engine, as SGLang serves one with ``--is-embedding``:

* ``POST /classify``: ``{"text": str | [str]}`` or ``{"input_ids": [int] | [[int]]}`` -> per input
  ``{"embedding": [score per label], "meta_info": {"id", "prompt_tokens", "weight_version"}}`` (one object for
  one input, a list for a list), SGLang's native reward-model answer. Each input is scored alone (no padding:
  the score head reads the last token's hidden state), one forward at a time.
* ``POST /generate`` is refused in one line naming ``/classify`` (``is_generation`` is false in
  ``/get_model_info``, as SGLang reports for such a model).
* ``/update_weights_from_disk`` loads another checkpoint of the same architecture (names and shapes checked
  before the swap); the health, info, load and control routes answer as the generating engine's do.

The request is bounded like ``/generate``: at most ``max_batch_size`` inputs and ``max_prompt_tokens`` tokens
in all. :mod:`slime_ascend.reward_mix.orm` is the client (an ``orm`` term of ``reward-mix``).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...files import read_json_object
from ..sglang_protocol import ONE_SERVER_INFO, RequestError, check_positive_ints, next_weight_version
from . import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_PROMPT_TOKENS

__all__ = ["RewardModelEngine", "is_reward_checkpoint", "load_reward_model", "reward_scores", "tiny_reward_model"]

ARCHITECTURE_SUFFIX = "ForSequenceClassification"
_CLASSIFY_KEYS = frozenset({"text", "input_ids", "rid", "model"})
MAX_CHARS_PER_TOKEN = 16  # text above 16 characters a token of the limit is refused before it is tokenized


def is_reward_checkpoint(model_dir: str | Path | None) -> bool:
    """Whether ``model_dir``'s config.json names a sequence-classification (reward model) architecture (read
    without torch: ``serve-torch`` asks before it imports it)."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return False
    try:
        archs = read_json_object(Path(model_dir) / "config.json").get("architectures") or []
    except ValueError:  # an unreadable config is the loader's one-line error, not this question's
        return False
    return isinstance(archs, list) and any(isinstance(a, str) and a.endswith(ARCHITECTURE_SUFFIX) for a in archs)


def tiny_reward_model(seed: int = 0, num_labels: int = 1):
    """The tiny Qwen3 (:func:`..model.tiny_qwen3_config`) with a random ``score`` head of ``num_labels`` outputs,
    weights drawn from ``torch.manual_seed(seed)``: a reward model for tests and the CPU demo."""
    import torch
    from transformers import Qwen3ForSequenceClassification

    from . import model as reference_model

    config = reference_model.tiny_qwen3_config(num_labels=num_labels)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForSequenceClassification(config)
    finally:
        torch.random.set_rng_state(rng_state)
    return model.eval()


def load_reward_model(model_dir: str | Path, dtype: Any = "float32"):
    """A ``*ForSequenceClassification`` checkpoint directory, in eval mode."""
    from transformers import AutoModelForSequenceClassification

    from . import model as reference_model

    if not is_reward_checkpoint(model_dir):
        raise ValueError(f"{str(model_dir)!r} is not a reward model: its config.json names no "
                         f"*{ARCHITECTURE_SUFFIX} architecture")
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), dtype=reference_model._resolve_dtype(dtype), use_safetensors=True)
    reference_model._reset_rotary_buffers(model)
    return model.eval()


def reward_scores(model: Any, inputs: list[list[int]]) -> list[list[float]]:
    """Each token list's scores (one per label), each input alone: the reference of ``/classify``."""
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for ids in inputs:
            logits = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device)).logits
            out.append([float(v) for v in logits[0].float().cpu()])
    return out


class RewardModelEngine:
    """A reward model on SGLang's HTTP surface (:func:`slime_ascend.rollout.sglang_protocol.routes`)."""

    engine_name = "the torch engine (reward model)"

    def __init__(self, model_path: str | Path, dtype: Any = "float32", device: str = "cpu",
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                 weight_version: str = "default") -> None:
        from . import device as engine_device
        from . import model as reference_model

        check_positive_ints(max_batch_size=max_batch_size, max_prompt_tokens=max_prompt_tokens)
        self.device = engine_device.resolve(str(device))
        self.model_path = str(model_path)
        self.dtype = reference_model._resolve_dtype(dtype)
        self.model = load_reward_model(self.model_path, self.dtype).to(self.device)
        self.tokenizer = reference_model.load_tokenizer(self.model_path)
        self.max_batch_size = max_batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.vocab_size = int(self.model.config.vocab_size)
        self.weight_version = str(weight_version)
        self._compute_lock = threading.Lock()  # one forward at a time; a weight swap takes it too
        self._state = threading.Lock()
        self._running = 0
        self._scored = 0  # inputs scored since start (server_info's scored_inputs)
        self._paused = False

    # ------------------------------------------------------------------ info
    def server_info(self) -> dict[str, Any]:
        return {
            "engine": "slime_ascend.torch_engine",
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.model_path,
            "is_embedding": True,  # SGLang's flag for a reward / embedding model
            "weight_version": self.weight_version,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "num_labels": int(self.model.config.num_labels),
            "vocab_size": self.vocab_size,
            "tp_size": 1,
            **ONE_SERVER_INFO,
            "skip_tokenizer_init": self.tokenizer is None,
            "paused": self._paused,
            "num_running_reqs": self._running,
            "num_waiting_reqs": 0,
            "scored_inputs": self._scored,
            "max_batch_size": self.max_batch_size,
            "max_prompt_tokens": self.max_prompt_tokens,
        }

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": False,
                "weight_version": self.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": getattr(self.model.config, "model_type", None),
                "architectures": getattr(self.model.config, "architectures", None)}

    def loads(self) -> dict[str, Any]:
        with self._state:
            running = self._running
        return {"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                           "num_total_reqs": running}]}

    def health(self) -> bool:
        return True

    def health_generate(self) -> bool:
        """A one-token forward answers (SGLang's health_generate of an embedding model runs one)."""
        try:
            reward_scores(self.model, [[0]])
        except Exception:  # noqa: BLE001 - any failure of the forward is "cannot serve"
            return False
        return True

    # ------------------------------------------------------------------ work
    def generate(self, payload: Any, is_disconnected: Callable[[], bool] | None = None) -> Any:
        raise RequestError(f"{self.engine_name} serves a reward model (is_generation: false, as SGLang with "
                           "--is-embedding): score text with POST /classify {\"text\": ...}")

    def _inputs(self, body: Any) -> tuple[list[list[int]], bool]:
        """(token lists, whether the request named one input) from a ``/classify`` body, checked."""
        if not isinstance(body, dict):
            raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - _CLASSIFY_KEYS)
        if unknown:
            raise RequestError(f"unknown /classify keys {unknown}; send text or input_ids")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError("/classify needs exactly one of 'text' (a string or a list of strings) or "
                               "'input_ids' (a list of token ids or a list of them)")
        single = isinstance(text, str) or (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids))
        if text is not None:
            texts = [text] if isinstance(text, str) else text
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("'text' must be a string or a non-empty list of strings")
            if self.tokenizer is None:
                raise RequestError(f"{self.model_path} has no tokenizer: send 'input_ids'")
            chars = sum(len(t) for t in texts)
            if len(texts) > self.max_batch_size or chars > MAX_CHARS_PER_TOKEN * self.max_prompt_tokens:
                self._check_batch(len(texts), chars // MAX_CHARS_PER_TOKEN)  # the tokenizer's work bounded first
            inputs = [list(self.tokenizer.encode(t)) for t in texts]
        else:
            inputs = [ids] if single else ids
            if not isinstance(inputs, list) or not inputs or not all(
                    isinstance(row, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in row)
                    for row in inputs):
                raise RequestError("'input_ids' must be a list of token ids or a non-empty list of such lists")
        for n, row in enumerate(inputs):
            if not row:
                raise RequestError(f"input {n} has no tokens: a reward model scores at least one token")
            bad = [i for i in row if not 0 <= i < self.vocab_size]
            if bad:
                raise RequestError(f"input {n} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        self._check_batch(len(inputs), sum(len(row) for row in inputs))
        return inputs, single

    def _check_batch(self, count: int, tokens: int) -> None:
        if count > self.max_batch_size:
            raise RequestError(f"/classify request of {count} inputs is above this server's limit of "
                               f"{self.max_batch_size} (--max-batch-size); split it", status=413)
        if tokens > self.max_prompt_tokens:
            raise RequestError(f"/classify request of {tokens} tokens is above this server's limit of "
                               f"{self.max_prompt_tokens} (--max-prompt-tokens); split it", status=413)

    def classify(self, body: Any) -> Any:
        inputs, single = self._inputs(body)
        rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
        with self._state:
            if self._paused:
                raise RequestError(f"{self.engine_name} is paused (/pause_generation); /continue_generation "
                                   "first", status=503, retry_after=1)
            self._running += 1
        try:
            with self._compute_lock:
                version = self.weight_version
                scores = reward_scores(self.model, inputs)
        finally:
            with self._state:
                self._running -= 1
        with self._state:
            self._scored += len(inputs)
        answers = [{"embedding": s, "meta_info": {"id": rid if single else f"{rid}_{n}", "prompt_tokens": len(row),
                                                   "weight_version": version}}
                   for n, (s, row) in enumerate(zip(scores, inputs))]
        return answers[0] if single else answers

    # ------------------------------------------------------------------ control
    def update_weights_from_disk(self, model_path: str, weight_version: Any = None, load_format: Any = None) -> dict:
        if load_format not in (None, "auto", "safetensors"):
            raise RequestError(f"load_format {load_format!r} is not supported by {self.engine_name}; leave it out")
        version = next_weight_version(self.weight_version, weight_version)
        try:
            new = load_reward_model(model_path, self.dtype)
        except (OSError, ValueError) as exc:
            return {"success": False, "message": f"{model_path}: {' '.join(str(exc).split())[:300]}"}
        old_shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        new_shapes = {k: tuple(v.shape) for k, v in new.state_dict().items()}
        if old_shapes != new_shapes:
            diff = sorted(set(old_shapes.items()) ^ set(new_shapes.items()))[:3]
            return {"success": False, "message": f"{model_path} is another architecture than the served reward "
                    f"model (first differences: {json.dumps([list(map(str, d)) for d in diff])}); restart the "
                    "engine with --model pointing at it"}
        new = new.to(self.device)
        with self._compute_lock:
            self.model, self.model_path, self.weight_version = new, str(model_path), version
        return {"success": True, "message": f"loaded {model_path}", "weight_version": version}

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        with self._state:
            self._paused = True
        return {"success": True, "message": f"paused ({mode}): /classify answers 503 until continue_generation"}

    def continue_generation(self) -> dict[str, Any]:
        with self._state:
            self._paused = False
        return {"success": True, "message": "continued"}

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        # one forward per request, run to its end under the compute lock: nothing is queued to abort
        return {"success": True, "message": "a reward model's requests are not abortable; none queued"}

    def flush_cache(self) -> dict[str, Any]:
        return {"success": True, "message": "a reward model keeps no cache"}
