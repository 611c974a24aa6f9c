"""slime's GLM-5 attention finds apex's fused THD RoPE where apex is not installed.

``DSAMLASelfAttention.get_absorb_query_key_value_tensors`` (``slime_plugins/models/glm5/glm5.py``) imports
``fused_apply_rotary_pos_emb_thd`` from ``apex.transformer.functional`` at every call (inside its ``fuse_rope``),
for the MLA queries and keys and the indexer's; apex is a CUDA build, absent on Ascend and on the host.

The patch wraps that method: while it runs, and only when apex cannot be found, ``sys.modules`` holds
``apex``, ``apex.transformer`` and ``apex.transformer.functional`` with
:func:`slime_ascend.glm5.ops.fused_apply_rotary_pos_emb_thd` (apex's signature and semantics, torch autograd for
the backward); they are taken out again when it returns, so nothing else in the process sees an apex. Where apex
is installed the method runs as it is. Only where CUDA is absent.

Upstream: patches/0021-glm5-spec-device-backends.patch (the RoPE from the device backend).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

GLM5 = "slime_plugins.models.glm5.glm5"
METHOD = "get_absorb_query_key_value_tensors"
IMPORT = "from apex.transformer.functional import fused_apply_rotary_pos_emb_thd"
APEX = ("apex", "apex.transformer", "apex.transformer.functional")


@contextlib.contextmanager
def host_apex_rope():
    """``apex.transformer.functional.fused_apply_rotary_pos_emb_thd`` importable for the block, if apex is absent."""
    from slime_ascend.host import module_installed

    if "apex" in sys.modules or module_installed("apex"):
        yield
        return
    from slime_ascend.glm5.ops import fused_apply_rotary_pos_emb_thd

    stand_ins = {name: types.ModuleType(name, "slime-ascend's stand-in for apex's THD RoPE (train.glm5_thd_rope)")
                 for name in APEX}
    stand_ins["apex"].transformer = stand_ins["apex.transformer"]
    stand_ins["apex.transformer"].functional = stand_ins["apex.transformer.functional"]
    stand_ins["apex.transformer.functional"].fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


def _with_host_rope(original):
    @functools.wraps(original)
    def get_absorb_query_key_value_tensors(self, *args, **kwargs):
        with host_apex_rope():
            return original(self, *args, **kwargs)

    return get_absorb_query_key_value_tensors


class GLM5ThdRope(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        mod = modules[GLM5]
        problems = missing_attrs(mod, [f"DSAMLASelfAttention.{METHOD}"])
        if problems:
            return problems
        return missing_source(getattr(mod.DSAMLASelfAttention, METHOD), [IMPORT, "fused_apply_rotary_pos_emb_thd(t,"],
                              f"DSAMLASelfAttention.{METHOD}")

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[GLM5].DSAMLASelfAttention, METHOD, _with_host_rope)


PATCH = GLM5ThdRope(
    id="train.glm5_thd_rope",
    targets=(f"{GLM5}:DSAMLASelfAttention.{METHOD}",),
    why="slime's GLM-5 attention imports apex's fused THD RoPE at each call; apex is CUDA-only.",
    how="Wrap get_absorb_query_key_value_tensors: while it runs, and only if apex is absent, sys.modules holds "
        "apex.transformer.functional with the torch THD RoPE of slime_ascend.glm5.ops; removed when it returns.",
    upstream="patches/0021-glm5-spec-device-backends.patch",
    checked_on=("0.3.1",),
)
