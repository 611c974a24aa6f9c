"""``slime-ascend doctor``'s Ascend environment lines: what a job started from this shell would inherit."""

from __future__ import annotations

from slime_ascend import doctor


def test_allocator_clash_and_ray_npu_count(tmp_path):
    assert doctor.ascend_environment({"PYTORCH_NPU_ALLOC_CONF": "x"}, str(tmp_path)) == []
    for i in range(16):
        (tmp_path / f"davinci{i}").touch()
    lines = doctor.ascend_environment({"PYTORCH_NPU_ALLOC_CONF": "x", "PYTORCH_ALLOC_CONF": ""}, str(tmp_path))
    assert [(l.topic, l.status) for l in lines] == [("allocator variables", "fail"), ("ray NPU count", "fail")]
    assert "Fix: unset PYTORCH_ALLOC_CONF" in lines[0].detail and "10 of the 16 found" in lines[1].detail
    assert "\n" not in doctor.format_lines(lines).split("\n")[0]


def _hide(monkeypatch, *packages):
    """Make ``packages`` absent in this process, as on a fresh host: ``sys.modules[name] = None`` is what both
    ``import`` and ``importlib.util.find_spec`` read as "not installed"; their loaded submodules go too."""
    import sys

    for name in list(sys.modules):
        if name.split(".", 1)[0] in packages:
            monkeypatch.delitem(sys.modules, name)
    for name in packages:
        monkeypatch.setitem(sys.modules, name, None)


def test_a_host_without_slime_says_what_it_cannot_check_and_exits_0(monkeypatch, capsys):
    from slime_ascend import cli, patch

    _hide(monkeypatch, "slime", "slime_plugins", "torch_npu", "mindspeed")
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "SLIME_ASCEND_PLUGINS", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not [line for line in out if line.startswith("[FAIL]")], out
    skipped = {line.split("  ")[-1].split(":")[0].strip(): line for line in out if line.startswith("[SKIP]")}
    assert "not importable: the patch targets in slime are not checked here" in skipped["not importable"]
    slime_line = skipped["slime is not importable"]
    # one line per reason, naming every patch whose targets live in slime
    in_slime = [p.id for p in patch.all_patches() if p.target_modules[0].split(".")[0] == "slime"]
    assert len(in_slime) > 10 and all(pid in slime_line for pid in in_slime)
    assert "train.npu_tensor_type" in skipped["torch_npu is not installed (not an Ascend host)"]
    assert "train.glm5_kernels" in skipped["slime_plugins is not importable"]
    assert len(skipped) == len({line for line in skipped.values()})  # no reason printed twice


def test_a_real_problem_still_fails(monkeypatch, tmp_path):
    """What it can check and finds wrong still exits 1: a patch whose target no longer fits, an allocator clash."""
    from slime_ascend import patch
    from slime_ascend.patch.base import RuntimePatch

    class Drifted(RuntimePatch):
        def check(self, modules):
            return ["json.dumps lost its 'indent' parameter"]

    drifted = Drifted(id="driver.example", targets=("json:dumps",), why="", how="", upstream="", checked_on=("0.3.1",))
    absent = Drifted(id="driver.absent", targets=("slime.utils.arguments:parse_args",), why="", how="", upstream="",
                     checked_on=("0.3.1",))
    _hide(monkeypatch, "slime")
    monkeypatch.setattr(patch, "all_patches", lambda: [drifted, absent])
    lines = doctor.patch_targets()
    assert [(l.topic, l.status) for l in lines] == [("patch driver.example", "fail"), ("patches not checked", "skip")]
    assert lines[1].detail == "slime is not importable: 1 patch (driver.absent)"
    assert doctor.exit_status(lines) == 1 and doctor.exit_status(lines[1:]) == 0
    clash = doctor.ascend_environment({"PYTORCH_NPU_ALLOC_CONF": "x", "PYTORCH_ALLOC_CONF": ""}, str(tmp_path))
    assert doctor.exit_status(clash) == 1


def test_a_patch_that_needs_the_npu_runtime_is_not_checked_where_it_is_not_loaded(monkeypatch):
    from slime_ascend.patch.train.npu_tensor_type import PATCH

    _hide(monkeypatch, "torch_npu")
    assert PATCH.not_checkable() == "torch_npu is not installed (not an Ascend host)"
    monkeypatch.delitem(__import__("sys").modules, "torch_npu")
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torch_npu" else real_find_spec(name, *a))
    assert PATCH.not_checkable() == "torch_npu is not loaded in this process"
