"""A vLLM OpenAI server made of vLLM's own code around a toy model, and the recorder of its answers.

``build_app()`` (needs ``vllm``, ``fastapi``) mounts vLLM's real FastAPI routers: ``/v1/completions``
(``vllm/entrypoints/openai/completion/api_router.py``: request parsing and validation by
``CompletionRequest``, answers built by ``OpenAIServingCompletion.request_output_to_completion_response``
from a ``RequestOutput`` whose log-prob containers vLLM's ``append_logprobs_for_next_position`` fills),
the RL router (``/weight_info``, ``/update_weight_version``, ``/pause`` ...), the dev routers
(``/collective_rpc``, ``/reset_prefix_cache``, ``/sleep``, ``/wake_up``) and ``/health``. Only the engine
is fake (:class:`ToyEngineClient`): it runs :func:`toy_logprobs` instead of a model.

``python tests/rollout/vllm_toy_server.py`` (in a Python where vLLM imports, e.g. a venv with
``pip install vllm``) serves the app on loopback, drives the adapter through :data:`SCENARIO`, and
writes every exchange vLLM saw to ``data/vllm_<version>.json``; ``test_vllm_ascend.py`` replays them
where vLLM is not installed. Importing this module needs only the standard library.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

VOCAB = 11
DATA = Path(__file__).parent / "data"
MODEL = "toy"

# what slime (and slime_ascend's OPD teachers) send the adapter, in order: (method, path, body)
SCENARIO: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/generate", {"input_ids": [3, 4], "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 4, "temperature": 0.7}}),
    ("POST", "/generate", {"input_ids": [5], "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "stop_token_ids": [6]}}),
    # OPD teacher scoring (slime_ascend.opd.scoring.build_score_payload): prompt log-probs and top-k
    ("POST", "/generate", {"input_ids": [1, 7, 2, 9, 0, 5], "return_logprob": True, "logprob_start_len": 0,
                           "top_logprobs_num": 3,
                           "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False}}),
    ("POST", "/generate", {"input_ids": [1, 7, 2, 9, 0, 5], "return_logprob": True, "logprob_start_len": 0,
                           "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False}}),
    ("GET", "/get_weight_version", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/ckpt/iter_1", "weight_version": "7"}),
    # prompt and output log-probs with top-k in one request, from a later start
    ("POST", "/generate", {"input_ids": [2, 8, 6, 1], "return_logprob": True, "logprob_start_len": 2,
                           "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 3, "temperature": 0.5}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/ckpt/iter_2"}),
    ("POST", "/generate", {"input_ids": [4], "sampling_params": {"max_new_tokens": 2}}),
    ("GET", "/get_weight_version", None),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
    ("POST", "/flush_cache", {}),
    ("GET", "/health_generate", None),
    # refused by vLLM's own validation (more prompt log-probs than --max-logprobs): a 400
    ("POST", "/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0,
                           "top_logprobs_num": 50, "sampling_params": {"max_new_tokens": 0}}),
]
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


def toy_logits(last_token: int) -> list[float]:
    """The toy model: next-token logits depend on the last token only (distinct values: no ties)."""
    return [((last_token * 7 + v * 3) % VOCAB) * 0.45 - v * 0.01 for v in range(VOCAB)]


def toy_logprobs(last_token: int, temperature: float = 1.0) -> list[float]:
    """``log_softmax(toy_logits(last_token) / temperature)``."""
    z = [x / temperature for x in toy_logits(last_token)]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def toy_next(last_token: int) -> int:
    """The toy model's sampling: the argmax (every temperature)."""
    logits = toy_logits(last_token)
    return logits.index(max(logits))


# ---------------------------------------------------------------------------------------- vLLM app
class ToyEngineClient:
    """The parts of vLLM's ``EngineClient`` the mounted routers call; generation is the toy model."""

    def __init__(self) -> None:
        self.weight_version = "default"  # vLLM's EngineCore starts at "default" (vllm/v1/engine/core.py)
        self.rpcs: list[tuple[str, tuple, dict]] = []

    async def get_weight_version(self) -> str:
        return self.weight_version

    async def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    async def collective_rpc(self, method: str, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> list:
        self.rpcs.append((method, args, kwargs or {}))
        return [None]  # one worker, whose update_config / reload_weights return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> bool:
        return True

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        return None

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return True

    async def check_health(self) -> None:
        return None

    async def is_sleeping(self) -> bool:
        return False


def _request_output(request: Any, engine: ToyEngineClient) -> Any:
    """A ``RequestOutput`` for ``request`` (a vLLM ``CompletionRequest``), log-probs in vLLM's containers."""
    from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs, create_sample_logprobs
    from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan

    params = request.to_sampling_params(request.max_tokens, {})  # vLLM's own translation (echo + 0 -> 1 token)
    prompt = list(request.prompt)

    def add(container: Any, last: int, token: int, k: int, temperature: float) -> None:
        lps = toy_logprobs(last, temperature)
        order = sorted(range(VOCAB), key=lambda v: -lps[v])
        rank = 1 + sum(1 for v in range(VOCAB) if lps[v] > lps[token])
        top = order[:k]
        append_logprobs_for_next_position(container, [token, *top], [lps[token], *(lps[v] for v in top)],
                                          [None] * (k + 1), rank, k)

    prompt_lps = None
    if params.prompt_logprobs is not None:
        prompt_lps = create_prompt_logprobs(False)
        for pos in range(1, len(prompt)):
            add(prompt_lps, prompt[pos - 1], prompt[pos], params.prompt_logprobs, 1.0)  # raw, as vLLM's prompt scores
    temperature = params.temperature if params.temperature and params.temperature > 0 else 1.0
    out_ids: list[int] = []
    sample_lps = create_sample_logprobs(False) if params.logprobs is not None else None
    finish, stop_reason = "length", None
    for _ in range(params.max_tokens):
        last = (prompt + out_ids)[-1]
        token = toy_next(last)
        out_ids.append(token)
        if sample_lps is not None:
            add(sample_lps, last, token, params.logprobs, temperature)  # processed_logprobs: after temperature
        if token in (params.stop_token_ids or []):
            finish, stop_reason = "stop", token
            break
    output = CompletionOutput(index=0, text="".join(f"<{t}>" for t in out_ids), token_ids=out_ids,
                              cumulative_logprob=None, logprobs=sample_lps, finish_reason=finish,
                              stop_reason=stop_reason,
                              weight_versions=[WeightVersionSpan(engine.weight_version, 0, len(out_ids))])
    return RequestOutput(request_id="toy", prompt=None, prompt_token_ids=prompt, prompt_logprobs=prompt_lps,
                         outputs=[output], finished=True, num_cached_tokens=0)


def build_app(exchanges: list[dict[str, Any]] | None = None) -> Any:
    """vLLM's routers around :class:`ToyEngineClient`; every exchange is appended to ``exchanges``."""
    from fastapi import FastAPI, Request
    from vllm.entrypoints.openai.completion.api_router import attach_router as attach_completion
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve.dev.cache.api_router import attach_router as attach_cache
    from vllm.entrypoints.serve.dev.rpc.api_router import attach_router as attach_rpc
    from vllm.entrypoints.serve.dev.sleep.api_router import attach_router as attach_sleep
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.entrypoints.serve.instrumentator.health import router as health_router

    engine = ToyEngineClient()
    serving = object.__new__(OpenAIServingCompletion)  # its answer-building methods only; no model, no renderer
    serving.enable_prompt_tokens_details = False
    serving.enable_per_request_metrics = False
    serving.system_fingerprint = None
    serving.return_tokens_as_token_ids = False

    async def create_completion(request: Any, raw_request: Any = None) -> Any:
        # vLLM's own --max-logprobs check (run by its input processor with the model's config)
        model_config = SimpleNamespace(max_logprobs=MAX_LOGPROBS, get_vocab_size=lambda: VOCAB)
        request.to_sampling_params(request.max_tokens, {})._validate_logprobs(model_config)
        return serving.request_output_to_completion_response(
            [_request_output(request, engine)], request, "cmpl-toy", 0, MODEL, None,
            RequestResponseMetadata(request_id="cmpl-toy"))

    serving.create_completion = create_completion
    app = FastAPI()
    app.state.engine_client = engine
    app.state.openai_serving_completion = serving
    app.state.enable_server_load_tracking = False
    app.state.args = SimpleNamespace(log_error_stack=False)  # what vLLM's error handlers read of its CLI args
    for attach in (attach_completion, attach_cache, attach_rpc, attach_sleep):
        attach(app)
    register_rl_api_routers(app)
    app.include_router(health_router)
    _install_error_handler(app)

    if exchanges is not None:
        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Any:
            from fastapi.responses import Response

            raw = await request.body()
            response = await call_next(request)
            chunks = [c async for c in response.body_iterator]
            body = b"".join(chunks)
            exchanges.append({
                "method": request.method, "path": request.url.path, "query": request.url.query,
                "request": json.loads(raw) if raw.strip() else None, "status": response.status_code,
                "response": json.loads(body) if body.strip() else None,
            })
            return Response(content=body, status_code=response.status_code, headers=dict(response.headers))

    return app


def _install_error_handler(app: Any) -> None:
    """vLLM's own exception handlers (a VLLMValidationError answers 400 with vLLM's ErrorResponse body)."""
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    init_exception_handler(app)


def run_scenario(url: str) -> list[tuple[int, Any]]:
    """Send :data:`SCENARIO` to the adapter at ``url`` over HTTP; each answer's (status, JSON body)."""
    import urllib.error
    import urllib.request

    answers = []
    for method, path, body in SCENARIO:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                answers.append((resp.status, json.loads(resp.read())))
        except urllib.error.HTTPError as err:
            answers.append((err.code, json.loads(err.read())))
    return answers


def serve_app(app: Any) -> tuple[Any, Any, int]:
    """``app`` under uvicorn on a free loopback port, in a daemon thread: (server, thread, port)."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def main() -> int:
    import threading

    import vllm

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from slime_ascend.rollout.backends.vllm_ascend import VLLMAdapter
    from slime_ascend.rollout.http_server import make_server

    exchanges: list[dict[str, Any]] = []
    server, thread, port = serve_app(build_app(exchanges))
    front = make_server(VLLMAdapter(f"http://127.0.0.1:{port}", MODEL))
    threading.Thread(target=front.serve_forever, daemon=True).start()
    answers = run_scenario(f"http://127.0.0.1:{front.server_address[1]}")
    front.shutdown()
    server.should_exit = True
    thread.join(10)
    DATA.mkdir(exist_ok=True)
    out = DATA / f"vllm_{vllm.__version__}.json"
    out.write_text(json.dumps({"vllm_version": vllm.__version__, "made_by": "tests/rollout/vllm_toy_server.py",
                               "exchanges": exchanges}, indent=1) + "\n")
    print(f"wrote {len(exchanges)} exchanges to {out}; adapter statuses {[s for s, _ in answers]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
