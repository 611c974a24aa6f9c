"""Checks of the emulated torch_memory_saver NPU build, run in a subprocess with ``install(memory_saver=True)``
(test_emulated_memory_saver.py runs them)."""

import os
import threading

import pytest
import torch

import torch_memory_saver
from torch_memory_saver import torch_memory_saver as tms

MEMORY_SAVER = True


def in_new_thread(fn):
    """The C core's configuration is per thread and read from the environment at first use: a fresh thread."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def check_it_is_the_npu_build_without_get_cpu_backup():
    assert torch_memory_saver._SLIME_ASCEND_EMULATED and torch_memory_saver.__version__.startswith("0.0.8")
    assert not hasattr(tms, "get_cpu_backup") and tms.enabled


def check_pause_releases_region_memory_and_resume_restores_backed_up_content():
    with tms.region(tag="kv"):
        kv = torch.full((1000,), 7.0, device="npu")
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = torch.full((500,), 3.0, device="npu")
    outside = torch.ones(250, device="npu")
    before = torch.npu.memory_allocated()
    tms.pause("kv")
    assert torch.npu.memory_allocated() == before - 4000
    tms.pause("weights")
    assert torch.npu.memory_allocated() == before - 6000  # what was allocated outside a region stays
    with pytest.raises(RuntimeError, match=r"torch_memory_saver\.pause"):
        kv + 1
    tms.resume()
    assert torch.npu.memory_allocated() == before
    assert torch.equal(weights.cpu(), torch.full((500,), 3.0))  # enable_cpu_backup: content kept
    assert torch.isnan(kv.cpu()).all()  # no backup: the device's content is not kept
    assert outside.sum().item() == 250.0
    tms.pause()
    with pytest.raises(RuntimeError, match=r"^aclrtUnmapMem failed\.$"):
        tms.pause("kv")
    tms.resume()


def check_regions_do_not_nest_and_disable_needs_an_active_state():
    with pytest.raises(AssertionError):
        with tms.region():
            with tms.region():
                pass

    def disable_without_init_enable():
        with tms.disable():
            pass

    with pytest.raises(RuntimeError, match=r"^disable\(\) should be called only when tms is active$"):
        in_new_thread(disable_without_init_enable)
    os.environ["TMS_INIT_ENABLE"] = "1"

    def disable_with_init_enable():
        with tms.disable():
            return torch.ones(8, device="npu").sum().item()

    try:
        assert in_new_thread(disable_with_init_enable) == 8.0
    finally:
        del os.environ["TMS_INIT_ENABLE"]


def check_the_preload_hook_mode_is_refused_as_documented():
    asked = torch_memory_saver.TorchMemorySaver()
    asked.hook_mode = "preload"
    for saver, setup in ((asked, {}), (torch_memory_saver.TorchMemorySaver(), {"TMS_HOOK_MODE": "preload"}),
                         (torch_memory_saver.TorchMemorySaver(),
                          {"LD_PRELOAD": "/site-packages/torch_memory_saver_hook_mode_preload.abi3.so"})):
        os.environ.update(setup)
        try:
            with pytest.raises(RuntimeError, match="preload hook mode is unsupported on NPU") as refused:
                saver.pause()
        finally:
            for key in setup:
                del os.environ[key]
        message = str(refused.value)
        assert type(refused.value).__name__ == "PreloadUnsupported" and "\n" not in message
        assert "aclrtMallocAlign32" in message, message
    with torch_memory_saver.configure_subprocess():
        assert "torch_memory_saver" not in os.environ.get("LD_PRELOAD", "")
