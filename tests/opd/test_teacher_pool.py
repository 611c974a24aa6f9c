"""TeacherPool (:mod:`slime_ascend.opd.pool`) with tiny real safetensors teachers on CPU."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from teacher_fixtures import VOCAB, teachers, tiny_model, weights_of, write_teacher  # noqa: F401  (teachers: fixture)

from slime_ascend.opd.loaders import TorchModuleLoader
from slime_ascend.opd.pool import TeacherLoadError, TeacherPool, TeacherUnavailableError
from slime_ascend.opd.teachers import TeacherMismatchError


class RecordingLoader(TorchModuleLoader):
    """Records stage calls (and their thread); optional delay / failures per teacher."""

    def __init__(self, model, delay=0.0, fail=None, gate=None):
        super().__init__(model)
        self.delay, self.fail, self.gate = delay, dict(fail or {}), gate
        self.calls: list[tuple[str, str]] = []

    def stage(self, spec):
        self.calls.append((spec.name, threading.current_thread().name))
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail.get(spec.name, 0) > 0:
            self.fail[spec.name] -= 1
            raise OSError("injected read failure")
        if self.delay:
            time.sleep(self.delay)
        return super().stage(spec)


def test_switch_replaces_weights_one_resident(teachers):
    specs, dirs, student = teachers
    model = tiny_model()
    with TeacherPool(specs, TorchModuleLoader(model), student_dir=student) as pool:
        for name in ["math", "code", "math", "chat"]:
            info = pool.activate(name)
            assert info.switched and pool.active == name
            for k, v in weights_of(dirs[name]).items():
                assert torch.equal(model.state_dict()[k], v)
            states = pool.state()
            assert [n for n, s in states.items() if s["status"] == "resident"] == [name]
        assert pool.activate("chat").switched is False
        m = pool.metrics()
        assert m["switches"] == 4 and m["cold_loads"] == 4


def test_prefetch_runs_in_background_and_switch_is_a_hit(teachers):
    specs, _, student = teachers
    gate = threading.Event()
    loader = RecordingLoader(tiny_model(), gate=gate)
    with TeacherPool(specs, loader, student_dir=student) as pool:
        gate.set()
        pool.activate("math")
        gate.clear()
        assert pool.prefetch("code")
        assert pool.state()["code"]["status"] == "prefetching"  # blocked on the gate: still in flight
        gate.set()
        pool._slot.future.result(5)
        assert pool.state()["code"]["status"] == "prefetched"
        n_calls = len(loader.calls)
        info = pool.activate("code")
        assert info.prefetch == "hit" and len(loader.calls) == n_calls  # no read at switch time
        assert loader.calls[-1] == ("code", loader.calls[-1][1]) and loader.calls[-1][1].startswith("teacher-prefetch")
        assert pool.metrics()["prefetch_hits"] == 1


def test_prefetch_hides_load_delay(teachers):
    specs, _, student = teachers
    delay = 0.4
    loader = RecordingLoader(tiny_model(), delay=delay)
    with TeacherPool(specs, loader, student_dir=student) as pool:
        cold = pool.activate("math")
        assert cold.prefetch == "miss" and cold.stall_s >= delay
        pool.prefetch("code")
        pool._slot.future.result(10)  # stands in for the active teacher's scoring time
        warm = pool.activate("code")
        assert warm.prefetch == "hit" and warm.stall_s < cold.stall_s / 4


def test_schedule_prefetches_next_and_stages_each_teacher_once(teachers):
    specs, _, student = teachers
    loader = RecordingLoader(tiny_model())
    seen = []
    with TeacherPool(specs, loader, student_dir=student) as pool:

        def score(name, items):
            slot = pool._slot
            seen.append((name, pool.active, slot.name if slot else None))
            if slot:
                slot.future.result(5)
            return [name] * len(items)

        groups = [("chat", [1]), ("math", [2, 3]), ("code", [4])]
        pool.set_schedule([n for n, _ in groups])  # each next teacher is prefetched while the current one scores
        out = []
        for name, items in groups:
            pool.activate(name)
            out.append(score(name, items))
        assert out == [["chat"], ["math", "math"], ["code"]]
        assert seen == [("chat", "chat", "math"), ("math", "math", "code"), ("code", "code", None)]
        assert [c[0] for c in loader.calls] == ["chat", "math", "code"]
        m = pool.metrics()
        # every switch was served by a prefetch (the first may still be in flight: "late")
        assert m["switches"] == 3 and m["cold_loads"] == 0 and m["prefetch_hits"] >= 2
        assert m["prefetch_hits"] + m["prefetch_late"] == 3 and m["prefetch_started"] == 3 and m["prefetch_discarded"] == 0


def test_memory_bound_one_prefetched(teachers):
    specs, dirs, student = teachers
    with TeacherPool(specs, TorchModuleLoader(tiny_model()), student_dir=student) as pool:
        pool.activate("math")
        pool.prefetch("code")
        pool.prefetch("chat")  # replaces the code prefetch
        assert pool.prefetched == "chat"
        states = pool.state()
        assert sum(s["status"] in ("prefetched", "prefetching") for s in states.values()) == 1
        pool._slot.future.result(5)
        m = pool.metrics()
        one = sum(v.numel() * v.element_size() for v in weights_of(dirs["math"]).values())
        assert m["prefetch_discarded"] == 1
        assert m["host_bytes"] == 2 * one and m["peak_host_bytes"] <= 2 * one
        pool.activate("code")  # cold: the chat prefetch is dropped first
        assert pool.prefetched is None and pool.metrics()["peak_host_bytes"] <= 2 * one


def test_corrupt_and_missing_checkpoints_fail_alone(teachers, tmp_path):
    specs, dirs, student = teachers
    (dirs["code"] / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    specs = specs + [{"name": "gone", "checkpoint_dir": str(tmp_path / "nope"), "domains": ["x"]}]
    with TeacherPool(specs, TorchModuleLoader(tiny_model()), student_dir=student) as pool:
        st = pool.state()
        assert st["code"]["status"] == "failed" and "corrupt safetensors" in st["code"]["error"]
        assert st["gone"]["status"] == "failed" and "does not exist" in st["gone"]["error"]
        with pytest.raises(TeacherUnavailableError, match=r"teacher 'code' \(.*code\)"):
            pool.activate("code")
        assert pool.prefetch("gone") is False
        pool.activate("math")  # the others still work
        assert [n for n, st in pool.state().items() if st["status"] != "failed"] == ["math", "chat"]


def test_corruption_after_start_is_reported_with_name(teachers):
    specs, dirs, student = teachers
    with TeacherPool(specs, TorchModuleLoader(tiny_model()), student_dir=student) as pool:
        f = dirs["chat"] / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
        with pytest.raises(TeacherLoadError, match=r"teacher 'chat' .*after 2 attempt"):
            pool.activate("chat")
        assert pool.state()["chat"]["status"] == "failed"
        pool.activate("math")


def test_vocab_or_tokenizer_mismatch_refused_at_start(teachers, tmp_path):
    specs, _, student = teachers
    odd = write_teacher(tmp_path, "odd", 5, vocab=VOCAB + 1)
    bad = specs + [{"name": "odd", "checkpoint_dir": str(odd), "domains": ["odd"]}]
    with pytest.raises(TeacherMismatchError, match="teacher 'odd'"):
        TeacherPool(bad, TorchModuleLoader(tiny_model()), student_dir=student)
    (odd / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    (odd / "tokenizer.json").write_text("another tokenizer")
    with pytest.raises(TeacherMismatchError, match="opd teacher 'odd': tokenizer files:"):
        TeacherPool(bad, TorchModuleLoader(tiny_model()), student_dir=student)


def test_failed_prefetch_retried_once_then_reported(teachers):
    specs, _, student = teachers
    loader = RecordingLoader(tiny_model(), fail={"code": 1, "chat": 5})
    with TeacherPool(specs, loader, student_dir=student) as pool:
        pool.activate("math")
        pool.prefetch("code")
        pool._slot.future.result(5)  # succeeded on the retry
        assert pool.activate("code").prefetch == "hit"
        assert pool.metrics()["stage_retries"] == 1
        pool.prefetch("chat")
        with pytest.raises(TeacherLoadError, match=r"teacher 'chat'.*injected read failure.*2 attempt"):
            pool.activate("chat")
        assert [c[0] for c in loader.calls].count("chat") == 2
        m = pool.metrics()
        assert m["stage_failures"] == 1 and m["stage_retries"] == 2
        assert pool.state()["chat"]["status"] == "failed" and pool.active == "code"
        pool.activate("math")
