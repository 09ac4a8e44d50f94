"""Single-process tests of the series' bucket-level layer-wise param all-gather.

megatron/core/distributed/param_and_grad_buffer.py (patched tree only; 0.17.1 has none of
these functions):

- ``layerwise_recv_buffer(grad_data, param_dtype, numel, busy)``: grad_data viewed as the
  param dtype; a temporary only while grad_data is busy (grads not yet consumed, a grad
  reduce in flight) or offloaded; asserts capacity;
- ``_layerwise_slots(recvs, numels)``: slots placed in order, each in the first buffer with
  room, 16-byte aligned if the whole layout fits so, else 4-byte, else packed, else None;
- ``start_layerwise_param_gather`` / ``finish_layerwise_param_gather``: the collective
  chosen from the per-rank shares (equal: one ``all_gather_into_tensor``; unequal: one
  broadcast per rank that owns something, in one coalescing block, a single plain param
  straight into itself, anything else through a slot), then the copy-out and the zeroing
  of exactly what was written.

The collectives are replaced by ``StandIn``: it records every call and delivers what the
other DP ranks would send (their owners' values), so one process plays one rank of a group
of any size. What real gloo ranks do is tested in test_layerwise_param_sync.py.

The module imports the megatron tree first on PYTHONPATH (the 0.17.1 series under the
suite); test_the_bucket_tests_pass_on_the_019_series runs it once more in a process that
imports build/patched-0.19, whose slot code also sends an MXFP8 param's fp32 master
(``_layerwise_src``: the MXFP8 tests run there only).
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from harness.trees import REPO_ROOT, check_expected_tree, env_for_tree
from megatron.core import package_info
from megatron.core.distributed import param_and_grad_buffer as pgb

# Under env_for_tree (the 0.19 run below): raise unless megatron comes from that tree.
check_expected_tree()

GARBAGE = -777.0  # what a rank holds for a param another rank owns, before the gather
GLOBAL_OFFSET = 100  # the stand-in's global rank of group rank r is 100 + r


class StandIn:
    """Recording stand-in for the collectives start_layerwise_param_gather() calls.

    Plays group rank ``rank`` of ``world``. ``truth[r]`` is the flat value of the params
    that rank r sends. A broadcast from another root writes that root's value into the
    tensor; ``all_gather_into_tensor`` writes every other rank's chunk. A call from this
    rank checks that what it sends is its own params' value (the copy-in happened).

    Attributes:
        calls: (name, tensor or (out, inp), group rank of the root or None, async_op,
            coalescing block id or None), in call order.
        blocks: async_ops flag of each coalescing block entered.
    """

    def __init__(self, rank, params_by_rank, truth):
        self.rank, self.params_by_rank, self.truth = rank, params_by_rank, truth
        self.calls, self.blocks, self._block = [], [], None

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: self.rank)
        monkeypatch.setattr(
            torch.distributed, "get_global_rank", lambda group, r: GLOBAL_OFFSET + r
        )
        monkeypatch.setattr(torch.distributed, "broadcast", self.broadcast)
        monkeypatch.setattr(torch.distributed, "all_gather_into_tensor", self.all_gather_into_tensor)
        monkeypatch.setattr(pgb, "_coalescing_manager", self.coalescing_manager)

    def _sends_own(self, t):
        assert torch.equal(t.detach().reshape(-1), self.truth[self.rank]), "sent stale params"

    def broadcast(self, tensor, src, group=None, async_op=False):
        root = src - GLOBAL_OFFSET
        self.calls.append(("broadcast", tensor, root, async_op, self._block))
        if root == self.rank:
            self._sends_own(tensor)
        else:
            tensor.view(-1).copy_(self.truth[root])
        return object() if async_op else None

    def all_gather_into_tensor(self, out, inp, group=None, async_op=False):
        self.calls.append(("all_gather_into_tensor", (out, inp), None, async_op, self._block))
        self._sends_own(inp)
        n = inp.numel()
        assert out.numel() == n * len(self.truth)
        for r, chunk in enumerate(out.split(n)):
            if r != self.rank:
                chunk.copy_(self.truth[r])
        return object() if async_op else None

    @contextlib.contextmanager
    def coalescing_manager(self, group, device=None, async_ops=False):
        assert self._block is None, "nested coalescing blocks"
        self._block = len(self.blocks)
        self.blocks.append(async_ops)
        try:
            yield "coalescing-manager"
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


def in_storage(t, owner):
    st = owner.untyped_storage()
    lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


def byte_range(t, owner):
    """[start, end) of t in bytes from the start of owner's storage."""
    start = t.data_ptr() - owner.untyped_storage().data_ptr()
    return start, start + t.numel() * t.element_size()


def gather(monkeypatch, shapes_by_rank, rank, param_dtype, grad_dtype, grad_numel, async_op=True):
    """One start+finish on rank `rank`; returns (stand-in, params, values, grad_data,
    grad_data before, written regions)."""
    params_by_rank, truth, values, grad_data = make_case(
        shapes_by_rank, rank, param_dtype, grad_dtype, grad_numel
    )
    before = grad_data.clone()
    stand_in = StandIn(rank, params_by_rank, truth)
    stand_in.install(monkeypatch)
    # What the series receives into while grad_data is idle (layerwise_recv_buffer).
    recv = grad_data.view(param_dtype)
    work, pending = pgb.start_layerwise_param_gather([recv], params_by_rank, None, async_op)
    written = list(pending[0])
    pgb.finish_layerwise_param_gather(*pending)
    return stand_in, work, params_by_rank, values, grad_data, before, written


def assert_params_are_owner_values(params_by_rank, values):
    for ps in params_by_rank:
        for p in ps:
            assert torch.equal(p.detach(), values[p]), "a param is not its owner's value"


def assert_zeroed_exactly(grad_data, before, written):
    """grad_data bytes inside the written regions are zero, all others as before."""
    now, old = grad_data.view(torch.uint8), before.view(torch.uint8)
    mask = torch.zeros(now.numel(), dtype=torch.bool)
    for t in written:
        lo, hi = byte_range(t, grad_data)
        mask[lo:hi] = True
    assert mask.any()
    assert torch.count_nonzero(now[mask]) == 0, "the gather left bytes it wrote in grad_data"
    assert torch.equal(now[~mask], old[~mask]), "the gather changed grad_data it did not write"


# ------------------------------------------------------------------- equal shares
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_equal_shares_one_all_gather_into_tensor_into_grad_data(monkeypatch, rank):
    """Shares 6, 6, 6 (a single-param owner among them): one all_gather_into_tensor whose
    output is one region of grad_data and whose input is this rank's chunk of it, filled
    with its params; the region (and only it) zero after the copy-out."""
    shapes = [[(3, 2)], [(2,), (4,)], [(1,), (5,)]]
    stand_in, work, params, values, grad, before, written = gather(
        monkeypatch, shapes, rank, torch.float32, torch.float32, grad_numel=21
    )
    ((name, (out, inp), _, async_op, block),) = stand_in.calls
    assert (name, async_op, block) == ("all_gather_into_tensor", True, None)
    assert work is not None
    assert out.numel() == 18 and in_storage(out, grad) and out.data_ptr() % 16 == 0
    assert inp.data_ptr() == out.data_ptr() + rank * 6 * 4 and inp.numel() == 6
    assert len(written) == 1 and written[0].data_ptr() == out.data_ptr()
    assert written[0].numel() == 18
    assert_params_are_owner_values(params, values)
    assert_zeroed_exactly(grad, before, written)


def test_equal_shares_sync_returns_no_work(monkeypatch):
    stand_in, work, *_ = gather(
        monkeypatch, [[(4,)], [(2, 2)]], 0, torch.float32, torch.float32, 8, async_op=False
    )
    assert work is None and stand_in.calls[0][3] is False


# ----------------------------------------------------------------- unequal shares
# Rank 0 owns two params (11 elements), rank 1 nothing, rank 2 one param (4), rank 3 two (5).
UNEQUAL = [[(3, 2), (5,)], [], [(4,)], [(2,), (3,)]]


@pytest.mark.parametrize("rank", range(4))
def test_unequal_shares_broadcast_from_exactly_the_owners(monkeypatch, rank):
    """One broadcast per rank that owns a param (none for the empty one), rooted at the
    owner's global rank, with the owner's share, all in one coalescing block; params are
    the owners' values afterwards on every rank."""
    stand_in, work, params, values, grad, before, _ = gather(
        monkeypatch, UNEQUAL, rank, torch.bfloat16, torch.float32, grad_numel=40
    )
    assert [(c[0], c[2], c[1].numel()) for c in stand_in.calls] == [
        ("broadcast", 0, 11),
        ("broadcast", 2, 4),
        ("broadcast", 3, 5),
    ]
    assert {c[4] for c in stand_in.calls} == {0} and stand_in.blocks == [True]
    assert work == "coalescing-manager"  # its wait() waits on the whole group
    assert_params_are_owner_values(params, values)


def test_unequal_shares_sync_returns_no_work(monkeypatch):
    stand_in, work, *_ = gather(
        monkeypatch, UNEQUAL, 1, torch.bfloat16, torch.float32, 40, async_op=False
    )
    assert work is None and stand_in.blocks == [False]


@pytest.mark.parametrize("rank", [0, 2])
def test_single_param_owner_broadcasts_in_place(monkeypatch, rank):
    """Rank 2 owns one param: its broadcast is that param's own storage on every rank (the
    receivers get it straight into param.data); no slot, nothing copied or zeroed for it."""
    stand_in, _, params, values, grad, _, written = gather(
        monkeypatch, UNEQUAL, rank, torch.bfloat16, torch.float32, grad_numel=40
    )
    (single,) = params[2]
    tensor = stand_in.calls[1][1]
    assert tensor.data_ptr() == single.data_ptr() and tensor.shape == single.shape
    assert not in_storage(tensor, grad)
    assert len(written) == 2 and all(in_storage(t, grad) for t in written)
    assert [t.numel() for t in written] == [11, 5]  # the multi-param owners' slots only


@pytest.mark.parametrize(
    "grad_dtype,grad_numel,starts",
    [
        # fp32 grad_data of 40 = 80 bf16 elements: slot starts rounded up to 16 bytes.
        (torch.float32, 40, [0, 16]),
        # bf16 grad_data of 20 elements: 16 + 5 > 20, so 4-byte aligned (12 + 5 <= 20);
        # packed slots: test_slot_layout.
        (torch.bfloat16, 20, [0, 12]),
    ],
)
def test_slots_aligned_where_there_is_room_packed_otherwise(monkeypatch, grad_dtype, grad_numel, starts):
    stand_in, _, params, values, grad, before, written = gather(
        monkeypatch, UNEQUAL, 1, torch.bfloat16, grad_dtype, grad_numel
    )
    slots = [stand_in.calls[0][1], stand_in.calls[2][1]]
    assert [(t.data_ptr() - grad.data_ptr()) // 2 for t in slots] == starts
    assert [t.data_ptr() for t in slots] == [t.data_ptr() for t in written]
    assert_params_are_owner_values(params, values)
    assert_zeroed_exactly(grad, before, written)


@pytest.mark.parametrize("rank", range(4))
def test_zeroes_exactly_what_the_gather_wrote(monkeypatch, rank):
    """grad_data holds consumed grads (0.5): after the copy-out the multi-param owners'
    slots (the local one included) are zero, every other byte is as before."""
    _, _, params, values, grad, before, written = gather(
        monkeypatch, UNEQUAL, rank, torch.bfloat16, torch.float32, grad_numel=40
    )
    assert_params_are_owner_values(params, values)
    assert_zeroed_exactly(grad, before, written)


# ------------------------------------------------------------------------- slots
def test_slots_align_to_the_storage_not_to_the_view():
    """A bucket's grad_data is a view at an offset into the buffer's: the slots are
    aligned in memory (16 bytes), consecutive and disjoint."""
    storage = torch.zeros(64, dtype=torch.bfloat16)
    recv = storage[3:]
    slots = pgb._layerwise_slots([recv], [5, 7, 9])
    assert [t.numel() for t in slots] == [5, 7, 9]
    assert all(t.data_ptr() % 16 == 0 for t in slots)
    assert [(t.data_ptr() - storage.data_ptr()) // 2 for t in slots] == [8, 16, 24]


@pytest.mark.parametrize(
    "dtype,numel,numels,starts",
    [
        (torch.float32, 12, [3, 5], [0, 4]),  # 4 fp32 elements = 16 bytes
        (torch.float32, 8, [3, 5], [0, 3]),  # 4 + 5 > 8: packed
        (torch.bfloat16, 13, [5, 5], [0, 8]),
        (torch.bfloat16, 12, [5, 5], [0, 6]),  # 8 + 5 > 12: 4-byte aligned
        (torch.bfloat16, 10, [5, 5], [0, 5]),  # 6 + 5 > 10: packed
    ],
)
def test_slot_layout(dtype, numel, numels, starts):
    recv = torch.zeros(numel, dtype=dtype)
    slots = pgb._layerwise_slots([recv], numels)
    assert [t.storage_offset() for t in slots] == starts
    assert [t.numel() for t in slots] == numels


def test_slots_that_do_not_fit_even_packed_give_none():
    assert pgb._layerwise_slots([torch.zeros(9, dtype=torch.bfloat16)], [5, 5]) is None


def test_slots_first_fit_over_several_buffers():
    """Each slot goes into the first buffer with room after the slots before it there; the
    16-byte layout does not fit (the third slot), the 4-byte one does."""
    a, b = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
    slots = pgb._layerwise_slots([a, b], [6, 9, 5])
    where = [("a" if t.untyped_storage().data_ptr() == a.data_ptr() else "b", t.storage_offset()) for t in slots]
    assert where == [("a", 0), ("b", 0), ("b", 10)]


@pytest.mark.parametrize("kind", ["subclass", "non_contiguous"])
def test_a_param_that_is_not_plain_goes_through_a_slot(monkeypatch, kind):
    """Rank 2's single param is a tensor subclass (as TE's Float8Tensor) or not contiguous:
    it is not broadcast in place but through a slot of grad_data, copied per tensor; the
    receivers' param gets the owner's value, the slot is zeroed again."""

    class Sub(torch.Tensor):
        pass

    params_by_rank, truth, values, grad = make_case(UNEQUAL, 0, torch.bfloat16, torch.float32, 40)
    old = params_by_rank[2][0]
    data = old.detach().clone().reshape(2, 2)
    # x.t().contiguous().t() equals x, with transposed strides.
    new = torch.nn.Parameter(data.as_subclass(Sub) if kind == "subclass" else data.t().contiguous().t())
    assert not pgb._is_plain(new)
    values[new] = values.pop(old).reshape(2, 2)
    params_by_rank[2] = [new]
    before = grad.clone()
    stand_in = StandIn(0, params_by_rank, truth)
    stand_in.install(monkeypatch)
    work, pending = pgb.start_layerwise_param_gather([grad.view(torch.bfloat16)], params_by_rank, None, True)
    sent = [c[1] for c in stand_in.calls if c[2] == 2]
    assert len(sent) == 1 and in_storage(sent[0], grad)
    assert [t.numel() for t in pending[0]] == [11, 4, 5]
    pgb.finish_layerwise_param_gather(*pending)
    assert torch.equal(new.detach().as_subclass(torch.Tensor), values[new])
    assert_zeroed_exactly(grad, before, pending[0])


# ------------------------------------------------------------------ receive buffer
#: The 0.17.1 series chooses the receive buffer in layerwise_recv_buffer(); the 0.19 series
#: inline in start_param_sync() (tested on real ranks in test_grad_data_guards.py).
requires_recv_buffer = pytest.mark.skipif(
    not hasattr(pgb, "layerwise_recv_buffer"), reason="no layerwise_recv_buffer in this tree"
)


@requires_recv_buffer
def test_receive_buffer_is_grad_data_viewed_as_the_param_dtype():
    grad = torch.zeros(10, dtype=torch.float32)
    recv = pgb.layerwise_recv_buffer(grad, torch.bfloat16, 20)
    assert recv.dtype == torch.bfloat16 and recv.numel() == 20
    assert recv.data_ptr() == grad.data_ptr()


@requires_recv_buffer
@pytest.mark.parametrize("offloaded", [False, True])
def test_busy_or_offloaded_grad_data_gets_a_temporary(offloaded):
    """busy: grad_data holds grads no step has consumed (or a grad reduce writes it), so a
    param sync between backward and the step receives into a fresh tensor, as 0.17.1."""
    grad = torch.full((10,), 0.5)
    if offloaded:
        grad.untyped_storage().resize_(0)
    recv = pgb.layerwise_recv_buffer(grad, torch.bfloat16, 7, busy=not offloaded)
    assert recv.numel() == 7 and recv.dtype == torch.bfloat16
    assert recv.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()


@requires_recv_buffer
def test_receive_buffer_too_small_asserts_with_sizes():
    grad = torch.zeros(5, dtype=torch.float32)
    with pytest.raises(AssertionError) as err:
        pgb.layerwise_recv_buffer(grad, torch.bfloat16, 11)
    msg = str(err.value)
    assert "5 x torch.float32" in msg and "11 x torch.bfloat16" in msg


@requires_recv_buffer
@pytest.mark.parametrize("rank", [0, 1])
def test_offloaded_grad_data_gets_a_temporary_and_is_never_written(monkeypatch, rank):
    """offload_grad_buffers() freed grad_data's storage: the gather receives into a fresh
    tensor of exactly its numel; the freed storage stays 0 bytes; params are synced."""
    params_by_rank, truth, values, grad = make_case(UNEQUAL, rank, torch.bfloat16, torch.float32, 40)
    grad.untyped_storage().resize_(0)
    stand_in = StandIn(rank, params_by_rank, truth)
    stand_in.install(monkeypatch)
    recv = pgb.layerwise_recv_buffer(grad, torch.bfloat16, 20)
    assert recv.numel() == 20 and recv.dtype == torch.bfloat16 and recv.untyped_storage().nbytes() == 40
    work, pending = pgb.start_layerwise_param_gather([recv], params_by_rank, None, True)
    assert all(in_storage(t, recv) for t in pending[0])
    pgb.finish_layerwise_param_gather(*pending)
    assert grad.untyped_storage().nbytes() == 0, "freed grad_data storage was written"
    assert_params_are_owner_values(params_by_rank, values)


def test_every_share_pattern_of_three_ranks_gathers_the_owners_values(monkeypatch):
    """Every assignment of 4 params (1, 2, 1, 2 elements) to 3 ranks (empty, single and
    multi-param owners, equal and unequal shares), from every rank: params are the owners'
    values, no zero-size collective, grad_data zeroed exactly where written."""
    shapes = [(1,), (2,), (1,), (2,)]
    forms = set()
    for owners in itertools.product(range(3), repeat=len(shapes)):
        by_rank = [[s for s, o in zip(shapes, owners) if o == r] for r in range(3)]
        for rank in range(3):
            with monkeypatch.context() as m:
                stand_in, _, params, values, grad, before, written = gather(
                    m, by_rank, rank, torch.bfloat16, torch.float32, grad_numel=16
                )
            forms.add(stand_in.calls[0][0])
            tensors = [c[1][1] if c[0] == "all_gather_into_tensor" else c[1] for c in stand_in.calls]
            assert all(t.numel() > 0 for t in tensors), (owners, rank)
            assert_params_are_owner_values(params, values)
            if written:
                assert_zeroed_exactly(grad, before, written)
            else:
                assert torch.equal(grad, before)
    assert forms == {"all_gather_into_tensor", "broadcast"}


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
def test_mxfp8_param_sends_its_master_through_a_slot(monkeypatch, rank):
    """0.19: rank 2's single param is MXFP8. Its owner sends param.main_param in the param
    dtype, through a slot of grad_data (not in place: its storage is not its values), and
    the receivers' copy_() gets that value; the slot is zeroed again."""
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
    assert not pgb._is_plain(new)
    before = grad.clone()
    stand_in = StandIn(rank, params_by_rank, truth)
    stand_in.install(monkeypatch)
    work, pending = pgb.start_layerwise_param_gather([grad.view(torch.bfloat16)], params_by_rank, None, True)
    sent = [c[1] for c in stand_in.calls if c[2] == 2]
    assert len(sent) == 1 and in_storage(sent[0], grad) and sent[0].numel() == value.numel()
    pgb.finish_layerwise_param_gather(*pending)
    if rank != 2:
        assert torch.equal(new.detach().as_subclass(torch.Tensor), value)
    assert_zeroed_exactly(grad, before, pending[0])


def test_mxfp8_param_without_master_is_refused_naming_it(monkeypatch):
    """0.19: an MXFP8 param whose main_param is None cannot be sent (its storage is not its
    values): an AssertionError that names main_param, before any collective."""
    _needs_mxfp8_sync()
    params_by_rank, truth, values, grad = make_case(UNEQUAL, 2, torch.bfloat16, torch.float32, 40)
    new = _mxfp8_param(values[params_by_rank[2][0]], monkeypatch)
    new.main_param = None
    params_by_rank[2] = [new]
    stand_in = StandIn(2, params_by_rank, truth)
    stand_in.install(monkeypatch)
    with pytest.raises(AssertionError, match="main_param"):
        pgb.start_layerwise_param_gather([grad.view(torch.bfloat16)], params_by_rank, None, True)
    assert stand_in.calls == []


# ------------------------------------------------------------------- the 0.19 series
def test_the_bucket_tests_pass_on_the_019_series(request, tmp_path):
    """This module's tests in a process that imports build/patched-0.19 (harness.trees
    env_for_tree: its megatron first on PYTHONPATH): as many as here, every one passes
    there (the MXFP8 tests included), none skipped but the receive-buffer helper's where
    the tree has none."""
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
    bad = {
        name: o for name, o in outcomes.items()
        if o and o != [("skipped", "no layerwise_recv_buffer in this tree")]
    }
    assert not bad, bad  # no failure or error, no other skip
    assert len(outcomes) == len(here) and any("mxfp8" in name for name in outcomes), outcomes
