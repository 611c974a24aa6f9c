import sys
import textwrap

from slime_ascend import _import_hooks


def _write(tmp_path, name, body):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))


def test_after_and_before_callbacks(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write(tmp_path, "ih_target", "VALUE = 1\n")
    order = []
    assert _import_hooks.before_import("ih_target", lambda: order.append("before"))
    _import_hooks.when_imported("ih_target", lambda m: order.append(("after", m.VALUE)))
    import ih_target  # noqa: F401

    assert order == ["before", ("after", 1)]
    # already imported: runs at once; before_import is too late
    _import_hooks.when_imported("ih_target", lambda m: order.append("now"))
    assert order[-1] == "now"
    assert not _import_hooks.before_import("ih_target", lambda: None)
    sys.modules.pop("ih_target", None)


def test_before_callback_that_imports_the_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write(tmp_path, "ih_core", "import builtins\nbuiltins.ih_core_execs = getattr(builtins, 'ih_core_execs', 0) + 1\n")
    _write(tmp_path, "ih_adaptor", "import ih_core\nPATCHED = True\n")
    seen = []
    _import_hooks.before_import("ih_core", lambda: __import__("ih_adaptor"))
    _import_hooks.when_imported("ih_core", lambda m: seen.append(m.__name__))
    import builtins

    import ih_core  # noqa: F401

    assert builtins.ih_core_execs == 1, "the module must execute once"
    assert "ih_adaptor" in sys.modules and seen == ["ih_core"]
    for n in ("ih_core", "ih_adaptor"):
        sys.modules.pop(n, None)
    del builtins.ih_core_execs


def test_before_and_after_callbacks_of_a_namespace_package(tmp_path, monkeypatch):
    """megatron-core's ``megatron`` has no __init__.py: its before-import callbacks (MindSpeed's adaptor,
    torch_npu's transfer_to_npu) used to never run, since a namespace package has no loader to wrap."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "ih_namespace").mkdir()
    _write(tmp_path / "ih_namespace", "core", "VALUE = 2\n")
    order = []
    assert _import_hooks.before_import("ih_namespace", lambda: order.append("before"))
    _import_hooks.when_imported("ih_namespace", lambda m: order.append(("after", list(m.__path__))))
    import ih_namespace.core

    assert order == ["before", ("after", [str(tmp_path / "ih_namespace")])]
    assert ih_namespace.core.VALUE == 2 and sys.modules["ih_namespace"].core is ih_namespace.core
    for n in ("ih_namespace.core", "ih_namespace"):
        sys.modules.pop(n, None)
