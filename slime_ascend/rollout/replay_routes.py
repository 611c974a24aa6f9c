"""Whether the engines' routed experts reach slime under ``--use-rollout-routing-replay``, checked at ``parse_args``.

slime asks each ``/generate`` for the routes (``return_routed_experts: true`` in ``sglang_rollout.generate``) and
sends it through its router. slime's Dockerfile installs a fork of SGLang's router that forwards that field;
sglang-router as PyPI ships it (0.3.2, what ``pip install sglang-router`` and this package's install script give)
re-serialises each body without it, so SGLang returns no routes and slime's train actor stops in
``fill_routing_replay`` ("rollout_routed_experts is required"), after Ray, the engines and the first rollout.

The routes reach slime when:

* the router forwards the field (the fork: ``'slime' in sglang_router.__version__``, slime's own check); or
* every engine adds them to every answer, asked or not: the torch engine started with
  ``enable_return_routed_experts`` (slime passes it to the engines it starts under replay; ``serve-torch
  --enable-return-routed-experts`` for an external one), which says so in ``/server_info``
  (``routed_experts_in_every_answer``).

Anything else is refused in one line naming the fix. An external engine that does not answer ``/server_info``
within a few seconds is left to slime's own check of it.
"""

from __future__ import annotations

from typing import Any

EVERY_ANSWER = "routed_experts_in_every_answer"  # the torch engine's /server_info field
PROBE_TIMEOUT_S = 5.0


def router_version() -> str | None:
    try:
        import sglang_router
    except ImportError:
        return None
    return str(getattr(sglang_router, "__version__", "unknown"))


def router_forwards_routes(version: str | None) -> bool:
    """slime's router fork forwards ``return_routed_experts`` (slime's Dockerfile asserts ``'slime' in``
    its version)."""
    return version is not None and "slime" in version


def _server_info(addr: str) -> dict[str, Any] | None:
    from ..json_client import JSONRequestError, request_json

    url = addr if addr.startswith("http") else f"http://{addr}"
    try:
        info = request_json(f"{url}/server_info", timeout_s=PROBE_TIMEOUT_S, deadline_s=PROBE_TIMEOUT_S)
    except (JSONRequestError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def refusal(args: Any, *, managed_engines_add_routes: bool, server_info=None) -> str | None:
    """None when the routes reach slime (see the module docstring), else the reason and the fix in one line.

    ``managed_engines_add_routes``: the engines slime starts itself add the routes to every answer (the
    ``torch-engine`` plugin's)."""
    if not getattr(args, "use_rollout_routing_replay", False):
        return None
    version = router_version()
    if router_forwards_routes(version):
        return None
    router = f"sglang-router {version}" if version else "sglang-router"
    dropped = (f"--use-rollout-routing-replay: slime's router ({router}, not slime's fork of it) drops each "
               "request's return_routed_experts")
    server_info = server_info or _server_info
    addrs = list(getattr(args, "rollout_external_engine_addrs", None) or [])
    if not addrs:
        if managed_engines_add_routes:
            return None
        return (f"{dropped}, so SGLang returns no routes. Fix: install slime's router (the sglang_router wheel "
                "slime's docker/Dockerfile installs), or drop --use-rollout-routing-replay")
    for addr in addrs:
        info = server_info(addr)
        if info is not None and info.get(EVERY_ANSWER) is not True:
            return (f"{dropped}, and the engine at {addr} adds routes only when a request asks ({EVERY_ANSWER} "
                    "is not true in its /server_info). Fix: start it with `slime-ascend serve-torch "
                    "--enable-return-routed-experts`, or install slime's router (slime's docker/Dockerfile)")
    return None
