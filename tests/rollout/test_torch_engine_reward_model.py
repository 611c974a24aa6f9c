"""The torch engine serving a reward model: SGLang's ``/classify`` answers equal the HF model's own scores."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, save_model
from slime_ascend.rollout.torch_engine.reward_model import (RewardModelEngine, is_reward_checkpoint, reward_scores,
                                                            tiny_reward_model)
from torch_engine_fixtures import served


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    return {seed: save_model(tiny_reward_model(seed=seed), root / f"rm{seed}", build_byte_tokenizer())
            for seed in (0, 1)}




def post(url: str, body) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_classify_answers_the_hf_models_scores_in_sglangs_shape(reward_dirs):
    directory = reward_dirs[0]
    assert is_reward_checkpoint(directory) and not is_reward_checkpoint(None)
    engine = RewardModelEngine(directory, max_batch_size=4, max_prompt_tokens=64)
    reference = tiny_reward_model(seed=0)
    tok = build_byte_tokenizer()
    texts = ["What is 2+2? 4", "What is 2+2? 5", "x"]
    with served(engine) as url:
        status, one = post(url + "/classify", {"text": texts[0]})
        assert status == 200 and set(one) == {"embedding", "meta_info"}
        assert one["embedding"] == pytest.approx(reward_scores(reference, [tok.encode(texts[0])])[0], abs=1e-6)
        assert one["meta_info"]["prompt_tokens"] == len(tok.encode(texts[0]))
        status, many = post(url + "/classify", {"text": texts})
        assert status == 200 and isinstance(many, list) and len(many) == 3
        want = reward_scores(reference, [tok.encode(t) for t in texts])
        for answer, scores in zip(many, want):
            assert answer["embedding"] == pytest.approx(scores, abs=1e-6)
        assert len({a["embedding"][0] for a in many}) == 3  # a score of the text, not a constant
        status, by_ids = post(url + "/classify", {"input_ids": tok.encode(texts[1])})
        assert by_ids["embedding"] == pytest.approx(want[1], abs=1e-6)
        info = get(url + "/get_model_info")
        assert info["is_generation"] is False and info["architectures"] == ["Qwen3ForSequenceClassification"]
        assert get(url + "/server_info")["is_embedding"] is True
        # generation is refused in one line naming /classify; bad and oversized requests are client errors
        status, answer = post(url + "/generate", {"text": "hi"})
        assert status == 400 and "/classify" in answer["error"] and "\n" not in answer["error"]
        for body, code, phrase in (({"text": "a", "input_ids": [1]}, 400, "exactly one of"),
                                   ({"text": []}, 400, "non-empty list"),
                                   ({"input_ids": []}, 400, "list of token ids"),
                                   ({"input_ids": [5000]}, 400, "outside"),
                                   ({"text": "a", "colour": 1}, 400, "unknown /classify keys"),
                                   ({"text": ["a"] * 5}, 413, "--max-batch-size"),
                                   ({"text": "a" * 65}, 413, "--max-prompt-tokens"),
                                   ({"text": "a" * 5000}, 413, "--max-prompt-tokens")):
            status, answer = post(url + "/classify", body)
            assert status == code and phrase in answer["error"], (body, answer)


def test_a_weight_update_from_disk_serves_the_new_scores_and_refuses_another_architecture(reward_dirs, tmp_path):
    engine = RewardModelEngine(reward_dirs[0])
    tok = build_byte_tokenizer()
    ids = tok.encode("the answer is 4")
    before = engine.classify({"input_ids": ids})["embedding"]
    with served(engine) as url:
        status, answer = post(url + "/update_weights_from_disk", {"model_path": str(reward_dirs[1]),
                                                                  "weight_version": "7"})
        assert status == 200 and answer["success"] is True
        after = post(url + "/classify", {"input_ids": ids})[1]
        assert after["meta_info"]["weight_version"] == "7"
        assert after["embedding"] == pytest.approx(reward_scores(tiny_reward_model(seed=1), [ids])[0], abs=1e-6)
        assert after["embedding"] != pytest.approx(before, abs=1e-6)
        wider = save_model(tiny_reward_model(seed=0, num_labels=2), tmp_path / "rm-2labels", tok)
        status, answer = post(url + "/update_weights_from_disk", {"model_path": str(wider)})
        assert answer["success"] is False and "another architecture" in answer["message"]
        assert get(url + "/get_weight_version")["weight_version"] == "7"  # still serving the last good one


def test_serve_torch_refuses_generation_only_flags_for_a_reward_model_in_one_line(reward_dirs):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--model", str(reward_dirs[0]),
                          "--port", "0", "--enable-return-routed-experts"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "reward model" in lines[0] and "--enable-return-routed-experts" in lines[0], out.stderr
