"""TeacherPool with tiny real safetensors teachers on CPU."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save_file

from slime_ascend.opd.pool import (
    SGLangEngineLoader,
    TeacherLoadError,
    TeacherPool,
    TeacherPoolService,
    TeacherUnavailableError,
    TorchModuleLoader,
    WeightDictLoader,
    make_teacher_pool_actor,
    read_safetensors_dir,
)
from slime_ascend.opd.teachers import TeacherMismatchError

VOCAB = 16


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, VOCAB))


def write_teacher(root, name, seed, vocab=VOCAB):
    torch.manual_seed(seed)
    d = root / name
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tiny_model().state_dict().items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    (d / "tokenizer.json").write_text("shared-tokenizer")
    return d


@pytest.fixture
def teachers(tmp_path):
    dirs = {n: write_teacher(tmp_path, n, i) for i, n in enumerate(["math", "code", "chat"])}
    student = write_teacher(tmp_path, "student", 99)
    specs = [{"name": n, "checkpoint_dir": str(d), "domains": [n]} for n, d in dirs.items()]
    return specs, dirs, student


def weights_of(d):
    state, _ = read_safetensors_dir(d)
    return state


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


def test_weight_dict_loader_swaps_in_place(teachers):
    specs, dirs, student = teachers
    model = tiny_model()
    live = dict(model.named_parameters())
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    with TeacherPool(specs, WeightDictLoader(live), student_dir=student) as pool:
        pool.activate("code")
        for k, v in weights_of(dirs["code"]).items():
            assert torch.equal(live[k].detach(), v) and live[k].data_ptr() == ptrs[k]


class _Engine(BaseHTTPRequestHandler):
    paths: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = self.path == "/update_weights_from_disk" and "model_path" in body
        type(self).paths.append(body.get("model_path"))
        data = json.dumps({"success": ok, "message": "" if ok else "bad"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_sglang_engine_loader_posts_update_weights(teachers, tmp_path):
    specs, dirs, student = teachers
    _Engine.paths = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        stage = tmp_path / "stage"
        with TeacherPool(specs, SGLangEngineLoader(url, stage_dir=stage), student_dir=student) as pool:
            pool.set_schedule(["math", "code"])
            pool.activate("math")
            pool._slot.future.result(5)
            assert pool.activate("code").prefetch == "hit"
        assert _Engine.paths == [str(stage / "math"), str(stage / "code")]
        assert (stage / "code" / "model.safetensors").read_bytes() == (dirs["code"] / "model.safetensors").read_bytes()
        with TeacherPool(specs, SGLangEngineLoader(url), student_dir=student) as pool:  # page-cache warm mode
            pool.activate("chat")
        assert _Engine.paths[-1] == str(dirs["chat"])
    finally:
        srv.shutdown()


def test_sglang_engine_refusal_marks_teacher_failed(teachers):
    specs, _, student = teachers
    post = lambda url, payload, timeout: {"success": "chat" not in payload["model_path"], "message": "OOM"}  # noqa: E731
    with TeacherPool(specs, SGLangEngineLoader("http://engine", post=post), student_dir=student) as pool:
        pool.activate("math")
        with pytest.raises(TeacherLoadError, match="teacher 'chat'.*OOM"):
            pool.activate("chat")
        assert pool.state()["chat"]["status"] == "failed"
        pool.activate("code")


def test_service_and_ray_actor_class(teachers):
    specs, _, student = teachers
    svc = TeacherPoolService(specs, lambda: TorchModuleLoader(tiny_model()), student_dir=str(student))
    assert svc.activate("math")["teacher"] == "math" and svc.active() == "math"
    assert svc.metrics()["switches"] == 1
    svc.close()
    pytest.importorskip("ray", reason="ray not installed")
    actor_cls = make_teacher_pool_actor(num_cpus=0)
    assert hasattr(actor_cls, "remote")


def test_copy_mode_keeps_parameters_and_old_weights_are_freed_in_background(teachers):
    import weakref

    specs, dirs, student = teachers
    model = tiny_model()
    ptr = model[0].weight.data_ptr()
    with TeacherPool(specs, TorchModuleLoader(model, mode="copy"), student_dir=student) as pool:
        pool.activate("math")
        assert model[0].weight.data_ptr() == ptr  # copy_ into the resident parameters
        assert torch.equal(model[0].weight.detach(), weights_of(dirs["math"])["0.weight"])
    assert TorchModuleLoader(tiny_model()).pin is False  # CPU: never pinned
    model = tiny_model()
    with TeacherPool(specs, TorchModuleLoader(model), student_dir=student) as pool:  # CPU assign
        pool.activate("math")
        old = weakref.ref(model[0].weight)
        pool.activate("code")
        pool._executor.submit(lambda: None).result(5)  # drain the background queue
        assert old() is None
        assert torch.equal(model[0].weight.detach(), weights_of(dirs["code"])["0.weight"])
