"""SGLang-shaped /generate client: payload, response parsing, HTTP transport, injection."""

import asyncio
from types import SimpleNamespace

import pytest
from conftest import need

from slime_ascend.rollout.engine_client import EngineClient, generate_url_from_args, parse_generate_response


def sglang_response(ids, lps, finish="stop", version="7"):
    return {"text": "hi", "meta_info": {"output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps)],
                                        "finish_reason": {"type": finish}, "weight_version": version}}


def test_parse_response_and_errors():
    r = parse_generate_response(sglang_response([5, 6], [-0.5, -0.25], "length"))
    assert (r.token_ids, r.log_probs, r.finish_reason, r.weight_version, r.text) == (
        [5, 6], [-0.5, -0.25], "length", "7", "hi")
    with pytest.raises(ValueError, match="output_token_logprobs"):
        parse_generate_response({"meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(ValueError, match="finish_reason"):
        parse_generate_response(sglang_response([1], [-1.0], "weird"))
    with pytest.raises(ValueError, match="null log-prob"):
        parse_generate_response(sglang_response([1], [None]))
    with pytest.raises(ValueError, match="meta_info"):
        parse_generate_response({"text": ""})


def test_url_from_args_and_injected_transport():
    assert generate_url_from_args(SimpleNamespace(sglang_router_ip="10.0.0.1", sglang_router_port=3000)) == (
        "http://10.0.0.1:3000/generate")
    with pytest.raises(ValueError, match="sglang_router_ip"):
        generate_url_from_args(SimpleNamespace())
    with pytest.raises(ValueError, match="url="):
        EngineClient()
    seen = []

    async def fake_post(payload):
        seen.append(payload)
        return sglang_response([9], [-0.1])

    client = EngineClient(post=fake_post)
    out = asyncio.run(client.generate([1, 2], {"max_new_tokens": 4}))
    assert out.token_ids == [9]
    assert seen == [{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}]


def test_http_transport_against_local_server():
    web = need("aiohttp.web")
    received = []

    async def handler(request):
        payload = await request.json()
        received.append(payload)
        n = payload["sampling_params"]["max_new_tokens"]
        return web.json_response(sglang_response(list(range(n)), [-1.0] * n))

    async def main():
        app = web.Application()
        app.router.add_post("/generate", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        router = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=port)
        client = EngineClient(generate_url_from_args(router))
        try:
            return await client.generate([3, 4, 5], {"max_new_tokens": 3, "temperature": 0.0})
        finally:
            await client.aclose()
            await runner.cleanup()

    out = asyncio.run(main())
    assert out.token_ids == [0, 1, 2] and out.log_probs == [-1.0] * 3 and out.weight_version == "7"
    assert received[0]["input_ids"] == [3, 4, 5] and received[0]["return_logprob"] is True
