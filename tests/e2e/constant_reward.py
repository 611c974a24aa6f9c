"""One reward for every sample (slime's RolloutManager imports it through ``--custom-rm-path``): GRPO's advantages are
then all zero and only the MTP loss trains the model, the scenario slime's ``--ci-test`` asserts when
``--enable-mtp-training`` is on (``slime/backends/megatron_utils/ci_utils.py``: only MTP parameters get a gradient;
slime's own CI gets it by truncating every response, ``tests/test_mimo_7B_mtp_only_grad.py``)."""

from __future__ import annotations


async def reward(args, sample, **_):
    return 1.0
