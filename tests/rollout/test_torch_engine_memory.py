"""The torch engine's release/resume_memory_occupation (slime's offload/onload under --colocate): the process's
resident memory goes down by about the weights' size, requests are refused meanwhile, the weights come back bit for
bit, and the next generation after resume is the one before the release (same tokens, log-probs within 1e-5)."""

from __future__ import annotations

import httpx
import pytest
import torch

from slime_ascend.rollout.torch_engine import model as reference_model
from slime_ascend.rollout.torch_engine.engine import TorchEngine

HTTP = httpx.Client(timeout=300, trust_env=False)
PROMPT = [1, 17, 250, 3, 999, 42]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory):
    """A Qwen3 of about 60 MB in float32 (hidden 512, 4 layers), so its weights dominate the RSS change."""
    config = reference_model.tiny_qwen3_config(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                               num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    return reference_model.save_model(model, tmp_path_factory.mktemp("big") / "qwen3",
                                      reference_model.build_byte_tokenizer())


def greedy(url: str) -> dict:
    r = HTTP.post(f"{url}/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_release_drops_weights_and_resume_restores_the_same_generation(big_model_dir):
    engine = TorchEngine(model_path=str(big_model_dir), dtype="float32")
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert weight_bytes > 40 << 20
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with engine.start_in_thread() as url:
        before = greedy(url)
        rss_loaded = rss_bytes()
        r = HTTP.post(f"{url}/release_memory_occupation", json={})
        assert r.status_code == 200 and r.json()["success"], r.text
        rss_released = rss_bytes()
        assert rss_loaded - rss_released > 0.6 * weight_bytes, (rss_loaded, rss_released, weight_bytes)
        assert all(p.numel() == 0 for p in engine.model.parameters())

        # while released: generation, weight updates and the health probe answer "not now"
        r = HTTP.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"]
        assert HTTP.get(f"{url}/health_generate").status_code == 503
        r = HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(big_model_dir)})
        assert r.status_code == 503

        # kv_cache alone leaves the weights released; weights bring them back
        assert HTTP.post(f"{url}/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert HTTP.post(f"{url}/generate", json={"input_ids": PROMPT}).status_code == 503
        r = HTTP.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]})
        assert r.status_code == 200, r.text
        assert rss_bytes() - rss_released > 0.6 * weight_bytes
        restored = engine.model.state_dict()
        assert all(torch.equal(restored[k], v) for k, v in weights.items())  # bit for bit
        after = greedy(url)
        assert after["output_ids"] == before["output_ids"]
        # same weights; the kernels may sum in another order on freshly aligned storage
        got, want = (torch.tensor([e[0] for e in x["meta_info"]["output_token_logprobs"]]) for x in (after, before))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert HTTP.get(f"{url}/health_generate").status_code == 200
        assert engine._spill_dir is None


def test_resume_refuses_unknown_tags():
    engine = TorchEngine()
    with engine.start_in_thread() as url:
        r = HTTP.post(f"{url}/resume_memory_occupation", json={"tags": ["weight"]})
        assert r.status_code == 400 and "unknown tags ['weight']" in r.json()["error"]
