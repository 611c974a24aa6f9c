"""No TorchScript / torch.compile fusion on Ascend.

Megatron decorates activations, fusions and MoE routing with ``jit_fuser`` and slime compiles
``compute_approx_kl``, ``compute_policy_loss`` and ``compute_cispo_loss`` (the fork's megatron.patch deletes 43
``@jit_fuser`` lines by hand). ``megatron.core.jit`` is patched as it is imported, before any module decorates
with it, and ``enable_jit_fuser`` becomes ``disable_jit_fuser``; modules that import slime's compiled functions
by name import them after ``slime.utils.ppo_utils`` is patched.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs

COMPILED = ("compute_approx_kl", "compute_policy_loss", "compute_cispo_loss")


def _eager(fn: Any) -> Any:
    return getattr(fn, "_torchdynamo_orig_callable", fn)


class DisableTorchCompile(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        jit = modules.get("megatron.core.jit")
        if jit is not None:
            problems += missing_attrs(jit, ["jit_fuser", "noop_decorator", "enable_jit_fuser", "disable_jit_fuser"])
        ppo = modules.get("slime.utils.ppo_utils")
        if ppo is not None:
            problems += missing_attrs(ppo, COMPILED)
            problems += [
                f"slime.utils.ppo_utils.{n} is no longer a torch.compile wrapper"
                for n in COMPILED
                if hasattr(ppo, n) and not hasattr(getattr(ppo, n), "_torchdynamo_orig_callable")
            ]
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        jit = modules.get("megatron.core.jit")
        if jit is not None:
            self.replace(jit, "jit_fuser", jit.noop_decorator)
            self.replace(jit, "enable_jit_fuser", jit.disable_jit_fuser)
        ppo = modules.get("slime.utils.ppo_utils")
        if ppo is not None:
            for name in COMPILED:
                self.wrap(ppo, name, _eager)


PATCH = DisableTorchCompile(
    id="train.disable_torch_compile",
    targets=("megatron.core.jit:jit_fuser", "megatron.core.jit:enable_jit_fuser")
    + tuple(f"slime.utils.ppo_utils:{n}" for n in COMPILED),
    why="TorchScript and torch.compile fusion do not run on Ascend NPUs.",
    how="jit_fuser -> Megatron's noop_decorator at import of megatron.core.jit; slime's compiled loss helpers -> "
    "their eager functions at import of slime.utils.ppo_utils.",
    upstream="patches/0006-accelerator-supports-torch-compile.patch",
    checked_on=("0.3.1",),
)
