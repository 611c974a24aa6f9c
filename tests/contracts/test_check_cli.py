import json
import subprocess
import sys

import pytest


def test_check_cli_reports_and_exits_zero(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "check", "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all contracts hold" in proc.stdout and "topk.repeat_identical" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] is True


def test_check_cli_npu_without_torch_npu_is_a_clean_error(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here, so --device npu is not the error this test expects")
    proc = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "check", "--device", "npu"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "torch_npu" in proc.stderr and "Fix:" in proc.stderr
