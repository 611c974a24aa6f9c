"""slime's routing replay (``--use-rollout-routing-replay``, ``--use-routing-replay``) in a stock Megatron-core.

slime implements replay in ``slime.utils.routing_replay`` and hooks it into Megatron with its own Megatron patch
(``docker/patch/latest/megatron.patch``, the ``moe_utils.py`` and ``router.py`` hunks): Megatron's
``topk_routing_with_score_function`` wraps its ``compute_topk`` with ``get_routing_replay_compute_topk`` (record,
replay forward, replay backward or fall through, by ``ROUTING_REPLAY_STAGE``), and ``TopKRouter.__init__`` ends
with ``register_routing_replay(self)`` (one ``RoutingReplay`` per router, made current by a forward pre-hook).
A Megatron-core without that patch (the wheel, MindSpeed's Megatron on Ascend) builds no replay, and slime's
train actor stops in ``fill_routing_replay`` (``RoutingReplay.all_routing_replays`` is empty).

This patch makes the same two changes at run time, device-neutral (nothing here is host-specific):

* ``topk_routing_with_score_function`` (in ``moe_utils`` and its by-name import in ``router``) passes Megatron's
  own ``compute_topk`` hook, its ``router_replay`` argument, an adapter whose ``get_replay_topk`` is
  ``get_routing_replay_compute_topk(<Megatron's compute_topk>)``: slime's function around exactly what
  Megatron's ``compute_topk`` does (its ``_compute_topk``, or a ``RouterReplay`` of Megatron's own when
  ``moe_enable_routing_replay`` set one), where slime's patch puts it;
* ``TopKRouter.__init__`` calls ``register_routing_replay(self)`` after the original, for the decoder's routers.

A router of a multi-token-prediction layer (``is_mtp_layer``: GLM-5's MTP layer is MoE) gets no ``RoutingReplay``
and chooses its experts itself in every stage: no engine returns routes for it (SGLang's routed experts cover the
decoder's layers; the MTP layer only drafts), and slime's ``fill_routing_replay`` fills one replay per MoE layer of
the decoder, asserting that this is every replay registered, so a replay for the MTP router stops training at the
first step (slime's own Megatron patch registers it too: upstream proposal 0020 carries the fix). While an MTP
router runs, the adapter calls Megatron's top-k directly, so slime's current replay (a decoder layer's) is neither
consumed nor recorded by it.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
ROUTER = "megatron.core.transformer.moe.router"
SLIME_REPLAY = "slime.utils.routing_replay"
NAME = "topk_routing_with_score_function"


class _MtpRouterRunning:
    """Whether an MTP layer's router is inside its forward (set by its pre-hook, cleared by its hook; one thread
    runs a train actor's forwards)."""

    depth = 0


def _enter_mtp_router(module, args):
    _MtpRouterRunning.depth += 1


def _leave_mtp_router(module, args, output):
    _MtpRouterRunning.depth -= 1


class SlimeReplayTopk:
    """What Megatron's ``compute_topk`` calls as ``router_replay.get_replay_topk(scores, topk, num_groups,
    group_topk, _compute_topk)``: slime's replay around Megatron's own choice (``inner``: the caller's
    ``router_replay``, None when it passed none); Megatron's choice alone while an MTP layer's router runs."""

    def __init__(self, inner: Any, wrap_compute_topk):
        self.inner = inner
        self._wrap = wrap_compute_topk

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        inner = self.inner

        def megatron_compute_topk(scores, topk, num_groups=None, group_topk=None):
            if inner is None:
                return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            return inner.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

        if _MtpRouterRunning.depth:
            return megatron_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self._wrap(megatron_compute_topk)(scores, topk, num_groups=num_groups, group_topk=group_topk)


def with_slime_replay(original, wrap_compute_topk):
    """``original`` (Megatron's ``topk_routing_with_score_function``) with slime's replay in its top-k."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def topk_routing_with_score_function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["router_replay"] = SlimeReplayTopk(bound.arguments.get("router_replay"), wrap_compute_topk)
        return original(*bound.args, **bound.kwargs)

    return topk_routing_with_score_function


def registering_init(original, register):
    """``TopKRouter.__init__`` that ends with slime's ``register_routing_replay(self)``, as slime's patch does, for a
    decoder layer's router; an MTP layer's router instead marks its forwards, in which the top-k is Megatron's own
    (module docstring)."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_mtp_layer", False):
            self.register_forward_pre_hook(_enter_mtp_router)
            self.register_forward_hook(_leave_mtp_router, always_call=True)
        else:
            register(self)

    return __init__


def megatron_has_slimes_patch(modules: dict[str, ModuleType] | None = None) -> bool:
    """True when the installed Megatron-core carries slime's own Megatron patch (replay already wired)."""
    if modules is None:
        import importlib

        modules = {name: importlib.import_module(name) for name in (MOE_UTILS, ROUTER)}
    try:
        routing = inspect.getsource(inspect.unwrap(getattr(modules[MOE_UTILS], NAME)))
        init = inspect.getsource(inspect.unwrap(modules[ROUTER].TopKRouter.__init__))
    except (OSError, TypeError, AttributeError):
        return False
    return "get_routing_replay_compute_topk" in routing or "register_routing_replay" in init


def slime_wires_replay_itself(slime_replay: ModuleType | None = None) -> bool:
    """True for a slime that wires replay into a stock Megatron-core by itself (upstream proposal 0020:
    ``slime.utils.routing_replay.install_routing_replay``): this patch would then wire it a second time."""
    if slime_replay is None:
        import importlib

        slime_replay = importlib.import_module(SLIME_REPLAY)
    return hasattr(slime_replay, "install_routing_replay")


def wanted(args) -> bool:
    """When a plugin installs this patch in a train actor: slime replays routes (``--use-rollout-routing-replay``
    sets ``use_routing_replay``), and neither the installed Megatron-core (slime's Megatron patch) nor slime
    (upstream proposal 0020) wires replay already."""
    if not getattr(args, "use_routing_replay", False):
        return False
    return not megatron_has_slimes_patch() and not slime_wires_replay_itself()


class RoutingReplayHooks(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        utils, router, slime = modules[MOE_UTILS], modules[ROUTER], modules[SLIME_REPLAY]
        problems = missing_attrs(utils, [NAME]) + missing_attrs(router, [NAME, "TopKRouter"])
        problems += missing_attrs(slime, ["get_routing_replay_compute_topk", "register_routing_replay",
                                          "RoutingReplay"])
        if problems:
            return problems
        if slime_wires_replay_itself(slime):
            return [f"{SLIME_REPLAY}.install_routing_replay exists: this slime wires replay into Megatron-core by "
                    "itself (patches/0020); wiring it again would record each route twice"]
        if megatron_has_slimes_patch(modules):
            return [f"{MOE_UTILS} already carries slime's Megatron patch (routing replay wired twice would record "
                    "each route twice); this runtime patch is for a Megatron-core without it"]
        function = inspect.unwrap(getattr(utils, NAME))
        problems += param_mismatch(function, ["logits", "topk"])
        if "router_replay" not in inspect.signature(function).parameters:
            problems.append(f"{MOE_UTILS}.{NAME} has no router_replay parameter")
        problems += missing_source(function, ["def compute_topk(", "router_replay.get_replay_topk(",
                                              "scores, topk, num_groups, group_topk, _compute_topk"])
        if inspect.unwrap(getattr(router, NAME)) is not function:
            problems.append(f"{ROUTER}.{NAME} is not {MOE_UTILS}.{NAME} (no longer imported by name)")
        problems += missing_source(router.TopKRouter.routing, [f"{NAME}(", "router_replay=self.router_replay"])
        if "is_mtp_layer" not in inspect.signature(router.TopKRouter.__init__).parameters:
            problems.append(f"{ROUTER}.TopKRouter.__init__ has no is_mtp_layer parameter (an MTP layer's router, "
                            "which must not replay, can no longer be told apart)")
        problems += param_mismatch(slime.get_routing_replay_compute_topk, ["old_compute_topk"])
        problems += param_mismatch(slime.register_routing_replay, ["module"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        slime = modules[SLIME_REPLAY]
        for name in (MOE_UTILS, ROUTER):
            self.wrap(modules[name], NAME, lambda original: with_slime_replay(
                original, slime.get_routing_replay_compute_topk))
        self.wrap(modules[ROUTER].TopKRouter, "__init__",
                  lambda original: registering_init(original, slime.register_routing_replay))


PATCH = RoutingReplayHooks(
    id="train.routing_replay",
    targets=(f"{MOE_UTILS}:{NAME}", f"{ROUTER}:{NAME}", f"{ROUTER}:TopKRouter.__init__", SLIME_REPLAY),
    why="slime's --use-rollout-routing-replay / --use-routing-replay live in slime's own Megatron patch "
    "(docker/patch/latest/megatron.patch: moe_utils.topk_routing_with_score_function wraps its compute_topk with "
    "slime.utils.routing_replay, TopKRouter.__init__ registers a RoutingReplay); a stock Megatron-core (the "
    "wheel, MindSpeed's Megatron on Ascend) has no replay and the train actor stops in fill_routing_replay. "
    "Device-neutral: what a cpu, NPU or unpatched-CUDA train actor needs alike.",
    how="Wrap topk_routing_with_score_function (moe_utils and router's by-name import) to pass, as Megatron's own "
    "router_replay hook, an adapter that runs get_routing_replay_compute_topk around Megatron's compute_topk "
    "(its _compute_topk, or the caller's RouterReplay); wrap TopKRouter.__init__ to end with "
    "register_routing_replay(self), except for an MTP layer's router (is_mtp_layer), which gets forward hooks "
    "under which the adapter uses Megatron's top-k alone: no engine returns its routes and slime's "
    "fill_routing_replay fills the decoder's MoE layers only. Installed in each train actor when --use-routing-replay is set (slime sets "
    "it for --use-rollout-routing-replay), the installed Megatron lacks slime's patch and slime does not wire replay "
    "itself (patches/0020); refused where either does (each route would be recorded twice).",
    upstream="patches/0020-routing-replay-through-megatron-router-replay.patch",
    checked_on=("0.3.1",),
)
