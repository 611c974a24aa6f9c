"""slime's default ``generate`` sends each request to an engine with a free slot, not to the router."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

ROLLOUT = "slime.rollout.sglang_rollout"


def _wrap_generate(original):
    @functools.wraps(original)
    async def generate(args, sample, sampling_params):
        from ...cosched.hooks import generate as dispatched

        return await dispatched(original, args, sample, sampling_params)

    return generate


class CoschedGenerate(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[ROLLOUT]
        problems = missing_attrs(module, ["generate", "generate_and_rm"])
        if problems:
            return problems
        problems += param_mismatch(module.generate, ["args", "sample", "sampling_params"], "sglang_rollout.generate")
        # the URL comes from these two fields only, so a copy of args with an engine's address reaches that engine
        problems += missing_source(module.generate,
                                   ['url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"'],
                                   "sglang_rollout.generate")
        # generate_and_rm reaches generate through the module's globals, so wrapping the module attribute is enough
        problems += missing_source(module.generate_and_rm, ["await generate(args, sample, sampling_params"],
                                   "sglang_rollout.generate_and_rm")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[ROLLOUT], "generate", _wrap_generate)


PATCH = CoschedGenerate(
    id="rollout.cosched_generate",
    targets=(f"{ROLLOUT}:generate",),
    why="slime posts every request to the router, which places it at once (round robin, cache-aware or consistent "
        "hashing) whatever each engine still has queued; co-scheduling needs the placement made when an engine has "
        "a free slot, in the rollout process, which slime has no hook for (--custom-generate-function-path replaces "
        "the whole generate, and compaction owns it).",
    how="sglang_rollout.generate is wrapped: it takes a slot of slime_ascend.cosched's dispatcher (the engines are "
        "the router's /workers) and runs slime's own generate on a copy of args whose router address is that "
        "engine's; the slot is released when the request returns or fails.",
    upstream="patches/0030-rollout-dispatch-hook.patch",
    checked_on=("0.3.1",),
)
