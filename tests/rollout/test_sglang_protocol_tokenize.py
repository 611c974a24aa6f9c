"""``POST /tokenize`` (and ``/v1/tokenize``) on the torch engine: SGLang 0.5.15's request and answer
(sglang/srt/entrypoints/openai/protocol.py:1225-1267, serving_tokenize.py:39-115), with ids computed by hand
from the byte tokenizer: ids 0-2 are ``<pad>`` ``<s>`` ``</s>``, then the 256 byte symbols in code-point
order, so a printable ASCII character ``c`` other than the space is id ``3 + ord(c) - 33``."""

from __future__ import annotations

import httpx
import pytest
from conftest import need

need("transformers")

from slime_ascend.rollout.torch_engine.engine import TorchEngine  # noqa: E402

HTTP = httpx.Client(trust_env=False)
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def ids(text: str) -> list[int]:
    assert all(33 <= ord(c) <= 126 for c in text)
    return [3 + ord(c) - 33 for c in text]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model, save_model

    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE
    path = save_model(load_model(None), tmp_path_factory.mktemp("tok-model"), tok)
    engine = TorchEngine(model_path=str(path), max_prompt_tokens=64)
    with engine.start_in_thread() as base:
        yield base


def post(url: str, body: dict, path: str = "/tokenize") -> httpx.Response:
    return HTTP.post(url + path, json=body, timeout=30)


def test_prompt_string_and_list(url):
    r = post(url, {"prompt": "hi!"})
    assert r.status_code == 200
    # the byte tokenizer adds no special tokens, so add_special_tokens (default true) changes nothing here
    assert r.json()["tokens"] == ids("hi!") == [74, 75, 3] and r.json()["count"] == 3
    assert isinstance(r.json()["max_model_len"], int)
    r = post(url, {"prompt": ["a", "</s>x", "é"], "add_special_tokens": False}, path="/v1/tokenize")
    # 'é' is the UTF-8 bytes 0xC3 0xA9, whose byte symbols are themselves; in code-point order after the 94
    # printable ASCII ones come 161-172 (12 of them), then 174-255 (173 is remapped): 0xC3 = 195 is
    # 3 + 94 + 12 + (195 - 174), 0xA9 = 169 is 3 + 94 + (169 - 161)
    assert r.json()["tokens"] == [ids("a"), [2, *ids("x")], [3 + 94 + 12 + 195 - 174, 3 + 94 + 169 - 161]]
    assert r.json()["count"] == [1, 2, 2]


def test_messages_apply_the_chat_template_with_the_generation_prompt(url):
    r = post(url, {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [1, *ids("user:hi"), 2, 1, *ids("assistant:")]
    # a final assistant turn is scored as a user turn, as SGLang does (serving_chat.py:235-275)
    r = post(url, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    assert r.json()["tokens"] == [1, *ids("user:a"), 2, 1, *ids("user:b"), 2, 1, *ids("assistant:")]


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({}, 400, "Exactly one of 'prompt' or 'messages'"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "Exactly one of 'prompt' or 'messages'"),
    ({"prompt": 3}, 400, "Expected str or List[str]"),
    ({"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens must be true or false"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}, 400, "string content"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, 400, "'tools' is not supported"),
    ({"prompt": "x" * 65}, 413, "65 characters is above this server's limit max_prompt_tokens=64"),
    ({"prompt": [""] * 65}, 413, "max_prompt_tokens=64"),  # each prompt counts at least one
])
def test_refusals_name_the_field(url, body, status, needle):
    r = post(url, body)
    assert r.status_code == status and needle in r.json()["error"], r.text


def test_engine_without_tokenizer_or_method():
    from slime_ascend.rollout.http_server import make_server

    engine = TorchEngine()  # the tiny random model has no tokenizer
    with engine.start_in_thread() as base:
        r = post(base, {"prompt": "a"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]

    class NoTokenize:  # an engine of the protocol without the optional method: no route, as a server without it
        engine_name = "stub"
        weight_version = "1"

    server = make_server(NoTokenize())
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = post(f"http://127.0.0.1:{server.server_address[1]}", {"prompt": "a"})
        assert r.status_code == 404 and "no endpoint /tokenize" in r.json()["error"]
    finally:
        server.shutdown()
        server.server_close()
