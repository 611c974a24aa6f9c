"""TEST DOUBLE: the ``npu`` device type on host memory (see :mod:`slime_ascend.npu_emulation`).

torch's ``PrivateUse1`` key is renamed ``npu`` and prepared as a Python backend
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``). An ``npu`` tensor is a
:class:`NpuTensor`: a ``torch.Tensor._make_wrapper_subclass`` whose device is ``npu:N`` and which holds the
host tensor that has the data. Every aten operator on it reaches :meth:`NpuTensor.__torch_dispatch__`,
which runs the operator on the host tensors and wraps the results again, so autograd, views, in-place
operators, optimizers and ``nn.Module.to`` work as on a device. A boxed ``PrivateUse1`` fallback does the
same for operators that reach the backend with no ``npu`` tensor argument (factories with
``device="npu"``: ``empty``, ``empty_strided``, ``tril_indices``, ...).

What a real device does and this one checks:

* an operator mixing an ``npu`` tensor with a ``cpu`` tensor that is not a 0-dim scalar raises the same
  ``RuntimeError`` as CUDA ("Expected all tensors to be on the same device ..."), except the operators that
  accept it on a device (copies, indexing with host indices); so does mixing ``npu:0`` and ``npu:1``;
* random operators draw from one generator per ``npu`` device (``torch.npu.default_generators``), not from
  the host's: ``torch.npu.manual_seed`` / ``get_rng_state`` act on the device stream of numbers;
* ``memory_allocated`` counts the bytes of live host storages owned by ``npu`` tensors (each storage once,
  released when its last tensor dies), with a peak since the last reset.

What it cannot be: numerics are the host's CPU kernels (no NPU kernel, no format/precision behaviour),
everything is synchronous, and ``data_ptr`` / ``untyped_storage`` answer for the host storage.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch

DEVICE_TYPE = "npu"
_CPU = torch.device("cpu")

# -- device state -----------------------------------------------------------------------------------------
_state_lock = threading.RLock()
_device_count = 1
_devices: list[torch.device] = []  # filled by configure(), once "npu" is a device type
_current = 0  # process-wide current device (see npu_module.set_device)
_generators: list[torch.Generator] = []


def configure(device_count: int) -> None:
    """Set the number of emulated devices (done once, by :func:`slime_ascend.npu_emulation.install`)."""
    global _device_count, _devices
    with _state_lock:
        _device_count = max(int(device_count), 0)
        _devices = [torch.device(DEVICE_TYPE, i) for i in range(max(_device_count, 1))]
        while len(_generators) < len(_devices):
            gen = torch.Generator()
            gen.manual_seed(torch.initial_seed())  # as a device generator starts from the default seed
            _generators.append(gen)


def device_count() -> int:
    return _device_count


def current_index() -> int:
    return _current


def set_current_index(index: int) -> None:
    global _current
    check_index(index)
    _current = index


def check_index(index: int) -> int:
    if not 0 <= index < _device_count:
        raise RuntimeError(f"npu device index {index} out of range: {_device_count} emulated device(s) "
                           "(ASCEND_RT_VISIBLE_DEVICES / SLIME_ASCEND_EMULATED_NPUS)")
    return index


def generator(index: int | None = None) -> torch.Generator:
    return _generators[_current if index is None else index]


def generators() -> tuple[torch.Generator, ...]:
    return tuple(_generators[:_device_count])


# -- memory accounting ------------------------------------------------------------------------------------
class _Memory:
    """Bytes of live host storages behind ``npu`` tensors, per device (each storage counted once, at its current
    size: a storage resized in place, ``untyped_storage().resize_(0)``, counts what it holds now)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, tuple[int, weakref.ref]] = {}  # storage cdata -> (device index, weakref)
        self.refs: dict[weakref.ref, int] = {}  # weakref -> storage cdata
        self.running: dict[int, int] = {}  # bytes per device as allocated (for the peak between queries)
        self.sizes: dict[int, int] = {}  # storage cdata -> bytes when last counted
        self.peak: dict[int, int] = {}
        self.alloc_count: dict[int, int] = {}
        self.free_count: dict[int, int] = {}
        self.observers: list = []  # called with (storage, index) for each new storage (use_mem_pool, memory saver)

    def track(self, storage: torch.UntypedStorage, index: int) -> None:
        key = storage._cdata
        if key in self.live:
            return
        nbytes = storage.nbytes()
        with self.lock:
            if key in self.live:
                return
            # torch keeps a storage's Python object alive as long as the storage: the callback fires when it is freed
            ref = weakref.ref(storage, self._dead)
            self.live[key] = (index, ref)
            self.refs[ref] = key
            self.sizes[key] = nbytes
            now = self.running.get(index, 0) + nbytes
            self.running[index] = now
            if now > self.peak.get(index, 0):
                self.peak[index] = now
            self.alloc_count[index] = self.alloc_count.get(index, 0) + 1
        for observe in self.observers:
            observe(storage, index)

    def _dead(self, ref) -> None:
        with self.lock:
            key = self.refs.pop(ref, None)
            if key is None:
                return
            index, _ = self.live.pop(key)
            self.running[index] = self.running.get(index, 0) - self.sizes.pop(key, 0)
            self.free_count[index] = self.free_count.get(index, 0) + 1

    def allocated(self, index: int) -> int:
        """Bytes held now on device ``index`` (and the running count and peak brought up to date)."""
        with self.lock:
            total = 0
            for key, (where, ref) in self.live.items():
                if where != index:
                    continue
                storage = ref()
                nbytes = storage.nbytes() if storage is not None else 0
                self.sizes[key] = nbytes
                total += nbytes
            self.running[index] = total
            if total > self.peak.get(index, 0):
                self.peak[index] = total
            return total

    def max_allocated(self, index: int) -> int:
        self.allocated(index)
        return self.peak.get(index, 0)

    def reset_peak(self, index: int) -> None:
        now = self.allocated(index)
        with self.lock:
            self.peak[index] = now


memory = _Memory()


# -- the tensor type --------------------------------------------------------------------------------------
class NpuTensor(torch.Tensor):
    """A tensor on the emulated ``npu`` device: the wrapper autograd and user code see; ``_host`` has the data."""

    _host: torch.Tensor
    _index: int
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    # ``param.data = other``: torch swaps the wrapper's metadata (``set_data``); the host tensor goes with it
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        torch._C.TensorBase.data.__set__(self, new)
        self._host = new._host
        self._index = new._index

    # Python-level methods a real device answers without an operator
    def data_ptr(self) -> int:
        return self._host.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._host.untyped_storage()

    def is_pinned(self, device=None) -> bool:
        return False

    def record_stream(self, stream) -> None:
        return None  # host work is synchronous: nothing to keep alive for another stream

    def tolist(self):
        return self._host.tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy "
                            "the tensor to host memory first.")
        return self.cpu().numpy()

    def __repr__(self, *, tensor_contents=None) -> str:
        # torch prints a subclass as "NpuTensor(...)": print it as a device tensor ("tensor(..., device='npu:0')")
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        head = type(self).__name__ + "("
        outer = "Parameter(" + head if text.startswith("Parameter(" + head) else head
        if text.startswith(outer):
            body = text[len(outer):-1] if outer != head else text[len(head):]
            text = "tensor(" + body.replace("\n" + " " * len(head), "\n" + " " * len("tensor("))
        if getattr(self, "_is_param", False):
            text = "Parameter containing:\n" + text
        return text

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __reduce_ex__(self, protocol):
        # torch.save / pickle of a tensor without real storage: torch's own rebuild for such device tensors (allowed
        # by weights_only loading) carries the host copy and moves it back to this device (or map_location's)
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (self._host.detach().clone(), self.dtype, str(self.device), self.requires_grad))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = _wrap(self._host.detach().clone(), self._index)
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k not in ("_host", "_index")})
        return new


def _wrap(host: torch.Tensor, index: int) -> NpuTensor:
    storage = host.untyped_storage()
    tensor = torch.Tensor._make_wrapper_subclass(
        NpuTensor, host.size(), strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
        device=_devices[index], layout=host.layout, requires_grad=False, storage_size=storage.nbytes())
    tensor._host = host
    tensor._index = index
    memory.track(storage, index)
    return tensor


def _sync_metadata(wrapper: NpuTensor) -> None:
    """After an operator changed the host tensor's size/stride/storage (``out=``, ``resize_``, ``set_``, the
    in-place view operators), make the wrapper's metadata match, without dispatching."""
    host = wrapper._host
    storage = host.untyped_storage()
    if (wrapper.size() == host.size() and wrapper.stride() == host.stride()
            and wrapper.storage_offset() == host.storage_offset()
            and torch.Tensor.untyped_storage(wrapper).nbytes() >= storage.nbytes()):
        return
    donor = torch.Tensor._make_wrapper_subclass(NpuTensor, (0,), dtype=host.dtype, device=wrapper.device,
                                                storage_size=storage.nbytes())
    with no_dispatch():
        include = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.ops.aten.set_.source_Storage_storage_offset(
                wrapper, torch.Tensor.untyped_storage(donor), host.storage_offset(), host.size(), host.stride())
        finally:
            torch._C._set_meta_in_tls_dispatch_include(include)
    memory.track(storage, wrapper._index)


# -- per-operator facts, computed once ----------------------------------------------------------------------
class _OpInfo:
    __slots__ = ("returns", "mutates", "seeded", "takes_generator", "mixed_ok")

    def __init__(self, func) -> None:
        schema = func._schema
        arguments = schema.arguments
        # for each return: the index (positional) or name (keyword) of the mutated argument it aliases, or None
        written = {}
        for i, argument in enumerate(arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                for name in alias.before_set:
                    written[name] = (i, argument.name, argument.kwarg_only)
        returns = []
        for ret in schema.returns:
            alias = ret.alias_info
            hit = None
            if alias is not None and alias.is_write:
                for name in alias.before_set:
                    hit = written.get(name, hit)
            returns.append(hit)
        self.returns = tuple(returns)
        self.mutates = tuple(written.values())
        self.seeded = torch.Tag.nondeterministic_seeded in func.tags
        self.takes_generator = any(a.name == "generator" for a in arguments)
        self.mixed_ok = schema.name in _MIXED_OK


# operators a device accepts with host tensors among the arguments (copies; indexing with host indices)
_MIXED_OK = frozenset({
    "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy", "aten::index",
    "aten::index_put_", "aten::index_put", "aten::_index_put_impl_", "aten::_unsafe_index",
    "aten::_unsafe_index_put", "aten::to", "aten::set_",
})
_INFO: dict[Any, _OpInfo] = {}


def _info(func) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _OpInfo(func)
    return info


def _mixed(first: int, other: torch.Tensor | int) -> RuntimeError:
    other_name = f"{DEVICE_TYPE}:{other}" if isinstance(other, int) else str(other.device)
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                        f"{DEVICE_TYPE}:{first} and {other_name}!")


class _Unwrap:
    """Arguments nested in lists (``cat``, ``_foreach_*``, ``index``): host tensors in, device index found."""

    __slots__ = ("index", "plain")

    def __init__(self, index: int, plain: list | None) -> None:
        self.index = index
        self.plain = plain

    def value(self, x):
        if isinstance(x, NpuTensor):
            index = x._index
            if self.index != index:
                if self.index >= 0:
                    raise _mixed(self.index, index)
                self.index = index
            return x._host
        if isinstance(x, torch.Tensor):
            if self.plain is None:
                self.plain = []
            self.plain.append(x)
            return x
        if isinstance(x, (list, tuple)) and x:
            return type(x)(self.value(y) for y in x)
        if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
            return _CPU
        return x


_NESTED = (list, tuple)
released = 0  # storages released in place by the emulated torch_memory_saver (pause): operands are checked


def _check_released(args, kwargs) -> None:
    for x in list(args) + list(kwargs.values()):
        for t in (x if isinstance(x, _NESTED) else (x,)):
            if isinstance(t, NpuTensor) and t.numel() and t._host.untyped_storage().nbytes() == 0:
                raise RuntimeError("an npu tensor whose memory is released (torch_memory_saver.pause) was used; "
                                   "resume() it first")


_dispatched = 0  # operators run on npu tensors in this process (dispatched_ops)


def dispatched_ops() -> int:
    """How many operators this process has run on ``npu`` tensors (every aten call through
    :meth:`NpuTensor.__torch_dispatch__` or the ``PrivateUse1`` fallback): a probe for tests that a piece of code
    ran its work on the device. Counted without a lock, so concurrent threads may lose a few."""
    return _dispatched


def _dispatch(func, args, kwargs):
    global _dispatched
    _dispatched += 1
    info = _INFO.get(func) or _info(func)
    index = -1
    plain = None
    nested = None
    host_args = list(args)
    for i, a in enumerate(args):
        if isinstance(a, NpuTensor):
            if index != a._index:
                if index >= 0:
                    raise _mixed(index, a._index)
                index = a._index
            host_args[i] = a._host
        elif isinstance(a, torch.Tensor):
            if plain is None:
                plain = []
            plain.append(a)
        elif isinstance(a, _NESTED) or isinstance(a, torch.device):
            if nested is None:
                nested = _Unwrap(index, plain)
            nested.index = index
            nested.plain = plain
            host_args[i] = nested.value(a)
            index, plain = nested.index, nested.plain
    device = None
    host_kwargs = kwargs
    if kwargs:
        host_kwargs = {}
        for k, v in kwargs.items():
            if isinstance(v, NpuTensor):
                if index != v._index:
                    if index >= 0:
                        raise _mixed(index, v._index)
                    index = v._index
                v = v._host
            elif k == "device" and v is not None:
                device = v if isinstance(v, torch.device) else torch.device(v)
                if device.type == DEVICE_TYPE:
                    v = _CPU
            elif isinstance(v, torch.Tensor):
                if plain is None:
                    plain = []
                plain.append(v)
            elif isinstance(v, _NESTED):
                nested = _Unwrap(index, plain)
                v = nested.value(v)
                index, plain = nested.index, nested.plain
            host_kwargs[k] = v
    here = index if index >= 0 else _current
    if released:
        _check_released(args, kwargs)
    if plain is not None and not info.mixed_ok:
        for t in plain:
            if t.dim() != 0 or t.device.type != "cpu":
                raise _mixed(here, t)
    if info.seeded and host_kwargs.get("generator") is None:
        out = _seeded_call(func, info, host_args, host_kwargs, here)
    else:
        out = func(*host_args, **host_kwargs)

    # the index the results are on: the device= argument, else the npu arguments'
    if device is not None:
        if device.type != DEVICE_TYPE:
            target = -1
        else:
            target = _current if device.index is None else check_index(device.index)
    else:
        target = here

    if info.mutates:
        for position, name, kwarg_only in info.mutates:
            arg = kwargs.get(name) if (kwarg_only or position >= len(args)) else args[position]
            if isinstance(arg, NpuTensor):
                _sync_metadata(arg)
            elif isinstance(arg, _NESTED):
                for a in arg:
                    if isinstance(a, NpuTensor):
                        _sync_metadata(a)

    returns = info.returns
    if len(returns) == 1:
        alias = returns[0]
        if alias is None:
            return _wrap(out, target) if type(out) is torch.Tensor and target >= 0 else _rewrap(out, target)
        position, name, kwarg_only = alias
        return kwargs.get(name) if (kwarg_only or position >= len(args)) else args[position]
    if isinstance(out, tuple) and len(returns) == len(out):
        return tuple(_rewrap(v, target) if a is None else
                     (kwargs.get(a[1]) if (a[2] or a[0] >= len(args)) else args[a[0]])
                     for v, a in zip(out, returns))
    return _rewrap(out, target)


def _rewrap(value, target: int):
    if isinstance(value, torch.Tensor):
        if target < 0 or isinstance(value, NpuTensor):
            return value
        return _wrap(value, target)
    if isinstance(value, (list, tuple)):
        return type(value)(_rewrap(v, target) for v in value)
    return value


def _seeded_call(func, info: "_OpInfo", args, kwargs, index: int):
    """Run a random operator on the npu device's generator: passed as ``generator=`` where the operator takes
    one, else swapped in as the host default generator's state for the call."""
    gen = _generators[index]
    if info.takes_generator:
        return func(*args, **{**kwargs, "generator": gen})
    default = torch.default_generator
    with _state_lock:
        saved = default.get_state()
        default.set_state(gen.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            gen.set_state(default.get_state())
            default.set_state(saved)


# -- the backend: operators reaching PrivateUse1 with no npu tensor argument ------------------------------------
_EXPLICIT = ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "lift_fresh", "detach", "alias",
             "_local_scalar_dense", "view", "set_.source_Tensor")


def _dispatch_kernel(op, *args, **kwargs):
    return _dispatch(op, args, kwargs)


def _fallback(op, *args, **kwargs):
    """Boxed PrivateUse1 fallback: ``device="npu"`` factories (and any operator that reaches the backend
    without an ``npu`` tensor): run on the host, results on the requested ``npu`` device."""
    return _dispatch(op, args, kwargs)


def _empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    host = torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
    return _wrap(host, _target(device))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _wrap(torch.empty_strided(size, stride, dtype=dtype), _target(device))


def _target(device) -> int:
    if device is None or device.index is None:
        return _current
    return check_index(device.index)


_libraries: list = []


def register_backend(backend_module) -> None:
    """Rename PrivateUse1 to ``npu``, register ``backend_module`` as ``torch.npu`` and the host kernels (once)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=backend_module)
    impl = torch.library.Library("aten", "IMPL")
    impl.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    impl.impl("empty_strided", _empty_strided, "PrivateUse1")
    # reached with the Python key excluded (torch.tensor(data, device="npu") builds its result that way), where
    # the boxed fallback cannot run: explicit kernels
    for name in _EXPLICIT:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        impl.impl(name, functools.partial(_dispatch_kernel, op), "PrivateUse1")
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    for name, policy in _AUTOCAST.items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        impl.impl(name, functools.partial(_autocast_kernel, op, policy), "AutocastPrivateUse1")
    _libraries.extend((impl, fallback))
    _install_pinned_memory()
    _install_current_index()
    _install_backward_on_the_calling_thread()


# -- autograd ----------------------------------------------------------------------------------------------------------
# torch's engine gives each device index of a backend its own worker thread, sized by the backend's device count,
# which a Python backend reports as 1: a backward on npu:1 and up would fail an internal assert. Run the backward
# pass on the calling thread instead (autograd's "multithreading disabled" mode), as torch.compile's own patch of the
# same function does for make_fx: the result is the same, the device threads only overlap work a host cannot.
def _install_backward_on_the_calling_thread() -> None:
    import torch.autograd
    import torch.autograd.graph

    original = torch.autograd.graph._engine_run_backward

    @functools.wraps(original)
    def run_backward(*args, **kwargs):
        if not torch._C._is_multithreading_enabled():
            return original(*args, **kwargs)
        torch._C._set_multithreading_enabled(False)
        try:
            return original(*args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(True)

    torch.autograd.graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward
    # callers of the engine itself (Megatron's pipeline schedules: Variable._execution_engine.run_backward) too
    from torch.autograd.variable import Variable

    if not isinstance(Variable._execution_engine, _CallingThreadEngine):
        Variable._execution_engine = _CallingThreadEngine(Variable._execution_engine)


class _CallingThreadEngine:
    """torch's autograd engine whose ``run_backward`` runs on the calling thread (see above); every other attribute
    (``queue_callback``, ``is_checkpoint_valid``, ...) is the engine's."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        if not torch._C._is_multithreading_enabled():
            return self._engine.run_backward(*args, **kwargs)
        torch._C._set_multithreading_enabled(False)
        try:
            return self._engine.run_backward(*args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(True)

    def __getattr__(self, name):
        return getattr(self._engine, name)


# -- autocast("npu"): CUDA's policy for the operators Megatron and models reach (torch's autocast_mode.cpp lists) ----
_LOWER = ("mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "addmv", "addr", "mv", "prelu",
          "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
          "convolution", "_convolution", "einsum", "chain_matmul", "scaled_dot_product_attention")
_FP32 = ("softmax.int", "log_softmax.int", "layer_norm", "native_layer_norm", "group_norm", "nll_loss",
         "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy_with_logits", "logsumexp", "cumsum",
         "cumprod", "exp", "log", "log1p", "rsqrt", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "norm.Scalar",
         "cosine_similarity", "kl_div", "cross_entropy_loss")
_AUTOCAST = {**{name: "lower" for name in _LOWER}, **{name: "fp32" for name in _FP32}}
_AUTOCAST_KEYS = None


def _autocast_kernel(op, policy, *args, **kwargs):
    global _AUTOCAST_KEYS
    if _AUTOCAST_KEYS is None:
        _AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
    dtype = torch.get_autocast_dtype(DEVICE_TYPE) if policy == "lower" else torch.float32

    def cast(x):
        if isinstance(x, NpuTensor) and x.is_floating_point() and x.dtype != torch.float64 and x.dtype != dtype:
            return x.to(dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(cast(y) for y in x)
        return x

    args = tuple(cast(a) for a in args)
    kwargs = {k: cast(v) for k, v in kwargs.items()}
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
        return op(*args, **kwargs)


# -- pinned host memory ----------------------------------------------------------------------------------------------
# torch asks the accelerator's hooks for a pinned-memory allocator, which a Python backend cannot provide; host memory
# is what the emulated device copies from anyway, so pin_memory=True allocates ordinary host memory and remembers it
# as pinned (``is_pinned()`` answers True for it, as on a device host).
_pinned_refs: dict = {}
_PIN_FACTORIES = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
                  "full_like", "tensor", "rand", "randn", "arange")


def _pinned_dead(ref) -> None:
    _pinned_refs.pop(ref, None)


def mark_pinned(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    if storage._cdata not in _pinned_refs.values():
        _pinned_refs[weakref.ref(storage, _pinned_dead)] = storage._cdata
    return tensor


def _is_marked(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage()._cdata in _pinned_refs.values()


def _install_pinned_memory() -> None:
    def factory(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if not kwargs.get("pin_memory"):
                return original(*args, **kwargs)
            kwargs["pin_memory"] = False
            return mark_pinned(original(*args, **kwargs))

        return wrapper

    for name in _PIN_FACTORIES:
        setattr(torch, name, factory(getattr(torch, name)))
    tensor_pin_memory = torch.Tensor.pin_memory
    tensor_is_pinned = torch.Tensor.is_pinned

    @functools.wraps(tensor_pin_memory)
    def pin_memory(self, device=None):
        if self.device.type != "cpu" or self.layout != torch.strided:
            return tensor_pin_memory(self, device)  # torch's own refusal ("cannot pin ...")
        if _is_marked(self):
            return self
        return mark_pinned(self.clone())

    @functools.wraps(tensor_is_pinned)
    def is_pinned(self, device=None):
        return self.device.type == "cpu" and _is_marked(self)

    torch.Tensor.pin_memory = pin_memory
    torch.Tensor.is_pinned = is_pinned


# -- "npu" without an index ------------------------------------------------------------------------------------------
# torch fills in the index of an index-less device from the backend's device guard (getDevice) before the operator is
# dispatched in torch.tensor / as_tensor / Tensor.new_tensor / Tensor.to; a Python backend's guard cannot answer, so
# torch fills 0. torch_npu's guard answers the current device: these entry points fill it in here first (a rank on
# npu:1 got torch.tensor([1.0], device="npu") on npu:0, and Megatron's loss scale met its loss on npu:1).
_INDEXED_FACTORIES = ("tensor", "as_tensor")


def _with_index(device):
    if isinstance(device, str) and device == DEVICE_TYPE:
        return torch.device(DEVICE_TYPE, _current)
    if isinstance(device, torch.device) and device.type == DEVICE_TYPE and device.index is None:
        return torch.device(DEVICE_TYPE, _current)
    return device


def _install_current_index() -> None:
    def factory(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _with_index(kwargs["device"])
            return original(*args, **kwargs)

        return wrapper

    def method(original, positional: bool):
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            if positional and args:
                args = (_with_index(args[0]), *args[1:])
            if "device" in kwargs:
                kwargs["device"] = _with_index(kwargs["device"])
            return original(self, *args, **kwargs)

        return wrapper

    for name in _INDEXED_FACTORIES:
        setattr(torch, name, factory(getattr(torch, name)))
    torch.Tensor.to = method(torch.Tensor.to, positional=True)
    torch.Tensor.new_tensor = method(torch.Tensor.new_tensor, positional=False)
