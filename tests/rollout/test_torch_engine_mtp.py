"""The torch engine with a checkpoint's MTP layer (GLM-5's ``model.layers.<num_hidden_layers>.*``, the tiny GLM-5 of
``slime_ascend.rollout.torch_engine.tiny_mtp``): the layer is held with the model (its weights in the model's state, switched by
every weight update in one version; a push without them refused by name), and NEXTN / EAGLE speculation drafts
with it. The speculative RL contract on an MoE + DSA model: greedy answers equal plain decoding token for token and
route for route; sampled answers carry the served model's log-probs (a plain full-sequence forward's within 1e-6
in fp32, plus two float32 epsilons of their size) and the routes and DSA key sets a plain forward of the same tokens records; acceptance is reported per
request and per weight version, and the engine's acceptance moves when a push changes the MTP layer."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from slime_ascend.rollout.torch_engine.tiny_mtp import save_tiny_glm5_with_mtp
from slime_ascend.rollout.torch_engine.engine import RequestError, TorchEngine
from slime_ascend.rollout.torch_engine.model import RouteRecorder, load_model, read_checkpoint
from slime_ascend.rollout.torch_engine.mtp import mtp_layers

PROMPT = [1, 5, 7, 9, 11, 13, 2, 4]
# log-probs: 1e-6 absolute plus two float32 epsilons of their size (at |log p| ~ 7 one float32 ulp is 4.8e-7: the
# verifying forward of 4 tokens and a full-sequence forward sum in other orders; measured at most 9.5e-7, 2 ulps)
LOGPROB_TOL = {"atol": 1e-6, "rtol": 2.4e-7}
MTP_PREFIX = "model.layers.4."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_glm5_with_mtp(tmp_path_factory.mktemp("glm5-mtp") / "tiny-glm5-mtp")


def _body(**sampling):
    return {"input_ids": PROMPT, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 20, "ignore_eos": True, **sampling}}


def _routes(answer):
    return np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype=np.int32)


def _plain_forward(model, ids):
    """Log-probs of ``ids[1:]`` and the routes of ``ids[:-1]`` from one full-sequence forward."""
    recorder = RouteRecorder.for_model(model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    lps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return lps, recorder.take(len(ids) - 1).numpy().reshape(-1)


def test_the_mtp_layer_is_held_with_the_model_and_a_push_without_it_is_refused(ckpt, tmp_path):
    engine = TorchEngine(model_path=ckpt, enable_return_routed_experts=True)
    assert len(mtp_layers(engine.model)) == 1
    state = read_checkpoint(ckpt, torch.float32).state
    mtp = sorted(n for n in state if n.startswith(MTP_PREFIX))
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.self_attn.indexer.wk.weight"} <= set(mtp)
    held = engine.model.state_dict()
    assert torch.equal(held["model.layers.4.eh_proj.weight"], state["model.layers.4.eh_proj.weight"])
    # the main forward does not run it: the answer is the same as the model's without an MTP layer
    assert engine.generate(_body(temperature=0.0))["output_ids"]
    without = {n: t for n, t in state.items() if not n.startswith(MTP_PREFIX)}
    with pytest.raises(RequestError, match=r"missing=\['model\.layers\.4\."):
        _push_disk(engine, without, ckpt, tmp_path)
    assert engine.weight_version == "default"  # refused whole: nothing switched


def _push_disk(engine, state, ckpt, out):
    import shutil

    from safetensors.torch import save_file

    out = out / "push"
    out.mkdir()
    for name in ("config.json",):
        shutil.copy(ckpt / name, out / name)
    save_file({n: t.contiguous() for n, t in state.items()}, str(out / "model.safetensors"))
    return engine.update_weights_from_disk(str(out))


def test_nextn_greedy_equals_plain_decoding_token_for_token_and_route_for_route(ckpt):
    plain = TorchEngine(model_path=ckpt, enable_return_routed_experts=True)
    spec = TorchEngine(model_path=ckpt, enable_return_routed_experts=True, speculative_algorithm="NEXTN",
                       speculative_num_steps=3)
    a, b = plain.generate(_body(temperature=0.0)), spec.generate(_body(temperature=0.0))
    assert b["output_ids"] == a["output_ids"]
    assert np.array_equal(_routes(a), _routes(b))
    got = torch.tensor([e[0] for e in b["meta_info"]["output_token_logprobs"]])
    want = torch.tensor([e[0] for e in a["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, want, **LOGPROB_TOL)
    assert b["meta_info"]["spec_verify_ct"] >= 1
    info = spec.server_info()
    assert info["speculative_algorithm"] == "EAGLE" and info["speculative_draft_model_path"] == str(ckpt)


def test_nextn_sampled_tokens_carry_the_served_models_log_probs_and_routes(ckpt):
    spec = TorchEngine(model_path=ckpt, enable_return_routed_experts=True, speculative_algorithm="EAGLE",
                       speculative_num_steps=3)
    model = load_model(ckpt, torch.float32)
    accepted = []
    for seed in range(3):
        answer = spec.generate(_body(temperature=1.0, sampling_seed=seed))
        ids = PROMPT + answer["output_ids"]
        lps, routes = _plain_forward(model, ids)
        got = torch.tensor([e[0] for e in answer["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, lps[len(PROMPT) - 1:], **LOGPROB_TOL), float((got - lps[len(PROMPT) - 1:]).abs().max())
        assert np.array_equal(_routes(answer), routes)  # the fed tokens: the prompt and the outputs but the last
        meta = answer["meta_info"]
        assert meta["spec_accept_token_num"] + meta["spec_verify_ct"] == len(answer["output_ids"]) - 1
        accepted.append(meta["spec_accept_length"])
    # the untrained tiny MTP layer against a near-uniform tiny model: drafts are kept at temperature 1
    assert max(accepted) > 1, accepted


def test_a_push_switches_the_mtp_layer_with_the_model(ckpt, tmp_path, caplog):
    spec = TorchEngine(model_path=ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3)
    spec.generate(_body(temperature=1.0, sampling_seed=0))
    state = read_checkpoint(ckpt, torch.float32).state
    moved = dict(state)
    moved[MTP_PREFIX + "eh_proj.weight"] = state[MTP_PREFIX + "eh_proj.weight"] * 50  # a draft that proposes worse
    with caplog.at_level("INFO", logger="slime_ascend.rollout.engine"):
        _push_disk(spec, moved, ckpt, tmp_path)
    assert torch.equal(spec.model.state_dict()[MTP_PREFIX + "eh_proj.weight"], moved[MTP_PREFIX + "eh_proj.weight"])
    assert spec.weight_version == "1"
    spec.generate(_body(temperature=1.0, sampling_seed=0))
    by_version = spec.server_info()["spec_accept_length_by_version"]
    assert set(by_version) == {"default", "1"}, by_version
    assert "speculative decoding under weight version default: accept length" in caplog.text


def _records(directory):
    return [torch.load(p, weights_only=False) for p in sorted(directory.glob("rollout-*.pt"))]


def _key_sets(record):
    return {layer: [frozenset(int(i) for i in row if i >= 0) for row in rows] for layer, rows in record["layers"].items()}


def test_nextn_records_the_dsa_key_sets_a_plain_forward_of_the_same_tokens_reads(ckpt, tmp_path):
    spec = TorchEngine(model_path=ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3,
                       dump_dsa_index_sets=tmp_path / "spec")
    plain = TorchEngine(model_path=ckpt, dump_dsa_index_sets=tmp_path / "plain")
    answer = spec.generate(_body(temperature=1.0, sampling_seed=3))
    assert answer["meta_info"]["spec_verify_ct"] >= 1
    ids = PROMPT + answer["output_ids"]
    # the plain engine reads the same tokens in one prefill: every fed position's key sets in one forward
    plain.generate({"input_ids": ids[:-1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    (got,), (want,) = _records(tmp_path / "spec"), _records(tmp_path / "plain")
    assert got["tokens"] == ids[:-1] == want["tokens"]
    assert _key_sets(got) == _key_sets(want)


def test_the_cached_draft_equals_the_uncached_reference_row_by_row(ckpt):
    """MTPDraft.draft (the layer's own KV cache: the known rows fed once, the chained rows cut off after each step)
    against MTPDraft.step (every row recomputed from scratch), greedy, over two steps of one request."""
    from slime_ascend.rollout.torch_engine.mtp import MTPDraft, MTPDraftState

    model = load_model(ckpt, torch.float32)
    draft, state = MTPDraft(model), MTPDraftState()
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(2):
            hidden = model.model(input_ids=torch.tensor([seq[:-1]])).last_hidden_state[0]
            got = draft.draft(state, hidden, seq, 3, lambda row: int(torch.argmax(row)))
            want, rows_h, rows_x = [], hidden, list(seq[1:])
            for _ in range(3):
                logits, out = draft.step(rows_h, rows_x)
                want.append(int(torch.argmax(logits)))
                rows_h, rows_x = torch.cat([rows_h, out.unsqueeze(0)]), rows_x + [want[-1]]
            assert got == want
            assert state.rows == len(seq) - 1 and state.cache.get_seq_length() == len(seq) - 1
            seq = seq + got[:2]  # two drafts kept, as a verifying forward might


def test_a_confident_model_and_its_agreeing_mtp_layer_meet_slimes_ci_bounds(tmp_path):
    """``make_next_token_confident`` (the model slime's ``--ci-test`` job trains, tests/e2e/test_slime_glm5_mtp_cpu.py):
    sampled at temperature 1, a token's mean log-prob in (-1, 0) and the mean entropy in (0, 1) (slime's rollout
    bounds); the MTP layer's loss on the sampled continuations below slime's 1.0; speculation accepts most drafts; and
    the MTP layer as drawn (``mtp_agrees=False``) does not agree, so the agreement is the rewrite's."""
    from slime_ascend.rollout.torch_engine.mtp import MTPDraft
    from slime_ascend.rollout.torch_engine.tiny_mtp import make_next_token_confident

    def measure(agrees: bool):
        checkpoint = make_next_token_confident(save_tiny_glm5_with_mtp(tmp_path / f"agrees-{agrees}"), mtp_agrees=agrees)
        engine = TorchEngine(model_path=checkpoint, speculative_algorithm="NEXTN", speculative_num_steps=3)
        draft = MTPDraft(engine.model)
        lps, entropies, losses, accepts = [], [], [], []
        for seed in range(4):
            prompt = [3 + (11 * seed + 5 * j) % 250 for j in range(12)]
            answer = engine.generate({"input_ids": prompt, "return_logprob": True, "sampling_params": {
                "max_new_tokens": 20, "ignore_eos": True, "temperature": 1.0, "sampling_seed": seed}})
            ids, start = prompt + answer["output_ids"], len(prompt) - 1
            lps += [x[0] for x in answer["meta_info"]["output_token_logprobs"]]
            accepts.append(answer["meta_info"]["spec_accept_length"])
            with torch.no_grad():
                logp = engine.model(input_ids=torch.tensor([ids[:-1]])).logits[0, start:].float().log_softmax(-1)
                entropies += (-(logp.exp() * logp).sum(-1)).tolist()
                hidden = engine.model.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
                rows = draft.logits(draft.rows(hidden[start:-1], ids[start + 1:-1]))
                losses.append(float(torch.nn.functional.cross_entropy(rows, torch.tensor(ids[start + 2:]))))
        return sum(lps) / len(lps), sum(entropies) / len(entropies), sum(losses) / len(losses), min(accepts)

    lp, entropy, loss, accept = measure(True)
    print(f"confident: mean log-prob {lp:.3f}, entropy {entropy:.3f}, MTP loss {loss:.3f}, accept length >= {accept:.2f}")
    assert -1 < lp < 0 and 0 < entropy < 1 and loss < 1.0 and accept > 2.5
    _, _, drawn_loss, _ = measure(False)
    print(f"MTP layer as drawn: loss {drawn_loss:.3f}")
    assert drawn_loss > 3.0
