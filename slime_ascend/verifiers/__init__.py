"""The verifier gate: a verifier (an environment's reward, a reward function) must pass three checks before it is
used to train. It rewards a known correct solution (``oracle``), gives nothing to a run where the agent did nothing
(``no_action``), and gives nothing to a run that left the task unfinished (``unfinished``).

* :mod:`.gate`: the three checks (pure: a scoring callable and its cases in, results out);
* :mod:`.scoring`: how a case is scored, exactly as training scores it (an environment played action by action
  under compaction's episode rule; a reward function called with slime's ``(args, sample)``);
* :mod:`.job`: which verifiers a slime job uses (from its ``args``), the ``verifier-gate`` plugin's start-up check,
  and ``slime-ascend check --verifiers CONFIG``;
* :mod:`.plugin`: the plugin's declaration.

A verifier declares its cases where it is defined: an environment with a ``verifier_cases()`` method, a reward
function with :func:`declare_cases` (or, for code one cannot edit and slime's ``--rm-type`` rules, the
``ascend_verifier_gate_cases`` setting).
"""

from __future__ import annotations

from .gate import CHECKS, EnvRun, GateCases, SampleRun, declare_cases

__all__ = ["CHECKS", "EnvRun", "GateCases", "SampleRun", "declare_cases"]
