"""A stand-in for ``slime.backends.megatron_utils.actor`` shaped like the real one, for CPU tests.

``MegatronTrainRayActor.train_critic`` has the same structure as slime's: values by ``forward_only``,
targets by ``compute_advantages_and_returns``, ``loss_type = "value_loss"``, then one
``train(...)`` call on the module-level name. The runtime patches install onto this module unchanged.
The module-level functions are set by the test (``forward_only``, ``get_values``,
``compute_advantages_and_returns``, ``train``).
"""

from __future__ import annotations


def get_values(*args, **kwargs):  # replaced by the test
    raise NotImplementedError


def forward_only(*args, **kwargs):  # replaced by the test
    raise NotImplementedError


def compute_advantages_and_returns(args, rollout_data):  # replaced by the test
    raise NotImplementedError


def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches, global_batch_sizes):
    raise NotImplementedError  # replaced by the test


class MegatronTrainRayActor:
    def __init__(self, args, model, optimizer, opt_param_scheduler):
        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.opt_param_scheduler = opt_param_scheduler

    def train_critic(self, rollout_id, rollout_data):
        data_iterator = [rollout_data]
        num_microbatches = [1]
        global_batch_sizes = [len(rollout_data["rewards"])]
        rollout_data.update(forward_only(get_values, self.args, self.model, data_iterator, num_microbatches))
        compute_advantages_and_returns(self.args, rollout_data)
        self.args.loss_type = "value_loss"
        train(
            rollout_id,
            self.model,
            self.optimizer,
            self.opt_param_scheduler,
            data_iterator,
            num_microbatches,
            global_batch_sizes,
        )
        return {"values": [v.detach().clone() for v in rollout_data["values"]]}
