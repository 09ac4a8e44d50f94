"""CUDA device arguments become CPU, and CPU tensors report CUDA type names.

* ``CudaToCpuMode`` (a ``TorchFunctionMode``): ``device='cuda'``/``'cuda:N'``/``N``/
  ``torch.device('cuda')`` in any torch call, ``Tensor.cuda()``, ``Tensor.to('cuda')``,
  ``Tensor.pin_memory()``/``pin_memory=True`` and ``Tensor.record_stream`` become their CPU
  (no-op) equivalents. ``.cuda()``/``.to('cuda')`` of a CPU tensor return the tensor itself,
  as on GPU for a tensor already on the device. Nearly every megatron module needs it, e.g.
  ``training/training.py:pretrain`` (``torch.tensor(..., device='cuda')``) and
  ``core/distributed/param_and_grad_buffer.py`` (buffers on ``torch.cuda.current_device()``).
* ``tensor_type``: ``Tensor.type()`` without arguments reports ``torch.cuda.<X>Tensor`` for
  CPU tensors; ``Tensor.type('torch.cuda.<X>Tensor')`` converts to the CPU type.
  ``core/optimizer/optimizer.py:Float16OptimizerWithFloat16Params.__init__`` and
  ``core/optimizer/clip_grads.py`` reject any other string.

Invariant: only arguments change; the called function and its results are the real ones.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def is_cuda_device(device: Any) -> bool:
    """True for 'cuda', 'cuda:N', torch.device('cuda', N) and bare ints (CUDA indices)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _to_cpu_device(device: Any) -> Any:
    return CPU if is_cuda_device(device) else device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]  # already "there"
        if func is torch.Tensor.record_stream:
            return None
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0],) + tuple(_to_cpu_device(a) for a in args[1:])
        return func(*args, **kwargs)


# The pushed mode while the layer is installed (None otherwise).
_mode: Optional[CudaToCpuMode] = None


def enter_mode() -> None:
    """Push the device-mapping mode for the rest of the process (until ``exit_mode``)."""
    global _mode
    _mode = CudaToCpuMode()
    _mode.__enter__()


def exit_mode() -> None:
    """Pop the mode pushed by ``enter_mode`` (no-op when none)."""
    global _mode
    if _mode is not None:
        _mode.__exit__(None, None, None)
        _mode = None


def mode_active() -> bool:
    return _mode is not None


@contextlib.contextmanager
def device_mapping_suspended() -> Iterator[None]:
    """Pop the device-mapping mode for the block and push it back after.

    The mode intercepts every torch call (microseconds each). It is needed to build
    megatron objects on CPU, not to run code that allocates on its buffers' own device;
    timing such code with the mode on charges each torch call an overhead no GPU run has.
    A no-op when the layer is not installed.
    """
    if _mode is None:
        yield
        return
    _mode.__exit__(None, None, None)
    try:
        yield
    finally:
        _mode.__enter__()


_real_tensor_type = torch.Tensor.type


def _cpu_type_name(cuda_name: str) -> str:
    """'torch.cuda.BFloat16Tensor' -> 'torch.BFloat16Tensor' (other names unchanged)."""
    prefix = "torch.cuda."
    return "torch." + cuda_name[len(prefix):] if cuda_name.startswith(prefix) else cuda_name


def tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs):
    """``Tensor.type`` that names CPU tensors as CUDA ones.

    Returns:
        With no ``dtype``: ``str`` like ``'torch.cuda.FloatTensor'`` for a CPU float32 tensor.
        With ``dtype``: the converted tensor; CUDA type names/classes map to the CPU type.
    """
    if dtype is None and not kwargs:
        name = _real_tensor_type(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name
    if isinstance(dtype, str):
        dtype = _cpu_type_name(dtype)
    elif isinstance(dtype, type) and getattr(dtype, "__module__", "") == "torch.cuda":
        dtype = _cpu_type_name(f"torch.cuda.{dtype.__name__}")
    return _real_tensor_type(self, dtype, non_blocking, **kwargs)
