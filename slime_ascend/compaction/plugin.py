"""The ``compaction`` plugin (CompactionRL, arXiv 2607.05378): rollouts with context compaction and
segment-aware credit on stock slime.

What each process runs:

* RolloutManager
  - generate (exclusive): :func:`slime_ascend.compaction.generate.generate`, one ``Sample`` per
    segment, all sharing ``rollout_id``; ``metadata["round_number"]`` = segment index.
  - reward_post_process (order 500): :func:`slime_ascend.compaction.credit.share_final_reward`, every
    segment gets the reward of its rollout's last segment. The dispatcher then normalises per prompt
    group counting each rollout once (slime's own normalisation falls back to the whole batch).
* Train actors (actor and critic), advantage chain (:mod:`slime_ascend.compaction.credit`):
  - order 50, ``prepare_segments``: all-gathers ``(rollout_id, round_number, trainable tokens)`` over the
    data-parallel group and stores ``rollout_trainable_tokens`` / ``trainable_tokens_after`` per sample;
  - order 150, ``base_advantages``: for ``ppo``, when no earlier contribution (e.g. sao at 100) set
    advantages, local skip-observation GAE per segment; for the other estimators the dispatcher runs
    slime's own at the chain's base order (200);
  - order 300, ``decay_advantages``: ``A(s, i) *= (gamma * lambda) ** N_after(s)``.

Token-level normalisation across segments needs nothing extra: slime's ``rollout_mask_sums`` make the
loss a per-rollout token mean over all segments, and a step counts rollouts, not samples.
Segment order reaches the trainer through ``round_number`` and ``rollout_ids``, which slime already
forwards, so no runtime patch is needed.
"""

from __future__ import annotations

from slime_ascend.plugins.base import Contribution, Plugin
from slime_ascend.plugins.settings import Setting

_P = "ascend_compaction_"
_CREDIT = "slime_ascend.compaction.credit."


def _optional_positive(value: object) -> str | None:
    return None if value is None or int(value) >= 1 else "must be >= 1 (or null for the default)"


# read by slime_ascend.compaction.generate (its SETTINGS_DEFAULTS are these defaults)
ROLLOUT_SETTINGS = (
    Setting(_P + "context_budget", int, None, optional=True, check=_optional_positive,
            help="context budget C in tokens; null = slime's rollout_max_context_len, else 32768"),
    Setting(_P + "trigger_tokens", int, 10240, minimum=0,
            help="T_comp: compact when C - |h| < T_comp (paper default 10240)"),
    Setting(_P + "max_compactions", int, 3, minimum=0, help="at most this many compactions per rollout"),
    Setting(_P + "keep_pairs", int, 2, minimum=0,
            help="k: the last k action-observation pairs are copied into the rebuilt context"),
    Setting(_P + "max_turns", int, 64, minimum=1, help="at most this many actions per rollout"),
    Setting(_P + "max_action_tokens", int, None, optional=True, check=_optional_positive,
            help="cap on one action's tokens; null = the sampling params' max_new_tokens"),
    Setting(_P + "summary_max_tokens", int, 2048, minimum=1, help="cap on one summary's tokens"),
    Setting(_P + "env", str, "kv_lookup",
            help="environment: a built-in name (kv_lookup) or a dotted package.module.attr factory"),
    Setting(_P + "env_kwargs", dict, None, optional=True, help="keyword arguments for the environment factory"),
    Setting(_P + "env_reward", bool, True,
            help="use the environment's final reward (false: leave reward unset for slime's reward model)"),
    Setting(_P + "use_chat_template", bool, True, help="format turns with the tokenizer's chat template"),
    Setting(_P + "summary_prompt_path", str, None, optional=True,
            help="text file with the summary instruction; null = the built-in one"),
    Setting(_P + "resume_template_path", str, None, optional=True,
            help="text file with the resume template ({task}, {summary}); null = the built-in one"),
)

SETTINGS = ROLLOUT_SETTINGS + (
    # train side (read by slime_ascend.compaction.credit)
    Setting(_P + "lambda_mode", str, "fixed", choices=("fixed", "length_adaptive"),
            help="GAE lambda of a rollout when the base estimator does not report one: fixed = slime's "
                 "--lambd; length_adaptive = 1 - 1/(alpha * l), l = trainable tokens of the whole rollout"),
    Setting(_P + "lambda_alpha", float, 1.5, minimum=1e-9, help="alpha of the length-adaptive lambda"),
    Setting(_P + "critic_target", str, "decayed", choices=("decayed", "local"),
            help="value target: decayed = decayed advantage + V (reference implementation); "
                 "local = the segment's undecayed GAE target"),
)

PLUGIN = Plugin(
    name="compaction",
    description="CompactionRL: context compaction in rollouts, cross-segment GAE and per-rollout credit",
    settings=SETTINGS,
    contributions=(
        Contribution("generate", "slime_ascend.compaction.generate.generate",
                     note="one Sample per segment, shared rollout_id, round_number = segment index"),
        Contribution("reward_post_process", _CREDIT + "share_final_reward", order=500,
                     note="every segment carries its rollout's final reward"),
        Contribution("advantage", _CREDIT + "prepare_segments", order=50,
                     note="gather segment layout over DP; rollout_trainable_tokens, trainable_tokens_after"),
        Contribution("advantage", _CREDIT + "base_advantages", order=150,
                     note="ppo, unless an earlier contribution set advantages: per-segment skip-observation GAE"),
        Contribution("advantage", _CREDIT + "decay_advantages", order=300,
                     note="A *= (gamma*lambda)**N_after(s)"),
    ),
    validate=_CREDIT + "validate",
)
