"""Single-process tests of the series' bucket-level layer-wise param all-gather.

megatron/core/distributed/param_and_grad_buffer.py (patched tree only; pristine has none of
this):

- ``_layerwise_all_gather(recv, slots, rank, group, async_op)`` (patch 0005): the collective
  chosen from the per-rank slots, the split of the 1-D ``recv`` in rank order: equal slots
  -> one ``all_gather_into_tensor`` straight into ``recv`` from this rank's slot; otherwise
  one broadcast per rank whose slot is not empty, rooted at that rank, of that slot, all
  inside one ``_coalescing_manager`` (one NCCL group launch);
- ``_ParamAndGradBucketGroup.start_param_sync`` (patch 0003): the receive buffer is the
  bucket's ``grad_data`` viewed as the param dtype while the group's ``grad_data_idle`` is
  True and the sync is not forced (and grad_data is at least as wide as the params), else
  one temporary of the gathered size; the slots are packed in rank order from its element
  0; this rank's params are copied straight into its slot;
- ``_copy_back_layerwise_gather``: the other ranks' slots into the params, then every slot
  zeroed (exactly what the gather wrote, nothing else of grad_data).

The collectives are replaced by ``StandIn``: it records every call and delivers what the
other DP ranks would send (their owners' values), so one process plays one rank of a group
of any size. The bucket group is megatron's class built without DDP (``bucket_group``),
holding stand-in buckets. What real gloo ranks do is tested in test_layerwise_param_sync.py.

The module imports the megatron tree first on PYTHONPATH (the 0.17.1 series under the
suite); test_the_bucket_tests_pass_on_the_019_series runs it once more in a process that
imports build/patched-0.19, whose start_param_sync also sends an MXFP8 param's fp32 master
(the MXFP8 tests run there only).
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.trees import REPO_ROOT, check_expected_tree, env_for_tree
from megatron.core import package_info
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed import param_and_grad_buffer as pgb

# Under env_for_tree (the 0.19 run below): raise unless megatron comes from that tree.
check_expected_tree()

GARBAGE = -777.0  # what a rank holds for a param another rank owns, before the gather
GLOBAL_OFFSET = 100  # the stand-in's global rank of group rank r is 100 + r


class Work:
    """A finished work handle (what the stand-in's collectives return when async)."""

    def __init__(self, name):
        self.name, self.waited = name, 0

    def wait(self):
        self.waited += 1
        return True


class StandIn:
    """Recording stand-in for the collectives the layer-wise gather calls.

    Plays group rank ``rank`` of ``len(truth)`` ranks. ``truth[r]`` is the flat value of the
    params that rank r sends. A broadcast from another root writes that root's value into
    the tensor; ``all_gather_into_tensor`` writes every other rank's chunk. A call from this
    rank checks that what it sends is its own params' value (the copy-in happened).

    Attributes:
        calls: (name, tensor or (out, inp), group rank of the root or None, async_op,
            coalescing block id or None), in call order.
        blocks: async_ops flag of each coalescing block entered.
        works: the Work each coalescing block or async call returned.
    """

    def __init__(self, rank, truth):
        self.rank, self.truth = rank, truth
        self.calls, self.blocks, self.works, self._block = [], [], [], None

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: self.rank)
        monkeypatch.setattr(
            torch.distributed, "get_global_rank", lambda group, r: GLOBAL_OFFSET + r
        )
        monkeypatch.setattr(torch.distributed, "broadcast", self.broadcast)
        monkeypatch.setattr(torch.distributed, "all_gather_into_tensor", self.all_gather_into_tensor)
        monkeypatch.setattr(pgb, "_coalescing_manager", self.coalescing_manager)
        return self

    def _sends_own(self, t):
        assert torch.equal(t.detach().reshape(-1), self.truth[self.rank]), "sent stale params"

    def _work(self, name, async_op):
        if not async_op:
            return None
        self.works.append(Work(name))
        return self.works[-1]

    def broadcast(self, tensor, src, group=None, async_op=False):
        root = src - GLOBAL_OFFSET
        self.calls.append(("broadcast", tensor, root, async_op, self._block))
        assert tensor.numel() > 0, "zero-size broadcast"
        if root == self.rank:
            self._sends_own(tensor)
        else:
            tensor.view(-1).copy_(self.truth[root])
        return self._work("broadcast", async_op)

    def all_gather_into_tensor(self, out, inp, group=None, async_op=False):
        self.calls.append(("all_gather_into_tensor", (out, inp), None, async_op, self._block))
        self._sends_own(inp)
        n = inp.numel()
        assert out.numel() == n * len(self.truth)
        for r, chunk in enumerate(out.split(n)):
            if r != self.rank:
                chunk.copy_(self.truth[r])
        return self._work("all_gather_into_tensor", async_op)

    @contextlib.contextmanager
    def coalescing_manager(self, group, device=None, async_ops=False):
        assert self._block is None, "nested coalescing blocks"
        self._block = len(self.blocks)
        self.blocks.append(async_ops)
        work = Work("coalescing_manager")
        self.works.append(work)
        try:
            yield work
        finally:
            self._block = None


def make_case(shapes_by_rank, rank, param_dtype, grad_dtype, grad_numel, fill=0.5):
    """Params owned per rank (shapes), as group rank `rank` holds them before a gather (own
    params at their value, the others' GARBAGE), a grad_data of `grad_numel` x grad_dtype
    holding `fill` (grads the step consumed), and the flat value each rank sends."""
    gen = torch.Generator().manual_seed(0)
    params_by_rank, truth, values = [], [], {}
    for shapes in shapes_by_rank:
        ps = []
        for shape in shapes:
            value = torch.randn(shape, generator=gen).to(param_dtype)
            p = torch.nn.Parameter(value.clone())
            values[p] = value
            ps.append(p)
        params_by_rank.append(ps)
        truth.append(
            torch.cat([values[p].reshape(-1) for p in ps]) if ps else torch.empty(0, dtype=param_dtype)
        )
    with torch.no_grad():
        for r, ps in enumerate(params_by_rank):
            if r != rank:
                for p in ps:
                    p.fill_(GARBAGE)
    grad_data = torch.full((grad_numel,), fill, dtype=grad_dtype)
    return params_by_rank, truth, values, grad_data


def bucket_group(params_by_rank, rank, grad_data, idle=True):
    """megatron's _ParamAndGradBucketGroup (built without DDP: only what the layer-wise
    param sync reads) of one stand-in bucket owning `params_by_rank`, as group rank `rank`
    holds it, with `grad_data` and the grad_data_idle flag `idle`."""
    params = [p for ps in params_by_rank for p in ps]
    bucket = SimpleNamespace(
        params_list=params, params=set(params), grad_data=grad_data, param_data=None,
        layerwise_gather_list=None, layerwise_params_list=None,
    )
    pgb._ParamAndGradBucket.set_layerwise_params_list(bucket, params_by_rank)
    g = object.__new__(pgb._ParamAndGradBucketGroup)
    g.ddp_config = DistributedDataParallelConfig(
        overlap_param_gather=True, use_distributed_optimizer=False
    )
    g.buckets = [bucket]
    g.intra_distributed_optimizer_instance_rank = rank
    g.intra_distributed_optimizer_instance_size = len(params_by_rank)
    g.intra_distributed_optimizer_instance_group = None
    g.param_gather_handle = None
    g.param_gather_dispatched = False
    g.next_param_gather_bucket_group = None
    g.grad_data_idle = idle
    return g


def in_storage(t, owner):
    st = owner.untyped_storage()
    lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


def assert_params_are_owner_values(params_by_rank, values):
    for ps in params_by_rank:
        for p in ps:
            assert torch.equal(p.detach(), values[p]), "a param is not its owner's value"


def sent_tensors(stand_in):
    """The tensor of each call (all_gather_into_tensor: its output), in call order."""
    return [c[1][0] if c[0] == "all_gather_into_tensor" else c[1] for c in stand_in.calls]


def sync(monkeypatch, shapes_by_rank, rank, param_dtype, grad_dtype, grad_numel, idle=True,
         force_sync=False):
    """start_param_sync() of a bucket group on rank `rank` (async unless forced), then what
    the forward pre-hook does (finish_param_sync) when not forced. Returns (stand-in, group,
    the slots the gather used, params, values, grad_data, grad_data before)."""
    params_by_rank, truth, values, grad_data = make_case(
        shapes_by_rank, rank, param_dtype, grad_dtype, grad_numel
    )
    before = grad_data.clone()
    stand_in = StandIn(rank, truth).install(monkeypatch)
    g = bucket_group(params_by_rank, rank, grad_data, idle)
    g.start_param_sync(force_sync=force_sync)
    slots = None
    if not force_sync:
        slots = list(g.buckets[0].layerwise_gather_list)
        assert g.param_gather_handle is not None
        g.finish_param_sync(skip_next_bucket_dispatch=True)
    assert g.param_gather_handle is None and g.buckets[0].layerwise_gather_list is None
    return stand_in, g, slots, params_by_rank, values, grad_data, before


# ------------------------------------------------------------- _layerwise_all_gather
def gather_into(monkeypatch, shares, rank, async_op=True, dtype=torch.bfloat16):
    """_layerwise_all_gather over slots of `shares` in a fresh recv, this rank's slot
    filled with its value, the others GARBAGE; returns (stand-in, recv, slots, truth, work)."""
    gen = torch.Generator().manual_seed(1)
    truth = [torch.randn(n, generator=gen).to(dtype) for n in shares]
    recv = torch.full((sum(shares),), GARBAGE, dtype=dtype)
    slots = list(recv.split(shares))
    slots[rank].copy_(truth[rank])
    stand_in = StandIn(rank, truth).install(monkeypatch)
    work = pgb._layerwise_all_gather(recv, slots, rank, None, async_op)
    return stand_in, recv, slots, truth, work


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("async_op", [True, False])
def test_equal_shares_one_all_gather_into_tensor_straight_into_recv(monkeypatch, rank, async_op):
    """Shares 6, 6, 6: one all_gather_into_tensor, outside any coalescing block, whose
    output is recv itself and whose input is this rank's slot; every slot then holds its
    owner's value. Async: its work is returned; sync: None."""
    stand_in, recv, slots, truth, work = gather_into(monkeypatch, [6, 6, 6], rank, async_op)
    ((name, (out, inp), _, op_async, block),) = stand_in.calls
    assert (name, op_async, block) == ("all_gather_into_tensor", async_op, None)
    assert stand_in.blocks == []
    assert out.data_ptr() == recv.data_ptr() and out.numel() == recv.numel() == 18
    assert inp.data_ptr() == slots[rank].data_ptr() and inp.numel() == 6
    assert work is (stand_in.works[0] if async_op else None)
    assert all(torch.equal(s, t) for s, t in zip(slots, truth))


# Rank 0 owns 11 elements, rank 1 nothing, rank 2 4, rank 3 5.
UNEQUAL_SHARES = [11, 0, 4, 5]


@pytest.mark.parametrize("rank", range(4))
@pytest.mark.parametrize("async_op", [True, False])
def test_unequal_shares_broadcast_each_slot_from_its_owner_in_one_block(monkeypatch, rank, async_op):
    """One broadcast per rank whose slot is not empty (none for rank 1), rooted at that
    rank's global rank, the tensor its slot itself (no copy), all inside one coalescing
    block with async_ops = async_op; every slot then holds its owner's value. Async: the
    block's work is returned (its wait() waits on the whole group); sync: None."""
    stand_in, recv, slots, truth, work = gather_into(monkeypatch, UNEQUAL_SHARES, rank, async_op)
    assert [(c[0], c[2], c[1].data_ptr(), c[1].numel()) for c in stand_in.calls] == [
        ("broadcast", r, slots[r].data_ptr(), n) for r, n in enumerate(UNEQUAL_SHARES) if n
    ]
    assert {c[4] for c in stand_in.calls} == {0} and stand_in.blocks == [async_op]
    assert all(c[3] for c in stand_in.calls)  # each broadcast joins the block's group
    assert work is (stand_in.works[0] if async_op else None)
    assert all(torch.equal(s, t) for s, t in zip(slots, truth))


def test_every_share_pattern_of_three_ranks(monkeypatch):
    """Every share pattern of 3 ranks (0 to 2 elements each, not all 0), from every rank:
    equal shares take one all_gather_into_tensor, unequal ones one broadcast per non-empty
    slot; no zero-size collective; every slot holds its owner's value."""
    forms = set()
    for shares in itertools.product(range(3), repeat=3):
        if max(shares) == 0:
            continue
        for rank in range(3):
            with monkeypatch.context() as m:
                stand_in, recv, slots, truth, _ = gather_into(m, list(shares), rank)
            names = [c[0] for c in stand_in.calls]
            if min(shares) == max(shares):
                assert names == ["all_gather_into_tensor"], (shares, rank)
            else:
                assert names == ["broadcast"] * sum(1 for s in shares if s), (shares, rank)
            forms |= set(names)
            assert all(t.numel() > 0 for t in sent_tensors(stand_in)), (shares, rank)
            assert all(torch.equal(s, t) for s, t in zip(slots, truth)), (shares, rank)
    assert forms == {"all_gather_into_tensor", "broadcast"}


# ------------------------------------------------------------------ start_param_sync
# Rank 0 owns two params (11 elements), rank 1 nothing, rank 2 one param (4), rank 3 two (5).
UNEQUAL = [[(3, 2), (5,)], [], [(4,)], [(2,), (3,)]]
EQUAL = [[(3, 2)], [(2,), (4,)], [(1,), (5,)]]  # 6, 6, 6: a single-param owner among them


@pytest.mark.parametrize("rank", range(4))
def test_slots_packed_in_rank_order_from_element_0_of_grad_data(monkeypatch, rank):
    """Idle grad_data (fp32, 40 elements = 80 bf16), async: the slots are
    grad_data.view(bf16)[:20].split(11, 0, 4, 5), in rank order from element 0, and the
    broadcasts send exactly those slots (the single-param owner's too: no in-place path)."""
    stand_in, _, slots, params, values, grad, _ = sync(
        monkeypatch, UNEQUAL, rank, torch.bfloat16, torch.float32, 40
    )
    assert [t.numel() for t in slots] == [11, 0, 4, 5]
    assert [(t.data_ptr() - grad.data_ptr()) // 2 for t in slots if t.numel()] == [0, 11, 15]
    assert [t.data_ptr() for t in sent_tensors(stand_in)] == [slots[r].data_ptr() for r in (0, 2, 3)]
    assert all(in_storage(t, grad) for t in sent_tensors(stand_in))
    assert_params_are_owner_values(params, values)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_equal_shares_gather_into_grad_data(monkeypatch, rank):
    """Idle grad_data, equal shares: the all_gather_into_tensor's output is the first 18
    elements of grad_data, its input this rank's slot of them."""
    stand_in, _, slots, params, values, grad, _ = sync(
        monkeypatch, EQUAL, rank, torch.float32, torch.float32, 21
    )
    ((_, (out, inp), _, _, _),) = stand_in.calls
    assert out.data_ptr() == grad.data_ptr() and out.numel() == 18
    assert inp.data_ptr() == grad.data_ptr() + rank * 6 * 4 and inp.numel() == 6
    assert_params_are_owner_values(params, values)


@pytest.mark.parametrize("shapes", [UNEQUAL, EQUAL[:2] + [[(6,)]]], ids=["unequal", "equal"])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_copy_out_zeroes_exactly_the_slots(monkeypatch, shapes, rank):
    """grad_data holds consumed grads (0.5, idle): after the pre-hook pair the params are
    the owners' values, the slots (sum of the shares in bf16, the local one included) are
    zero, every other grad_data byte is as before."""
    _, _, slots, params, values, grad, before = sync(
        monkeypatch, shapes, rank, torch.bfloat16, torch.float32, 40
    )
    n = sum(t.numel() for t in slots) * 2
    now, old = grad.view(torch.uint8), before.view(torch.uint8)
    assert n > 0 and torch.count_nonzero(now[:n]) == 0, "a slot was not zeroed"
    assert torch.equal(now[n:], old[n:]), "the copy-out changed grad_data it did not write"
    assert_params_are_owner_values(params, values)


RECEIVE_CASES = {
    # case: (idle, force_sync, param dtype, grad dtype) -> into grad_data?
    "idle": (True, False, torch.bfloat16, torch.float32, True),
    "idle_same_dtype": (True, False, torch.float32, torch.float32, True),
    "forced": (True, True, torch.bfloat16, torch.float32, False),
    "not_idle": (False, False, torch.bfloat16, torch.float32, False),
    "not_idle_forced": (False, True, torch.bfloat16, torch.float32, False),
    "grad_data_narrower": (True, False, torch.float32, torch.bfloat16, False),
}


@pytest.mark.parametrize("case", RECEIVE_CASES)
@pytest.mark.parametrize("rank", [0, 2])
def test_receive_buffer_is_grad_data_only_while_idle_and_not_forced(monkeypatch, case, rank):
    """grad_data (viewed as the param dtype) is the receive buffer only while the group's
    grad_data_idle is True, the sync is not forced and grad_data is at least as wide as the
    params; otherwise one temporary of exactly the gathered size (20 elements), holding the
    packed slots, and grad_data is never written (every byte as before). Either way the
    params end as the owners' values."""
    idle, forced, pdtype, gdtype, into_grad = RECEIVE_CASES[case]
    stand_in, g, _, params, values, grad, before = sync(
        monkeypatch, UNEQUAL, rank, pdtype, gdtype, 40, idle=idle, force_sync=forced
    )
    tensors = sent_tensors(stand_in)
    assert len(tensors) == 3
    assert all(in_storage(t, grad) == into_grad for t in tensors), case
    if not into_grad:
        st = tensors[0].untyped_storage()
        assert all(t.untyped_storage().data_ptr() == st.data_ptr() for t in tensors)
        assert st.nbytes() == 20 * tensors[0].element_size()
        assert [t.data_ptr() - st.data_ptr() for t in tensors] == [
            o * tensors[0].element_size() for o in (0, 11, 15)
        ]
        assert torch.equal(grad.view(torch.uint8), before.view(torch.uint8)), "grad_data written"
    assert stand_in.blocks == [not forced]
    assert_params_are_owner_values(params, values)


@pytest.mark.parametrize("complete", ["forced_sync", "free_overlap_buffers"])
@pytest.mark.parametrize("rank", [0, 1])
def test_pending_gather_completed_by_a_forced_sync_or_free_overlap_buffers(monkeypatch, complete, rank):
    """A gather pending in grad_data (async start_param_sync, no finish) completed by a
    forced sync or free_overlap_buffers(): the work waited on, the params the owners'
    values, the slots zeroed, nothing gathered again, no gather state left."""
    params_by_rank, truth, values, grad = make_case(UNEQUAL, rank, torch.bfloat16, torch.float32, 40)
    before = grad.clone()
    stand_in = StandIn(rank, truth).install(monkeypatch)
    g = bucket_group(params_by_rank, rank, grad)
    g.start_param_sync()
    if complete == "forced_sync":
        g.start_param_sync(force_sync=True)
    else:
        g.free_overlap_buffers()
    # The coalescing block's work (the first) waited on once; the broadcasts' own works,
    # inside the block, are the block's.
    assert len(stand_in.calls) == 3 and stand_in.works[0].name == "coalescing_manager"
    assert stand_in.works[0].waited == 1
    assert g.param_gather_handle is None and g.buckets[0].layerwise_gather_list is None
    assert_params_are_owner_values(params_by_rank, values)
    now, old = grad.view(torch.uint8), before.view(torch.uint8)
    assert torch.count_nonzero(now[:40]) == 0 and torch.equal(now[40:], old[40:])


def test_local_params_copied_into_their_slot_per_param(monkeypatch):
    """This rank's params go into its slot one by one (a non-contiguous one included): the
    slot it sends equals its params' flat value (StandIn checks it), nothing allocated for
    them beyond the temporary receive buffer of a forced sync."""
    params_by_rank, truth, values, grad = make_case(UNEQUAL, 0, torch.bfloat16, torch.float32, 40)
    w = params_by_rank[0][0]
    w.data = w.data.t().contiguous().t()  # same values, transposed strides
    assert not w.data.is_contiguous()
    StandIn(0, truth).install(monkeypatch)
    g = bucket_group(params_by_rank, 0, grad)
    g.start_param_sync()
    g.finish_param_sync(skip_next_bucket_dispatch=True)
    assert_params_are_owner_values(params_by_rank, values)


# ------------------------------------------------------------------ MXFP8 params (0.19)
class _MXFP8(torch.Tensor):
    """Stands for TE's MXFP8Tensor: its storage is not its values (zeros here); the value
    to send is the fp32 master in param.main_param."""


def _mxfp8_param(value, monkeypatch):
    """A param of class _MXFP8 holding zeros, its fp32 master `value`; pgb.is_mxfp8tensor
    made to recognise it (on CPU no TE tensor exists)."""
    monkeypatch.setattr(pgb, "is_mxfp8tensor", lambda t: isinstance(t, _MXFP8))
    param = torch.nn.Parameter(torch.zeros_like(value).as_subclass(_MXFP8))
    param.main_param = value.float()
    return param


def _needs_mxfp8_sync():
    if (package_info.MAJOR, package_info.MINOR) < (0, 19):
        pytest.skip("megatron-core 0.17.1 sends no MXFP8 master in the layer-wise gather")


@pytest.mark.parametrize("rank", [0, 2])
def test_mxfp8_param_sends_its_master_through_its_slot(monkeypatch, rank):
    """0.19: rank 2's single param is MXFP8. Its owner copies param.main_param into its
    slot of grad_data and sends that slot; the receivers' copy_() gets that value; the
    slots are zeroed again."""
    _needs_mxfp8_sync()
    params_by_rank, truth, values, grad = make_case(UNEQUAL, rank, torch.bfloat16, torch.float32, 40)
    old = params_by_rank[2][0]
    value = values.pop(old)
    new = _mxfp8_param(value, monkeypatch)
    if rank != 2:
        with torch.no_grad():
            new.fill_(GARBAGE)
    values[new] = value
    params_by_rank[2] = [new]
    before = grad.clone()
    stand_in = StandIn(rank, truth).install(monkeypatch)
    g = bucket_group(params_by_rank, rank, grad)
    g.start_param_sync()
    sent = [c[1] for c in stand_in.calls if c[2] == 2]
    assert len(sent) == 1 and in_storage(sent[0], grad) and sent[0].numel() == value.numel()
    g.finish_param_sync(skip_next_bucket_dispatch=True)
    if rank != 2:
        assert torch.equal(new.detach().as_subclass(torch.Tensor), value)
    now, old_bytes = grad.view(torch.uint8), before.view(torch.uint8)
    assert torch.count_nonzero(now[:40]) == 0 and torch.equal(now[40:], old_bytes[40:])


def test_mxfp8_param_without_master_is_refused_naming_it(monkeypatch):
    """0.19: an MXFP8 param whose main_param is None cannot be sent (its storage is not its
    values): an AssertionError that names main_param, before any collective."""
    _needs_mxfp8_sync()
    params_by_rank, truth, values, grad = make_case(UNEQUAL, 2, torch.bfloat16, torch.float32, 40)
    new = _mxfp8_param(values[params_by_rank[2][0]], monkeypatch)
    new.main_param = None
    params_by_rank[2] = [new]
    stand_in = StandIn(2, truth).install(monkeypatch)
    g = bucket_group(params_by_rank, 2, grad)
    with pytest.raises(AssertionError, match="main_param"):
        g.start_param_sync()
    assert stand_in.calls == []


# ------------------------------------------------------------------- the 0.19 series
def test_the_bucket_tests_pass_on_the_019_series(request, tmp_path):
    """This module's tests in a process that imports build/patched-0.19 (harness.trees
    env_for_tree: its megatron first on PYTHONPATH): as many as here, every one passes
    there (the MXFP8 tests included), none skipped."""
    parent = REPO_ROOT / "build" / "patched-0.19"
    if not (parent / "megatron" / "core").is_dir():
        pytest.skip("build/patched-0.19 is missing; run scripts/setup.sh")
    here = [i for i in request.session.items if i.path == Path(__file__) and "019_series" not in i.name]
    report = tmp_path / "junit.xml"
    # The repo root holds the 0.17.1 tree's megatron/: run from tmp_path (`python -m` puts
    # the working directory first on sys.path) without the root conftest.py (pytest would
    # put its folder, the repo root, first too).
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
         "-c", str(REPO_ROOT / "pytest.ini"), "--rootdir", str(REPO_ROOT), "--noconftest",
         "-k", "not 019_series", f"--junitxml={report}", str(Path(__file__))],
        env=env_for_tree("patched-0.19"), cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    outcomes = {
        case.get("name"): [(c.tag, c.get("message", "")) for c in case]
        for case in ET.parse(report).getroot().iter("testcase")
    }
    bad = {name: o for name, o in outcomes.items() if o}
    assert not bad, bad  # no failure, error or skip
    assert len(outcomes) == len(here) and any("mxfp8" in name for name in outcomes), outcomes
