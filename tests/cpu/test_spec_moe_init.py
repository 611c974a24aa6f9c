"""slime_ascend.cpu.spec's expert linears draw the same initial weights, and leave the host generator in the same
state, in every expert-parallel layout: slime's PPO critic draws its value head (not in the HF checkpoint) right
after the model, so its values at EP 2 equal the one-rank run's only if the experts' draws did not depend on EP
(``tests/e2e/test_slime_moe_cpu.py`` compares them)."""

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from slime_ascend.cpu.spec import LocalGroupedLinear, LocalRowGroupedLinear  # noqa: E402

EXPERTS, HIDDEN, FFN = 4, 8, 6


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _build(cls, ep: int, ep_rank: int, etp: int = 1, etp_rank: int = 0, seed: int = 7):
    torch.manual_seed(seed)
    pg = types.SimpleNamespace(ep=_Group(ep, ep_rank), expt_tp=_Group(etp, etp_rank), expt_dp=_Group(1, 0))
    config = types.SimpleNamespace(params_dtype=torch.float32)
    layer = cls(EXPERTS // ep, HIDDEN, 2 * FFN, config=config, init_method=lambda w: torch.nn.init.normal_(w, 0, 0.02),
                bias=False, skip_bias_add=False, is_expert=True, pg_collection=pg)
    after = torch.randn(16)  # what the generator gives next (slime's critic: its value head)
    return [getattr(layer, f"weight{i}").detach().clone() for i in range(EXPERTS // ep)], after


@pytest.mark.parametrize("cls", [LocalGroupedLinear, LocalRowGroupedLinear])
def test_expert_weights_and_the_generator_after_them_do_not_depend_on_expert_parallelism(cls):
    whole, after = _build(cls, ep=1, ep_rank=0)
    assert len(whole) == EXPERTS and not torch.equal(whole[0], whole[1])
    for ep_rank in range(2):
        local, local_after = _build(cls, ep=2, ep_rank=ep_rank)
        assert len(local) == 2
        for i, w in enumerate(local):
            assert torch.equal(w, whole[ep_rank * 2 + i]), (ep_rank, i)
        assert torch.equal(local_after, after), ep_rank


def test_expert_tensor_parallel_shards_are_pieces_of_the_one_rank_weights():
    whole, after = _build(LocalGroupedLinear, ep=1, ep_rank=0)
    row_whole, _ = _build(LocalRowGroupedLinear, ep=1, ep_rank=0)
    for rank in range(2):
        column, column_after = _build(LocalGroupedLinear, ep=2, ep_rank=1, etp=2, etp_rank=rank)
        row, _ = _build(LocalRowGroupedLinear, ep=2, ep_rank=1, etp=2, etp_rank=rank)
        assert column[0].shape == (FFN, HIDDEN) and row[0].shape == (2 * FFN, HIDDEN // 2)
        assert torch.equal(column[1], whole[3].chunk(2, dim=0)[rank])  # output dimension over expert TP
        assert torch.equal(row[1], row_whole[3].chunk(2, dim=1)[rank])  # input dimension
        assert row[1].is_contiguous() and torch.equal(column_after, after)
