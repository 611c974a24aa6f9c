"""The runtime patch ledger.

Every change slime-ascend makes to upstream code at run time is listed here, one file per patch,
grouped by the process that runs the target (``driver/``, ``train/``, ``rollout/``,
``engine/``). Each entry says what it changes, why, how, which upstream patch in ``patches/``
would retire it, and on which slime versions it was checked (the patch object carries these
fields; ``slime-ascend doctor`` prints them and checks each target against the installed slime).

| id | target | retired by |
|---|---|---|
| driver.ray_npu_resources | `ray` in slime.ray.{placement_group,actor_group,rollout,train_actor}; InfoActor | 0002-accelerator-ray-resource-name |
| train.disable_torch_compile | megatron.core.jit.jit_fuser; compiled helpers in slime.utils.ppo_utils | 0006-accelerator-supports-torch-compile |
| train.fc1_gather_layout | update_weight.common.all_gather_param(s_async) and by-name imports | 0007-fc1-gather-partition-dim |
| train.mindspeed_repatch | mindspeed.megatron_adaptor.repatch(args) after init | 0001-plugin-import-from-environment |
| train.critic_train_iters | MegatronTrainRayActor.train_critic: K value-loss passes | 0003-critic-train-iters |
| train.critic_advantage_function | critic's compute_advantages_and_returns keeps our GAE | 0003-critic-train-iters |
| train.critic_hf_value_head | hf_to_megatron.load_model_hf_weights: the critic's value-head bias from an HF --load | 0011-critic-hf-value-head-bias |
| train.quantize_params | megatron_to_hf.quantize_params funnel -> our formats | 0005-quantizer-hook |
| train.quant_post_process | updaters' engine restore/post-process gate also for Ascend W8A8_DYNAMIC | 0005-quantizer-hook |
| train.weight_sync_metrics | updaters' update_weights timed, pop_metrics gets perf/weight_sync_* | 0005-quantizer-hook |
| rollout.forward_metadata | RolloutManager._split_train_data_by_dp forwards each sample's train_metadata | 0004-forward-metadata-extra-batch-keys |
| rollout.cosched_generate | sglang_rollout.generate: each request sent to an engine with a free slot (cosched) | 0030-rollout-dispatch-hook |
| train.rollout_log_metadata | train_metric_utils.log_rollout_data skips the forwarded metadata | 0004-forward-metadata-extra-batch-keys |
| train.loss_batch_metadata | model.get_batch: the loss batch also fetches the forwarded metadata (OPD top-k payload) | 0004-forward-metadata-extra-batch-keys (`--extra-train-batch-keys metadata`) |
| driver.ray_cpu_resources | `ray` in slime.ray.{placement_group,actor_group,rollout,train_actor}; InfoActor (no device resource) | 0002-accelerator-ray-resource-name |
| train.cpu_current_device | torch.cuda.{current_device,set_device,synchronize,empty_cache}, Tensor/Module.cuda | megatron/megatron-device-neutral-placement.md |
| train.cpu_streams | torch.cuda.{Stream,Event,current_stream,default_stream,stream,set_stream} | megatron/megatron-device-neutral-placement.md |
| train.cpu_device_map | torch factories' device=, Tensor.new_*, Tensor/Module.to: cuda -> cpu | megatron/megatron-device-neutral-placement.md |
| train.cpu_tensor_type | Tensor.type() of a CPU tensor reads torch.cuda.*Tensor | megatron/megatron-device-neutral-placement.md |
| train.npu_tensor_type | Tensor.type() of an npu tensor reads torch.cuda.*Tensor (MindSpeed's type_wrapper; Ascend without MindSpeed) | megatron/megatron-device-neutral-placement.md |
| train.npu_cuda_rng_state | megatron tensor_parallel.random._set_cuda_rng_state on torch.npu.default_generators (MindSpeed's; Ascend without MindSpeed) | megatron/megatron-device-neutral-placement.md |
| train.npu_device_arch_version | megatron.training get_device_arch_version (3 bindings) answers 8 (MindSpeed's; Ascend without MindSpeed) | megatron/megatron-device-arch-version.md |
| train.cpu_device_properties | torch.cuda.get_device_properties: the host's (Megatron's get_device_arch_version) | megatron/megatron-device-arch-version.md |
| train.cpu_moe_splits | megatron moe_utils.maybe_move_tensor_to_cpu (and token_dispatcher's by-name import): numpy split sizes from CPU tensors | megatron/megatron-moe-host-splits.md |
| train.distrib_optimizer_step | megatron DistributedOptimizer.state_dict / load_state_dict over torch's Adam (no TE / Apex): step 0 before the first step (checkpoint loads), one step counter per param after a load | megatron/megatron-distrib-optimizer-torch-adam-step.md |
| train.routing_replay | megatron moe_utils/router topk_routing_with_score_function, TopKRouter.__init__: slime's routing replay without its Megatron patch (device-neutral) | 0020-routing-replay-through-megatron-router-replay |
| train.mtp_layer_name | update_weight.common._named_params_and_buffers_global: Megatron-core 0.19's mtp_model_layer spelled transformer_layer, as slime's converters read it (device-neutral) | 0027-mtp-layer-name-megatron-0.19 |
| train.mtp_training | megatron GPTModel.forward: slime's mtp_kwargs accepted (labels = input_ids, which Megatron-core 0.19 derives itself) on a Megatron without slime's patch (device-neutral) | megatron/megatron-mtp-training.md |
| train.reloadable_group_collectives | slime's ReloadableProcessGroup: forwards torch 2.14's reduce_scatter_single / all_gather_single / all_to_all_single / gather_single | 0017-reloadable-group-forwards-single-collectives |
| driver.acknowledged_weight_update | RayTrainGroup._reload_rollout_weights_from_disk: every engine switched and read back, or all returned to the last acknowledged version | 0012-acknowledged-weight-update |
| driver.acknowledged_collective_update | RayTrainGroup.update_weights (distributed / tensor transports): every engine's version read back and published | 0023-acknowledged-collective-update |
| train.gloo_float8_broadcast | update_weight_from_distributed.update_weights_from_distributed (and its by-name import): float8 broadcast as bytes over gloo; with a sync plugin's `distributed_delta`, each bucket as the quantised blocks changed since the version every engine acknowledged (weight_sync/distributed_delta.py) | 0022-gloo-float8-broadcast |
| train.pipelined_weight_send | UpdateWeightFromDistributed._send_weights / _update_bucket_weights_from_distributed: slime's bucket send on a sender thread, one bucket in flight while the next is gathered and quantised (weight_sync/pipelined_send.py) | 0025-pipelined-distributed-weight-send |
| train.cpu_tensor_reductions | hf_weight_iterator_direct.monkey_patch_torch_reductions: host tensors keep torch's reducer after sglang's CUDA-only one (the colocated push on the host) | 0024-colocated-push-device-neutral-reductions |
| train.dsa_deterministic_topk | glm5 ops.indexer.pytorch_topk_with_invalid_padding: deterministic DSA indexer top-k | 0013-dsa-indexer-deterministic-topk |
| train.glm5_kernels | sys.modules stand-ins for slime_plugins.models.glm5.ops.tilelang_{indexer,sparse_mla}_{fwd,bwd} (no CUDA) | 0021-glm5-spec-device-backends |
| train.glm5_host_spec | glm5.py's TELinear, TESpecProvider, get_gpt_decoder_block_spec: host parts under TE's names (no CUDA) | 0021-glm5-spec-device-backends |
| train.glm5_thd_rope | DSAMLASelfAttention.get_absorb_query_key_value_tensors: apex's THD RoPE from torch while apex is absent | 0021-glm5-spec-device-backends |
| train.glm5_index_topk | get_glm5_spec / DSAMultiLatentAttention.__init__: the checkpoint's index_topk, not 2048 (no CUDA) | 0021-glm5-spec-device-backends |
| train.dsa_index_dump | glm5.py's DSAMultiLatentAttention.forward, SparseMLA / SGLangSparseMLA, model.get_batch: each layer's attended DSA key sets written per micro-batch (dsa-determinism's `ascend_dsa_index_dump_dir`) | 0026-glm5-dsa-index-dump |
| train.reset_optimizer_on_push | MegatronTrainRayActor.update_weights: the optimizer reset after each weight push (GLM-5 cadence) | 0014-reset-optimizer-on-weight-push |
| driver.validate_at_parse_args | slime.utils.arguments.parse_args: the plugins validated on its result | 0016-role-entry-hook |
| rollout.validate_at_http_client | slime.utils.http_utils.init_http_client: validation and rollout patches first | 0016-role-entry-hook |
| train.validate_at_actor_init | TrainRayActor.init: train role recorded, validation and train patches first | 0016-role-entry-hook |
| driver.allgather_cp_local_spec | slime.backends.megatron_utils.arguments._validate_allgather_cp_supported: --allgather-cp of a dense model with the cpu spec | 0015-allgather-cp-layer-spec-opt-in |
| engine.sglang_npu_launch | SGLangEngine._init_normal: NPU ServerArgs + engine env (HCCL ports, FIA, no expandable segments) | 0010-accelerator-engine-launch-defaults |
| train.hccl_port_env | TrainRayActor.init (train moment): the engines' HCCL port ranges where the job left them unset, before the actor's process groups | slime/train-actors-get-the-engines-communicator-env.md |
| engine.sglang_dsa_deterministic_topk | SGLang's dsa_topk_backend._topk_unfused (its torch top-k backend): the dsa-determinism rule in place of torch.topk, in SGLang's processes | sglang/sglang-dsa-torch-topk-deterministic.md |
| engine.torch_engine_launch | SGLangEngine._init_normal: the torch engine started in place of SGLang's server (slime's ports, router, health check, shutdown) | 0019-engine-launcher-hook |
| driver.resumed_weight_version | RayTrainGroup.create: after --load, disk weight versions go on from the resumed rollout | 0018-resumed-weight-version |

Plugins declare the patches they need and when (:class:`slime_ascend.plugins.base.PatchUse`); the
runtime installs them (:mod:`slime_ascend.startup.patch_plan`): as their targets are imported, or
as a train actor or the RolloutManager starts, with its ``args``; the three role-entry patches (``*.validate_at_*``,
:mod:`.role_entry`) are the runtime's own, registered by the bootstrap in every activated process. No feature
module imports this package. Each patch checks its target first and fails loudly.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import PatchError, PatchTargetError, RuntimePatch, slime_version

# id -> module that defines PATCH
LEDGER: dict[str, str] = {
    "driver.ray_npu_resources": "slime_ascend.patch.driver.ray_npu_resources",
    "train.disable_torch_compile": "slime_ascend.patch.train.disable_torch_compile",
    "train.fc1_gather_layout": "slime_ascend.patch.train.fc1_gather_layout",
    "train.mindspeed_repatch": "slime_ascend.patch.train.mindspeed_repatch",
    "rollout.forward_metadata": "slime_ascend.patch.rollout.forward_metadata",
    "rollout.cosched_generate": "slime_ascend.patch.rollout.cosched_generate",
    "train.rollout_log_metadata": "slime_ascend.patch.train.rollout_log_metadata",
    "train.loss_batch_metadata": "slime_ascend.patch.train.loss_batch_metadata",
    "engine.sglang_npu_launch": "slime_ascend.patch.engine.sglang_npu_launch",
    "train.hccl_port_env": "slime_ascend.patch.train.hccl_port_env",
    "engine.torch_engine_launch": "slime_ascend.patch.engine.torch_engine_launch",
    "engine.sglang_dsa_deterministic_topk": "slime_ascend.patch.engine.sglang_dsa_deterministic_topk",
    "driver.acknowledged_weight_update": "slime_ascend.patch.driver.acknowledged_weight_update",
    "driver.acknowledged_collective_update": "slime_ascend.patch.driver.acknowledged_collective_update",
    "train.gloo_float8_broadcast": "slime_ascend.patch.train.gloo_float8_broadcast",
    "train.pipelined_weight_send": "slime_ascend.patch.train.pipelined_weight_send",
    "train.cpu_tensor_reductions": "slime_ascend.patch.train.cpu_tensor_reductions",
    "train.reset_optimizer_on_push": "slime_ascend.patch.train.reset_optimizer_on_push",
    "driver.ray_cpu_resources": "slime_ascend.patch.driver.ray_cpu_resources",
    "train.cpu_current_device": "slime_ascend.patch.train.cpu_current_device",
    "train.cpu_streams": "slime_ascend.patch.train.cpu_streams",
    "train.cpu_device_map": "slime_ascend.patch.train.cpu_device_map",
    "train.cpu_tensor_type": "slime_ascend.patch.train.cpu_tensor_type",
    "train.npu_tensor_type": "slime_ascend.patch.train.npu_tensor_type",
    "train.npu_cuda_rng_state": "slime_ascend.patch.train.npu_cuda_rng_state",
    "train.npu_device_arch_version": "slime_ascend.patch.train.npu_device_arch_version",
    "train.cpu_device_properties": "slime_ascend.patch.train.cpu_device_properties",
    "train.cpu_moe_splits": "slime_ascend.patch.train.cpu_moe_splits",
    "train.distrib_optimizer_step": "slime_ascend.patch.train.distrib_optimizer_step",
    "train.routing_replay": "slime_ascend.patch.train.routing_replay",
    "train.mtp_layer_name": "slime_ascend.patch.train.mtp_layer_name",
    "train.mtp_training": "slime_ascend.patch.train.mtp_training",
    "train.reloadable_group_collectives": "slime_ascend.patch.train.reloadable_group_collectives",
    "train.critic_train_iters": "slime_ascend.patch.train.critic_train_iters",
    "train.critic_advantage_function": "slime_ascend.patch.train.critic_advantage_function",
    "train.critic_hf_value_head": "slime_ascend.patch.train.critic_hf_value_head",
    "train.quantize_params": "slime_ascend.patch.train.quantize_params",
    "train.quant_post_process": "slime_ascend.patch.train.quant_post_process",
    "train.weight_sync_metrics": "slime_ascend.patch.train.weight_sync_metrics",
    "train.dsa_deterministic_topk": "slime_ascend.patch.train.dsa_deterministic_topk",
    "train.glm5_kernels": "slime_ascend.patch.train.glm5_kernels",
    "train.glm5_host_spec": "slime_ascend.patch.train.glm5_host_spec",
    "train.glm5_thd_rope": "slime_ascend.patch.train.glm5_thd_rope",
    "train.glm5_index_topk": "slime_ascend.patch.train.glm5_index_topk",
    "train.dsa_index_dump": "slime_ascend.patch.train.dsa_index_dump",
    "driver.validate_at_parse_args": "slime_ascend.patch.driver.validate_at_parse_args",
    "rollout.validate_at_http_client": "slime_ascend.patch.rollout.validate_at_http_client",
    "train.validate_at_actor_init": "slime_ascend.patch.train.validate_at_actor_init",
    "driver.allgather_cp_local_spec": "slime_ascend.patch.driver.allgather_cp_local_spec",
    "driver.resumed_weight_version": "slime_ascend.patch.driver.resumed_weight_version",
}


def get(patch_id: str) -> RuntimePatch:
    try:
        module = LEDGER[patch_id]
    except KeyError:
        raise KeyError(f"no runtime patch {patch_id!r} in the ledger; known: {', '.join(sorted(LEDGER))}") from None
    patch = importlib.import_module(module).PATCH
    if patch.id != patch_id:
        raise PatchError(f"ledger entry {patch_id!r} points at {module}, which defines {patch.id!r}")
    return patch


def all_patches() -> list[RuntimePatch]:
    return [get(patch_id) for patch_id in LEDGER]


def install(patch_id: str, args: Any = None) -> RuntimePatch:
    """Check and apply now (imports the targets)."""
    patch = get(patch_id)
    patch.install(args)
    return patch


__all__ = [
    "LEDGER",
    "PatchError",
    "PatchTargetError",
    "RuntimePatch",
    "all_patches",
    "get",
    "install",
    "slime_version",
]
