"""The critic's role in slime's ``--megatron-config-path`` file: written here, read back here.

slime gives each role of that file its own overrides (``_apply_megatron_role_overrides``); the critic's entry
carries SAO's freeze list (and any other critic-only args, e.g. its learning rate). ``python -m
slime_ascend.sao.critic`` and ``slime-ascend config`` write it; the start-up freeze check
(:func:`slime_ascend.sao.freeze.check_freeze_config`) and the demo read it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def critic_role_overrides(freeze_patterns: Sequence[str] = ("self_attention",), **extra: Any) -> dict:
    """Overrides for the critic role: the freeze list plus any ``extra`` slime args (e.g. ``lr=5e-6``)."""
    out = dict(extra)
    frozen = list(out.pop("freeze_params_name_list", None) or [])
    out["freeze_params_name_list"] = frozen + [p for p in freeze_patterns if p not in frozen]
    return out


def write_role_config_for(path: str, settings: dict, force: bool = False) -> None:
    """``slime-ascend config``'s writer of the critic role file, with the YAML's freeze patterns."""
    patterns = settings.get("ascend_sao_freeze_patterns") or ["self_attention"]
    if not settings.get("ascend_sao_freeze_critic_attention", True):
        patterns = []
    write_megatron_role_config(path, patterns, force=force)


def role_entry(path: str | None, config: Any, role: str = "critic") -> dict | None:
    """The ``role: ROLE`` entry of the slime megatron role config ``config`` read from ``path`` (None: none)."""
    entries = config.get("megatron") if isinstance(config, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: needs a top-level 'megatron' list of role entries")
    found = [e for e in entries if isinstance(e, dict) and e.get("role") == role]
    if len(found) > 1:
        raise ValueError(f"{path}: more than one entry with role: {role}")
    return found[0] if found else None


def critic_entry(path: str | None, config: Any) -> dict | None:
    """The ``role: critic`` entry of ``config`` (:func:`role_entry`)."""
    return role_entry(path, config, "critic")


def write_megatron_role_config(
    path: str,
    freeze_patterns: Sequence[str] = ("self_attention",),
    *,
    merge_from: str | None = None,
    force: bool = False,
    **critic_extra: Any,
) -> dict:
    """Write a slime ``--megatron-config-path`` file whose critic role freezes ``freeze_patterns``.

    ``merge_from``: an existing role config to keep (its entries stay; the critic's freeze list is
    extended). ``critic_extra``: more critic overrides (slime arg names, e.g. ``lr=5e-6,
    lr_warmup_iters=10`` as in the SAO paper). Returns the written mapping.
    """
    import yaml

    if os.path.exists(path) and not force and os.path.abspath(path) != os.path.abspath(merge_from or ""):
        raise FileExistsError(f"{path} exists; pass force=True (--force) to overwrite it")
    config: dict = {"megatron": []}
    if merge_from is not None:
        with open(merge_from) as f:
            config = yaml.safe_load(f) or {}
    entry = critic_entry(merge_from, config)
    if entry is not None:
        key = "overrides" if "overrides" in entry or "args" not in entry else "args"
        entry[key] = critic_role_overrides(freeze_patterns, **{**(entry.get(key) or {}), **critic_extra})
    else:
        config["megatron"].append({"name": "default", "role": "critic",
                                   "overrides": critic_role_overrides(freeze_patterns, **critic_extra)})
    text = (
        "# slime --megatron-config-path role config for the sao plugin (python -m slime_ascend.sao.critic).\n"
        "# The critic's attention is frozen here, not on the command line, so the actor trains all parameters.\n"
        + yaml.safe_dump(config, sort_keys=False)
    )
    with open(path, "w") as f:
        f.write(text)
    return config


def role_overrides(megatron_config_path: str, role: str = "critic") -> dict:
    """A role entry's overrides of a slime megatron role config ({} when there is none)."""
    import yaml

    with open(megatron_config_path) as f:
        raw = yaml.safe_load(f) or {}
    entry = role_entry(megatron_config_path, raw, role)
    return {} if entry is None else dict(entry.get("overrides") or entry.get("args") or {})


def critic_overrides(megatron_config_path: str) -> dict:
    """The critic entry's overrides of a slime megatron role config ({} when there is none)."""
    return role_overrides(megatron_config_path, "critic")


def shared_save_dir(args: Any) -> str | None:
    """The directory the actor and the critic would both save to, or None.

    slime saves each role's checkpoint to that role's ``args.save`` (``save_model``: ``iter_NNNNNNN`` and
    ``latest_checkpointed_iteration.txt``), and a role gets its own ``save`` only from its entry in
    ``--megatron-config-path`` (``_apply_megatron_role_overrides``). Without one the critic saves into the actor's
    directory after the actor, over the actor's checkpoint, and a job resumed from it loads the critic's weights
    into the policy. ``args`` are the shared command-line args (the driver's, not a train actor's, whose
    ``save`` already carries its role's override)."""
    save = getattr(args, "save", None)
    if not save or not getattr(args, "use_critic", False):
        return None
    path = getattr(args, "megatron_config_path", None)
    critic = actor = save
    if path:
        critic = role_overrides(path, "critic").get("save") or save
        actor = role_overrides(path, "actor").get("save") or save
    if os.path.abspath(os.path.expanduser(str(critic))) == os.path.abspath(os.path.expanduser(str(actor))):
        return str(critic)
    return None
