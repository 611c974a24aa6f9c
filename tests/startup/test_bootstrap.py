import json

import pytest
from conftest import run_python

HEAVY = ("torch", "torch_npu", "ray", "megatron", "slime")


def test_inert_by_default_imports_nothing_heavy():
    proc = run_python(
        "import sys, json; import slime_ascend, slime_ascend.hooks, slime_ascend.plugins.registry;"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_interpreter_start_does_not_import_package_when_unset():
    proc = run_python("import sys; print('slime_ascend' in sys.modules)")
    assert proc.stdout.strip() == "False"


def test_active_with_variable_and_still_light():
    proc = run_python(
        "import sys, json; from slime_ascend.startup import bootstrap as b;"
        f"print(json.dumps([sorted(b.started()), [m for m in {HEAVY!r} if m in sys.modules]]))",
        env={"SLIME_ASCEND_PLUGINS": "npu"},
    )
    assert proc.returncode == 0, proc.stderr
    started, heavy = json.loads(proc.stdout)
    assert started == ["npu"]
    assert heavy == []


def test_unknown_plugin_is_reported_not_fatal():
    proc = run_python(
        "from slime_ascend.startup import bootstrap as b; print(type(b.activation_error()).__name__)",
        env={"SLIME_ASCEND_PLUGINS": "no-such-plugin"},
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == "PluginError"
    assert "no-such-plugin" in proc.stderr and "Known plugins" in proc.stderr


def test_activate_is_idempotent_and_thread_safe():
    proc = run_python(
        "import threading; from slime_ascend.startup import bootstrap as b\n"
        "ran = []\n"
        "ts = [threading.Thread(target=lambda: ran.append(b.activate('npu'))) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(sorted(map(tuple, ran)), b.activate('npu'))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(), (), (), (), (), (), (), ('npu',)] []"


def test_reaches_multiprocessing_spawn_children():
    code = (
        "import multiprocessing as mp\n"
        "def child(q):\n"
        "    import sys\n"
        "    q.put(sorted(sys.modules['slime_ascend._bootstrap'].started()) if 'slime_ascend._bootstrap' in sys.modules else None)\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn'); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()\n"
        "    print(q.get(timeout=60)); p.join()\n"
    )
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "spawn_check.py")
        with open(path, "w") as fh:
            fh.write(code)
        env = dict(os.environ, SLIME_ASCEND_PLUGINS="npu")
        proc = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, cwd=tmp, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['npu']"


def test_the_pth_name_is_the_bootstrap():
    proc = run_python(
        "import sys; from slime_ascend import _bootstrap; from slime_ascend.startup import bootstrap\n"
        "print(_bootstrap.started is bootstrap.started, sorted(bootstrap.started()))",
        env={"SLIME_ASCEND_PLUGINS": "npu"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "['npu']"]


def test_pth_is_installed():
    from slime_ascend import doctor

    assert doctor.find_pth(), "slime_ascend_bootstrap.pth is not in site-packages: install the package"


def _fake_plugin_dist(tmp):
    """A directory for PYTHONPATH holding a distribution with entry points of the plugin group:
    ``boom`` (process start raises what BOOM_KIND names) and ``boom-import`` (its module calls
    sys.exit at import)."""
    import os

    dist = os.path.join(tmp, "boomplug-0.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w") as fh:
        fh.write("Metadata-Version: 2.1\nName: boomplug\nVersion: 0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as fh:
        fh.write("[slime_ascend.plugins]\nboom = boomplug:PLUGIN\nboom-import = boomimport:PLUGIN\n")
    with open(os.path.join(tmp, "boomplug.py"), "w") as fh:
        fh.write(
            "import os\n"
            "from slime_ascend.plugins.base import Plugin\n"
            "def die():\n"
            "    kind = os.environ['BOOM_KIND']\n"
            "    if kind == 'exit':\n"
            "        raise SystemExit(3)\n"
            "    if kind == 'interrupt':\n"
            "        raise KeyboardInterrupt\n"
            "    raise RuntimeError('boom')\n"
            "PLUGIN = Plugin(name='boom', description='raises at process start', process_start=('boomplug.die',))\n"
        )
    with open(os.path.join(tmp, "boomimport.py"), "w") as fh:
        fh.write("import sys\nsys.exit(4)\n")
    return tmp


def _pythonpath(path):
    import os

    return os.pathsep.join([path, *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.mark.parametrize("kind,exc", [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt"), ("error", "RuntimeError")])
def test_plugin_raising_base_exception_at_process_start_does_not_end_the_interpreter(tmp_path, kind, exc):
    path = _fake_plugin_dist(str(tmp_path))
    env = {"SLIME_ASCEND_PLUGINS": "boom", "PYTHONPATH": _pythonpath(path), "BOOM_KIND": kind}
    proc = run_python(
        "import sys; from slime_ascend import hooks; from slime_ascend.startup import bootstrap as b\n"
        "print('alive', type(b.activation_error()).__name__)\n"
        "try:\n"
        "    hooks.megatron_init(type('A', (), {})())\n"
        "except BaseException as e:\n"
        "    print(type(e).__name__, '|', e)\n",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert first == f"alive {exc}"
    assert second.startswith("PluginError |") and exc in second, second  # kept, re-raised at first use
    assert f"activation of SLIME_ASCEND_PLUGINS='boom' failed: {exc}" in proc.stderr


def test_plugin_module_calling_sys_exit_at_import_is_reported_broken(tmp_path):
    path = _fake_plugin_dist(str(tmp_path))
    env = {"SLIME_ASCEND_PLUGINS": "boom-import", "PYTHONPATH": _pythonpath(path)}
    proc = run_python("from slime_ascend.startup import bootstrap as b; print('alive', type(b.activation_error()).__name__)",
                      env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "alive PluginError"
    assert "'boom-import'" in proc.stderr and "installed but broken" in proc.stderr and "SystemExit: 4" in proc.stderr
