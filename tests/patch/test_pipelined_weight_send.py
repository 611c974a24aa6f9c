"""train.pipelined_weight_send on slime's real UpdateWeightFromDistributed: slime's own _send_weights loop with
each bucket's send (slime's own _update_bucket_weights_from_distributed, lock and all) on a sender thread while
the next bucket is made; buckets sent in order, one at a time, the lock always released, a failure raised after the
bucket in flight ended; a subclass untouched; the target checked."""

from __future__ import annotations

import threading
import time
import types

import pytest

from slime_ascend import patch

pytestmark = pytest.mark.slime

MODULE = "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
PATCH_ID = "train.pipelined_weight_send"


@pytest.fixture
def module():
    import importlib

    pytest.importorskip("megatron.core")
    mod = importlib.import_module(MODULE)
    p = patch.get(PATCH_ID)
    assert p.check({MODULE: mod}) == []
    p.install(modules={MODULE: mod})
    try:
        yield mod
    finally:
        p.remove()


class Lock:
    """slime's engine lock actor, its .remote() calls reduced to calls."""

    def __init__(self, log):
        self.log, self.held = log, False
        self.acquire = types.SimpleNamespace(remote=self._acquire)
        self.release = types.SimpleNamespace(remote=self._release)

    def _acquire(self):
        if self.held:
            return False
        self.held = True
        self.log.append(("acquire", None))
        return True

    def _release(self):
        assert self.held
        self.held = False
        self.log.append(("release", None))
        return True


def _updater(mod, log, chunks, fail_after=None, cls=None):
    """An UpdateWeightFromDistributed (or ``cls``) whose two passes yield ``chunks`` (lists of bucket names)."""
    updater = object.__new__(cls or mod.UpdateWeightFromDistributed)
    updater._group_name, updater._model_update_groups, updater.weight_version = "g", object(), 3
    updater.rollout_engines, updater.rollout_engine_lock = [], Lock(log)

    def passes(names):
        def it():
            for i, name in enumerate(names):
                if fail_after is not None and name == fail_after:
                    raise RuntimeError(f"gather failed before {name}")
                log.append(("made", name))
                yield [(name, None)]
        return it

    updater._iter_non_expert_chunks, updater._iter_expert_chunks = passes(chunks[0]), passes(chunks[1])
    return updater


@pytest.fixture
def wire(monkeypatch, module):
    """slime's update_weights_from_distributed and ray.get as recorders; the send of a bucket takes 50 ms."""
    log: list[tuple[str, object]] = []
    lock = threading.Lock()

    def send(group_name, group, weight_version, rollout_engines, converted_named_tensors, load_format=None):
        names = [n for n, _ in converted_named_tensors]
        with lock:
            log.append(("send start", names[0]))
        time.sleep(0.05)
        with lock:
            log.append(("send end", names[0]))
        return []

    monkeypatch.setattr(module, "update_weights_from_distributed", send)
    monkeypatch.setattr(module.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(module, "get_gloo_group", lambda: None)
    monkeypatch.setattr(module.dist, "barrier", lambda group=None: log.append(("barrier", None)))
    return log


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def test_each_bucket_is_sent_while_the_next_is_made(module, wire):
    updater = _updater(module, wire, [["a", "b", "c"], ["e1", "e2"]])
    bar = Bar()
    updater._send_weights(bar)
    order = [name for kind, name in wire if kind == "send start"]
    assert order == ["a", "b", "c", "e1", "e2"] and bar.n == 5
    events = [(k, n) for k, n in wire]
    assert events.index(("made", "b")) < events.index(("send end", "a"))  # bucket b made while a was sent
    assert events.index(("made", "e2")) < events.index(("send end", "e1"))
    # one at a time: each send starts after the one before ended, under the lock
    sends = [(k, n) for k, n in wire if k.startswith("send")]
    assert sends == [(k, n) for n in order for k in ("send start", "send end")]
    assert not updater.rollout_engine_lock.held and wire.count(("acquire", None)) == wire.count(("release", None)) == 5
    assert wire.count(("barrier", None)) == 2


def test_a_failure_while_a_bucket_is_in_flight_ends_it_and_raises(module, wire):
    updater = _updater(module, wire, [["a", "b", "c"], []], fail_after="c")
    with pytest.raises(RuntimeError, match="gather failed before c"):
        updater._send_weights(Bar())
    assert [n for k, n in wire if k == "send end"] == ["a", "b"]  # b, in flight at the failure, finished
    assert not updater.rollout_engine_lock.held


def test_a_subclass_keeps_slimes_order(module, wire):
    class Subclass(module.UpdateWeightFromDistributed):
        pass

    updater = _updater(module, wire, [["a", "b"], []], cls=Subclass)
    updater._send_weights(Bar())
    events = [(k, n) for k, n in wire]
    assert events.index(("send end", "a")) < events.index(("made", "b"))  # sequential, as slime does it


def test_a_changed_target_is_refused_loudly():
    p = patch.get(PATCH_ID)

    class UpdateWeightFromDistributed:
        def _send_weights(self, pbar):
            for chunk in self._iter_non_expert_chunks():
                self._update_bucket_weights_from_distributed(chunk, pbar=pbar)

        def _update_bucket_weights_from_distributed(self, converted_named_tensors, pbar=None, load_format=None):
            pass

    fake = types.SimpleNamespace(__name__=MODULE, UpdateWeightFromDistributed=UpdateWeightFromDistributed,
                                 update_weights_from_distributed=lambda *a: None, get_gloo_group=lambda: None)
    problems = p.check({MODULE: fake})
    assert any("no longer contains" in problem for problem in problems), problems
    with pytest.raises(patch.PatchTargetError):
        p.install(modules={MODULE: fake})


def test_declared_by_every_sync_plugin_with_its_setting():
    from types import SimpleNamespace

    from slime_ascend.patch.train.pipelined_weight_send import wanted
    from slime_ascend.weight_sync.plugin import PLUGINS

    for plugin in PLUGINS:
        assert PATCH_ID in plugin.patch_ids, plugin.name
    assert wanted(SimpleNamespace(ascend_plugins=["fp8-sync"])) is False  # off by default
    assert wanted(SimpleNamespace(ascend_plugins=["fp8-sync"], ascend_fp8_sync_pipelined_send=True)) is True
    assert wanted(SimpleNamespace(ascend_plugins=["staleness"])) is False  # no sync plugin
