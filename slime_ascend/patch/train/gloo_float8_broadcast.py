"""slime's weight broadcast carries float8 tensors over gloo as their bytes.

``update_weights_from_distributed`` (slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py)
sends each bucket's names/dtypes/shapes to the engines and broadcasts every tensor with ``dist.broadcast``; gloo
(the ``cpu`` plugin's transport) refuses float8 ("Invalid scalar type"), so an ``fp8-sync`` push (or slime's own
FP8 quantizer) over the distributed transport fails on the host. The replacement is slime's function with one
change: each tensor is broadcast as :func:`slime_ascend.weight_sync.wire.wire_view` of it (a ``uint8`` view of
the same bytes for float8 over gloo; the tensor itself otherwise), the metadata still naming the real dtype; the
torch engine receives the same way. Over NCCL/HCCL nothing changes. The module attribute is looked up at each
call by ``_update_bucket_weights_from_distributed`` (and imported by name into ``update_weight_from_tensor``).
With a sync plugin's ``distributed_delta`` setting, each bucket goes through
:func:`slime_ascend.weight_sync.distributed_delta.push_bucket` as the quantised blocks that changed since the
version every engine acknowledged (the version whole when an engine does not hold it).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

DISTRIBUTED = "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
TENSOR = "slime.backends.megatron_utils.update_weight.update_weight_from_tensor"
ATTR = "update_weights_from_distributed"
SIGNATURE = ["group_name", "group", "weight_version", "rollout_engines", "converted_named_tensors", "load_format"]
# what the replacement reproduces of slime's function (checked, so a change upstream is noticed)
EXPECTED_SOURCE = ("engine.update_weights_from_distributed.remote(", "names=[name for name, _ in converted_named_tensors]",
                   "dtypes=[param.dtype for _, param in converted_named_tensors]",
                   "shapes=[param.shape for _, param in converted_named_tensors]", "weight_version=str(weight_version)",
                   "dist.broadcast(param.data, 0, group=group, async_op=True)")


def _replacement(original, args: Any = None):
    def update_weights_from_distributed(group_name, group, weight_version, rollout_engines, converted_named_tensors,
                                        load_format=None):
        from slime_ascend.weight_sync.distributed_delta import push_bucket
        from slime_ascend.weight_sync.funnel import distributed_delta_enabled

        return push_bucket(group_name, group, weight_version, rollout_engines, converted_named_tensors, load_format,
                           delta=args is not None and distributed_delta_enabled(args))

    update_weights_from_distributed.__slime_ascend_original__ = original
    return update_weights_from_distributed


class GlooFloat8Broadcast(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[DISTRIBUTED]
        problems = missing_attrs(module, [ATTR, "UpdateWeightFromDistributed"])
        if problems:
            return problems
        fn = getattr(module, ATTR)
        fn = getattr(fn, "__slime_ascend_original__", fn)
        return (param_mismatch(fn, SIGNATURE, f"{ATTR}") + missing_source(fn, EXPECTED_SOURCE, ATTR)
                + missing_source(module.UpdateWeightFromDistributed._update_bucket_weights_from_distributed,
                                 ["refs = update_weights_from_distributed("],
                                 "UpdateWeightFromDistributed._update_bucket_weights_from_distributed"))

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        def replacement(original):
            return _replacement(original, args)

        self.wrap(modules[DISTRIBUTED], ATTR, replacement)
        if getattr(modules[TENSOR], ATTR, None) is not None:
            self.wrap(modules[TENSOR], ATTR, replacement)


PATCH = GlooFloat8Broadcast(
    id="train.gloo_float8_broadcast",
    targets=(f"{DISTRIBUTED}:{ATTR}", f"{TENSOR}:{ATTR}"),
    why="gloo (the cpu plugin's transport) has no float8 type: slime's weight broadcast of an FP8 push fails "
        "with 'Invalid scalar type'.",
    how="slime's update_weights_from_distributed with each tensor broadcast as a uint8 view of its bytes when it "
        "is float8 and the group is gloo (metadata unchanged); the torch engine receives the same way.",
    upstream="patches/0022-gloo-float8-broadcast.patch",
    checked_on=("0.3.1",),
)
