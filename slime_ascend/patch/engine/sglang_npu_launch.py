"""SGLang engines that slime launches get the NPU server arguments and environment.

slime builds each server's ``ServerArgs`` in the ``SGLangEngine`` Ray actor from its own args (``--sglang-*``,
``--sglang-config`` overrides) and spawns the server from there. The backend's server arguments (the device,
the ``ascend`` attention backend, graph mode, memory fraction) come from ``self.args`` (the ``ascend_rollout_*``
settings of the sglang-npu plugin); a value the user gave wins, except ``device``, which must be ``npu``. The
spawned server inherits the environment (HCCL port ranges, ``ASCEND_USE_FIA``; expandable segments break
SGLang's sleep mode). Externally launched engines (``_init_external``) are untouched.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

logger = logging.getLogger("slime_ascend.patch")

MODULE = "slime.backends.sglang_utils.sglang_engine"


def _bridge(orig: Any) -> Any:
    def _init_normal(self, server_args_dict):
        from ...rollout.backends import sglang_npu

        backend = sglang_npu.BACKEND
        options = backend.options_from_args(self.args)
        backend.check(options)
        merged, kept = sglang_npu.fill_server_args(
            server_args_dict, backend.server_args(options), sglang_npu.server_args_fields()
        )
        for key, (user, ours) in kept.items():
            logger.info("sglang-npu: keeping %s=%r from slime's args (the plugin would set %r)", key, user, ours)
        changed = sglang_npu.apply_env(backend.env(options))
        if changed:
            logger.info("sglang-npu: engine environment %s", changed)
        return orig(self, merged)

    _init_normal.__wrapped__ = orig
    return _init_normal


class SGLangNPULaunch(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[MODULE]
        problems = missing_attrs(module, ["SGLangEngine._init_normal", "launch_server_process"])
        if problems:
            return problems
        method = module.SGLangEngine._init_normal
        problems += param_mismatch(method, ["self", "server_args_dict"], "SGLangEngine._init_normal")
        problems += missing_source(method, ["ServerArgs(**server_args_dict)"], "SGLangEngine._init_normal")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[MODULE].SGLangEngine, "_init_normal", _bridge)


PATCH = SGLangNPULaunch(
    id="engine.sglang_npu_launch",
    targets=(f"{MODULE}:SGLangEngine._init_normal",),
    why="slime's SGLang launch path has no NPU server arguments or environment, and strips expandable segments "
    "only from the CUDA allocator variables.",
    how="wrap SGLangEngine._init_normal: fill the sglang-npu backend's ServerArgs where slime's dict holds SGLang's "
    "default, set its environment where unset and strip expandable_segments from PYTORCH_NPU_ALLOC_CONF.",
    upstream="patches/0010-accelerator-engine-launch-defaults.patch",
    checked_on=("0.3.1",),
)
