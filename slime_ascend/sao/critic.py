"""SAO critic wiring: the megatron_init contribution, start-up validation, and the per-role config.

``megatron_init`` runs in every train process (actor and critic) with that process's args, before
slime builds and loads the model. It copies the K setting onto the args keys of the upstream
``--critic-train-iters`` proposal. The runtime has installed sao's patches by then (declared in
:mod:`slime_ascend.sao.plugin`): ``train.critic_train_iters`` and ``train.critic_advantage_function``
only act inside ``train_critic``, so they are harmless in the actor, and ``train.critic_hf_value_head``
acts only on a model with a value head.

The critic's freeze list cannot go into the shared YAML (that would freeze the actor too). It goes
into the critic role of slime's ``--megatron-config-path``; :func:`~slime_ascend.sao.role_config.write_megatron_role_config`
writes that file, and :func:`main` is its command line (``python -m slime_ascend.sao.critic -o sao_megatron.yaml
[--merge yours.yaml]``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from .role_config import write_megatron_role_config

PLUGIN_NAME = "sao"
logger = logging.getLogger("slime_ascend.sao")
TIS_PLUGINS_IGNORED = ("dis", "icepop")


def validate(args: Any, settings: Any) -> None:
    """Start-up checks in every process that uses the plugin (raises SettingsError)."""
    from slime_ascend.plugins.settings import SettingsError

    from .freeze import check_freeze_config
    from .loss import dis_band

    try:
        dis_band(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if getattr(args, "use_tis", False):
        raise SettingsError(
            "sao: --use-tis is set, but sao's custom loss applies DIS itself and slime's TIS would never run. Fix: "
            "remove --use-tis"
        )
    if (getattr(args, "use_rollout_logprobs", False) and float(getattr(args, "kl_coef", 0) or 0) != 0
            and getattr(args, "megatron_config_path", None) is None):
        raise SettingsError(
            "sao: kl_coef != 0 with use_rollout_logprobs and no --megatron-config-path: the critic inherits "
            "kl_coef and slime's critic would compute KL without reference log-probs. Fix: pass "
            "--megatron-config-path (slime sets the critic's kl_coef to 0 there), or set kl_coef 0"
        )
    from slime_ascend.plugins import roles, runtime

    ignored = sorted(set(runtime.enabled_names(args)) & set(TIS_PLUGINS_IGNORED))
    if ignored:
        logger.warning(
            "sao: plugins %s act through slime's TIS hook, which slime does not call under sao's custom loss; they "
            "have no effect (sao applies DIS itself; tune it with ascend_sao_dis_preset)", ignored
        )
    if settings.freeze_critic_attention:
        check_freeze_config(args, list(settings.freeze_patterns))
    if roles.train_role() is None:  # the driver and the rollout process hold the shared command-line args
        _check_critic_save(args)


def _check_critic_save(args: Any) -> None:
    from slime_ascend.plugins.settings import SettingsError

    from .role_config import shared_save_dir

    try:
        shared = shared_save_dir(args)
    except (OSError, ValueError):  # the role config is unreadable here: check_freeze_config / slime say so
        return
    if shared is not None:
        config = getattr(args, "megatron_config_path", None)
        writer = (f"--merge {config} -o {config}" if config else "-o sao_megatron.yaml")
        raise SettingsError(
            f"sao: the critic would save into --save {shared}, the actor's own directory, over the actor's "
            "checkpoint (slime saves each role to its args.save). Fix: give the critic its own: "
            f"`python -m slime_ascend.sao.critic {writer} --set save={shared.rstrip('/')}_critic` (or `save:` "
            f"under the role: critic entry of {config or 'your --megatron-config-path file'})"
        )


def megatron_init(args: Any) -> None:
    """K critic passes and their LR schedule onto this process's args (order 200), where the
    ``train.critic_train_iters`` patch (installed by the runtime as the train actor starts) reads them."""
    from slime_ascend.plugins import roles, runtime

    settings = runtime.settings(args, PLUGIN_NAME)
    setattr(args, roles.CRITIC_ITERS_ARG, int(settings.critic_iters))
    setattr(args, roles.CRITIC_SCHEDULE_ARG, settings.critic_lr_schedule)


def _parse_value(text: str) -> Any:
    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, str):  # YAML 1.1 reads 5e-6 as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime_ascend.sao.critic",
        description="Write slime's --megatron-config-path file with the SAO critic freeze list.",
    )
    parser.add_argument("-o", "--output", required=True, help="file to write")
    parser.add_argument("--merge", default=None, help="existing role config to extend")
    parser.add_argument("--freeze", nargs="+", default=["self_attention"],
                        help="regexes of critic parameters to freeze (default: self_attention)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more critic overrides, slime arg names, e.g. lr=5e-6 lr_warmup_iters=10")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    ns = parser.parse_args(argv)
    extra = {}
    for item in ns.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        extra[key] = _parse_value(value)
    try:
        write_megatron_role_config(ns.output, ns.freeze, merge_from=ns.merge, force=ns.force, **extra)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {ns.output}; pass --megatron-config-path {ns.output} to slime")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
