"""Plugin declaration of ``dsa-determinism`` (cheap to import; no torch).

slime's DSA lightning indexer (``slime_plugins/models/glm5/ops/indexer.py``, used by the GLM-5 and
DeepSeek-V3.2 specs) picks each query's top-k keys with ``torch.topk``, whose order among equal scores
is unspecified (it differs between devices, kernels and thread counts). The sparse attention then
reads the keys in that order, so two runs on the same scores can attend to a different key set at
the k-th place, and sum the selected keys in a different order. This plugin makes the train-side
selection the package's deterministic top-k (:mod:`slime_ascend.algorithms.dsa_topk`): score desc,
ties by lower index, ``-inf`` keys never selected (``-1``), NaN refused; same layout and dtypes as
slime's function returns (values best first in the scores' dtype, int32 indices, ``-1`` / ``-inf``
padding). Key-sharded scoring merges to the same result (``merge_topk_candidates``).

The patch (``train.dsa_deterministic_topk``) is installed, in every process, as slime's indexer module is
imported, which only the Megatron train actors do (a rollout engine has its own indexer). One setting,
``ascend_dsa_index_dump_dir`` (off by default): each train actor writes there the key sets every layer's sparse
attention read (``train.dsa_index_dump``), for ``slime-ascend dsa-index-sets`` to compare with the torch engine's
(``serve-torch --dump-dsa-index-sets``; :mod:`slime_ascend.dsa.index_sets`). The torch engine selects by the
same rule (``rollout/torch_engine/glm5.py``; train and rollout sets compared per layer in
``tests/glm5/test_glm5_train_rollout_logprobs.py`` and, in slime's loop, ``tests/e2e/test_slime_glm5_cpu.py``).
SGLang's selects by it on its torch top-k backend (``--sglang-dsa-topk-backend torch``, unfused:
``engine.sglang_dsa_deterministic_topk``, in SGLang's own processes); its default sgl-kernel backend and fused
transforms are CUDA kernels, and on Ascend it selects inside ``torch_npu.npu_lightning_indexer``, a fused kernel
whose tie rule cannot be read or checked on a host without an NPU: ``validate`` warns at ``parse_args`` where
slime's SGLang engines would select so. slime's ``--freeze-indexer`` is unaffected: it sets
``requires_grad`` on the indexer's parameters (``model_provider.freeze_model_params``), the selection
itself has no parameters.
"""

from __future__ import annotations

from ..plugins.base import Plugin, PatchUse
from ..plugins.settings import Setting

PLUGIN = Plugin(
    name="dsa-determinism",
    description="slime's DSA indexer (GLM-5 / DeepSeek-V3.2) selects with the deterministic top-k "
                "(ties by lower index, -inf never selected, NaN refused); key-sharded merge rule",
    settings=(
        Setting("ascend_dsa_index_dump_dir", str, None, optional=True,
                help="a directory where each train actor writes the DSA key sets every GLM-5 layer attended to, per "
                     "micro-batch (train-rank*.pt), for `slime-ascend dsa-index-sets` to compare with the engine's "
                     "(serve-torch --dump-dsa-index-sets); needs --context-parallel-size 1; unset: nothing written"),
    ),
    patches=(PatchUse("train.dsa_deterministic_topk"),
             PatchUse("engine.sglang_dsa_deterministic_topk"),  # in SGLang's processes, as their indexer imports
             PatchUse("train.dsa_index_dump", "train", when="slime_ascend.patch.train.dsa_index_dump.wanted")),
    validate="slime_ascend.dsa.checks.validate",
)


def index_dump_dir(args) -> str | None:
    """The ``ascend_dsa_index_dump_dir`` setting on slime's ``args`` (None: unset), as the train actors'
    ``train.dsa_index_dump`` and the torch engines slime starts both read it."""
    from ..plugins import runtime

    return runtime.settings(args, PLUGIN.name).dsa_index_dump_dir or None
