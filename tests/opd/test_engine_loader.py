"""The HTTP teacher-engine loader (:mod:`slime_ascend.opd.engine_loader`) behind a TeacherPool."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from teacher_fixtures import teachers  # noqa: F401  (pytest fixture)

from slime_ascend.opd.engine_loader import SGLangEngineLoader
from slime_ascend.opd.pool import TeacherLoadError, TeacherPool


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


def _ok(url, payload, timeout):
    return {"success": True}


def test_the_stage_dir_holds_the_resident_and_the_prefetched_copy_at_most(teachers, tmp_path):
    """Three teachers cycled through one engine: each staged copy goes once its teacher stops being resident (or its
    prefetch is discarded), so the stage directory never holds more than two; staging time and bytes are counted."""
    specs, dirs, student = teachers
    stage = tmp_path / "stage"
    held: list[set[str]] = []
    size = sum(p.stat().st_size for p in dirs["math"].iterdir())
    loader = SGLangEngineLoader("http://engine", stage_dir=stage, post=_ok)
    with TeacherPool(specs, loader, student_dir=student) as pool:
        for name in ["math", "code", "chat", "math", "code"]:
            pool.set_schedule([n for n in ["math", "code", "chat"] if n != name][:1])
            pool.activate(name)
            if pool._slot is not None:
                pool._slot.future.result(5)
            held.append({p.name for p in stage.iterdir()})
            assert name in held[-1] and len(held[-1]) <= 2, held
        pool.prefetch("chat")
        pool._slot.future.result(5)
        pool.prefetch("math")  # discards the chat prefetch: its copy goes
        pool._slot.future.result(5)
        assert {p.name for p in stage.iterdir()} == {"code", "math"}
        m = pool.metrics()
    assert m["switches"] == 5 and m["stage_s"] > 0 and m["read_bytes"] >= 5 * size, m
    assert m["read_bytes"] % size == 0  # whole checkpoints read (a reused copy reads nothing)


def test_a_copy_not_staged_by_the_pool_is_never_deleted(teachers, tmp_path):
    specs, dirs, student = teachers
    stage = tmp_path / "stage"
    loader = SGLangEngineLoader("http://engine", stage_dir=stage, post=_ok)
    with TeacherPool(specs, loader, student_dir=student) as pool:
        pool.activate("math")
        stage.joinpath("code").mkdir()  # a directory of someone else under a teacher's name
        stage.joinpath("code", "notes.txt").write_text("mine")
        loader.release(pool.specs["code"])
        assert stage.joinpath("code", "notes.txt").read_text() == "mine"
        pool.activate("chat")  # math's copy goes, the foreign directory stays
        assert not stage.joinpath("math").exists() and stage.joinpath("code", "notes.txt").exists()
