"""What the torch engine's tests (tests/rollout, tests/reliability) share: module-scoped ``engine``
and ``url`` fixtures (a TorchEngine served on 127.0.0.1 from a thread; bind them in a test module as
``engine, url = torch_engine_fixtures.engine, torch_engine_fixtures.url``), the prompt they send,
a ``/generate`` posted from a background thread, :func:`served` (any engine of SGLang's HTTP surface, served from a
thread: the reward model) and :func:`bf16_dir` (the tiny model, shifted, saved in BF16)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import httpx
import pytest
import torch

from slime_ascend.rollout.http_server import make_server
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model, save_model

PROMPT = [1, 17, 250, 3, 999, 42]
HTTP = httpx.Client(trust_env=False)  # thread-safe; no proxies for loopback


@pytest.fixture(scope="module")
def engine():
    return TorchEngine(return_original_logprob=False)


@pytest.fixture(scope="module")
def url(engine):
    with engine.start_in_thread() as base:
        yield base


@contextlib.contextmanager
def served(engine):
    """``engine`` (anything :func:`make_server` serves) on 127.0.0.1 from a daemon thread; yields its base URL."""
    server = make_server(engine, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def post_in_thread(url: str, payload: dict) -> tuple[threading.Thread, dict]:
    """POST ``payload`` to ``url``/generate from a daemon thread; its JSON answer lands in ``box["response"]``."""
    box: dict = {}

    def run() -> None:
        box["response"] = HTTP.post(f"{url}/generate", json=payload, timeout=300).json()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def bf16_dir(out: Path, scale: float) -> Path:
    """The tiny Qwen3 (seed 0) with ``scale`` added to every weight, saved in BF16 as an HF directory at ``out``:
    two scales are two weight versions of one model."""
    model = load_model(None, dtype=torch.float32, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.ones_like(p))
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    return save_model(model, out, build_byte_tokenizer())
