"""The ``dsa-determinism`` plugin's checks at ``parse_args``: its dump setting, and which rollout side selects by
its rule."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..plugins.settings import SettingsError

logger = logging.getLogger("slime_ascend.dsa")


def validate(args: Any, settings: Any) -> None:
    """A dump needs whole sequences on each rank (refused under context parallelism, in one line); a warning where
    slime's SGLang engines select by a kernel of their own."""
    if settings.dsa_index_dump_dir:
        cp = int(getattr(args, "context_parallel_size", 1) or 1)
        if cp != 1:
            raise SettingsError(
                f"ascend_dsa_index_dump_dir needs whole sequences on each rank, but --context-parallel-size is {cp} "
                "(a CP rank holds a shard of each sequence's queries). Fix: dump at --context-parallel-size 1, or "
                "unset ascend_dsa_index_dump_dir")
    problem = sglang_selection_problem(args)
    if problem:
        logger.warning("dsa-determinism: %s", problem)


def sglang_selection_problem(args: Any, environ: dict[str, str] | None = None) -> str | None:
    """Why slime's SGLang engines would not select by the plugin's rule (``engine.sglang_dsa_deterministic_topk``
    covers SGLang's torch top-k backend, unfused), or None: they do, or the rollouts come from the torch engine or
    from external engines (not launched by slime: their own settings decide).

    On Ascend no top-k flag reaches SGLang's selection: its indexer's ``forward_npu`` picks the keys inside
    ``torch_npu.npu_lightning_indexer`` (a fused kernel), so there the answer is never None."""
    from ..plugins import runtime

    environ = os.environ if environ is None else environ
    names = runtime.enabled_names(args)
    if "torch-engine" in names or getattr(args, "rollout_external_engine_addrs", None):
        return None
    where = sglang_on_ascend(args, names)
    if where:
        return (f"SGLang on Ascend ({where}) selects the DSA keys inside torch_npu.npu_lightning_indexer (its "
                "indexer's forward_npu), which never reaches the top-k this plugin patches, whatever "
                "--sglang-dsa-topk-backend and SGLANG_DSA_FUSE_TOPK say; train and rollout may attend to different "
                "keys on tied scores there, and that path is not checked (the kernel's tie rule cannot be read). "
                "Fix: rollouts that select by the rule come from the torch engine (plugin torch-engine)")
    backend = getattr(args, "sglang_dsa_topk_backend", None) or "sgl-kernel"
    fused = environ.get("SGLANG_DSA_FUSE_TOPK", environ.get("SGLANG_NSA_FUSE_TOPK", "true")).lower() not in (
        "0", "false", "no", "off")
    if backend == "torch" and not fused:
        return None
    return (f"SGLang selects the DSA keys with its {backend!r} top-k backend{' (fused)' if fused else ''}, not by "
            "this plugin's rule, so train and rollout may attend to different keys on tied scores. Fix: "
            "--sglang-dsa-topk-backend torch with SGLANG_DSA_FUSE_TOPK=false in the engines' environment (CUDA "
            "only: on Ascend SGLang selects inside torch_npu.npu_lightning_indexer)")


def sglang_on_ascend(args: Any, names: list[str]) -> str | None:
    """What makes slime's SGLang engines run SGLang's Ascend indexer (``forward_npu``: SGLang dispatches to it
    wherever torch_npu is importable), or None: the sglang-npu plugin, ``--sglang-device npu``, the npu plugin
    on a device (not on the host with cpu), or torch_npu installed here."""
    from .. import host

    if "sglang-npu" in names:
        return "plugin sglang-npu"
    if getattr(args, "sglang_device", None) == "npu":
        return "--sglang-device npu"
    if "npu" in names and "cpu" not in names:
        return "plugin npu"
    if host.torch_npu_installed():
        return "torch_npu is installed"
    return None
