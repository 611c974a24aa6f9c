"""Plugin declaration for ``tito`` (token-in/token-out). Declarations only; the hook code is
:mod:`slime_ascend.tito.hooks` (over the plain functions of :mod:`slime_ascend.tito.fingerprint`).

* ``tito`` (rollout_sample_hook 900, reward_post_process 900, megatron_init 900,
  rollout_data_postprocess 900): the token IDs trained on are the ones sampled, and the tokenizer /
  chat template are the same revision on the rollout and train sides.
"""

from __future__ import annotations

from ..plugins.base import Contribution, Plugin
from ..plugins.settings import Setting

_O = "slime_ascend.tito.hooks."

TITO = Plugin(
    name="tito",
    description="token-in/token-out: train on the exact rollout token IDs with the same tokenizer revision",
    settings=(
        Setting("ascend_tito_tokenizer_revision", str, None,
                "expected tokenizer fingerprint (`slime-ascend tito-fingerprint <hf_checkpoint>`); unset: the "
                "rollout and train sides are compared with each other through Ray's KV store",
                optional=True),
        Setting("ascend_tito_require_record", bool, True,
                "fail when a sample reaches training without the record the rollout_sample_hook writes"),
    ),
    contributions=(
        Contribution("rollout_sample_hook", _O + "record_sample", order=900,
                     note="records token hash + tokenizer/chat-template fingerprint on sample.metadata"),
        Contribution("reward_post_process", _O + "check_samples", order=900,
                     note="fails when tokens changed since generation"),
        Contribution("megatron_init", _O + "check_train_tokenizer", order=900,
                     note="train-side tokenizer fingerprint vs pinned / rollout-side"),
        Contribution("rollout_data_postprocess", _O + "check_train_rollout", order=900,
                     note="train-side fingerprint vs the rollout side's, every rollout"),
    ),
)
