"""``torch``: the torch engine as slime's rollout engine, started by slime or attached from outside.

:class:`~slime_ascend.rollout.torch_engine.engine.TorchEngine` speaks SGLang's HTTP surface (``/generate``,
``/server_info``, weight sync from disk and from tensors, pause/continue, release/resume of memory).

* **slime-managed** (the ``torch-engine`` plugin): slime's own ``SGLangEngine`` Ray actors start it in place
  of SGLang's server (:mod:`slime_ascend.patch.engine.torch_engine_launch` calls :func:`launch_process` with
  the server arguments slime computed), on slime's host and port, registered with slime's router, waited for
  with slime's health check, stopped by slime's ``shutdown``. ``--rollout-num-gpus`` /
  ``--rollout-num-gpus-per-engine`` decide how many; each is one unsharded process.
* **external**: ``slime-ascend serve-torch --model DIR --port PORT`` (or, in-process, :func:`serve`) and slime's
  ``--rollout-external-engine-addrs`` (:meth:`TorchEngineBackend.slime_flags`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from . import BackendError, RolloutBackend

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


class TorchEngineBackend(RolloutBackend):
    name = "torch"
    description = "torch engine (torch + transformers) with SGLang's HTTP surface; started by slime or external"
    plugin = "torch-engine"

    def slime_flags(self, options: Mapping[str, Any], addrs: list[str] | None = None) -> list[str]:
        """The flags of an external engine (a slime-managed one needs none: slime starts it)."""
        return ["--rollout-external-engine-addrs", *(addrs or ["127.0.0.1:30000"]), "--update-weight-transport",
                "disk", "--update-weight-disk-dir", "DIR"]

    def options_from_args(self, args: Any) -> dict[str, Any]:
        """The plugin's options, and the ``dsa-determinism`` plugin's ``ascend_dsa_index_dump_dir`` (the engines
        write their side of the DSA key sets beside the train actors')."""
        from ...dsa.plugin import index_dump_dir

        return {**super().options_from_args(args), "dsa_index_dump_dir": index_dump_dir(args)}

    def command(self, server_args: Mapping[str, Any], options: Mapping[str, Any]) -> list[str]:
        """``slime-ascend serve-torch`` for one engine from the ``ServerArgs`` fields slime computed
        (``_compute_server_args``): its model, host, port and seed; the dtype is slime's (``--fp16``:
        ``float16``, ``--sglang-dtype``) when it names one, else the plugin's ``ascend_rollout_torch_dtype``;
        ``ascend_rollout_torch_prefix_cache_tokens`` above 0 turns the engine's prefix cache on; slime's
        ``enable_return_routed_experts`` (routing replay) makes every answer carry its routes;
        ``dsa_index_dump_dir`` (``dsa-determinism``'s ``ascend_dsa_index_dump_dir``) has it write each request's DSA
        key sets there (``--dump-dsa-index-sets``); ``ascend_rollout_torch_device`` is the device it computes on
        (``--device``: on an Ascend host the NPU Ray gave the engine actor); slime's ``--sglang-speculative-*``
        become its speculative flags (:func:`speculative_flags`)."""
        nnodes = int(server_args.get("nnodes", 1) or 1)
        if nnodes != 1:
            raise BackendError(f"torch-engine: an engine spanning {nnodes} nodes (--rollout-num-gpus-per-engine above "
                               "--num-gpus-per-node) is not supported; the torch engine is one process. Fix: "
                               "--rollout-num-gpus-per-engine at most --num-gpus-per-node")
        dtype = server_args.get("dtype")
        if dtype not in DTYPES:
            dtype = options.get("torch_dtype") or "float32"
        host = str(server_args["host"]).strip("[]")
        tokens = int(options.get("torch_prefix_cache_tokens") or 0)
        prefix_cache = ["--prefix-cache-tokens", str(tokens)] if tokens > 0 else []
        # slime sets it under --use-rollout-routing-replay (_compute_server_args)
        routes = ["--enable-return-routed-experts"] if server_args.get("enable_return_routed_experts") else []
        dump = options.get("dsa_index_dump_dir")
        index_sets = ["--dump-dsa-index-sets", str(dump)] if dump else []
        device = str(options.get("torch_device") or "cpu")
        return [sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--model", str(server_args["model_path"]),
                "--host", host, "--port", str(int(server_args["port"])),
                "--seed", str(int(server_args.get("random_seed", 0) or 0)), "--dtype", dtype, "--device", device,
                *prefix_cache, *routes, *index_sets, *speculative_flags(server_args)]


def speculative_flags(server_args: Mapping[str, Any]) -> list[str]:
    """serve-torch's speculative flags from slime's ``--sglang-speculative-*`` (SGLang's ``ServerArgs`` fields, as
    slime's ``_compute_server_args`` copies them): ``STANDALONE`` speculates with a draft model; ``EAGLE`` / ``NEXTN``
    (slime's GLM-5 scripts: ``--sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 3
    --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 4``) with the served checkpoint's own MTP
    layer. Another algorithm is refused in one line."""
    algorithm = server_args.get("speculative_algorithm")
    if algorithm in (None, "", "NONE"):
        return []
    algorithm = str(algorithm).upper()
    if algorithm not in ("STANDALONE", "EAGLE", "NEXTN"):
        raise BackendError(f"torch-engine: --sglang-speculative-algorithm {algorithm} is not supported; the torch engine "
                           "speculates with a draft model (STANDALONE) or the checkpoint's own MTP layer (EAGLE, "
                           "NEXTN). Fix: one of those, or leave speculation off")
    draft, steps = server_args.get("speculative_draft_model_path"), server_args.get("speculative_num_steps")
    if not steps or (algorithm == "STANDALONE" and not draft):
        raise BackendError(f"torch-engine: --sglang-speculative-algorithm {algorithm} needs "
                           f"--sglang-speculative-num-steps K{' and --sglang-speculative-draft-model-path DIR' if algorithm == 'STANDALONE' else ''}")
    flags = ["--speculative-algorithm", algorithm, "--speculative-num-steps", str(int(steps))]
    if draft:
        flags += ["--speculative-draft-model-path", str(draft)]
    topk = server_args.get("speculative_eagle_topk")
    if algorithm != "STANDALONE" and topk:
        flags += ["--speculative-eagle-topk", str(int(topk))]
    tokens = server_args.get("speculative_num_draft_tokens")
    if tokens:
        flags += ["--speculative-num-draft-tokens", str(int(tokens))]
    return flags


BACKEND = TorchEngineBackend()


def launch_process(server_args: Mapping[str, Any], options: Mapping[str, Any]) -> subprocess.Popen:
    """Start one torch engine for an ``SGLangEngine`` actor; returns at once (the caller waits with slime's own
    health check). Its output goes to the actor's (Ray forwards it to the driver's log). The engine process runs
    no plugins (``SLIME_ASCEND_PLUGINS`` is dropped): it imports neither slime nor Megatron."""
    cmd = BACKEND.command(server_args, options)
    env = {k: v for k, v in os.environ.items() if k != "SLIME_ASCEND_PLUGINS"}
    logger.info("torch-engine: starting %s", " ".join(cmd))
    print(f"torch-engine: slime-managed engine starting on {cmd[cmd.index('--host') + 1]}:"
          f"{cmd[cmd.index('--port') + 1]}", flush=True)
    return subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr)


@contextlib.contextmanager
def serve(model_path: str | None = None, host: str = "127.0.0.1", port: int = 0, **engine_kwargs: Any) -> Iterator[str]:
    """Serve a fresh :class:`TorchEngine` from a thread; yields its address ``host:port`` as
    slime's ``--rollout-external-engine-addrs`` takes it."""
    from ..torch_engine.engine import TorchEngine

    engine = TorchEngine(model_path=model_path, **engine_kwargs)
    with engine.start_in_thread(host=host, port=port) as url:
        yield url.removeprefix("http://")
