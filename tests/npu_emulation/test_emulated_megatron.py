"""Megatron-core's GPT model, DDP and distributed optimizer on the emulated device through ``transfer_to_npu``
(emulated_megatron_checks.py, in one subprocess): where Megatron needs MindSpeed on Ascend, and a bf16 training step
whose parameters, gradients and optimizer state all stay on ``npu`` once MindSpeed's two adaptations are applied."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from conftest import skip_outside_ci
from emulated_process import checks_test

CHECKS = Path(__file__).with_name("emulated_megatron_checks.py")


def megatron_installed() -> None:
    if importlib.util.find_spec("megatron") is None:  # not imported here: the subprocess imports it
        skip_outside_ci("megatron-core is not installed")


test_emulated_megatron = checks_test(CHECKS, env={"ASCEND_RT_VISIBLE_DEVICES": "0"}, before=megatron_installed)
