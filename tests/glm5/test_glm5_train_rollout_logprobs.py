"""Train-side and rollout-side per-token log-probs of the tiny GLM-5 agree within slime's own bound, in fp32.

Train side: slime's glm5 spec on the host (the glm5 patches, and ``train.dsa_deterministic_topk`` of the
``dsa-determinism`` plugin: ties in the indexer's scores go to the lower index), loaded from the HF checkpoint by
slime's ``hf_to_megatron``, three packed sequences in one forward. Rollout side: the torch engine's model
(``load_model(hf_dir)``: transformers' ``GlmMoeDsa`` aligned to the checkpoint by
``slime_ascend.rollout.torch_engine.glm5``), fed as the engine feeds it: a prompt, then one token at a time on
its KV cache. The sequences are longer than ``index_topk`` (8), so the DSA selection decides the attention.

Bound: ``LOGPROB_ATOL`` = 1e-6, slime's gate for GLM-5 on 8 H100s (``tests/test_glm52_6layer_deterministic_e2e.py``);
measured here about 3e-7. Without the engine's alignment (transformers as it is) the log-probs differ by up to
~0.4; undoing any one of its three parts breaks the bound too (``test_each_departure_breaks_the_bound``:
half-split indexer RoPE ~0.4, fp32 indexer key ~4e-2, latent norms' eps 1e-6 ~4e-5). The train side without
``dsa-determinism`` (slime's ``torch.topk``, ties in no fixed order: the ReLU'd scores tie at exactly 0) measured
up to 9e-2 here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slime

pytest.importorskip("megatron.core")
pytest.importorskip("slime.backends.megatron_utils.hf_to_megatron", reason="real slime is not on PYTHONPATH")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import single_process_megatron  # noqa: E402
from glm5_spec_fixtures import (K, Wrap, glm5_model, glm5_patched, megatron_config, packed,  # noqa: E402
                                slime_args, thd_positions)

LOGPROB_ATOL = 1e-6
LENGTHS = [96, 61, 40]
PROMPT = 16  # the rollout side prefills this many tokens of each sequence, then decodes one at a time


def _token_logprobs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """log p(seq[i + 1] | seq[: i + 1]) from ``logits`` [len(seq), V], in float64 after the model's fp32."""
    return torch.log_softmax(logits[:-1].double(), -1).gather(-1, seq[1:, None]).squeeze(-1)


DEPARTURES = ("transformers as is", "half-split indexer RoPE", "latent norms' eps 1e-6", "fp32 indexer key")


def _rollout_model(path, undo: str | None):
    """The engine's model (``load_model``), or one with a part of its GLM-5 alignment undone (``undo``)."""
    from transformers import AutoModelForCausalLM

    from slime_ascend.rollout.torch_engine.model import _reset_rotary_buffers, load_model

    if undo == "transformers as is":  # the rollout side before the alignment
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        _reset_rotary_buffers(model)  # as load_model does (see there): this process may have built Megatron models
        return model
    model = load_model(path, torch.float32)
    for layer in model.model.layers:
        attn = layer.self_attn
        if undo == "latent norms' eps 1e-6":
            attn.q_a_layernorm.variance_epsilon = attn.kv_a_layernorm.variance_epsilon = 1e-6
        elif undo == "fp32 indexer key" and attn.indexer is not None:
            attn.indexer.key_dtype = None
    if undo == "half-split indexer RoPE":
        model.config.indexer_rope_interleave = False
    return model


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """(rollout models by name, token ids, train log-probs per sequence, train top-k per indexer layer [T, topk]
    in local indices)."""
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from transformers import AutoModelForCausalLM

    from slime_ascend.glm5.tiny import tiny_glm5_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_glm5_config(), dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-glm5")
    hf.save_pretrained(str(path))
    rollout = {undo: _rollout_model(path, undo) for undo in (None, *DEPARTURES)}
    torch.manual_seed(1)
    ids = torch.randint(3, K["vocab_size"], (sum(LENGTHS),))
    selected = []
    with single_process_megatron(), glm5_patched() as glm5:
        model = glm5_model(glm5, slime_args(path), megatron_config()).eval()
        load_hf_weights(slime_args(path), [Wrap(Wrap(model))], str(path))
        original = glm5.lighting_indexer

        def spy(*args, **kwargs):
            scores, indices = original(*args, **kwargs)
            selected.append(indices.clone())
            return scores, indices

        glm5.lighting_indexer = spy
        try:
            with torch.no_grad():
                logits = model(ids[None], thd_positions(LENGTHS), None, packed_seq_params=packed(LENGTHS))[0]
        finally:
            glm5.lighting_indexer = original
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)[:-1].repeat_interleave(torch.tensor(LENGTHS))
    local = [torch.where(s >= 0, s - starts[:, None], s) for s in selected]  # -1 padding stays
    train_lps = [_token_logprobs(lg, seq) for lg, seq in zip(logits.split(LENGTHS), ids.split(LENGTHS))]
    return rollout, ids, train_lps, local


def _rollout(model, seq: torch.Tensor):
    """Log-probs of ``seq[1:]`` and each indexer layer's selected keys [len(seq), topk], as the engine feeds the
    model (``engine._forward``: the prompt, then one token a step on the KV cache)."""
    seen: dict[int, list[torch.Tensor]] = {}
    def hook(i):
        return lambda _module, _args, out: seen.setdefault(i, []).append(out[0])

    hooks = [layer.self_attn.indexer.register_forward_hook(hook(i))
             for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    try:
        with torch.no_grad():
            out = model(input_ids=seq[None, :PROMPT], use_cache=True)
            past, steps = out.past_key_values, [out.logits[0]]
            for t in range(PROMPT, len(seq)):
                out = model(input_ids=seq[None, t:t + 1], past_key_values=past, use_cache=True)
                past = out.past_key_values
                steps.append(out.logits[0])
    finally:
        for hook in hooks:
            hook.remove()
    return _token_logprobs(torch.cat(steps).float(), seq), {i: torch.cat(v) for i, v in seen.items()}


def test_train_and_rollout_logprobs_and_selections_agree(sides):
    rollout, ids, train_lps, train_topk = sides
    model = rollout[None]
    assert type(model.model.layers[0].self_attn.indexer).__name__ == "GLM5CheckpointIndexer"
    assert model.config.indexer_rope_interleave is True  # GLM-5's config.json, kept in the checkpoint
    offset = 0
    for seq, lp in zip(ids.split(LENGTHS), train_lps):
        rollout_lp, rollout_topk = _rollout(model, seq)
        diff = (rollout_lp - lp).abs().max().item()
        assert diff <= LOGPROB_ATOL, f"train/rollout log-prob gap {diff:.3e} > {LOGPROB_ATOL:g}"
        # IndexShare: layers 1 and 3 compute, 2 and 4 reuse; the train side ran its indexer twice, in order
        assert sorted(rollout_topk) == [0, 2] and len(train_topk) == 2
        for train_sel, layer in zip(train_topk, sorted(rollout_topk)):
            for q in range(len(seq)):
                expected = {int(k) for k in train_sel[offset + q].flatten() if k >= 0}
                assert len(expected) == min(q + 1, K["index_topk"])
                assert set(rollout_topk[layer][q].tolist()) == expected, (layer, q)
        offset += len(seq)


@pytest.mark.parametrize("undo", DEPARTURES)
def test_each_departure_breaks_the_bound(sides, undo):
    """The old rollout side (transformers 5.12's ``GlmMoeDsa`` as loaded before) and each part of the alignment
    undone alone: the gap exceeds the bound (so the bound is not one that cannot fail). One full-sequence
    forward per sequence (the KV-cache path is the first test's)."""
    rollout, ids, train_lps, _ = sides
    model = rollout[undo]
    gaps = []
    for seq, lp in zip(ids.split(LENGTHS), train_lps):
        with torch.no_grad():
            gaps.append((_token_logprobs(model(input_ids=seq[None]).logits[0], seq) - lp).abs().max().item())
    assert all(math.isfinite(g) for g in gaps) and max(gaps) > 5 * LOGPROB_ATOL, gaps


def test_load_model_recomputes_the_rotary_buffers_the_checkpoint_lacks(sides):
    """``inv_freq`` is not in the checkpoint; ``load_model`` recomputes it from the config (model.py
    ``_reset_rotary_buffers``), whatever transformers' loading left in it."""
    from slime_ascend.rollout.torch_engine.model import _reset_rotary_buffers

    rotary = sides[0][None].model.rotary_emb
    expected = 1.0 / (K["rope_parameters"]["rope_theta"] ** (torch.arange(0, K["head_dim"], 2).float()
                                                             / K["head_dim"]))
    torch.testing.assert_close(rotary.inv_freq, expected, rtol=1e-6, atol=0)
    rotary.inv_freq.fill_(float("nan"))
    _reset_rotary_buffers(sides[0][None])
    torch.testing.assert_close(rotary.inv_freq, expected, rtol=1e-6, atol=0)
