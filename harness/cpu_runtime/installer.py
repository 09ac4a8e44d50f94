"""Install and uninstall the CPU runtime layer: the order of the items and the GPU guard.

``install`` refuses (``RuntimeError``) when a real CUDA GPU is present, unless ``force``.
The probe uses ``torch.cuda.is_available``/``device_count`` captured when this module was
imported, and runs before anything is patched, so a refused install changes nothing.

Invariants: ``install`` is idempotent; every attribute goes through
``patching.replace``, so ``uninstall`` restores the process exactly (used by tests). The
device-mapping mode is pushed last, so that installing runs without it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, List, Optional

import torch

from harness.cpu_runtime import collectives, compilation, cuda_stubs, device, p2p, rng
from harness.cpu_runtime.patching import replace, restore_all

#: Environment variable read by ``install_if_requested``: "1" installs, "force" installs even
#: on a GPU machine, anything else (or unset) does nothing.
ENV_VAR = "MEGATRON_CPU_RUNTIME"

# The real probes, captured before anything can patch them (the guard must see real hardware).
_REAL_CUDA_IS_AVAILABLE: Callable[[], bool] = torch.cuda.is_available
_REAL_CUDA_DEVICE_COUNT: Callable[[], int] = torch.cuda.device_count

log = logging.getLogger("harness.cpu_runtime")

_installed_items: List[str] = []
# The filter added to megatron's random logger (None when not installed).
_log_filter: Optional[logging.Filter] = None


def real_gpu_present() -> bool:
    """True when this process sees a real CUDA device (probes captured at import)."""
    try:
        return bool(_REAL_CUDA_IS_AVAILABLE()) and int(_REAL_CUDA_DEVICE_COUNT()) > 0
    except Exception:  # a broken driver is not a usable GPU
        return False


def _patch_torch() -> None:
    cuda = torch.cuda
    for name, value in cuda_stubs.stubs().items():
        replace(cuda, name, value)
    replace(torch.cuda.graphs, "is_current_stream_capturing", lambda: False)
    _installed_items.append("torch.cuda stubs")

    for owner in (cuda, cuda.random):
        for name, value in rng.torch_cuda_rng().items():
            replace(owner, name, value)
    replace(cuda, "default_generators", (torch.default_generator,))
    _installed_items.append("CUDA RNG on CPU generator")

    replace(torch.Tensor, "type", device.tensor_type)
    _installed_items.append("Tensor.type cuda names")

    for name, value in cuda_stubs.accelerator_stubs().items():
        replace(torch.accelerator, name, value)
    _installed_items.append("torch.accelerator off")

    _disable_dynamo()
    replace(torch, "compile", compilation.compile_passthrough)
    _installed_items.append("torch.compile/dynamo off")

    from torch.utils.data import dataloader as _dl

    replace(_dl._BaseDataLoaderIter, "__init__", rng.wrap_loader_iter_init(_dl._BaseDataLoaderIter.__init__))
    _installed_items.append("DataLoader iter keeps RNG")

    collectives.install(replace)
    _installed_items.append("all-gather collective model (ProcessGroupNCCL semantics on gloo)")

    p2p.install(replace)
    _installed_items.append("p2p sends keep their storage until complete (NCCL allocator semantics)")

    device.enter_mode()
    _installed_items.append("cuda->cpu TorchFunctionMode")


def _patch_megatron() -> None:
    """megatron's RNG helpers and compile_helpers, on whichever tree is importable."""
    global _log_filter
    try:
        import megatron.core.datasets.utils as ds_utils
        import megatron.core.tensor_parallel.random as mrandom
    except ImportError as exc:  # megatron not on the path: the torch-level items still apply
        log.info("cpu_runtime: megatron not importable (%s); megatron items skipped", exc)
        return
    real_get, real_set = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
    # Rebind in every loaded megatron module that imported the helpers by name.
    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith("megatron"):
            continue
        if getattr(mod, "_get_cuda_rng_state", None) is real_get:
            replace(mod, "_get_cuda_rng_state", rng.megatron_get_cuda_rng_state)
        if getattr(mod, "_set_cuda_rng_state", None) is real_set:
            replace(mod, "_set_cuda_rng_state", rng.megatron_set_cuda_rng_state)
    _log_filter = rng.DropForkWarning()
    logging.getLogger(mrandom.__name__).addFilter(_log_filter)
    replace(ds_utils, "compile_helpers", cuda_stubs.noop)
    _installed_items.append(f"megatron RNG helpers + compile_helpers ({os.path.dirname(mrandom.__file__)})")
    try:
        import megatron.core.transformer.moe.moe_utils as moe_utils
    except ImportError as exc:
        log.info("cpu_runtime: megatron's moe_utils not importable (%s); MoE item skipped", exc)
        return
    real_move = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if real_move is not None:
        # token_dispatcher.py imports it by name: rebind there too if already loaded.
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("megatron") and getattr(mod, "maybe_move_tensor_to_cpu", None) is real_move:
                replace(mod, "maybe_move_tensor_to_cpu", cuda_stubs.moe_tensor_to_host)
        _installed_items.append("MoE split sizes to the host as from CUDA (maybe_move_tensor_to_cpu)")


#: Environment variables set by install, with their values before it (None: unset).
_env_before: dict = {}


def _disable_dynamo() -> None:
    """``torch._dynamo.config.disable``: set on the module if it is imported, else through
    ``TORCH_COMPILE_DISABLE=1``, which the module reads when first imported (importing
    torch._dynamo here would cost each rank about 1.4 s of CPU; megatron never imports it
    once ``torch.compile`` is the passthrough)."""
    config = sys.modules.get("torch._dynamo.config")
    if config is not None:
        replace(config, "disable", True)
    else:
        _env_before.setdefault("TORCH_COMPILE_DISABLE", os.environ.get("TORCH_COMPILE_DISABLE"))
        os.environ["TORCH_COMPILE_DISABLE"] = "1"


def install(force: bool = False) -> None:
    """Install the CPU runtime layer in this process (idempotent).

    Args:
        force: install even when a real CUDA GPU is present (e.g. to compare CPU runs on a
            GPU machine). Without it, a present GPU raises.

    Raises:
        RuntimeError: a real GPU is present and ``force`` is False. Nothing was patched.
    """
    if not force and real_gpu_present():
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
    return device.mode_active()


def installed_items() -> List[str]:
    """Names of the installed items, for start-up logs."""
    return list(_installed_items)


def uninstall() -> None:
    """Undo ``install`` (for tests): pop the mode, restore every attribute, drop the filter."""
    global _log_filter
    if not is_installed():
        return
    device.exit_mode()
    restore_all()
    for name, value in _env_before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _env_before.clear()
    p2p.clear()
    if _log_filter is not None:
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_log_filter)
        _log_filter = None
    _installed_items.clear()
