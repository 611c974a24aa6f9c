"""Our GLM-5 ops keep the interfaces of slime's CUDA-only modules: read slime's source (ast) and compare.

A drift in slime (a renamed function, a new or reordered argument, a changed default, a new name its
wrappers import from a tilelang module) fails here, before a patch substitutes our ops for the old names.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from conftest import slime_src
from slime_ascend.glm5.ops import SLIME_COUNTERPARTS

pytestmark = pytest.mark.slime

_NO_DEFAULT = object()


def _tree(module: str) -> ast.Module:
    root = slime_src()
    assert root is not None, "slime's source tree is not on PYTHONPATH"
    path = Path(root, *module.split(".")).with_suffix(".py")
    assert path.is_file(), f"{path} is gone from slime: the counterpart table needs updating"
    return ast.parse(path.read_text(), str(path))


def _definition(tree: ast.Module, name: str) -> ast.FunctionDef | ast.ClassDef:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    raise AssertionError(f"slime no longer defines {name}")


def _slime_params(fn: ast.FunctionDef) -> tuple[list[tuple[str, object]], list[str]]:
    """(positional (name, default) pairs, keyword-only names) of a function in slime's source."""
    positional = fn.args.posonlyargs + fn.args.args
    defaults = [_NO_DEFAULT] * (len(positional) - len(fn.args.defaults)) + [ast.literal_eval(d) for d in fn.args.defaults]
    return [(a.arg, d) for a, d in zip(positional, defaults)], [a.arg for a in fn.args.kwonlyargs]


def _assert_compatible(where: str, fn: ast.FunctionDef, ours) -> None:
    """Ours takes slime's arguments in slime's order with slime's defaults; anything extra has a default."""
    theirs, kwonly = _slime_params(fn)
    params = [p for p in inspect.signature(ours).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [p.name for p in params]
    assert names[: len(theirs)] == [n for n, _ in theirs], f"{where}: slime has {theirs}, ours {names}"
    for (name, default), p in zip(theirs, params):
        ours_default = _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default
        assert ours_default == default, f"{where}: default of {name} is {default!r} in slime, {ours_default!r} here"
    extra = params[len(theirs):]
    assert all(p.default is not inspect.Parameter.empty for p in extra), f"{where}: extra arguments need defaults"
    assert set(kwonly) <= set(names), f"{where}: slime's keyword-only {kwonly} missing here"


@pytest.mark.parametrize("target", [t for t in SLIME_COUNTERPARTS if t.startswith("slime_plugins.")])
def test_signature_matches_slimes_source(target):
    module, name = target.split(":")
    node, ours = _definition(_tree(module), name), SLIME_COUNTERPARTS[target]
    if isinstance(node, ast.FunctionDef):
        _assert_compatible(target, node, ours)
        return
    methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
    for method in ("forward", "backward"):
        _assert_compatible(f"{target}.{method}", methods[method], getattr(ours, method))


def test_slimes_wrappers_import_only_names_we_provide():
    """The names slime's indexer.py / sparse_mla.py take from the tilelang modules all have a counterpart."""
    provided = {tuple(t.split(":")) for t in SLIME_COUNTERPARTS}
    package = "slime_plugins.models.glm5.ops"
    seen = set()
    for wrapper in ("indexer", "sparse_mla"):
        for node in ast.walk(_tree(f"{package}.{wrapper}")):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module.startswith("tilelang_"):
                for alias in node.names:
                    seen.add((f"{package}.{node.module}", alias.name))
    assert seen and seen <= provided, f"slime imports {sorted(seen - provided)} from tilelang modules too"


def test_the_spec_imports_from_the_ops_only_names_we_provide_or_know():
    """glm5.py's imports from its ops: all ours except the SGLang FlashMLA path (sgl_kernel, CUDA, opt-in
    through MEGATRON_USE_SGLANG_SPARSE_MLA=1)."""
    provided = {tuple(t.split(":")) for t in SLIME_COUNTERPARTS}
    imported = set()
    for node in ast.walk(_tree("slime_plugins.models.glm5.glm5")):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").startswith("ops."):
            imported |= {(f"slime_plugins.models.glm5.{node.module}", a.name) for a in node.names}
    assert imported - provided == {("slime_plugins.models.glm5.ops.sparse_mla", "SGLangSparseMLA")}


def test_the_spec_calls_apex_thd_rope_with_apexs_three_arguments():
    ours = list(inspect.signature(SLIME_COUNTERPARTS["apex.transformer.functional:fused_apply_rotary_pos_emb_thd"]).parameters)
    assert ours[:3] == ["t", "cu_seqlens", "freqs"]  # apex/transformer/functional/fused_rope.py
    tree = _tree("slime_plugins.models.glm5.glm5")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "apex.transformer.functional"]
    assert any(a.name == "fused_apply_rotary_pos_emb_thd" for n in imports for a in n.names)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "fused_apply_rotary_pos_emb_thd"]
    assert calls and all(len(c.args) <= 3 and not c.keywords for c in calls)
