"""slime's Ray code starts its placement groups and actors on a host without GPUs.

The same view as ``driver.ray_npu_resources`` (:class:`DeviceRay`) with no device resource. Dropping
``num_gpus`` keeps the CPU share (the train actors already ask for ``num_cpus`` of the same amount), so
``python train.py`` starts on any Ray cluster, including the local one slime's first Ray call starts in the
driver, with no ``--num-gpus`` or custom resources. The two patches replace the same attributes: with ``cpu``
and ``npu`` together (``npu`` on the host) the ``cpu`` plugin leaves Ray to ``driver.ray_npu_resources``.
"""

from __future__ import annotations

from .ray_npu_resources import TARGETS, DeviceRay, RayDeviceResources


class CPURay(DeviceRay):
    """The view for the ``cpu`` plugin: GPU requests become nothing but the CPU share."""

    RESOURCE = None


class RayCPUResources(RayDeviceResources):
    VIEW = CPURay


PATCH = RayCPUResources(
    id="driver.ray_cpu_resources",
    targets=TARGETS,
    why="slime requests Ray's GPU resource and reads ray.get_gpu_ids(); a CPU-only host has neither, so the "
    "placement group waits for ever.",
    how="Each target module's `ray` becomes a view that drops num_gpus (keeping the CPU share), drops GPU from "
    "placement-group bundles, and reports device 0 from get_gpu_ids; InfoActor is re-declared through it.",
    upstream="patches/0002-accelerator-ray-resource-name.patch",
    checked_on=("0.3.1",),
)
