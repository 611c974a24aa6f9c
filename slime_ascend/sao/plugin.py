"""The ``sao`` plugin (SAO, arXiv 2607.07508): single-rollout asynchronous PPO with a value model.

What each train process runs (slime's actor and critic Ray actors):

* runtime patches, installed as each train actor starts: ``train.critic_train_iters`` (K value-loss
  passes per rollout), ``train.critic_advantage_function`` (the critic keeps our advantage function
  and routes its value loss through our loss dispatcher, although ``--megatron-config-path`` nulls
  the former) and ``train.critic_hf_value_head`` (the critic can start from an HF ``--load``).
* megatron_init (order 200, :func:`slime_ascend.sao.critic.megatron_init`): K and its LR schedule
  onto slime's args.
* advantage (order 100, :func:`slime_ascend.sao.advantage.skip_observation_advantages`):
  skip-observation GAE, gathered over context parallelism, computed, re-sliced. Actor: lambda
  ``1 - 1/(alpha * l)`` per rollout, ``l`` = trainable tokens; critic: ``ascend_sao_critic_lambda``.
* loss (exclusive, :func:`slime_ascend.sao.loss.sao_loss`): actor = DIS policy loss against the
  engine's log-probs; critic = clipped value loss. Both reduced per token over all trainable
  tokens (``calculate_per_token_loss``).
* before_train_step (order 200, :func:`slime_ascend.sao.freeze.before_train_step`): in the critic,
  checks on the real model that the frozen attention parameters have no gradient buffer and no
  optimizer state (first step) and stayed bit-identical (second step).

The critic freeze list goes into the critic role of ``--megatron-config-path``; write that file
with ``python -m slime_ascend.sao.critic -o sao_megatron.yaml``.
"""

from __future__ import annotations

from slime_ascend.plugins.base import CommandLineFlag, Contribution, PatchUse, Plugin
from slime_ascend.plugins.settings import Setting, read

_P = "ascend_sao_"
_S = "slime_ascend.sao."


def _freeze_config_given(args: object) -> bool:
    # a command-line check runs after the settings' own (runtime.check), so the value reads cleanly here
    return not read(_FREEZE_ATTENTION, args) or getattr(args, "megatron_config_path", None) is not None


def _patterns_check(value: object) -> str | None:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        return "must be a non-empty list of regular expressions (re.search on Megatron parameter names)"
    import re

    for v in value:
        try:
            re.compile(v)
        except re.error as exc:
            return f"{v!r} is not a valid regular expression ({exc})"
    return None


_FREEZE_ATTENTION = Setting(
    _P + "freeze_critic_attention", bool, True,
    help="freeze the critic's attention; needs the critic freeze list in --megatron-config-path")

SETTINGS = (
    Setting(_P + "critic_iters", int, 2, minimum=1,
            help="K: value-loss passes over each rollout batch per policy update (SAO faster value update)"),
    Setting(_P + "critic_lr_schedule", str, "per_rollout", choices=("per_rollout", "per_pass"),
            help="critic LR/WD schedule with K passes: per_rollout = advances only in the first pass (same "
                 "units as the actor; lr-warmup/decay iters count policy steps); per_pass = advances in every "
                 "pass (K times per rollout: scale the critic's lr_warmup_iters / lr_decay_iters by K)"),
    Setting(_P + "lambda_alpha", float, 1.5, minimum=1e-9,
            help="alpha of the policy's length-adaptive GAE lambda 1 - 1/(alpha * l), l = trainable tokens"),
    Setting(_P + "gamma", float, 1.0, minimum=0.0, maximum=1.0, help="GAE discount (replaces slime's --gamma)"),
    Setting(_P + "critic_lambda", float, 1.0, minimum=0.0, maximum=1.0,
            help="GAE lambda for the critic's value targets (SAO: 1)"),
    Setting(_P + "dis_preset", str, "maths", choices=("glm5", "maths", "coding", "custom"),
            help="DIS band: maths (0.7, 6.0), coding (0.2, 4.0), glm5 (0.8, 1.28), custom = the two eps below"),
    Setting(_P + "dis_eps_low", float, None, optional=True,
            help="DIS eps_low (keep r > 1 - eps_low); required with dis_preset custom, else must be null"),
    Setting(_P + "dis_eps_high", float, None, optional=True,
            help="DIS eps_high (keep r < 1 + eps_high); required with dis_preset custom, else must be null"),
    _FREEZE_ATTENTION,
    Setting(_P + "freeze_patterns", list, ["self_attention"], check=_patterns_check,
            help="regexes (re.search) naming the critic's frozen parameters; 'self_attention' covers QKV, output "
                 "projection, q/k layernorms, fused input layernorm, MLA and DSA-indexer weights"),
    Setting(_P + "verify_frozen", bool, True,
            help="in the critic, check on the real model that frozen parameters get no optimizer state and no "
                 "update (first two train steps)"),
)

PLUGIN = Plugin(
    name="sao",
    description="SAO: skip-observation GAE, K critic updates, frozen critic attention, DIS loss, single rollouts",
    settings=SETTINGS,
    contributions=(
        Contribution("advantage", _S + "advantage.skip_observation_advantages", order=100,
                     note="skip-observation GAE; actor lambda 1-1/(alpha*l), critic lambda ascend_sao_critic_lambda"),
        Contribution("loss", _S + "loss.sao_loss",
                     note="actor: DIS policy loss; critic: clipped value loss; per-token normalisation"),
        Contribution("megatron_init", _S + "critic.megatron_init", order=200,
                     note="K critic passes and their LR schedule onto slime's args"),
        Contribution("before_train_step", _S + "freeze.before_train_step", order=200,
                     note="critic: frozen parameters have no optimizer state and stay bit-identical"),
    ),
    patches=(
        PatchUse("train.critic_train_iters", "train"),
        PatchUse("train.critic_advantage_function", "train", after=("train.critic_train_iters",)),
        PatchUse("train.critic_hf_value_head", "train"),
    ),
    slime_args=(
        ("calculate_per_token_loss", True),  # token-level normalisation over all trainable tokens
        ("use_rollout_logprobs", True),  # DIS needs no recomputed old log-probs; KL (if any) uses the engine's
    ),
    command_line=(
        CommandLineFlag("--advantage-estimator ppo", "slime creates the critic only for ppo",
                        check=lambda a: getattr(a, "advantage_estimator", None) == "ppo"),
        CommandLineFlag("--n-samples-per-prompt 1", "single rollout per prompt; slime derives the global batch "
                        "size from it", check=lambda a: getattr(a, "n_samples_per_prompt", None) == 1),
        CommandLineFlag("--megatron-config-path sao_megatron.yaml",
                        "critic freeze list (`slime-ascend config -o` writes it beside the YAML)",
                        check=_freeze_config_given),
        CommandLineFlag("train_async.py --rollout-function-path "
                        "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
                        "asynchrony (recommended; add the staleness plugin to bound off-policy lag)"),
    ),
    validate=_S + "critic.validate",
    config_files=(("sao_megatron.yaml", _S + "role_config.write_role_config_for"),),
)
