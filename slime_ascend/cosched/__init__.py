"""``cosched``: rollout requests dispatched by free engine capacity (GLM-5.3's co-scheduling).

slime sends every request of a batch up front under one concurrency bound and lets the router place it, so a long
generation can hold one engine's queue while another engine sits empty. With this plugin each request waits in one
queue in the rollout process and goes to an engine the moment that engine has a free slot; a multi-turn session
stays on its engine while that engine has capacity, and moves (counted) when it has not.

* :mod:`.dispatch`: the capacity dispatcher (pure asyncio: engines, slots, sessions, its counts);
* :mod:`.hooks`: the adapter slime's rollout calls (through the ``rollout.cosched_generate`` patch) and the
  per-rollout metrics;
* :mod:`.plugin`: the declaration.
"""
