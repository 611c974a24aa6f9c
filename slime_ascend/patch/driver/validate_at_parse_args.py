"""The driver validates its plugins on the ``args`` slime's ``parse_args`` returns (after the YAML is applied)."""

from __future__ import annotations

from ..role_entry import UPSTREAM, RoleEntry

PATCH = RoleEntry(
    id="driver.validate_at_parse_args",
    targets=("slime.utils.arguments:parse_args",),
    why="slime has no hook where the driver first holds the final args, so a bad plugin setting would only stop "
        "the job at the first hook call, after Ray, the engines and the train actors have started.",
    how="parse_args is wrapped: its result is validated (slime_ascend.startup.early); a refusal is one line on "
        "stderr and exit status 2, as argparse does for a bad flag. Installed as slime.utils.arguments is imported, "
        "before train.py binds the name.",
    upstream=UPSTREAM,
    checked_on=("0.3.1",),
    role="driver",
    args_at=None,
    source=("return args",),
)
