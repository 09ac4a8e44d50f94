"""Single-process tests of the two behaviours of the series' layer-wise param sync that
no real rank can reach, over a stand-in bucket group.

Everything else of the bucket-level gather (patches 0003 to 0005: the collective chosen from
the shares, the slots packed in grad_data or in one temporary, the copy-back and zeroing,
pending gathers completed, every share pattern of 3 ranks) is checked on real gloo ranks,
through megatron's DDP and bucket groups, in test_layerwise_param_sync.py. What is left here:

- grad_data narrower than the params (fp32 params over bf16 grads): start_param_sync must
  not receive into it; megatron's DDP never builds such a bucket;
- 0.19's MXFP8 params: the owner sends the param's fp32 master (``main_param``) through its
  slot, and refuses a param without one; megatron recognises an MXFP8 param by Transformer
  Engine's MXFP8Tensor class, which does not exist without Transformer Engine (not
  installed on the CPU ranks), so no real rank holds one.

The collectives are replaced by ``StandIn``: it records every call and delivers what the
other DP ranks would send (their owners' values), so one process plays one rank of a group
of any size. The bucket group is megatron's class built without DDP (``bucket_group``),
holding stand-in buckets.

The module imports the megatron tree first on PYTHONPATH (the 0.17.1 series under the
suite); test_the_bucket_tests_pass_on_the_019_series runs it once more in a process that
imports build/patched-0.19, whose start_param_sync also sends an MXFP8 param's fp32 master
(the MXFP8 tests run there only).
"""

from __future__ import annotations

import contextlib
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
    """Recording stand-in for the collectives the layer-wise gather calls on unequal shares
    (the only ones used here): broadcasts inside one coalescing block.

    Plays group rank ``rank`` of ``len(truth)`` ranks. ``truth[r]`` is the flat value of the
    params that rank r sends. A broadcast from another root writes that root's value into
    the tensor; one from this rank checks that what it sends is its own params' value (the
    copy-in happened).

    Attributes:
        calls: (name, tensor, group rank of the root, async_op, coalescing block id or
            None), in call order.
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


def sync(monkeypatch, shapes_by_rank, rank, param_dtype, grad_dtype, grad_numel):
    """The forward pre-hook pair (async start_param_sync(), then finish_param_sync()) of a
    bucket group on rank `rank` over idle grad_data. Returns (stand-in, params, values,
    grad_data, grad_data before)."""
    params_by_rank, truth, values, grad_data = make_case(
        shapes_by_rank, rank, param_dtype, grad_dtype, grad_numel
    )
    before = grad_data.clone()
    stand_in = StandIn(rank, truth).install(monkeypatch)
    g = bucket_group(params_by_rank, rank, grad_data)
    g.start_param_sync()
    assert g.param_gather_handle is not None
    g.finish_param_sync(skip_next_bucket_dispatch=True)
    assert g.param_gather_handle is None and g.buckets[0].layerwise_gather_list is None
    return stand_in, params_by_rank, values, grad_data, before


# ------------------------------------------------------ grad_data narrower than the params
# Rank 0 owns two params (11 elements), rank 1 nothing, rank 2 one param (4), rank 3 two (5).
UNEQUAL = [[(3, 2), (5,)], [], [(4,)], [(2,), (3,)]]


@pytest.mark.parametrize("rank", [0, 2])
def test_grad_data_narrower_than_the_params_is_not_received_into(monkeypatch, rank):
    """fp32 params over a bf16 grad_data, idle, not forced: the gather receives into one
    temporary of exactly the gathered size (20 elements), the slots packed in it in rank
    order, and grad_data is never written; the params end as the owners' values.
    Stand-in only: megatron's DDP never builds such a bucket (a buffer's grad dtype is fp32
    or the param's own: group_params_for_buffers), so no real rank reaches this guard of
    start_param_sync; real ranks check every bucket DDP does build
    (test_layerwise_param_sync.py)."""
    stand_in, params, values, grad, before = sync(
        monkeypatch, UNEQUAL, rank, torch.float32, torch.bfloat16, 40
    )
    tensors = [c[1] for c in stand_in.calls]
    assert len(tensors) == 3 and not any(in_storage(t, grad) for t in tensors)
    st = tensors[0].untyped_storage()
    assert all(t.untyped_storage().data_ptr() == st.data_ptr() for t in tensors)
    assert st.nbytes() == 20 * 4
    assert [t.data_ptr() - st.data_ptr() for t in tensors] == [o * 4 for o in (0, 11, 15)]
    assert torch.equal(grad.view(torch.uint8), before.view(torch.uint8)), "grad_data written"
    assert stand_in.blocks == [True]
    assert_params_are_owner_values(params, values)


# ------------------------------------------------------------------ MXFP8 params (0.19)
class _MXFP8(torch.Tensor):
    """Stands for TE's MXFP8Tensor: its storage is not its values (zeros here); the value
    to send is the fp32 master in param.main_param. Stand-in only: megatron's
    is_mxfp8tensor() is True only for Transformer Engine's MXFP8Tensor, which needs TE (not
    installed on the CPU ranks), so the MXFP8 cases cannot run on real ranks."""


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
        env=env_for_tree("series-0.19"), cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    outcomes = {
        case.get("name"): [(c.tag, c.get("message", "")) for c in case]
        for case in ET.parse(report).getroot().iter("testcase")
    }
    bad = {name: o for name, o in outcomes.items() if o}
    assert not bad, bad  # no failure, error or skip
    assert len(outcomes) == len(here) and any("mxfp8" in name for name in outcomes), outcomes
