"""Reward-mix terms for the e2e test (slime's RolloutManager imports them: the test puts this folder on
the job's PYTHONPATH): a grader that fails on every fourth sample, as one that times out would."""

from __future__ import annotations


def flaky(args, sample, **_):
    if sample.index % 4 == 3:
        raise TimeoutError(f"grader did not answer for sample {sample.index}")
    return (len(sample.response) % 3) / 2
