"""slime_ascend.cpu.spec above one rank: the tiny Qwen3 at tensor parallelism 2, with and without sequence
parallelism, in two gloo processes (``spec_tp_worker.py``), loaded by slime's own HF->Megatron conversion,
against transformers' fp32 forward and backward of the same checkpoint: the log-probs slime computes over the
vocab-parallel logits, and every parameter's gradient after Megatron's ``finalize_model_grads``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import zygote

from conftest import need

pytestmark = pytest.mark.slime

need("megatron.core")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from spec_tp_worker import batch_log_probs, run, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Qwen3 in fp32 with every weight drawn at a scale that makes the logits and gradients large
    (norm weights around 1, not all 1: a norm applied on the wrong shard shows), its transformers log-probs
    of BATCH, and the gradients of their negative sum saved as an HF checkpoint of the same names."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("tp")
    model = tiny_model()
    model.save_pretrained(str(root / "model"), safe_serialization=True)
    log_probs = batch_log_probs(model)
    (-log_probs.sum()).backward()
    (root / "grads").mkdir()
    save_file({n: p.grad.contiguous() for n, p in model.named_parameters()}, str(root / "grads" / "model.safetensors"))
    (root / "grads" / "config.json").write_text((root / "model" / "config.json").read_text())
    return root, log_probs.detach()


def _run(root: Path, tp: int, sp: bool) -> list[dict]:
    out = root / f"tp{tp}-sp{int(sp)}"
    zygote.spawn(run, args=(tp, zygote.free_port(), str(root / "model"), str(root / "grads"), sp, str(out)), nprocs=tp,
                 env={**os.environ, "SLIME_ASCEND_PLUGINS": "cpu", "OMP_NUM_THREADS": "1"}, timeout=600)
    return [torch.load(f"{out}.{rank}.pt") for rank in range(tp)]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_matches_transformers(checkpoint, sp):
    root, log_probs = checkpoint
    ranks = _run(root, 2, sp)
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["log_probs"], log_probs, rtol=0, atol=2e-5)
        assert got["grads"].keys() == got["expected"].keys()
        for name, grad in got["grads"].items():
            expected = got["expected"][name]
            assert expected.abs().max() > 0, name  # every parameter has a gradient to compare
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}")
    # the shards differ between the ranks, the replicated norms do not
    assert not torch.equal(ranks[0]["grads"]["output_layer.weight"], ranks[1]["grads"]["output_layer.weight"])
    assert torch.equal(ranks[0]["grads"]["decoder.final_layernorm.weight"],
                       ranks[1]["grads"]["decoder.final_layernorm.weight"])
