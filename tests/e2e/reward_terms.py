"""Reward-mix terms for the e2e test (slime's RolloutManager imports them: the test puts this folder on
the job's PYTHONPATH): a judge that fails on every fourth sample, as a grader that times out would."""

from __future__ import annotations


def judge(args, sample, **_):
    if sample.index % 4 == 3:
        raise TimeoutError(f"judge did not answer for sample {sample.index}")
    return (len(sample.response) % 3) / 2
