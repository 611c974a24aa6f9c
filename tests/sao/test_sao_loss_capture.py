"""sao's actor loss hands its train-side log-probs to slime's train dump as slime's own policy loss does
(``sao.loss.capture_train_log_probs`` into ``loss._maybe_capture_log_probs``): with ``use_rollout_logprobs`` slime
skips their separate forward, so without it ``--save-debug-train-data`` would have no ``log_probs`` under sao."""

import pytest
import torch

pytestmark = pytest.mark.slime

slime_loss = pytest.importorskip("slime.backends.megatron_utils.loss", reason="real slime is not on PYTHONPATH")

from slime_ascend.sao.loss import capture_train_log_probs  # noqa: E402


def test_captured_by_rollout_position_first_value_wins_and_nothing_without_a_dump():
    first = [torch.tensor([-0.5, -1.0]), torch.tensor([-2.0])]
    capture_train_log_probs({"partition": [3, 1]}, first)  # slime is not dumping: nothing is kept
    slime_loss.enable_log_prob_capture()
    try:
        capture_train_log_probs({"partition": [3, 1]}, first)
        capture_train_log_probs({"partition": [3]}, [torch.tensor([9.0, 9.0])])  # a later pass (after a step)
        capture_train_log_probs({}, [torch.tensor([7.0])])  # no partition: slime adds it only when dumping
    finally:
        captured = slime_loss.drain_captured_log_probs()
    assert sorted(captured) == [1, 3]
    assert torch.equal(captured[3], first[0]) and torch.equal(captured[1], first[1])
    assert slime_loss.drain_captured_log_probs() == {}
