"""Runtime patches of slime and the libraries it runs (Megatron, SGLang, MindSpeed, torch, Ray) live in
``slime_ascend/patch/``, where each has a ledger entry and a target check; nothing else in the package sets or
deletes attributes on their objects.

Read statically (``ast``) in every file outside ``patch/``, a patch is a ``setattr``/``delattr`` call, an attribute
assignment (``x.attr = ...``, ``x.attr += ...``) or an attribute ``del`` whose object is

- a name bound by importing one of those packages (``import megatron.core as mc``, ``from slime.utils import
  arguments``), or an attribute chain from it (``mc.jit.jit_fuser``);
- a module looked up at run time (``importlib.import_module(...)``, ``__import__(...)``, ``sys.modules[...]``);
- in a file that registers import callbacks (``when_imported`` / ``before_import``), a function parameter: what
  such a callback receives is the module just imported.

Setting values on data (slime's ``args``, a ``Sample``, a Megatron spec built for this call) is not a patch.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slime_ascend"
UPSTREAM = ("slime", "slime_plugins", "megatron", "sglang", "mindspeed", "torch", "torch_npu", "ray", "transformers")
CALLBACK_REGISTRARS = ("when_imported", "before_import")


def _upstream_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UPSTREAM:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in UPSTREAM:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _is_runtime_lookup(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        return name in ("import_module", "__import__")
    return isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules"


def patches_outside_the_ledger(source: str, filename: str = "<source>") -> list[str]:
    """``line: code`` of every attribute change on an upstream object in ``source`` (rules in the module doc)."""
    tree = ast.parse(source, filename)
    upstream = _upstream_names(tree)
    registers = any(isinstance(n, ast.Attribute) and n.attr in CALLBACK_REGISTRARS or
                    isinstance(n, ast.Name) and n.id in CALLBACK_REGISTRARS for n in ast.walk(tree))
    params: set[str] = set()
    if registers:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                params.update(a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs)
    found = []

    def check(obj: ast.expr, node: ast.AST) -> None:
        root = _root(obj)
        if _is_runtime_lookup(obj) or _is_runtime_lookup(root) or (
                isinstance(root, ast.Name) and (root.id in upstream or root.id in params)):
            found.append((node.lineno, f"{node.lineno}: {ast.unparse(node).splitlines()[0]}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr") and node.args:
            check(node.args[0], node)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute):
                        check(t.value, node)
    return [text for _, text in sorted(found)]


# -- the detector itself, on hand-written code -------------------------------------------------------------
def test_finds_each_kind_of_patch():
    source = (
        "import importlib, sys\n"
        "import megatron.core as mc\n"
        "from slime.utils import arguments\n"
        "from slime_ascend import _import_hooks\n"
        "mc.jit.jit_fuser = None\n"
        "setattr(arguments, 'parse_args', None)\n"
        "arguments.x += 1\n"
        "del arguments.y\n"
        "importlib.import_module('slime.ray.rollout').ray = None\n"
        "sys.modules['slime.utils'].z = 1\n"
        "def _wrap(owner, name):\n"
        "    setattr(owner, name, None)\n"
        "_import_hooks.when_imported('slime.ray.train_actor', lambda m: _wrap(m.TrainRayActor, 'init'))\n"
    )
    assert [line.split(":")[0] for line in patches_outside_the_ledger(source)] == [
        "5", "6", "7", "8", "9", "10", "12"]


def test_leaves_data_alone():
    source = (
        "import torch\n"
        "def megatron_init(args, settings):\n"
        "    setattr(args, 'critic_train_iters', 2)\n"
        "    args.kl_coef = 0.0\n"
        "    weight = torch.nn.Parameter(torch.empty(2))\n"
        "    setattr(weight, 'tensor_model_parallel', True)\n"
        "    weight.partition_dim = 0\n"
    )
    assert patches_outside_the_ledger(source) == []


# -- the package ---------------------------------------------------------------------------------------------
#: file -> the statements (as unparsed) that look like a patch but are not, and why
NOT_PATCHES = {
    "demo/slime_train_api.py": {
        # where slime / Megatron do not import, the demo registers stand-in modules of its own under their names
        # and links each to its stand-in parent package; no module of slime or Megatron is changed
        "sys.modules['slime.backends.megatron_utils'].loss = loss",
        "sys.modules['megatron.core'].mpu = mpu",
    },
}


# the emulated Ascend device is a test double of torch_npu, and stands in for what torch_npu itself does to torch
# (the PrivateUse1 backend, torch.npu, transfer_to_npu's redirection of torch.cuda): it installs only when asked
# (SLIME_ASCEND_EMULATE_NPU=1, or install()), never where a real torch_npu is importable, and no production path of
# the package imports it otherwise (tests/npu_emulation/test_emulated_torch_npu.py)
TEST_DOUBLE = "npu_emulation/"


def test_no_runtime_patch_outside_the_patch_package():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("patch/", TEST_DOUBLE)):
            continue
        hits = patches_outside_the_ledger(path.read_text(), str(path))
        offenders += [f"slime_ascend/{rel}:{hit}" for hit in hits
                      if hit.partition(": ")[2] not in NOT_PATCHES.get(rel, ())]
    assert not offenders, ("attributes of slime / Megatron / their libraries changed outside slime_ascend/patch/: "
                           "make each a ledger patch there (RuntimePatch, with its target check):\n"
                           + "\n".join(offenders))
