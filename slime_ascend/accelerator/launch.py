"""What an Ascend launch of slime must satisfy before anything starts: the ``npu`` plugin's checks at ``parse_args``.

* **Train offload.** slime's ``offload_train`` (``--colocate`` turns it on, PPO's critic forces it) makes it
  LD_PRELOAD torch_memory_saver's *preload* hook into every Megatron train actor (``slime/ray/actor_group.py``)
  and call ``torch_memory_saver.pause()/resume()`` around rollouts. The NPU build of torch_memory_saver
  (sgl-kernel-npu ``contrib/torch_memory_saver``) does not support that mode: torch_npu reaches
  ``aclrtMallocAlign32`` through dlopen + dlsym, which LD_PRELOAD cannot intercept (its README's FAQ;
  ``hooks/mode_preload.configure_subprocess`` skips the preload on NPU). Only the region-based ``torch`` hook mode
  works there, and slime allocates Megatron outside any region. So the train actors' NPU memory would stay taken
  and the colocated engines' resume runs out of memory. On NPU the plugin's YAML sets ``offload_train: false``
  (:data:`SLIME_ARGS`), and colocation is what slime can do without it: ``--release-train`` (the train actors end
  around each rollout, their NPU memory freed with them; they reload from ``--save``). A job that still has
  ``offload_train`` (no YAML), or colocates without ``--release-train``, is refused in one line.
* **Allocator variables.** torch_npu refuses to start its caching allocator when both ``PYTORCH_NPU_ALLOC_CONF``
  and ``PYTORCH_ALLOC_CONF`` are set, even to an empty value (``NPUAllocatorConfig::instance``: "Both
  PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF have been set"). The train actors inherit the job's environment
  plus ``--train-env-vars``: both are checked.

* **Ray's NPU count.** ``ray start`` counts a node's NPUs with pyACL (``acl.rt.get_device_count()``) and, where
  pyACL cannot be imported (CANN's ``set_env.sh`` not sourced first), by the device files ``/dev/davinci?``: at
  most 10 (Ray's ``NPUAcceleratorManager.get_current_node_num_accelerators``).

Where ``npu`` runs on the host (``cpu,npu``) there is no NPU memory and no torch_npu, and only the allocator check
applies. Nothing here imports slime, Ray or torch.
"""

from __future__ import annotations

import glob
import importlib.util
import re
from collections.abc import Mapping
from typing import Any

from ..host import ALLOC_CONF_ENVS

#: plain slime settings the ``npu`` plugin's YAML carries (applied after slime's own offload rules)
SLIME_ARGS = (("offload_train", False),)

RELEASE_TRAIN_FIX = ("--release-train --update-weight-transport disk --update-weight-disk-dir DIR (slime ends the "
                     "train actors around each rollout and reloads them from --save)")


def _engines_share_train_npus(args: Any) -> bool:
    """``--colocate`` with engines slime starts on the train actors' NPUs (none for external engines, a train-only
    debug run or ``--rollout-num-gpus 0``)."""
    if not getattr(args, "colocate", False):
        return False
    if getattr(args, "rollout_external_engine_addrs", None) or getattr(args, "debug_train_only", False):
        return False
    return getattr(args, "rollout_num_gpus", None) != 0


def offload_problem(args: Any) -> str | None:
    """Why the train actors' NPU memory would not be freed as slime expects, or None."""
    if getattr(args, "train_backend", "megatron") != "megatron":
        return None  # slime preloads torch_memory_saver only into Megatron actors
    if getattr(args, "offload_train", False):
        if getattr(args, "use_critic", False):
            cause = "slime forces it for PPO's critic (--advantage-estimator ppo)"
        elif getattr(args, "colocate", False):
            cause = "--colocate turns it on"
        else:
            cause = "--offload-train / --offload"
        fix = "offload_train: false in the YAML given to --custom-config-path (`slime-ascend config npu ...` writes it)"
        if _engines_share_train_npus(args) and not getattr(args, "release_train", False):
            fix += f", with {RELEASE_TRAIN_FIX}"
        return (f"npu: offload_train is on ({cause}): slime would LD_PRELOAD torch_memory_saver's preload hook into "
                "the train actors, a mode its NPU build does not support (torch_npu allocates through "
                "aclrtMallocAlign32 by dlsym, out of LD_PRELOAD's reach), so their NPU memory would stay taken. "
                f"Fix: {fix}")
    if _engines_share_train_npus(args) and not getattr(args, "release_train", False):
        return ("npu: --colocate without --release-train keeps the train actors' NPU memory taken while the engines "
                "generate (offload_train is off on NPU: torch_memory_saver's NPU build has no preload hook). "
                f"Fix: add {RELEASE_TRAIN_FIX}, or drop --colocate and give the engines NPUs of their own "
                "(--rollout-num-gpus N)")
    return None


def alloc_conf_problem(environ: Mapping[str, str], train_env_vars: Mapping[str, str] | None = None) -> str | None:
    """Both allocator variables set in the train actors' environment (the job's plus ``--train-env-vars``)."""
    merged = {**environ, **(train_env_vars or {})}
    if not all(name in merged for name in ALLOC_CONF_ENVS):
        return None
    where = ", ".join(f"{name}={merged[name]!r}" + (" (--train-env-vars)" if name in (train_env_vars or {}) else "")
                      for name in ALLOC_CONF_ENVS)
    return (f"npu: both allocator variables are set for the train actors ({where}); torch_npu then refuses to start "
            "its allocator (\"Both PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF have been set\"). Fix: unset "
            "PYTORCH_ALLOC_CONF before `ray start` and in the job's runtime env (keep PYTORCH_NPU_ALLOC_CONF)")


def problems(args: Any, environ: Mapping[str, str], on_device: bool = True) -> list[str]:
    """Every problem of this launch the ``npu`` plugin refuses, one line each (``on_device``: False where ``npu`` runs
    on the host with ``cpu``)."""
    train_env = getattr(args, "train_env_vars", None)
    found = [alloc_conf_problem(environ, train_env if isinstance(train_env, Mapping) else {})]
    if on_device:
        found.insert(0, offload_problem(args))
    return [p for p in found if p]


def ray_npu_detection_problem(dev: str = "/dev") -> str | None:
    """On an Ascend node: NPUs that ``ray start`` here would not count (pyACL not importable and more device files
    than Ray's ``/dev/davinci?`` pattern matches), or None (not an Ascend node, or Ray would see them all)."""
    devices = [p for p in glob.glob(f"{dev}/davinci*") if re.fullmatch(r"davinci\d+", p.rsplit("/", 1)[-1])]
    try:
        acl = importlib.util.find_spec("acl") is not None
    except (ImportError, ValueError):
        acl = False
    if acl or len(devices) <= 10:
        return None
    return (f"ray: pyACL (CANN's acl module) is not importable here, so `ray start` would count this node's NPUs by "
            f"/dev/davinci? device files: 10 of the {len(devices)} found. Fix: source CANN's set_env.sh (e.g. "
            "/usr/local/Ascend/ascend-toolkit/set_env.sh) before `ray start`")
