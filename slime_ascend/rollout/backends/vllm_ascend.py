"""``vllm-ascend``: vLLM with vllm-ascend as slime's rollout engine, through an SGLang-surface adapter.

slime talks SGLang's HTTP API to its engines; vLLM serves an OpenAI-compatible API. The adapter
is a small stdlib HTTP server in front of one vLLM server, attached to slime with
``--rollout-external-engine-addrs``:

* ``POST /generate`` (``input_ids`` + SGLang sampling params + ``return_logprob``, ``logprob_start_len``,
  ``top_logprobs_num``) -> ``POST /v1/completions`` with the token ids as the prompt,
  ``return_token_ids``, ``return_tokens_as_token_ids`` and ``return_weight_versions``; output log-probs
  with ``logprobs: k`` (``k = top_logprobs_num``, 0: the sampled token only), prompt log-probs with
  ``prompt_logprobs: k``; ``max_new_tokens: 0`` (scoring, as slime's and slime_ascend's OPD teachers
  send) becomes vLLM's prompt-only ``echo: true, max_tokens: 0``. The answer is rebuilt as SGLang's
  ``{text, output_ids, meta_info}``: ``output_token_logprobs`` ``[[logprob, id, None], ...]``;
  ``input_token_logprobs`` for ``input_ids[logprob_start_len:]``, the first entry's log-prob ``None``;
  ``input_top_logprobs`` / ``output_top_logprobs``: per position ``None`` (the first input position)
  or the ``k`` largest ``[logprob, id, None]``, largest first (SGLang's order; vLLM's per-position dict
  lists the prompt token first and may hold ``k + 1`` entries). vLLM's prompt log-probs are raw
  (temperature 1), as SGLang's ``input_token_logprobs``; vLLM writes ``-inf`` as ``-9999.0``;
* ``meta_info.weight_version``: the version of the weights that sampled the last output token, from
  vLLM's ``choices[0].weight_versions`` spans; when there are none, vLLM's current version;
* ``POST /update_weights_from_disk`` -> vLLM's dev-mode ``/collective_rpc``: ``update_config``
  (``model_config.model`` = the new checkpoint) then ``reload_weights``, then ``/reset_prefix_cache``,
  then ``POST /update_weight_version`` (the requested version, else the engine's numeric version + 1,
  else ``"1"``); the answer's version is the one vLLM reports afterwards;
* ``GET /get_weight_version`` (and ``/server_info``, ``/model_info``): vLLM's ``GET /weight_info``,
  read on every call (the adapter keeps no version of its own);
* ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` -> ``/sleep?level=N`` / ``/wake_up``;
* ``POST /pause_generation`` / ``/continue_generation`` / ``/abort_request``: handled in the adapter
  (new requests wait while paused; ``abort`` closes the upstream connections of in-flight requests,
  which makes vLLM abort them, and answers them with ``finish_reason: abort``);
* the rest of SGLang's surface as :mod:`slime_ascend.rollout.sglang_protocol` maps it for every engine
  (``/server_info``, ``/model_info``, ``/v1/loads``, ``/health*``, ``/flush_cache``, the same input checks,
  501 for the distributed weight-sync endpoints), served by :mod:`slime_ascend.rollout.http_server` with the
  same connection and request limits (and flags) as ``slime-ascend serve-torch``.

Needs a vLLM with the dev-mode RL endpoints ``GET /weight_info`` / ``POST /update_weight_version`` and
``return_weight_versions`` (vllm-project/vllm#49040; present in vLLM 0.33.0) started with
``VLLM_SERVER_DEV_MODE=1`` (vllm-ascend's ``rl_config`` sets it); a vLLM without them is refused at the
first weight update or version read, before anything changes. Start vLLM with ``--logprobs-mode
processed_logprobs`` (output log-probs after temperature, as SGLang reports them) and ``--max-logprobs``
at least the largest ``top_logprobs_num`` (vLLM's default is 20; slime_ascend's OPD top-k default is 32).
A request vLLM refuses (400/422) is answered 400 with vLLM's message; other vLLM failures 502.

Tested (``tests/rollout/test_vllm_ascend.py``) end to end over loopback HTTP against vLLM 0.33.0's own
server code (its FastAPI routers, ``CompletionRequest`` validation, ``OpenAIServingCompletion`` answer
building) around a toy model (``tests/rollout/vllm_toy_server.py``) where vLLM imports, and everywhere
against the exchanges recorded from it (``tests/rollout/data/vllm_0.33.0.json``). Not tested: a vLLM /
vllm-ascend engine running a real model (neither runs on this CPU host).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from ...command import ArgumentParser
from ..http_server import add_server_flags, make_server, serve_until_interrupted, server_options
from ..sglang_protocol import ONE_SERVER_INFO, RequestError, abort_matches, check_generate_keys, next_weight_version
from . import RolloutBackend

logger = logging.getLogger("slime_ascend.rollout")

# SGLang sampling param -> vLLM completions field
SAMPLING_MAP = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
    "min_new_tokens": "min_tokens",
}
# accepted and dropped: SGLang-only hints with no vLLM counterpart
IGNORED_SAMPLING = {"custom_params"}
# top-level /generate keys honoured (sglang_protocol.check_generate_keys refuses the rest)
GENERATE_KEYS = frozenset({"input_ids", "sampling_params", "return_logprob", "rid", "logprob_start_len",
                           "top_logprobs_num"})
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default (vLLM's is 16)
VLLM_DEV_MODE_HINT = ("the adapter needs vLLM's dev-mode RL endpoints (GET /weight_info, POST /update_weight_version: "
                      "vllm-project/vllm#49040, vLLM 0.33.0 has them) with VLLM_SERVER_DEV_MODE=1")


def _int_field(name: str, value: Any, default: int, low: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RequestError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def to_vllm_request(
    model: str, input_ids: list[int], sampling_params: Mapping[str, Any] | None, *, return_logprob: bool = False,
    logprob_start_len: int = -1, top_logprobs_num: int = 0,
) -> dict[str, Any]:
    """SGLang ``/generate`` fields -> a vLLM ``/v1/completions`` body (raises :class:`RequestError`)."""
    if not isinstance(input_ids, list) or not input_ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in input_ids):
        raise RequestError("input_ids must be a non-empty list of token ids (the adapter does not tokenize text)")
    if logprob_start_len >= len(input_ids):
        raise RequestError(f"logprob_start_len={logprob_start_len} must be below the number of input tokens "
                           f"{len(input_ids)} (or -1 for no input log-probs)")
    params = dict(sampling_params or {})
    body: dict[str, Any] = {
        "model": model,
        "prompt": input_ids,
        "max_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
        "echo": False,
        "stream": False,
        "n": 1,
    }
    n = params.pop("n", 1)
    if n != 1:
        raise RequestError(f"sampling_params.n={n!r}: the adapter serves one sample per request (send n requests)")
    for key, value in params.items():
        if key in IGNORED_SAMPLING or value is None:
            continue
        if key not in SAMPLING_MAP:
            raise RequestError(f"sampling_params.{key} has no vLLM counterpart in the adapter; drop it")
        body[SAMPLING_MAP[key]] = value
    top = top_logprobs_num if return_logprob else 0
    if body["max_tokens"] == 0:
        body["echo"] = True  # vLLM's prompt-only path: it accepts max_tokens 0 only with echo
    else:
        body["logprobs"] = top  # the sampled token's log-prob, plus the top-k with top_logprobs_num
    if return_logprob and logprob_start_len >= 0:
        body["prompt_logprobs"] = top
    return body


def _token_id(token: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise RequestError(f"vLLM returned token {token!r}, expected 'token_id:<n>' (return_tokens_as_token_ids)", 502)
    return int(token.split(":", 1)[1])


def _top_entries(row: Mapping[int, float], k: int) -> list[list[Any]]:
    """The ``k`` largest of one position's ``{token_id: logprob}``, SGLang's ``[logprob, id, None]``, largest first."""
    ranked = sorted(row.items(), key=lambda item: -item[1])[:k]
    return [[lp, tid, None] for tid, lp in ranked]


def _input_logprobs(choice: Mapping[str, Any], input_ids: list[int], start: int, k: int) -> dict[str, Any]:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs`` when ``k``) from vLLM's
    ``prompt_logprobs``: one ``{"<token_id>": {"logprob", "rank", "decoded_token"}}`` (or None) per prompt token."""
    rows = choice.get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != len(input_ids):
        raise RequestError("vLLM answer lacks one choices[0].prompt_logprobs entry per prompt token "
                           f"({len(input_ids)}); got {str(rows)[:200]}", 502)
    tokens: list[list[Any]] = [[None, input_ids[start], None]]
    tops: list[Any] = [None]
    for pos in range(start + 1, len(input_ids)):
        try:
            row = {int(t): float(v["logprob"]) for t, v in rows[pos].items()}
            tokens.append([row[input_ids[pos]], input_ids[pos], None])
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RequestError(f"vLLM prompt_logprobs[{pos}] has no log-prob for prompt token {input_ids[pos]}: "
                               f"{str(rows[pos])[:200]}", 502) from exc
        tops.append(_top_entries(row, k))
    out: dict[str, Any] = {"input_token_logprobs": tokens}
    if k:
        out["input_top_logprobs"] = tops
    return out


def from_vllm_response(
    answer: Mapping[str, Any], *, rid: str, input_ids: list[int], max_tokens: int | None, return_logprob: bool,
    current_version: Callable[[], str], logprob_start_len: int = -1, top_logprobs_num: int = 0,
) -> dict[str, Any]:
    """A vLLM completions answer -> SGLang's ``/generate`` answer (``current_version()``: vLLM's weight
    version, asked only when the answer carries no ``weight_versions`` span)."""
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise RequestError(f"vLLM answer has no choices[0]: {answer!r}"[:500], 502) from exc
    logprobs = choice.get("logprobs") or {}
    k = top_logprobs_num if return_logprob else 0
    if max_tokens == 0:  # echo without generation: vLLM samples one token internally and reports it; SGLang none
        ids: list[int] = []
    elif choice.get("token_ids") is not None:  # vLLM's return_token_ids
        ids = [int(t) for t in choice["token_ids"]]
    elif logprobs.get("tokens") is not None:
        ids = [_token_id(t) for t in logprobs["tokens"]]
    else:
        raise RequestError("vLLM answer carries neither token_ids nor logprobs.tokens", 502)
    reason = choice.get("finish_reason")
    if reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": choice.get("stop_reason")}
    elif reason == "length":
        finish = {"type": "length", "length": max_tokens if max_tokens is not None else len(ids)}
    elif reason == "abort":
        finish = {"type": "abort", "message": "aborted by vLLM"}
    else:
        raise RequestError(f"vLLM finish_reason {reason!r} is not stop/length/abort", 502)
    lps: dict[str, Any] | None = None
    if return_logprob:
        lps = _empty_logprobs(k)
        if ids:
            values = logprobs.get("token_logprobs")
            if values is None or len(values) != len(ids):
                raise RequestError("vLLM answer lacks one log-prob per output token (logprobs.token_logprobs)", 502)
            lps["output_token_logprobs"] = [[float(lp), tid, None] for lp, tid in zip(values, ids)]
            if k:
                rows = logprobs.get("top_logprobs")
                if rows is None or len(rows) != len(ids) or not all(isinstance(r, Mapping) for r in rows):
                    raise RequestError("vLLM answer lacks one top-logprobs map per output token "
                                       "(logprobs.top_logprobs)", 502)
                lps["output_top_logprobs"] = [_top_entries({_token_id(t): float(v) for t, v in r.items()}, k)
                                              for r in rows]
        if logprob_start_len >= 0:
            lps.update(_input_logprobs(choice, input_ids, logprob_start_len, k))
    spans = choice.get("weight_versions") or []
    version = str(spans[-1]["version"]) if spans else current_version()
    usage = answer.get("usage") or {}
    return _sglang_answer(
        rid, finish, ids, version, int(usage.get("prompt_tokens", len(input_ids))),
        int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0), lps,
        choice.get("text", "") if ids else "",
    )


def _empty_logprobs(k: int) -> dict[str, Any]:
    """SGLang's log-prob fields of an answer with no tokens scored (``return_logprob`` on)."""
    out: dict[str, Any] = {"input_token_logprobs": [], "output_token_logprobs": []}
    if k:
        out.update(input_top_logprobs=[], output_top_logprobs=[])
    return out


def _sglang_answer(rid: str, finish: dict[str, Any], ids: list[int], weight_version: str, prompt_tokens: int,
                   cached_tokens: int, logprobs: dict[str, Any] | None, text: str = "") -> dict[str, Any]:
    """SGLang's ``/generate`` answer; ``logprobs``: its log-prob fields (None: return_logprob off)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                            "completion_tokens": len(ids), "cached_tokens": cached_tokens,
                            "weight_version": weight_version, **(logprobs or {})}
    return {"text": text, "output_ids": ids, "meta_info": meta}


class VLLMAdapter:
    """SGLang's engine surface (:class:`~slime_ascend.rollout.sglang_protocol.SGLangEngine`) over one vLLM
    OpenAI server at ``vllm_url``."""

    engine_name = "the vllm-ascend adapter"

    def __init__(
        self, vllm_url: str, model: str, *, tp_size: int = 1, sleep_level: int = 1, timeout: float = 3600.0,
    ) -> None:
        parts = urlsplit(vllm_url if "://" in vllm_url else f"http://{vllm_url}")
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"vllm_url {vllm_url!r} must be http://host:port")
        self.host, self.port = parts.hostname, parts.port
        self.model = model
        self.tp_size = int(tp_size)
        self.sleep_level = int(sleep_level)
        self.timeout = timeout
        self._state = threading.Condition()
        self._paused = False
        self._inflight: dict[str, http.client.HTTPConnection] = {}
        self._aborted: set[str] = set()

    # -- upstream -------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None, rid: str | None = None) -> Any:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        if rid is not None:
            with self._state:
                self._inflight[rid] = conn
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            if response.status >= 400:
                # a request vLLM refuses as invalid is the client's to fix; anything else is vLLM's failure
                status = 400 if response.status in (400, 422) else 502
                raise RequestError(f"vLLM {method} {path} answered {response.status}: {raw[:500]!r}", status)
            return json.loads(raw) if raw.strip() else {}
        finally:
            if rid is not None:
                with self._state:
                    self._inflight.pop(rid, None)
            conn.close()

    def _engine_version(self) -> str:
        """The weight version vLLM reports now (dev-mode ``GET /weight_info``)."""
        try:
            answer = self._call("GET", "/weight_info")
        except (RequestError, OSError, http.client.HTTPException) as exc:
            raise RequestError(f"cannot read vLLM's weight version ({exc}); {VLLM_DEV_MODE_HINT}", 502) from exc
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        if not isinstance(version, str):
            raise RequestError(f"vLLM GET /weight_info answered {answer!r}, expected {{'weight_version': str}}"[:500],
                               502)
        return version

    @property
    def weight_version(self) -> str:
        """vLLM's weight version, read from the engine on every call."""
        return self._engine_version()

    # -- SGLang surface -------------------------------------------------------------------
    def generate(self, payload: Mapping[str, Any], is_disconnected: Any = None) -> Any:
        if isinstance(payload, Mapping) and payload.get("input_ids") is None:
            raise RequestError("send input_ids (the adapter does not tokenize 'text')")
        check_generate_keys(payload, GENERATE_KEYS, self.engine_name)
        ids = payload["input_ids"]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return [self.generate({**payload, "input_ids": one, "rid": None}) for one in ids]
        rid, return_logprob = payload.get("rid") or uuid.uuid4().hex, payload.get("return_logprob", False)
        if not isinstance(rid, str):
            raise RequestError(f"rid must be a string, got {rid!r}")
        if not isinstance(return_logprob, bool):
            raise RequestError(f"return_logprob must be true or false, got {return_logprob!r}")
        start = _int_field("logprob_start_len", payload.get("logprob_start_len"), -1, -1) if return_logprob else -1
        top = _int_field("top_logprobs_num", payload.get("top_logprobs_num"), 0, 0) if return_logprob else 0
        body = to_vllm_request(self.model, ids, payload.get("sampling_params"), return_logprob=return_logprob,
                               logprob_start_len=start, top_logprobs_num=top)
        with self._state:
            self._state.wait_for(lambda: not self._paused)
        try:
            answer = self._call("POST", "/v1/completions", body, rid=rid)
        except (OSError, http.client.HTTPException) as exc:
            with self._state:
                was_aborted = rid in self._aborted
                self._aborted.discard(rid)
            if was_aborted:
                return _sglang_answer(rid, {"type": "abort", "message": "aborted by the adapter"}, [],
                                      self.weight_version, len(ids), 0,
                                      _empty_logprobs(top) if return_logprob else None)
            raise RequestError(f"vLLM at {self.host}:{self.port} unreachable: {exc}", 502) from exc
        return from_vllm_response(answer, rid=rid, input_ids=ids, max_tokens=body["max_tokens"],
                                  return_logprob=return_logprob, current_version=self._engine_version,
                                  logprob_start_len=start, top_logprobs_num=top)

    def _abort(self, rids: list[str]) -> int:
        with self._state:
            conns = [(r, self._inflight[r]) for r in rids if r in self._inflight]
            self._aborted.update(r for r, _ in conns)
        for _, conn in conns:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)  # vLLM aborts a request whose client went away
                except OSError:
                    pass
        return len(conns)

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        with self._state:
            self._paused = True
            rids = list(self._inflight)
        aborted = self._abort(rids) if mode == "abort" else 0
        return {"success": True, "message": f"paused (mode={mode}, aborted {aborted})"}

    def continue_generation(self) -> dict[str, Any]:
        with self._state:
            self._paused = False
            self._state.notify_all()
        return {"success": True, "message": "continued"}

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        with self._state:
            rids = [r for r in self._inflight if abort_matches(r, rid, abort_all)]
        return {"success": True, "num_aborted": self._abort(rids)}

    def update_weights_from_disk(self, model_path: str, weight_version: Any = None, **_: Any) -> dict[str, Any]:
        if not isinstance(model_path, str) or not model_path:
            raise RequestError("update_weights_from_disk needs 'model_path'")
        if weight_version is not None and (not isinstance(weight_version, str | int)
                                           or isinstance(weight_version, bool)):
            raise RequestError(f"weight_version must be a string, got {weight_version!r}")
        current = self._engine_version()  # first: a vLLM without the version API is refused before anything changes
        self._call("POST", "/collective_rpc", {"method": "update_config",
                                               "args": [{"model_config": {"model": model_path}}]})
        self._call("POST", "/collective_rpc", {"method": "reload_weights"})
        if self._call("POST", "/reset_prefix_cache").get("success") is False:
            raise RequestError(f"vLLM reloaded {model_path} but could not reset its prefix cache (requests still "
                               f"running: pause generation before a weight update); its weight version stays "
                               f"{current!r}", 409)
        target = next_weight_version(current, weight_version)
        self._call("POST", "/update_weight_version", {"new_version": target})
        reported = self._engine_version()
        if reported != target:
            raise RequestError(f"vLLM reports weight version {reported!r} after POST /update_weight_version "
                               f"{target!r}", 502)
        return {"success": True, "message": f"reloaded {model_path}", "weight_version": reported}

    def release_memory_occupation(self) -> dict[str, Any]:
        self._call("POST", f"/sleep?level={self.sleep_level}")
        return {"success": True}

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        query = "".join(f"&tags={t}" for t in tags or ()).lstrip("&")
        self._call("POST", "/wake_up" + (f"?{query}" if query else ""))
        return {"success": True}

    def flush_cache(self) -> dict[str, Any]:
        return {"success": self._call("POST", "/reset_prefix_cache").get("success") is not False}

    def _answers(self, method: str, path: str, body: Any = None) -> bool:
        try:
            self._call(method, path, body)
            return True
        except (RequestError, OSError, http.client.HTTPException):
            return False

    def health(self) -> bool:
        return self._answers("GET", "/health")

    def health_generate(self) -> bool:
        body = to_vllm_request(self.model, [0], {"max_new_tokens": 1, "temperature": 0.0})
        return self.health() and self._answers("POST", "/v1/completions", body)

    def server_info(self) -> dict[str, Any]:
        """What slime's external-engine discovery and its server-args check read."""
        return {
            "engine": "vllm (slime_ascend vllm-ascend adapter)",
            "vllm_url": f"http://{self.host}:{self.port}",
            "model_path": self.model,
            "served_model_name": self.model,
            "weight_version": self.weight_version,
            "tp_size": self.tp_size,
            **ONE_SERVER_INFO,
            "paused": self._paused,
        }

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model, "is_generation": True, "weight_version": self.weight_version}

    def loads(self) -> dict[str, Any]:
        """Requests at vLLM through this adapter (vLLM's own queue is not visible here: all count as running)."""
        with self._state:
            running = len(self._inflight)
        return {"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                           "num_total_reqs": running}]}


class VLLMAscendBackend(RolloutBackend):
    name = "vllm-ascend"
    description = "vLLM + vllm-ascend behind an SGLang-surface adapter, attached as external engines (disk sync)"
    plugin = "vllm-ascend"

    def env(self, options: Mapping[str, Any]) -> dict[str, str]:
        # for the vLLM server: dev-mode endpoints (sleep/wake, collective_rpc), no expandable segments
        return {"VLLM_SERVER_DEV_MODE": "1", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}

    def vllm_command(self, options: Mapping[str, Any], model_path: str, port: int = 8000, tp_size: int = 1,
                     max_logprobs: int | None = None) -> list[str]:
        """``vllm serve`` argv; ``max_logprobs``: the largest top-k a client will ask (OPD's ``ascend_opd_topk``;
        vLLM refuses more than its ``--max-logprobs``, default 20)."""
        argv = ["vllm", "serve", model_path, "--port", str(port), "--tensor-parallel-size", str(tp_size),
                "--enable-sleep-mode", "--logprobs-mode", "processed_logprobs"]
        if max_logprobs is not None:
            argv += ["--max-logprobs", str(int(max_logprobs))]
        if options["vllm_rl_config"]:
            argv += ["--additional-config", json.dumps({"rl_config": {"enabled": True}})]
        return argv

    def slime_flags(self, options: Mapping[str, Any], addrs: list[str] | None = None) -> list[str]:
        return ["--rollout-external-engine-addrs", *(addrs or ["HOST:PORT"]), "--update-weight-transport", "disk",
                "--update-weight-disk-dir", "DIR"]


BACKEND = VLLMAscendBackend()


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m slime_ascend.rollout.backends.vllm_ascend",
                            description="SGLang-surface adapter in front of a vLLM (vllm-ascend) server")
    parser.add_argument("--vllm-url", required=True, help="http://host:port of the vLLM OpenAI server")
    parser.add_argument("--model", required=True, help="served model name (vLLM's --served-model-name or path)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default loopback; give the node's address when slime runs elsewhere)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1, help="reported to slime as the engine's GPU count")
    parser.add_argument("--sleep-level", type=int, default=1, choices=(1, 2))
    add_server_flags(parser.add_argument_group("limits (bounded work per server, as serve-torch's)"))
    ns = parser.parse_args(argv)
    adapter = VLLMAdapter(ns.vllm_url, ns.model, tp_size=ns.tp_size, sleep_level=ns.sleep_level)
    server = make_server(adapter, ns.host, ns.port, **server_options(ns))
    print(f"vllm adapter at http://{ns.host}:{server.server_address[1]} -> {ns.vllm_url}", flush=True)
    serve_until_interrupted(server)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
