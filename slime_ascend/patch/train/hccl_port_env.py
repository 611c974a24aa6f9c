"""The train actors get the HCCL port ranges the sglang-npu launch bridge gives the engines.

CANN: in a multi-card job, if one card of an HCCL communicator sets ``HCCL_HOST_SOCKET_PORT_RANGE`` /
``HCCL_NPU_SOCKET_PORT_RANGE``, every card must. ``engine.sglang_npu_launch`` sets them in each engine slime launches
(where the job left them unset), and slime's weight-update group joins those engines with the train actors, whose
environment is the job's plus ``--train-env-vars``: without this patch they lacked the ranges whenever the job did.
As each ``TrainRayActor.init`` starts (before ``dist.init_process_group`` and every HCCL communicator of the actor),
the same values are set the same way: the job's own value wins, else the ``ascend_rollout_hccl_*_port_range``
setting (:func:`slime_ascend.rollout.backends.sglang_npu.apply_train_env`). ``--train-env-vars`` giving another
value is refused at ``parse_args`` (``sglang_npu.hccl_problem``).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, method_mismatch

logger = logging.getLogger("slime_ascend.patch")

MODULE = "slime.ray.train_actor"


class HCCLPortEnv(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        # the process group must come after the moment this patch runs at (the start of init)
        return method_mismatch(modules[MODULE], "TrainRayActor.init", ["self", "args", "role"],
                               ["dist.init_process_group("], unwrap=True)

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        if args is None:
            raise ValueError("train.hccl_port_env needs slime's args")
        from ...rollout.backends.sglang_npu import apply_train_env

        changed = apply_train_env(args)
        if changed:
            logger.info("sglang-npu: train actor environment %s (as the engines')", changed)


PATCH = HCCLPortEnv(
    id="train.hccl_port_env",
    targets=(f"{MODULE}:TrainRayActor.init",),
    why="slime starts the train actors with the job's environment only, while the engines they share an HCCL "
    "weight-update group with get the HCCL port ranges from the sglang-npu launch bridge; CANN requires every card "
    "of a communicator to set them if one does.",
    how="as each train actor starts (train moment, before its process group), set the engines' HCCL port-range "
    "variables where the job left them unset, from the same sglang-npu settings.",
    upstream="patches/slime/train-actors-get-the-engines-communicator-env.md",
    checked_on=("0.3.1",),
)
