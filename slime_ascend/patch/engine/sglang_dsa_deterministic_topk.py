"""SGLang's DSA indexer, on its torch top-k backend, selects by the ``dsa-determinism`` rule (the rollout side).

SGLang's DSA indexer (``sglang/srt/layers/attention/dsa/dsa_indexer.py``, GLM-5 and DeepSeek-V3.2) selects each
query's keys in ``DSATopKBackend.topk_func`` / ``topk_transform`` (``dsa_topk_backend.py``). On its ``torch``
backend (``--dsa-topk-backend torch``, which SGLang runs with ``SGLANG_DSA_FUSE_TOPK=false``) that is
``_topk_unfused(score, lengths, topk, row_starts, topk_op=torch.topk, ...)``: the row's keys outside
``[row_start, row_start + length)`` masked to ``-inf``, then ``torch.topk``, whose choice among equal scores is
unspecified, while the train side (``train.dsa_deterministic_topk``) keeps the lower index. This patch has
``_topk_unfused`` select with the package's deterministic top-k wherever it would call ``torch.topk``: best first,
ties to the lower index, ``-inf`` keys never (``-1``), NaN refused. The rest is SGLang's: the masking, the
``row_starts`` shift, the ``-1`` layout, and every other ``topk_op`` (flashinfer's, which has its own
``SGLANG_DSA_TOPK_FLASHINFER_DETERMINISTIC`` / ``_TIE_BREAK`` settings).

Installed in every process that imports ``dsa_topk_backend`` (SGLang's scheduler processes, which inherit
``SLIME_ASCEND_PLUGINS`` from the engine actor that spawns them). Not covered, and said so where the plugin's
``validate`` sees an SGLang rollout: SGLang's default ``sgl-kernel`` backend and the fused top-k transforms
(CUDA kernels), and on Ascend ``forward_npu``, which scores and selects inside ``torch_npu.npu_lightning_indexer``
(a fused kernel whose tie rule cannot be read or checked on a host without an NPU).

Upstream: patches/sglang/sglang-dsa-torch-topk-deterministic.md.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

MODULE = "sglang.srt.layers.attention.dsa.dsa_topk_backend"
NAME = "_topk_unfused"
UNFUSED_SNIPPETS = ("masked_fill(~valid_mask, float(\"-inf\"))", "topk_op(masked_logits, valid_topk, **topk_kwargs)",
                    "topk_scores == float(\"-inf\"), -1")
TORCH_BACKEND_SNIPPETS = ("_topk_unfused(", "topk_op=torch.topk")


def deterministic_topk_op(scores, k, dim=-1, **kwargs):
    """``torch.topk(scores, k, dim=-1)`` as ``_topk_unfused`` calls it, by the ``dsa-determinism`` rule:
    ``(values, indices)``, best first, ties to the lower index, ``-1`` for ``-inf`` keys."""
    import torch

    from slime_ascend.algorithms.dsa_topk import deterministic_topk

    if dim not in (-1, scores.dim() - 1) or kwargs.get("largest", True) is False:
        raise ValueError(f"engine.sglang_dsa_deterministic_topk: topk over dim={dim} with {kwargs} is not the "
                         "indexer's selection (the last dim, largest)")
    return deterministic_topk(scores, int(k), index_dtype=torch.int64)


def _deterministic(original):
    import torch

    @functools.wraps(original)
    def _topk_unfused(score, lengths, topk, row_starts=None, topk_op=torch.topk, topk_op_kwargs=None):
        if topk_op is torch.topk:
            topk_op = deterministic_topk_op
        return original(score, lengths, topk, row_starts=row_starts, topk_op=topk_op, topk_op_kwargs=topk_op_kwargs)

    _topk_unfused.__slime_ascend_patch__ = "engine.sglang_dsa_deterministic_topk"
    return _topk_unfused


class SGLangDSADeterministicTopk(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        mod = modules[MODULE]
        problems = missing_attrs(mod, [NAME, "DSATopKBackend.topk_func"])
        if problems:
            return problems
        function = inspect.unwrap(getattr(mod, NAME))
        problems += param_mismatch(function, ["score", "lengths", "topk", "row_starts", "topk_op", "topk_op_kwargs"],
                                   NAME)
        problems += missing_source(function, UNFUSED_SNIPPETS, NAME)
        problems += missing_source(mod.DSATopKBackend.topk_func, TORCH_BACKEND_SNIPPETS, "DSATopKBackend.topk_func")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[MODULE], NAME, _deterministic)


PATCH = SGLangDSADeterministicTopk(
    id="engine.sglang_dsa_deterministic_topk",
    targets=(f"{MODULE}:{NAME}",),
    why="SGLang's DSA indexer on its torch top-k backend selects with torch.topk, whose choice among equal scores is "
        "unspecified; the train side (dsa-determinism) keeps the lower index, so the two sides can attend to "
        "different keys on tied scores (the indexer's ReLU scores tie at exactly 0 often).",
    how="Wrap dsa_topk_backend._topk_unfused (called by name from DSATopKBackend.topk_func) so that where its "
        "topk_op is torch.topk it selects with slime_ascend.algorithms.dsa_topk.deterministic_topk (values best "
        "first, ties by lower index, -1 for -inf keys, NaN refused); masking, row_starts and layout stay SGLang's.",
    upstream="patches/sglang/sglang-dsa-torch-topk-deterministic.md",
    checked_on=("0.3.1",),
)
