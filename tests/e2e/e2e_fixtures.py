"""Fixtures shared by the tests of slime's own loop: the tiny Qwen3 (made once per test module) and a
torch engine serving it on 127.0.0.1 for one test. Imported by name into each test module."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_model, start_engine, stop


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE (4 experts, top 2, layer 0 dense; flags ``slime_job.TINY_QWEN3_MOE_ARGS``)."""
    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3-moe", moe=True)


@pytest.fixture
def engine(model_dir, tmp_path):
    """Listening, still loading its model when the test starts (``start_engine(ready=False)``): the slime job a
    test starts next overlaps the load; slime's first request to it (or the test's) waits until it answers."""
    eng = start_engine(model_dir, tmp_path / "engine.log", ready=False)
    yield eng
    stop(eng.proc)
