"""Which HF parameter names are quantised.

Default policy (no list from a checkpoint): `<...>layers.<i>.<...>.<leaf>.weight` with 2 or 3
dims whose leaf module is a decoder linear projection (attention q/k/v/o, fused qkv, MLA
q_a/q_b/kv_a/kv_b, DSA indexer wq_b/wk, linear-attention projections, dense / shared /
routed expert gate/up/down and w1/w2/w3). Everything else stays in its dtype: embeddings,
norms, the MoE router `mlp.gate`, `shared_expert_gate`, `lm_head`, MTP `eh_proj`, indexer
`weights_proj`, biases and all 1-D tensors.

Ignore-list policy (a checkpoint's `ignore` / `modules_to_not_convert` / FLOAT entries):
every Linear-like `.weight` (2 or 3 dims, not an embedding, not `lm_head`) is quantised
unless its module matches a rule. A rule matches a module name exactly, as a dotted prefix
(`model.layers.0` matches `model.layers.0.mlp.down_proj`), as a dotted suffix (`lm_head`,
`mlp.gate`), or, with a `re:` prefix, by `re.match` of the regex.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

QUANTIZED_LEAVES: frozenset[str] = frozenset({
    # attention
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "dense",
    # MLA (DeepSeek-V2/V3, Kimi, GLM-MoE-DSA)
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    # DSA lightning indexer
    "wq_b", "wk",
    # linear attention (Qwen3-Next gated delta net)
    "in_proj_qkvz", "in_proj_qkv", "in_proj_z", "out_proj",
    # MLP / experts
    "gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3",
})

EMBEDDING_LEAVES: frozenset[str] = frozenset({"embed_tokens", "wte", "word_embeddings", "embeddings", "embed"})
_LAYER_RE = re.compile(r"(^|\.)layers\.\d+\.")


def module_of(param_name: str) -> str:
    """`a.b.weight` -> `a.b`."""
    return param_name[: -len(".weight")] if param_name.endswith(".weight") else param_name


@lru_cache(maxsize=256)
def _compiled(rule: str) -> re.Pattern[str]:
    return re.compile(rule[3:])


def matches_rule(module: str, rule: str) -> bool:
    if rule.startswith("re:"):
        return _compiled(rule).match(module) is not None
    return module == rule or module.startswith(rule + ".") or module.endswith("." + rule)


def matches_any(module: str, rules: Iterable[str]) -> bool:
    return any(matches_rule(module, r) for r in rules)


def is_default_quantized(name: str, ndim: int) -> bool:
    """The default policy, without any ignore rules."""
    if not name.endswith(".weight") or ndim not in (2, 3):
        return False
    module = module_of(name)
    leaf = module.rsplit(".", 1)[-1]
    return leaf in QUANTIZED_LEAVES and _LAYER_RE.search(module) is not None


def is_linear_like(name: str, ndim: int) -> bool:
    """Candidates of the ignore-list policy."""
    if not name.endswith(".weight") or ndim not in (2, 3):
        return False
    parts = module_of(name).split(".")
    if parts[-1] == "lm_head" or any(p in EMBEDDING_LEAVES for p in parts):
        return False
    return not any("norm" in p for p in parts[-1:])


def should_quantize(
    name: str, ndim: int, ignore: Iterable[str] | None = None, extra_ignore: Iterable[str] = ()
) -> bool:
    """True when parameter `name` with `ndim` dims is to be quantised.

    `ignore` None selects the default policy; a list selects the ignore-list policy.
    `extra_ignore` rules are applied in both modes.
    """
    module = module_of(name)
    if ignore is None:
        ok = is_default_quantized(name, ndim)
    else:
        ok = is_linear_like(name, ndim) and not matches_any(module, ignore)
    return ok and not matches_any(module, extra_ignore)
