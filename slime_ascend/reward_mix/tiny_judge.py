"""A tiny generative judge whose verdict is known: for the tests and the CPU jobs of ``reward-mix``'s ``judge``.

A real Qwen3 checkpoint (the tiny config of :func:`slime_ascend.rollout.torch_engine.model.tiny_qwen3_config`,
byte tokenizer), served by the real engine, with weights set so that it is a bigram model: every layer's output
projections are zero (the residual stream is the current token's embedding), each token's embedding is one of
two unit vectors, and the LM head maps them to the next token. After a token of even id it says ``Y``, after an
odd one ``N``, whatever the token (``Y``, ``N`` and ``</s>`` included: a judged text may end in any of them). So for
any text, greedy decoding's first token is ``Y`` when the text's last token id is even and ``N`` otherwise
(:func:`expected_verdict` is the reference), and a caller asks for that one token (:data:`MAX_NEW_TOKENS`: the judge
never ends its answer by itself). An earlier version ended after ``Y`` or ``N`` (``</s>``) and so answered nothing
to a text ending in ``Y``, ``N`` or ``</s>``: the slime-loop job's random policy wrote such a response now and then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VERDICTS = {"Y": 1.0, "N": 0.0}
TEMPLATE = "{prompt}{response}"
MAX_NEW_TOKENS = 1  # the judge's answer: one verdict token (judge.verdict's max_new_tokens)
_SCALE = 10.0


def build(out_dir: str | Path) -> Path:
    """Write the judge checkpoint (with its tokenizer) to ``out_dir``; returns it."""
    import torch

    from ..rollout.torch_engine.model import build_byte_tokenizer, load_model, save_model

    tokenizer = build_byte_tokenizer()
    model = load_model(None, dtype=torch.float32, seed=0)
    yes, no = (tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c))[0] for c in ("Y", "N"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        ids = torch.arange(embed.shape[0])
        embed[ids % 2 == 0, 0] = 1.0
        embed[ids % 2 == 1, 1] = 1.0
        head = model.lm_head.weight
        head.zero_()
        head[yes, 0] = head[no, 1] = _SCALE
    return save_model(model, out_dir, tokenizer)


def expected_verdict(tokenizer: Any, text: str) -> float:
    """The value the judge gives ``text`` (a rendered template): 1.0 when its last token id is even."""
    ids = tokenizer.encode(text)
    return VERDICTS["Y"] if ids and ids[-1] % 2 == 0 else VERDICTS["N"]
