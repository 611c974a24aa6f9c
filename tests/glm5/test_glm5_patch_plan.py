"""The glm5 patches come through the patch plan: in a fresh process with the ``cpu`` plugin enabled (the
bootstrap, as in every slime process), importing slime's glm5 spec just works and finds our parts; without the
plugin it stops at ``import tilelang``, as it does for any slime user on a host without CUDA."""

from __future__ import annotations

import json

import pytest

from conftest import run_python

pytestmark = pytest.mark.slime

CODE = """
import json, sys
try:
    import slime_plugins.models.glm5.glm5 as g
except ImportError as exc:
    print(json.dumps({"error": str(exc)})); raise SystemExit
ops = "slime_plugins.models.glm5.ops."
print(json.dumps({
    "TELinear": g.TELinear.__module__ + "." + g.TELinear.__name__,
    "TESpecProvider": g.TESpecProvider.__name__,
    "block": g.get_gpt_decoder_block_spec.__module__,
    "kernels": {m: sys.modules[ops + m].__doc__.split(" stand-in")[0] for m in
                ("tilelang_indexer_fwd", "tilelang_indexer_bwd", "tilelang_sparse_mla_fwd", "tilelang_sparse_mla_bwd")},
    "indexer_fwd": sys.modules[ops + "indexer"].indexer_fwd_interface.__module__,
    "rope_wrapped": hasattr(g.DSAMLASelfAttention.get_absorb_query_key_value_tensors, "__wrapped__"),
}))
"""


def test_the_cpu_plugin_gives_slimes_glm5_spec_its_host_parts():
    proc = run_python(CODE, env={"SLIME_ASCEND_PLUGINS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["TELinear"] == "slime_ascend.cpu.glm5_spec.HostDuplicatedLinear"
    assert got["TESpecProvider"] == "HostSpecProvider" and got["block"] == "slime_ascend.cpu.glm5_spec"
    assert set(got["kernels"].values()) == {"slime-ascend's cpu"}
    assert got["rope_wrapped"] is True
    assert got["indexer_fwd"] == "slime_ascend.glm5.ops.indexer"  # what slime's IndexerFunction calls


def test_without_the_plugin_slimes_spec_needs_tilelang():
    proc = run_python(CODE, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tilelang" in json.loads(proc.stdout.strip().splitlines()[-1])["error"]


def test_the_cpu_plugin_accepts_slimes_glm5_spec_on_the_command_line():
    import types

    from slime_ascend.cpu.plugin import GLM5_SPEC, PLUGIN, SPEC

    (flag,) = [f for f in PLUGIN.command_line if f.flag.startswith("--spec")]
    assert flag.check(types.SimpleNamespace(spec=GLM5_SPEC.split()))
    assert flag.check(types.SimpleNamespace(spec=SPEC.split()))
    assert not flag.check(types.SimpleNamespace(spec=["slime_plugins.models.glm4", "get_glm_spec"]))
