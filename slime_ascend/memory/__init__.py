"""Memory ledger: the peak accelerator (and host) memory of each role of a slime job, object by object.

Pure Python (no torch): :mod:`.ledger` holds the formulas, :mod:`.cli` the ``slime-ascend memory`` command.
:mod:`.measure` checks the estimate against slime's own Megatron train actor run on this CPU (the ``cpu``
plugin), through :mod:`.probe`, the before-train-step hook that reads the actor's memory.
"""
