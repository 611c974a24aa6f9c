"""``dsa-determinism``'s warning at ``parse_args``: which rollout side selects the DSA keys by the plugin's rule.

On Ascend SGLang's indexer selects inside ``torch_npu.npu_lightning_indexer`` (``Indexer.forward_npu``), which the
top-k flags never reach: there the warning stays on whatever ``--sglang-dsa-topk-backend`` and
``SGLANG_DSA_FUSE_TOPK`` say (the "Fix" for CUDA used to silence it)."""

from __future__ import annotations

import importlib.util
import logging
import types

import pytest

from slime_ascend import host
from slime_ascend.dsa import checks
from slime_ascend.dsa.checks import sglang_selection_problem

UNFUSED = {"SGLANG_DSA_FUSE_TOPK": "false"}


def _args(plugins: str, **kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(ascend_plugins=plugins, sglang_dsa_topk_backend="torch", **kw)


@pytest.fixture(autouse=True)
def _no_job_plugins(monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    monkeypatch.setattr(host, "torch_npu_installed", lambda: False)


@pytest.mark.parametrize("plugins, extra, where", [
    ("npu,sglang-npu,dsa-determinism", {}, "plugin sglang-npu"),
    ("npu,dsa-determinism", {}, "plugin npu"),  # SGLang finds torch_npu on the node and runs forward_npu
    ("dsa-determinism", {"sglang_device": "npu"}, "--sglang-device npu"),
])
def test_sglang_on_ascend_warns_whatever_the_topk_flags_say(plugins, extra, where):
    problem = sglang_selection_problem(_args(plugins, **extra), environ=UNFUSED)  # the CUDA "Fix" followed
    assert problem is not None, "the warning's own Fix silenced it on SGLang's Ascend indexer"
    assert f"SGLang on Ascend ({where})" in problem
    assert "torch_npu.npu_lightning_indexer" in problem and "forward_npu" in problem
    assert "different keys on tied scores" in problem and "not checked" in problem
    assert "\n" not in problem


def test_torch_npu_on_this_host_is_ascend_too(monkeypatch):
    monkeypatch.setattr(host, "torch_npu_installed", lambda: True)
    problem = sglang_selection_problem(_args("dsa-determinism"), environ=UNFUSED)
    assert problem and "SGLang on Ascend (torch_npu is installed)" in problem


def test_cuda_sglang_is_quiet_only_on_the_unfused_torch_backend():
    assert sglang_selection_problem(_args("dsa-determinism"), environ=UNFUSED) is None
    fused = sglang_selection_problem(_args("dsa-determinism"), environ={})
    assert "'torch' top-k backend (fused)" in fused and "Fix: --sglang-dsa-topk-backend torch" in fused
    # cpu,npu runs npu on the host, where rollouts come from the torch engine or a CUDA-less SGLang
    assert sglang_selection_problem(_args("cpu,npu,dsa-determinism"), environ=UNFUSED) is None


@pytest.mark.parametrize("plugins, extra", [
    ("npu,torch-engine,dsa-determinism", {}),  # the torch engine selects by the rule, on any device
    ("npu,sglang-npu,dsa-determinism", {"rollout_external_engine_addrs": ["h:1"]}),  # their own launch decides
])
def test_no_warning_where_slime_launches_no_sglang(plugins, extra):
    assert sglang_selection_problem(_args(plugins, **extra), environ={}) is None


def test_validate_logs_it_at_parse_args(caplog):
    settings = types.SimpleNamespace(dsa_index_dump_dir=None)
    with caplog.at_level(logging.WARNING, logger="slime_ascend.dsa"):
        checks.validate(_args("npu,sglang-npu,dsa-determinism"), settings)
    assert any("SGLang on Ascend (plugin sglang-npu)" in r.getMessage() for r in caplog.records)


def test_sglangs_ascend_indexer_selects_inside_the_fused_kernel():
    """The premise, read from the installed SGLang: ``Indexer.forward_npu`` calls
    ``torch_npu.npu_lightning_indexer`` and never the top-k function the plugin patches."""
    module = "sglang.srt.layers.attention.dsa.dsa_indexer"
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    from slime_ascend._import_hooks import module_file

    path = module_file(module)
    if path is None:
        pytest.skip(f"{module} not in the installed sglang")
    source = path.read_text()
    start = source.index("    def forward_npu(")
    end = source.find("\n    def ", start + 1)
    body = source[start:end if end > 0 else None]
    assert "npu_lightning_indexer(" in body
    assert "topk_func" not in body and "_topk_unfused" not in body and "torch.topk" not in body


def test_on_the_emulated_ascend_host_too():
    """A process with the emulated Ascend stack (``SLIME_ASCEND_EMULATE_NPU=1``: a torch_npu is importable, as SGLang
    finds it on a node and dispatches to ``forward_npu``) warns with the CUDA fix followed."""
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("slime_ascend.npu_emulation") is None:
        pytest.skip("slime_ascend.npu_emulation is not in this checkout")
    code = ("import types\nfrom slime_ascend.dsa.checks import sglang_selection_problem as p\n"
            "print(p(types.SimpleNamespace(sglang_dsa_topk_backend='torch'), environ={'SGLANG_DSA_FUSE_TOPK': 'false'}))")
    env = {**os.environ, "SLIME_ASCEND_EMULATE_NPU": "1", "SLIME_ASCEND_PLUGINS": "dsa-determinism"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("SGLang on Ascend (torch_npu is installed) selects")
