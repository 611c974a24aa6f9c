"""The torch engine's prefix cache in slime's own ``train.py`` (``cpu``, ``compaction``, ``staleness``).

One torch engine served with ``--prefix-cache-tokens`` behind slime's router; compaction's ``kv_lookup`` episodes are
multi-turn (each action's prompt extends the last one) and every episode shares the environment's instructions, so
a later turn, and a later rollout's first turn, would find a cached prefix. slime pushes three weight versions
(before rollout 0, after step 0, after step 1). Evidence from the engine's own report (``/server_info``'s
``prefix_cache``) and log, and from slime's metrics:

* reuse happened in the rollouts (``prefill_tokens_saved`` > 0, ``hits`` > 0);
* slime flushes before every push (``pause_generation``, ``flush_cache``, ``update_weights_from_disk``: the
  contract its SGLang engines rely on): in the engine's log each push after a rollout is preceded by a flush that
  dropped that rollout's prefixes (N > 0), and the switch itself then found nothing left to drop (its own drop,
  the second line of the contract, is exercised by tests/rollout/test_torch_engine_prefix_cache.py); the next
  rollout started from an empty cache, so none of its tokens came from a prefix of the version before;
* every push switched the cache's generation (three switches); after the last push the cache holds nothing;
* no request was inserted under a version other than the one that computed it (``stale_inserts_refused`` 0:
  ``train.py`` is synchronous, slime pauses with ``abort``), and the staleness plugin kept every sample.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from slime_ascend.demo.slime_job import Engine, free_port, make_prompts, run_slime, slime_flags, stop
from slime_ascend.json_client import JSONRequestError, request_json
from e2e_fixtures import model_dir  # noqa: F401  (pytest fixture)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1200)]

PLUGINS = ("cpu", "compaction", "staleness")
NUM_ROLLOUT = 2
BATCH, N_SAMPLES = 2, 4  # test_slime_compaction.py's: random rewards differ in some group (1 - 1/4096)
SETTINGS = {  # test_slime_compaction.py's episode: 3 facts, a 1024-token budget, one compaction a rollout
    "ascend_compaction_env_reward": "false",
    "ascend_compaction_env_kwargs": json.dumps({"num_facts": 3, "noise_lines": 1, "answer_turns": 1}),
    "ascend_compaction_context_budget": "1024",
    "ascend_compaction_trigger_tokens": "700",
    "ascend_compaction_max_compactions": "1",
    "ascend_compaction_keep_pairs": "1",
    "ascend_compaction_summary_max_tokens": "8",
    "ascend_compaction_use_chat_template": "false",
    "ascend_staleness_tau": "1",
}


@pytest.fixture
def cached_engine(model_dir, tmp_path):  # noqa: F811
    """``slime-ascend serve-torch`` with the prefix cache on (slime_job.start_engine's, plus the flag)."""
    import os

    port, log = free_port(), tmp_path / "engine.log"
    env = {k: v for k, v in os.environ.items() if k != "SLIME_ASCEND_PLUGINS"}
    cmd = [sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--prefix-cache-tokens", "65536"]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                request_json(url + "/health", timeout_s=2)
                break
            except JSONRequestError:
                time.sleep(0.3)
        yield Engine(url, proc, log)
    finally:
        stop(proc)


def test_train_py_compaction_reuses_prefixes_and_drops_them_at_every_push(model_dir, cached_engine,  # noqa: F811
                                                                           tmp_path):
    config = tmp_path / "ascend.yaml"
    sets = [w for k, v in SETTINGS.items() for w in ("--set", f"{k}={v}")]
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, *sets, "-o", str(config)],
                   check=True, capture_output=True, text=True)
    flags = slime_flags(model_dir, make_prompts(tmp_path / "prompts.jsonl"), [cached_engine], tmp_path,
                        num_rollout=NUM_ROLLOUT, batch=BATCH, n_samples=N_SAMPLES, save=False)
    flags += ["--seq-length", "2048"]
    run = run_slime("train.py", flags, tmp_path, PLUGINS, custom_config=config)
    assert run.returncode == 0, run.log[-6000:]
    print(f"train.py ran {run.seconds:.0f} s")

    stats = request_json(cached_engine.url + "/server_info", timeout_s=10)["prefix_cache"]
    assert stats["enabled"] and stats["max_tokens"] == 65536, stats
    # reuse in the rollouts: later turns of an episode (and episodes of one rollout) on their engine
    assert stats["hits"] > 0 and stats["prefill_tokens_saved"] > 0, stats
    # slime's three pushes each switched the cache generation
    assert stats["switches"] == stats["generation"] == NUM_ROLLOUT + 1, stats
    # the engine's log, in order: per push, slime's flush (what it dropped) then the switch (what was left)
    events = re.findall(r"(flush_cache: dropped|weight version \S+ -> \S+: dropped) (\d+) cached prefixes",
                        cached_engine.log.read_text())
    print("engine events:", events, "prefix cache:", stats)
    switches = [i for i, (what, _) in enumerate(events) if what.startswith("weight version")]
    assert len(switches) == NUM_ROLLOUT + 1, events
    for i in switches[1:]:  # the pushes after a rollout: flushed just before, with that rollout's prefixes
        assert i > 0 and events[i - 1][0] == "flush_cache: dropped" and int(events[i - 1][1]) > 0, events
    assert all(int(events[i][1]) == 0 for i in switches), events  # nothing left once slime had flushed
    assert stats["invalidated_entries"] == 0 and stats["flushed_entries"] > 0, stats
    # after the last push nothing of the version before is held; nothing was cached under a later version
    assert stats["entries"] == stats["tokens"] == 0 and stats["stale_inserts_refused"] == 0, stats

    staleness = [m for m in run.metrics() if any(k.startswith("rollout/staleness_") for k in m)]
    assert len(staleness) == NUM_ROLLOUT, staleness
    assert all(m["rollout/staleness_dropped"] == 0 and m["rollout/staleness_kept"] > 0 for m in staleness), staleness
