"""What a weight broadcast carries for a tensor: gloo has no float8 type, so a float8 tensor travels as its bytes.

Both sides of slime's ``update_weights_from_distributed`` use :func:`wire_view` (the train side through the
runtime patch ``train.gloo_float8_broadcast``, the torch engine in
:mod:`slime_ascend.rollout.torch_engine.weight_group`): the metadata names the real dtype, the broadcast carries
a ``uint8`` view of the same bytes, so what arrives is bit-identical. Over NCCL/HCCL the tensor goes as it is.
"""

from __future__ import annotations

import torch

__all__ = ["BYTES_ON_GLOO", "wire_view"]

BYTES_ON_GLOO = (torch.float8_e4m3fn, torch.float8_e5m2)  # gloo refuses them ("Invalid scalar type")


def wire_view(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """``tensor`` as a broadcast over ``backend`` carries it: a ``uint8`` view (same bytes, same count) of a
    float8 tensor over gloo, else the tensor itself."""
    return tensor.view(torch.uint8) if str(backend) == "gloo" and tensor.dtype in BYTES_ON_GLOO else tensor
