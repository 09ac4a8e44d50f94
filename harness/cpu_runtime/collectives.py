"""The all-gather collective model: what ProcessGroupNCCL allocates and launches, run on gloo.

One model serves the unit tests, the functional runs and the bench. It replaces
``torch.distributed.all_gather``, ``all_gather_into_tensor`` and ``_all_gather_base`` (both
the ``torch.distributed`` and the ``distributed_c10d`` names). For each call it

1. allocates, through torch, every temporary that ProcessGroupNCCL would allocate, so that
   ``harness.alloc_counter`` and the torch profiler see it on CPU as the CUDA caching
   allocator would on a GPU;
2. moves the data with gloo broadcasts, one per non-empty rank slot, straight into the
   destination: the CPU execution itself allocates nothing (gloo's own allgather flattens
   into a fresh ``world x numel`` buffer in C++, which would hide or fake the difference);
3. appends a ``CollectiveRecord`` (form, modelled NCCL temporary bytes, NCCL calls, bytes
   received) to every active ``record_collectives()`` list.

Per call form (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, torch 2.x):

=========================  ===================================  ==================  =====  ========
call                       ProcessGroupNCCL                     NCCL temporary      ops    launches
=========================  ===================================  ==================  =====  ========
all_gather, equal shapes   ``allgather``: ``newLikeFlat`` flat  world x numel x     1      1
                           output, one ``ncclAllGather`` into   itemsize bytes
                           it, then ``copy_`` of each slice
                           into the list (on the NCCL stream)
all_gather, unequal        ``allgather``: ``startCoalescing``,  0                   world  1
                           one ``_broadcast_oop`` per rank      (zero-size slots
                           (root i into every ``list[i]``),     included)
                           ``endCoalescing``
all_gather_into_tensor /   ``_allgather_base``: one             0                   1      1
_all_gather_base           ``ncclAllGather`` straight into the
                           output (inside ``_coalescing_manager``:
                           ``allgather_into_tensor_coalesced``,
                           one launch for the manager)
broadcast                  ``broadcast``: one ``ncclBroadcast`` 0                   1      1
                           in place; inside
                           ``_coalescing_manager(group, device)``
                           (``startCoalescing`` ..
                           ``endCoalescing``) one NCCL group,
                           one launch for the manager
=========================  ===================================  ==================  =====  ========

*ops* are NCCL collective calls (``ncclAllGather`` / ``ncclBroadcast``), *zero-size ops* those of
them that move no byte (NCCL still issues them), *launches* NCCL group launches: every call is
one, except that the calls made inside one ``_coalescing_manager`` block share one (each record
carries its ``launch_id``; ``summarize()`` counts distinct ids).

Units: bytes and element counts are per rank. ``wire_bytes`` is what this rank receives from
the other ranks (every slot but its own; padding included, since padded slots travel).

Invariants:
- The destination tensors are written only after the gather completed: for the flat form
  by the slice copies, which run in ``wait()`` of an async handle (the temporary stays
  alive until then, as NCCL stashes it on the work object).
- Zero-element slots are not broadcast: gloo aborts the process on empty tensors
  (pytorch #85234). NCCL still gets a (zero-byte) call for them; the record counts it.
- Inside ``torch.distributed._coalescing_manager`` without ``device`` (the fast path of
  ``all_gather_into_tensor``) a call runs to completion at once and returns a completed
  handle; the manager's own ``wait()`` then has nothing left to do. With ``device`` (how a
  caller groups broadcasts into one NCCL group) gloo has no ``startCoalescing``: the model
  replaces the manager for gloo and fake groups, runs each broadcast as an async gloo work
  and hands them to the manager, whose ``wait()`` (async) or exit (sync) waits on them all.
- Under ``defer_async_completion()`` an async call moves no data until its own handle's
  ``wait()``: the latest completion c10d allows (see there).
- Calls on gloo groups run as described on any device (gloo stages CUDA tensors through
  host memory; the flat temporary is allocated on the tensors' device, so on a GPU the
  CUDA caching allocator sees it). Calls on the "fake" test backend run the same way
  without moving data. Calls on other backends (NCCL) are recorded and passed to torch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

FORM_LIST_EQUAL = "all_gather/equal"
FORM_LIST_UNEQUAL = "all_gather/unequal"
FORM_INTO_TENSOR = "all_gather_into_tensor"
FORM_BROADCAST = "broadcast"


@dataclass(frozen=True)
class CollectiveRecord:
    """One modelled all-gather call on one rank (see the module docstring's table).

    Attributes:
        form: ``FORM_LIST_EQUAL``, ``FORM_LIST_UNEQUAL``, ``FORM_INTO_TENSOR`` or
            ``FORM_BROADCAST``.
        nccl_function: the ProcessGroupNCCL path it mirrors.
        rank, world: this rank within the call's group, and the group size.
        dtype: e.g. ``"torch.bfloat16"``.
        slot_numels: elements per rank slot (the list entries, or ``world`` equal chunks);
            for a broadcast, the one tensor's numel.
        nccl_temporary_bytes: bytes ProcessGroupNCCL allocates for the call.
        ops: NCCL collective calls issued (``ncclAllGather`` or ``ncclBroadcast``).
        zero_size_ops: of those, the ones that move no byte.
        wire_bytes: bytes this rank receives from the other ranks.
        async_op: the caller asked for a work handle.
        coalesced: issued inside ``_coalescing_manager``.
        launch_id: records with the same id went to NCCL as one group launch.
        src: group rank of a broadcast's root (None for the all-gathers).
    """

    form: str
    nccl_function: str
    rank: int
    world: int
    dtype: str
    slot_numels: Tuple[int, ...]
    nccl_temporary_bytes: int
    ops: int
    zero_size_ops: int
    wire_bytes: int
    async_op: bool
    coalesced: bool
    launch_id: int = -1
    src: Optional[int] = None

    def as_dict(self) -> Dict[str, Any]:
        """JSON-ready fields (``slot_numels`` as a list)."""
        d = asdict(self)
        d["slot_numels"] = list(self.slot_numels)
        return d


def model_call(form: str, slot_numels: Sequence[int], rank: int, dtype: torch.dtype,
               *, async_op: bool = False, coalesced: bool = False, launch_id: Optional[int] = None,
               world: Optional[int] = None, src: Optional[int] = None) -> CollectiveRecord:
    """The record of one call, from shapes alone (no tensor is touched).

    Args:
        form: one of the ``FORM_*`` names.
        slot_numels: elements per rank slot, in rank order (``len`` = world size); for
            ``FORM_BROADCAST`` the one tensor's numel, as a 1-sequence.
        rank: this rank in the group.
        dtype: element type of the slots.
        launch_id: the NCCL group launch the call belongs to (see ``summarize``); None: a
            launch of its own.
        world, src: group size and root's group rank, for ``FORM_BROADCAST`` only.

    Raises:
        ValueError: unknown form, ``rank`` (or ``src``) outside the group, or a broadcast
            without ``world`` and ``src``.
    """
    itemsize = dtype.itemsize
    if launch_id is None:
        launch_id = next(_launch_ids)
    if form == FORM_BROADCAST:
        if world is None or src is None or len(slot_numels) != 1:
            raise ValueError("collective model: a broadcast record needs world, src and one numel")
        if not (0 <= rank < world and 0 <= src < world):
            raise ValueError(f"collective model: {rank=} or {src=} outside a group of {world}")
        n = int(slot_numels[0])
        return CollectiveRecord(form, "ProcessGroupNCCL::broadcast (ncclBroadcast)", rank, world,
                                str(dtype), (n,), 0, 1, int(n == 0), 0 if rank == src else n * itemsize,
                                bool(async_op), bool(coalesced), launch_id, src)
    world = len(slot_numels)
    if not 0 <= rank < world:
        raise ValueError(f"collective model: {rank=} outside a group of {world}")
    received = sum(n for r, n in enumerate(slot_numels) if r != rank) * itemsize
    if form == FORM_LIST_EQUAL:
        fn, temp, ops = "ProcessGroupNCCL::allgather (newLikeFlat + ncclAllGather + copy_)", \
            world * slot_numels[0] * itemsize, 1
        zero = int(slot_numels[0] == 0)
    elif form == FORM_LIST_UNEQUAL:
        fn, temp, ops = "ProcessGroupNCCL::allgather (coalesced _broadcast_oop per rank)", 0, world
        zero = sum(1 for n in slot_numels if n == 0)
    elif form == FORM_INTO_TENSOR:
        fn = ("ProcessGroupNCCL::allgather_into_tensor_coalesced" if coalesced
              else "ProcessGroupNCCL::_allgather_base")
        temp, ops, zero = 0, 1, int(slot_numels[0] == 0)
    else:
        raise ValueError(f"collective model: unknown form {form!r}")
    return CollectiveRecord(form, fn, rank, world, str(dtype), tuple(int(n) for n in slot_numels),
                            int(temp), ops, zero, int(received), bool(async_op), bool(coalesced),
                            launch_id)


def summarize(records: Sequence[CollectiveRecord]) -> Dict[str, int]:
    """Totals of a list of records (one rank's calls).

    Returns:
        ``calls`` (c10d calls), ``ops`` (NCCL collective calls), ``zero_size_ops``,
        ``launches`` (NCCL group launches: distinct ``launch_id``), ``nccl_temporary_bytes``
        and ``wire_bytes`` (bytes received).
    """
    return {
        "calls": len(records),
        "ops": sum(r.ops for r in records),
        "zero_size_ops": sum(r.zero_size_ops for r in records),
        "launches": len({r.launch_id for r in records}),
        "nccl_temporary_bytes": sum(r.nccl_temporary_bytes for r in records),
        "wire_bytes": sum(r.wire_bytes for r in records),
    }


_launch_ids = itertools.count()


@dataclass
class _OpenGroup:
    """A ``_coalescing_manager(group, device)`` block the model runs on a gloo/fake group."""

    launch_id: int
    works: List[Any] = field(default_factory=list)  # gloo works of the broadcasts inside
    deferred: List[Callable[[], None]] = field(default_factory=list)  # under defer_async_completion


#: group -> the modelled device-coalescing block open on it.
_open_groups: Dict[Any, _OpenGroup] = {}
#: group -> launch id of torch's own (fast-path) ``_coalescing_manager`` block open on it.
_fast_path_ids: Dict[Any, int] = {}


def _launch_id(group: Any) -> int:
    """The launch id of a call on ``group``: the open coalescing block's, or a new one."""
    pg = group if group is not None else c10d._get_default_group()
    open_group = _open_groups.get(pg)
    if open_group is not None:
        return open_group.launch_id
    fast_path = _fast_path_ids.get(pg)
    if fast_path is not None:
        return fast_path
    return next(_launch_ids)


# ---------------------------------------------------------------- recording
_recorders: List[List[CollectiveRecord]] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[List[CollectiveRecord]]:
    """Collect a ``CollectiveRecord`` per all-gather call made inside the block.

    Works with the CPU runtime layer installed (gloo ranks) and without it (e.g. NCCL
    ranks on GPUs): then the three functions are wrapped for the block only, record, and
    call torch's own. Without the layer, names bound before the block are not seen (e.g.
    megatron's ``dist_all_gather_func``, bound at import); with it they are, as the layer
    is installed before megatron is imported. Blocks nest; each gets every call made
    inside it.

    Example::

        with record_collectives() as calls:
            bucket_group.start_param_sync(); bucket_group.finish_param_sync()
        assert sum(c.nccl_temporary_bytes for c in calls) == 0
    """
    records: List[CollectiveRecord] = []
    _recorders.append(records)
    patched_here = not model_installed()
    if patched_here:
        _set_model_functions(setattr)
    try:
        yield records
    finally:
        if patched_here:
            _restore_real_functions()
        _recorders.remove(records)


def _record(record: CollectiveRecord) -> None:
    for records in _recorders:
        records.append(record)


# ---------------------------------------------------------------- execution on gloo
_real_all_gather = dist.all_gather
_real_all_gather_into_tensor = dist.all_gather_into_tensor
_real_all_gather_base = dist._all_gather_base
_real_broadcast = dist.broadcast
_real_coalescing_manager = c10d._coalescing_manager


class ModelWork:
    """Work handle of a modelled call: waits on every gloo broadcast, then finishes it.

    ``finish`` (the slice copies of the flat form) runs once, after the last broadcast
    completed; the NCCL temporary is released with it. Mirrors the parts of
    ``torch.distributed.Work`` that megatron uses.
    """

    def __init__(self, works: List[Any], finish: Optional[Callable[[], None]] = None,
                 start: Optional[Callable[[], None]] = None):
        self._works = works  # one gloo Work per non-empty slot
        self._finish = finish
        self._start = start  # deferred data movement (defer_async_completion), run in wait()

    def _complete(self) -> None:
        self._works = []  # done: drop gloo's references to the buffers
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def wait(self, timeout: Any = None) -> bool:
        if self._start is not None:
            start, self._start = self._start, None
            start()
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        self._complete()
        return True

    def is_completed(self) -> bool:
        if self._start is None and all(work.is_completed() for work in self._works):
            self._complete()
            return True
        return False

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)


#: Backends whose calls the model executes itself; others go to torch unchanged. "fake"
#: (torch.testing's fake process group) moves no data, so the model's broadcasts are no-ops
#: there and the records are what a run at that group size would issue.
MODEL_BACKENDS = ("gloo", "fake")


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "unknown"


def _coalescing(group: Any) -> bool:
    """True inside ``_coalescing_manager`` for ``group``."""
    pg = group if group is not None else c10d._get_default_group()
    return pg in c10d._world.pg_coalesce_state


def _broadcast_slots(slots: Sequence[torch.Tensor], inp: torch.Tensor, rank: int, group: Any,
                     async_op: bool) -> List[Any]:
    """Fill ``slots[r]`` with rank r's input, one gloo broadcast per non-empty slot.

    ``inp`` is the broadcast source of this rank's own slot, which then gets a copy of it
    unless it is ``inp`` itself (same data pointer). Views only: nothing is allocated.
    """
    works = []
    for slot, out in enumerate(slots):
        if out.numel() == 0:  # gloo aborts on empty tensors (pytorch #85234)
            continue
        work = _real_broadcast(inp if slot == rank else out, group_src=slot, group=group, async_op=async_op)
        if async_op:
            works.append(work)
    own = slots[rank]
    if own.numel() and own.data_ptr() != inp.data_ptr():
        own.view(-1).copy_(inp.view(-1))
    return works


def _check_list(tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, rank: int, world: int) -> None:
    if len(tensor_list) != world:
        raise ValueError(f"all_gather: {rank=} got {len(tensor_list)} output slots for a group of {world}")
    for slot, out in enumerate(tensor_list):
        if out.dtype != tensor.dtype:
            raise ValueError(f"all_gather: {rank=} {slot=} dtype {out.dtype} != input dtype {tensor.dtype}")
        if not out.is_contiguous():
            raise ValueError(f"all_gather: {rank=} {slot=} output is not contiguous")
    if tensor_list[rank].numel() != tensor.numel():
        raise ValueError(
            f"all_gather: {rank=} own slot numel {tensor_list[rank].numel()} != input numel {tensor.numel()}"
        )
    if tensor.numel() and not tensor.is_contiguous():
        raise ValueError(f"all_gather: {rank=} input is not contiguous")


_deferring = [False]


@contextlib.contextmanager
def defer_async_completion() -> Iterator[None]:
    """Inside the block, an async modelled call moves its data only in its own ``wait()``.

    c10d defines an async collective's output only once that call's own work has been
    waited on, and backends complete works in any order before that (ProcessGroupGloo runs
    them on a pool of worker threads; NCCL happens to finish one communicator's works in
    order). This is the latest completion the contract allows, made deterministic: code
    that reads an output before waiting on the work that writes it reads what was there
    before, every time, and a work never waited on never moves data. The gloo broadcasts
    then run synchronously in ``wait()``, so every rank must wait on the same works in the
    same order (true of SPMD code). Calls made inside ``_coalescing_manager`` blocks are
    deferred to the block's work. Sync calls are unaffected.
    """
    previous, _deferring[0] = _deferring[0], True
    try:
        yield
    finally:
        _deferring[0] = previous


def _run(move: Callable[[bool], List[Any]], finish: Optional[Callable[[], None]], async_op: bool,
         coalesced: bool) -> Optional[ModelWork]:
    """Run ``move(async_gloo)`` (the gloo broadcasts) now, or in the handle's ``wait()``
    under ``defer_async_completion``; then ``finish`` once they completed."""
    if _deferring[0] and async_op and not coalesced:
        return ModelWork([], finish, start=lambda: move(False))
    return _finish_sync(move(async_op and not coalesced), finish, async_op, coalesced)


def _finish_sync(works: List[Any], finish: Optional[Callable[[], None]], async_op: bool,
                 coalesced: bool) -> Optional[ModelWork]:
    handle = ModelWork(works, finish)
    if not async_op or coalesced:
        handle.wait()
    return handle if async_op else None


def _passes_through(group: Any) -> bool:
    """Calls that torch runs itself: not a group member, or a backend not in MODEL_BACKENDS."""
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        return True
    backend = _backend(group)
    return not any(name in backend for name in MODEL_BACKENDS)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Optional[ModelWork]:
    """``torch.distributed.all_gather`` as ProcessGroupNCCL::allgather runs it.

    Args:
        tensor_list: ``world`` contiguous tensors of ``tensor.dtype``; slot ``r`` receives
            rank ``r``'s input. Equal shapes take the flat path (one NCCL temporary of
            ``world x numel``), different shapes the broadcast path (none). Every rank
            passes the same shapes, as NCCL requires.
        tensor: this rank's input; its numel equals its own slot's. It may be that slot.
        group: process group (None: the default group).
        async_op: return a handle to ``wait()`` on.

    Returns:
        None, or a ``ModelWork`` when ``async_op`` (torch's own handle off gloo/CPU).

    Raises:
        ValueError: wrong slot count, dtype, own-slot size, or a non-contiguous tensor (a
            staging copy would allocate). The message names the rank and the slot.
    """
    if _passes_through(group):
        if group is None or group != dist.GroupMember.NON_GROUP_MEMBER:
            equal = all(t.shape == tensor_list[0].shape for t in tensor_list)
            _record(model_call(FORM_LIST_EQUAL if equal else FORM_LIST_UNEQUAL,
                               [t.numel() for t in tensor_list], dist.get_rank(group), tensor.dtype,
                               async_op=async_op, launch_id=_launch_id(group)))
        with torch._C.DisableTorchFunction():  # no re-dispatch to this wrapper
            return _real_all_gather(tensor_list, tensor, group=group, async_op=async_op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_list(tensor_list, tensor, rank, world)
    coalesced = _coalescing(group)
    equal = all(t.shape == tensor_list[0].shape for t in tensor_list)
    _record(model_call(FORM_LIST_EQUAL if equal else FORM_LIST_UNEQUAL, [t.numel() for t in tensor_list],
                       rank, tensor.dtype, async_op=async_op, coalesced=coalesced,
                       launch_id=_launch_id(group)))
    if not equal:
        return _run(lambda a: _broadcast_slots(tensor_list, tensor, rank, group, a), None, async_op,
                    coalesced)
    # newLikeFlat: the temporary NCCL gathers into, allocated through torch.
    flat = torch.empty((world, *tensor_list[0].shape), dtype=tensor.dtype, device=tensor.device)

    def copy_out(flat=flat):
        for r, out in enumerate(tensor_list):
            out.copy_(flat[r])

    return _run(lambda a: _broadcast_slots(list(flat.unbind(0)), tensor.view(tensor_list[0].shape), rank,
                                           group, a), copy_out, async_op, coalesced)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Optional[ModelWork]:
    """``torch.distributed.all_gather_into_tensor`` as ProcessGroupNCCL::_allgather_base runs it.

    Args:
        output_tensor: contiguous, ``world * input.numel()`` elements of the input's dtype;
            chunk ``r`` (in flat order) receives rank ``r``'s input. No temporary.
        input_tensor: this rank's input; may be its own chunk of ``output_tensor``.
        group, async_op: as ``all_gather``.

    Returns:
        None, or a ``ModelWork`` when ``async_op``.

    Raises:
        ValueError: size or dtype mismatch, or a non-contiguous tensor, naming the rank.
    """
    if _passes_through(group):
        if group is None or group != dist.GroupMember.NON_GROUP_MEMBER:
            world = dist.get_world_size(group)
            _record(model_call(FORM_INTO_TENSOR, [input_tensor.numel()] * world, dist.get_rank(group),
                               input_tensor.dtype, async_op=async_op,
                               coalesced=group in c10d._world.pg_coalesce_state,
                               launch_id=_launch_id(group)))
        with torch._C.DisableTorchFunction():
            return _real_all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = input_tensor.numel()
    if output_tensor.numel() != world * n:
        raise ValueError(f"all_gather_into_tensor: {rank=} output numel {output_tensor.numel()} "
                         f"!= {world=} x input numel {n}")
    if output_tensor.dtype != input_tensor.dtype:
        raise ValueError(f"all_gather_into_tensor: {rank=} output dtype {output_tensor.dtype} "
                         f"!= input dtype {input_tensor.dtype}")
    if not output_tensor.is_contiguous() or not input_tensor.is_contiguous():
        raise ValueError(f"all_gather_into_tensor: {rank=} output and input must be contiguous")
    coalesced = _coalescing(group)
    _record(model_call(FORM_INTO_TENSOR, [n] * world, rank, input_tensor.dtype, async_op=async_op,
                       coalesced=coalesced, launch_id=_launch_id(group)))
    chunks = list(output_tensor.view(-1).split(n)) if n else [output_tensor.view(-1)] * world
    return _run(lambda a: _broadcast_slots(chunks, input_tensor.view(-1), rank, group, a), None, async_op,
                coalesced)


@functools.wraps(_real_all_gather_base)
def _all_gather_base(output_tensor, input_tensor, group=None, async_op=False):
    """The deprecated name of ``all_gather_into_tensor`` (megatron falls back to it)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None,
              async_op: bool = False, group_src: Optional[int] = None) -> Optional[ModelWork]:
    """``torch.distributed.broadcast`` as ProcessGroupNCCL::broadcast runs it: one ncclBroadcast.

    Args:
        tensor: contiguous; the root's is sent, every other rank's is overwritten in place.
        src: the root's global rank; or ``group_src``, its rank in ``group``.
        group, async_op: as ``all_gather``. Inside a modelled
            ``_coalescing_manager(group, device)`` block the broadcast joins that block's
            NCCL group: it runs as an async gloo work that the block waits on, and the
            handle returned here has nothing of its own to wait for.

    Returns:
        None, or a ``ModelWork`` when ``async_op``.

    Raises:
        ValueError: a non-contiguous tensor (NCCL would need a staging copy), naming the rank.
    """
    if _passes_through(group):
        if group is None or group != dist.GroupMember.NON_GROUP_MEMBER:
            root = group_src if group_src is not None else dist.get_group_rank(
                group if group is not None else c10d._get_default_group(), src)
            _record(model_call(FORM_BROADCAST, [tensor.numel()], dist.get_rank(group), tensor.dtype,
                               world=dist.get_world_size(group), src=root, async_op=async_op,
                               coalesced=_coalescing(group), launch_id=_launch_id(group)))
        with torch._C.DisableTorchFunction():
            return _real_broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    pg = group if group is not None else c10d._get_default_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    root = group_src if group_src is not None else dist.get_group_rank(pg, src)
    if tensor.numel() and not tensor.is_contiguous():
        raise ValueError(f"broadcast: {rank=} tensor is not contiguous")
    open_group = _open_groups.get(pg)
    _record(model_call(FORM_BROADCAST, [tensor.numel()], rank, tensor.dtype, world=world, src=root,
                       async_op=async_op, coalesced=open_group is not None or _coalescing(group),
                       launch_id=_launch_id(group)))
    work = None
    if tensor.numel() and _deferring[0] and (async_op or open_group is not None):
        def move(a=False):
            _real_broadcast(tensor, group_src=root, group=group)
            return []
        if open_group is not None:
            open_group.deferred.append(move)
            return ModelWork([]) if async_op else None
        return ModelWork([], start=move)
    if tensor.numel():  # gloo aborts on empty tensors (pytorch #85234)
        work = _real_broadcast(tensor, group_src=root, group=group,
                               async_op=async_op or open_group is not None)
    if open_group is not None:
        if work is not None:
            open_group.works.append(work)
        return ModelWork([]) if async_op else None
    return ModelWork([work] if work is not None else []) if async_op else None


@contextlib.contextmanager
def _coalescing_manager(group: Any = None, device: Optional[torch.device] = None,
                        async_ops: bool = False) -> Iterator[Any]:
    """``torch.distributed._coalescing_manager`` with one launch id per block.

    With ``device`` on a gloo or fake group (gloo has no ``startCoalescing``), the block is
    modelled: broadcasts inside it run as async gloo works; at exit one ``ModelWork`` waits
    on all of them, appended to the manager (``async_ops``) or waited on at once, as
    ProcessGroupNCCL's ``endCoalescing`` work would be. Otherwise torch's own manager runs
    the block (fast-path coalescing of ``all_gather_into_tensor``, ``all_reduce``, ...).
    """
    pg = group if group is not None else c10d._get_default_group()
    launch_id = next(_launch_ids)
    if device is None or _passes_through(pg):
        _fast_path_ids[pg] = launch_id
        try:
            with _real_coalescing_manager(group, device, async_ops) as cm:
                yield cm
        finally:
            _fast_path_ids.pop(pg, None)
        return
    if pg in _open_groups:
        raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
    _open_groups[pg] = open_group = _OpenGroup(launch_id)
    cm = c10d._CoalescingManager()
    try:
        yield cm
    finally:
        del _open_groups[pg]
    deferred = open_group.deferred
    work = ModelWork(open_group.works, start=(lambda: [m() for m in deferred]) if deferred else None)
    if async_ops:
        cm.append(work)
    else:
        work.wait()


# ---------------------------------------------------------------- install
_NAMES: Tuple[Tuple[str, Callable], ...] = (
    ("all_gather", all_gather),
    ("all_gather_into_tensor", all_gather_into_tensor),
    ("_all_gather_base", _all_gather_base),
    ("broadcast", broadcast),
    ("_coalescing_manager", _coalescing_manager),
)
_REAL = {"all_gather": _real_all_gather, "all_gather_into_tensor": _real_all_gather_into_tensor,
         "_all_gather_base": _real_all_gather_base, "broadcast": _real_broadcast,
         "_coalescing_manager": _real_coalescing_manager}


def _set_model_functions(setter: Callable[[Any, str, Any], None]) -> None:
    """Put the model's functions on ``torch.distributed`` and ``distributed_c10d``.

    Both names matter: megatron binds ``torch.distributed.all_gather_into_tensor`` at
    import (``dist_all_gather_func``), and torch's own functions re-dispatch through the
    ``distributed_c10d`` global while a torch-function mode is active.
    """
    for name, fn in _NAMES:
        setter(dist, name, fn)
        setter(c10d, name, fn)


def _restore_real_functions() -> None:
    for name, _ in _NAMES:
        setattr(dist, name, _REAL[name])
        setattr(c10d, name, _REAL[name])


def model_installed() -> bool:
    """True while ``torch.distributed.all_gather`` is this model's."""
    return dist.all_gather is all_gather


def install(replace: Callable[[Any, str, Any], None]) -> None:
    """Install the model through ``replace`` (``harness.cpu_runtime.patching.replace``)."""
    _set_model_functions(replace)
