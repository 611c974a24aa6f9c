"""``vllm-ascend``: vLLM with vllm-ascend as slime's rollout engine, through an SGLang-surface adapter.

slime talks SGLang's HTTP API to its engines; vLLM serves an OpenAI-compatible API. The adapter
is a small stdlib HTTP server in front of one vLLM server, attached to slime with
``--rollout-external-engine-addrs``:

* ``POST /generate`` (``input_ids`` + SGLang sampling params + ``return_logprob``) ->
  ``POST /v1/completions`` with the token ids as the prompt, ``logprobs: 0`` (the sampled token's
  log-prob) and ``return_tokens_as_token_ids`` (tokens come back as ``token_id:<n>``); the answer is
  rebuilt as SGLang's ``{text, output_ids, meta_info: {finish_reason, output_token_logprobs, ...}}``;
* ``POST /update_weights_from_disk`` -> vLLM's dev-mode ``/collective_rpc``: ``update_config``
  (``model_config.model`` = the new checkpoint) then ``reload_weights``, then ``/reset_prefix_cache``;
* ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` -> ``/sleep?level=N`` / ``/wake_up``;
* ``POST /pause_generation`` / ``/continue_generation`` / ``/abort_request``: handled in the adapter
  (new requests wait while paused; ``abort`` closes the upstream connections of in-flight requests,
  which makes vLLM abort them, and answers them with ``finish_reason: abort``);
* the rest of SGLang's surface as :mod:`slime_ascend.rollout.http_api` serves it for every engine
  (``/server_info``, ``/model_info``, ``/v1/loads``, ``/health*``, ``/flush_cache``, the same input checks,
  501 for the distributed weight-sync endpoints).

The dev-mode endpoints need ``VLLM_SERVER_DEV_MODE=1`` in vLLM's environment (vllm-ascend's
``rl_config`` sets it). Log-probs: start vLLM with ``--logprobs-mode processed_logprobs`` so they are
taken after temperature, as SGLang reports them. Verified here: the mapping against a stub that
answers in vLLM's response shape; not verified: a real vLLM / vllm-ascend server (neither installs
on this CPU host).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import socket
import threading
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ..http_api import (ONE_SERVER_INFO, RequestError, abort_matches, check_generate_keys, make_server,
                        next_weight_version, serve_until_interrupted)
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
# top-level /generate keys honoured (http_api.check_generate_keys refuses the rest)
GENERATE_KEYS = frozenset({"input_ids", "sampling_params", "return_logprob", "rid"})


def to_vllm_request(model: str, input_ids: list[int], sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """SGLang ``/generate`` fields -> a vLLM ``/v1/completions`` body (raises :class:`RequestError`)."""
    if not isinstance(input_ids, list) or not input_ids or not all(isinstance(t, int) for t in input_ids):
        raise RequestError("input_ids must be a non-empty list of token ids (the adapter does not tokenize text)")
    params = dict(sampling_params or {})
    body: dict[str, Any] = {
        "model": model,
        "prompt": input_ids,
        "logprobs": 0,  # the sampled token's log-prob
        "return_tokens_as_token_ids": True,
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
    return body


def _token_id(token: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise RequestError(f"vLLM returned token {token!r}, expected 'token_id:<n>' (return_tokens_as_token_ids)", 502)
    return int(token.split(":", 1)[1])


def from_vllm_response(
    answer: Mapping[str, Any], *, rid: str, prompt_len: int, max_tokens: int | None, return_logprob: bool,
    weight_version: str,
) -> dict[str, Any]:
    """A vLLM completions answer -> SGLang's ``/generate`` answer."""
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise RequestError(f"vLLM answer has no choices[0]: {answer!r}"[:500], 502) from exc
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens")
    if choice.get("token_ids") is not None:  # vLLM's return_token_ids extension
        ids = [int(t) for t in choice["token_ids"]]
    elif tokens is not None:
        ids = [_token_id(t) for t in tokens]
    else:
        raise RequestError("vLLM answer carries neither token_ids nor logprobs.tokens", 502)
    token_logprobs = logprobs.get("token_logprobs")
    if return_logprob and (token_logprobs is None or len(token_logprobs) != len(ids)):
        raise RequestError("vLLM answer lacks one log-prob per output token (logprobs.token_logprobs)", 502)
    reason = choice.get("finish_reason")
    if reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": choice.get("stop_reason")}
    elif reason == "length":
        finish = {"type": "length", "length": max_tokens if max_tokens is not None else len(ids)}
    elif reason == "abort":
        finish = {"type": "abort", "message": "aborted by vLLM"}
    else:
        raise RequestError(f"vLLM finish_reason {reason!r} is not stop/length/abort", 502)
    usage = answer.get("usage") or {}
    return _sglang_answer(
        rid, finish, ids, weight_version, int(usage.get("prompt_tokens", prompt_len)),
        int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0),
        [float(lp) for lp in token_logprobs] if return_logprob else None, choice.get("text", ""),
    )


def _sglang_answer(rid: str, finish: dict[str, Any], ids: list[int], weight_version: str, prompt_tokens: int,
                   cached_tokens: int, logprobs: list[float] | None, text: str = "") -> dict[str, Any]:
    """SGLang's ``/generate`` answer; ``logprobs`` None: no ``output_token_logprobs`` (return_logprob off)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                            "completion_tokens": len(ids), "cached_tokens": cached_tokens,
                            "weight_version": weight_version}
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(logprobs, ids)]
    return {"text": text, "output_ids": ids, "meta_info": meta}


class VLLMAdapter:
    """SGLang's engine surface (:class:`~slime_ascend.rollout.http_api.SGLangEngine`) over one vLLM
    OpenAI server at ``vllm_url``."""

    engine_name = "the vllm-ascend adapter"

    def __init__(
        self, vllm_url: str, model: str, *, tp_size: int = 1, sleep_level: int = 1,
        weight_version: str = "default", timeout: float = 3600.0,
    ) -> None:
        parts = urlsplit(vllm_url if "://" in vllm_url else f"http://{vllm_url}")
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"vllm_url {vllm_url!r} must be http://host:port")
        self.host, self.port = parts.hostname, parts.port
        self.model = model
        self.tp_size = int(tp_size)
        self.sleep_level = int(sleep_level)
        self.weight_version = str(weight_version)
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
                raise RequestError(f"vLLM {method} {path} answered {response.status}: {raw[:500]!r}", 502)
            return json.loads(raw) if raw.strip() else {}
        finally:
            if rid is not None:
                with self._state:
                    self._inflight.pop(rid, None)
            conn.close()

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
        body = to_vllm_request(self.model, ids, payload.get("sampling_params"))
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
                                      self.weight_version, len(ids), 0, [] if return_logprob else None)
            raise RequestError(f"vLLM at {self.host}:{self.port} unreachable: {exc}", 502) from exc
        return from_vllm_response(answer, rid=rid, prompt_len=len(ids), max_tokens=body.get("max_tokens"),
                                  return_logprob=return_logprob, weight_version=self.weight_version)

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

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, **_: Any) -> dict[str, Any]:
        if not isinstance(model_path, str) or not model_path:
            raise RequestError("update_weights_from_disk needs 'model_path'")
        self._call("POST", "/collective_rpc", {"method": "update_config",
                                               "args": [{"model_config": {"model": model_path}}]})
        self._call("POST", "/collective_rpc", {"method": "reload_weights"})
        self._call("POST", "/reset_prefix_cache")
        self.weight_version = next_weight_version(self.weight_version, weight_version)
        return {"success": True, "message": f"reloaded {model_path}", "weight_version": self.weight_version}

    def release_memory_occupation(self) -> dict[str, Any]:
        self._call("POST", f"/sleep?level={self.sleep_level}")
        return {"success": True}

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        query = "".join(f"&tags={t}" for t in tags or ()).lstrip("&")
        self._call("POST", "/wake_up" + (f"?{query}" if query else ""))
        return {"success": True}

    def flush_cache(self) -> dict[str, Any]:
        self._call("POST", "/reset_prefix_cache")
        return {"success": True}

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

    def vllm_command(self, options: Mapping[str, Any], model_path: str, port: int = 8000, tp_size: int = 1) -> list[str]:
        argv = ["vllm", "serve", model_path, "--port", str(port), "--tensor-parallel-size", str(tp_size),
                "--enable-sleep-mode", "--logprobs-mode", "processed_logprobs"]
        if options["vllm_rl_config"]:
            argv += ["--additional-config", json.dumps({"rl_config": {"enabled": True}})]
        return argv

    def slime_flags(self, options: Mapping[str, Any], addrs: list[str] | None = None) -> list[str]:
        return ["--rollout-external-engine-addrs", *(addrs or ["HOST:PORT"]), "--update-weight-transport", "disk",
                "--update-weight-disk-dir", "DIR"]


BACKEND = VLLMAscendBackend()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_ascend.rollout.backends.vllm_ascend",
                                     description="SGLang-surface adapter in front of a vLLM (vllm-ascend) server")
    parser.add_argument("--vllm-url", required=True, help="http://host:port of the vLLM OpenAI server")
    parser.add_argument("--model", required=True, help="served model name (vLLM's --served-model-name or path)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default loopback; give the node's address when slime runs elsewhere)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1, help="reported to slime as the engine's GPU count")
    parser.add_argument("--sleep-level", type=int, default=1, choices=(1, 2))
    ns = parser.parse_args(argv)
    adapter = VLLMAdapter(ns.vllm_url, ns.model, tp_size=ns.tp_size, sleep_level=ns.sleep_level)
    server = make_server(adapter, ns.host, ns.port)
    print(f"vllm adapter at http://{ns.host}:{server.server_address[1]} -> {ns.vllm_url}", flush=True)
    serve_until_interrupted(server)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
