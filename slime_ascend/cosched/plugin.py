"""Declaration of the ``cosched`` plugin (cheap to import; the code is :mod:`.hooks` and :mod:`.dispatch`)."""

from __future__ import annotations

from ..plugins.base import Contribution, PatchUse, Plugin
from ..plugins.settings import Setting

PLUGIN = Plugin(
    name="cosched",
    description="Rollout co-scheduling: each request waits in one queue and goes to the engine that has a free slot "
                "the moment it has one; multi-turn sessions (compaction's episodes: every turn) stay on their engine "
                "while it has room (moves counted); per-engine busy fraction, queue wait, moves and the engines' "
                "reported prefix reuse in slime's rollout metrics",
    settings=(
        Setting("ascend_cosched_unit", str, "requests", choices=("requests", "kv_tokens"),
                help="what an engine's capacity counts: requests (ascend_cosched_capacity slots) or kv_tokens (its "
                "KV capacity, max_total_num_tokens of its /v1/loads; a request takes its prompt plus max_new_tokens)"),
        Setting("ascend_cosched_capacity", int, 0, minimum=0,
                help="requests running at once per engine (0: slime's --sglang-server-concurrency); unit requests"),
        Setting("ascend_cosched_kv_fraction", float, 0.9, minimum=0.01, maximum=1.0,
                help="unit kv_tokens: the share of each engine's KV capacity requests may reserve (the rest is "
                "headroom for its prefix cache)"),
        Setting("ascend_cosched_refresh_s", float, 30.0, minimum=0.0,
                help="how often the engine list is read again from the router's /workers (seconds)"),
    ),
    contributions=(
        Contribution("reward_post_process", "slime_ascend.cosched.hooks.report", order=10,
                     note="this rollout's dispatch counts as rollout/cosched_* metrics; rewards unchanged"),
    ),
    # compaction's turns (its generate calls the engines itself): hooked when slime_ascend.compaction.generate loads
    process_start=("slime_ascend.cosched.sessions.process_start",),
    patches=(PatchUse("rollout.cosched_generate", "rollout"),),
)
