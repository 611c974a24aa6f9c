"""sglang-npu: produced ServerArgs (validated with the installed sglang), environment, the launch
bridge patch applied onto real slime, and the SGLang fixes check."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import pytest
from conftest import need

from slime_ascend.rollout.backends import sglang_npu

B = sglang_npu.BACKEND
REPO = Path(__file__).resolve().parents[2]


def test_server_args_defaults_and_options():
    assert B.server_args(B.defaults()) == {"device": "npu", "attention_backend": "ascend"}
    sa = B.server_args(B.options({"graph_mode": False, "mem_fraction": 0.7, "sampling_backend": "ascend"}))
    assert sa["mem_fraction_static"] == 0.7 and sa["sampling_backend"] == "ascend"
    assert sa.keys() & {"cuda_graph_backend_decode", "disable_cuda_graph"}


def test_env_and_flags():
    env = B.env(B.defaults())
    assert env == {"ASCEND_USE_FIA": "1", "HCCL_HOST_SOCKET_PORT_RANGE": "60000-60050",
                   "HCCL_NPU_SOCKET_PORT_RANGE": "61000-61050", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}
    assert B.slime_flags(B.defaults()) == []
    assert B.slime_flags(B.defaults(), ["a:1", "b:2"]) == ["--rollout-external-engine-addrs", "a:1", "b:2"]


def test_to_cli():
    assert sglang_npu.to_cli({"device": "npu", "x_y": True, "off": False, "none": None, "f": 0.5}) == [
        "--device", "npu", "--x-y", "--f", "0.5"]


@pytest.mark.parametrize("value,expected", [
    ("expandable_segments:True", ""),
    ("expandable_segments:True,max_split_size_mb:128", "max_split_size_mb:128"),
    ("max_split_size_mb:128, expandable_segments:False", "max_split_size_mb:128"),
    ("garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6"),
    (None, None),
])
def test_strip_expandable_segments(value, expected):
    assert sglang_npu.strip_expandable_segments(value) == expected


def test_apply_env_fills_unset_and_strips_allocator():
    environ = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "ASCEND_USE_FIA": "0"}
    changed = sglang_npu.apply_env({"ASCEND_USE_FIA": "1", "HCCL_NPU_SOCKET_PORT_RANGE": "1-2"}, environ)
    assert environ == {"PYTORCH_NPU_ALLOC_CONF": "", "ASCEND_USE_FIA": "0", "HCCL_NPU_SOCKET_PORT_RANGE": "1-2"}
    assert changed == {"PYTORCH_NPU_ALLOC_CONF": "", "HCCL_NPU_SOCKET_PORT_RANGE": "1-2"}


def test_fill_server_args_precedence():
    defaults = {"device": None, "attention_backend": None, "mem_fraction_static": None, "tp_size": 1}
    ours = {"device": "npu", "attention_backend": "ascend", "mem_fraction_static": 0.8, "not_a_field": 1}
    merged, kept = sglang_npu.fill_server_args({"tp_size": 2, "mem_fraction_static": 0.6}, ours, defaults)
    assert merged == {"tp_size": 2, "mem_fraction_static": 0.6, "device": "npu", "attention_backend": "ascend"}
    assert kept == {"mem_fraction_static": (0.6, 0.8)}
    with pytest.raises(ValueError, match="drop --sglang-device"):
        sglang_npu.fill_server_args({"device": "cuda"}, ours, defaults)


# -- against the installed sglang ----------------------------------------------------------------
sglang = need("sglang", "ServerArgs validation needs it")


@pytest.mark.parametrize("overrides", [{}, {"graph_mode": False, "mem_fraction": 0.7, "sampling_backend": "ascend"},
                                       {"sampling_backend": "pytorch"}])
def test_produced_server_args_validate_with_real_sglang(overrides):
    report = sglang_npu.validate_server_args(B.server_args(B.options(overrides)))
    assert "argparse types/choices round trip" in report["checked"]
    construction = "ServerArgs construction"
    resolves_at_launch = hasattr(sglang_npu._server_args_class(), "resolve_once")
    assert (construction in report["checked"]) is resolves_at_launch
    assert any(item.startswith(construction) for item in report["not_checked"]) is not resolves_at_launch
    assert B.validate(B.options(overrides)) == []


def test_validation_rejects_what_sglang_rejects():
    with pytest.raises(ValueError, match="not ServerArgs fields"):
        sglang_npu.validate_server_args({"device": "npu", "ascend_magic": 1})
    with pytest.raises(ValueError, match="rejects|choice"):
        sglang_npu.validate_server_args({"attention_backend": "not-a-backend"})
    problems = B.validate(B.options({"attention_backend": "not-a-backend"}))
    assert problems and "ascend_rollout_attention_backend" in problems[0]


def test_server_args_fields_match_sglang_parser():
    fields = sglang_npu.server_args_fields()
    assert {"device", "attention_backend", "mem_fraction_static", "sampling_backend"} <= set(fields)
    assert fields["device"] is None and fields["attention_backend"] is None  # what fill_server_args compares to


def test_installed_sglang_has_the_fork_fixes():
    assert sglang_npu.check_sglang_fixes() == []


def test_fixes_check_can_fail(monkeypatch):
    monkeypatch.setattr(sglang_npu, "SGLANG_FIXES", sglang_npu.SGLANG_FIXES + (
        ("made-up fix", "sglang.srt.layers.vocab_parallel_embedding", "THIS SNIPPET IS NOT THERE"),
        ("missing module", "sglang.srt.no_such_module", "x"),
    ))
    problems = sglang_npu.check_sglang_fixes()
    assert len(problems) == 2 and "made-up fix" in problems[0] and "not found" in problems[1]


def test_launch_command_parses_with_sglang():
    argv = B.launch_command(B.options({"mem_fraction": 0.8}), "/models/x", port=31000, tp_size=2)
    parser = argparse.ArgumentParser()
    sglang_npu._server_args_class().add_cli_args(parser)
    ns = parser.parse_args(argv[3:])
    assert (ns.device, ns.attention_backend, ns.mem_fraction_static, ns.port, ns.tp_size) == ("npu", "ascend", 0.8,
                                                                                             31000, 2)


# -- the launch bridge on real slime --------------------------------------------------------------
@pytest.mark.slime
def test_launch_bridge_on_real_slime(monkeypatch):
    from slime.backends.sglang_utils import sglang_engine

    from slime_ascend import patch

    p = patch.get("engine.sglang_npu_launch")
    original = sglang_engine.SGLangEngine._init_normal
    assert p.verify() == []
    captured = {}
    monkeypatch.setattr(sglang_engine, "launch_server_process", lambda server_args: captured.setdefault("sa", server_args))
    monkeypatch.setattr(sglang_engine.SGLangEngine, "_register_to_router", lambda self, d: None, raising=True)
    if not hasattr(sglang_engine.ServerArgs, "resolve_once"):
        # slime's pinned SGLang resolves device and model in ServerArgs.__post_init__ (imports torch_npu,
        # opens the model): not possible on this host; the bridge's arguments are what is checked here
        monkeypatch.setattr(sglang_engine.ServerArgs, "__post_init__", lambda self: None)
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    monkeypatch.delenv("HCCL_HOST_SOCKET_PORT_RANGE", raising=False)
    monkeypatch.setenv("ASCEND_USE_FIA", "0")  # the user's export wins
    p.install()
    try:
        assert sglang_engine.SGLangEngine._init_normal is not original
        engine = sglang_engine.SGLangEngine.__new__(sglang_engine.SGLangEngine)
        engine.args = argparse.Namespace(ascend_rollout_mem_fraction=0.66)
        engine.server_host, engine.server_port = "127.0.0.1", 1
        engine._init_normal({"model_path": "/m", "tp_size": 1, "attention_backend": "torch_native"})
        sa = captured["sa"]
        assert (sa.device, sa.mem_fraction_static, sa.model_path) == ("npu", 0.66, "/m")
        assert sa.attention_backend == "torch_native"  # the user's --sglang-attention-backend wins
        assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:64"
        assert os.environ["HCCL_HOST_SOCKET_PORT_RANGE"] == "60000-60050"
        assert os.environ["ASCEND_USE_FIA"] == "0"
        engine.args = argparse.Namespace()
        with pytest.raises(ValueError, match="sglang-npu needs ServerArgs.device"):
            engine._init_normal({"model_path": "/m", "device": "cuda"})
    finally:
        p.remove()
        monkeypatch.delenv("HCCL_HOST_SOCKET_PORT_RANGE", raising=False)
    assert sglang_engine.SGLangEngine._init_normal is original


def test_launch_bridge_refuses_a_changed_target():
    import types

    from slime_ascend import patch

    class SGLangEngine:
        def _init_normal(self, server_args_dict):
            return server_args_dict  # builds no server args: not the expected shape

    fake = types.ModuleType("slime.backends.sglang_utils.sglang_engine")
    fake.SGLangEngine = SGLangEngine
    fake.launch_server_process = lambda sa: None
    p = patch.get("engine.sglang_npu_launch")
    problems = p.check({"slime.backends.sglang_utils.sglang_engine": fake})
    assert problems and "ServerArgs(**server_args_dict)" in problems[0]
    with pytest.raises(patch.PatchTargetError):
        p.install(modules={"slime.backends.sglang_utils.sglang_engine": fake})
    assert SGLangEngine._init_normal.__name__ == "_init_normal" and not hasattr(SGLangEngine._init_normal, "__wrapped__")


@pytest.mark.slime
def test_bootstrap_installs_the_bridge_in_a_fresh_process():
    from conftest import run_python, slime_src

    code = textwrap.dedent("""
        import slime.backends.sglang_utils.sglang_engine as m
        print("WRAPPED", hasattr(m.SGLangEngine._init_normal, "__wrapped__"))
    """)
    env = {"SLIME_ASCEND_PLUGINS": "sglang-npu", "PYTHONPATH": os.pathsep.join([str(slime_src()), str(REPO)])}
    done = run_python(code, env=env, timeout=300)
    assert "WRAPPED True" in done.stdout, done.stdout + done.stderr


def test_rollout_routing_replay_behind_the_pypi_router_is_refused_at_validation(monkeypatch):
    """SGLang on Ascend adds the routes only when the request asks, and sglang-router from PyPI drops the field:
    refused in one line (rollout.replay_routes); slime's fork of the router passes."""
    from slime_ascend.plugins.settings import SettingsError

    args = argparse.Namespace(use_rollout_routing_replay=True, rollout_external_engine_addrs=None)
    monkeypatch.setattr("slime_ascend.rollout.replay_routes.router_version", lambda: "0.3.2")
    with pytest.raises(SettingsError) as info:
        sglang_npu.validate_plugin(args, None)
    assert str(info.value).startswith("sglang-npu: --use-rollout-routing-replay: slime's router (sglang-router "
                                      "0.3.2") and "\n" not in str(info.value), str(info.value)
    monkeypatch.setattr("slime_ascend.rollout.replay_routes.router_version", lambda: "0.3.2+slime")
    sglang_npu.validate_plugin(args, None)


def test_installed_sglang_has_the_speculative_rules_sglang_npu_stands_for():
    assert sglang_npu.check_speculative_rules() == []


def test_speculative_rules_check_can_fail(monkeypatch):
    real = sglang_npu._module_source
    monkeypatch.setattr(sglang_npu, "_module_source", lambda name: (
        real(name).replace("_PAGE_TREE_SPEC_BACKENDS = (", "_PAGE_TREE_SPEC_BACKENDS = (\"ascend\", ")
        if name == "sglang.srt.arg_groups.speculative_hook" else real(name)))
    problems = sglang_npu.check_speculative_rules()
    assert len(problems) == 1 and problems[0].startswith("a draft tree with pages needs flashinfer"), problems


def _speculative_args(**flags):
    base = {"use_rollout_routing_replay": False, "rollout_external_engine_addrs": None,
            "sglang_speculative_algorithm": None, "sglang_speculative_eagle_topk": None, "sglang_page_size": None}
    return argparse.Namespace(**{**base, **flags})


@pytest.mark.parametrize("flags", [
    {},  # no speculation
    # slime's scripts/run-glm5-744B-A40B.sh: EAGLE over the model's MTP layer, a chain of drafts (top-k 1)
    {"sglang_speculative_algorithm": "EAGLE", "sglang_speculative_eagle_topk": 1},
    {"sglang_speculative_algorithm": "NEXTN", "sglang_speculative_eagle_topk": None},  # SGLang picks the shape
    {"sglang_speculative_algorithm": "EAGLE", "sglang_speculative_eagle_topk": 4, "sglang_page_size": 1},
])
def test_speculative_flags_sglang_runs_on_ascend_pass(flags):
    sglang_npu.validate_plugin(_speculative_args(**flags), None)


@pytest.mark.parametrize("flags, start", [
    ({"sglang_speculative_algorithm": "EAGLE", "sglang_speculative_eagle_topk": 2},
     "sglang-npu: --sglang-speculative-eagle-topk 2: on Ascend SGLang attends with its 'ascend' backend at page size "
     "128 (SGLang's NPU default)"),
    ({"sglang_speculative_algorithm": "EAGLE3", "sglang_speculative_eagle_topk": 8, "sglang_page_size": 16},
     "sglang-npu: --sglang-speculative-eagle-topk 8: on Ascend SGLang attends with its 'ascend' backend at page size "
     "16 (--sglang-page-size)"),
    ({"sglang_speculative_algorithm": "NGRAM"}, "sglang-npu: --sglang-speculative-algorithm NGRAM: SGLang runs n-gram"),
])
def test_speculative_flags_sglang_refuses_on_ascend_are_one_line_before_ray(flags, start):
    """What SGLang on Ascend raises at the engine's start (SPECULATIVE_RULES, read from its source above) is one line
    naming the flag and the fix at parse_args."""
    from slime_ascend.plugins.settings import SettingsError

    with pytest.raises(SettingsError) as info:
        sglang_npu.validate_plugin(_speculative_args(**flags), None)
    line = str(info.value)
    assert line.startswith(start) and "\n" not in line and "Fix: " in line, line


@pytest.mark.slime
def test_slimes_parse_args_refuses_a_draft_tree_on_ascend_in_one_line(tmp_path):
    """slime's own parse_args, with the npu and sglang-npu plugins and the speculative flags of slime's GLM-5 script
    but a draft tree (top-k 2): one line and exit 2 before Ray starts; top-k 1, as the script has it, parses."""
    import slime_parse_args

    release = ("--release-train", "--update-weight-transport", "disk", "--update-weight-disk-dir",
               str(tmp_path / "sync"), "--save", str(tmp_path / "ckpt"))
    speculative = ("--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
                   "--sglang-speculative-num-draft-tokens", "4", "--sglang-speculative-eagle-topk")
    proc, as_scripted = slime_parse_args.parse_args_each(tmp_path, ["npu", "sglang-npu"],
                                                         [(*release, *speculative, "2"), (*release, *speculative, "1")])
    lines = slime_parse_args.error_lines(proc)
    assert proc.returncode == 2 and "PARSED" not in proc.stdout and len(lines) == 1, (lines, proc.stderr[-3000:])
    assert lines[0].startswith("slime-ascend: error: sglang-npu: --sglang-speculative-eagle-topk 2: on Ascend "), lines
    assert "Traceback" not in proc.stderr
    assert as_scripted.returncode == 0 and "PARSED" in as_scripted.stdout, as_scripted.stderr[-3000:]
