"""slime's GLM-5 spec gets device-neutral ops in place of its tilelang kernel modules where CUDA is absent.

``slime_plugins/models/glm5/ops/indexer.py`` and ``sparse_mla.py`` import ``indexer_fwd_interface``,
``indexer_bwd_interface``, ``sparse_mla_fwd_interface`` and ``sparse_mla_bwd`` from four ``tilelang_*`` modules
at import time; each starts with ``import tilelang`` (CUDA only), so on an Ascend or CPU host importing slime's
spec stops there, whatever else is in place.

When ``slime_plugins.models`` is imported (before any glm5 module) this patch puts four modules with those names
and functions in ``sys.modules``: the ops :func:`slime_ascend.glm5.kernels.kernel_functions` selects for the
device (torch ops on ``cpu``; on ``npu`` torch_npu's fused sparse attention where it fits). slime's wrappers
(``IndexerFunction``, ``SparseMLA``, the ``-1`` padding, ``dsa-determinism``'s top-k) run unchanged over them.
Declared by the ``cpu`` and ``npu`` plugins with the condition "not CUDA"; on CUDA slime's kernels stay.

Target check: slime's two wrapper files (read as text: they cannot be imported before this patch) import from
the tilelang modules only the names provided, and no real tilelang module is imported yet.

Upstream: patches/0021-glm5-spec-device-backends.patch (the spec takes its kernels from a backend chosen per
device).
"""

from __future__ import annotations

import ast
import sys
import types
from types import ModuleType
from typing import Any

from ..._import_hooks import module_file
from ..base import RuntimePatch

OPS = "slime_plugins.models.glm5.ops"
WRAPPERS = ("indexer", "sparse_mla")
MARK = "__slime_ascend_patch__"


def _kernel_modules() -> dict[str, tuple[str, ...]]:
    from slime_ascend.glm5.kernels import KERNEL_MODULES

    return KERNEL_MODULES


def imported_kernel_names(source: str) -> dict[str, set[str]]:
    """tilelang module -> the names a wrapper's source imports from it (``from .tilelang_x import a, b``)."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").startswith("tilelang_"):
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return found


class GLM5Kernels(RuntimePatch):
    def load_targets(self) -> dict[str, ModuleType]:
        return {}  # the targets are what this patch provides; importing them here would import tilelang

    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems = []
        provided = _kernel_modules()
        for wrapper in WRAPPERS:
            path = module_file(f"{OPS}.{wrapper}")
            if path is None:
                problems.append(f"{OPS}.{wrapper} is not found in slime")
                continue
            for module, names in imported_kernel_names(path.read_text(errors="replace")).items():
                missing = sorted(names - set(provided.get(module, ())))
                if missing:
                    problems.append(f"{OPS}.{wrapper} imports {missing} from {module}, which the stand-ins lack")
        for module in provided:
            existing = sys.modules.get(f"{OPS}.{module}")
            if existing is not None and getattr(existing, MARK, None) != self.id:
                problems.append(f"{OPS}.{module} is already imported (slime's kernel): the stand-ins would come late")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        from slime_ascend.glm5.kernels import device_kind, kernel_functions

        device = device_kind()
        for module, functions in kernel_functions(device).items():
            name = f"{OPS}.{module}"
            stand_in = types.ModuleType(name, f"slime-ascend's {device} stand-in for slime's {module} "
                                              "(runtime patch train.glm5_kernels)")
            for attr, fn in functions.items():
                setattr(stand_in, attr, fn)
            setattr(stand_in, MARK, self.id)
            sys.modules[name] = stand_in

    def _stand_ins(self) -> list[str]:
        return [f"{OPS}.{m}" for m in _kernel_modules() if getattr(sys.modules.get(f"{OPS}.{m}"), MARK, None) == self.id]

    @property
    def applied(self) -> bool:
        return bool(self._stand_ins())

    def remove(self) -> None:
        for name in self._stand_ins():
            del sys.modules[name]


PATCH = GLM5Kernels(
    id="train.glm5_kernels",
    targets=tuple(f"{OPS}.tilelang_{n}" for n in ("indexer_fwd", "indexer_bwd", "sparse_mla_fwd", "sparse_mla_bwd")),
    why="slime's GLM-5 spec imports tilelang kernel modules (CUDA only) for the DSA indexer and sparse MLA, "
        "forward and backward: without CUDA the spec cannot even be imported.",
    how="When slime_plugins.models is imported, put modules of the four tilelang names in sys.modules, with the "
        "same function names and signatures: the torch ops of slime_ascend.glm5.ops (cpu), or torch_npu's fused "
        "sparse attention where it fits (npu); only where CUDA is absent.",
    upstream="patches/0021-glm5-spec-device-backends.patch",
    checked_on=("0.3.1",),
)
