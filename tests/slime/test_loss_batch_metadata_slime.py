"""train.loss_batch_metadata on real slime: the loss batch that train_one_step builds holds each sample's
forwarded metadata (the opd top-k payload), in micro-batch order; forward_only's batches do not."""

import pytest
import torch

from slime_ascend import patch

pytestmark = pytest.mark.slime

PATCH_ID = "train.loss_batch_metadata"


@pytest.fixture(scope="module")
def slime_model():
    from slime_ascend.compat import typing_override

    typing_override.ensure()  # megatron-core >= 0.17 on Python 3.11 (as the cpu plugin does)
    import slime.backends.megatron_utils.model as model

    return model


@pytest.fixture
def single_rank(monkeypatch, slime_model):
    """get_batch on one TP/CP rank of this host, without initialising Megatron's process groups."""
    import slime.backends.megatron_utils.data as data
    from slime.utils import accelerator

    monkeypatch.setattr(data.mpu, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(data.mpu, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(data.mpu, "get_context_parallel_rank", lambda: 0)
    monkeypatch.setattr(accelerator, "device", lambda: torch.device("cpu"), raising=False)
    monkeypatch.setattr(accelerator, "current_device", lambda: torch.device("cpu"), raising=False)
    return data


def _train_keys(model):
    """The loss batch's key list, read from train_one_step's source (what the patch must widen)."""
    import inspect
    import re

    source = inspect.getsource(model.train_one_step)
    block = source[source.index("batch = get_batch("):]
    return [k for k in re.findall(r'^\s*"([a-z_]+)",\s*$', block[: block.index("]")], re.M)]


def _rollout_data():
    payload = [{"opd_topk": {"format": "opd_topk_v1", "k": 2, "ids": torch.tensor([[i, i + 1]] * 2, dtype=torch.int32),
                             "log_probs": torch.full((2, 2), -1.0 - i)}, "opd_coef": float(i)} for i in range(3)]
    return {
        "tokens": [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11])],
        "total_lengths": [4, 3, 4], "response_lengths": [2, 2, 2],
        "loss_masks": [torch.ones(2, dtype=torch.int)] * 3,
        "advantages": [torch.zeros(2)] * 3,
        "metadata": payload,
    }


def test_target_matches_this_slime(slime_model):
    assert patch.get(PATCH_ID).verify() == []
    assert "advantages" in _train_keys(slime_model) and "metadata" not in _train_keys(slime_model)


def test_loss_batch_gets_the_micro_batch_metadata(slime_model, single_rank):
    data = single_rank
    keys = _train_keys(slime_model)
    rollout = _rollout_data()
    it = data.DataIterator(rollout, [[2, 0], [1]])
    assert "metadata" not in slime_model.get_batch(it, keys, 1)  # stock slime: never requested
    original = slime_model.get_batch
    patch.install(PATCH_ID)
    try:
        it = data.DataIterator(rollout, [[2, 0], [1]])
        first, second = slime_model.get_batch(it, keys, 1), slime_model.get_batch(it, keys, 1)
        assert first["metadata"] == [rollout["metadata"][2], rollout["metadata"][0]]
        assert second["metadata"] == [rollout["metadata"][1]]
        assert first["metadata"][0]["opd_topk"]["ids"].tolist() == [[2, 3], [2, 3]]
        # everything slime builds is unchanged: tokens, packing, masks
        torch.testing.assert_close(first["tokens"], torch.tensor([[8, 9, 10, 11, 1, 2, 3, 4]]))
        # forward_only's log-prob passes (no 'advantages' in their request) are left alone
        it = data.DataIterator(rollout, [[0]])
        assert "metadata" not in slime_model.get_batch(it, ["tokens", "loss_masks", "multimodal_train_inputs",
                                                             "total_lengths", "response_lengths"], 1)
        # no forwarded metadata (rollout.forward_metadata not installed in the rollout manager): None, as any key
        it = data.DataIterator({k: v for k, v in rollout.items() if k != "metadata"}, [[0]])
        assert slime_model.get_batch(it, keys, 1)["metadata"] is None
    finally:
        patch.get(PATCH_ID).remove()
    assert slime_model.get_batch is original


def test_check_fails_loudly_when_train_one_step_changes(slime_model, monkeypatch):
    from slime_ascend.patch.base import PatchTargetError

    def train_one_step(*args, **kwargs):  # a slime whose loss batch is built some other way
        return None

    monkeypatch.setattr(slime_model, "train_one_step", train_one_step)
    with pytest.raises(PatchTargetError, match="train.loss_batch_metadata.*train_one_step no longer contains"):
        patch.install(PATCH_ID)
    assert not patch.get(PATCH_ID).applied
