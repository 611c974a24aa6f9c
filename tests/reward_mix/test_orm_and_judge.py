"""reward-mix's model-based terms against real servers: ``orm.score`` (SGLang's /classify on the torch engine
serving a reward model; slime's --rm-url protocol) and ``judge.verdict`` (a generative judge over /generate, the
torch engine serving the tiny judge whose verdict is known)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from slime_ascend.json_client import JSONRequestError
from slime_ascend.reward_mix import hooks, judge, orm, tiny_judge
from slime_ascend.reward_mix.mix import MixError, parse_terms
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, save_model
from slime_ascend.rollout.torch_engine.reward_model import RewardModelEngine, reward_scores, tiny_reward_model
from torch_engine_fixtures import served

SAMPLES = [SimpleNamespace(prompt=p, response=r, label="4")
           for p, r in (("What is 2+2? ", "4"), ("What is 2+2? ", "five"), ("Name a colour: ", "blue!"),
                        ("Name a colour: ", "red"), ("Say hi ", ""),
                        ("Yes or no? ", "Y"), ("Yes or no? ", "N"))]  # ending in a verdict word




@contextlib.contextmanager
def scripted(answers):
    """A stdlib HTTP server answering POSTs from ``answers`` in turn ((status, JSON body)); records the bodies."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = answers[min(len(seen), len(answers)) - 1]
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", seen
    finally:
        server.shutdown()
        server.server_close()


def run(coro):
    return asyncio.run(coro)


def test_orm_scores_each_sample_as_the_reward_model_does(tmp_path):
    directory = save_model(tiny_reward_model(seed=2), tmp_path / "rm", build_byte_tokenizer())
    reference, tok = tiny_reward_model(seed=2), build_byte_tokenizer()
    with served(RewardModelEngine(directory)) as url:
        got = [run(orm.score(None, s, url=url)) for s in SAMPLES]
        templated = run(orm.score(None, SAMPLES[0], url=url, template="Q: {prompt}\nA: {response}\nGold: {label}"))
    want = [reward_scores(reference, [tok.encode(s.prompt + s.response)])[0][0] for s in SAMPLES]
    assert got == pytest.approx(want, abs=1e-6) and len(set(got)) == len(SAMPLES)
    text = "Q: What is 2+2? \nA: 4\nGold: 4"
    assert templated == pytest.approx(reward_scores(reference, [tok.encode(text)])[0][0], abs=1e-6)


def test_orm_over_slimes_rm_url_protocol_retries_a_5xx_and_fails_the_sample_on_a_bad_answer():
    sample = SAMPLES[0]
    with scripted([(503, {"error": "busy"}), (200, {"score": 0.75})]) as (url, seen):
        assert run(orm.score(None, sample, url=url, protocol="slime-rm", retries=1)) == 0.75
    assert seen[-1] == {"prompt": sample.prompt, "response": sample.response, "label": "4"}  # slime's payload
    with scripted([(200, 1.5)]) as (url, _):
        assert run(orm.score(None, sample, url=url, protocol="slime-rm")) == 1.5
    with scripted([(200, {"score": "high"})]) as (url, _):
        with pytest.raises(orm.ORMError, match="not a finite number"):
            run(orm.score(None, sample, url=url, protocol="slime-rm"))
    with scripted([(500, {"error": "down"})]) as (url, seen):
        with pytest.raises(JSONRequestError, match="HTTP 500"):
            run(orm.score(None, sample, url=url, protocol="slime-rm", retries=2))
    assert len(seen) == 3  # the first try and two retries


def test_judge_verdicts_are_the_served_models_own(tmp_path):
    directory = tiny_judge.build(tmp_path / "judge")
    tok = build_byte_tokenizer()
    with served(TorchEngine(model_path=directory)) as url:
        got = [run(judge.verdict(None, s, url=url, template=tiny_judge.TEMPLATE, verdicts=tiny_judge.VERDICTS,
                                 max_new_tokens=tiny_judge.MAX_NEW_TOKENS)) for s in SAMPLES]
        with pytest.raises(judge.JudgeError, match="no verdict"):  # verdict words the judge never says
            run(judge.verdict(None, SAMPLES[0], url=url, template=tiny_judge.TEMPLATE,
                              max_new_tokens=tiny_judge.MAX_NEW_TOKENS))
    want = [tiny_judge.expected_verdict(tok, s.prompt + s.response) for s in SAMPLES]
    assert got == want and set(want) == {0.0, 1.0}  # both verdicts occur


def test_parse_verdict_takes_the_earliest_whole_word():
    verdicts = {"yes": 1.0, "no": 0.0}
    assert judge.parse_verdict("No. Well, yes", verdicts) == 0.0
    assert judge.parse_verdict("I say YES", verdicts) == 1.0
    assert judge.parse_verdict("nothing here, yesterday", verdicts) is None  # no whole word
    assert judge.parse_verdict("Verdict: Y", {"Y": 1.0, "N": 0.0}) == 1.0


@pytest.mark.parametrize("term, phrase", [
    ({"path": "slime_ascend.reward_mix.orm.score", "kwargs": {"url": "rm-host:30000"}}, "kwargs.url"),
    ({"path": "slime_ascend.reward_mix.orm.score", "kwargs": {"url": "http://h", "protocol": "grpc"}},
     "kwargs.protocol"),
    ({"path": "slime_ascend.reward_mix.orm.score", "kwargs": {"url": "http://h", "template": "{answer}"}},
     "template names ['answer']"),
    ({"path": "slime_ascend.reward_mix.judge.verdict", "kwargs": {"url": "http://h"}}, "'template'"),
    ({"path": "slime_ascend.reward_mix.judge.verdict",
      "kwargs": {"url": "http://h", "template": "{prompt}", "verdicts": {"yes": "1"}}}, "verdicts['yes']"),
    ({"path": "slime_ascend.reward_mix.judge.verdict",
      "kwargs": {"url": "http://h", "template": "{prompt}", "max_new_tokens": 0}}, "max_new_tokens"),
])
def test_a_model_term_with_unusable_kwargs_is_refused_at_start_in_one_line(term, phrase):
    settings = SimpleNamespace(components=[{"name": "t", **term}], penalties=[])
    with pytest.raises(MixError, match=None) as err:
        hooks.validate(SimpleNamespace(), settings)
    assert phrase in str(err.value) and "reward-mix term 't'" in str(err.value) and "\n" not in str(err.value)


def test_the_orm_term_is_an_outcome_model_by_default():
    (orm_term, judge_term) = parse_terms([
        {"name": "orm", "path": "slime_ascend.reward_mix.orm.score", "kwargs": {"url": "http://h"}},
        {"name": "judge", "path": "slime_ascend.reward_mix.judge.verdict"}], "ascend_reward_components")
    assert (orm_term.kind, judge_term.kind) == ("outcome_model", "judge")
