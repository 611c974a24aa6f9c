"""The emulated ``npu`` device (slime_ascend.npu_emulation.device): factories, host copies, an MLP trained with
AdamW entirely on ``npu`` (and equal to the same steps on the host), mixed-device refusals, printing and
serialization, views and in-place operators, memory figures, the device generator, autocast and pinned memory.
Each check runs in one subprocess with the emulation installed (emulated_device_checks.py)."""

from __future__ import annotations

from pathlib import Path

from emulated_process import checks_test

CHECKS = Path(__file__).with_name("emulated_device_checks.py")

test_emulated_device = checks_test(CHECKS)
