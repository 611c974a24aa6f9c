"""``parity_reward.reward`` for a custom generate that returns a list of samples (compaction's segments): slime
then calls ``--custom-rm-path`` once with the whole list (``rm_hub.batched_async_rm``) and wants one reward per
sample back. A single sample is answered as ``parity_reward`` answers it."""

from __future__ import annotations

from parity_reward import reward as _parity


async def reward(args, sample, **kwargs):
    if isinstance(sample, list):
        return [await _parity(args, s, **kwargs) for s in sample]
    return await _parity(args, sample, **kwargs)
