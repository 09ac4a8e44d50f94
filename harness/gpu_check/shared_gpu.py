"""Rank-side set-up for gloo ranks on CUDA, and a record of param all-gather call forms.

Two ranks on one GPU need two things megatron does not do by itself:

* ``LOCAL_RANK`` modulo the device count. ``training/initialize.py:_initialize_distributed``
  calls ``torch.cuda.set_device(args.local_rank)``, and ``args.local_rank`` defaults to
  ``$LOCAL_RANK`` (``training/config/common_config.py``): rank 1 of two would ask for
  ``cuda:1``. ``install`` rewrites the variable before megatron parses its arguments.
* An uneven ``torch.distributed.all_gather`` on gloo. Gloo rejects slots of different sizes
  on CPU and CUDA tensors alike, while ``core/distributed/param_and_grad_buffer.py:
  start_param_sync`` (layer-wise branch) gathers per-rank shares of different sizes. gloo
  groups go through ``harness.cpu_runtime.collectives.all_gather`` (one broadcast per slot,
  straight into the caller's output; gloo's CUDA broadcast stages through host memory).
  NCCL groups go to torch unchanged.

Both all-gather entry points are also recorded (``CALLS``): per call the form ("list" or
"into_tensor"), group size, slot sizes, element size and device, and the bytes that
``ProcessGroupNCCL::allgather`` would allocate for it: with equal slot sizes the list form
gathers into one flat ``world_size x numel`` output from the CUDA caching allocator and
copies the slices out; with different sizes it runs one broadcast per rank (no temporary);
``all_gather_into_tensor`` writes into the caller's output (no temporary).

Enabled in a rank by ``install()``; ``harness/pretrain_gpt.py`` calls
``install_if_requested()``, which acts when ``MEGATRON_SHARED_GPU=1``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from typing import Any, List, Sequence

import torch
import torch.distributed as dist

#: "1": ``install_if_requested`` installs (several gloo ranks may share one GPU).
ENV_VAR = "MEGATRON_SHARED_GPU"

_state = {"installed": False, "real": {}}


@dataclass
class GatherCall:
    """One all-gather call as a rank issued it.

    Attributes:
        form: "list" (``all_gather``) or "into_tensor" (``all_gather_into_tensor``).
        backend: the group's backend name ("gloo", "nccl", ...).
        world: group size.
        slot_numels: elements per rank slot (list form) or the input numel repeated.
        itemsize: bytes per element.
        device: "cuda" or "cpu".
    """

    form: str
    backend: str
    world: int
    slot_numels: List[int]
    itemsize: int
    device: str

    @property
    def shares_equal(self) -> bool:
        return len(set(self.slot_numels)) <= 1

    @property
    def nccl_temporary_bytes(self) -> int:
        """Bytes ProcessGroupNCCL would allocate for this call (see the module docstring)."""
        if self.form == "list" and self.shares_equal:
            return self.world * (self.slot_numels[0] if self.slot_numels else 0) * self.itemsize
        return 0

    def as_dict(self) -> dict:
        return {**asdict(self), "shares_equal": self.shares_equal,
                "nccl_temporary_bytes": self.nccl_temporary_bytes}


#: Calls recorded since the last ``CALLS.clear()`` (this process only).
CALLS: List[GatherCall] = []


def summarize_calls(calls: Sequence[GatherCall]) -> dict:
    """Counts and bytes of ``calls``: {calls, list_equal, list_unequal, into_tensor,
    received_bytes (sum of all slots), nccl_temporary_bytes}."""
    return {
        "calls": len(calls),
        "list_equal": sum(c.form == "list" and c.shares_equal for c in calls),
        "list_unequal": sum(c.form == "list" and not c.shares_equal for c in calls),
        "into_tensor": sum(c.form == "into_tensor" for c in calls),
        "received_bytes": sum(sum(c.slot_numels) * c.itemsize for c in calls),
        "nccl_temporary_bytes": sum(c.nccl_temporary_bytes for c in calls),
    }


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - a group this rank is not in
        return "unknown"


def _wrap_all_gather(real):
    from harness.cpu_runtime.collectives import all_gather as all_gather_by_broadcast

    @functools.wraps(real)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
            return real(tensor_list, tensor, group=group, async_op=async_op)
        backend = _backend(group)
        CALLS.append(GatherCall("list", backend, len(tensor_list), [t.numel() for t in tensor_list],
                                tensor.element_size(), tensor.device.type))
        if "gloo" in backend:
            return all_gather_by_broadcast(tensor_list, tensor, group=group, async_op=async_op)
        return real(tensor_list, tensor, group=group, async_op=async_op)

    return all_gather


def _wrap_into_tensor(real):
    @functools.wraps(real)
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if group is None or group != dist.GroupMember.NON_GROUP_MEMBER:
            world = dist.get_world_size(group)
            CALLS.append(GatherCall("into_tensor", _backend(group), world, [input_tensor.numel()] * world,
                                    input_tensor.element_size(), input_tensor.device.type))
        return real(output_tensor, input_tensor, group=group, async_op=async_op)

    return all_gather_into_tensor


def shared_local_rank(local_rank: int, device_count: int) -> int:
    """The CUDA device index of ``local_rank`` when ranks share ``device_count`` GPUs.

    Raises:
        RuntimeError: ``device_count`` < 1 (no GPU: this set-up is for CUDA ranks only).
    """
    if device_count < 1:
        raise RuntimeError(
            f"{ENV_VAR}=1 needs a CUDA GPU (torch.cuda.device_count() is {device_count}); "
            "for CPU ranks use MEGATRON_CPU_RUNTIME=1 instead")
    return local_rank % device_count


def install() -> None:
    """Rewrite ``LOCAL_RANK`` for a shared GPU and wrap both all-gather entry points.

    Idempotent. Call before megatron parses its arguments.

    Raises:
        RuntimeError: no CUDA GPU.
    """
    if _state["installed"]:
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["LOCAL_RANK"] = str(shared_local_rank(local, torch.cuda.device_count()))
    record_gathers()


def record_gathers() -> None:
    """Wrap ``all_gather`` / ``all_gather_into_tensor`` (both names torch exposes) so that
    every call lands in ``CALLS``; gloo list gathers go through the uneven broadcast form.
    Works without a GPU (the memory worker records on CPU ranks too). Idempotent."""
    if _state["real"]:
        _state["installed"] = True
        return
    for name, wrap in (("all_gather", _wrap_all_gather), ("all_gather_into_tensor", _wrap_into_tensor)):
        real = getattr(dist.distributed_c10d, name)
        _state["real"][name] = real
        wrapped = wrap(real)
        setattr(dist, name, wrapped)
        setattr(dist.distributed_c10d, name, wrapped)
    _state["installed"] = True


def uninstall() -> None:
    """Restore the original all-gather functions (tests). ``LOCAL_RANK`` is left as is."""
    for name, real in _state["real"].items():
        setattr(dist, name, real)
        setattr(dist.distributed_c10d, name, real)
    _state["real"] = {}
    _state["installed"] = False
    CALLS.clear()


def install_if_requested() -> bool:
    """``install()`` when ``$MEGATRON_SHARED_GPU`` is "1"; returns whether it installed."""
    if os.environ.get(ENV_VAR) == "1":
        install()
        return True
    return False
