"""The torch engine under slime's ``--colocate`` calls, as slime's train.py makes them: a quantised colocated push
(``update_weights_from_tensor`` of the bytes ``slime-ascend quantize`` writes, the fp8/int8 sync plugins' output)
and onload's tags (``onload_kv`` resumes ``kv_cache`` and ``cuda_graph`` together)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.weight_read import decode_raw

from torch_engine_fixtures import bf16_dir
from test_torch_engine_tensor_update import file_system_sharing, push  # noqa: F401  (fixture)

HTTP = httpx.Client(timeout=300, trust_env=False)


def checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.usefixtures("file_system_sharing")
@pytest.mark.parametrize("fmt", ["fp8-block", "int8-w8a8"])
def test_quantised_colocated_push_serves_the_converters_bytes(tmp_path, fmt):
    from slime_ascend.quant.checkpoint import convert_checkpoint

    q0, q1 = tmp_path / "q0", tmp_path / "q1"
    convert_checkpoint(bf16_dir(tmp_path / "bf16-0", 0.0), q0, fmt)
    convert_checkpoint(bf16_dir(tmp_path / "bf16-1", 0.01), q1, fmt)
    pushed = checkpoint(q1)
    assert any(t.dtype in (torch.float8_e4m3fn, torch.int8) for t in pushed.values())
    names = sorted(pushed)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    engine = TorchEngine(model_path=str(q0), return_original_logprob=False)
    with engine.start_in_thread() as url:
        # half a version is staged and never serves
        r = push(url, [(n, pushed[n]) for n in first], "1")
        assert r.status_code == 200 and "staged" in r.json()["message"], r.text
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "default"
        # a tensor in another format than the served checkpoint's is refused, naming the fix; the staged half stays
        weight = next(n for n in second if pushed[n].dtype in (torch.float8_e4m3fn, torch.int8))
        r = push(url, [(weight, pushed[weight].to(torch.bfloat16))], "1")
        assert r.status_code == 400 and f"the served {fmt} checkpoint holds" in r.json()["error"], r.text
        r = push(url, [("model.layers.0.mlp.up_proj.weight_scale_inv_x", pushed[weight])], "1")
        assert r.status_code == 400 and "is not a tensor of the served" in r.json()["error"], r.text
        # the rest completes it: the version serves, the bytes as received are what /get_weights_by_name answers
        r = push(url, [(n, pushed[n]) for n in second], "1")
        assert r.status_code == 200 and "weight version 1 loaded" in r.json()["message"], r.text
        for name, tensor in pushed.items():
            answer = HTTP.post(url + "/get_weights_by_name",
                               json={"name": name, "truncate_size": 1 << 20, "return_raw": True}).json()
            assert answer["weight_version"] == "1" and same_bytes(decode_raw(answer), tensor), name
        # slime's offload / onload around training: released, weights back, then kv_cache with cuda_graph
        assert HTTP.post(f"{url}/release_memory_occupation", json={}).status_code == 200
        r = push(url, [(n, pushed[n]) for n in first], "2")
        assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"], r.text
        assert HTTP.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        r = HTTP.post(f"{url}/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]})
        assert r.status_code == 200, r.text
        for name, tensor in pushed.items():
            answer = HTTP.post(url + "/get_weights_by_name",
                               json={"name": name, "truncate_size": 1 << 20, "return_raw": True}).json()
            assert same_bytes(decode_raw(answer), tensor), name
    # it serves exactly what loading that checkpoint from disk serves (the same dequantisation)
    want = TorchEngine(model_path=str(q1), return_original_logprob=False).model.state_dict()
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_resume_accepts_sglangs_three_tags_and_release_reports_resident_memory():
    engine = TorchEngine()
    with engine.start_in_thread() as url:
        r = HTTP.post(f"{url}/release_memory_occupation", json={})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["resident_bytes_before"] > 0 and body["resident_bytes_after"] > 0, body
        assert HTTP.post(f"{url}/resume_memory_occupation",
                         json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
        assert HTTP.get(f"{url}/health_generate").status_code == 503  # weights still released
        assert HTTP.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert HTTP.get(f"{url}/health_generate").status_code == 200
        r = HTTP.post(f"{url}/resume_memory_occupation", json={"tags": ["cuda_graphs"]})
        assert r.status_code == 400 and "unknown tags ['cuda_graphs']" in r.json()["error"]


@pytest.mark.usefixtures("file_system_sharing")
def test_a_mixed_bucket_with_an_odd_sized_tensor_decodes_byte_for_byte():
    """sglang's FlattenedTensorBucket packs every dtype of a bucket back to back (``supports_multi_dtypes``), so a
    float32 scale after an int8 tensor of odd size starts at an offset torch cannot view as float32."""
    from test_torch_engine_tensor_update import serialize_bucket

    from slime_ascend.rollout.torch_engine.tensor_update import decode_named_tensors

    gen = torch.Generator().manual_seed(3)
    named = [("a.weight", torch.randint(-127, 128, (3,), dtype=torch.int8, generator=gen)),
             ("a.weight_scale", torch.rand(2, 1, generator=gen)),
             ("b.weight", torch.randn(3, 5, generator=gen).to(torch.bfloat16))]
    text, _alive = serialize_bucket(named)
    got = decode_named_tensors([text], "flattened_bucket")
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(same_bytes(g, t) for (_, g), (_, t) in zip(got, named, strict=True))
