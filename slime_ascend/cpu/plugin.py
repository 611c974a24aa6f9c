"""The ``cpu`` plugin: slime's own ``train.py`` / ``train_async.py`` on a host without GPUs.

What the ``npu`` plugin does for Ascend, for the host CPU (``slime_on_cpu.md`` lists the blockers):

* every process: the ``cpu`` accelerator joins slime's registry as soon as
  ``slime.utils.accelerator`` is imported (gloo, ``current_device() == "cpu"``), and slime's Ray code
  asks for a CPU share where it asks for a GPU (``driver.ray_cpu_resources``);
* every process that imports Megatron: the ``train.cpu_*`` patches make Megatron's direct
  ``torch.cuda`` calls act on the host (current device, ``.cuda()``, streams and events, ``cuda``
  devices in tensor factories and ``.to()``, ``Tensor.type()`` strings), what torch_npu's
  ``transfer_to_npu`` does on Ascend. They apply only where CUDA is absent;
* the Megatron flags slime needs on the host, printed by ``slime-ascend config cpu --flags``: the
  local transformer with :mod:`slime_ascend.cpu.spec` (THD-packed attention, TE parameter names),
  CPU initialisation, no fused kernels;
* ``offload_train: false`` in the YAML: slime turns train offload on for PPO's critic, and offload
  preloads torch_memory_saver's CUDA library into the train actors, which then cannot start.

It is for development, debugging and CI of slime jobs without a GPU; a GPU or NPU host keeps its
device (the accelerator has the lowest priority, and the torch shims refuse to replace CUDA).

With ``npu`` (``SLIME_ASCEND_PLUGINS=cpu,npu``, a host without torch_npu) the ``npu`` plugin's code
paths run on the host: ``npu`` owns the accelerator and the Ray resources (``NPU``, which Ray must
advertise), this plugin keeps the Megatron shims, flags and YAML. On a host with torch_npu the
pairing is refused: the chip is there, use ``npu`` alone.
"""

from __future__ import annotations

from .. import _import_hooks
from ..plugins.base import CommandLineFlag, PatchUse, Plugin
from ..glm5.patch_uses import GLM5_PATCH_USES

TORCH_PATCHES = ("train.cpu_current_device", "train.cpu_streams", "train.cpu_device_map", "train.cpu_tensor_type",
                 "train.cpu_device_properties")
_P = "slime_ascend.cpu.plugin."
SPEC = "slime_ascend.cpu.spec get_layer_spec"
# slime's own GLM-5 spec runs too: the glm5 patches (GLM5_PATCH_USES) give it host linears, torch ops and RoPE
GLM5_SPEC = "slime_plugins.models.glm5.glm5 get_glm5_spec"


def _register_accelerator(module) -> None:
    from . import accelerator

    accelerator.register(module)


def host_without_cuda() -> bool:
    """Condition of the ``train.cpu_*`` patches: a CUDA host keeps CUDA (the plugin then only adds the
    accelerator). Evaluated when Megatron-core is imported."""
    import torch

    return not torch.cuda.is_available()


def owns_ray() -> bool:
    """Condition of ``driver.ray_cpu_resources``: not with ``npu``, whose ``NPU`` view replaces the same attributes."""
    from ..host import on_host

    return not on_host()


def on_process_start() -> None:
    from ..compat import typing_override

    typing_override.ensure()  # megatron-core >= 0.17 on Python 3.11
    from ..host import on_host

    on_host()  # refuse cpu+npu on a host with torch_npu, in every process
    _import_hooks.when_imported("slime.utils.accelerator", _register_accelerator)


# (flag, args attribute, the value the host supports, why not another): checked in every process, the driver's
# parse_args first, so a job the host cannot run stops before Ray or any engine starts
UNSUPPORTED = (
    # MoE and expert parallelism run (slime_ascend.cpu.spec: Megatron's MoELayer, experts under TE's names);
    # slime's MoE model scripts also pass these two TransformerEngine/CUDA kernels
    ("--moe-grouped-gemm", "moe_grouped_gemm", False,
     "grouped GEMM needs TransformerEngine; slime_ascend.cpu.spec's experts run one matmul per expert"),
    ("--moe-permute-fusion", "moe_permute_fusion", False, "the fused token permutation needs TransformerEngine"),
)


def validate(args, settings) -> None:
    """The layouts the host runs: tensor (with or without sequence), pipeline, data and expert parallelism, and
    context parallelism alone; anything else is refused with one line naming the flag."""
    from ..plugins.settings import SettingsError

    for flag, attr, supported, why in UNSUPPORTED:
        value = getattr(args, attr, supported)
        if value not in (supported, None):
            fix = f"drop {flag}" if supported in (None, False) else f"{flag} {supported}"
            shown = flag if value is True else f"{flag} {value}"
            raise SettingsError(f"cpu: {shown} is not supported on the host ({why}). Fix: {fix}; tensor, "
                                "pipeline, data and expert parallelism run")
    _check_context_parallel(args, SettingsError)
    _check_expert_tensor_parallel(args, SettingsError)
    _check_replay_routes(args, SettingsError)
    from . import ray_capacity

    ray_capacity.check(args)  # Ray can place every actor slime will ask for (the driver), or one line


def _check_replay_routes(args, error) -> None:
    """--use-rollout-routing-replay: the train side replays (train.routing_replay); the engines' routes must reach
    it past slime's router (rollout.replay_routes): slime-managed engines on the host are torch engines, which
    slime's flag makes add them to every answer."""
    from ..plugins import runtime
    from ..rollout import replay_routes

    managed_torch = "torch-engine" in runtime.enabled_names(args)
    refusal = replay_routes.refusal(args, managed_engines_add_routes=managed_torch)
    if refusal:
        raise error(f"cpu: {refusal}")


# context parallelism (zig-zag and --allgather-cp) runs, and matches one rank, alone (every train rank one CP rank);
# each flag that would combine it with another layout, untested, is refused by name
CP_ALONE = (("--tensor-model-parallel-size", "tensor_model_parallel_size", 1),
            ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", 1),
            ("--expert-model-parallel-size", "expert_model_parallel_size", 1))


def _check_context_parallel(args, error) -> None:
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp == 1:
        return
    for flag, attr, alone in CP_ALONE:
        value = getattr(args, attr, alone)
        if value not in (alone, None):
            raise error(f"cpu: {flag} {value} with --context-parallel-size {cp} is not supported on the host (context "
                        f"parallelism runs alone; this combination has not been checked against one rank). Fix: "
                        f"{flag} {alone}, or --context-parallel-size 1")
    world = (getattr(args, "actor_num_nodes", 1) or 1) * (getattr(args, "actor_num_gpus_per_node", cp) or cp)
    if world != cp:
        raise error(f"cpu: --actor-num-gpus-per-node {world} with --context-parallel-size {cp} is not supported on "
                    "the host (data parallelism over CP groups has not been checked against one rank). Fix: "
                    f"--actor-num-gpus-per-node {cp} --actor-num-nodes 1, or --context-parallel-size 1")


def _check_expert_tensor_parallel(args, error) -> None:
    """MoE with expert TP above 1 (Megatron's default is the TP size): the all-to-all dispatcher gathers each expert-TP
    group's tokens in uneven pieces (``all_gather`` of a list of sizes), which gloo refuses in the first step."""
    if not getattr(args, "num_experts", None):
        return
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if tp > 1 and not getattr(args, "sequence_parallel", False):
        # Megatron's MoELayer raises this in the train actor, after Ray and the engines have started
        raise error(f"cpu: an MoE model at --tensor-model-parallel-size {tp} needs --sequence-parallel (Megatron's "
                    "MoELayer refuses MoE with tensor parallelism and without it in training). Fix: add "
                    "--sequence-parallel")
    etp = getattr(args, "expert_tensor_parallel_size", None)
    etp = etp if etp is not None else (getattr(args, "tensor_model_parallel_size", 1) or 1)
    if etp != 1:
        given = "" if getattr(args, "expert_tensor_parallel_size", None) is not None else \
            " (Megatron's default: the --tensor-model-parallel-size)"
        raise error(f"cpu: --expert-tensor-parallel-size {etp}{given} is not supported on the host with an MoE model "
                    "(Megatron's all-to-all dispatcher gathers the expert-tensor-parallel group's tokens in uneven "
                    "pieces, which gloo's all_gather cannot do). Fix: --expert-tensor-parallel-size 1 (what slime's MoE "
                    "scripts pass)")


def _flag(flag: str, why: str, attr: str, value) -> CommandLineFlag:
    return CommandLineFlag(flag, why, check=lambda a: getattr(a, attr, None) == value)


PLUGIN = Plugin(
    name="cpu",
    description="slime on the host CPU (gloo, Ray without GPUs, Megatron's torch.cuda calls on the host, "
    "a THD-packed local spec): development, debugging and CI without a GPU",
    conflicts=("sglang-npu", "vllm-ascend"),  # with "npu": npu on the host (module docstring)
    process_start=("slime_ascend.cpu.plugin.on_process_start",),
    patches=(PatchUse("driver.ray_cpu_resources", when=_P + "owns_ray"),
             PatchUse("driver.allgather_cp_local_spec"),  # slime allows --allgather-cp for DSA models only
             PatchUse("train.reloadable_group_collectives"),  # sequence parallelism's reduce-scatter on torch 2.14
             # expert parallelism's all-to-all split sizes: both bindings at once, once the dispatcher has its own
             PatchUse("train.cpu_moe_splits", "import:megatron.core.transformer.moe.token_dispatcher",
                      when=_P + "host_without_cuda"),
             # torch's Adam in Megatron's distributed optimizer (no TE / Apex here): checkpoint loads and resumed steps
             PatchUse("train.distrib_optimizer_step", when="slime_ascend.patch.train.distrib_optimizer_step.wanted"),
             # slime's routing replay in a Megatron-core without slime's Megatron patch (device-neutral; the
             # predicate lives with the patch: whether slime or Megatron already wire replay)
             PatchUse("train.routing_replay", "train", when="slime_ascend.patch.train.routing_replay.wanted"),
             # --mtp-num-layers on Megatron-core 0.19: its MTP layer's new name, spelled as slime's converters read it
             PatchUse("train.mtp_layer_name", "train", when="slime_ascend.patch.train.mtp_layer_name.wanted"),
             PatchUse("train.mtp_training", "train", when="slime_ascend.patch.train.mtp_training.wanted"))
    + tuple(PatchUse(p, "import:megatron.core", when=_P + "host_without_cuda") for p in TORCH_PATCHES)
    + GLM5_PATCH_USES,  # slime's glm5 spec: torch ops, host linears, THD RoPE (slime_ascend.glm5)
    # slime forces offload_train for PPO (--advantage-estimator ppo: actor and critic share devices) and then
    # LD_PRELOADs torch_memory_saver's CUDA hook into every train actor, which cannot even start without
    # libcuda; on the host there is no device memory to offload (the YAML is applied after that rule)
    slime_args=(("offload_train", False),),
    validate=_P + "validate",
    command_line=(
        _flag("--transformer-impl local", "TransformerEngine needs CUDA", "transformer_impl", "local"),
        CommandLineFlag(f"--spec {SPEC}", "THD-packed attention and TE parameter names on the local transformer",
                        check=lambda a: list(getattr(a, "spec", None) or []) in (SPEC.split(), GLM5_SPEC.split())),
        _flag("--use-cpu-initialization", "Megatron initialises weights on the current CUDA device otherwise",
              "use_cpu_initialization", True),
        _flag("--inference-rng-tracker", "the CUDA RNG tracker reads torch.cuda.get_rng_state()",
              "inference_rng_tracker", True),
        # the inference tracker keeps no states, and Megatron's load_checkpoint exits ("Unable to load rng state")
        # on a checkpoint whose rng_tracker_states are empty: such a checkpoint says it holds no RNG, and every
        # Megatron then loads it (--load of the job's own --save, here or on a GPU) without one
        _flag("--no-save-rng", "with --inference-rng-tracker the checkpoint's RNG tracker states are empty, and "
              "Megatron's --load of such a checkpoint exits", "no_save_rng", True),
        _flag("--no-rope-fusion", "fused RoPE needs TransformerEngine", "apply_rope_fusion", False),
        _flag("--no-gradient-accumulation-fusion", "needs a CUDA extension", "gradient_accumulation_fusion", False),
        _flag("--no-masked-softmax-fusion", "needs a CUDA kernel", "masked_softmax_fusion", False),
        _flag("--no-bias-swiglu-fusion", "jit-fused for CUDA", "bias_swiglu_fusion", False),
        _flag("--no-bias-dropout-fusion", "jit-fused for CUDA", "bias_dropout_fusion", False),
        _flag("--no-persist-layer-norm", "needs apex", "no_persist_layer_norm", True),
    ),
)
