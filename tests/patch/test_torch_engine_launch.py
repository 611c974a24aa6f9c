"""``engine.torch_engine_launch`` on real slime, without Ray: slime's own ``SGLangEngine`` actor class starts the
torch engine (one subprocess) from the server arguments slime computes, waits for it with slime's health check,
and then drives it with its own methods: health, pause/continue, flush, offload/onload, the colocated tensor push
exactly as ``_send_to_colocated_engine`` sends it (gloo gather, FlattenedTensorBucket, MultiprocessingSerializer),
the version read-back, and shutdown."""

from __future__ import annotations

import argparse
import socket
import types

import pytest
import torch

from slime_ascend import patch
from slime_ascend.demo.slime_job import make_model

from conftest import need


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Handle:
    """What ``_send_to_colocated_engine`` calls: ``engine.update_weights_from_tensor.remote(**kwargs)``."""

    def __init__(self, actor) -> None:
        self.update_weights_from_tensor = types.SimpleNamespace(
            remote=lambda **kw: actor.update_weights_from_tensor(**kw))


@pytest.mark.slime
def test_slime_engine_actor_starts_and_drives_the_torch_engine(tmp_path):
    sglang_engine = need("slime.backends.sglang_utils.sglang_engine")
    from slime_ascend.rollout.torch_engine.tensor_update import use_file_system_sharing

    p = patch.get("engine.torch_engine_launch")
    original = sglang_engine.SGLangEngine._init_normal
    assert p.verify() == []
    model_dir = make_model(tmp_path / "tiny-qwen3")
    port = _free_port()
    p.install()
    actor = sglang_engine.SGLangEngine(argparse.Namespace(rollout_external=False, ascend_rollout_torch_dtype="float32"),
                                       rank=0)
    actor.node_rank, actor.server_host, actor.server_port = 0, "127.0.0.1", port
    actor.router_ip = actor.router_port = None
    try:
        actor._init_normal({"model_path": str(model_dir), "host": "127.0.0.1", "port": port, "random_seed": 1234,
                            "nnodes": 1, "tp_size": 1, "enable_memory_saver": True})
        assert actor.process.poll() is None
        assert actor.health_generate() is True
        assert actor.get_weight_version() == "default"
        actor.pause_generation()
        actor.flush_cache()
        actor.continue_generation()
        assert actor.release_memory_occupation()["success"]
        with pytest.raises(Exception, match="503"):
            actor.health_generate()
        actor.resume_memory_occupation(tags=["weights"])
        actor.resume_memory_occupation(tags=["kv_cache"])
        assert actor.health_generate() is True

        # slime's colocated push, its own code: one rank, one engine, a gloo gather group of one
        import torch.distributed as dist

        update = need("slime.backends.megatron_utils.update_weight.update_weight_from_tensor")
        from slime_ascend.rollout.torch_engine import model as reference_model

        use_file_system_sharing()  # what the torch-engine plugin sets in slime's train actors
        state = reference_model.load_model(str(model_dir)).state_dict()
        new = [(k, (v.float() + 0.01).to(torch.bfloat16)) for k, v in state.items()]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        try:
            group = dist.new_group(ranks=[0], backend="gloo")
            refs, alive = update._send_to_colocated_engine(new, ipc_engine=_Handle(actor), ipc_gather_src=0,
                                                           ipc_gather_group=group, weight_version=7)
        finally:
            dist.destroy_process_group()
        assert len(refs) == 1 and refs[0]["success"], refs
        assert "weight version 7 loaded" in refs[0]["message"]
        assert actor.get_weight_version() == "7"
        del alive
    finally:
        if getattr(actor, "process", None) is not None:
            actor.shutdown()  # router deregistration fails (no router here: a warning), then the process tree
            actor.process.wait(timeout=30)
        p.remove()
    assert actor.process.returncode is not None
    assert sglang_engine.SGLangEngine._init_normal is original


def test_launch_refuses_a_changed_target():
    class SGLangEngine:
        def _init_normal(self, server_args_dict):
            return server_args_dict

        def _register_to_router(self, d):
            pass

        def shutdown(self):
            pass

    fake = types.ModuleType("slime.backends.sglang_utils.sglang_engine")
    fake.SGLangEngine = SGLangEngine
    fake._wait_server_healthy = lambda base_url, api_key, is_process_alive: None
    fake.kill_process_tree = lambda pid: None
    p = patch.get("engine.torch_engine_launch")
    problems = p.check({"slime.backends.sglang_utils.sglang_engine": fake})
    assert problems and "launch_server_process(ServerArgs(**server_args_dict))" in problems[0]
    with pytest.raises(patch.PatchTargetError):
        p.install(modules={"slime.backends.sglang_utils.sglang_engine": fake})


def build_parser_device(cmd: list[str]) -> str:
    from slime_ascend.rollout.torch_engine.cli import build_parser

    return build_parser().parse_args(cmd[cmd.index("serve-torch") + 1:]).device


def test_engine_command_from_slime_server_args():
    from slime_ascend.rollout.backends import BackendError
    from slime_ascend.rollout.backends.torch_engine import BACKEND

    cmd = BACKEND.command({"model_path": "/m", "host": "[::1]", "port": 123, "random_seed": 5, "dtype": "float16"},
                          BACKEND.options())
    assert cmd[-12:] == ["--model", "/m", "--host", "::1", "--port", "123", "--seed", "5", "--dtype", "float16",
                         "--device", "cpu"]
    bf16 = BACKEND.command({"model_path": "/m", "host": "h", "port": 1}, BACKEND.options({"torch_dtype": "bfloat16"}))
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16"
    # ascend_rollout_torch_device: where each engine computes (on an Ascend host, the NPU Ray gave the engine actor)
    on_npu = BACKEND.command({"model_path": "/m", "host": "h", "port": 1}, BACKEND.options({"torch_device": "npu"}))
    assert on_npu[on_npu.index("--device") + 1] == "npu"
    assert build_parser_device(on_npu) == "npu"
    with pytest.raises(BackendError, match="--rollout-num-gpus-per-engine"):
        BACKEND.command({"model_path": "/m", "host": "h", "port": 1, "nnodes": 2}, BACKEND.options())
    assert "--prefix-cache-tokens" not in cmd  # off by default
    cached = BACKEND.command({"model_path": "/m", "host": "h", "port": 1},
                             BACKEND.options({"torch_prefix_cache_tokens": 4096}))
    assert cached[-2:] == ["--prefix-cache-tokens", "4096"]
    assert "--enable-return-routed-experts" not in cmd  # slime sets the field only under routing replay
    routed = BACKEND.command({"model_path": "/m", "host": "h", "port": 1, "enable_return_routed_experts": True},
                             BACKEND.options())
    assert routed[-1] == "--enable-return-routed-experts"
    from slime_ascend.rollout.torch_engine.cli import build_parser

    assert build_parser().parse_args(routed[routed.index("serve-torch") + 1:]).enable_return_routed_experts is True
    # the dsa-determinism plugin's ascend_dsa_index_dump_dir: the engines write their side of the key sets there
    import types

    assert "--dump-dsa-index-sets" not in cmd and BACKEND.options_from_args(types.SimpleNamespace())[
        "dsa_index_dump_dir"] is None
    options = BACKEND.options_from_args(types.SimpleNamespace(ascend_dsa_index_dump_dir="/runs/dsa"))
    dumping = BACKEND.command({"model_path": "/m", "host": "h", "port": 1}, options)
    assert dumping[-2:] == ["--dump-dsa-index-sets", "/runs/dsa"]
    assert build_parser().parse_args(dumping[dumping.index("serve-torch") + 1:]).dump_dsa_index_sets == "/runs/dsa"


def test_the_device_setting_refuses_a_name_the_engine_does_not_know():
    from slime_ascend.rollout.plugin import TORCH_ENGINE

    setting = next(s for s in TORCH_ENGINE.settings if s.key == "ascend_rollout_torch_device")
    assert setting.default == "cpu" and setting.check("npu:1") is None and setting.check("cuda") is None
    assert setting.check("tpu") == "must be cpu, cuda, cuda:N, npu or npu:N"


def test_slimes_speculative_flags_reach_the_engine_command():
    """slime's --sglang-speculative-* (ServerArgs fields) become serve-torch's flags: STANDALONE with its draft model;
    EAGLE / NEXTN (the checkpoint's own MTP layer) as slime's GLM-5 scripts pass them; another algorithm, or one
    without what it needs, is refused in one line."""
    from slime_ascend.rollout.backends import BackendError
    from slime_ascend.rollout.backends.torch_engine import BACKEND
    from slime_ascend.rollout.torch_engine.cli import build_parser

    base = {"model_path": "/m", "host": "h", "port": 1}
    assert "--speculative-algorithm" not in BACKEND.command({**base, "speculative_algorithm": None}, BACKEND.options())
    cmd = BACKEND.command({**base, "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/draft",
                           "speculative_num_steps": 3, "speculative_num_draft_tokens": 4}, BACKEND.options())
    parsed = build_parser().parse_args(cmd[cmd.index("serve-torch") + 1:])
    assert (parsed.speculative_algorithm, parsed.speculative_draft_model_path, parsed.speculative_num_steps,
            parsed.speculative_num_draft_tokens) == ("STANDALONE", "/draft", 3, 4)
    # slime's scripts/run-glm5-744B-A40B.sh: EAGLE, 3 steps, top-k 1, 4 draft tokens
    cmd = BACKEND.command({**base, "speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                           "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}, BACKEND.options())
    parsed = build_parser().parse_args(cmd[cmd.index("serve-torch") + 1:])
    assert (parsed.speculative_algorithm, parsed.speculative_draft_model_path, parsed.speculative_num_steps,
            parsed.speculative_eagle_topk, parsed.speculative_num_draft_tokens) == ("EAGLE", None, 3, 1, 4)
    for fields, phrase in (({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}, "is not supported"),
                           ({"speculative_algorithm": "EAGLE"}, "--sglang-speculative-num-steps K"),
                           ({"speculative_algorithm": "STANDALONE"}, "--sglang-speculative-draft-model-path")):
        with pytest.raises(BackendError, match=phrase) as err:
            BACKEND.command({**base, **fields}, BACKEND.options())
        assert "\n" not in str(err.value)
