"""slime's own engine actors start the torch engine in place of SGLang's server (the ``torch-engine`` plugin).

``SGLangEngine._init_normal`` builds SGLang's ``ServerArgs`` from the dict slime computed and launches SGLang's
HTTP server, then registers it with slime's router. With the torch engine, the same actor instead starts
``slime-ascend serve-torch`` on the same host, port, model and seed
(:func:`slime_ascend.rollout.backends.torch_engine.launch_process`), waits with slime's own
``_wait_server_healthy`` (``/health_generate`` until 200, failing if the process dies) and registers it with
``self._register_to_router`` as slime does. ``self.process`` is the engine's process, so slime's
``shutdown`` (router deregistration, ``kill_process_tree``) and ``simulate_crash`` act on it; every other
call of the actor (pause/continue, flush, release/resume, weight updates, health) is slime's HTTP request to
the engine. SGLang's ``ServerArgs`` is never built (it needs an accelerator SGLang knows). Externally launched
engines (``_init_external``) are untouched.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

logger = logging.getLogger("slime_ascend.patch")

MODULE = "slime.backends.sglang_utils.sglang_engine"


def _launch(module: ModuleType) -> Any:
    def wrapper(orig: Any) -> Any:
        def _init_normal(self, server_args_dict):
            from ...rollout.backends import torch_engine

            backend = torch_engine.BACKEND
            options = backend.options_from_args(self.args)
            logger.info("torch-engine: slime-managed torch engine at %s:%s (rank %s)", self.server_host,
                        self.server_port, self.rank)
            self.process = torch_engine.launch_process(server_args_dict, options)
            host = str(server_args_dict["host"]).strip("[]")
            host = f"[{host}]" if ":" in host else host
            module._wait_server_healthy(
                base_url=f"http://{host}:{server_args_dict['port']}",
                api_key=server_args_dict.get("api_key"),
                is_process_alive=lambda: self.process.poll() is None,
            )
            self._register_to_router(server_args_dict)

        _init_normal.__wrapped__ = orig
        return _init_normal

    return wrapper


class TorchEngineLaunch(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[MODULE]
        problems = missing_attrs(module, ["SGLangEngine._init_normal", "SGLangEngine._register_to_router",
                                          "SGLangEngine.shutdown", "_wait_server_healthy", "kill_process_tree"])
        if problems:
            return problems
        method = module.SGLangEngine._init_normal
        problems += param_mismatch(method, ["self", "server_args_dict"], "SGLangEngine._init_normal")
        problems += missing_source(method, ["self.process = launch_server_process(ServerArgs(**server_args_dict))",
                                            "self._register_to_router(server_args_dict)"], "SGLangEngine._init_normal")
        problems += param_mismatch(module._wait_server_healthy, ["base_url", "api_key", "is_process_alive"],
                                   "_wait_server_healthy")
        problems += missing_source(module.SGLangEngine.shutdown, ["kill_process_tree(self.process.pid)"],
                                   "SGLangEngine.shutdown")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        module = modules[MODULE]
        self.wrap(module.SGLangEngine, "_init_normal", _launch(module))


PATCH = TorchEngineLaunch(
    id="engine.torch_engine_launch",
    targets=(f"{MODULE}:SGLangEngine._init_normal",),
    why="slime's engine actor can only launch SGLang's server, whose ServerArgs needs an accelerator SGLang "
    "knows; the torch engine (any torch device, the host CPU included) has no launch path of its own.",
    how="wrap SGLangEngine._init_normal: start `slime-ascend serve-torch` with slime's host/port/model/seed, wait "
    "with slime's _wait_server_healthy, register with slime's router; self.process is the engine's process.",
    upstream="patches/0019-engine-launcher-hook.patch",
    checked_on=("0.3.1",),
)
