"""The runtime installs every enabled plugin's declared runtime patches; plugins only declare them.

A plugin lists what it needs as :class:`~slime_ascend.plugins.base.PatchUse` (ledger id, moment,
condition, stack order). At each moment this module installs, in ledger order, the patches of the
enabled plugins declared for it whose condition holds (and, at process start, the runtime's own
role-entry patches, :data:`slime_ascend.startup.early.PATCHES`, the same way):

=================  ===========================================================  ==========================
moment             where                                                        called from
=================  ===========================================================  ==========================
``import``         every process, as each target module is imported             :mod:`.bootstrap`
``import:<mod>``   every process, when ``<mod>`` is imported                    :mod:`.bootstrap`
``train``          each train actor, with its args, as ``TrainRayActor.init``    :mod:`.early`
                   starts (before the process group and the model)
``rollout``        the RolloutManager, with its args, as it starts              :mod:`.early`
=================  ===========================================================  ==========================

So no feature module imports ``slime_ascend.patch``: deleting a patch when upstream merges its fix
touches the ledger and one declaration, nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from ..plugins.base import PatchUse, resolve

logger = logging.getLogger("slime_ascend.plugins")


def planned(plugins) -> list[PatchUse]:
    """The declared patch uses of ``plugins`` in install order (ledger order), once per patch id; a patch two
    plugins declare is installed where either plugin's condition holds.

    Raises ValueError for an unknown id, one patch declared at two moments, or an ``after`` that the
    ledger order contradicts."""
    from .. import patch

    order = {patch_id: i for i, patch_id in enumerate(patch.LEDGER)}
    uses: dict[str, PatchUse] = {}
    for plugin in plugins:
        for use in plugin.patches:
            if use.patch not in order:
                raise ValueError(f"plugin {plugin.name!r} declares patch {use.patch!r}, which is not in the ledger")
            seen = uses.get(use.patch)
            if seen is None:
                uses[use.patch] = use
                continue
            if seen.moment != use.moment:
                raise ValueError(f"patch {use.patch!r} is declared at two moments ({seen.moment}, {use.moment})")
            uses[use.patch] = _combined(seen, use)
    for use in uses.values():
        for before in use.after:
            if before in uses and order[before] > order[use.patch]:
                raise ValueError(f"patch {use.patch!r} must stack after {before!r}, which comes later in the ledger: "
                                 "reorder slime_ascend.patch.LEDGER")
    return sorted(uses.values(), key=lambda u: order[u.patch])


def _conditions(use: PatchUse) -> tuple[str, ...]:
    return (use.when,) if isinstance(use.when, str) else tuple(use.when or ())


def _combined(first: PatchUse, second: PatchUse) -> PatchUse:
    """One patch declared by two plugins: installed where either needs it (no condition when either has none;
    else either condition), stacked after what either names."""
    when = None if first.when is None or second.when is None else tuple(
        dict.fromkeys(_conditions(first) + _conditions(second)))
    return dataclasses.replace(first, when=when, after=tuple(dict.fromkeys(first.after + second.after)))


def _wanted(use: PatchUse, *args: Any) -> bool:
    return use.when is None or any(bool(resolve(when)(*args)) for when in _conditions(use))


def install_at_process_start(plugins) -> list[str]:
    """Register the import-moment patches of ``plugins`` (the bootstrap, once per process); returns their
    ids. A condition is evaluated once, when the first module that triggers the patch is imported."""
    return register_at_import([use for use in planned(plugins) if use.role is None])


def register_at_import(uses) -> list[str]:
    """Register import-moment patch ``uses`` (in the order given); returns their ids."""
    from .. import _import_hooks, patch

    registered = []
    for use in uses:
        wanted = functools.lru_cache(maxsize=None)(lambda use=use: _wanted(use))
        if use.trigger is None:
            target = patch.get(use.patch)
            for name in target.target_modules:
                _import_hooks.when_imported(name, lambda module, name=name, target=target, wanted=wanted: (
                    target.install(modules={name: module}) if wanted() else None))
        else:
            _import_hooks.when_imported(use.trigger, lambda _module, patch_id=use.patch, wanted=wanted: (
                patch.install(patch_id) if wanted() else None))
        registered.append(use.patch)
    return registered


def install_for_role(args: Any, role: str, plugins, *, only: tuple[str, ...] | None = None,
                     modules: dict | None = None) -> list[str]:
    """Install the ``role`` (train / rollout) patches of ``plugins`` with this process's ``args``.

    ``only``: just these ids (of those planned). ``modules``: the targets' modules (default: imported);
    a stand-in for slime's actor where slime is absent passes ``{}``, so each patch checks and changes only
    what it changes on ``args``."""
    from .. import patch

    installed = []
    for use in planned(plugins):
        if use.role == role and (only is None or use.patch in only) and _wanted(use, args):
            if modules is None:
                patch.install(use.patch, args)
            else:
                patch.get(use.patch).install(args, modules=modules)
            installed.append(use.patch)
    return installed


def applied(patch_id: str) -> bool:
    """Whether the runtime patch ``patch_id`` is applied in this process (for a feature's own guard)."""
    from .. import patch

    return patch.get(patch_id).applied
