"""The emulated torch_memory_saver NPU build (slime_ascend.npu_emulation.memory_saver): regions paused and resumed
on the emulated device, the C core's rules, the preload hook mode refused as the build documents; and installed only
when asked (the real torch_memory_saver stays otherwise)."""

from __future__ import annotations

from pathlib import Path

from conftest import need
from emulated_process import checks_test, run_python

CHECKS = Path(__file__).with_name("emulated_memory_saver_checks.py")

test_emulated_memory_saver = checks_test(CHECKS)


def test_the_memory_saver_is_emulated_only_when_asked():
    need("torch_memory_saver", "the real one, which must stay where the emulated one is not asked for: bash "
                               "scripts/install-slime-cpu.sh")
    code = ("import slime_ascend.npu_emulation as e\ne.install()\nimport torch_memory_saver as t\n"
            "print(getattr(t, '_SLIME_ASCEND_EMULATED', False))")
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stdout + proc.stderr
    proc = run_python("import torch, torch_memory_saver as t\nprint(t._SLIME_ASCEND_EMULATED)",
                      env={"SLIME_ASCEND_PLUGINS": "npu", "SLIME_ASCEND_EMULATE_NPU": "1",
                           "SLIME_ASCEND_EMULATE_MEMORY_SAVER": "1"})
    assert proc.returncode == 0 and proc.stdout.split() == ["True"], proc.stdout + proc.stderr
