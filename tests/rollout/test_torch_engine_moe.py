"""The torch engine serving the tiny Qwen3-MoE: generation, weight updates from a per-expert checkpoint
(slime's push layout), and the routed experts in SGLang's ``routed_experts`` format, checked against the
router logits transformers itself returns for the whole sequence (``output_router_logits``)."""

from __future__ import annotations

import base64

import pytest
import torch

from slime_ascend.rollout.torch_engine.engine import TorchEngine, RequestError
from slime_ascend.rollout.torch_engine.model import TINY_QWEN3_MOE_KWARGS, load_model, save_model

K = TINY_QWEN3_MOE_KWARGS
PROMPT = [5, 17, 300, 2 + 40, 99, 1000, 44]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_model(load_model(None, moe=True, seed=1), tmp_path_factory.mktemp("moe") / "m")


@pytest.fixture(scope="module")
def engine(moe_dir):
    return TorchEngine(str(moe_dir))


def _routes(meta: dict) -> torch.Tensor:
    raw = base64.b64decode(meta["routed_experts"])
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, K["num_hidden_layers"],
                                                                        K["num_experts_per_tok"])


@torch.no_grad()
def _expected_routes(model, tokens: list[int]) -> torch.Tensor:
    """Each fed token's top-k experts from transformers' own router logits of one full-sequence pass."""
    out = model(input_ids=torch.tensor([tokens[:-1]]), output_router_logits=True, use_cache=False)
    moe_layers = [i for i in range(K["num_hidden_layers"]) if i not in K["mlp_only_layers"]]
    assert len(out.router_logits) == len(moe_layers)
    expected = torch.zeros(len(tokens) - 1, K["num_hidden_layers"], K["num_experts_per_tok"], dtype=torch.int32)
    for layer, logits in zip(moe_layers, out.router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        expected[:, layer] = torch.topk(probs, K["num_experts_per_tok"], dim=-1).indices.to(torch.int32)
    return expected


def test_generate_returns_the_routed_experts_of_every_fed_token(engine, moe_dir):
    answer = engine.generate({"input_ids": PROMPT, "return_routed_experts": True, "return_logprob": True,
                              "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3,
                                                  "ignore_eos": True}})
    tokens = PROMPT + answer["output_ids"]
    routes = _routes(answer["meta_info"])
    assert routes.shape == (len(tokens) - 1, K["num_hidden_layers"], K["num_experts_per_tok"])
    assert torch.equal(routes, _expected_routes(load_model(moe_dir), tokens))
    assert not routes[:, 0].any()  # layer 0 is dense
    assert ((routes[:, 1] >= 0) & (routes[:, 1] < K["num_experts"])).all() and (routes[:, 1, 0] != routes[:, 1, 1]).all()
    assert len(set(routes[:, 1].flatten().tolist())) > 1  # the tokens do not all go to the same experts


def test_slime_decodes_the_routes_as_sglangs(engine):
    misc = pytest.importorskip("slime.utils.misc", reason="real slime is not on PYTHONPATH")
    answer = engine.generate({"input_ids": PROMPT, "return_routed_experts": True,
                              "sampling_params": {"max_new_tokens": 3, "sampling_seed": 0, "ignore_eos": True}})
    flat = misc.decode_int32_meta_array(answer["meta_info"], "routed_experts")
    assert torch.equal(flat, _routes(answer["meta_info"]).flatten())
    assert "routed_experts" not in engine.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
                                                   )["meta_info"]


def test_routed_experts_refused_on_a_dense_model_and_for_non_bool():
    dense = TorchEngine(None)
    with pytest.raises(RequestError, match="return_routed_experts needs an MoE model") as info:
        dense.generate({"input_ids": PROMPT, "return_routed_experts": True})
    assert "\n" not in str(info.value)
    dense.generate({"input_ids": PROMPT, "return_routed_experts": False, "sampling_params": {"max_new_tokens": 1}})
    with pytest.raises(RequestError, match="must be true or false"):
        dense.generate({"input_ids": PROMPT, "return_routed_experts": "yes"})


def test_update_weights_from_a_per_expert_checkpoint(engine, moe_dir, tmp_path):
    """slime's weight push writes each expert's gate/up/down (transformers >= 5 holds them stacked)."""
    other = save_model(load_model(None, moe=True, seed=7), tmp_path / "other")
    params = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    try:
        engine.update_weights_from_disk(str(other))
        got = engine.generate({"input_ids": PROMPT, "return_logprob": True, "sampling_params": params})
        fresh = TorchEngine(str(other)).generate({"input_ids": PROMPT, "return_logprob": True,
                                                      "sampling_params": params})
        assert got["output_ids"] == fresh["output_ids"]
        assert got["meta_info"]["output_token_logprobs"] == fresh["meta_info"]["output_token_logprobs"]
        model = load_model(other)
        assert torch.equal(engine.model.model.layers[1].mlp.experts.gate_up_proj,
                           model.model.layers[1].mlp.experts.gate_up_proj)
    finally:
        engine.update_weights_from_disk(str(moe_dir))


def test_an_incomplete_expert_set_is_refused_and_the_model_kept(engine, moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = save_model(load_model(None, moe=True, seed=9), tmp_path / "broken")
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"))
    before = engine.model.model.layers[1].mlp.experts.gate_up_proj.clone()
    with pytest.raises(RequestError, match=r"experts of 'model.layers.1.mlp.experts' are incomplete: missing "
                                           r"\['model.layers.1.mlp.experts.2.up_proj.weight'\]"):
        engine.update_weights_from_disk(str(broken))
    assert torch.equal(engine.model.model.layers[1].mlp.experts.gate_up_proj, before)


def test_enable_return_routed_experts_adds_the_routes_to_every_answer(engine, moe_dir):
    """Behind slime's router from PyPI no request asks for the routes (it drops the field); an engine started
    with SGLang's server flag adds them anyway, the same routes a request that asks gets."""
    every = TorchEngine(str(moe_dir), enable_return_routed_experts=True)
    request = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "sampling_seed": 5, "ignore_eos": True}}
    got = every.generate(dict(request))
    asked = engine.generate(dict(request, return_routed_experts=True))
    assert got["output_ids"] == asked["output_ids"]
    assert torch.equal(_routes(got["meta_info"]), _routes(asked["meta_info"]))
    info, plain = every.server_info(), engine.server_info()
    assert info["enable_return_routed_experts"] is info["routed_experts_in_every_answer"] is True
    assert plain["enable_return_routed_experts"] is plain["routed_experts_in_every_answer"] is False


def test_enable_return_routed_experts_refused_for_a_dense_model():
    with pytest.raises(ValueError, match="enable_return_routed_experts needs an MoE model") as info:
        TorchEngine(None, enable_return_routed_experts=True)
    assert "\n" not in str(info.value) and "--enable-return-routed-experts" in str(info.value)
