"""The device probe of tests/e2e/test_slime_npu_emulated.py, run inside slime's train actor by slime's own hook
``--custom-megatron-before-train-step-hook-path npu_device_probe.before_train_step`` (slime calls it at the start of
every train step, after the gradients are zeroed, with the model chunks and the optimizer): nothing is set on slime's
objects, they are only read.

Each call prints one line: how many of the parameters, of their ``main_grad`` buffers (Megatron DDP's gradient
buffer views) and of the optimizer's tensors (state and main parameters, the fp32 shards of the distributed
optimizer) are on ``npu``, the operators the emulated device ran since the previous call (at rollout N > 0: the
train step of rollout N-1, the weight push after it and rollout N's log-probs), which torch_npu is loaded, whether
its ``transfer_to_npu`` was applied, and which device patches (``train.npu_*``, ``train.cpu_*``) this process holds. A
tensor on any other device (the host, or another rank's NPU) stops the job with one line naming it.
"""

from __future__ import annotations

import torch

_last = {"ops": None}


def _optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def _optimizer_tensors(optimizer):
    out = []
    for opt in _optimizers(optimizer):
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            out += [(f"param_groups[{i}]", p) for i, p in enumerate(group["params"])]
        for index, state in enumerate(inner.state.values()):
            out += [(f"state[{index}].{k}", v) for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    return out


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    import torch_npu

    from slime_ascend.npu_emulation import device

    params = [(name, p) for chunk in model for name, p in chunk.named_parameters()]
    grads = [(name, p.main_grad) for name, p in params if getattr(p, "main_grad", None) is not None]
    state = _optimizer_tensors(optimizer)
    here = torch.device("npu", torch.cuda.current_device())  # the NPU this rank was given
    stray = [f"{kind} {name} on {t.device}" for kind, group in (("param", params), ("main_grad", grads),
                                                                 ("optimizer", state))
             for name, t in group if t.device != here]
    from slime_ascend import patch
    from slime_ascend.npu_emulation import transfer_to_npu

    # what ran this process's Megatron: the npu plugin's patches applied here, and transfer_to_npu
    applied = ",".join(sorted(p.id for p in patch.all_patches() if p.applied and p.id.startswith("train.")
                              and ("npu" in p.id or "cpu" in p.id)))
    ops = device.dispatched_ops()
    since = "-" if _last["ops"] is None else ops - _last["ops"]
    _last["ops"] = ops
    rank = torch.distributed.get_rank()
    print(f"npu device probe: rank {rank} rollout {rollout_id} step {step_id}: params {len(params)} "
          f"main_grads {len(grads)} optimizer_tensors {len(state)} off_npu {len(stray)} ops_since_last {since} "
          f"torch_npu {torch_npu.__version__} current_device {torch.cuda.current_device()} "
          f"transfer_to_npu {transfer_to_npu.applied()} patches {applied}", flush=True)
    if stray:
        raise RuntimeError(f"npu device probe: {len(stray)} train tensors are not on npu, first: {stray[0]}")
