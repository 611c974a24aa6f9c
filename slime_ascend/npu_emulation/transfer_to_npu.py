"""TEST DOUBLE: ``torch_npu.contrib.transfer_to_npu`` for the emulated device (see :mod:`slime_ascend.npu_emulation`).

Importing ``torch_npu.contrib.transfer_to_npu`` (MindSpeed's adaptor does, and Ascend users put it at the top of
CUDA code) runs :func:`apply`, which does what the real module's ``_init()`` does (Ascend/pytorch
``torch_npu/contrib/transfer_to_npu.py``), in its order and with its lists:

* ``torch.cuda.*``, ``torch.cuda.amp.*`` and ``torch.cuda.random.*`` become ``torch.npu``'s (torch_npu
  ``_apply_patches``: every name of ``torch.npu.__all__`` is copied onto the ``torch.cuda`` module), and the
  functions of ``torch_cuda_fn_white_list`` take ``"cuda"`` devices as ``"npu"``;
* the device arguments (``device``, ``device_type``, ``map_location``, ``device_id``) of torch's tensor factories,
  ``Tensor.to`` / ``new_*`` / ``pin_memory``, ``Module.to`` / ``to_empty``, ``torch.UntypedStorage``,
  ``torch.Generator``, ``DistributedDataParallel``, ``init_device_mesh`` and torch's device context read
  ``cuda`` as ``npu`` (an integer device as ``npu:N``);
* ``Tensor.cuda`` / ``Module.cuda`` are ``.npu``, ``Tensor.is_cuda`` is ``is_npu``, ``torch.cuda.DoubleTensor`` is
  ``torch.npu.FloatTensor``, ``torch.cuda.CUDAGraph`` is ``torch.npu.NPUGraph``;
* ``init_process_group`` and ``_new_group_with_tag`` turn ``nccl`` into ``hccl``, ``is_nccl_available`` is
  ``is_hccl_available``, and ``cuda`` leaves ``Backend.default_device_backend_map``;
* ``torch.jit.script`` becomes the identity (with the real module's warning), triton is reported absent.

Not done here: the profiler replacement (``torch_npu.profiler`` is not emulated) and the wrapping of third-party
APIs listed in torch_npu's ``apis_config.json`` (a data file of the real package).
"""

from __future__ import annotations

import functools
import threading
import warnings

torch_fn_white_list = ['logspace', 'randint', 'hann_window', 'rand', 'full_like', 'ones_like', 'rand_like',
                       'randperm', 'arange', 'frombuffer', 'normal', '_empty_per_channel_affine_quantized',
                       'empty_strided', 'empty_like', 'scalar_tensor', 'tril_indices', 'bartlett_window', 'ones',
                       'sparse_coo_tensor', 'randn', 'kaiser_window', 'tensor', 'triu_indices', 'as_tensor', 'zeros',
                       'randint_like', 'full', 'eye', '_sparse_csr_tensor_unsafe', 'empty',
                       '_sparse_coo_tensor_unsafe', 'blackman_window', 'zeros_like', 'range', 'sparse_csr_tensor',
                       'randn_like', 'from_file', '_cudnn_init_dropout_state', '_empty_affine_quantized', 'linspace',
                       'hamming_window', 'empty_quantized', '_pin_memory', 'autocast', 'load', 'set_default_device']
torch_tensor_fn_white_list = ['new_empty', 'new_empty_strided', 'new_full', 'new_ones', 'new_tensor', 'new_zeros',
                              'to', 'pin_memory']
torch_module_fn_white_list = ['to', 'to_empty']
torch_cuda_fn_white_list = [
    'get_device_properties', 'get_device_name', 'get_device_capability', 'list_gpu_processes', 'set_device',
    'synchronize', 'mem_get_info', 'memory_stats', 'memory_summary', 'memory_allocated', 'max_memory_allocated',
    'reset_max_memory_allocated', 'memory_reserved', 'max_memory_reserved', 'reset_max_memory_cached',
    'reset_peak_memory_stats', 'default_stream'
]
torch_distributed_fn_white_list = ['__init__']
device_kwargs_list = ['device', 'device_type', 'map_location', 'device_id']

_lock = threading.Lock()
_applied = False


def _replace_cuda_to_npu_in_kwargs(kwargs, device_arg, device):
    import torch

    if type(device) == str and 'cuda' in device:  # noqa: E721 - the real module's exact-type tests
        kwargs[device_arg] = device.replace('cuda', 'npu')
    elif type(device) == torch.device and 'cuda' in device.type:  # noqa: E721
        kwargs[device_arg] = torch.device('npu:{}'.format(device.index) if device.index is not None else 'npu')
    elif type(device) == int:  # noqa: E721
        kwargs[device_arg] = f'npu:{device}'
    elif type(device) == dict:  # noqa: E721
        kwargs[device_arg] = _replace_cuda_to_npu_in_dict(device)


def _replace_cuda_to_npu_in_list(args_list, replace_int):
    import torch

    for idx, arg in enumerate(args_list):
        if isinstance(arg, str) and 'cuda' in arg:
            args_list[idx] = arg.replace('cuda', 'npu')
        elif isinstance(arg, torch.device) and 'cuda' in arg.type:
            args_list[idx] = torch.device('npu:{}'.format(arg.index) if arg.index is not None else 'npu')
        elif replace_int and not isinstance(arg, bool) and isinstance(arg, int):
            args_list[idx] = f'npu:{arg}'
        elif isinstance(arg, dict):
            args_list[idx] = _replace_cuda_to_npu_in_dict(arg)
    return args_list


def _replace_cuda_to_npu_in_dict(device_dict):
    new_dict = {}
    for key, value in device_dict.items():
        if isinstance(key, str):
            key = key.replace('cuda', 'npu')
        if isinstance(value, str):
            value = value.replace('cuda', 'npu')
        new_dict[key] = value
    return new_dict


def _wrapper_cuda(fn):
    @functools.wraps(fn)
    def decorated(*args, **kwargs):
        replace_int = fn.__name__ in ['to', 'to_empty']
        if args:
            args = _replace_cuda_to_npu_in_list(list(args), replace_int)
        if kwargs:
            for device_arg in device_kwargs_list:
                device = kwargs.get(device_arg, None)
                if device is not None:
                    _replace_cuda_to_npu_in_kwargs(kwargs, device_arg, device)
            device_ids = kwargs.get('device_ids', None)
            if type(device_ids) == list:  # noqa: E721
                _replace_cuda_to_npu_in_list(device_ids, replace_int)
        return fn(*args, **kwargs)

    return decorated


def _device_wrapper(enter_fn, white_list):
    for fn_name in white_list:
        fn = getattr(enter_fn, fn_name, None)
        if fn:
            setattr(enter_fn, fn_name, _wrapper_cuda(fn))


def _wrapper_hccl(fn):
    @functools.wraps(fn)
    def decorated(*args, **kwargs):
        if args:
            args = [arg.replace('nccl', 'hccl') if type(arg) == str and 'nccl' in arg else arg  # noqa: E721
                    for arg in args]
        if kwargs:
            backend = kwargs.get('backend', None)
            if type(backend) == str and 'nccl' in backend:  # noqa: E721
                kwargs['backend'] = backend.replace('nccl', 'hccl')
        return fn(*args, **kwargs)

    return decorated


def _jit_script(obj, optimize=None, _frames_up=0, _rcb=None, example_inputs=None):
    return obj


def _jit_script_method(fn):
    return fn


def _patch_has_triton():
    return False


def _generator_proxy():
    import torch

    class _GeneratorProxy(torch.Generator):
        def __new__(cls, device='cpu'):
            device = _replace_cuda_to_npu_in_list([device], None)[0]
            return super().__new__(cls, device)

    return _GeneratorProxy


def apply() -> None:
    """Redirect ``torch.cuda`` and ``cuda`` devices to the emulated ``npu`` (once per process; see module doc)."""
    global _applied
    with _lock:
        if _applied:
            return
        _applied = True
    import torch
    import torch.distributed
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    import torch.nn.parallel
    import torch.utils._device
    import torch.utils._triton
    from torch.nn.parameter import UninitializedTensorMixin
    from torch.utils._device import _device_constructors

    import torch_npu

    _device_constructors()
    warnings.warn(
        "The torch.Tensor.cuda and torch.nn.Module.cuda are replaced with torch.Tensor.npu and torch.nn.Module.npu "
        "now. The backend in torch.distributed.init_process_group set to hccl now. The torch.cuda.* and "
        "torch.cuda.amp.* are replaced with torch.npu.* and torch.npu.amp.* now (emulated npu device).",
        ImportWarning)

    # torch.cuda.*
    torch_npu._apply_patches([
        ['cuda', torch_npu.npu], ['cuda.amp', torch_npu.npu.amp],
        ['cuda.random', torch_npu.npu.random],
        ['cuda.amp.autocast_mode', torch_npu.npu.amp.autocast_mode],
        ['cuda.amp.common', torch_npu.npu.amp.common],
        ['cuda.amp.grad_scaler', torch_npu.npu.amp.grad_scaler],
    ])
    _device_wrapper(torch.cuda, torch_cuda_fn_white_list)
    torch.cuda.device.__init__ = _wrapper_cuda(torch.cuda.device.__init__)

    # torch.*
    _device_wrapper(torch, torch_fn_white_list)
    torch.UntypedStorage.__new__ = _wrapper_cuda(torch.UntypedStorage.__new__)
    torch.Generator = _generator_proxy()

    # torch.Tensor.*
    _device_wrapper(torch.Tensor, torch_tensor_fn_white_list)
    torch.Tensor.cuda = torch.Tensor.npu
    torch.Tensor.is_cuda = torch.Tensor.is_npu
    torch.cuda.DoubleTensor = torch.npu.FloatTensor

    # torch.nn.Module.*
    _device_wrapper(torch.nn.Module, torch_module_fn_white_list)
    torch.nn.Module.cuda = torch.nn.Module.npu

    # torch.distributed
    torch.distributed.init_process_group = _wrapper_hccl(torch.distributed.init_process_group)
    torch.distributed.is_nccl_available = torch.distributed.is_hccl_available
    torch.distributed.ProcessGroup._get_backend = _wrapper_cuda(torch.distributed.ProcessGroup._get_backend)
    fsdp = torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel
    fsdp.__init__ = _wrapper_cuda(fsdp.__init__)
    torch.distributed.Backend.default_device_backend_map.pop('cuda', None)
    torch.distributed.device_mesh.init_device_mesh = _wrapper_cuda(torch.distributed.device_mesh.init_device_mesh)
    torch.distributed.distributed_c10d._new_group_with_tag = _wrapper_hccl(
        torch.distributed.distributed_c10d._new_group_with_tag)

    torch.cuda.CUDAGraph = torch.npu.NPUGraph
    _device_wrapper(torch.nn.parallel.DistributedDataParallel, torch_distributed_fn_white_list)
    torch.utils._device.DeviceContext.__init__ = _wrapper_cuda(torch.utils._device.DeviceContext.__init__)

    warnings.warn('torch.jit.script and torch.jit.script_method will be disabled by transfer_to_npu, which currently '
                  'does not support them, if you need to enable them, please do not use transfer_to_npu.',
                  RuntimeWarning)
    torch.jit.script = _jit_script
    torch.jit.script_method = _jit_script_method
    setattr(torch.utils._triton, 'has_triton', _patch_has_triton)
    for i, method in enumerate(UninitializedTensorMixin._allowed_methods):
        if method.__name__ == "to":
            UninitializedTensorMixin._allowed_methods[i] = torch.Tensor.to
            break


def applied() -> bool:
    return _applied
