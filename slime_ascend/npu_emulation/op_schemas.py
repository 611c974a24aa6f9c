"""The real schemas of the torch_npu operators the emulated ``torch_npu`` registers (data only, no torch import).

Every ``npu_*`` name in ``slime_ascend/`` (``grep -rn "npu_" slime_ascend``, 2026-12-06), and what the emulation
does with it:

================================  ==========================================================================  ==========
op                                where the package meets it                                                  emulated
================================  ==========================================================================  ==========
``npu_sparse_flash_attention``    called: ``glm5/npu_sparse_attention.py`` (chosen in ``glm5/kernels.py``)   yes
``npu_lightning_indexer``         SGLang's Ascend DSA indexer selects inside it (``dsa/checks.py``,           yes
                                  ``dsa/plugin.py``, ``patch/engine/sglang_dsa_deterministic_topk.py``,
                                  ``glm5/kernels.py``): the rollout side of the train/rollout key sets
``npu_fusion_attention``          imported by name: transformers' Ascend flash attention                      yes (part)
                                  (``transformers/integrations/npu_flash_attention.py``), imported by every
                                  process that imports transformers where torch_npu is available
``npu_fused_infer_attention_score``  named only: SGLang's decode under ``ASCEND_USE_FIA=1``                  no
                                  (``rollout/plugin.py``, ``rollout/backends/sglang_npu.py``); the package
                                  never calls it and SGLang does not run on the emulated device
``npu_dynamic_mx_quant``          named only: the rule ``quant/mxfp8.py`` matches; checked there against a    no
                                  Fraction-exact reference, the device kernel's bits need a device
================================  ==========================================================================  ==========

:data:`SCHEMAS` holds each emulated op's ``func:`` line verbatim from :data:`SOURCE`; :data:`DOCS` the pages
whose input constraints the reference bodies enforce.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DOCS", "EXPORT_SOURCE", "SCHEMAS", "SOURCE", "Schema"]

#: Where the schema strings come from (the newest stored snapshot of Ascend/op-plugin).
SOURCE = {
    "repo": "Ascend/op-plugin",
    "commit": "517f2e7d0f202f38b76310706cb977ca2388ad21",  # 2026-08-21
    "path": "op_plugin/config/op_plugin_functions.yaml",
}

#: How torch_npu exposes them: ``torch_npu.<name> = torch.ops.npu.<name>`` (the OpOverloadPacket) for every
#: name in ``dir(torch.ops.npu)``, and ``torch.<name>`` a wrapper that raises "deprecated".
EXPORT_SOURCE = {
    "repo": "Ascend/pytorch",
    "commit": "9e73e708ab9350d203475609f36f8a43f6a0c2ab",  # 2026-08-21
    "path": "torch_npu/_init/core/_exports.py",
    "lines": "45-51 (_export_npu_ops)",
}


class Schema(NamedTuple):
    line: int  # in SOURCE["path"] at SOURCE["commit"]
    section: str  # the yaml section holding it
    func: str  # verbatim


SCHEMAS: dict[str, Schema] = {
    "npu_sparse_flash_attention": Schema(7487, "custom", (
        "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
        "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
        "int sparse_block_size=1, str layout_query=\"BSND\", str layout_kv=\"BSND\", int sparse_mode=3, "
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int attention_mode=0, "
        "bool return_softmax_lse=False, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)")),
    "npu_lightning_indexer": Schema(6417, "custom", (
        "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
        "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, "
        "str layout_query=\"BSND\", str layout_key=\"BSND\", int sparse_count=2048, int sparse_mode=3, "
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, bool return_value=False) "
        "-> (Tensor, Tensor)")),
    "npu_fusion_attention": Schema(6249, "custom", (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False, str softmax_layout=\"\", Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, "
        "int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)")),
}

#: The documentation (same repo and commit as SOURCE) and the code whose checks the reference bodies follow.
DOCS = {
    "npu_sparse_flash_attention": (
        "docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md",
        "op_plugin/ops/opapi/SparseFlashAttentionKernelNpuOpApi.cpp",
        "op_plugin/python/meta/_meta_registrations.py:283",
        "test/test_custom_ops/test_npu_sparse_flash_attention.py:128 (cpu_sparse_flash_attention)",
        "test/test_custom_ops/test_npu_dense_lightning_indexer_grad_kl_loss.py:24 (softmax_max/sum convention)",
    ),
    "npu_lightning_indexer": (
        "docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md",
        "op_plugin/ops/opapi/LightningIndexerKernelNpuOpApi.cpp",
        "op_plugin/python/meta/_meta_registrations.py:2417",
        "test/test_custom_ops/test_npu_lightning_indexer.py:24 (_lightning_indexer)",
    ),
    "npu_fusion_attention": (
        "docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md (parameters, outputs, constraints)",
    ),
}
