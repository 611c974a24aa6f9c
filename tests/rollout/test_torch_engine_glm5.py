"""The torch engine serving the tiny GLM-5 (transformers' ``GlmMoeDsa``: MLA, DSA with IndexShare, MoE with a
shared expert): generation whose log-probs are the full-sequence forward's (the KV-cached decode, with the
indexer's top-k smaller than the sequence and reused on the shared layers, selects as the whole pass does), and
the routed experts in SGLang's layout, checked against the router's own logits."""

from __future__ import annotations

import base64

import pytest
import torch

from slime_ascend.glm5.tiny import TINY_GLM5_KWARGS as K
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model, score_tokens

PROMPT = [5, 17, 300, 42, 99, 1000, 44, 7, 7, 512, 3, 80]  # 12 > index_topk 8: the selection matters


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory):
    return save_model(load_model(None, glm5=True, seed=1), tmp_path_factory.mktemp("glm5") / "m")


@pytest.fixture(scope="module")
def engine(glm5_dir):
    return TorchEngine(str(glm5_dir))


def test_the_tiny_glm5_is_glm_moe_dsa_with_index_share(engine):
    model = engine.model
    assert type(model).__name__ == "GlmMoeDsaForCausalLM" and model.config.index_topk < len(PROMPT)
    assert model.config.indexer_types == ["full", "shared", "full", "shared"]
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.skip_topk for a in attention] == [False, True, False, True]
    with pytest.raises(ValueError, match="not both"):
        load_model(None, moe=True, glm5=True)


def test_generated_log_probs_are_the_full_sequence_forwards(engine):
    out = engine.generate({"input_ids": PROMPT, "return_logprob": True,
                           "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 3,
                                               "ignore_eos": True}})
    assert len(out["output_ids"]) == 8
    expected = score_tokens(engine.model, PROMPT + out["output_ids"])[len(PROMPT) - 1:]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _expected_routes(model, tokens: list[int]) -> torch.Tensor:
    """Each fed token's experts from the router's logits of one full pass: sigmoid, plus the correction bias for
    the choice, weights from the sigmoid, highest weight first (ties to the lower expert)."""
    logits = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: logits.__setitem__(i, o))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        model(input_ids=torch.tensor([tokens[:-1]]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    top_k = K["num_experts_per_tok"]
    expected = torch.zeros(len(tokens) - 1, K["num_hidden_layers"], top_k, dtype=torch.int32)
    for layer, raw in logits.items():
        scores = raw.float().sigmoid()
        chosen = torch.topk(scores + model.model.layers[layer].mlp.gate.e_score_correction_bias, top_k).indices
        for t in range(chosen.shape[0]):
            pairs = sorted(chosen[t].tolist(), key=lambda e: (-float(scores[t, e]), e))
            expected[t, layer] = torch.tensor(pairs, dtype=torch.int32)
    return expected


def test_generate_returns_the_routed_experts_of_every_fed_token(engine, glm5_dir):
    answer = engine.generate({"input_ids": PROMPT, "return_routed_experts": True,
                              "sampling_params": {"max_new_tokens": 5, "sampling_seed": 0, "ignore_eos": True}})
    tokens = PROMPT + answer["output_ids"]
    raw = base64.b64decode(answer["meta_info"]["routed_experts"])
    routes = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, K["num_hidden_layers"],
                                                                        K["num_experts_per_tok"])
    assert routes.shape[0] == len(tokens) - 1
    assert not routes[:, 0].any()  # layer 1 is dense
    assert torch.equal(routes, _expected_routes(load_model(glm5_dir), tokens))
    assert len(set(routes[:, 1:].flatten().tolist())) > 1


@torch.no_grad()
def _full_pass_sets(model, tokens: list[int]) -> dict[int, torch.Tensor]:
    """Each layer's attended keys for every position of one full pass over ``tokens`` (no KV cache)."""
    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[2][0]))
             for i, layer in enumerate(model.model.layers)]
    try:
        model(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_dump_dsa_index_sets_writes_each_requests_key_sets_per_layer(glm5_dir, tmp_path):
    """``dump_dsa_index_sets``: one rollout record per request (``slime_ascend.dsa.index_sets``) whose fed tokens
    are the prompt and the outputs but the last, and whose key sets, the prefill's rows then one row per decode
    step, are the sets of one full pass over those tokens in every layer (the shared layers' the same as the
    computing layer before them)."""
    from slime_ascend.dsa.index_sets import canonical_sets, load_records

    dumping = TorchEngine(str(glm5_dir), dump_dsa_index_sets=tmp_path / "sets")
    out = dumping.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "sampling_seed": 5,
                                                                   "ignore_eos": True}})
    (record,) = load_records(tmp_path / "sets", "rollout-*.pt")
    fed = PROMPT + out["output_ids"][:-1]
    assert record["tokens"] == fed and record["start"] == 0 and record["weight_version"] == "default"
    expected = _full_pass_sets(dumping.model, fed)
    assert sorted(record["layers"]) == sorted(expected) == [0, 1, 2, 3]
    width = K["index_topk"]
    for layer, sets in record["layers"].items():
        assert sets.shape == (len(fed), width) and sets.dtype == torch.int32
        assert torch.equal(canonical_sets(sets, width), canonical_sets(expected[layer], width)), layer
    assert torch.equal(record["layers"][1], record["layers"][0]) and torch.equal(record["layers"][3],
                                                                                  record["layers"][2])
    # past index_topk keys the selection decides: the last positions read index_topk of their len(fed) keys
    assert (canonical_sets(record["layers"][0], width)[len(PROMPT):] >= 0).sum(1).eq(width).all()


def test_dump_dsa_index_sets_refuses_a_model_without_dsa(tmp_path):
    with pytest.raises(ValueError, match="needs a DSA model.*Fix: drop --dump-dsa-index-sets"):
        TorchEngine(None, dump_dsa_index_sets=tmp_path / "sets")
