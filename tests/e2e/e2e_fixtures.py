"""Fixtures shared by the tests of slime's own loop: the tiny Qwen3 (made once per test module) and a
reference engine serving it on 127.0.0.1 for one test. Imported by name into each test module."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_model, start_engine, stop


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    pytest.importorskip("megatron.training", reason="megatron-core with megatron.training is not installed")
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture
def engine(model_dir, tmp_path):
    eng = start_engine(model_dir, tmp_path / "engine.log")
    yield eng
    stop(eng.proc)
