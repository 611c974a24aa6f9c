"""Speculative decoding in the torch engine (``serve-torch --speculative-algorithm STANDALONE``): greedy answers equal
the engine's own non-speculative ones token for token; every returned token's log-prob is the served model's (a
plain full-sequence forward's within 1e-6 in fp32), sampled or greedy, whatever the draft; acceptance is reported per
request (SGLang's ``spec_verify_ct``) and per weight version."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model, score_tokens

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {name: save_model(load_model(None, seed=seed), root / name) for name, seed in (("target", 0), ("other", 1))}


def _body(**sampling):
    return {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **sampling}}


def _served_log_probs(model, answer, temperature=1.0):
    ids = PROMPT + answer["output_ids"]
    return score_tokens(model, ids, temperature)[len(PROMPT) - 1:]


@pytest.mark.parametrize("draft", ["target", "other"])
def test_greedy_tokens_equal_the_plain_engines_and_log_probs_are_the_served_models(dirs, draft):
    plain = TorchEngine(model_path=dirs["target"])
    spec = TorchEngine(model_path=dirs["target"], speculative_draft_model_path=dirs[draft], speculative_num_steps=4)
    a, b = plain.generate(_body(temperature=0.0)), spec.generate(_body(temperature=0.0))
    assert b["output_ids"] == a["output_ids"]
    got = torch.tensor([e[0] for e in b["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, _served_log_probs(load_model(dirs["target"]), b), atol=1e-6)
    meta = b["meta_info"]
    # one token from the prefill, the rest from verifying forwards; the draft that is the model keeps all 4 drafts
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] * meta["spec_verify_ct"] == 23
    # SGLang's counts, which slime's rollout metrics read: kept drafts plus one token per forward is every token
    assert meta["spec_accept_token_num"] + meta["spec_verify_ct"] == 23
    assert meta["spec_accept_token_num"] <= meta["spec_draft_token_num"] <= 4 * meta["spec_verify_ct"]
    if draft == "target":
        assert meta["spec_accept_length"] > 4
    info = spec.server_info()
    assert info["speculative_algorithm"] == "STANDALONE" and info["spec_verify_ct_by_version"] == {
        "default": meta["spec_verify_ct"]}


def test_sampled_tokens_carry_the_served_models_log_probs_at_the_temperature(dirs):
    spec = TorchEngine(model_path=dirs["target"], speculative_draft_model_path=dirs["target"], speculative_num_steps=3)
    target = load_model(dirs["target"])
    for seed in range(3):
        answer = spec.generate(_body(temperature=0.8, top_k=50, sampling_seed=seed))
        got = torch.tensor([e[0] for e in answer["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, _served_log_probs(target, answer, 0.8), atol=1e-6)
        assert answer["meta_info"]["spec_accept_length"] > 1  # the draft that is the model: drafts are kept


def test_acceptance_is_counted_per_weight_version(dirs, caplog):
    spec = TorchEngine(model_path=dirs["target"], speculative_draft_model_path=dirs["target"], speculative_num_steps=2)
    spec.generate(_body(temperature=0.0))
    with caplog.at_level("INFO", logger="slime_ascend.rollout.engine"):
        spec.update_weights_from_disk(str(dirs["other"]), weight_version="2")  # the policy moved; the draft did not
    spec.generate(_body(temperature=0.0))
    by_version = spec.server_info()["spec_accept_length_by_version"]
    assert set(by_version) == {"default", "2"} and by_version["default"] > by_version["2"], by_version
    # the engine's log says how the draft kept up with each version as the next one comes in
    assert f"speculative decoding under weight version default: accept length {by_version['default']:.2f}" \
        in caplog.text


def test_unsupported_combinations_are_refused(dirs, tmp_path):
    with pytest.raises(ValueError, match="prefix cache"):
        TorchEngine(model_path=dirs["target"], speculative_draft_model_path=dirs["target"], speculative_num_steps=2,
                    prefix_cache_tokens=1024)
    with pytest.raises(ValueError, match="has no MTP layer"):  # NEXTN / EAGLE draft with the checkpoint's own
        TorchEngine(model_path=dirs["target"], speculative_algorithm="NEXTN", speculative_num_steps=2)
    with pytest.raises(ValueError, match="is another model"):
        TorchEngine(model_path=dirs["target"], speculative_algorithm="EAGLE", speculative_num_steps=2,
                    speculative_draft_model_path=dirs["other"])
    with pytest.raises(ValueError, match="needs a draft model"):
        TorchEngine(model_path=dirs["target"], speculative_num_steps=2)
    wide = save_model(load_model(None, config_overrides={"vocab_size": 512}), tmp_path / "v512")
    with pytest.raises(ValueError, match="one vocabulary"):
        TorchEngine(model_path=dirs["target"], speculative_draft_model_path=wide, speculative_num_steps=2)
    out = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--speculative-algorithm",
                          "STANDALONE", "--speculative-draft-model-path", str(dirs["target"]),
                          "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "3"],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1 and "--speculative-num-draft-tokens 4" in lines[0], out.stderr
    out = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--speculative-algorithm", "EAGLE",
                          "--speculative-num-steps", "3", "--speculative-eagle-topk", "4"],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1 and "--speculative-eagle-topk 1" in lines[0], out.stderr
