import json

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
        "import sys, json; from slime_ascend import _bootstrap as b;"
        f"print(json.dumps([sorted(b.started()), [m for m in {HEAVY!r} if m in sys.modules]]))",
        env={"SLIME_ASCEND_PLUGINS": "npu"},
    )
    assert proc.returncode == 0, proc.stderr
    started, heavy = json.loads(proc.stdout)
    assert started == ["npu"]
    assert heavy == []


def test_unknown_plugin_is_reported_not_fatal():
    proc = run_python(
        "from slime_ascend import _bootstrap as b; print(type(b.activation_error()).__name__)",
        env={"SLIME_ASCEND_PLUGINS": "no-such-plugin"},
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == "PluginError"
    assert "no-such-plugin" in proc.stderr and "Known plugins" in proc.stderr


def test_activate_is_idempotent_and_thread_safe():
    proc = run_python(
        "import threading; from slime_ascend import _bootstrap as b\n"
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


def test_pth_is_installed():
    from slime_ascend import doctor

    assert doctor.find_pth(), "slime_ascend_bootstrap.pth is not in site-packages: install the package"
