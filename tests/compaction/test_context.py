"""CompactionRL token-level context rules: trigger, atomic tail, rebuild, segment masks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.compaction.context import (
    CompactionConfig,
    Pair,
    SegmentBuilder,
    rebuild_context,
    should_compact,
    tail_pairs,
)


def test_trigger_boundary_exactly_at_threshold_does_not_fire():
    cfg = CompactionConfig(budget=20000, trigger_tokens=10240)
    at = 20000 - 10240  # C - |h| == T_comp
    assert not should_compact(at, cfg, compactions_done=0, new_pairs=1)
    assert should_compact(at + 1, cfg, compactions_done=0, new_pairs=1)  # C - |h| == T_comp - 1
    assert not should_compact(at - 1, cfg, compactions_done=0, new_pairs=1)


def test_trigger_respects_max_compactions_and_needs_a_new_pair():
    cfg = CompactionConfig(budget=100, trigger_tokens=50, max_compactions=3)
    assert should_compact(90, cfg, compactions_done=2, new_pairs=1)
    assert not should_compact(90, cfg, compactions_done=3, new_pairs=1)
    assert not should_compact(90, cfg, compactions_done=0, new_pairs=0)
    assert not should_compact(90, CompactionConfig(budget=100, trigger_tokens=50, max_compactions=0),
                              compactions_done=0, new_pairs=5)


def test_defaults_match_paper():
    cfg = CompactionConfig(budget=65536)
    assert (cfg.trigger_tokens, cfg.max_compactions, cfg.keep_pairs) == (10240, 3, 2)


@pytest.mark.parametrize("kwargs", [dict(budget=0), dict(budget=10, trigger_tokens=-1),
                                    dict(budget=10, max_compactions=-1), dict(budget=10, keep_pairs=-1)])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        CompactionConfig(**kwargs)


@settings(max_examples=100, deadline=None)
@given(budget=st.integers(1, 5000), trigger=st.integers(0, 5000), length=st.integers(0, 6000),
       done=st.integers(0, 5), cap=st.integers(0, 5), new=st.integers(0, 3))
def test_trigger_matches_reference(budget, trigger, length, done, cap, new):
    cfg = CompactionConfig(budget=budget, trigger_tokens=trigger, max_compactions=cap)
    remaining = budget - length
    expected = (remaining < trigger) and (done < cap) and (new >= 1)
    assert should_compact(length, cfg, compactions_done=done, new_pairs=new) == expected


pair_st = st.builds(Pair, st.lists(st.integers(0, 999), min_size=0, max_size=6).map(tuple),
                    st.lists(st.integers(1000, 1999), min_size=0, max_size=6).map(tuple))


@settings(max_examples=100, deadline=None)
@given(head=st.lists(st.integers(0, 99), max_size=8), pairs=st.lists(pair_st, max_size=7), k=st.integers(0, 9))
def test_rebuild_is_head_plus_last_k_whole_pairs(head, pairs, k):
    tokens, spans = rebuild_context(head, pairs, k)
    kept = pairs[max(0, len(pairs) - k):] if k else []
    expected = list(head)
    for p in kept:  # reference: whole pairs, in order
        expected += list(p.action) + list(p.observation)
    assert tokens == expected
    assert tail_pairs(pairs, k) == kept
    # spans tile the context, nothing trainable, and each tail pair appears as action then observation
    assert all(not s.trainable for s in spans)
    pos = 0
    for s in spans:
        assert s.start == pos and s.end > s.start
        pos = s.end
    assert pos == len(tokens)
    kinds = [s.kind for s in spans if s.kind.startswith("tail")]
    nonempty = [(p.action, p.observation) for p in kept]
    assert kinds == [kind for a, o in nonempty for kind, part in (("tail_action", a), ("tail_observation", o)) if part]


def test_tail_never_splits_a_pair():
    pairs = [Pair((1, 2), (3,)), Pair((4,), (5, 6, 7)), Pair((8,), (9,))]
    tokens, _ = rebuild_context([0], pairs, 2)
    assert tokens == [0, 4, 5, 6, 7, 8, 9]
    assert tail_pairs(pairs, 5) == pairs and tail_pairs(pairs, 0) == []


def test_segment_builder_masks_and_log_probs_align():
    b = SegmentBuilder([7, 7, 7])
    b.append("action", [1, 2], log_probs=[-0.1, -0.2])
    b.append("observation", [3, 4, 5])
    b.append("summary_request", [6])
    b.append("summary", [8], log_probs=[-0.3])
    seg = b.build()
    assert seg.tokens == [7, 7, 7, 1, 2, 3, 4, 5, 6, 8]
    assert seg.prompt_length == 3 and seg.response_length == 7
    assert seg.loss_mask == [1, 1, 0, 0, 0, 0, 1]
    assert seg.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.3]
    assert [(s.kind, s.start, s.end, s.trainable) for s in seg.spans] == [
        ("prompt", 0, 3, False), ("action", 3, 5, True), ("observation", 5, 8, False),
        ("summary_request", 8, 9, False), ("summary", 9, 10, True)]


def test_segment_builder_rejects_misaligned_log_probs():
    b = SegmentBuilder([1])
    with pytest.raises(ValueError, match="log-prob"):
        b.append("action", [1, 2], log_probs=[-0.1])
    with pytest.raises(ValueError, match="log-prob"):
        b.append("summary", [1])
    with pytest.raises(ValueError, match="must not carry"):
        b.append("observation", [1], log_probs=[0.0])
