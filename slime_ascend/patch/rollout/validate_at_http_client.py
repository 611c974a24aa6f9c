"""The RolloutManager validates its plugins (and installs their rollout patches) as it starts."""

from __future__ import annotations

from ..role_entry import UPSTREAM, RoleEntry

PATCH = RoleEntry(
    id="rollout.validate_at_http_client",
    targets=("slime.utils.http_utils:init_http_client",),
    why="slime's RolloutManager gets its args in __init__, with no hook before it starts the engines; "
        "init_http_client(args) is its first call and the rollout-side patches must be in place by then.",
    how="init_http_client is wrapped: its args are validated and the enabled plugins' rollout patches installed "
        "(slime_ascend.startup.early) before it runs. Installed as slime.utils.http_utils is imported, before "
        "slime.ray.rollout binds the name.",
    upstream=UPSTREAM,
    checked_on=("0.3.1",),
    role="rollout",
    args_at=0,
    params=("args",),
)
