"""Remote teachers (``slime_ascend.opd.compat`` + ``engine_probe``): a teacher known only by its URL is
checked at its engine, over loopback HTTP.

``FakeSGLang`` answers as SGLang 0.5.15 does for what the probe asks (``/model_info``, ``/server_info``
without ``vocab_size``, ``/tokenize``, ``/generate`` refusing a ``token_ids_logprob`` id outside
``[0, vocab_size)`` with HTTP 400, sglang/srt/managers/tokenizer_manager.py:1074-1092), with a real HF
tokenizer read from a checkpoint the driver is then told nothing about. It records every request and marks
itself *crashed* when asked to embed an input id outside its vocabulary (real SGLang does not check input
ids: on a GPU that is a device-side assert), so each test also shows the probe never sends one. Then the
project's torch engine, and the plugin's validation (one line, naming the teacher and the address).
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import trickling_server
from test_opd_compat import TEMPLATE, VOCAB, make_args, make_checkpoint, teacher

from slime_ascend.opd import compat
from slime_ascend.opd.teachers import TeacherMismatchError
from slime_ascend.plugins.settings import SettingsError

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _clean():
    compat.clear_cache()
    yield
    compat.clear_cache()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote")
    return {
        "student": make_checkpoint(root / "student"),
        "same": make_checkpoint(root / "same"),
        "merges": make_checkpoint(root / "merges", merges=(("a", "b"),)),  # "tabs" in the probe texts
        "eos": make_checkpoint(root / "eos", eos="<|end|>"),
        "template": make_checkpoint(root / "template", template=TEMPLATE.replace(": ", "\n")),
        "larger": make_checkpoint(root / "larger", vocab_size=VOCAB + 64),
        "smaller": make_checkpoint(root / "smaller", vocab_size=VOCAB - 20),  # still above the 261 tokens
    }


class FakeSGLang:
    """SGLang 0.5.15's answers to the probe's requests, for the tokenizer and config.json of ``ckpt``."""

    def __init__(self, ckpt: Path, *, serve_tokenize: bool = True):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(ckpt))
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        self.requests: list[tuple[str, dict | None]] = []
        self.crashed = False
        fake = self

        def tokenize(body):  # sglang/srt/entrypoints/openai/serving_tokenize.py:39-115
            if body.get("messages") is not None:
                text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
                return {"tokens": tok.encode(text, add_special_tokens=False)}
            prompt = body["prompt"]
            enc = [tok.encode(t, add_special_tokens=body.get("add_special_tokens", True))
                   for t in ([prompt] if isinstance(prompt, str) else prompt)]
            return {"tokens": enc[0] if isinstance(prompt, str) else enc, "count": [len(e) for e in enc],
                    "max_model_len": -1}

        def generate(body):
            for tid in body.get("token_ids_logprob") or ():
                if not 0 <= tid < vocab:
                    return 400, {"error": {"message": f"token_ids_logprob contains out-of-vocabulary token id "
                                                      f"{tid}; valid range is [0, {vocab})."}}
            ids = body["input_ids"]
            if any(not 0 <= i < vocab for i in ids):
                fake.crashed = True
                return 500, {"error": {"message": "CUDA error: device-side assert triggered"}}
            entries = [[None if i == 0 else -1.5, t, None] for i, t in enumerate(ids)]
            return 200, {"text": "", "meta_info": {"input_token_logprobs": entries}}

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                fake.requests.append((self.path, None))
                if self.path in ("/model_info", "/get_model_info"):
                    return self._send(200, {"model_path": "/remote/teacher", "tokenizer_path": "/remote/teacher",
                                            "is_generation": True})
                if self.path in ("/server_info", "/get_server_info"):  # no vocab_size, as SGLang
                    return self._send(200, {"model_path": "/remote/teacher", "skip_tokenizer_init": False})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, body))
                if self.path in ("/tokenize", "/v1/tokenize") and serve_tokenize:
                    return self._send(200, tokenize(body))
                if self.path == "/generate":
                    return self._send(*generate(body))
                self._send(404, {"detail": "Not Found"})

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_sglang():
    started = []

    def start(ckpt, **kw):
        started.append(FakeSGLang(ckpt, **kw))
        return started[-1]

    yield start
    for eng in started:
        eng.close()


def remote(name: str, url: str, **extra):
    return teacher(name, "/nonexistent/" + name, url=url, **extra)


def refusal(ckpts, spec, **kw) -> str:
    with pytest.raises(TeacherMismatchError) as e:
        compat.check_teachers([spec], ckpts["student"], **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"opd teacher {spec.name!r}: "), msg
    return msg


# ---------------------------------------------------------------------------------------------- SGLang
def test_compatible_remote_teacher_is_checked_and_accepted(ckpts, fake_sglang, caplog):
    caplog.set_level(logging.WARNING, logger="slime_ascend.opd")
    eng = fake_sglang(ckpts["same"])
    (report,) = compat.check_teachers([remote("code", eng.url)], ckpts["student"])
    assert report.ok and set(report.unchecked) == {"tokenizer_len"}, report.unchecked
    posts = [(p, b) for p, b in eng.requests if b is not None]
    # the special tokens and the texts in one list prompt, the conversation, then two scoring requests
    assert [p for p, _ in posts] == ["/tokenize", "/tokenize", "/generate", "/generate"]
    prompts = posts[0][1]["prompt"]
    assert prompts[:3] == ["<pad>", "<s>", "</s>"] and posts[0][1]["add_special_tokens"] is False
    assert any(ord(c) > 0xFFFF for text in prompts for c in text)  # bytes outside ASCII and the BMP
    assert posts[1][1]["messages"][-1]["role"] == "user"
    assert [b["token_ids_logprob"] for _, b in posts[2:]] == [[VOCAB - 1], [VOCAB]]
    assert all(b["sampling_params"]["max_new_tokens"] == 0 and b["return_logprob"] for _, b in posts[2:])
    # the scored prefix is the student's own ids of the conversation with its chat template
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpts["student"]))
    rendered = tok.apply_chat_template(posts[1][1]["messages"], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s>system: ") and rendered.endswith("<s>assistant:")
    assert posts[2][1]["input_ids"] == tok.encode(rendered, add_special_tokens=False)[:24]
    assert not eng.crashed


@pytest.mark.parametrize(("name", "needle"), [
    ("merges", "tokenizer: '  leading spaces,\\ttabs\\nand\\r\\nnew…' gives [..., 260, "),
    # '</s>' is no special token there: its bytes < / s > (ids 4 + ord - 33)
    ("eos", "special_tokens: '</s>' gives [31, 18, 86, 33] at the teacher, [2] at the student"),
    ("template", "chat_template: the probe conversation with the chat template applied gives [..., "),
])
def test_remote_teacher_with_another_tokenizer_is_refused(ckpts, fake_sglang, name, needle):
    eng = fake_sglang(ckpts[name])
    msg = refusal(ckpts, remote("code", eng.url))
    assert needle in msg, msg
    assert f"teacher read from {eng.url}" in msg and "Fix:" in msg and "compat_check: warn" in msg
    assert not eng.crashed


def test_merges_mismatch_shows_the_ids_where_they_part(ckpts, fake_sglang):
    """'tabs': the student has t a b s, the merged teacher t ab s; both shown from the first differing id."""
    eng = fake_sglang(ckpts["merges"])
    msg = refusal(ckpts, remote("code", eng.url))
    a, b, s = (4 + ord(c) - 33 for c in "abs")  # ids 0-3 are specials, then the bytes from '!' on
    ab = 4 + 256  # 'ab', after the 256 bytes
    assert f"gives [..., {ab}, {s}," in msg and f"at the teacher, [..., {a}, {b}, {s}," in msg, msg
    assert "(1 more of the probe texts differ)" in msg  # 'tab' in the last text too


def test_remote_teacher_with_a_larger_vocabulary_bound_is_refused(ckpts, fake_sglang):
    eng = fake_sglang(ckpts["larger"])  # the very same tokenizer: only the embedding rows differ
    msg = refusal(ckpts, remote("code", eng.url))
    assert msg.startswith(f"opd teacher 'code': vocab_size: the teacher scores token id {VOCAB}, past the "
                          f"student's vocab_size {VOCAB}: its vocabulary is larger"), msg
    assert not eng.crashed


def test_remote_teacher_with_a_smaller_vocabulary_is_refused_before_it_embeds_a_student_id(ckpts, fake_sglang):
    eng = fake_sglang(ckpts["smaller"])
    msg = refusal(ckpts, remote("code", eng.url))
    assert f"vocab_size: the teacher refuses token id {VOCAB - 1}, the student's largest" in msg
    assert f"valid range is [0, {VOCAB - 20})" in msg  # the engine's own answer, quoted
    assert not eng.crashed and eng.paths().count("/generate") == 1


def test_engine_without_tokenize_still_has_its_vocabulary_checked(ckpts, fake_sglang, caplog):
    caplog.set_level(logging.WARNING, logger="slime_ascend.opd")
    eng = fake_sglang(ckpts["same"], serve_tokenize=False)
    (report,) = compat.check_teachers([remote("code", eng.url)], ckpts["student"])
    assert report.ok and {"tokenizer", "special_tokens", "chat_template"} <= set(report.unchecked)
    assert "serves neither /tokenize nor /v1/tokenize" in report.unchecked["tokenizer"]
    assert eng.paths().count("/generate") == 2 and "/v1/tokenize" in eng.paths()
    line = next(r.message for r in caplog.records if "not checked" in r.message)
    assert line.startswith("opd teacher 'code': not checked against the student: ")
    eng = fake_sglang(ckpts["larger"], serve_tokenize=False)
    assert "vocab_size: the teacher scores token id" in refusal(ckpts, remote("code", eng.url))


def test_engine_path_readable_here_is_fingerprinted_from_its_files(ckpts):
    class Info(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = json.dumps({"model_path": str(ckpts["eos"]), "tokenizer_path": str(ckpts["eos"])}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert refusal(ckpts, remote("code", url)).startswith("opd teacher 'code': eos_token 3 '<|end|>' differs")
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------- no answer
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_teacher_is_refused_at_once_naming_teacher_and_address(ckpts, caplog):
    url = f"http://127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    msg = refusal(ckpts, remote("code", url))
    assert time.monotonic() - t0 < 2.0
    assert msg.startswith(f"opd teacher 'code': {url} did not answer /model_info ("), msg
    assert "Fix: start the engine of 'code' before the job (or correct its url)" in msg
    assert "compat_check: off" in msg
    # warn: logged, and the job starts
    caplog.set_level(logging.WARNING, logger="slime_ascend.opd")
    assert compat.check_teachers([remote("code", url, compat_check="warn")], ckpts["student"]) == []
    assert any(r.message.startswith(f"opd teacher 'code': {url} did not answer") and "starting unchecked" in r.message
               for r in caplog.records)


@pytest.fixture
def trickle():
    """Accepts, then sends a valid HTTP answer one byte a second: every read succeeds within any per-read timeout."""
    with trickling_server(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}') as url:
        yield url


def test_trickling_teacher_is_refused_within_the_deadline(ckpts, trickle):
    t0 = time.monotonic()
    msg = refusal(ckpts, remote("code", trickle), timeout_s=2)
    elapsed = time.monotonic() - t0
    assert 1.9 < elapsed < 3.0, elapsed  # its first answer alone would take ~70 s
    assert msg.startswith(f"opd teacher 'code': {trickle} did not answer /model_info (no complete answer within "
                          "the 2 s the check allows)"), msg


def test_several_teachers_refused_in_one_line(ckpts, fake_sglang):
    bad, dead = fake_sglang(ckpts["eos"]), f"http://127.0.0.1:{closed_port()}"
    ok = fake_sglang(ckpts["same"])
    specs = [remote("math", ok.url), remote("code", bad.url), remote("chat", dead)]
    with pytest.raises(TeacherMismatchError) as e:
        compat.check_teachers(specs, ckpts["student"])
    msg = str(e.value)
    assert "\n" not in msg and "'math'" not in msg
    assert msg.startswith("opd teacher 'code': special_tokens: ") and f"; opd teacher 'chat': {dead} did not answer" in msg
    assert "Fix: give each teacher a checkpoint" in msg and "and start the engine of 'chat' before the job" in msg


def test_plugin_validation_stops_on_an_unreachable_teacher(ckpts, opd_state):
    from slime_ascend.plugins import runtime

    url = f"http://127.0.0.1:{closed_port()}"
    teachers = [{"name": "code", "checkpoint_dir": "/remote/code", "domains": ["code"], "url": url}]
    with pytest.raises(SettingsError) as e:
        runtime.settings(make_args(ascend_opd_teachers=teachers, hf_checkpoint=str(ckpts["student"])), "opd")
    assert str(e.value).startswith(f"opd teacher 'code': {url} did not answer /model_info (") and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- torch engine
@pytest.fixture(scope="module")
def reference_teacher(ckpts, tmp_path_factory):
    """The torch engine serving a tiny Qwen3 with the student's tokenizer and vocabulary, whose directory is
    then moved away: the driver reads nothing of it, as for an engine on another host."""
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_ascend.rollout.torch_engine.engine import TorchEngine
    from slime_ascend.rollout.torch_engine.model import save_model, tiny_qwen3_config

    def serve(tokenizer_dir: Path, name: str):
        model_dir = tmp_path_factory.mktemp(name)
        model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=VOCAB))
        save_model(model, model_dir, AutoTokenizer.from_pretrained(str(tokenizer_dir)))
        engine = TorchEngine(model_path=str(model_dir))
        shutil.move(str(model_dir), str(model_dir) + "-elsewhere")
        return engine.start_in_thread()

    with serve(ckpts["same"], "ref-same") as same, serve(ckpts["template"], "ref-template") as other:
        yield {"same": same, "template": other}


def test_torch_engine_teacher_is_checked_through_tokenize(ckpts, reference_teacher):
    (report,) = compat.check_teachers([remote("code", reference_teacher["same"])], ckpts["student"])
    assert report.ok and set(report.unchecked) == {"tokenizer_len"}, report.unchecked
    msg = refusal(ckpts, remote("chat", reference_teacher["template"]))
    assert msg.startswith("opd teacher 'chat': chat_template: the probe conversation with the chat template applied")
