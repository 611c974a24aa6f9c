"""``slime-ascend demo``: slime's closed RL loop in miniature, through our hook dispatchers.

:mod:`.task` (digits task, environment, starting checkpoints), :mod:`.rollout` (engines, generate and
rewards as slime's RolloutManager), :mod:`.trainer` (policy + critic as slime's train actors, weight
export), :mod:`.loop` (Ray orchestration, metrics, report), :mod:`.cli` (the command).
"""
