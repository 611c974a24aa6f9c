"""Memory ledger: the peak accelerator (and host) memory of each role of a slime job, object by object.

Pure Python (no torch): :mod:`.ledger` holds the formulas, :mod:`.cli` the ``slime-ascend memory`` command,
:mod:`.measure` the CPU measurement that checks the estimate against a real training step.
"""
