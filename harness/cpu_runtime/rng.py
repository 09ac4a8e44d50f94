"""The CUDA RNG API backed by the CPU default generator, and DataLoaders that keep it.

On CPU, dropout draws from the CPU default generator. Backing the "CUDA" generator by that
same generator makes ``CudaRNGStatesTracker.fork()`` (``core/tensor_parallel/random.py``)
switch dropout to the tracker's state exactly as on GPU, and checkpoint save/restore of
``cuda_rng_state``/``rng_tracker_states`` (``training/checkpointing.py:get_rng_state``,
``load_checkpoint``) exact.

* ``torch_cuda_rng()``: ``torch.cuda`` (and ``torch.cuda.random``) ``get_rng_state``/
  ``set_rng_state`` (+ ``_all``), ``manual_seed`` (+ ``_all``), ``seed`` (+ ``_all``),
  ``initial_seed``.
* ``megatron_get_cuda_rng_state``/``megatron_set_cuda_rng_state``: replace megatron's
  ``_get_cuda_rng_state``/``_set_cuda_rng_state``. Upstream's setter defers through
  ``torch.cuda._lazy_call``, which never runs on CPU, so ``fork()`` would silently not
  switch states.
* ``DropForkWarning``: ``fork()`` logs "CPU RNG state changed within GPU RNG context" on
  every dropout under it (true by construction here); the filter drops exactly that record.
* ``wrap_loader_iter_init``: ``_BaseDataLoaderIter.__init__`` draws ``_base_seed`` from the
  default generator; after a checkpoint's RNG state was restored, that extra draw
  (``training.py:build_train_valid_test_data_iterators``) would make a resumed run differ
  from a straight one. The draw still happens (worker seeds are unchanged) and the generator
  state is restored after it.

Units: RNG states are CPU generator states (uint8 tensors of 5056 bytes), not CUDA ones (16
bytes): GPU checkpoints cannot resume in CPU mode and vice versa.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, List, Sequence

import torch

RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _get_rng_state_all() -> List[torch.Tensor]:
    return [torch.default_generator.get_state()]


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)  # now, no lazy call


def _set_rng_state_all(new_states: Sequence[torch.Tensor]) -> None:
    torch.default_generator.set_state(new_states[0])


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _seed() -> None:
    torch.default_generator.seed()


def _initial_seed() -> int:
    return torch.default_generator.initial_seed()


def torch_cuda_rng() -> Dict[str, Callable]:
    """``torch.cuda`` / ``torch.cuda.random`` RNG attribute name -> CPU-generator replacement."""
    return {
        "get_rng_state": _get_rng_state,
        "get_rng_state_all": _get_rng_state_all,
        "set_rng_state": _set_rng_state,
        "set_rng_state_all": _set_rng_state_all,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed,
        "seed": _seed,
        "seed_all": _seed,
        "initial_seed": _initial_seed,
    }


def megatron_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """Replacement of ``core/tensor_parallel/random.py:_get_cuda_rng_state`` (same signature).

    Raises:
        NotImplementedError: ``graph_safe`` (CUDA-graph RNG states do not exist on CPU).
    """
    if graph_safe:
        raise NotImplementedError("cpu_runtime: graph-safe (CUDA graph) RNG states do not exist on CPU")
    return torch.default_generator.get_state()


def megatron_set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    """Replacement of ``core/tensor_parallel/random.py:_set_cuda_rng_state``: sets it now.

    Raises:
        NotImplementedError: ``graph_safe``.
    """
    if graph_safe:
        raise NotImplementedError("cpu_runtime: graph-safe (CUDA graph) RNG states do not exist on CPU")
    torch.default_generator.set_state(new_state)


class DropForkWarning(logging.Filter):
    """Drops megatron's per-dropout 'CPU RNG state changed within GPU RNG context' warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return RNG_FORK_WARNING not in str(record.msg)


def wrap_loader_iter_init(real_init: Callable) -> Callable:
    """``_BaseDataLoaderIter.__init__`` that leaves the CPU generator state as it found it."""

    @functools.wraps(real_init)
    def __init__(self, loader, *args, **kwargs):
        state = torch.default_generator.get_state()
        try:
            real_init(self, loader, *args, **kwargs)
        finally:
            torch.default_generator.set_state(state)

    return __init__
