"""Rank-side set-up for gloo ranks on CUDA: two ranks sharing one GPU.

Several ranks on one GPU need what megatron does not do by itself: for gloo and NCCL alike,
``LOCAL_RANK`` modulo the device count (below); for NCCL, a distinct ``NCCL_HOSTID`` per rank
(``share_device`` sets ``<host>-rank<LOCAL_RANK>``): NCCL refuses two ranks of one host on one
device ("Duplicate GPU detected"), and with distinct host ids it connects them through its
socket transport (``NET/Socket``; the launch sets ``NCCL_SOCKET_IFNAME=lo``), as ranks of
different hosts. That runs NCCL's own collectives and allocations on real CUDA memory, not
its intra-node transports (no NVLink, no P2P, no shared memory). For gloo ranks, three things:

* ``LOCAL_RANK`` modulo the device count. ``training/initialize.py:_initialize_distributed``
  calls ``torch.cuda.set_device(args.local_rank)``, and ``args.local_rank`` defaults to
  ``$LOCAL_RANK`` (``training/config/common_config.py``): rank 1 of two would ask for
  ``cuda:1``. ``share_device`` rewrites the variable before megatron parses its arguments.
* All-gathers with NCCL's semantics on gloo. Gloo rejects list slots of different sizes
  (CPU and CUDA tensors alike), while ``core/distributed/param_and_grad_buffer.py:
  start_param_sync`` (layer-wise branch) gathers per-rank shares of different sizes. The
  all-gathers go through ``harness.cpu_runtime.collectives``, the one collective model: on
  gloo it broadcasts each slot straight into the caller's buffers (gloo's CUDA broadcast
  stages through host memory) and allocates, on the GPU, exactly the temporaries
  ProcessGroupNCCL would; on NCCL it records the call and lets torch run it. So the CUDA
  memory a gloo run measures includes what NCCL would add, and
  ``collectives.record_collectives()`` says which call forms ran.
* Coalesced all-reduces on gloo. DDP's grad sync (``param_and_grad_buffer.py:
  start_grad_sync``) issues its per-bucket ``all_reduce`` calls inside
  ``torch.distributed._coalescing_manager``, which ends in
  ``ProcessGroupGloo::allreduce_coalesced``: CPU tensors only ("unsupported device type").
  For gloo groups the manager is replaced: calls are captured as torch captures them
  (``_world.pg_coalesce_state``), and on exit each captured ``all_reduce`` /
  ``reduce_scatter_tensor`` runs on its own; the handle waits for all of them. The sums are
  the same ones. Calls that run at once inside a coalescing block (the model's all-gathers)
  are done when the block ends. NCCL groups keep torch's manager, and so do blocks with a
  ``device`` (broadcasts grouped into one NCCL group): the collective model runs those. megatron binds the name at
  import; modules imported earlier are rebound.

``harness/upstream_pretrain_gpt.py`` calls ``install_if_requested()``, which acts when
``MEGATRON_SHARED_GPU=1``; the GPU check's memory worker calls ``install_collectives()``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
from typing import Any, List

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from harness.cpu_runtime import collectives

#: "1": ``install_if_requested`` installs (several gloo ranks may share one GPU).
ENV_VAR = "MEGATRON_SHARED_GPU"

_replaced: List[tuple] = []  # (owner, name, original), for uninstall
_state = {"installed": False}


class CollectedWork:
    """Handle of one gloo ``_coalescing_manager`` block: ``wait()`` waits for each of its
    collectives in issue order (what megatron's ``finish_grad_sync`` calls)."""

    def __init__(self):
        self.works: List[Any] = []

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        return True


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group this rank is not in
        return "unknown"


def _replay(op: Any, group: Any) -> Any:
    """Run one collective that a coalescing block captured, on its own, async."""
    name = getattr(op.op, "__name__", "")
    if name == "all_reduce":
        return dist.all_reduce(op.tensor, op=op.redop, group=group, async_op=True)
    if name == "reduce_scatter_tensor":
        return dist.reduce_scatter_tensor(op.dst_tensor, op.tensor, op=op.redop, group=group, async_op=True)
    raise NotImplementedError(f"gloo coalescing block: cannot replay a captured {name or op.op!r}")


def _wrap_coalescing_manager(real):
    @contextlib.contextmanager
    @functools.wraps(real)
    def _coalescing_manager(group=None, device=None, async_ops=False):
        if "gloo" not in _backend(group) or device is not None:
            # NCCL groups; and device blocks (broadcasts grouped into one NCCL group), which
            # the collective model runs on gloo.
            with real(group, device, async_ops) as cm:
                yield cm
            return
        pg = group if group is not None else c10d._get_default_group()
        if c10d._world.pg_coalesce_state.setdefault(pg, []):
            raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
        block = CollectedWork()
        try:
            yield block
        finally:
            captured = c10d._world.pg_coalesce_state.pop(pg, [])
        block.works = [_replay(op, pg) for op in captured]
        if not async_ops:
            block.wait()

    return _coalescing_manager


def share_device() -> None:
    """Rewrite ``LOCAL_RANK`` to ``LOCAL_RANK`` modulo the device count and give this rank its own
    ``NCCL_HOSTID``, ``<base>-rank<LOCAL_RANK>`` (``base``: the inherited ``NCCL_HOSTID``, else
    the host name; NCCL reads it when the rank's first communicator is created). Call before
    megatron is imported and parses its arguments.

    Raises:
        RuntimeError: no CUDA GPU (this set-up is for CUDA ranks only).
    """
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if count < 1:
        raise RuntimeError(f"{ENV_VAR}=1 needs a CUDA GPU (torch.cuda.device_count() is {count}); "
                           "for CPU ranks use MEGATRON_CPU_RUNTIME=1 instead")
    os.environ["LOCAL_RANK"] = str(local % count)
    os.environ["NCCL_HOSTID"] = f"{os.environ.get('NCCL_HOSTID') or socket.gethostname()}-rank{local}"


def _replace(owner: Any, name: str, value: Any) -> None:
    _replaced.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def install_collectives() -> None:
    """The collective model for all-gathers (unless the CPU runtime layer installed it) and
    the gloo coalescing manager (see the module docstring). Works without a GPU. Idempotent."""
    if _state["installed"]:
        return
    if not collectives.model_installed():
        collectives.install(_replace)
    real_cm = c10d._coalescing_manager
    wrapped = _wrap_coalescing_manager(real_cm)
    _replace(dist, "_coalescing_manager", wrapped)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron") and getattr(mod, "_coalescing_manager", None) is real_cm:
            _replace(mod, "_coalescing_manager", wrapped)
    _state["installed"] = True


def uninstall() -> None:
    """Restore every replaced function (tests). ``LOCAL_RANK`` is left as is."""
    for owner, name, original in reversed(_replaced):
        setattr(owner, name, original)
    _replaced.clear()
    _state["installed"] = False


def install_if_requested() -> bool:
    """When ``$MEGATRON_SHARED_GPU`` is "1": ``share_device()`` (once) and
    ``install_collectives()``; returns whether it acted. Idempotent."""
    if os.environ.get(ENV_VAR) != "1":
        return False
    if not _state["installed"]:
        share_device()
    install_collectives()
    return True
