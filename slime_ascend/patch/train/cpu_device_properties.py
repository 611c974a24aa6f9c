"""Megatron reads the device's architecture from ``torch.cuda.get_device_properties``.

``megatron.training.arguments.validate_args`` calls ``get_device_arch_version()``
(``torch.cuda.get_device_properties("cuda:0").major``) whenever tensor or context parallelism is above 1,
so slime's driver stops in ``parse_args`` on a host without CUDA before any actor starts. Megatron-core's
FSDP buffers and MoE permutation read ``total_memory`` / ``multi_processor_count`` from the same call.
"""

from __future__ import annotations

from ...cpu import cuda_shims
from ._cpu_common import CudaShims

PATCH = CudaShims(
    id="train.cpu_device_properties",
    targets=("torch:cuda.get_device_properties",),
    why="Megatron's validate_args reads torch.cuda.get_device_properties('cuda:0').major (get_device_arch_version) "
    "for --tensor-model-parallel-size or --context-parallel-size above 1; a torch without CUDA raises there, in the "
    "driver's parse_args.",
    how="torch.cuda.get_device_properties returns the host's: total memory, core count, and major 10, the "
    "architecture Megatron treats as having no CUDA_DEVICE_MAX_CONNECTIONS limit (the host has no hardware work "
    "queues). Applied in every process that imports megatron.core (the driver included), only where "
    "torch.cuda.is_available() is False.",
    upstream="patches/megatron/megatron-device-arch-version.md",
    checked_on=("0.3.1",),
    replaced={"cuda.get_device_properties": cuda_shims.get_device_properties},
)
