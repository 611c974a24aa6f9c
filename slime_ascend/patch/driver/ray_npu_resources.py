"""Ray asks for ``NPU`` where slime asks for ``GPU``.

On Ascend, Ray sets ``ASCEND_RT_VISIBLE_DEVICES`` for NPU workers. Each target module's global ``ray`` (and
``placement_group`` where imported by name) becomes a :class:`DeviceRay` view; ``InfoActor``, decorated when
``placement_group.py`` was imported, is re-declared through it. Everything else on the ray module passes
through untouched, and removing the patch restores the originals.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

GPU = "GPU"
NPU = "NPU"


def translate_options(options: dict[str, Any], resource: str | None = NPU) -> dict[str, Any]:
    """``num_gpus=x`` -> ``resources={resource: x}`` (merged with any resources given). With
    ``resource=None`` (the ``cpu`` plugin) the GPU request is dropped and the CPU share stays."""
    options = dict(options)
    gpus = options.pop("num_gpus", None)
    if gpus and resource is not None:
        resources = dict(options.get("resources") or {})
        resources[resource] = resources.get(resource, 0) + gpus
        options["resources"] = resources
    return options


def translate_bundles(bundles: list[dict[str, float]], resource: str | None = NPU) -> list[dict[str, float]]:
    out = []
    for bundle in bundles:
        bundle = dict(bundle)
        if GPU in bundle:
            gpus = bundle.pop(GPU)
            if resource is not None:
                bundle[resource] = bundle.get(resource, 0) + gpus
        out.append(bundle)
    return out


class _TranslatingRemote:
    """An ActorClass / RemoteFunction whose ``options`` translate GPU requests."""

    def __init__(self, wrapped: Any, resource: str | None = NPU):
        self._wrapped = wrapped
        self._resource = resource

    def options(self, **options: Any) -> Any:
        return self._wrapped.options(**translate_options(options, self._resource))

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped.remote(*args, **kwargs)

    def __getattr__(self, item: str) -> Any:
        if item in ("_wrapped", "_resource"):
            raise AttributeError(item)
        return getattr(self._wrapped, item)


class DeviceRay:
    """The ray module as slime's Ray code should see it where a device is not Ray's ``GPU``.

    ``RESOURCE`` is the Ray resource that stands for one device; None means no device resource
    at all (the ``cpu`` plugin), and then ``get_gpu_ids`` reports the one host device, 0.
    """

    RESOURCE: str | None = NPU

    def __init__(self, ray_module: ModuleType):
        self._ray = ray_module

    def __getattr__(self, item: str) -> Any:
        if item == "_ray":
            raise AttributeError(item)
        return getattr(self._ray, item)

    def __reduce__(self):
        # Ray may pickle a function whose globals hold this view; rebuild it around the
        # receiving process's own ray module.
        return (_rebuild_view, (type(self),))

    def remote(self, *args: Any, **options: Any) -> Any:
        if args and len(args) == 1 and not options and callable(args[0]):
            return _TranslatingRemote(self._ray.remote(args[0]), self.RESOURCE)
        translated = translate_options(options, self.RESOURCE)
        # a GPU-free actor class must still declare its device need: keep num_gpus out
        decorator = self._ray.remote(**translated)
        return lambda target: _TranslatingRemote(decorator(target), self.RESOURCE)

    def get_gpu_ids(self) -> list[Any]:
        if self.RESOURCE is None:
            return [0]
        ids = self._ray.get_runtime_context().get_accelerator_ids().get(self.RESOURCE, [])
        return list(ids)

    def cluster_resources(self) -> dict[str, float]:
        return _as_gpu_view(self._ray.cluster_resources(), self.RESOURCE)

    def available_resources(self) -> dict[str, float]:
        return _as_gpu_view(self._ray.available_resources(), self.RESOURCE)


class NPURay(DeviceRay):
    """The view for Ascend: one NPU per GPU slime asks for."""

    RESOURCE = NPU


def _rebuild_view(view_type: type) -> DeviceRay:
    import ray

    return view_type(ray)


def _as_gpu_view(resources: dict[str, float], resource: str | None = NPU) -> dict[str, float]:
    """slime only logs ``GPU`` counts; report the devices (host CPUs without a device resource)
    under that key."""
    resources = dict(resources)
    resources[GPU] = resources.get(resource if resource is not None else "CPU", 0)
    return resources


class NoDeviceResource(RuntimeError):
    """The Ray cluster advertises none of the device resource slime's placement group needs."""


def require_device_resource(bundles: list[dict[str, float]], resource: str | None, cluster: dict[str, float]) -> None:
    """A placement group that needs ``resource`` on a cluster with none of it waits for ever in slime
    (``pg.ready()``): say so at once."""
    need = sum(b.get(resource, 0) for b in bundles) if resource is not None else 0
    if need and not cluster.get(resource):
        raise NoDeviceResource(
            f"slime's placement group needs {need:g} {resource} but the Ray cluster advertises no {resource} "
            f"resource. Fix: start Ray with `ray start --head --resources '{{\"{resource}\": {need:g}}}'` "
            f"(on Ascend, with the Ascend driver visible to Ray), or set RAY_OVERRIDE_RESOURCES for a local cluster."
        )


def device_placement_group(original, resource: str | None = NPU):
    def placement_group(bundles, *args, **kwargs):
        bundles = translate_bundles(bundles, resource)
        group = original(bundles, *args, **kwargs)  # starts the local cluster on slime's first Ray call
        if resource is not None:
            import ray

            try:
                require_device_resource(bundles, resource, ray.cluster_resources())
            except NoDeviceResource:
                ray.util.remove_placement_group(group)
                raise
        return group

    placement_group.__wrapped__ = original
    return placement_group


class _DeviceDefaults(_TranslatingRemote):
    """An ActorClass declared with ``num_gpus=n``, asking for ``n`` of ``resource`` instead.

    The class itself is not re-declared (Ray pickles it by reference to its module), so every
    ``options``/``remote`` call carries the device request explicitly.
    """

    def __init__(self, wrapped: Any, gpus: float, resource: str | None = NPU):
        super().__init__(wrapped, resource)
        self._defaults = {"num_gpus": 0, "resources": {resource: gpus} if resource is not None else {}}

    def options(self, **options: Any) -> Any:
        translated = translate_options(options, self._resource)
        merged = {**self._defaults, **translated}
        merged["resources"] = {**self._defaults["resources"], **translated.get("resources", {})}
        return self._wrapped.options(**merged)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.options().remote(*args, **kwargs)


# module -> what it must still contain for the translation to be complete
EXPECTED_SOURCE = {
    "slime.ray.placement_group": ('{"GPU": 1, "CPU": 1}', "ray.get_gpu_ids()", "@ray.remote(num_gpus=1)"),
    "slime.ray.actor_group": ('"num_gpus": 1', "num_gpus=num_gpus_per_actor", "ray.remote(**actor_options)"),
    "slime.ray.rollout": ("ray.remote(SGLangEngine)", "num_gpus=num_gpus"),
    "slime.ray.train_actor": ("ray.get_gpu_ids()[0]",),
}
TARGETS = tuple(f"{m}:ray" for m in EXPECTED_SOURCE) + ("slime.ray.placement_group:placement_group",
                                                        "slime.ray.placement_group:InfoActor")


class RayDeviceResources(RuntimePatch):
    """Each target module's ``ray`` becomes ``VIEW`` (a :class:`DeviceRay` subclass)."""

    VIEW: type[DeviceRay] = NPURay

    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        for name, module in modules.items():
            problems += missing_attrs(module, ["ray"])
            problems += missing_source(module, EXPECTED_SOURCE.get(name, ()), label=name)
            if name == "slime.ray.placement_group":
                problems += missing_attrs(module, ["placement_group", "InfoActor.options"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        view, resource = self.VIEW, self.VIEW.RESOURCE
        for name, module in modules.items():
            self.wrap(module, "ray", lambda ray_module: view(ray_module))
            if name == "slime.ray.placement_group":
                self.wrap(module, "placement_group", lambda original: device_placement_group(original, resource))
                # @ray.remote(num_gpus=1) InfoActor, re-declared through the view
                self.wrap(module, "InfoActor", lambda actor_class: _DeviceDefaults(actor_class, 1, resource))


PATCH = RayDeviceResources(
    id="driver.ray_npu_resources",
    targets=TARGETS,
    why="slime requests Ray's GPU resource and reads ray.get_gpu_ids(); Ascend NPUs are Ray's NPU resource.",
    how="Each target module's `ray` becomes a view that maps num_gpus to resources={'NPU': n}, GPU bundles to "
    "NPU bundles, and get_gpu_ids to the NPU accelerator ids; InfoActor is re-declared through it.",
    upstream="patches/0002-accelerator-ray-resource-name.patch",
    checked_on=("0.3.1",),
)
