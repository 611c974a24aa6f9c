"""A deterministic reward for the layout-parity e2e test (slime's RolloutManager imports it through
``--custom-rm-path``: the test puts this folder on the job's PYTHONPATH). It varies between samples, so
GRPO's advantages are not all zero, and it is the same in every run, so runs can be compared."""

from __future__ import annotations


async def reward(args, sample, **_):
    return float(sum(sample.tokens[-len(sample.response) or None:]) % 2) if sample.response else 0.0
