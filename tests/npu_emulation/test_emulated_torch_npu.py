"""The emulated torch_npu (slime_ascend.npu_emulation): the package and ``torch.npu`` API in a subprocess with the
emulation installed (emulated_torch_npu_checks.py), and, each in its own interpreter, that nothing is installed
unless asked, that the bootstrap arms it from ``SLIME_ASCEND_EMULATE_NPU``, and that it refuses to shadow a real
torch_npu."""

from __future__ import annotations

from pathlib import Path

import pytest

from emulated_process import checks_test, run_python

CHECKS = Path(__file__).with_name("emulated_torch_npu_checks.py")

test_emulated_torch_npu = checks_test(CHECKS, env={"ASCEND_RT_VISIBLE_DEVICES": "4,5,6"})


def test_nothing_is_installed_unless_asked():
    code = ("import importlib.util, sys, slime_ascend, slime_ascend.npu_emulation as e, torch\n"
            "from slime_ascend import host\n"
            "print(e.installed(), getattr(torch, 'npu', None), 'torch_npu' in sys.modules,"
            " importlib.util.find_spec('torch_npu'), host.torch_npu_installed())\n")
    for env in ({}, {"SLIME_ASCEND_PLUGINS": "npu"}, {"SLIME_ASCEND_PLUGINS": "npu", "SLIME_ASCEND_EMULATE_NPU": "0"}):
        proc = run_python(code, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["False", "None", "False", "None", "False"], (env, proc.stdout, proc.stderr)


def test_the_bootstrap_arms_the_emulation_before_torch_is_imported():
    code = ("import sys\n"
            "from slime_ascend import host\n"
            "print('torch' in sys.modules, host.torch_npu_installed())\n"
            "import torch\n"
            "print(torch.npu.device_count(), torch.empty(1, device='npu').device, sys.modules['torch_npu'].__version__)\n")
    proc = run_python(code, env={"SLIME_ASCEND_PLUGINS": "npu", "SLIME_ASCEND_EMULATE_NPU": "1",
                                 "SLIME_ASCEND_EMULATED_NPUS": "2"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "2", "npu:0", "2.14.0+emulated"], proc.stdout + proc.stderr


def test_import_torch_npu_first_installs_it():
    proc = run_python("import torch_npu, torch\nprint(torch_npu._SLIME_ASCEND_EMULATED, torch.npu.is_available())",
                      env={"SLIME_ASCEND_PLUGINS": "npu", "SLIME_ASCEND_EMULATE_NPU": "yes"})
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stdout + proc.stderr


@pytest.fixture
def real_torch_npu(tmp_path):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    return tmp_path


def test_install_refuses_where_a_real_torch_npu_is_importable(real_torch_npu):
    proc = run_python("import slime_ascend.npu_emulation as e\ne.install()",
                      env={"PYTHONPATH": f"{Path(__file__).resolve().parents[2]}:{real_torch_npu}"})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("slime_ascend.npu_emulation.EmulationRefused: the npu emulation refuses to run: a real "
                           "torch_npu is importable (") and str(real_torch_npu) in last and "Fix: unset" in last


def test_the_bootstrap_refuses_in_one_line_and_leaves_the_real_torch_npu(real_torch_npu):
    code = ("import torch_npu, torch\n"
            "from slime_ascend.startup import bootstrap\n"
            "print(getattr(torch_npu, 'REAL', False), getattr(torch, 'npu', None), type(bootstrap.activation_error()).__name__)")
    proc = run_python(code, env={"SLIME_ASCEND_PLUGINS": "npu", "SLIME_ASCEND_EMULATE_NPU": "1",
                                 "PYTHONPATH": f"{Path(__file__).resolve().parents[2]}:{real_torch_npu}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "None", "EmulationRefused"], proc.stdout + proc.stderr
    refusals = [line for line in proc.stderr.splitlines() if "refuses to run" in line]
    assert len(refusals) == 1 and refusals[0].startswith("slime-ascend: activation of SLIME_ASCEND_PLUGINS='npu' "
                                                         "failed: EmulationRefused: the npu emulation refuses")


def test_a_bad_switch_value_is_refused_in_one_line():
    from slime_ascend.npu_emulation import EmulationRefused, enabled_in

    assert enabled_in({"SLIME_ASCEND_EMULATE_NPU": "1"}) and not enabled_in({})
    with pytest.raises(EmulationRefused, match=r"SLIME_ASCEND_EMULATE_NPU='maybe': use 1"):
        enabled_in({"SLIME_ASCEND_EMULATE_NPU": "maybe"})
