"""SGLang's HTTP surface as a protocol: what an engine implements, the request checks both engines share,
and the route table mapping SGLang's endpoint names onto an engine (stdlib only; no sockets here).

One route table for the torch engine (:mod:`slime_ascend.rollout.torch_engine.engine`) and the
vLLM adapter (:mod:`slime_ascend.rollout.backends.vllm_ascend`); :mod:`slime_ascend.rollout.http_server`
serves it. Endpoints (the ones slime's rollout, external-engine discovery and weight sync call):

* ``POST /generate``; ``GET|POST /health``, ``/health_generate``
* ``GET /server_info``, ``/get_server_info``, ``/get_model_info``, ``/model_info``, ``/get_weight_version``,
  ``/v1/loads``; ``/get_load`` (SGLang's legacy projection of ``/v1/loads``, :func:`legacy_load`, which
  sglang-router's ``power_of_two`` policy polls) for an engine with a ``get_load`` method (the torch engine)
* ``POST /update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``, ``/abort_request``
* ``GET|POST /flush_cache``; ``POST /release_memory_occupation``, ``/resume_memory_occupation`` (a no-op
  for an engine without them), ``/post_process_weights`` (a no-op)
* ``POST /update_weights_from_distributed``, ``/update_weights_from_tensor``, ``/init_weights_update_group``,
  ``/destroy_weights_update_group``: 501 (disk sync only), except ``/update_weights_from_tensor`` on an
  engine with that method (the torch engine: slime's ``--colocate`` push), and the other three on an engine
  with methods of their names taking the request body (the torch engine: slime's broadcast over gloo).
* ``POST /classify`` for an engine with a ``classify`` method taking the request body (the torch engine serving a
  reward model, :mod:`slime_ascend.rollout.torch_engine.reward_model`): SGLang's native reward-model request and
  answer.
* ``POST /tokenize``, ``/v1/tokenize`` for an engine with a ``tokenize`` method (the torch engine;
  the OPD teacher check asks a remote teacher's engine through it): SGLang's request and answer.
* ``GET|POST /get_weights_by_name`` for an engine with a ``get_weights_by_name`` method taking the request body
  (the torch engine, :mod:`slime_ascend.rollout.torch_engine.weight_read`): SGLang's request and answer, and the
  exact bytes with ``return_raw``.

Client errors (:class:`RequestError`, the one error type of both engines) answer 4xx/5xx with
``{"error": message, "success": false}``. :func:`check_generate_keys` is the shared refusal of
``/generate`` fields an engine would not honour (slime's router adds some at neutral values).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["HeldAnswer", "ONE_SERVER_INFO", "RequestError", "SGLangEngine", "WORK_PATHS", "abort_matches",
           "check_generate_keys", "check_positive_ints", "check_weight_version", "legacy_load", "next_weight_version",
           "routes"]

# the routes that start engine work (a server keeps a reserve of connections for the others: control calls)
WORK_PATHS = frozenset({"/generate", "/classify"})

_UNSUPPORTED_SYNC = (
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
)

# Top-level /generate keys accepted only when falsy (SGLang features no engine here implements).
NEUTRAL_REQUEST_KEYS = frozenset({
    "stream", "image_data", "video_data", "audio_data", "input_embeds", "return_routed_experts", "lora_path",
    "custom_logit_processor", "token_ids_logprob", "session_params", "return_hidden_states", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "data_parallel_rank", "priority",
})
# Keys slime's sglang router adds when it re-serialises a /generate body, with the values that leave
# the result unchanged (compared with ``is``: JSON true/false/null only). Any other value is a 400.
ROUTER_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "model": (None,),
    "no_logs": (False,),
    "return_bytes": (False,),
    "return_entropy": (False,),
    "log_metrics": (True, False),  # only decides whether SGLang records metrics
}


class RequestError(ValueError):
    """A client (4xx) or upstream (5xx) error: the server answers it with ``status`` and ``{"error": message}``
    (and a ``Retry-After: retry_after`` header when given: a 503 of a server-wide budget that frees soon)."""

    def __init__(self, message: str, status: int = 400, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class HeldAnswer:
    """An answer that holds a share of a server-wide budget (e.g. bytes of answers in flight) until the server has
    sent it, or failed to: the server calls :meth:`release` once, after the send (an engine's ``value`` is what
    the server encodes)."""

    __slots__ = ("_release", "value")

    def __init__(self, value: Any, release: Callable[[], None]) -> None:
        self.value, self._release = value, release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


# /server_info fields of an engine that is one unsharded server (slime's external-engine discovery reads them)
ONE_SERVER_INFO = {"pp_size": 1, "dp_size": 1, "ep_size": 1, "enable_memory_saver": False,
                   "disaggregation_mode": "null"}


def check_positive_ints(**values: Any) -> None:
    """ValueError naming the first of ``values`` that is not a positive integer (a bool is not one)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


WEIGHT_VERSION = re.compile(r"[A-Za-z0-9._:+-]{1,128}")


def check_weight_version(requested: Any) -> str | None:
    """``requested`` as the version string to store (None: not given), or :class:`RequestError`: a non-negative
    integer or a word of at most 128 letters, digits and ``._:+-`` (slime sends ``str(int)``); an empty,
    boolean, negative or oversized value would be stored and reported back as given."""
    if requested is None:
        return None
    if isinstance(requested, int) and not isinstance(requested, bool) and requested >= 0:
        return str(requested)
    if isinstance(requested, str) and WEIGHT_VERSION.fullmatch(requested):
        return requested
    shown = repr(requested) if len(repr(requested)) <= 40 else repr(requested)[:40] + "..."
    raise RequestError(f"weight_version must be a non-negative integer or a word of at most 128 letters, digits "
                       f"and ._:+- (slime sends str(int)), got {shown}")


def next_weight_version(current: str, requested: Any = None) -> str:
    """The version after a weight update: ``requested`` when given (checked by :func:`check_weight_version`),
    else ``current`` + 1 when it is a number, else ``"1"`` (SGLang keeps the old version; both engines here
    count instead)."""
    requested = check_weight_version(requested)
    if requested is not None:
        return requested
    return str(int(current) + 1) if current.isdigit() else "1"


def abort_matches(candidate: str, rid: str | None, abort_all: bool) -> bool:
    """SGLang's ``/abort_request`` match: every request, or ``rid`` and its batch's ids ``rid_<i>``."""
    return abort_all or (rid is not None and (candidate == rid or candidate.startswith(f"{rid}_")))


class SGLangEngine(Protocol):
    """What :func:`routes` maps SGLang's endpoints onto (:func:`slime_ascend.rollout.http_server.make_server`
    serves it): SGLang's endpoint semantics as methods (dicts in, dicts out; :class:`RequestError` for a refused
    request). ``engine_name`` names it in messages. Optional:
    ``release_memory_occupation()`` and ``resume_memory_occupation(tags)`` (absent: a no-op), and
    ``tokenize(body)`` (absent: no ``/tokenize`` route, a 404 as from a server without it)."""

    engine_name: str
    weight_version: str

    def generate(self, payload: dict[str, Any], is_disconnected: Callable[[], bool] | None = None) -> Any: ...
    def update_weights_from_disk(self, model_path: str, weight_version: Any = None, load_format: Any = None) -> dict: ...
    def pause_generation(self, mode: str = "abort") -> dict[str, Any]: ...
    def continue_generation(self) -> dict[str, Any]: ...
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]: ...
    def flush_cache(self) -> dict[str, Any]: ...
    def health(self) -> bool: ...
    def health_generate(self) -> bool: ...
    def server_info(self) -> dict[str, Any]: ...
    def model_info(self) -> dict[str, Any]: ...
    def loads(self) -> dict[str, Any]: ...


def check_generate_keys(payload: Any, supported: set[str] | frozenset[str], engine_name: str) -> None:
    """Refuse a ``/generate`` body that is not an object, has a key outside ``supported`` (and the
    neutral ones), or sets a neutral key to a value that would change the result."""
    if not isinstance(payload, dict):
        raise RequestError(f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - set(supported) - NEUTRAL_REQUEST_KEYS - set(ROUTER_NEUTRAL_VALUES))
    if unknown:
        raise RequestError(f"unknown /generate keys {unknown}; remove them ({engine_name} does not implement them)")
    for key in NEUTRAL_REQUEST_KEYS:
        if payload.get(key):
            raise RequestError(f"/generate field {key!r} is not supported by {engine_name}")
    for key, neutral in ROUTER_NEUTRAL_VALUES.items():
        if key in payload and not any(payload[key] is v for v in neutral):
            allowed = " or ".join(json.dumps(v) for v in neutral)
            raise RequestError(
                f"/generate field {key!r}={json.dumps(payload[key])[:80]} would change the result and is not "
                f"supported by {engine_name}; send {allowed} or leave it out"
            )


def legacy_load(loads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``/v1/loads``' per-DP-rank entries as SGLang 0.5.15's legacy ``/get_load`` projects them
    (``sglang/srt/entrypoints/http_server.py`` ``get_load``): ``num_reqs`` running plus waiting, ``num_tokens`` the
    KV tokens used plus pending (``num_total_tokens``), ``num_pending_tokens`` the pending ones, ``ts_tic`` a
    ``perf_counter`` stamp. sglang-router's load monitor polls it for ``power_of_two`` and reads ``num_tokens``."""
    ts = time.perf_counter()
    return [{"dp_rank": load["dp_rank"], "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
             "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_total_tokens"],
             "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"], "ts_tic": ts}
            for load in loads]


def routes(engine: SGLangEngine) -> dict[tuple[str, str], Callable[..., tuple[int, Any]]]:
    """``(method, path) -> handler(body) -> (status, answer)`` for ``engine``; a handler with ``needs_client``
    also takes the server's disconnect probe."""
    name = engine.engine_name

    def ok(value: Any) -> tuple[int, Any]:
        return 200, value

    def probe(check: str, failure: str) -> Callable[[dict], tuple[int, Any]]:
        return lambda body: ((200, {"status": "ok"}) if getattr(engine, check)()
                             else (503, {"error": f"{name} {failure}"}))

    def update_from_disk(body: dict) -> tuple[int, Any]:
        if "model_path" not in body:
            raise RequestError("update_weights_from_disk needs 'model_path'")
        extra = {k: body[k] for k in ("weight_version", "load_format") if k in body}
        return ok(engine.update_weights_from_disk(body["model_path"], **extra))

    def pause(body: dict) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        return ok(engine.pause_generation(mode))

    def abort(body: dict) -> tuple[int, Any]:
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            raise RequestError("rid must be a string")
        if not isinstance(abort_all, bool):
            raise RequestError("abort_all must be true or false")
        return ok(engine.abort_request(rid=rid, abort_all=abort_all))

    def no_op(body: dict) -> tuple[int, Any]:
        return ok({"success": True, "message": f"no-op on {name}"})

    def release(body: dict) -> tuple[int, Any]:
        fn = getattr(engine, "release_memory_occupation", None)
        return no_op(body) if fn is None else ok(fn())

    def resume(body: dict) -> tuple[int, Any]:
        fn = getattr(engine, "resume_memory_occupation", None)
        if fn is None:
            return no_op(body)
        tags = body.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise RequestError("tags must be a list of strings")
        return ok(fn(tags))

    def unsupported(body: dict) -> tuple[int, Any]:
        return 501, {"success": False, "error": f"{name} supports disk weight sync only (--update-weight-transport disk)"}

    def generate(body: dict, is_disconnected: Callable[[], bool] | None = None) -> tuple[int, Any]:
        return ok(engine.generate(body, is_disconnected=is_disconnected))

    generate.needs_client = True  # type: ignore[attr-defined]  # the server passes the disconnect probe

    table: dict[tuple[str, str], Callable[..., tuple[int, Any]]] = {
        ("POST", "/generate"): generate,
        ("POST", "/update_weights_from_disk"): update_from_disk,
        ("POST", "/pause_generation"): pause,
        ("POST", "/continue_generation"): lambda body: ok(engine.continue_generation()),
        ("POST", "/abort_request"): abort,
        ("GET", "/get_weight_version"): lambda body: ok({"weight_version": engine.weight_version}),
        ("GET", "/get_model_info"): lambda body: ok(engine.model_info()),
        ("GET", "/model_info"): lambda body: ok(engine.model_info()),  # the name sglang's router tries first
        ("GET", "/server_info"): lambda body: ok(engine.server_info()),
        ("GET", "/get_server_info"): lambda body: ok(engine.server_info()),
        ("GET", "/v1/loads"): lambda body: ok(engine.loads()),
        ("POST", "/release_memory_occupation"): release,
        ("POST", "/resume_memory_occupation"): resume,
        ("POST", "/post_process_weights"): no_op,
    }
    for method in ("GET", "POST"):
        table[(method, "/health")] = probe("health", "is not healthy")
        table[(method, "/health_generate")] = probe("health_generate", "cannot generate")
        table[(method, "/flush_cache")] = lambda body: ok(engine.flush_cache())
    for path in _UNSUPPORTED_SYNC:
        table[("POST", path)] = unsupported
    from_tensor = getattr(engine, "update_weights_from_tensor", None)
    if from_tensor is not None:  # the torch engine (torch_engine/tensor_update.py): slime's --colocate push
        def update_from_tensor(body: dict) -> tuple[int, Any]:
            if "serialized_named_tensors" not in body:
                raise RequestError("update_weights_from_tensor needs 'serialized_named_tensors'")
            extra = {k: body[k] for k in ("load_format", "flush_cache", "weight_version", "donate_tensors")
                     if k in body}
            return ok(from_tensor(body["serialized_named_tensors"], **extra))

        table[("POST", "/update_weights_from_tensor")] = update_from_tensor
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        group_call = getattr(engine, path[1:], None)  # the torch engine (torch_engine/weight_group.py): the body
        if group_call is not None:
            table[("POST", path)] = lambda body, call=group_call: ok(call(body))
    get_load = getattr(engine, "get_load", None)
    if get_load is not None:
        table[("GET", "/get_load")] = lambda body: ok(get_load())
    read_weights = getattr(engine, "get_weights_by_name", None)
    if read_weights is not None:  # the torch engine (torch_engine/weight_read.py); SGLang serves GET and POST
        for method in ("GET", "POST"):
            table[(method, "/get_weights_by_name")] = lambda body, call=read_weights: ok(call(body))
    classify = getattr(engine, "classify", None)
    if classify is not None:  # a reward model (torch_engine/reward_model.py): SGLang's native reward endpoint
        table[("POST", "/classify")] = lambda body: ok(classify(body))
    tokenize = getattr(engine, "tokenize", None)
    if tokenize is not None:
        # SGLang 0.5.15 serves one handler under both names (sglang/srt/entrypoints/http_server.py:1648-1663)
        table[("POST", "/tokenize")] = table[("POST", "/v1/tokenize")] = lambda body: ok(tokenize(body))
    return table
