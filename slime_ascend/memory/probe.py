"""A hook slime calls inside its Megatron train actor: the actor's memory at the start of every train step.

    --custom-megatron-before-train-step-hook-path slime_ascend.memory.probe.before_train_step
    SLIME_ASCEND_MEMORY_PROBE=/path/to/probe.jsonl   (in the job's environment; without it the hook does nothing)

slime calls it after ``zero_grad`` and before each step's forward/backward (``slime/backends/megatron_utils/
model.py``, ``train_one_step``). Each call appends one JSON line: the process id, rollout and step ids, the
bytes of the model state Megatron holds (:func:`model_state_bytes`), the resident set (``VmRSS``) and its
peak since the previous call (``VmHWM``), then resets that peak (``/proc/self/clear_refs`` = 5). So, for two
consecutive steps of one rollout, ``hwm`` of the later line minus ``rss`` of the earlier is what the earlier
step added on top of what it started with: its forward/backward (saved activations, logits, loss
temporaries, backward temporaries, inputs) and its optimizer step. Linux only (``/proc``).

Reads only: it sets no attribute on slime's, Megatron's or torch's objects.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "SLIME_ASCEND_MEMORY_PROBE"


def read_status() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def reset_peak() -> None:
    """Set ``VmHWM`` to the current ``VmRSS`` (Linux >= 4.0, ``Documentation/filesystems/proc.rst``)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _tensors(obj: Any):
    if hasattr(obj, "untyped_storage"):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def model_state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """Bytes of the model state of this rank, counted on the tensors themselves (each storage once):
    ``params`` (the model's parameters: views of Megatron's DDP param buffer), ``grads`` (their
    ``main_grad``: the DDP grad buffer), ``optimizer`` (every tensor of the torch optimizer(s) inside
    Megatron's: the fp32 main params and Adam's state)."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    chunks = model if isinstance(model, (list, tuple)) else [model]
    params = [p for c in chunks for p in c.parameters()]
    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]]
    return {
        "params": size(params),
        "grads": size(g for g in (getattr(p, "main_grad", None) for p in params) if g is not None),
        "optimizer": size(t for o in inner for t in _tensors([g["params"] for g in o.param_groups])) +
        size(t for o in inner for t in _tensors(list(o.state.values()))),
    }


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    """slime's ``custom_megatron_before_train_step_hook``: one JSON line (module docstring), then the peak reset."""
    path = os.environ.get(ENV)
    if not path:
        return
    state = model_state_bytes(model, optimizer)
    rss, hwm = read_status()
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"pid": os.getpid(), "rollout": rollout_id, "step": step_id, "rss": rss, "hwm": hwm,
                            "model_state": state}) + "\n")
    reset_peak()
