"""Each train actor validates its plugins (and installs their train patches) as ``TrainRayActor.init`` starts."""

from __future__ import annotations

from ..role_entry import UPSTREAM, RoleEntry

PATCH = RoleEntry(
    id="train.validate_at_actor_init",
    targets=("slime.ray.train_actor:TrainRayActor.init",),
    why="slime has no hook in a train actor before its process group and model are built, which is where the "
        "train-side patches must be installed and a bad setting refused (the actor and the critic each with their "
        "own args).",
    how="TrainRayActor.init is wrapped: the actor's Megatron role (actor / critic) is recorded, its args are "
        "validated and the enabled plugins' train patches installed (slime_ascend.startup.early) before it runs; "
        "after it, one line logs the accelerator slime selected. Installed as slime.ray.train_actor is imported, "
        "before slime's actor classes subclass it.",
    upstream=UPSTREAM,
    checked_on=("0.3.1",),
    role="train",
    args_at=1,
    params=("self", "args", "role"),
)
