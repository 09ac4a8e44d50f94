"""CPU runtime layer: run megatron-core 0.17.1 and megatron.training unchanged on CPU ranks.

Megatron assumes a CUDA device everywhere: it allocates with ``device='cuda'``, asks
``torch.cuda`` for streams, events and RNG states, compares ``Tensor.type()`` strings with
``'torch.cuda.*Tensor'``, and relies on NCCL accepting uneven ``all_gather`` sizes. This module
patches torch (and a few megatron module attributes) in-process so that the real training loop
runs on CPU with the gloo backend. It never edits a file of either megatron tree; it changes
Python objects after import, and only when asked to:

* ``install(force=False)``: install every item below (idempotent).
* ``install_if_requested()``: install only when env ``MEGATRON_CPU_RUNTIME`` is ``1``
  (``force`` installs even when a GPU is present).
* ``is_installed()``; ``uninstall()`` (for tests: restores every patched attribute).

Safety: ``install`` refuses (``RuntimeError``) when a real CUDA GPU is present, unless
``force=True``. The probe uses ``torch.cuda.is_available``/``device_count`` captured when this
module was imported, and runs before anything is patched, so a refused install changes nothing.

Items (each: what, why, which upstream code needs it)
-----------------------------------------------------
1. ``device`` mapping (a ``TorchFunctionMode``): ``device='cuda'``/``'cuda:N'``/``N``/
   ``torch.device('cuda')`` in any torch call, ``Tensor.cuda()``, ``Tensor.to('cuda')``,
   ``Tensor.pin_memory()``/``pin_memory=True`` and ``Tensor.record_stream`` become CPU
   (no-op) equivalents. ``.cuda()``/``.to('cuda')`` of a CPU tensor return the tensor itself,
   as on GPU for a tensor already on the device. Needed by nearly every module, e.g.
   ``training/training.py:pretrain`` (``torch.tensor(..., device='cuda')``),
   ``core/distributed/param_and_grad_buffer.py`` (``torch.cuda.current_device()`` buffers).
2. ``Tensor.type()`` without arguments reports ``torch.cuda.<X>Tensor`` for CPU tensors, and
   ``Tensor.type('torch.cuda.<X>Tensor')`` converts to the CPU type. Needed by
   ``core/optimizer/optimizer.py:Float16OptimizerWithFloat16Params.__init__`` and
   ``core/optimizer/clip_grads.py``, which reject any other string.
3. ``torch.cuda`` stubs: ``is_available`` (True), ``device_count`` (1), ``current_device``,
   ``set_device``, ``device`` (context), ``Stream``/``Event``/``current_stream``/
   ``default_stream``/``set_stream``/``stream`` (no-op objects; events time with
   ``time.perf_counter``), ``is_current_stream_capturing`` (False), ``synchronize``,
   ``empty_cache``, ``memory_stats``/``memory_allocated``/``max_memory_allocated``/
   ``memory_reserved``/``max_memory_reserved``/``reset_peak_memory_stats``/
   ``device_memory_used``. Needed by ``training/initialize.py:_initialize_distributed``
   (``device_count() > 0`` gates ``mpu.initialize_model_parallel``), ``core/timers.py``,
   ``training/training.py:training_log``, DDP's communication streams.
   The memory functions return **0**: there is no CPU allocator statistic; measure memory
   with the torch profiler or a dispatch mode instead (this layer must not fake numbers).
4. CUDA RNG backed by the CPU default generator: ``torch.cuda.get_rng_state``/
   ``set_rng_state``/``manual_seed``/``manual_seed_all``/``seed``/``initial_seed`` and
   ``torch.cuda.default_generators``, plus megatron's ``_get_cuda_rng_state``/
   ``_set_cuda_rng_state`` (``core/tensor_parallel/random.py``; upstream's setter defers
   through ``torch.cuda._lazy_call``, which never runs on CPU, so ``CudaRNGStatesTracker.fork``
   would silently not switch states). On CPU, dropout draws from the CPU default generator,
   so backing the "CUDA" generator by that same generator makes ``fork()`` switch dropout
   to the tracker's state exactly as on GPU, and checkpoint save/restore of
   ``cuda_rng_state``/``rng_tracker_states`` (``training/checkpointing.py:get_rng_state``,
   ``load_checkpoint``) is exact. ``fork()`` logs "CPU RNG state changed within GPU RNG
   context" on every dropout under it (true by construction here); a logging filter drops
   exactly that record. RNG states are CPU generator states (5056 bytes), not CUDA ones
   (16 bytes): GPU checkpoints cannot resume in CPU mode and vice versa.
5. ``torch.accelerator.is_available()`` is False and ``current_accelerator()`` None, so
   ``torch.utils.data.DataLoader`` does not try to pin memory
   (``training/datasets/data_samplers.py`` passes ``pin_memory=True``).
6. Compilation off: ``torch.compile`` returns the function unchanged and
   ``torch._dynamo.config.disable`` is set. ``core/jit.py`` binds ``jit_fuser = torch.compile``
   at import; compiled fusions (bias-gelu, swiglu...) then run eagerly, bitwise repeatable.
7. ``megatron.core.datasets.utils.compile_helpers`` is a no-op: ``training/initialize.py:
   _compile_dependencies`` runs ``make`` in the dataset folder; the wheel ships the prebuilt
   ``helpers_cpp`` and the tree may be read-only.
8. DataLoader iterators do not consume CPU RNG draws: ``_BaseDataLoaderIter.__init__`` draws
   ``_base_seed`` from the default generator. Dropout shares that generator on CPU, so the
   extra draws when ``training.py:build_train_valid_test_data_iterators`` runs after a
   checkpoint's RNG state was restored would make a resumed run differ from a straight one.
   The draw still happens (worker seeds are unchanged) but the generator state is restored.
9. ``torch.distributed.all_gather`` on gloo with NCCL semantics: gloo rejects uneven sizes
   (pytorch #156627) while ``core/distributed/param_and_grad_buffer.py:start_param_sync``
   (layer-wise branch) and ``core/optimizer/layer_wise_optimizer.py:allgather_params`` gather
   per-rank flat params of different sizes. Each rank's slot is broadcast from its owner
   straight into the caller's output tensors: **zero bytes allocated** (gloo's own allgather
   flattens into a fresh ``world_size * numel`` buffer), so memory measured around a
   collective is the caller's alone. Zero-element slots are skipped: gloo aborts the process
   with SIGFPE on them (pytorch #85234). ``async_op=True`` returns a handle whose ``wait()``
   waits for every broadcast. Non-gloo groups go to the original function.

Usage::

    import harness.cpu_runtime as cpu_runtime
    cpu_runtime.install()          # before building megatron objects; ideally before import
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["install", "install_if_requested", "is_installed", "uninstall", "ENV_VAR"]

#: Environment variable read by ``install_if_requested``: "1" installs, "force" installs even
#: on a GPU machine, anything else (or unset) does nothing.
ENV_VAR = "MEGATRON_CPU_RUNTIME"

# The real probes, captured before anything can patch them (the guard must see real hardware).
_REAL_CUDA_IS_AVAILABLE: Callable[[], bool] = torch.cuda.is_available
_REAL_CUDA_DEVICE_COUNT: Callable[[], int] = torch.cuda.device_count

_CPU = torch.device("cpu")
_RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"

log = logging.getLogger(__name__)


class _Patch(NamedTuple):
    """One replaced attribute, so that ``uninstall`` can put it back."""

    owner: Any  # module or class whose attribute was replaced
    name: str
    original: Any  # _MISSING when the attribute did not exist


_MISSING = object()
# Every attribute replaced by install(), in order; uninstall() restores them in reverse.
_patches: List[_Patch] = []
# The pushed TorchFunctionMode (None when not installed).
_mode: Optional[TorchFunctionMode] = None
# The logging filter added to megatron's random logger (None when not installed).
_log_filter: Optional[logging.Filter] = None
_installed_items: List[str] = []


def _real_gpu_present() -> bool:
    """True when this process sees a real CUDA device (probes captured at module import)."""
    try:
        return bool(_REAL_CUDA_IS_AVAILABLE()) and int(_REAL_CUDA_DEVICE_COUNT()) > 0
    except Exception:  # a broken driver is not a usable GPU
        return False


def _set(owner: Any, name: str, value: Any) -> None:
    """Replace ``owner.name`` with ``value`` and remember the original for ``uninstall``."""
    if isinstance(owner, type):  # a class: restore only what it defined itself, not inherited
        original = owner.__dict__.get(name, _MISSING)
    else:
        original = getattr(owner, name, _MISSING)
    _patches.append(_Patch(owner, name, original))
    setattr(owner, name, value)


# --------------------------------------------------------------------------- 1. device mode
def _is_cuda_device(device: Any) -> bool:
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
    return _CPU if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU (item 1).

    Only arguments change; the called function and its results are the real ones.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            # Tensor.cuda(device=None, non_blocking=False, memory_format=...): already "there".
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0],) + tuple(_to_cpu_device(a) for a in args[1:])
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- 2. Tensor.type
_real_tensor_type = torch.Tensor.type


def _cpu_type_name(cuda_name: str) -> str:
    """'torch.cuda.BFloat16Tensor' -> 'torch.BFloat16Tensor' (other names unchanged)."""
    return "torch." + cuda_name[len("torch.cuda.") :] if cuda_name.startswith("torch.cuda.") else cuda_name


def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs):
    """``Tensor.type`` that names CPU tensors as CUDA ones (item 2).

    Returns:
        With no ``dtype``: ``str`` like ``'torch.cuda.FloatTensor'`` for a CPU float32 tensor.
        With ``dtype``: the converted tensor; CUDA type names/classes map to the CPU type.
    """
    if dtype is None and not kwargs:
        name = _real_tensor_type(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch.") :]
        return name
    if isinstance(dtype, str):
        dtype = _cpu_type_name(dtype)
    elif isinstance(dtype, type) and getattr(dtype, "__module__", "") == "torch.cuda":
        dtype = _cpu_type_name(f"torch.cuda.{dtype.__name__}")
    return _real_tensor_type(self, dtype, non_blocking, **kwargs)


# --------------------------------------------------------------------------- 3. torch.cuda stubs
class _Event:
    """Stand-in for ``torch.cuda.Event``: everything is already complete on CPU.

    ``elapsed_time`` returns milliseconds (float) between two ``record()`` calls, as CUDA does.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        self._t: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "_Event") -> float:
        if self._t is None or end_event._t is None:
            raise RuntimeError("cpu_runtime Event.elapsed_time: both events must be recorded first")
        return (end_event._t - self._t) * 1000.0


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: one ordered CPU timeline, all waits are no-ops."""

    cuda_stream = 0
    device = _CPU

    def __init__(self, device: Any = None, priority: int = 0, **kwargs):
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Optional[_Event] = None) -> _Event:
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_default_stream = _Stream()
_current_stream: List[_Stream] = [_default_stream]  # one-element box
_current_device: List[int] = [0]


def _set_stream(stream: Any) -> None:
    _current_stream[0] = stream if stream is not None else _default_stream


@contextlib.contextmanager
def _stream_ctx(stream: Any = None):
    """``torch.cuda.stream(s)``: make ``s`` current for the block (ordering is trivial on CPU)."""
    previous = _current_stream[0]
    if stream is not None:
        _current_stream[0] = stream
    try:
        yield stream
    finally:
        _current_stream[0] = previous


class _DeviceCtx:
    """``torch.cuda.device(i)``: a no-op context (one CPU "device")."""

    def __init__(self, device: Any = None):
        self.idx = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _set_device(device: Any) -> None:
    if isinstance(device, torch.device):
        device = device.index or 0
    elif isinstance(device, str):
        device = torch.device(device).index or 0
    _current_device[0] = int(device)


def _zero(*args, **kwargs) -> int:
    return 0


def _noop(*args, **kwargs) -> None:
    return None


def _memory_stats(device: Any = None) -> dict:
    """The keys ``training.py:training_log`` reads, all 0 (no CPU allocator statistics)."""
    keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "reserved_bytes.all.peak", "allocation.all.current", "allocation.all.peak")
    return {k: 0 for k in keys}


# --------------------------------------------------------------------------- 4. CUDA RNG on CPU
def _cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """``torch.cuda.get_rng_state``: a fresh uint8 CPU tensor (5056 bytes), the CPU generator state."""
    return torch.default_generator.get_state()


def _cuda_get_rng_state_all() -> List[torch.Tensor]:
    return [torch.default_generator.get_state()]


def _cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """``torch.cuda.set_rng_state``: sets the CPU generator now (no lazy call)."""
    torch.default_generator.set_state(new_state)


def _cuda_set_rng_state_all(new_states: Sequence[torch.Tensor]) -> None:
    torch.default_generator.set_state(new_states[0])


def _cuda_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cuda_seed() -> None:
    torch.default_generator.seed()


def _cuda_initial_seed() -> int:
    return torch.default_generator.initial_seed()


def _megatron_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """Replacement of ``core/tensor_parallel/random.py:_get_cuda_rng_state`` (same signature)."""
    if graph_safe:
        raise NotImplementedError("cpu_runtime: graph-safe (CUDA graph) RNG states do not exist on CPU")
    return torch.default_generator.get_state()


def _megatron_set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    """Replacement of ``core/tensor_parallel/random.py:_set_cuda_rng_state``: sets it now."""
    if graph_safe:
        raise NotImplementedError("cpu_runtime: graph-safe (CUDA graph) RNG states do not exist on CPU")
    torch.default_generator.set_state(new_state)


class _DropForkWarning(logging.Filter):
    """Drops megatron's per-dropout 'CPU RNG state changed within GPU RNG context' warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_FORK_WARNING not in str(record.msg)


# --------------------------------------------------------------------------- 6. no compilation
def _compile_passthrough(model: Any = None, **kwargs):
    """``torch.compile`` stand-in: returns ``model`` unchanged (also as ``@torch.compile(...)``)."""
    if model is None:
        return lambda fn: fn
    return model


# --------------------------------------------------------------------------- 8. DataLoader RNG
def _wrap_loader_iter_init(real_init: Callable) -> Callable:
    @functools.wraps(real_init)
    def __init__(self, loader, *args, **kwargs):
        state = torch.default_generator.get_state()
        try:
            real_init(self, loader, *args, **kwargs)
        finally:
            torch.default_generator.set_state(state)

    return __init__


# --------------------------------------------------------------------------- 9. uneven all_gather
class _GatherWork:
    """Work handle of an ``all_gather`` run as one async broadcast per non-empty slot.

    Mirrors the parts of ``torch.distributed.Work`` that megatron uses.
    """

    def __init__(self, works: List[Any]):
        # One gloo Work per broadcast slot; empty slots have none.
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def get_future(self):
        return torch.futures.collect_all([work.get_future() for work in self._works])


_real_all_gather = dist.all_gather


def _is_gloo(group: Any) -> bool:
    try:
        return "gloo" in str(dist.get_backend(group))
    except Exception:
        return False


def all_gather_by_broadcast(
    tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Optional[_GatherWork]:
    """``all_gather`` with NCCL semantics, as one broadcast per rank slot (item 9).

    Args:
        tensor_list: ``group_size`` contiguous CPU tensors, each of ``tensor.dtype``; slot ``r``
            receives rank ``r``'s input. Slot sizes may differ (uneven) or be 0; every rank must
            pass the same sizes, as with NCCL.
        tensor: this rank's contiguous input; ``numel`` must equal its own slot's. It may be
            that slot itself (same storage), then nothing is copied.
        group: process group (``None``: the default group).
        async_op: return a ``_GatherWork`` to ``wait()`` on instead of blocking.

    Returns:
        ``None`` when ``async_op`` is False, else a handle with ``wait()``.

    Raises:
        ValueError: wrong slot count, dtype, own-slot size, or a non-contiguous tensor (gloo
            needs contiguous buffers, and a staging copy would allocate). The message names
            the rank and the slot.

    Memory: allocates no tensor; rank ``r``'s slot is the broadcast buffer itself.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if len(tensor_list) != world:
        raise ValueError(f"all_gather: {rank=} got {len(tensor_list)} output slots for a group of {world}")
    for slot, out in enumerate(tensor_list):
        if out.dtype != tensor.dtype:
            raise ValueError(f"all_gather: {rank=} {slot=} dtype {out.dtype} != input dtype {tensor.dtype}")
        if not out.is_contiguous():
            raise ValueError(f"all_gather: {rank=} {slot=} output is not contiguous")
    own = tensor_list[rank]
    if own.numel() != tensor.numel():
        raise ValueError(f"all_gather: {rank=} own slot numel {own.numel()} != input numel {tensor.numel()}")
    if tensor.numel() and not tensor.is_contiguous():
        raise ValueError(f"all_gather: {rank=} input is not contiguous")

    works = []
    for slot, out in enumerate(tensor_list):
        if out.numel() == 0:  # gloo SIGFPE on empty tensors (pytorch #85234); nothing to send
            continue
        buf = tensor if slot == rank else out
        work = dist.broadcast(buf, group_src=slot, group=group, async_op=async_op)
        if async_op:
            works.append(work)
    if own.numel() and own.data_ptr() != tensor.data_ptr():
        own.view(-1).copy_(tensor.view(-1))  # views: no allocation
    return _GatherWork(works) if async_op else None


@functools.wraps(_real_all_gather)
def _all_gather(tensor_list, tensor, group=None, async_op=False):
    """``torch.distributed.all_gather``: gloo groups go through ``all_gather_by_broadcast``."""
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        return _real_all_gather(tensor_list, tensor, group=group, async_op=async_op)
    if _is_gloo(group) and tensor.device.type == "cpu":
        return all_gather_by_broadcast(tensor_list, tensor, group=group, async_op=async_op)
    return _real_all_gather(tensor_list, tensor, group=group, async_op=async_op)


# --------------------------------------------------------------------------- install
def _patch_torch() -> None:
    global _mode
    cuda = torch.cuda
    # 3. torch.cuda stubs
    for name, value in {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: _current_device[0],
        "set_device": _set_device,
        "device": _DeviceCtx,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: _current_stream[0],
        "default_stream": lambda device=None: _default_stream,
        "set_stream": _set_stream,
        "stream": _stream_ctx,
        "is_current_stream_capturing": lambda: False,
        "synchronize": _noop,
        "empty_cache": _noop,
        "memory_stats": _memory_stats,
        "memory_allocated": _zero,
        "max_memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_reserved": _zero,
        "reset_peak_memory_stats": _noop,
        "reset_max_memory_allocated": _noop,
        "device_memory_used": _zero,
        "get_device_name": lambda device=None: "cpu (harness.cpu_runtime)",
    }.items():
        _set(cuda, name, value)
    _set(torch.cuda.graphs, "is_current_stream_capturing", lambda: False)
    _installed_items.append("torch.cuda stubs")

    # 4. CUDA RNG on the CPU generator
    for owner in (cuda, cuda.random):
        _set(owner, "get_rng_state", _cuda_get_rng_state)
        _set(owner, "get_rng_state_all", _cuda_get_rng_state_all)
        _set(owner, "set_rng_state", _cuda_set_rng_state)
        _set(owner, "set_rng_state_all", _cuda_set_rng_state_all)
        _set(owner, "manual_seed", _cuda_manual_seed)
        _set(owner, "manual_seed_all", _cuda_manual_seed)
        _set(owner, "seed", _cuda_seed)
        _set(owner, "seed_all", _cuda_seed)
        _set(owner, "initial_seed", _cuda_initial_seed)
    _set(cuda, "default_generators", (torch.default_generator,))
    _installed_items.append("CUDA RNG on CPU generator")

    # 2. Tensor.type
    _set(torch.Tensor, "type", _tensor_type)
    _installed_items.append("Tensor.type cuda names")

    # 5. accelerator
    _set(torch.accelerator, "is_available", lambda: False)
    _set(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    _installed_items.append("torch.accelerator off")

    # 6. compilation off
    dynamo_config = importlib.import_module("torch._dynamo.config")
    _set(dynamo_config, "disable", True)
    _set(torch, "compile", _compile_passthrough)
    _installed_items.append("torch.compile/dynamo off")

    # 8. DataLoader iterators keep the CPU RNG state
    from torch.utils.data import dataloader as _dl

    _set(_dl._BaseDataLoaderIter, "__init__", _wrap_loader_iter_init(_dl._BaseDataLoaderIter.__init__))
    _installed_items.append("DataLoader iter keeps RNG")

    # 9. all_gather (both names: torch.distributed.X and distributed_c10d.X for internal callers)
    _set(dist, "all_gather", _all_gather)
    _set(dist.distributed_c10d, "all_gather", _all_gather)
    _installed_items.append("gloo all_gather by broadcast")

    # 1. device mapping, last so the patches above ran without it
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    _installed_items.append("cuda->cpu TorchFunctionMode")


def _patch_megatron() -> None:
    """Items 4 (megatron RNG helpers) and 7 (compile_helpers), on whichever tree imports."""
    global _log_filter
    try:
        import megatron.core.datasets.utils as ds_utils
        import megatron.core.tensor_parallel.random as mrandom
    except ImportError as exc:  # megatron not on the path: torch-level items still apply
        log.info("cpu_runtime: megatron not importable (%s); megatron items skipped", exc)
        return
    real_get, real_set = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
    # Rebind in every loaded megatron module that imported the helpers by name.
    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith("megatron"):
            continue
        if getattr(mod, "_get_cuda_rng_state", None) is real_get:
            _set(mod, "_get_cuda_rng_state", _megatron_get_cuda_rng_state)
        if getattr(mod, "_set_cuda_rng_state", None) is real_set:
            _set(mod, "_set_cuda_rng_state", _megatron_set_cuda_rng_state)
    _log_filter = _DropForkWarning()
    logging.getLogger(mrandom.__name__).addFilter(_log_filter)
    _set(ds_utils, "compile_helpers", _noop)
    _installed_items.append(f"megatron RNG helpers + compile_helpers ({os.path.dirname(mrandom.__file__)})")


def install(force: bool = False) -> None:
    """Install the CPU runtime layer in this process (idempotent).

    Args:
        force: install even when a real CUDA GPU is present (e.g. to compare CPU runs on a
            GPU machine). Without it, a present GPU raises.

    Raises:
        RuntimeError: a real GPU is present and ``force`` is False. Nothing was patched.
    """
    if not force and _real_gpu_present():
        raise RuntimeError(
            "harness.cpu_runtime refuses to install: a real CUDA GPU is present "
            f"({_REAL_CUDA_DEVICE_COUNT()} device(s)). The CPU runtime would silently move all "
            f"work to CPU. Unset {ENV_VAR} to train on the GPU, or call install(force=True) / "
            f"set {ENV_VAR}=force to run on CPU anyway."
        )
    if is_installed():
        return
    _patch_torch()
    _patch_megatron()


def install_if_requested() -> bool:
    """Install when env ``MEGATRON_CPU_RUNTIME`` is ``1`` (or ``force``); return whether installed.

    Raises:
        RuntimeError: requested with ``1`` on a machine with a real GPU (see ``install``).
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("1", "true", "yes", "force"):
        install(force=value == "force")
        return True
    return False


def is_installed() -> bool:
    """True once ``install`` has patched this process (until ``uninstall``)."""
    return _mode is not None


def installed_items() -> List[str]:
    """Names of the installed items, for start-up logs."""
    return list(_installed_items)


def uninstall() -> None:
    """Undo ``install`` (for tests): pop the mode, restore every attribute, drop the filter."""
    global _mode, _log_filter
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    for patch in reversed(_patches):
        if patch.original is _MISSING:
            delattr(patch.owner, patch.name)
        else:
            setattr(patch.owner, patch.name, patch.original)
    _patches.clear()
    if _log_filter is not None:
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_log_filter)
        _log_filter = None
    _installed_items.clear()
