"""Multi-rank worker for test_grad_data_guards.py: public DDP calls while a layer-wise
param all-gather is pending, on real megatron-core objects and gloo ranks.

Run under torchrun, one process per DP rank, with the tree under test first on
PYTHONPATH (harness.trees.env_for_tree) and MEGATRON_CPU_RUNTIME=1 on CPU:

    torchrun --nproc-per-node 2 tests/unit_tests/grad_data_guard_worker.py --out DIR \
        --scenarios zero_grad,offload,...

Every scenario trains a DDP-wrapped TinyNet (tests/unit_tests/layerwise_worker.py: DDP
built the way megatron.training builds it, `main_grad` a view into `grad_data`, and the
LayerWiseDistributedOptimizer with overlapped param gather) for STEPS optimizer steps of
MICROBATCHES microbatches, and injects one call sequence at a fixed point of each step
(see SCENARIOS). A scenario that starts a pending gather names its point
(Scenario.gather_start, one of START_POINTS); its "<name>_idle" twin starts
the same calls right after zero_grad_buffer() of steps 1 and 2, where grad_data (the
bucket's flat grad buffer, which every param's main_grad views) holds no grad and the
series receives the gather into it. After the last step one forward pass with every
module (no grad) completes whatever gather is left, so the final params are comparable.

Outputs, per scenario and config:
    DIR/<config>.<scenario>.rank<R>.pt   torch.save of {"main_grads": [[tensor]] per
        step (after finish_grad_sync), "params": [[tensor]] per step (after its first
        forward: the params it computes with; the last entry is after the final
        forward), "grad_norms": [float], "error": "<type>: <message>" or None,
        "error_step", "error_phase", "error_is_runtime_error", "state_kept": whether
        params and grad_data equal the snapshot taken right before the call that
        raised, "pending_state_kept": the same for the params and for the grad_data of
        the bucket groups whose gather was pending then (None when nothing raised or no
        snapshot was taken), "temporaries": {phase: gather calls that received into a
        temporary}, "grad_data_gathers": {phase: gather calls that touched grad_data} (see
        GatherReceives)}.
    DIR/results.json (rank 0)   {"<config>/<scenario>": the scalar fields above, and
        "reentry_errors", "reentry_state_kept"} plus "_meta".
A scenario that raises stops at that point; the error is recorded, not re-raised, so
that the pristine tree's assertions are data. The errors are deterministic, so every
rank raises at the same call (no rank is left waiting in a collective).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Importing layerwise_worker installs the CPU runtime layer (MEGATRON_CPU_RUNTIME=1) and
# imports megatron-core from the tree on PYTHONPATH.
from layerwise_worker import (  # noqa: E402
    Setup,
    all_ranks,
    parallel_state,
    parse_config,
    wait_for_pending_gathers,
    worker_arg_parser,
)

from harness.trees import check_expected_tree  # noqa: E402

STEPS = 3
MICROBATCHES = 2
# Layers that the forward-only probe pass runs (of len(WIDTHS) - 1).
PROBE_DEPTH = 2


# ----------------------------------------------------------------------- forward variants
# Each runs TinyNet's expert layer (when it has one) after the dense layers it runs.
def _as(x, layer):
    """x in the layer's param dtype (Scenario.two_dtypes: the last layer is fp32)."""
    return x.to(layer.weight.dtype)


def _experts(self, x):
    return x if self.experts is None else self.experts(x)


def _forward_full(self, x):
    for layer in self.layers:
        x = torch.tanh(layer(_as(x, layer)))
    return _experts(self, x)


def _forward_probe(self, x):
    """Only the first PROBE_DEPTH layers: e.g. a rollout or probe that exits early."""
    for layer in self.layers[:PROBE_DEPTH]:
        x = torch.tanh(layer(_as(x, layer)))
    return x


def _forward_bypass_last(self, x):
    """The last dense layer's params used from the parent: its forward pre-hook never
    fires."""
    for layer in self.layers[:-1]:
        x = torch.tanh(layer(_as(x, layer)))
    last = self.layers[-1]
    return _experts(self, torch.tanh(F.linear(_as(x, last), last.weight, last.bias)))


def _forward_last_unused(self, x):
    """Every dense layer runs (its forward pre-hook fires), but the last one's output is
    dropped, as an auxiliary head outside the loss: its bucket group gets no grads."""
    for layer in self.layers[:-1]:
        x = torch.tanh(layer(_as(x, layer)))
    self.layers[-1](_as(x, self.layers[-1]))
    return _experts(self, x)


def _forward_skip_last(self, x):
    """The last dense layer is not used at all in this pass (no params, no grads)."""
    for layer in self.layers[:-1]:
        x = torch.tanh(layer(_as(x, layer)))
    return _experts(self, x)


# ------------------------------------------------------------- where the gathers receive
class GatherReceives:
    """Classifies every param all-gather call (torch.distributed.broadcast,
    all_gather_into_tensor, all_gather) of a scenario run by where its tensors lie, whatever
    the tree's helpers are called: "grad_data" (a tensor inside some bucket's grad_data
    storage: it receives into, or sends from, grad_data), "in_place" (every tensor a param's
    own storage: a single param broadcast in place), else "temporary" (a receive buffer of
    its own: 0.17.1's list all_gather, or the series' fallback while grad_data is busy or
    offloaded). `counts[kind]` maps the phase name (Phase) of each call to how many."""

    NAMES = ("broadcast", "all_gather_into_tensor", "all_gather")

    def __init__(self, s, phase):
        self.s, self.phase = s, phase
        self.counts = {"grad_data": {}, "in_place": {}, "temporary": {}}
        self._orig = {}

    def _kind(self, tensors):
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return None
        grads = {g.untyped_storage().data_ptr() for g in self.s.grad_datas()}
        params = {p.untyped_storage().data_ptr() for p in self.s.params}
        ptrs = [t.untyped_storage().data_ptr() for t in tensors]
        if any(ptr in grads for ptr in ptrs):
            return "grad_data"
        return "in_place" if all(ptr in params for ptr in ptrs) else "temporary"

    def __enter__(self):
        for name in self.NAMES:
            orig = self._orig[name] = getattr(dist, name)

            def spy(*args, _orig=orig, **kwargs):
                tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
                tensors += [t for a in args[:1] if isinstance(a, (list, tuple)) for t in a]
                kind = self._kind(tensors)
                if kind is not None:
                    per_phase = self.counts[kind]
                    per_phase[self.phase.name] = per_phase.get(self.phase.name, 0) + 1
                return _orig(*args, **kwargs)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def set_forward(s, fn):
    s.ddp.module.forward = types.MethodType(fn, s.ddp.module)


# ----------------------------------------------------------------------------- snapshots
def _pending_works(s):
    """Wait on the work objects of every pending gather and of every grad reduction in
    flight (backward starts them with --overlap-grad-reduce) without consuming the handles,
    so that a snapshot of grad_data is not racing a collective that still writes there."""
    wait_for_pending_gathers(s)
    for g in s.bucket_groups:
        if g.grad_reduce_handle is not None:
            g.grad_reduce_handle.wait()


def snapshot(s):
    """(params, grad_data of every bucket, whether its bucket group has a gather pending)."""
    _pending_works(s)
    pending = [g.param_gather_handle is not None for g in s.bucket_groups for _ in g.buckets]
    return (
        [p.detach().clone() for p in s.params],
        [gd.clone() for gd in s.grad_datas()],
        pending,
    )


def state_equals(s, snap, pending_only=False):
    """Params and grad_data (of the buckets whose gather was pending, if pending_only)
    bitwise equal to `snap`."""
    params, grads, pending = snap
    ok = all(torch.equal(p.detach(), q) for p, q in zip(s.params, params))
    ok &= all(
        torch.equal(g, h)
        for g, h, was_pending in zip(s.grad_datas(), grads, pending)
        if was_pending or not pending_only
    )
    return ok


class Phase:
    """Names the call sequence in progress; before the calls named in `snap_phases` it
    snapshots params and grad_data (waiting on pending receives, see _pending_works)."""

    def __init__(self, s, snap_phases):
        self.s = s
        self.snap_phases = snap_phases
        self.name = None
        self.snap = None

    def __call__(self, name):
        self.name = name
        self.snap = snapshot(self.s) if name in self.snap_phases else None
        return self


# ----------------------------------------------------------------------------- scenarios
class Scenario:
    """Injection points of one training step; the base class injects nothing."""

    forward = staticmethod(_forward_full)
    # Phases before which the state is snapshotted, to check that an error left it as
    # it was. Waiting on the receives changes timing only, so it is kept to the phases
    # where an error is expected.
    snap_phases = frozenset()

    # DDPConfig.overlap_grad_reduce of the run.
    overlap_grad_reduce = True
    # Whether TinyNet gets an expert layer (its own expert-parallel buffer and bucket
    # group, gathered over the expert-DP group).
    expert = False
    # DDPConfig.overlap_param_gather (False: the optimizer's gather in step()).
    overlap_param_gather = True
    # The last layer in fp32 (a second grad buffer) and DDP built with disable_bucketing,
    # as megatron.training builds every model chunk after the first with VPP: one bucket
    # group over a bf16 and an fp32 bucket.
    two_dtypes = False
    # zero_grad_buffer() before every step (False: before step 0 only, so every later
    # backward accumulates onto the grads the previous step consumed).
    zero_grad_every_step = True
    # The last microbatch's backward inside no_sync() too, and the grad reduce started by
    # the caller's ddp.start_grad_sync() after it, as megatron's pipeline schedules do
    # through config.grad_sync_func.
    grad_sync_by_caller = False
    # Where start_gather() runs (one of START_POINTS), for a scenario that starts a pending
    # gather; None for one that starts none. Every gather-starting scenario has a twin
    # "<name>_idle" whose gather_start is "idle" (defined after SCENARIOS).
    gather_start = None

    def backward(self, s, loss):
        """One microbatch's backward: autograd with DDP's backward hooks."""
        loss.backward()

    def start_gather(self, s, k, phase):
        """The calls that start a pending gather and what the scenario then does with it
        pending (at gather_start)."""

    def _at(self, point, s, k, phase):
        if self.gather_start == point:
            self.start_gather(s, k, phase)

    def after_zero_grad(self, s, k, phase):
        """Right after zero_grad_buffer() of step k, before its first forward: the idle
        window (grad_data holds no grad). The "idle" start point uses it in steps 1 and 2,
        whose params the previous step changed (step 0's are equal on every rank)."""
        if k > 0:
            self._at("idle", s, k, phase)

    def after_step(self, s, k, phase):
        """After optimizer.step() of step k (the next step's zero_grad_buffer follows)."""
        self._at("after_step", s, k, phase)

    def after_no_sync_backward(self, s, k, phase):
        """After the backward of each microbatch inside no_sync() of step k."""
        self._at("after_no_sync_backward", s, k, phase)

    def after_backward(self, s, k, phase):
        """After the last microbatch's backward of step k, before finish_grad_sync."""
        self._at("after_backward", s, k, phase)

    def before_step(self, s, k, phase):
        """After finish_grad_sync of step k, before optimizer.step()."""
        self._at("before_step", s, k, phase)


#: Where a scenario's pending gather can start (Scenario.gather_start): the injection points
#: of a step. "idle" is right after zero_grad_buffer(), where the series receives a gather
#: into grad_data; at the others grad_data holds grads (or the consumed grads of the step
#: before), and the series receives into temporaries.
START_POINTS = ("idle", "after_no_sync_backward", "after_backward", "before_step", "after_step")


class Baseline(Scenario):
    """Nothing injected: the control (both trees must agree bitwise)."""


class ZeroGradWhilePending(Scenario):
    """(a) start_param_sync() right after the step (gathers dispatched early, e.g. to
    overlap them with data loading); the next step's zero_grad_buffer() runs before the
    forward pre-hooks finish them, once their data has landed (wait_for_pending_gathers:
    deterministic, and what a fast network gives). Started in the idle window, the
    zero_grad_buffer() with the gathers pending is a second one, called here."""

    gather_start = "after_step"

    def start_gather(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()
        wait_for_pending_gathers(s)
        if self.gather_start != "after_step":
            phase("zero_grad_buffer_again")
            s.ddp.zero_grad_buffer()


class OffloadWhilePending(Scenario):
    """(b) offload_grad_buffers() then restore_grad_buffers() while the gathers that
    start_param_sync() dispatched are pending (RL loops free grads between rollouts)."""

    gather_start = "after_step"

    def start_gather(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()
        phase("offload_grad_buffers")
        s.ddp.offload_grad_buffers()
        phase("restore_grad_buffers")
        s.ddp.restore_grad_buffers()


class GatherIntoOffloaded(Scenario):
    """offload_grad_buffers(), then a non-forced start_param_sync() while grad_data's
    storage is freed (it must not receive there), then restore_grad_buffers() with those
    gathers pending, and training goes on (the forward's pre-hooks finish them)."""

    gather_start = "after_step"

    def start_gather(self, s, k, phase):
        phase("offload_grad_buffers")
        s.ddp.offload_grad_buffers()
        phase("start_param_sync")
        s.ddp.start_param_sync()
        wait_for_pending_gathers(s)
        phase("restore_grad_buffers")
        s.ddp.restore_grad_buffers()


class ForwardOnlyProbe(Scenario):
    """(c) a forward-only pass (torch.no_grad(), pre-hooks left enabled) after the step
    that runs only the first PROBE_DEPTH layers: the gather chained to the next bucket
    group (next_param_gather_bucket_group) is left pending into the next step."""

    gather_start = "after_step"

    def start_gather(self, s, k, phase):
        phase("forward_only_probe")
        set_forward(s, _forward_probe)
        try:
            with torch.no_grad():
                s.ddp(s.batch(k, 99))
        finally:
            set_forward(s, self.forward)
        wait_for_pending_gathers(s)


class BypassPreHook(Scenario):
    """(d) the last layer's params used from the parent (F.linear): its pre-hook never
    fires, its chained gather stays pending, backward accumulates into the receive slot."""

    forward = staticmethod(_forward_bypass_last)


class GatherAfterBackward(Scenario):
    """(e) start_param_sync() after the last microbatch's backward and before
    finish_grad_sync(): finish_grad_sync() finds a pending gather in bucket groups that
    already received this step's grads."""

    snap_phases = frozenset({"start_param_sync", "finish_grad_sync"})
    gather_start = "after_backward"

    def start_gather(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()


class StartParamSyncReentry(Scenario):
    """start_param_sync() twice: the second call finds the gathers of the first pending.
    The error is caught (a caller that retries), and training goes on."""

    snap_phases = frozenset({"start_param_sync_again"})

    def after_step(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()
        phase("start_param_sync_again")
        try:
            s.ddp.start_param_sync()
        except Exception as exc:
            s.reentry_errors.append(f"{type(exc).__name__}: {exc}")
            s.reentry_state_kept.append(all_ranks(state_equals(s, phase.snap)))


class StartGradSyncWhilePending(Scenario):
    """start_grad_sync() called by the caller (as megatron's schedules do through
    grad_sync_func) in a step whose forward did not use the last layer: that layer's
    chained gather is pending when its bucket groups are reduced. Step 0 only."""

    forward = staticmethod(_forward_skip_last)

    def after_backward(self, s, k, phase):
        if k == 0:
            phase("start_grad_sync")
            s.ddp.start_grad_sync()


class SkipLastReference(Scenario):
    """StartGradSyncWhilePending without the start_grad_sync() call: the reference for
    its steps after step 0 (pristine asserts there, see the test)."""

    forward = staticmethod(_forward_skip_last)


class BaselineNoOverlapGradReduce(Scenario):
    """Baseline without --overlap-grad-reduce (grads reduced in finish_grad_sync)."""

    overlap_grad_reduce = False


def _forced_sync(s, phase):
    """What disable_forward_pre_hook() does: a forced (synchronous) param sync."""
    phase("forced_param_sync")
    s.ddp.start_param_sync(force_sync=True)


class ForcedBeforeStep(Scenario):
    """start_param_sync(force_sync=True) after finish_grad_sync() and before the step:
    grad_data holds the reduced grads step() is about to read. 0.17.1 gathers into
    temporaries; but the gather marks the bucket groups dispatched, so the next forward's
    pre-hooks do not gather the params the step updates (see the test)."""

    def before_step(self, s, k, phase):
        _forced_sync(s, phase)


class ForcedBeforeStepNoOverlapGradReduce(ForcedBeforeStep):
    overlap_grad_reduce = False


class ForcedDuringReduce(Scenario):
    """A forced param sync after the last backward, before finish_grad_sync(): the grad
    all-reduce that backward dispatched (--overlap-grad-reduce) is still writing
    grad_data."""

    def after_backward(self, s, k, phase):
        _forced_sync(s, phase)


class ForcedAfterNoSync(Scenario):
    """A forced param sync after a microbatch's backward inside no_sync(): grad_data holds
    accumulated grads, which no overlap_grad_reduce bookkeeping has registered."""

    def after_no_sync_backward(self, s, k, phase):
        _forced_sync(s, phase)


class GatherAfterNoSync(Scenario):
    """start_param_sync() (async) after a microbatch's backward inside no_sync(); the next
    microbatch's forward pre-hooks finish it."""

    gather_start = "after_no_sync_backward"

    def start_gather(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()


class ForcedWithBypass(Scenario):
    """The last layer's pre-hook bypassed (its chained gather stays pending while backward
    accumulates into grad_data), then a forced param sync before finish_grad_sync()."""

    forward = staticmethod(_forward_bypass_last)

    def after_backward(self, s, k, phase):
        _forced_sync(s, phase)


class GatherThenForcedBeforeStep(Scenario):
    """After finish_grad_sync(): start_param_sync() (grad_data holds the reduced grads the
    step will read, so a gather must not receive there), then start_param_sync(
    force_sync=True), what disable_forward_pre_hook() does, with those gathers pending;
    then the step. Started in the idle window: the gathers receive
    into grad_data, their data lands (waited on), and the forced sync must copy them back
    and leave grad_data zeroed for the backward that follows."""

    gather_start = "before_step"

    def start_gather(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()
        if self.gather_start == "idle":
            wait_for_pending_gathers(s)
        _forced_sync(s, phase)


def _hookless_backward(s, loss):
    """Backward without DDP's backward hooks, as megatron's local CUDA graphs run it
    (transformer/cuda_graphs.py skips the hook during capture and replay): the grads come
    from torch.autograd.grad, which runs no AccumulateGrad hook, and are added into
    main_grad (a view into grad_data) by hand, as the hook would."""
    grads = torch.autograd.grad(loss, s.params, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(s.params, grads):
            if g is not None:
                p.main_grad.add_(g)


def _fused_wgrad_backward(s, loss):
    """Backward as gradient_accumulation_fusion runs it: the wgrad kernel adds each grad
    straight into main_grad and sets grad_added_to_main_grad, and the autograd function
    returns a dummy grad (megatron's LinearWithGradAccumulationAndAsyncCommunication, TE's
    get_dummy_wgrad), so DDP's backward hook still runs and adds nothing. Emulated: the
    grads of torch.autograd.grad added into main_grad by hand, then a backward of zeros
    that reaches every param's AccumulateGrad, hence DDP's hook."""
    grads = torch.autograd.grad(loss, s.params, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(s.params, grads):
            if g is not None:
                p.main_grad.add_(g)
                p.grad_added_to_main_grad = True
    sum((p * 0).sum() for p, g in zip(s.params, grads) if g is not None).backward()


class FusedWgradNoOverlapGradReduce(Scenario):
    """Every backward through the fused-wgrad path (_fused_wgrad_backward), without
    --overlap-grad-reduce: DDP's hook sees only a dummy grad and grad_added_to_main_grad
    until finish_grad_sync() reduces the grads."""

    overlap_grad_reduce = False

    def backward(self, s, loss):
        _fused_wgrad_backward(s, loss)


class FusedWgradGatherAfterBackward(FusedWgradNoOverlapGradReduce):
    """An async start_param_sync() after the last microbatch's fused-wgrad backward,
    before finish_grad_sync(): it must not receive over the grads added to main_grad."""

    gather_start = "after_backward"

    def start_gather(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()


class FusedWgradGatherAfterNoSync(FusedWgradGatherAfterBackward):
    """The same after the first microbatch's fused-wgrad backward inside no_sync(); the
    next microbatch's forward pre-hooks finish the gathers."""

    gather_start = "after_no_sync_backward"


class OptimizerGather(Scenario):
    """Without --overlap-param-gather: the optimizer's allgather_params() in step()."""

    overlap_param_gather = False


class HooklessNoOverlapGradReduce(Scenario):
    """Every backward hook-less (_hookless_backward); without --overlap-grad-reduce, so
    finish_grad_sync() reduces the grads (start_grad_sync() of every bucket group)."""

    overlap_grad_reduce = False

    def backward(self, s, loss):
        _hookless_backward(s, loss)


class HooklessForcedBeforeStep(HooklessNoOverlapGradReduce):
    """A hook-less backward, finish_grad_sync(), then a forced param sync before the step:
    no backward hook has marked grad_data as holding grads."""

    def before_step(self, s, k, phase):
        _forced_sync(s, phase)


class GradSyncFunc(Scenario):
    """The grad reduce started by the caller (grad_sync_by_caller) on a model whose last
    dense layer gets no grads (_forward_last_unused): its bucket group's grad_data is
    reduced, but no backward hook marked it."""

    forward = staticmethod(_forward_last_unused)
    grad_sync_by_caller = True


class ForcedDuringReduceNoGrads(GradSyncFunc):
    """GradSyncFunc with a forced param sync while every bucket group's grad reduce is in
    flight, before finish_grad_sync(): the last layer's group got no grads this step, so
    only the reduce in flight says its grad_data is busy."""

    def after_backward(self, s, k, phase):
        _forced_sync(s, phase)


class SkipLastOptimizerGather(Scenario):
    """SkipLastReference without --overlap-param-gather: the optimizer gathers in step(),
    no gather is ever pending. The reference of the scenarios that skip the last layer."""

    forward = staticmethod(_forward_skip_last)
    overlap_param_gather = False


class GatherAfterBackwardNoOverlapGradReduce(GatherAfterBackward):
    """GatherAfterBackward without --overlap-grad-reduce: no grad reduce is in flight when
    the gather starts; only the backward hooks say that grad_data holds grads."""

    overlap_grad_reduce = False


class HooklessGatherBeforeStep(HooklessNoOverlapGradReduce):
    """A hook-less backward, finish_grad_sync() (its grad reduce), then an async
    start_param_sync() before the step: only the grad reduce says that grad_data holds
    grads; the step completes the pending gather."""

    def before_step(self, s, k, phase):
        phase("start_param_sync")
        s.ddp.start_param_sync()


class HooklessForcedBeforeGradSync(HooklessNoOverlapGradReduce):
    """A hook-less backward, then a forced param sync before finish_grad_sync(): nothing
    has said yet that grad_data holds grads (no hook ran, no grad reduce started)."""

    def after_backward(self, s, k, phase):
        _forced_sync(s, phase)


class AccumulateAcrossSteps(Scenario):
    """zero_grad_buffer() before step 0 only: each later step's backward adds onto the
    grads the previous step consumed (a caller that accumulates across optimizer steps)."""

    zero_grad_every_step = False


class AccumulateAcrossStepsOptimizerGather(AccumulateAcrossSteps):
    """AccumulateAcrossSteps without --overlap-param-gather: the optimizer gathers in
    step(), right before the next backward."""

    overlap_param_gather = False


class AllgatherAfterNoSync(Scenario):
    """The optimizer's allgather_params() called directly after a microbatch's backward
    inside no_sync(), with grads accumulated in grad_data and no grad reduce yet."""

    def after_no_sync_backward(self, s, k, phase):
        phase("allgather_params")
        s.opt.allgather_params()


SCENARIOS = {
    "baseline": Baseline,
    "zero_grad": ZeroGradWhilePending,
    "offload": OffloadWhilePending,
    "forward_only": ForwardOnlyProbe,
    "bypass_prehook": BypassPreHook,
    "gather_after_backward": GatherAfterBackward,
    "reentry": StartParamSyncReentry,
    "start_grad_sync": StartGradSyncWhilePending,
    "skip_last_reference": SkipLastReference,
    "baseline_no_ogr": BaselineNoOverlapGradReduce,
    "forced_before_step": ForcedBeforeStep,
    "forced_before_step_no_ogr": ForcedBeforeStepNoOverlapGradReduce,
    "forced_during_reduce": ForcedDuringReduce,
    "forced_after_no_sync": ForcedAfterNoSync,
    "gather_after_no_sync": GatherAfterNoSync,
    "forced_bypass": ForcedWithBypass,
    "gather_then_forced_before_step": GatherThenForcedBeforeStep,
    "hookless_no_ogr": HooklessNoOverlapGradReduce,
    "hookless_forced_before_step_no_ogr": HooklessForcedBeforeStep,
    "grad_sync_func": GradSyncFunc,
    "forced_during_reduce_no_grads": ForcedDuringReduceNoGrads,
    "skip_last_optimizer_gather": SkipLastOptimizerGather,
    "gather_after_backward_no_ogr": GatherAfterBackwardNoOverlapGradReduce,
    "hookless_gather_before_step_no_ogr": HooklessGatherBeforeStep,
    "hookless_forced_before_grad_sync_no_ogr": HooklessForcedBeforeGradSync,
    "allgather_after_no_sync": AllgatherAfterNoSync,
    "accumulate_across_steps": AccumulateAcrossSteps,
    "accumulate_across_steps_optimizer_gather": AccumulateAcrossStepsOptimizerGather,
}
# The same on a model with an expert layer (its own expert-parallel bucket group, gathered
# over the expert-DP group: 2 at EP 1 on 2 ranks).
for _name in ("baseline", "zero_grad", "forward_only", "bypass_prehook", "forced_before_step"):
    SCENARIOS[f"{_name}_moe"] = type(f"{SCENARIOS[_name].__name__}MoE", (SCENARIOS[_name],), {"expert": True})
# Every rule on the expert bucket groups as on the dense ones.
for _name in ("offload", "gather_after_backward", "gather_then_forced_before_step"):
    SCENARIOS[f"{_name}_moe"] = type(f"{SCENARIOS[_name].__name__}MoE", (SCENARIOS[_name],), {"expert": True})
SCENARIOS["gather_into_offloaded"] = GatherIntoOffloaded
SCENARIOS["gather_into_offloaded_moe"] = type("GatherIntoOffloadedMoE", (GatherIntoOffloaded,), {"expert": True})
SCENARIOS["optimizer_gather_moe"] = type("OptimizerGatherMoE", (OptimizerGather,), {"expert": True})
SCENARIOS["fused_wgrad_no_ogr"] = FusedWgradNoOverlapGradReduce
SCENARIOS["fused_wgrad_gather_after_backward_no_ogr"] = FusedWgradGatherAfterBackward
SCENARIOS["fused_wgrad_gather_after_no_sync_no_ogr"] = FusedWgradGatherAfterNoSync
# Without --overlap-grad-reduce (overlap_param_gather alone): the completion of pending
# gathers is keyed on overlap_param_gather.
for _name in ("zero_grad", "offload"):
    SCENARIOS[f"{_name}_no_ogr"] = type(
        f"{SCENARIOS[_name].__name__}NoOverlapGradReduce", (SCENARIOS[_name],), {"overlap_grad_reduce": False}
    )
# The same on one bucket group of a bf16 and an fp32 bucket (Scenario.two_dtypes).
for _name in ("baseline", "zero_grad", "forced_before_step", "gather_after_backward"):
    SCENARIOS[f"{_name}_two_dtypes"] = type(
        f"{SCENARIOS[_name].__name__}TwoDtypes", (SCENARIOS[_name],), {"two_dtypes": True}
    )
# Every gather-starting scenario's twin "<name>_idle": the same gather started right after
# zero_grad_buffer() (Scenario.gather_start "idle"), where grad_data is idle. Which twins a
# test runs is its choice (test_grad_data_guards.py: GATHER_STARTING).
for _name, _cls in list(SCENARIOS.items()):
    if _cls.gather_start is not None:
        SCENARIOS[f"{_name}_idle"] = type(f"{_cls.__name__}Idle", (_cls,), {"gather_start": "idle"})


def run(scenario: Scenario, cfg):
    """Train STEPS steps with `scenario`'s injections; return the record (see module)."""
    s = Setup(
        cfg,
        overlap=scenario.overlap_param_gather,
        expert=scenario.expert,
        overlap_grad_reduce=scenario.overlap_grad_reduce,
        fp32_last_layer=scenario.two_dtypes,
    )
    s.reentry_errors, s.reentry_state_kept = [], []
    set_forward(s, scenario.forward)
    phase = Phase(s, scenario.snap_phases)
    rec = {"main_grads": [], "params": [], "grad_norms": [], "error": None}
    rec.update(error_step=None, error_phase=None, error_is_runtime_error=None)
    rec.update(state_kept=None, pending_state_kept=None)
    k = 0
    spy = GatherReceives(s, phase).__enter__()
    try:
        for k in range(STEPS):
            if k == 0 or scenario.zero_grad_every_step:
                phase("zero_grad_buffer")
                s.ddp.zero_grad_buffer()
                s.opt.zero_grad()
                scenario.after_zero_grad(s, k, phase)
            for mb in range(MICROBATCHES):
                last = mb == MICROBATCHES - 1
                synced = last and not scenario.grad_sync_by_caller
                ctx = contextlib.nullcontext() if synced else s.ddp.no_sync()
                with ctx:
                    phase("forward")
                    out = s.ddp(s.batch(k, mb))
                    if mb == 0:  # the params this step computes with
                        rec["params"].append([p.detach().clone() for p in s.params])
                    phase("backward")
                    scenario.backward(s, out.float().pow(2).mean())
                if not last:
                    scenario.after_no_sync_backward(s, k, phase)
            if scenario.grad_sync_by_caller:
                phase("start_grad_sync")
                s.ddp.start_grad_sync()
            scenario.after_backward(s, k, phase)
            phase("finish_grad_sync")
            s.ddp.finish_grad_sync()
            rec["main_grads"].append(s.main_grads())
            scenario.before_step(s, k, phase)
            phase("optimizer_step")
            rec["grad_norms"].append(float(s.opt.step()[1]))
            scenario.after_step(s, k, phase)
        k = STEPS
        phase("final_forward")
        set_forward(s, _forward_full)
        with torch.no_grad():
            s.ddp(s.batch(k, 0))
        rec["params"].append([p.detach().clone() for p in s.params])
    except Exception as exc:
        if os.environ.get("LAYERWISE_WORKER_DEBUG"):
            traceback.print_exc()
        rec.update(error=f"{type(exc).__name__}: {exc}", error_step=k, error_phase=phase.name)
        rec["error_is_runtime_error"] = isinstance(exc, RuntimeError)
        if phase.snap is not None:
            rec["state_kept"] = all_ranks(state_equals(s, phase.snap))
            rec["pending_state_kept"] = all_ranks(state_equals(s, phase.snap, pending_only=True))
    finally:
        spy.__exit__(None, None, None)
        # A scenario that raised may leave gathers (into grad_data, on pristine 0.19.2) or
        # grad reduces in flight: let them land before this model is freed, so that no
        # late write of gloo's threads hits the next scenario's memory (SIGSEGV by timing).
        with contextlib.suppress(Exception):
            _pending_works(s)
    rec["grad_data_gathers"] = spy.counts["grad_data"]
    rec["temporaries"] = spy.counts["temporary"]
    rec["reentry_errors"] = s.reentry_errors
    rec["reentry_state_kept"] = s.reentry_state_kept
    return rec


def main(argv=None):
    args = worker_arg_parser(__doc__, "output directory", SCENARIOS, "bf16-fp32grad-layers").parse_args(argv)
    out = Path(args.out)
    unknown = [n for n in args.scenarios.split(",") if n not in SCENARIOS]
    if unknown:  # e.g. the "_idle" twin of a scenario that starts no gather
        raise SystemExit(f"unknown scenarios {unknown}; expected some of {sorted(SCENARIOS)}")
    dist.init_process_group(backend="gloo")
    tree = check_expected_tree()
    parallel_state.initialize_model_parallel()
    rank = dist.get_rank()
    summary = {"_meta": {"tree": tree, "world_size": dist.get_world_size()}}
    for cfg in map(parse_config, args.configs.split(",")):
        for name in args.scenarios.split(","):
            if os.environ.get("LAYERWISE_WORKER_DEBUG"):
                print(f"rank {rank}: {cfg.name}/{name}", file=sys.stderr, flush=True)
            rec = run(SCENARIOS[name](), cfg)
            torch.save(rec, out / f"{cfg.name}.{name}.rank{rank}.pt")
            keys = (
                "grad_norms",
                "error",
                "error_step",
                "error_phase",
                "error_is_runtime_error",
                "state_kept",
                "pending_state_kept",
                "temporaries",
                "grad_data_gathers",
                "reentry_errors",
                "reentry_state_kept",
            )
            summary[f"{cfg.name}/{name}"] = {k: rec[k] for k in keys}
            dist.barrier()
    if rank == 0:
        (out / "results.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
