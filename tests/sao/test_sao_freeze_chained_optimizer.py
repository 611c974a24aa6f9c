"""SAO's frozen-critic check reads an MoE critic's optimizer: Megatron's ``ChainedOptimizer`` of a dense and an
expert optimizer, whose ``optimizer`` property asserts that it chains one (the tiny GLM-5 critic of
``slime-ascend demo --model glm5`` stopped there at its first critic step)."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import need
from slime_ascend.sao import freeze


def toy_model():
    torch.manual_seed(0)
    m = torch.nn.Module()
    block = torch.nn.Module()
    block.self_attention = torch.nn.ModuleDict({"linear_qkv": torch.nn.Linear(4, 12), "linear_proj": torch.nn.Linear(4, 4)})
    block.mlp = torch.nn.ModuleDict({"linear_fc1": torch.nn.Linear(4, 8), "linear_fc2": torch.nn.Linear(8, 4)})
    m.decoder = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([block])})
    m.output_layer = torch.nn.Linear(4, 1)
    return m


def freeze_like_slime(model, patterns):
    for name in freeze.matching_names([n for n, _ in model.named_parameters()], patterns):
        dict(model.named_parameters())[name].requires_grad = False


def _chained(*param_lists):
    need("megatron.core", "Megatron-core: bash scripts/install-slime-cpu.sh")
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    inner = [types.SimpleNamespace(optimizer=torch.optim.Adam(ps), config=None,
                                   param_groups=torch.optim.Adam(ps).param_groups) for ps in param_lists]
    chained = ChainedOptimizer(inner)
    with pytest.raises(AssertionError, match="more than one optimizer"):
        chained.optimizer  # noqa: B018 (what the check met)
    return chained


def test_verify_frozen_reads_a_chained_optimizer_of_two():
    model = toy_model()
    freeze_like_slime(model, ["self_attention"])
    mlp = [p for n, p in model.named_parameters() if "mlp" in n]
    head = [model.output_layer.weight, model.output_layer.bias]
    names = freeze.verify_frozen(model, _chained(mlp, head), ["self_attention"])
    assert len(names) == 4 and all("self_attention" in n for n in names)
    attention = [p for n, p in model.named_parameters() if "self_attention" in n]
    # a frozen parameter in the second chained optimizer is found
    with pytest.raises(RuntimeError, match="is in the optimizer"):
        freeze.verify_frozen(model, _chained(mlp, head + attention), ["self_attention"])
