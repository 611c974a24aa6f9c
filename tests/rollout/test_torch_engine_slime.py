"""Drive the torch engine with slime's real client code (needs slime importable: SLIME_SRC on PYTHONPATH).

Checks that slime's ``sglang_rollout.generate`` fills Samples with the engine's exact tokens and
log-probs, that external-engine discovery and its server-args sanity check accept the engine,
that ``SGLangEngine``'s disk weight-sync calls work, and that OPD teacher scoring reads
``input_token_logprobs`` correctly.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from argparse import Namespace

import pytest
import torch

from conftest import need

need("slime.utils.types")  # outside CI, skips naming what of slime's stack is missing; on CI, fails

from slime.backends.sglang_utils.external import discover_external_engines  # noqa: E402
from slime.rollout import sglang_rollout  # noqa: E402
from slime.utils import http_utils  # noqa: E402
from slime.utils.async_utils import run  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

from slime_ascend.rollout.torch_engine import model as reference_model
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model, score_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_slime")
    return save_model(load_model(None, seed=11), out, reference_model.build_byte_tokenizer())


@pytest.fixture(scope="module")
def served(model_dir):
    engine = TorchEngine(model_path=str(model_dir), return_original_logprob=False)
    with engine.start_in_thread() as url:
        yield engine, url


def make_args(model_dir, url: str, **overrides) -> Namespace:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    args = Namespace(
        hf_checkpoint=str(model_dir),
        sglang_router_ip=host,
        sglang_router_port=int(port),
        rollout_temperature=0.8,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=6,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        sglang_server_concurrency=4,
        rollout_num_engines=1,
        sglang_dp_size=1,
        n_samples_per_prompt=1,
        ci_test=False,
        use_rollout_routing_replay=False,
        use_distributed_post=False,
        partial_rollout=False,
        reward_key=None,
        rm_url=f"{url}/generate",
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def slime_generate(args: Namespace, prompt: str, seed: int) -> Sample:
    sglang_rollout.GenerateState.clear_instances()
    http_utils.init_http_client(args)
    state = sglang_rollout.GenerateState(args)
    sampling_params = {**state.sampling_params, "sampling_seed": seed}
    sample = Sample(prompt=prompt, index=0)
    return run(sglang_rollout.generate(args, sample, sampling_params))


def test_slime_discovery_and_server_args_check(served, model_dir, monkeypatch):
    engine, url = served
    (info,) = discover_external_engines([url.removeprefix("http://")])
    assert info.worker_type == "regular" and info.num_gpus == 1
    assert info.parallel_config == {"tp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1}

    from slime.backends.sglang_utils import sglang_engine
    # no accelerator on a CPU host; the device id is irrelevant to the checked fields
    monkeypatch.setattr(sglang_engine.accelerator, "resolve_visible_device_id", lambda device_id: device_id)
    args = Namespace(
        hf_checkpoint=str(model_dir), seed=0, offload_rollout=False, rollout_num_gpus_per_engine=1, sglang_pp_size=1,
        num_gpus_per_node=1, sglang_dp_size=1, sglang_ep_size=1, use_rollout_routing_replay=False, fp16=False,
    )
    if not dataclasses.is_dataclass(sglang_engine.ServerArgs):
        # this sglang build's ServerArgs is not a dataclass; give slime a stand-in holding every key it sets
        names = set(re.findall(r'^\s+"(\w+)":', inspect.getsource(sglang_engine._compute_server_args), re.M))
        stand_in = dataclasses.make_dataclass("ServerArgs", [(n, object, None) for n in sorted(names)])
        monkeypatch.setattr(sglang_engine, "ServerArgs", stand_in)
    expected, fields = sglang_engine._compute_server_args(
        args, 0, f"{info.host}:{info.port}", None, info.host, info.port, base_gpu_id=0
    )
    actual = info.server_info
    assert "enable_memory_saver" in fields
    mismatches = {name: (expected.get(name), actual.get(name)) for name in fields if expected.get(name) != actual.get(name)}
    assert not mismatches  # what SGLangEngine._init_external asserts


def test_slime_generate_fills_sample_with_exact_tokens_and_logprobs(served, model_dir):
    engine, url = served
    args = make_args(model_dir, url)
    sample = slime_generate(args, "hello world", seed=5)
    prompt_ids = engine.tokenizer.encode("hello world", add_special_tokens=False)
    assert sample.tokens[: len(prompt_ids)] == prompt_ids
    response_ids = sample.tokens[len(prompt_ids) :]
    assert sample.response_length == len(response_ids) == len(sample.rollout_log_probs) == 6
    assert sample.loss_mask == [1] * 6
    assert sample.status == Sample.Status.TRUNCATED
    assert sample.weight_versions == [engine.weight_version]
    assert sample.response == engine.tokenizer.decode(response_ids, skip_special_tokens=False)
    expected = score_tokens(engine.model, sample.tokens, temperature=args.rollout_temperature)[len(prompt_ids) - 1 :]
    torch.testing.assert_close(torch.tensor(sample.rollout_log_probs), expected, atol=1e-5, rtol=1e-5)

    again = slime_generate(args, "hello world", seed=5)
    assert again.tokens == sample.tokens and again.rollout_log_probs == sample.rollout_log_probs


def test_slime_top_p_replay_metadata(served, model_dir):
    engine, url = served
    args = make_args(model_dir, url, rollout_top_p=0.5)
    sample = slime_generate(args, "abc", seed=1)
    offsets = torch.as_tensor(sample.rollout_top_p_token_offsets)
    assert offsets.numel() == sample.response_length + 1
    ids = torch.as_tensor(sample.rollout_top_p_token_ids)
    prompt_len = len(sample.tokens) - sample.response_length
    for i, token in enumerate(sample.tokens[prompt_len:]):
        assert token in ids[offsets[i] : offsets[i + 1]].tolist()


def test_slime_disk_weight_sync_calls(served, model_dir, tmp_path):
    """The call sequence of slime's RayTrainGroup._reload_rollout_weights_from_disk, via SGLangEngine's client."""
    from slime.backends.sglang_utils import sglang_engine
    engine, url = served
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = sglang_engine.SGLangEngine(Namespace(rollout_external=True), rank=0)
    client.node_rank, client.server_host, client.server_port = 0, host, int(port)
    client.router_ip = client.router_port = None

    new_model = load_model(None, seed=12)
    weight_dir = save_model(new_model, tmp_path / "weight_v000001")
    client.pause_generation()
    client.flush_cache()
    result = client.update_weights_from_disk(model_path=str(weight_dir), weight_version="1")
    assert result["success"] is True
    assert client.get_weight_version() == "1"
    client.continue_generation()
    assert client.health_generate() is True

    args = make_args(model_dir, url)
    sample = slime_generate(args, "hello", seed=2)
    assert sample.weight_versions == ["1"]
    prompt_len = len(sample.tokens) - sample.response_length
    expected = score_tokens(new_model, sample.tokens, temperature=args.rollout_temperature)[prompt_len - 1 :]
    torch.testing.assert_close(torch.tensor(sample.rollout_log_probs), expected, atol=1e-5, rtol=1e-5)


def test_slime_opd_teacher_scoring(served, model_dir):
    from slime.rollout import on_policy_distillation as opd
    engine, url = served
    args = make_args(model_dir, url)
    sample = slime_generate(args, "teacher", seed=3)
    sample.reward = run(opd.reward_func(args, sample))
    opd.post_process_rewards(args, [sample])
    expected = score_tokens(engine.model, sample.tokens)[-sample.response_length :]  # temperature-1, as SGLang
    torch.testing.assert_close(sample.teacher_log_probs, expected, atol=1e-5, rtol=1e-5)
