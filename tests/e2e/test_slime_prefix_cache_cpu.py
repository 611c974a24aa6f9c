"""KV ownership in slime's own ``train.py``: ``cosched`` + the torch engine's prefix cache, with ``compaction``
(multi-turn, the environment paying its own reward), ``staleness`` and ``verifier-gate`` (``cpu``).

Two torch engines served with ``--prefix-cache-tokens`` behind slime's router (external engines: every check below
reads each engine's own report, ``/server_info``'s ``prefix_cache``, and its log after slime's run has ended, and
slime stops the engines it starts itself); compaction's ``kv_lookup`` episodes (the episode of
tests/e2e/test_slime_compaction.py) are multi-turn (each action's prompt extends the last one) and every episode
shares the environment's instructions, so a later turn, and a later rollout's first turn, would find a cached
prefix. ``cosched`` dispatches every turn by KV tokens (``ascend_cosched_unit: kv_tokens``: each engine's budget is
90% of the ``max_total_num_tokens`` its ``/v1/loads`` reports, ``--max-total-tokens 4096``; a turn takes its prompt
plus its ``max_new_tokens``; 8 episodes at once): an episode is one session, kept on the engine that served its last
turn while the turn fits there, moved (counted) when it does not. slime pushes three weight versions (before rollout 0, after step 0, after step 1).

Evidence, from the engines' own counters and logs and from slime's metrics (``rollout/cosched_*``, per rollout):

* sessions stay on their owner: every later turn of an episode is an owner turn or a counted move
  (``session_turns == owner_turns + moves``), owner turns happen in every rollout, and the owner reuses their
  prefixes (``owner_cached_tokens`` > 0); both engines serve every rollout and each reused prefixes itself
  (its own ``prefill_tokens_saved`` > 0, ``hits`` > 0);
* slime's metrics and the engines agree: the tokens the answers reported reused (``cached_tokens``), summed over
  rollouts, equal the engines' own ``prefill_tokens_saved``, and the prompt tokens their ``prompt_tokens``;
* no token after a weight switch comes from an old-version prefix: every answer that reused a prefix says which
  version computed it (``cached_weight_version``) and none differs from the answer's own ``weight_version``
  (``stale_prefix_answers`` 0, none unreported); and the engine side of the contract: slime flushes before every
  push (``pause_generation``, ``flush_cache``, ``update_weights_from_disk``: the contract its SGLang engines rely
  on), so in each engine's log each push after a rollout is preceded by a flush that dropped that rollout's
  prefixes (N > 0), and the switch itself then found nothing left to drop (its own drop, the second line of the
  contract, is exercised by tests/rollout/test_torch_engine_prefix_cache.py); every push switched each engine's
  cache generation (three switches); after the last push the caches hold nothing;
* no request was inserted under a version other than the one that computed it (``stale_inserts_refused`` 0:
  ``train.py`` is synchronous, slime pauses with ``abort``), and the staleness plugin kept every sample.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from slime_ascend.demo.slime_job import Engine, free_port, make_prompts, run_slime, slime_flags, stop
from slime_ascend.json_client import JSONRequestError, request_json
from e2e_fixtures import model_dir  # noqa: F401  (pytest fixture)
from test_slime_compaction import BATCH, EPISODE, N_SAMPLES

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

PLUGINS = ("cpu", "compaction", "staleness", "cosched", "verifier-gate")
NUM_ROLLOUT = 2
NUM_ENGINES = 2
# each engine's KV budget (serve-torch --max-total-tokens, reported in /v1/loads): a turn reserves its prompt (up to
# ~1,000 tokens in this episode) plus its max_new_tokens, so an engine holds about 3 of the 8 episodes' turns at once
MAX_TOTAL_TOKENS = 4096
KV_FRACTION = 0.9
SETTINGS = {  # test_slime_compaction.py's episode: 3 facts, a 1024-token budget, one compaction a rollout
    **EPISODE,
    # the environment pays its own reward (the tiny model never answers the lookup: 0 throughout), so the
    # verifier gate checks the environment's verifier in slime's processes before the first rollout
    "ascend_compaction_env_reward": "true",
    "ascend_staleness_tau": "1",
    "ascend_cosched_unit": "kv_tokens",
    "ascend_cosched_kv_fraction": str(KV_FRACTION),
}


def _cached_engine(model_dir, log) -> Engine:  # noqa: F811
    """``slime-ascend serve-torch`` with the prefix cache on (slime_job.start_engine's, plus the flag)."""
    import os

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SLIME_ASCEND_PLUGINS"}
    env["OMP_NUM_THREADS"] = "1"  # one core per engine: the two engines do not oversubscribe the host's two
    cmd = [sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--prefix-cache-tokens", "65536", "--max-total-tokens", str(MAX_TOTAL_TOKENS)]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(log.parent),
                                start_new_session=True)
    return Engine(f"http://127.0.0.1:{port}", proc, log)


@pytest.fixture
def cached_engines(model_dir, tmp_path):  # noqa: F811
    engines = [_cached_engine(model_dir, tmp_path / f"engine{i}.log") for i in range(NUM_ENGINES)]
    try:
        deadline = time.monotonic() + 120
        for engine in engines:
            while time.monotonic() < deadline:
                assert engine.proc.poll() is None, engine.log.read_text()[-3000:]
                try:
                    request_json(engine.url + "/health", timeout_s=2)
                    break
                except JSONRequestError:
                    time.sleep(0.3)
        yield engines
    finally:
        for engine in engines:
            stop(engine.proc)


def test_train_py_compaction_sessions_keep_their_kv_owner_across_versions(model_dir, cached_engines,  # noqa: F811
                                                                          tmp_path):
    config = tmp_path / "ascend.yaml"
    sets = [w for k, v in SETTINGS.items() for w in ("--set", f"{k}={v}")]
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, *sets, "-o", str(config)],
                   check=True, capture_output=True, text=True)
    flags = slime_flags(model_dir, make_prompts(tmp_path / "prompts.jsonl"), cached_engines, tmp_path,
                        num_rollout=NUM_ROLLOUT, batch=BATCH, n_samples=N_SAMPLES, save=False)
    flags += ["--seq-length", "2048"]
    run = run_slime("train.py", flags, tmp_path, PLUGINS, custom_config=config)
    assert run.returncode == 0, run.log[-6000:]
    print(f"train.py ran {run.seconds:.0f} s")

    # the verifier gate checked the environment's reward at slime's parse_args (driver and RolloutManager), with
    # the no-op played to the turn limit and the unfinished episode scored as it stands
    gate = [line for line in run.log.splitlines() if "verifier gate:" in line and "passes oracle, no_action and "
            "unfinished" in line]
    assert any("RolloutManager" in line for line in gate) and "kv_lookup" in "".join(gate), gate
    # cosched dispatched compaction's turns (its generate talks to the engines itself)
    assert "cosched: compaction's turns are dispatched, one session per episode" in run.log
    cosched = [m for m in run.metrics() if "rollout/cosched_requests" in m]
    print("cosched:", cosched)
    assert len(cosched) == NUM_ROLLOUT, cosched
    for m in cosched:
        dispatched = [m[f"rollout/cosched_engine{i}_dispatched"] for i in range(NUM_ENGINES)]
        # dispatched by KV tokens: each engine's budget is kv_fraction of the capacity its /v1/loads reports
        assert all(m[f"rollout/cosched_engine{i}_budget"] == int(MAX_TOTAL_TOKENS * KV_FRACTION)
                   for i in range(NUM_ENGINES)), m
        assert m["rollout/cosched_oversized"] == 0, m
        assert m["rollout/cosched_requests"] == m["rollout/cosched_answers"] == sum(dispatched), m
        assert min(dispatched) > 0, m  # both engines served the rollout
        # a later turn is an owner turn or a counted move; sessions stayed on their owner, which reused their prefix
        assert m["rollout/cosched_session_turns"] == m["rollout/cosched_owner_turns"] + m["rollout/cosched_moves"], m
        assert m["rollout/cosched_owner_turns"] > 0 and m["rollout/cosched_owner_cached_tokens"] > 0, m
        # no answer reused a prefix of another weight version than its own (each said which)
        assert m["rollout/cosched_stale_prefix_answers"] == 0, m
        assert m["rollout/cosched_prefix_version_unreported"] == 0, m

    stats = [request_json(e.url + "/server_info", timeout_s=10)["prefix_cache"] for e in cached_engines]
    print("prefix caches:", stats)
    # slime's metrics and the engines' own counters agree on the reuse and the prompts
    summed = {key: sum(m[f"rollout/cosched_engine{i}_{key}"] for m in cosched for i in range(NUM_ENGINES))
              for key in ("cached_tokens", "prompt_tokens")}
    assert summed["cached_tokens"] == sum(s["prefill_tokens_saved"] for s in stats), (summed, stats)
    assert summed["prompt_tokens"] == sum(s["prompt_tokens"] for s in stats), (summed, stats)
    assert sum(m["rollout/cosched_answers"] for m in cosched) == sum(s["lookups"] for s in stats), stats

    for engine, stat in zip(cached_engines, stats, strict=True):
        assert stat["enabled"] and stat["max_tokens"] == 65536, stat
        # reuse in the rollouts: later turns of an episode (and episodes of one rollout) on their engine
        assert stat["hits"] > 0 and stat["prefill_tokens_saved"] > 0, stat
        # slime's three pushes each switched the cache generation
        assert stat["switches"] == stat["generation"] == NUM_ROLLOUT + 1, stat
        # the engine's log, in order: per push, slime's flush (what it dropped) then the switch (what was left)
        events = re.findall(r"(flush_cache: dropped|weight version \S+ -> \S+: dropped) (\d+) cached prefixes",
                            engine.log.read_text())
        print(f"engine {engine.url} events:", events)
        switches = [i for i, (what, _) in enumerate(events) if what.startswith("weight version")]
        assert len(switches) == NUM_ROLLOUT + 1, events
        for i in switches[1:]:  # the pushes after a rollout: flushed just before, with that rollout's prefixes
            assert i > 0 and events[i - 1][0] == "flush_cache: dropped" and int(events[i - 1][1]) > 0, events
        assert all(int(events[i][1]) == 0 for i in switches), events  # nothing left once slime had flushed
        assert stat["invalidated_entries"] == 0 and stat["flushed_entries"] > 0, stat
        # after the last push nothing of the version before is held; nothing was cached under a later version
        assert stat["entries"] == stat["tokens"] == 0 and stat["stale_inserts_refused"] == 0, stat

    staleness = [m for m in run.metrics() if any(k.startswith("rollout/staleness_") for k in m)]
    assert len(staleness) == NUM_ROLLOUT, staleness
    assert all(m["rollout/staleness_dropped"] == 0 and m["rollout/staleness_kept"] > 0 for m in staleness), staleness
