"""slime's DSA indexer selects its top-k keys deterministically (the ``dsa-determinism`` plugin).

slime's GLM-5 / DeepSeek-V3.2 lightning indexer (``slime_plugins/models/glm5/ops/indexer.py``) computes the
index logits (tilelang kernel, or SGLang's FP8 kernel with ``MEGATRON_USE_SGLANG_FP8_INDEXER=1``) and selects
in ``IndexerFunction.forward`` with ``pytorch_topk_with_invalid_padding(logits, topk)``, i.e. ``torch.topk``.
The replacement is :func:`slime_ascend.dsa.indexer.topk_with_invalid_padding` and carries the original as
``__wrapped__`` (``glm5.py`` reaches the name only through ``lighting_indexer``). The rest of the forward is
untouched: the FP8 path's ascending re-sort, the score gather, the saved tensors, the backward, a given
``topk_indices`` (index replay), ``--freeze-indexer``.

Why this seam: the narrowest one that is a plain module attribute. On a host without ``tilelang``
(every CPU host) the module cannot be imported; ``verify`` then checks the same snippets in slime's
source file, and the tests import slime's real module with the two tilelang kernel modules stubbed.

Upstream: patches/0013-dsa-indexer-deterministic-topk.patch (the same rule inside
``pytorch_topk_with_invalid_padding``).
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

from ..._import_hooks import module_file
from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

INDEXER = "slime_plugins.models.glm5.ops.indexer"
ATTR = "pytorch_topk_with_invalid_padding"

#: What slime's selection function must still contain (its output contract), and the call site.
TOPK_SNIPPETS = (
    "selected = min(topk, logits.shape[-1])",
    "torch.topk(logits, selected, dim=-1)",
    "indices.to(torch.int32)",
    "masked_fill(scores == -torch.inf, -1)",
)
CALL_SNIPPET = f"{ATTR}(logits, topk)"


def _deterministic(original: Any) -> Any:
    from slime_ascend.dsa.indexer import topk_with_invalid_padding

    @functools.wraps(original)
    def pytorch_topk_with_invalid_padding(logits, topk):
        return topk_with_invalid_padding(logits, topk)

    pytorch_topk_with_invalid_padding.__slime_ascend_patch__ = "train.dsa_deterministic_topk"
    return pytorch_topk_with_invalid_padding


def _source_problems(source: str, label: str) -> list[str]:
    """The same shape checks on the text of slime's ``indexer.py`` (when it cannot be imported here)."""
    problems = [f"{label} no longer contains {s!r}" for s in (*TOPK_SNIPPETS, CALL_SNIPPET) if s not in source]
    if f"def {ATTR}(logits" not in source:
        problems.append(f"{label} no longer defines {ATTR}(logits, topk)")
    if "class IndexerFunction" not in source:
        problems.append(f"{label} no longer defines IndexerFunction")
    return problems


class DSADeterministicTopk(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        mod = modules.get(INDEXER)
        if mod is None:
            return []
        problems = missing_attrs(mod, [ATTR, "IndexerFunction", "lighting_indexer"])
        if problems:
            return problems
        fn = getattr(mod, ATTR)  # ours carries slime's as __wrapped__: signature and source follow it
        problems += param_mismatch(fn, ["logits", "topk"], ATTR)
        problems += missing_source(fn, TOPK_SNIPPETS, ATTR)
        problems += missing_source(mod.IndexerFunction.forward, [CALL_SNIPPET], "IndexerFunction.forward")
        return problems

    def verify(self, modules: dict[str, ModuleType] | None = None) -> list[str]:
        problems = super().verify(modules)
        if modules is None and problems and problems[0].startswith("cannot import target"):
            path = _source_file()
            if path is not None:  # tilelang / deep_gemm missing: check slime's source text instead
                return _source_problems(path.read_text(errors="replace"), f"{INDEXER} ({path})")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        mod = modules[INDEXER]
        self.replace(mod, ATTR, _deterministic(inspect.unwrap(getattr(mod, ATTR))))


def _source_file() -> Path | None:
    return module_file(INDEXER)


PATCH = DSADeterministicTopk(
    id="train.dsa_deterministic_topk",
    targets=(f"{INDEXER}:{ATTR}",),
    why="slime's DSA indexer (GLM-5 / DeepSeek-V3.2) selects its top-k keys with torch.topk, whose choice and "
        "order among equal scores is unspecified: the sparse-attention key set and summation order can change "
        "between devices, kernels and runs on identical scores.",
    how="Replace indexer.pytorch_topk_with_invalid_padding (looked up by IndexerFunction.forward at every call) "
        "with the deterministic top-k in the same layout: values best first, ties by lower index, int32 indices, "
        "-1/-inf for -inf keys and padding; NaN refused.",
    upstream="patches/0013-dsa-indexer-deterministic-topk.patch",
    checked_on=("0.3.1",),
)
