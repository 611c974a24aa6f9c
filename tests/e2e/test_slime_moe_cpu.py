"""slime's own ``train.py`` on this CPU with an MoE model: the tiny Qwen3-MoE (4 experts, top 2, layer 0 dense;
``slime_job.TINY_QWEN3_MOE_ARGS``) at one rank and with ``--expert-model-parallel-size 2``.

The same seeded, deterministic job as ``test_slime_parallel_cpu`` (its helpers: fp32 training, per-sample
sampling seeds, a reward of the response, ``--save-debug-train-data``, 2 rollouts), on the MoE checkpoint the
torch engine serves. EP 2 must reproduce the one-rank run's tokens and train-side log-probs of every
sample (log-probs to 2e-5 absolute), and its loss and grad norm of each step (1e-4 relative): the experts
live on two ranks and Megatron's all-to-all dispatcher moves the tokens over gloo. fp32 routing has no ties
here: the router's top-2 over 4 experts of random weights is decided by margins far above fp32 rounding.

The weight pushes (``--update-weight-transport disk``: slime writes one HF directory per update) of the EP 2
run hold every expert, gathered from both EP ranks by slime's own weight iterator, and the first push is the
one-rank run's byte for byte.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from e2e_fixtures import moe_model_dir  # noqa: F401  (pytest fixture)
from slime_ascend.demo.slime_job import TINY_QWEN3_MOE_ARGS
from test_slime_parallel_cpu import METRIC_RTOL, _assert_like_reference, _ranks, _run, _steps

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1800)]

# later flags win: replaces the dense architecture of slime_flags; keep every push (slime deletes each once loaded)
MOE = shlex.split(TINY_QWEN3_MOE_ARGS) + ["--update-weight-disk-keep-files"]
EP2 = ["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"]
EXPERTS = 4


def _pushes(work: Path) -> list[Path]:
    return sorted(p for p in (work / "weights").iterdir() if p.is_dir())


def _pushed_tensors(push: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(push.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.fixture(scope="module")
def moe_reference(moe_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("moe-one-rank")
    return work, _run(moe_model_dir, work, MOE)


def test_moe_one_rank_runs_slimes_loop_and_pushes_every_expert(moe_model_dir, moe_reference):
    from slime_ascend.rollout.torch_engine.model import load_model, validate_state_dict

    work, run = moe_reference
    assert _ranks(run) == 1
    steps = _steps(run)
    assert [m["train/step"] for m in steps] == [0, 1] and any(m["train/grad_norm"] > 0 for m in steps)
    pushes = _pushes(work)
    assert pushes, "slime pushed no weights"
    state = _pushed_tensors(pushes[-1])
    experts = {n for n in state if ".mlp.experts." in n}
    assert experts == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(EXPERTS)
                       for p in ("gate", "up", "down")}
    validate_state_dict(load_model(moe_model_dir), state, source=str(pushes[-1]))  # the engine loads it
    # the push after the last step carries trained weights, not the checkpoint's
    first, last = _pushed_tensors(pushes[0]), state
    assert any(not first[n].equal(last[n]) for n in experts)


# EP 2: Megatron's all-to-all dispatcher over gloo (its split sizes made host values by train.cpu_moe_splits)
def test_expert_parallel_2_matches_the_one_rank_moe_run(moe_model_dir, moe_reference, tmp_path):
    work = tmp_path / "ep2"
    run = _run(moe_model_dir, work, MOE + EP2)
    assert _ranks(run) == 2, _ranks(run)
    _assert_like_reference(moe_reference, work, run, dp=2)  # EP 2 of 2 ranks: data parallel 2
    # pushes: all experts, gathered over EP; the first (before any step) byte-identical to one rank's
    ref_pushes, pushes = _pushes(moe_reference[0]), _pushes(work)
    assert [p.name for p in pushes] == [p.name for p in ref_pushes]
    for ref_push, push in zip(ref_pushes, pushes):
        ref_state, state = _pushed_tensors(ref_push), _pushed_tensors(push)
        assert sorted(state) == sorted(ref_state)
        assert len([n for n in state if ".mlp.experts." in n]) == 3 * EXPERTS
    first_ref, first = _pushed_tensors(ref_pushes[0]), _pushed_tensors(pushes[0])
    assert all(first[n].dtype == first_ref[n].dtype and first[n].equal(first_ref[n]) for n in first_ref)
    for ref_push, push in zip(ref_pushes[1:], pushes[1:]):  # trained weights: fp32 sums in another order
        import torch

        ref_state, state = _pushed_tensors(ref_push), _pushed_tensors(push)
        for name, tensor in ref_state.items():
            torch.testing.assert_close(state[name].float(), tensor.float(), rtol=METRIC_RTOL, atol=1e-6)
