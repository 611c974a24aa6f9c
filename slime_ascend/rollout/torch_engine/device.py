"""The device the torch engine computes on (``serve-torch --device``): ``cpu`` (the default), ``cuda[:N]``, or
``npu[:N]`` (torch_npu on an Ascend host; the emulated Ascend device of :mod:`slime_ascend.npu_emulation` where
``SLIME_ASCEND_EMULATE_NPU=1`` asks for it on a host without one: every ``slime-ascend`` command arms it).

The weights, the KV cache and every forward live on the device; what leaves the engine is made on the host: each
forward's logits are copied to the host in float32 and sampled there with the request's seeded CPU generator, so
an answer's tokens and log-probs are a function of the logits alone, whichever device computed them. Weight
updates arrive on the host (disk, tensor, and the weight-update group, gloo) and are copied into the device's
parameters; a released engine spills its weights to a host file and hands the device's cached memory back
(``empty_cache``)."""

from __future__ import annotations

from ..engine_device import parse_name

__all__ = ["empty_cache", "memory_allocated", "resolve"]


def resolve(name: str):
    """The ``torch.device`` for ``name``, checked to exist in this process; ValueError in one line with the fix
    otherwise. ``npu``: imports torch_npu (what makes the ``npu`` device exist; where the process was made an
    emulated Ascend host, ``slime-ascend``'s commands with ``SLIME_ASCEND_EMULATE_NPU=1`` or
    :func:`slime_ascend.npu_emulation.arm_from_environment`, the emulated one)."""
    kind, index = parse_name(name)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device and torch.npu)
        except ImportError as exc:
            raise ValueError(f"device {name}: torch_npu is not importable ({exc}). Fix: install the torch-npu that "
                             "matches this torch and CANN and source CANN's set_env.sh, or set "
                             "SLIME_ASCEND_EMULATE_NPU=1 to serve on the emulated Ascend device (a test double)"
                             ) from None
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    if not module.is_available():
        raise ValueError(f"device {name}: torch.{kind}.is_available() is False on this host. Fix: serve with "
                         "--device cpu, or on a host with that device")
    count = module.device_count()
    if index is not None and index >= count:
        raise ValueError(f"device {name}: this process sees {count} {kind} device(s) (0 to {count - 1}). Fix: "
                         f"name one of them, or check the visible-devices variable")
    return torch.device(kind, index if index is not None else module.current_device())


def empty_cache(device) -> None:
    """Hand the device's cached, unused memory back (``torch.<device>.empty_cache``); nothing on the host."""
    if device.type != "cpu":
        import torch

        getattr(torch, device.type).empty_cache()


def memory_allocated(device) -> int | None:
    """Bytes the device's allocator holds for live tensors; None on the host (its figure is the resident size)."""
    if device.type == "cpu":
        return None
    import torch

    return int(getattr(torch, device.type).memory_allocated(device))
