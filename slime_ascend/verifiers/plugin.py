"""Declaration of the ``verifier-gate`` plugin (cheap to import; the code is :mod:`.job`)."""

from __future__ import annotations

from ..plugins.base import Plugin
from ..plugins.settings import Setting
from .gate import TIMEOUT_SETTING


def _check_cases(value):
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return ("must map verifier names (an environment spec, a reward function's module.fn, rm_type:NAME) to "
                "the module.fn that returns its GateCases")
    return None


PLUGIN = Plugin(
    name="verifier-gate",
    description="Every verifier is checked at start before it trains anything: it rewards its oracle solution, "
                "gives nothing to a run where the agent did nothing and nothing to an unfinished run; a verifier "
                "that fails is refused in one line naming it and the check",
    settings=(
        Setting("ascend_verifier_gate_cases", dict, None, optional=True, check=_check_cases,
                help="cases for verifiers that cannot declare their own: {verifier name: module.fn returning "
                     "slime_ascend.verifiers.GateCases}; names are the environment spec, the reward function's "
                     "dotted path, or rm_type:NAME for slime's --rm-type rules"),
        Setting("ascend_verifier_gate_require_cases", bool, True,
                help="refuse a verifier that declares no cases (false: warn and train with it unchecked)"),
        Setting(TIMEOUT_SETTING, float, 60.0, minimum=0.1,
                help="seconds one call into a verifier (building it, declaring its cases, scoring one case) may "
                     "take; a verifier that does not answer in time fails the gate"),
    ),
    validate="slime_ascend.verifiers.job.validate",
)
