"""The rollout-backend plugins: ``sglang-npu`` and ``vllm-ascend`` (declarations only, cheap to import).

``sglang-npu``: slime launches SGLang on Ascend as usual; the engine-side bridge
(:mod:`slime_ascend.patch.engine.sglang_npu_launch`) fills in the NPU server arguments and
environment from these settings in each ``SGLangEngine`` actor, right before it spawns the
server. A value you pass yourself as ``--sglang-<flag>`` (or in ``--sglang-config`` overrides)
wins over the setting, except ``device``, which must be ``npu``. The train actors, which share the HCCL
weight-update group with those engines, get the same HCCL port ranges as they start (``train.hccl_port_env``).

``vllm-ascend``: vLLM with vllm-ascend, attached through slime's external-engine addresses with
the adapter of :mod:`slime_ascend.rollout.backends.vllm_ascend` (SGLang's HTTP surface on top of
vLLM's OpenAI server). Weight sync goes through disk.
"""

from __future__ import annotations

from typing import Any

from ..plugins.base import CommandLineFlag, PatchUse, Plugin
from ..plugins.settings import Setting


def _port_range(value: str) -> str | None:
    parts = value.split("-")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return "use the form LOW-HIGH, e.g. 60000-60050"
    low, high = (int(p) for p in parts)
    if not (1024 <= low <= high <= 65535):
        return "ports must satisfy 1024 <= LOW <= HIGH <= 65535"
    return None


SGLANG_NPU = Plugin(
    name="sglang-npu",
    description="SGLang on Ascend as slime's rollout engine (device/attention backend/graph mode, HCCL env, "
    "engine-process fixes)",
    requires=("npu",),
    conflicts=("vllm-ascend",),
    settings=(
        Setting("ascend_rollout_attention_backend", str, "ascend",
                "SGLang attention backend on NPU (ServerArgs.attention_backend)"),
        Setting("ascend_rollout_graph_mode", bool, True,
                "capture NPU graphs (false sets ServerArgs.cuda_graph_backend_{decode,prefill}=disabled)"),
        Setting("ascend_rollout_mem_fraction", float, None,
                "ServerArgs.mem_fraction_static; null keeps --sglang-mem-fraction-static / SGLang's choice",
                minimum=0.05, maximum=0.98, optional=True),
        Setting("ascend_rollout_sampling_backend", str, None,
                "ServerArgs.sampling_backend ('ascend' or 'pytorch'); null keeps SGLang's default",
                choices=("ascend", "pytorch"), optional=True),
        Setting("ascend_rollout_use_fia", bool, True,
                "ASCEND_USE_FIA=1: decode through npu_fused_infer_attention_score (the path slime's NPU fork "
                "forced by patching ascend_backend.py)"),
        Setting("ascend_rollout_hccl_host_port_range", str, "60000-60050",
                "HCCL_HOST_SOCKET_PORT_RANGE where the job leaves it unset, in the engines slime launches and the "
                "train actors alike (CANN: every card of an HCCL communicator, or none)", check=_port_range),
        Setting("ascend_rollout_hccl_npu_port_range", str, "61000-61050",
                "HCCL_NPU_SOCKET_PORT_RANGE where the job leaves it unset, in the engines slime launches and the "
                "train actors alike", check=_port_range),
    ),
    patches=("engine.sglang_npu_launch",  # in whatever process imports slime's engine actor
             # the train actors share the weight-update group with those engines: the same port ranges
             PatchUse("train.hccl_port_env", "train",
                      when="slime_ascend.rollout.backends.sglang_npu.launches_engines")),
    validate="slime_ascend.rollout.backends.sglang_npu.validate_plugin",
)


def _has_external_addrs(args: Any) -> bool:
    return bool(getattr(args, "rollout_external_engine_addrs", None))


def _disk_sync(args: Any) -> bool:
    return getattr(args, "update_weight_transport", None) == "disk" and bool(getattr(args, "update_weight_disk_dir", None))


VLLM_ASCEND = Plugin(
    name="vllm-ascend",
    description="vLLM + vllm-ascend attached as external engines through an SGLang-surface adapter (disk weight sync)",
    requires=("npu",),
    conflicts=("sglang-npu",),
    settings=(
        Setting("ascend_rollout_vllm_rl_config", bool, True,
                "start vLLM with --additional-config '{\"rl_config\": {\"enabled\": true}}' (no NZ weights, "
                "no expandable_segments; vllm-ascend's RL mode)"),
        Setting("ascend_rollout_vllm_sleep_level", int, 1,
                "vLLM sleep level used for release/resume memory occupation (1 keeps weights in host memory)",
                choices=(1, 2)),
    ),
    command_line=(
        CommandLineFlag("--rollout-external-engine-addrs HOST:PORT ...",
                        "slime discovers the adapters at these addresses while validating its args",
                        check=_has_external_addrs),
        CommandLineFlag("--update-weight-transport disk --update-weight-disk-dir DIR",
                        "the adapter reloads weights from the checkpoint slime writes (vLLM has no SGLang "
                        "distributed-update endpoint)",
                        check=_disk_sync),
    ),
)


def _torch_device_problem(value: str) -> str | None:
    from .engine_device import check_name

    try:
        check_name(value)
    except ValueError:
        return "must be cpu, cuda, cuda:N, npu or npu:N"
    return None


TORCH_ENGINE = Plugin(
    name="torch-engine",
    description="the torch engine as slime's rollout engine: slime's own SGLangEngine actors start it in place of "
    "SGLang's server (any torch device; the host CPU with cpu); it serves offload/onload and the tensor push",
    conflicts=("sglang-npu", "vllm-ascend"),
    settings=(
        Setting("ascend_rollout_torch_dtype", str, "float32",
                "dtype the torch engine serves in (slime's --fp16 / --sglang-dtype win when they name one)",
                choices=("float32", "bfloat16", "float16")),
        Setting("ascend_rollout_torch_prefix_cache_tokens", int, 0,
                "positions of earlier requests' KV each torch engine keeps for reuse (serve-torch "
                "--prefix-cache-tokens; 0: off), reused only under the weight version that computed them",
                check=lambda v: None if v >= 0 else "must be 0 (off) or a positive number of token positions"),
        Setting("ascend_rollout_torch_device", str, "cpu",
                "device each torch engine computes on (serve-torch --device): cpu, cuda[:N], npu[:N] (on an Ascend "
                "host the NPU Ray gave the engine actor; SLIME_ASCEND_EMULATE_NPU=1: the emulated one)",
                check=_torch_device_problem),
    ),
    # the engine actor's launch; CPU tensors of the colocated push as named shared memory the engine can open
    process_start=("slime_ascend.rollout.plugin.torch_engine_process_start",),
    patches=("engine.torch_engine_launch",  # in whatever process imports slime's engine actor
             # the train actors: host tensors of the colocated push stay picklable after sglang's CUDA-only reducer
             "train.cpu_tensor_reductions"),
)


def torch_engine_process_start() -> None:
    """slime's train actors pickle the colocated push (``update_weights_from_tensor``) with torch's sharing
    strategy; set ``file_system`` there so the torch engine, not a child of theirs, can open the tensors."""
    from .. import _import_hooks
    from slime_ascend.weight_sync.tensor_sharing import use_file_system_sharing

    _import_hooks.when_imported("slime.backends.megatron_utils.update_weight.update_weight_from_tensor",
                                use_file_system_sharing)
