"""The torch engine's prefix cache (rollout/torch_engine/prefix_cache.py): bounded LRU of earlier requests' KV,
reused by a later turn of a session under the weight version that computed it, dropped at every weight switch.

Tolerances (measured on the host, Intel Xeon, 2 cores, AVX-512, float32 tiny Qwen3): a reused prefix gives the
same token ids as no cache; its log-probs differ by float rounding only (the prefix's KV computed in other chunks:
measured 4.8e-7 at most over four greedy turns; bound 1e-5). After a switch the engine's answers equal, bit for bit,
those of a fresh engine loaded with the new weights that is sent the same requests."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slime_ascend.rollout.torch_engine.cli import build_parser
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model
from slime_ascend.rollout.torch_engine.prefix_cache import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_TOKENS, PrefixCache

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
LOGPROB_TOL = 1e-5  # measured 4.8e-7


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _lps(answer: dict) -> list[float]:
    return [e[0] for e in answer["meta_info"]["output_token_logprobs"]]


def _turns(engine: TorchEngine, history: list[int], n: int, seed: int, **payload) -> tuple[list[dict], list[int]]:
    """``n`` turns of one session: each prompt is the last one, its output and a new user message of 8 tokens."""
    answers = []
    for turn in range(n):
        answer = engine.generate({"input_ids": history, "sampling_params": GREEDY, "return_logprob": True, **payload})
        answers.append(answer)
        history = history + answer["output_ids"] + _ids(8, seed + turn)
    return answers, history


def _new_weights(model: torch.nn.Module, seed: int = 7) -> dict[str, torch.Tensor]:
    """A second weight version of ``model`` (every weight shifted by seeded noise), in the model's layout."""
    g = torch.Generator().manual_seed(seed)
    return {name: t + 0.3 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t.clone()
            for name, t in model.state_dict().items()}


def _fresh_with(state: dict[str, torch.Tensor], **kwargs) -> TorchEngine:
    engine = TorchEngine(return_original_logprob=False, **kwargs)
    engine.model.load_state_dict(state)
    return engine


# ---------------------------------------------------------------- the cache alone


def _kv(n: int, fill: float = 0.0):
    """A transformers DynamicCache of ``n`` positions (2 layers, 2 heads, head_dim 4)."""
    from transformers.cache_utils import DynamicCache

    kv = DynamicCache()
    for layer in range(2):
        k = torch.full((1, 2, n, 4), fill + layer)
        kv.update(k, k + 0.5, layer)
    return kv


def test_lru_bounds_longest_match_and_private_copies():
    cache = PrefixCache(max_tokens=10, max_entries=2)
    assert cache.insert([1, 2, 3, 4], _kv(4, 1.0), None, generation=0)
    assert cache.insert([1, 2, 9], _kv(3, 2.0), None, generation=0)
    # the longest common prefix wins (here the 4-token entry: 3 tokens in common), capped by limit
    hit = cache.match([1, 2, 3, 7, 7], limit=10)
    assert hit.length == 3 and hit.kv.get_seq_length() == 3 and float(hit.kv.layers[0].keys[0, 0, 0, 0]) == 1.0
    assert cache.match([1, 2, 3, 7, 7], limit=2).length == 2
    assert cache.match([5, 1, 2], limit=10) is None
    # the copy is private: extending it leaves the stored entry as it was
    hit.kv.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    assert cache.match([1, 2, 3, 4, 8], limit=10).kv.get_seq_length() == 4
    # an entry extended by a new one is replaced by it; the least recently used goes first beyond max_entries
    assert cache.insert([1, 2, 3, 4, 5, 6], _kv(6, 3.0), None, generation=0)
    assert cache.stats()["entries"] == 2 and cache.stats()["tokens"] == 9
    assert cache.insert([8, 8], _kv(2), None, generation=0)  # 11 tokens > 10: [1, 2, 9] (LRU) evicted
    stats = cache.stats()
    assert (stats["entries"], stats["tokens"], stats["evicted_entries"]) == (2, 8, 1)
    assert cache.match([1, 2, 9], limit=10).length == 2  # only [1, 2, 3, 4, 5, 6] is left for this prompt
    # refused: above max_tokens alone, a KV that does not hold the tokens, an old generation
    assert not cache.insert(list(range(11)), _kv(11), None, generation=0)
    assert not cache.insert([4, 4, 4], _kv(2), None, generation=0)
    assert not cache.insert([4, 4], _kv(2), None, generation=-1)
    stats = cache.stats()
    assert (stats["oversize"], stats["uncacheable"], stats["stale_inserts_refused"]) == (1, 1, 1)
    assert stats["prefill_tokens_saved"] == 3 + 2 + 4 + 2 and stats["hits"] == 4 and stats["lookups"] == 5


def test_switch_drops_everything_and_starts_a_generation():
    cache = PrefixCache(max_tokens=100, version="v0")
    cache.insert([1, 2, 3], _kv(3), None, generation=0)
    cache.insert([4, 5], _kv(2), None, generation=0)
    assert cache.versions() == ["v0", "v0"]
    assert cache.switch("v1") == (2, 5)
    assert cache.versions() == [] and cache.generation == 1 and cache.match([1, 2, 3, 4], limit=10) is None
    assert not cache.insert([1, 2, 3], _kv(3), None, generation=0)  # computed before the switch: refused
    assert cache.insert([1, 2, 3], _kv(3), None, generation=1) and cache.versions() == ["v1"]
    stats = cache.stats()
    assert (stats["invalidated_entries"], stats["invalidated_tokens"], stats["switches"]) == (2, 5, 1)
    off = PrefixCache(max_tokens=0)
    assert not off.enabled and not off.insert([1, 2], _kv(2), None, 0) and off.match([1, 2, 3], 5) is None
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(max_tokens=-1)


# ---------------------------------------------------------------- in the engine


def test_later_turns_reuse_their_prefix_with_the_same_tokens():
    cached = TorchEngine(return_original_logprob=False, prefix_cache_tokens=4096)
    plain = TorchEngine(return_original_logprob=False)
    history = _ids(40, 0)
    with_cache, _ = _turns(cached, history, 4, seed=100)
    without, _ = _turns(plain, history, 4, seed=100)
    worst = 0.0
    prompt_lens = []
    for a, b in zip(with_cache, without, strict=True):
        assert a["output_ids"] == b["output_ids"]
        worst = max(worst, max(abs(x - y) for x, y in zip(_lps(a), _lps(b), strict=True)))
        prompt_lens.append(a["meta_info"]["prompt_tokens"])
    assert worst <= LOGPROB_TOL
    # turn t reuses all of turn t-1 but its last output token (fed first now): prompt + 12 outputs - 1
    saved = [a["meta_info"]["cached_tokens"] for a in with_cache]
    assert saved == [0] + [n + GREEDY["max_new_tokens"] - 1 for n in prompt_lens[:-1]]
    assert all(b["meta_info"]["cached_tokens"] == 0 for b in without)
    stats = cached.server_info()["prefix_cache"]
    assert stats["prefill_tokens_saved"] == sum(saved) and stats["prompt_tokens"] == sum(prompt_lens)
    assert stats["entries"] == 1  # each turn's entry replaced the one it extends
    assert cached.server_info()["disable_radix_cache"] is False and plain.server_info()["disable_radix_cache"]
    assert plain.server_info()["prefix_cache"]["lookups"] == 0


def test_a_weight_switch_drops_the_old_versions_prefixes():
    engine = TorchEngine(return_original_logprob=False, prefix_cache_tokens=4096)
    _, history = _turns(engine, _ids(40, 1), 2, seed=200)
    before = engine.server_info()["prefix_cache"]
    assert before["entries"] == 1 and engine._prefix_cache.versions() == ["default"]
    state = _new_weights(engine.model)
    engine._switch_to(state, "v1", source="test")
    after = engine.server_info()["prefix_cache"]
    assert engine._prefix_cache.versions() == []  # nothing of the old version is left
    assert (after["entries"], after["tokens"], after["invalidated_entries"]) == (0, 0, 1)
    assert after["invalidated_tokens"] == before["tokens"] and after["weight_version"] == "v1"
    # the next turns equal a fresh engine with the new weights sent the same turns, bit for bit: the first
    # recomputes its whole prompt (it extends the old version's entry), the second reuses the first's (new version)
    answers, _ = _turns(engine, history, 2, seed=300)
    fresh, _ = _turns(_fresh_with(state, prefix_cache_tokens=4096), history, 2, seed=300)
    for a, b in zip(answers, fresh, strict=True):
        assert a["output_ids"] == b["output_ids"] and _lps(a) == _lps(b)
        assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"]
        assert a["meta_info"]["weight_version"] == "v1"
    assert answers[0]["meta_info"]["cached_tokens"] == 0 and answers[1]["meta_info"]["cached_tokens"] > 0
    assert engine._prefix_cache.versions() == ["v1"]


def test_an_old_prefix_kept_across_the_switch_would_change_the_tokens(monkeypatch):
    """What the switch's drop prevents (and what the test above would see): the old weights' KV reused under the
    new weights gives log-probs far from the new policy's."""
    engine = TorchEngine(return_original_logprob=False, prefix_cache_tokens=4096)
    _, history = _turns(engine, _ids(40, 1), 2, seed=200)
    state = _new_weights(engine.model)
    monkeypatch.setattr(engine._prefix_cache, "switch", lambda version: (0, 0))  # keeps entries and generation
    engine._switch_to(state, "v1", source="test")
    stale, _ = _turns(engine, history, 1, seed=300)
    fresh, _ = _turns(_fresh_with(state), history, 1, seed=300)
    assert stale[0]["meta_info"]["cached_tokens"] > 0
    # the answer names the version that computed the reused prefix, so a stale reuse is visible in the answer
    assert (stale[0]["meta_info"]["cached_weight_version"], stale[0]["meta_info"]["weight_version"]) == ("default", "v1")
    assert max(abs(x - y) for x, y in zip(_lps(stale[0]), _lps(fresh[0]), strict=True)) > 1e-2


def test_a_request_parked_across_a_switch_is_not_cached():
    """An ``in_place`` pause parks a request mid-decode; a switch goes through; it resumes on its old KV (as in
    SGLang) but its KV, part old version, is never inserted."""
    engine = TorchEngine(return_original_logprob=False, prefix_cache_tokens=4096)
    box: dict = {}
    payload = {"input_ids": _ids(20, 2), "sampling_params": {**GREEDY, "max_new_tokens": 400}}
    worker = threading.Thread(target=lambda: box.update(answer=engine.generate(payload)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while not engine._running and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.pause_generation("in_place")
    while engine._parked != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._parked == 1
    engine._switch_to(_new_weights(engine.model), "v1", source="test")
    engine.continue_generation()
    worker.join(timeout=300)
    assert box["answer"]["meta_info"]["weight_version"] == "v1"
    stats = engine.server_info()["prefix_cache"]
    assert (stats["entries"], stats["stale_inserts_refused"], stats["inserted_entries"]) == (0, 1, 0)


def test_scored_prompt_positions_are_computed_not_reused():
    cached = TorchEngine(return_original_logprob=False, prefix_cache_tokens=4096)
    plain = TorchEngine(return_original_logprob=False)
    _, history = _turns(cached, _ids(30, 3), 1, seed=400)
    start = 10
    body = {"input_ids": history, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": start,
            "top_logprobs_num": 2}
    a, b = cached.generate(body), plain.generate(body)
    assert a["meta_info"]["cached_tokens"] == start  # the scored positions from start on are fed
    assert a["output_ids"] == b["output_ids"]
    for key in ("input_token_logprobs", "input_top_logprobs"):
        assert len(a["meta_info"][key]) == len(b["meta_info"][key]) == len(history) - start
    got = [e[0] for e in a["meta_info"]["input_token_logprobs"][1:]]
    want = [e[0] for e in b["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= LOGPROB_TOL
    assert a["meta_info"]["input_top_logprobs"][1][0][1] == b["meta_info"]["input_top_logprobs"][1][0][1]


def test_flush_and_memory_release_empty_the_cache():
    engine = TorchEngine(return_original_logprob=False, prefix_cache_tokens=4096)
    _turns(engine, _ids(20, 4), 1, seed=500)
    assert engine.flush_cache() == {"success": True, "message": "flushed 1 cached prefixes"}
    _turns(engine, _ids(20, 4), 1, seed=500)
    assert engine.server_info()["prefix_cache"]["entries"] == 1
    engine.release_memory_occupation()
    assert engine.server_info()["prefix_cache"]["entries"] == 0
    engine.resume_memory_occupation()
    assert engine.server_info()["prefix_cache"]["flushed_entries"] == 2


def test_moe_routes_of_a_reused_prefix_are_those_of_no_cache(tmp_path):
    moe = save_model(load_model(None, moe=True, seed=1), tmp_path / "moe")
    cached = TorchEngine(str(moe), prefix_cache_tokens=4096)
    plain = TorchEngine(str(moe))
    history = _ids(20, 5)
    a, _ = _turns(cached, history, 1, seed=600)  # no routes asked for: the entry keeps them anyway
    follow = {"input_ids": history + a[0]["output_ids"] + _ids(8, 600), "sampling_params": GREEDY,
              "return_routed_experts": True}
    got, want = cached.generate(follow), plain.generate(follow)
    assert got["meta_info"]["cached_tokens"] == len(history) + GREEDY["max_new_tokens"] - 1
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["routed_experts"] == want["meta_info"]["routed_experts"]


def test_serve_torch_flags():
    args = build_parser().parse_args([])
    assert (args.prefix_cache_tokens, args.prefix_cache_entries) == (DEFAULT_MAX_TOKENS, DEFAULT_MAX_ENTRIES) == (0, 256)
    args = build_parser().parse_args(["--prefix-cache-tokens", "65536", "--prefix-cache-entries", "8"])
    assert (args.prefix_cache_tokens, args.prefix_cache_entries) == (65536, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefix-cache-tokens", "-1"])


@torch.no_grad()
def test_glm5_keeps_its_dsa_selection_after_a_cache_and_serves_with_the_prefix_cache(tmp_path):
    """The tiny GLM-5 (transformers 5.12's GlmMoeDsa, index_topk 8, IndexShare): transformers' attention, given the
    boolean SDPA mask of a chunk that follows a cache, attends densely (the indexer's top-k lost; measured 0.31 to
    0.70 from the full forward's logits). The engine's aligned attention hands it the additive mask: the chunk is
    the full forward within fp32 rounding (measured 1.2e-7), so the engine serves GLM-5 with its prefix cache, and
    later turns reuse their prefix with the tokens and key sets of no cache."""
    from slime_ascend.dsa.index_sets import canonical_sets, load_records
    from slime_ascend.rollout.torch_engine.prefix_cache import unsupported

    model = load_model(None, glm5=True, seed=1)
    ids = torch.tensor([_ids(40, 6)])
    full = model(input_ids=ids, use_cache=True).logits[0]
    past = model(input_ids=ids[:, :20], use_cache=True).past_key_values
    chunk = model(input_ids=ids[:, 20:], past_key_values=past, use_cache=True).logits[0]
    assert (chunk - full[20:]).abs().max() <= 1e-5
    assert unsupported(model) is None
    for layer in model.model.layers:  # transformers' attention as it is: refused, and the gap it would make
        layer.self_attn.__class__ = type(layer.self_attn).__mro__[1]
    assert "DSA indexers" in unsupported(model)
    past = model(input_ids=ids[:, :20], use_cache=True).past_key_values
    assert (model(input_ids=ids[:, 20:], past_key_values=past, use_cache=True).logits[0] - full[20:]).abs().max() > 0.1

    path = save_model(load_model(None, glm5=True, seed=1), tmp_path / "glm5")
    cached = TorchEngine(str(path), return_original_logprob=False, prefix_cache_tokens=4096,
                         dump_dsa_index_sets=tmp_path / "cached")
    plain = TorchEngine(str(path), return_original_logprob=False, dump_dsa_index_sets=tmp_path / "plain")
    history = _ids(20, 9)
    with_cache, _ = _turns(cached, history, 3, seed=300)
    without, _ = _turns(plain, history, 3, seed=300)
    for a, b in zip(with_cache, without, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(_lps(a), _lps(b), strict=True)) <= LOGPROB_TOL
    assert [a["meta_info"]["cached_tokens"] for a in with_cache][1:] == [20 + 11, 20 + 12 + 8 + 11]
    # the positions each cached turn computed read the key sets the uncached turn read there
    for got, want in zip(load_records(tmp_path / "cached", "rollout-*.pt"), load_records(tmp_path / "plain",
                                                                                         "rollout-*.pt")):
        assert got["tokens"] == want["tokens"]
        for layer, sets in got["layers"].items():
            theirs = want["layers"][layer][got["start"]:]
            assert torch.equal(canonical_sets(sets, 8), canonical_sets(theirs, 8)), (got["start"], layer)
