"""Declaration of the ``reward-mix`` plugin (cheap to import; the code is :mod:`.hooks`)."""

from __future__ import annotations

from ..plugins.base import Contribution, PatchUse, Plugin
from ..plugins.settings import Setting


def _check(penalty: bool):
    def check(value):
        from .mix import MixError, parse_terms

        try:
            parse_terms(value, "ascend_reward_penalties" if penalty else "ascend_reward_components", penalty)
        except MixError as e:
            return str(e)
        return None

    return check


_H = "slime_ascend.reward_mix.hooks."
PLUGIN = Plugin(
    name="reward-mix",
    description="General-RL reward mix R = sum w_k R_k - sum lambda_j P_j declared in the YAML: rule / outcome-model "
                "/ judge components and penalties kept per sample through training, per-term metrics, a failed "
                "grader is an environment failure (never a low reward)",
    conflicts=("opd",),  # both own slime's reward model
    settings=(
        Setting("ascend_reward_components", dict, [],
                "components: list of {name, rm_type (slime's --rm-type names) | path (module.fn(args, sample)), "
                "weight?, kind? (rule | outcome_model | judge), kwargs?}", check=_check(False)),
        Setting("ascend_reward_penalties", dict, [],
                "penalties: list of {name, rm_type | path, lambda? (>= 0), kwargs?}; subtracted", check=_check(True)),
        Setting("ascend_reward_term_timeout_s", float, 300.0,
                "time limit of one term on one sample (seconds); a term that has not answered by then fails its "
                "sample (an environment failure, never a low reward)", minimum=0.001),
    ),
    contributions=(
        Contribution("reward_model", _H + "reward", note="every component and penalty of a sample, concurrently"),
        Contribution("reward_post_process", _H + "fail_unscored", order=50,
                     note="a failed term fails the sample (removed, FAILED), never a low reward; per-term metrics"),
    ),
    # each sample's components, failure and versions travel to training in train_metadata
    patches=(PatchUse("rollout.forward_metadata", "rollout"), PatchUse("train.rollout_log_metadata", "train")),
    validate=_H + "validate",
)
