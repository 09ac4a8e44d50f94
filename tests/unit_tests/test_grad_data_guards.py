"""grad_data is shared state: public DDP calls while a layer-wise param all-gather is pending.

The series receives the layer-wise param all-gather into the bucket's grad_data (slots of
the owners of several params, the equal-shares region; a single param is broadcast in
place), so any call that writes, frees or reduces grad_data while a gather is in flight
reaches the params or the grads. Pristine 0.17.1 received into private temporaries. Each
scenario below trains 3 steps on 2 gloo ranks with real DDP and
LayerWiseDistributedOptimizer, once on each tree (tests/unit_tests/
grad_data_guard_worker.py, config bf16-fp32grad-layers: one bucket group per layer, slots
in most of them), and pins:

- pristine: what it does (correct, silently wrong, or the assertion it trips);
- patched, where the right result is well defined (zero_grad_buffer(), offload/restore
  and a forward-only pass with a gather pending; start_param_sync() re-entry; a param
  sync, forced or not, between backward and the step: after backward, during the grad
  all-reduce, after no_sync() microbatches, with and without --overlap-grad-reduce, after
  a backward without DDP's hooks (local CUDA graphs), a forced sync with gathers of
  start_param_sync() pending; a gather pending where no grads were accumulated, at the
  grad reduce): the params after every step and the main_grad of every step, bitwise
  equal to pristine's where pristine is right, and to the run without the call where it
  is not (a forced sync before the step: pristine computes the next step with stale
  params). A gather that meets this step's grads receives into a temporary, as 0.17.1
  does; on the normal path no gather does (the worker classifies every gather collective
  by where its tensors lie, per phase, on every tree);
- patched, where it is not: LayerwiseGradDataConflictError (a RuntimeError) only where
  completing the gather would write into grads: a gather received into grad_data and still
  pending when backward accumulated grads there (its bucket group's start_grad_sync(), or
  a forced param sync); the message names the call and what happened. Under Transformer
  Engine's fused wgrad the GEMM has already added into main_grad then, so nothing is
  claimed about the state there.

Some scenarios run on a model with an expert layer too (suffix _moe: expert-parallel
bucket groups, gathered over the expert-DP group). test_guard_mutants_are_caught runs every
scenario on each guard mutant (tests/mutants/guards/), on both bases (tests/mutants/0.19/).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from harness.launch import CORE_PRELOAD, torchrun_command
from harness.trees import BASES, REPO_ROOT, make_mutant_tree

WORKER = Path(__file__).with_name("grad_data_guard_worker.py")
# Guard mutants: guards/ of a base's mutants folder (test_layerwise_param_sync.py does not
# run them), and its shared zero_grad_buffer_under_pending_gather.patch.
MUTANTS = REPO_ROOT / "tests" / "mutants"
#: Base (harness.trees.BASES) -> its mutants (tests/mutants/0.19/: the same bugs on patches/0.19).
MUTANT_DIRS = {"0.17.1": MUTANTS, "0.19": MUTANTS / "0.19"}
CONFIG = "bf16-fp32grad-layers"
SCENARIOS = (
    "baseline,zero_grad,offload,forward_only,bypass_prehook,gather_after_backward,reentry,"
    "start_grad_sync,skip_last_reference,baseline_no_ogr,forced_before_step,"
    "forced_before_step_no_ogr,forced_during_reduce,forced_after_no_sync,"
    "gather_after_no_sync,forced_bypass,baseline_moe,zero_grad_moe,forward_only_moe,"
    "bypass_prehook_moe,forced_before_step_moe,gather_then_forced_before_step,hookless_no_ogr,"
    "hookless_forced_before_step_no_ogr,grad_sync_func,forced_during_reduce_no_grads,"
    "skip_last_optimizer_gather"
)
RANKS = (0, 1)
TIMEOUT_S = 600
GUARD_ERROR = "LayerwiseGradDataConflictError"


def conflict_message(call):
    """What a guard says (issue 38, D1): the call, the bucket group (its buckets' ids), and
    what happened: its gather went into grad_data before backward wrote grads there."""
    return re.compile(
        re.escape(call) + r": .*all-gather of buckets \[[0-9, ]+\].*into grad_data before "
        r"backward wrote grads there.*would overwrite",
        re.S,
    )


GRAD_SYNC_MESSAGE = conflict_message("start_grad_sync()")
FORCED_PENDING_MESSAGE = conflict_message("start_param_sync(force_sync=True)")

pytestmark = [pytest.mark.gloo]


#: Scenarios left out on a tree, and why. Pristine 0.19.2 gathers into grad_data, and
#: offload_grad_buffers() frees grad_data's storage under the pending gathers: on CPU its
#: torch.cuda.synchronize() (a no-op in the CPU runtime) does not wait for gloo's worker
#: threads as CUDA's waits for NCCL kernels, so a late write into the freed storage kills a
#: rank with SIGSEGV, or not, by timing (on a GPU, by reading, the gather lands and
#: finish_param_sync() later copies from the reallocated grad_data). No result to record.
NOT_RUN_ON = {"upstream-0.19": ("offload",)}


def scenarios_for(tree) -> str:
    """SCENARIOS less NOT_RUN_ON[tree], comma-separated."""
    skip = NOT_RUN_ON.get(str(tree), ())
    return ",".join(s for s in SCENARIOS.split(",") if s not in skip)


def run_worker(tree, out: Path) -> dict:
    """Run every scenario (``scenarios_for``) on 2 gloo ranks importing `tree`; return results.json.

    torchrun stops every rank when one dies (e.g. SIGSEGV), so a crash is an
    AssertionError here, not a hang; TIMEOUT_S bounds the rest.
    """
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = torchrun_command(
        WORKER,
        ["--out", str(out), "--scenarios", scenarios_for(tree), "--configs", CONFIG],
        nproc=len(RANKS),
        tree=tree,
        preload=CORE_PRELOAD,
    )
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO_ROOT
    )
    res = out / "results.json"
    assert proc.returncode == 0 and res.exists(), (
        f"worker failed (rc={proc.returncode}) on {tree}:\n" + (proc.stdout + proc.stderr)[-4000:]
    )
    return json.loads(res.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """get(tree) -> (results.json dict, output dir); each tree run once per module."""
    cache = {}
    tmp = tmp_path_factory.mktemp("guards")

    def get(tree):
        if str(tree) not in cache:
            out = tmp / f"run{len(cache)}"
            cache[str(tree)] = (run_worker(tree, out), out)
        return cache[str(tree)]

    return get


def record(runs, tree, scenario):
    """(summary, [per-rank record]) of one scenario (see the worker's docstring)."""
    results, out = runs(tree)
    recs = [torch.load(out / f"{CONFIG}.{scenario}.rank{r}.pt") for r in RANKS]
    return results[f"{CONFIG}/{scenario}"], recs


def assert_bitwise(got, want, what, steps=None):
    """Per rank: params after each step and main_grad of each step, bitwise equal."""
    for rank, (g, w) in enumerate(zip(got, want)):
        for key in ("params", "main_grads"):
            n = len(w[key]) if steps is None else steps
            assert len(g[key]) >= n and len(w[key]) >= n, (what, key, len(g[key]), len(w[key]))
            for step in range(n):
                bad = [
                    i
                    for i, (x, y) in enumerate(zip(g[key][step], w[key][step]))
                    if not torch.equal(x, y)
                ]
                assert not bad, f"{what}: rank {rank} {key} of step {step} differ at tensors {bad}"
        n = len(w["grad_norms"]) if steps is None else steps
        assert g["grad_norms"][:n] == w["grad_norms"][:n], what


def trains_like(runs, tree, scenario, ref_tree="upstream", ref_scenario=None):
    """`scenario` on `tree` trains 3 steps without error, bitwise equal to `ref_scenario`
    (default: the same) on `ref_tree` (default: pristine)."""
    ref_scenario = ref_scenario or scenario
    ps, p = record(runs, tree, scenario)
    us, u = record(runs, ref_tree, ref_scenario)
    assert us["error"] is None, f"the reference raised: {us}"
    assert ps["error"] is None, f"{tree} raised: {ps}"
    assert len(u[0]["params"]) == 4  # 3 steps + the final forward
    assert_bitwise(p, u, f"{scenario}: {tree} vs {ref_scenario} on {ref_tree}")


def temporaries(runs, tree, scenario):
    """Gather calls of `scenario` on `tree` that received into a temporary (neither
    grad_data nor a param broadcast in place; counted by the worker on every tree)."""
    summary, _ = record(runs, tree, scenario)
    return summary["temporaries"]


def grad_data_gathers(runs, tree, scenario, phase):
    """Gather collectives of `scenario` on `tree` whose tensors lay in grad_data, during
    the calls named `phase` (every tree: counted by the worker around torch.distributed)."""
    summary, _ = record(runs, tree, scenario)
    return summary["grad_data_gathers"].get(phase, 0)


def assert_guard_error(summary, step, phases, message):
    """The guard raised LayerwiseGradDataConflictError (a RuntimeError) at `step` in one
    of `phases`, with a message matching `message`."""
    assert summary["error"] is not None, f"no error: the scenario trained silently: {summary}"
    assert summary["error"].startswith(GUARD_ERROR + ": "), summary["error"]
    assert summary["error_is_runtime_error"] is True, summary
    assert message.search(summary["error"]), summary["error"]
    assert summary["error_step"] == step and summary["error_phase"] in phases, summary


def assert_pristine_assertion(summary, step, phase):
    assert summary["error"] is not None and summary["error"].startswith("AssertionError"), summary
    assert (summary["error_step"], summary["error_phase"]) == (step, phase), summary


# ------------------------------------------- what the patched tree must do, per scenario
def expect_like_pristine_in_grad_data(scenario):
    """Bitwise equal to pristine, every gather received into grad_data (no temporary)."""

    def expect(runs, tree):
        trains_like(runs, tree, scenario)
        assert temporaries(runs, tree, scenario) == 0

    return expect


def expect_reentry(runs, tree):
    """start_param_sync() twice: 0.17.1's bare assertion each step (kept by the series),
    nothing changed by it, and the 3 steps equal pristine's."""
    summary, _ = record(runs, tree, "reentry")
    assert summary["reentry_errors"] == ["AssertionError: "] * 3, summary
    assert summary["reentry_state_kept"] == [True] * 3, summary
    trains_like(runs, tree, "reentry")


def expect_bypass_raises(scenario):
    """F.linear(x, layer.weight) from the parent: the layer's pre-hook never finishes its
    chained gather, backward accumulates into the pending gather's receive buffer: its
    grad sync raises in step 0 (from finish_grad_sync in the first step, from the backward
    hook later)."""

    def expect(runs, tree):
        summary, _ = record(runs, tree, scenario)
        assert_guard_error(summary, 0, {"backward", "finish_grad_sync"}, GRAD_SYNC_MESSAGE)

    return expect


def expect_gather_after_backward_completes(runs, tree):
    """start_param_sync() between backward and finish_grad_sync() receives into
    temporaries (this step's grads are in grad_data) and is left pending: completing it
    writes no grad, so finish_grad_sync() completes it (no error), and the 3 steps equal
    the run without the call bitwise; no gather touched grad_data in that call."""
    trains_like(runs, tree, "gather_after_backward", ref_tree=tree, ref_scenario="baseline")
    assert temporaries(runs, tree, "gather_after_backward") > 0
    assert grad_data_gathers(runs, tree, "gather_after_backward", "start_param_sync") == 0


def expect_skip_last_completes(runs, tree):
    """The last layer unused in forward leaves its chained gather pending in its idle
    grad_data, where backward accumulates nothing: its grad reduce (the caller's
    start_grad_sync() in step 0, or finish_grad_sync()) completes the gather first, and
    the 3 steps equal the same model trained with the optimizer's gather in step(), where
    no gather is ever pending, bitwise."""
    for scenario in ("start_grad_sync", "skip_last_reference"):
        trains_like(runs, tree, scenario, ref_tree=tree, ref_scenario="skip_last_optimizer_gather")


def expect_through_temporaries(scenario, ref_scenario=None):
    """A param sync between backward and the step receives into temporaries (grad_data
    holds this step's grads): bitwise equal to pristine's same scenario, or where pristine
    is wrong (ref_scenario given) to the run without the call."""

    def expect(runs, tree):
        if ref_scenario is None:
            trains_like(runs, tree, scenario)
        else:
            trains_like(runs, tree, scenario, ref_tree=tree, ref_scenario=ref_scenario)
        assert temporaries(runs, tree, scenario) > 0

    return expect


def expect_equal_to_the_run_without_the_calls(scenario, ref_scenario, phases):
    """`scenario` trains 3 steps bitwise equal to `ref_scenario` on the same tree (the run
    without the injected calls), and no gather collective of the injected calls (`phases`)
    touched grad_data: they went through temporaries."""

    def expect(runs, tree):
        trains_like(runs, tree, scenario, ref_tree=tree, ref_scenario=ref_scenario)
        for phase in phases:
            n = grad_data_gathers(runs, tree, scenario, phase)
            assert n == 0, f"{scenario} on {tree}: {n} gathers in grad_data during {phase}"

    return expect


def expect_forced_bypass_raises(runs, tree):
    """A gather left pending by a bypassed pre-hook, backward accumulated into grad_data,
    then a forced param sync: it raises (at step 0) instead of copying out or zeroing what
    backward added to."""
    summary, _ = record(runs, tree, "forced_bypass")
    assert_guard_error(summary, 0, {"forced_param_sync"}, FORCED_PENDING_MESSAGE)


EXPECT = {
    "baseline": expect_like_pristine_in_grad_data("baseline"),
    "zero_grad": expect_like_pristine_in_grad_data("zero_grad"),
    "offload": expect_like_pristine_in_grad_data("offload"),
    "forward_only": expect_like_pristine_in_grad_data("forward_only"),
    "reentry": expect_reentry,
    "bypass_prehook": expect_bypass_raises("bypass_prehook"),
    "gather_after_backward": expect_gather_after_backward_completes,
    "start_grad_sync": expect_skip_last_completes,
    "baseline_no_ogr": expect_like_pristine_in_grad_data("baseline_no_ogr"),
    "forced_before_step": expect_through_temporaries("forced_before_step", "baseline"),
    "forced_before_step_no_ogr": expect_through_temporaries(
        "forced_before_step_no_ogr", "baseline_no_ogr"
    ),
    "forced_during_reduce": expect_through_temporaries("forced_during_reduce"),
    "forced_after_no_sync": expect_through_temporaries("forced_after_no_sync"),
    "gather_after_no_sync": expect_through_temporaries("gather_after_no_sync"),
    "forced_bypass": expect_forced_bypass_raises,
    "baseline_moe": expect_like_pristine_in_grad_data("baseline_moe"),
    "zero_grad_moe": expect_like_pristine_in_grad_data("zero_grad_moe"),
    "forward_only_moe": expect_like_pristine_in_grad_data("forward_only_moe"),
    "bypass_prehook_moe": expect_bypass_raises("bypass_prehook_moe"),
    "forced_before_step_moe": expect_through_temporaries(
        "forced_before_step_moe", "baseline_moe"
    ),
    # Issue 38, item 1: start_param_sync() after finish_grad_sync() (temporaries), then a
    # forced sync with those gathers pending, then the step.
    "gather_then_forced_before_step": expect_equal_to_the_run_without_the_calls(
        "gather_then_forced_before_step", "baseline", ("start_param_sync", "forced_param_sync")
    ),
    # Item 2: a backward without DDP's hooks (local CUDA graphs), then a forced sync.
    "hookless_no_ogr": expect_like_pristine_in_grad_data("hookless_no_ogr"),
    "hookless_forced_before_step_no_ogr": expect_equal_to_the_run_without_the_calls(
        "hookless_forced_before_step_no_ogr", "hookless_no_ogr", ("forced_param_sync",)
    ),
    # Item 8: a forced sync while a grad reduce is in flight for a group without grads.
    "grad_sync_func": expect_like_pristine_in_grad_data("grad_sync_func"),
    "forced_during_reduce_no_grads": expect_equal_to_the_run_without_the_calls(
        "forced_during_reduce_no_grads", "grad_sync_func", ("forced_param_sync",)
    ),
    "skip_last_optimizer_gather": expect_like_pristine_in_grad_data("skip_last_optimizer_gather"),
}


def test_every_scenario_has_an_expectation():
    assert set(EXPECT) | {"skip_last_reference"} == set(SCENARIOS.split(","))


# ----------------------------------------------------------------------------- control
def test_baseline_trees_agree(runs):
    """Control: nothing injected, the trees agree bitwise (3 steps, params and main_grad),
    with and without --overlap-grad-reduce and with an expert layer; the patched tree
    gathers into grad_data only."""
    for scenario in ("baseline", "baseline_no_ogr", "baseline_moe"):
        EXPECT[scenario](runs, "patched")


# --------------------------------------------------- (a) zero_grad_buffer with a gather pending
def test_zero_grad_buffer_with_gather_pending(runs):
    """start_param_sync() after the step, then the next step's zero_grad_buffer() before
    the pre-hooks finish the gathers. Pristine: correct. Patched: zero_grad_buffer()
    completes the gathers first; equal to pristine (dense and MoE)."""
    EXPECT["zero_grad"](runs, "patched")
    EXPECT["zero_grad_moe"](runs, "patched")


# --------------------------------------- (b) offload/restore of grad buffers with a gather pending
def test_offload_restore_with_gather_pending(runs):
    """start_param_sync(), offload_grad_buffers(), restore_grad_buffers(), next step.
    Pristine: correct (its receive buffers are not grad_data). Patched: offload completes
    the gathers first; equal to pristine."""
    EXPECT["offload"](runs, "patched")


# ------------------------------------ (c) forward-only pass leaving a chained gather pending
def test_forward_only_pass_leaves_chained_gather_pending(runs):
    """A no_grad forward over the first layers (pre-hooks on) after each step leaves
    next_param_gather_bucket_group's gather pending into the next step.
    Pristine: correct. Patched: equal to pristine (dense and MoE)."""
    EXPECT["forward_only"](runs, "patched")
    EXPECT["forward_only_moe"](runs, "patched")


# ----------------------------------- (d) params used without their module's forward pre-hook
def test_prehook_bypass_pristine(runs):
    """Pristine: the bypassed layer's gather is never waited on; the next step's chained
    dispatch trips `assert self.param_gather_handle is None` (step 1, forward)."""
    for scenario in ("bypass_prehook", "bypass_prehook_moe"):
        summary, _ = record(runs, "upstream", scenario)
        assert_pristine_assertion(summary, step=1, phase="forward")


def test_prehook_bypass_raises(runs):
    EXPECT["bypass_prehook"](runs, "patched")
    EXPECT["bypass_prehook_moe"](runs, "patched")


# ----------------------------- (e) a gather started between backward and finish_grad_sync
def test_gather_after_backward_pristine(runs):
    """Pristine: finish_grad_sync() resets param_gather_dispatched without waiting; the
    next step's first pre-hook trips `assert self.param_gather_handle is None`."""
    summary, _ = record(runs, "upstream", "gather_after_backward")
    assert_pristine_assertion(summary, step=1, phase="forward")


def test_gather_after_backward_completes(runs):
    EXPECT["gather_after_backward"](runs, "patched")


# ------------------------------------------------- start_param_sync with a gather pending
def test_start_param_sync_reentry_pristine(runs):
    """Pristine: a bare AssertionError each step, state unchanged; training goes on."""
    summary, _ = record(runs, "upstream", "reentry")
    assert summary["error"] is None, summary
    assert summary["reentry_errors"] == ["AssertionError: "] * 3, summary
    assert summary["reentry_state_kept"] == [True] * 3


def test_start_param_sync_reentry(runs):
    EXPECT["reentry"](runs, "patched")


# -------------------------------------------------- start_grad_sync with a gather pending
def test_start_grad_sync_with_gather_pending_pristine(runs):
    """Pristine: step 0 completes; a module unused in forward leaves its chained gather
    pending past finish_grad_sync, so step 1's chained dispatch trips its assertion (with
    or without the start_grad_sync() call)."""
    for scenario in ("start_grad_sync", "skip_last_reference"):
        summary, _ = record(runs, "upstream", scenario)
        assert_pristine_assertion(summary, step=1, phase="forward")


def test_start_grad_sync_completes_a_gather_where_no_grads_were_accumulated(runs):
    EXPECT["start_grad_sync"](runs, "patched")


# ------------------------------- (f) a param sync between backward and the optimizer step
def test_forced_sync_before_step_pristine_computes_with_stale_params(runs):
    """Pristine trains on without error, but silently wrong: the forced sync marks the
    bucket groups dispatched after finish_grad_sync() has cleared them, so the next
    step's pre-hooks do not gather what the step updated; step 1 computes with the other
    rank's params of before step 0 (they differ from the run without the call)."""
    for scenario, ref in (
        ("forced_before_step", "baseline"),
        ("forced_before_step_no_ogr", "baseline_no_ogr"),
        ("forced_before_step_moe", "baseline_moe"),
    ):
        summary, got = record(runs, "upstream", scenario)
        _, want = record(runs, "upstream", ref)
        assert summary["error"] is None, summary
        assert all(torch.equal(x, y) for x, y in zip(got[0]["params"][0], want[0]["params"][0]))
        assert not all(torch.equal(x, y) for x, y in zip(got[0]["params"][1], want[0]["params"][1]))


def test_forced_sync_before_step(runs):
    """Patched: the forced gathers receive into temporaries (grad_data holds the reduced
    grads the step reads), and step() clears the dispatched mark, so the next step gathers
    its updated params: equal to the run without the call, dense, MoE, and without
    --overlap-grad-reduce."""
    for scenario in ("forced_before_step", "forced_before_step_no_ogr", "forced_before_step_moe"):
        EXPECT[scenario](runs, "patched")


def test_param_sync_during_grad_reduce_and_after_no_sync(runs):
    """A forced sync with the grad all-reduce in flight, a forced and an async sync after a
    no_sync() microbatch's backward: pristine is right (its receive buffers are private);
    patched receives into temporaries there and equals it bitwise."""
    for scenario in ("forced_during_reduce", "forced_after_no_sync", "gather_after_no_sync"):
        us, _ = record(runs, "upstream", scenario)
        assert us["error"] is None, us
        trains_like(runs, "upstream", scenario, ref_scenario="baseline")
        EXPECT[scenario](runs, "patched")


def test_forced_sync_with_a_gather_pending_in_grad_data_raises(runs):
    """Pristine trains on (the forced sync drops the pending gather: the bypassed layer
    keeps stale params, silently). Patched raises."""
    summary, _ = record(runs, "upstream", "forced_bypass")
    assert summary["error"] is None, summary
    EXPECT["forced_bypass"](runs, "patched")


# ------------------------------------------- issue 38: forced syncs the guard must let through
def _series(base):
    """The patched tree of `base`; skips where build/patched-0.19 is missing."""
    if base != "0.17.1":
        _skip_without_019()
    return BASES[base][1]


@pytest.mark.parametrize("base", BASES)
def test_forced_sync_completes_gathers_that_went_to_temporaries(runs, base):
    """Item 1. Per step: backward, finish_grad_sync(), start_param_sync() (grad_data holds
    the reduced grads: temporaries), start_param_sync(force_sync=True) with those gathers
    pending (what disable_forward_pre_hook() does), the step. Completing them writes no
    grad: the forced sync completes them, and the 3 steps equal the run without the two
    calls bitwise (params, main_grad, grad norms), with no gather in grad_data."""
    EXPECT["gather_then_forced_before_step"](runs, _series(base))


def test_forced_sync_after_gathers_to_temporaries_pristine(runs):
    """Item 1 on the pristine trees, for reference. 0.17.1 computes step 0 right (its
    forced sync drops the pending gathers, which hold the params the ranks already have),
    then the next steps with stale params: the sync marked the bucket groups dispatched
    after finish_grad_sync() cleared them (as forced_before_step). 0.19.2 receives the
    gathers into grad_data over the reduced grads and the forced sync drops them without
    zeroing: every step reads param bytes as grads (grad norm 4.155 against 0.267 at step
    0), silently."""
    summary, got = record(runs, "upstream", "gather_then_forced_before_step")
    base, want = record(runs, "upstream", "baseline")
    assert summary["error"] is None, summary
    assert summary["grad_norms"][0] == base["grad_norms"][0]
    assert summary["grad_norms"][1] != base["grad_norms"][1], summary
    assert not all(torch.equal(x, y) for x, y in zip(got[0]["params"][1], want[0]["params"][1]))
    _skip_without_019()
    summary, _ = record(runs, "upstream-0.19", "gather_then_forced_before_step")
    base, _ = record(runs, "upstream-0.19", "baseline")
    assert summary["error"] is None, summary
    assert round(summary["grad_norms"][0], 3) == 4.155 and round(base["grad_norms"][0], 3) == 0.267
    assert summary["grad_data_gathers"].get("start_param_sync", 0) > 0, summary


@pytest.mark.parametrize("base", BASES)
def test_forced_sync_after_a_backward_without_ddp_hooks(runs, base):
    """Item 2. Backward without DDP's backward hooks (as local CUDA graphs run it: grads
    from autograd.grad added into main_grad by hand), finish_grad_sync() (no
    --overlap-grad-reduce: it reduces every bucket group), a forced param sync, the step:
    no hook marked grad_data as holding grads, yet the forced sync must not receive there.
    The 3 steps equal the run without the forced sync bitwise, no gather in grad_data; the
    hook-less run itself equals the run with the hooks."""
    tree = _series(base)
    EXPECT["hookless_no_ogr"](runs, tree)
    trains_like(runs, tree, "hookless_no_ogr", ref_tree=tree, ref_scenario="baseline_no_ogr")
    EXPECT["hookless_forced_before_step_no_ogr"](runs, tree)


def test_forced_sync_after_a_backward_without_ddp_hooks_pristine(runs):
    """Item 2 on the pristine trees, for reference: 0.17.1 receives into temporaries (step
    0 right) but then computes with stale params (the dispatched mark, as
    forced_before_step); 0.19.2 receives into grad_data and zeroes every grad: grad norm
    0.0 at every step."""
    summary, _ = record(runs, "upstream", "hookless_forced_before_step_no_ogr")
    ref, _ = record(runs, "upstream", "hookless_no_ogr")
    assert summary["error"] is None and summary["grad_norms"][0] == ref["grad_norms"][0]
    assert summary["grad_norms"][1] != ref["grad_norms"][1], summary
    _skip_without_019()
    summary, _ = record(runs, "upstream-0.19", "hookless_forced_before_step_no_ogr")
    assert summary["error"] is None and summary["grad_norms"] == [0.0] * 3, summary


@pytest.mark.parametrize("base", BASES)
def test_forced_sync_during_the_grad_reduce_of_a_group_without_grads(runs, base):
    """Item 8, first kind. The caller starts every bucket group's grad reduce
    (start_grad_sync(), as a pipeline schedule's grad_sync_func does after the last
    microbatch), then forces a param sync before finish_grad_sync(); the last layer's
    output is dropped, so its bucket group got no grads and no backward hook marked it:
    only the reduce in flight says its grad_data is busy. The forced gathers go through
    temporaries (no gather in grad_data) and the 3 steps equal the run without the forced
    sync bitwise. Pristine 0.17.1 equals it too (private receive buffers); 0.19.2 zeroes
    every grad."""
    EXPECT["forced_during_reduce_no_grads"](runs, _series(base))
    trains_like(runs, "upstream", "forced_during_reduce_no_grads", ref_scenario="grad_sync_func")
    if base == "0.19":
        summary, _ = record(runs, "upstream-0.19", "forced_during_reduce_no_grads")
        assert summary["grad_norms"] == [0.0] * 3, summary


# ----------------------------------------------------------------------------- mutants
#: Scenarios (EXPECT keys) each guard mutant must fail, and no others. The scenarios let a
#: pending gather's data land before the call under test (wait_for_pending_gathers in the
#: worker), so the outcome does not depend on timing.
GUARD_MUTANT_MUST_FAIL = {
    # zero_grad_buffer() zeroes the received slots before the pre-hooks copy them out:
    # wherever a gather is pending at the next step's zero_grad_buffer() (dispatched after
    # the step, chained by a forward-only pass, left by a refused re-entry).
    "zero_grad_buffer_under_pending_gather": {
        "zero_grad",
        "forward_only",
        "reentry",
        "zero_grad_moe",
        "forward_only_moe",
    },
    # A forced sync ignores that grad_data holds this step's grads (or a grad reduce is
    # writing it) and receives there: wrong grads wherever one runs between backward and
    # the step (after a hook-less backward too), and a gather into grad_data while a
    # group's reduce is in flight.
    "forced_sync_receives_over_grads": {
        "forced_before_step",
        "forced_before_step_no_ogr",
        "forced_during_reduce",
        "forced_after_no_sync",
        "forced_before_step_moe",
        "hookless_forced_before_step_no_ogr",
        "forced_during_reduce_no_grads",
    },
    # step() marks only the dense bucket groups' grads consumed and their gathers due:
    # after a forced sync before the step the expert groups' next gather is skipped (stale
    # expert params, as pristine). Their gathers after the step also get a temporary
    # allocated, but the expert layer's owners hold one param each and broadcast it in
    # place, so no collective uses it (the worker classifies the collectives' tensors).
    "step_marks_only_dense_groups": {"forced_before_step_moe"},
    # Issue 38, item 1 (v5/): the guard raises for any pending gather once grads are in
    # grad_data, also one that received into temporaries: a forced sync, and
    # finish_grad_sync() after a gather started between backward and it, raise where
    # completing is right.
    "guard_raises_over_temporaries": {"gather_then_forced_before_step", "gather_after_backward"},
    # Item 2 (v5/): start_grad_sync() leaves grad_data unmarked, so after a hook-less
    # backward a forced sync before the step receives over the reduced grads.
    "start_grad_sync_leaves_grads_unmarked": {"hookless_forced_before_step_no_ogr"},
}


#: Base -> mutant -> the scenarios it must fail. 0.19: the same, measured mutant by mutant
#: (its series has the same code at each mutated line; step_marks_only_dense_groups mutates
#: step_with_ready_grads(), 0.19's step; the v5/ mutants are the same bugs); no mutant is
#: skipped. The references stay
#: pristine 0.17.1 (EXPECT), which 0.19 + its series equals bitwise in every scenario
#: (test_019_series_equals_the_0171_series_in_every_scenario); pristine 0.19.2 is wrong in
#: some (it zeroes the grads of a forced sync before the step).
GUARD_MUTANT_MUST_FAIL_BY_BASE = {
    "0.17.1": GUARD_MUTANT_MUST_FAIL,
    "0.19": {mutant: set(scenarios) for mutant, scenarios in GUARD_MUTANT_MUST_FAIL.items()},
}


#: Mutants of issue 38's items (v5/ of a base's mutants folder) that other files run:
#: item 3's, in test_layerwise_param_sync.py.
V5_MUTANTS_ELSEWHERE = {"collective_follows_private_state"}


def mutant_patch(name, base="0.17.1"):
    """The base's guard mutant `name`: in guards/ or v5/ of its mutants folder, else shared
    there."""
    for folder in ("guards", "v5"):
        patch = MUTANT_DIRS[base] / folder / f"{name}.patch"
        if patch.exists():
            return patch
    return MUTANT_DIRS[base] / f"{name}.patch"


@pytest.mark.parametrize("base", BASES)
def test_guard_mutants_exist(base):
    must_fail = GUARD_MUTANT_MUST_FAIL_BY_BASE[base]
    assert {p.stem for p in (MUTANT_DIRS[base] / "guards").glob("*.patch")} <= set(must_fail)
    v5 = {p.stem for p in (MUTANT_DIRS[base] / "v5").glob("*.patch")}
    assert v5 - V5_MUTANTS_ELSEWHERE <= set(must_fail) and V5_MUTANTS_ELSEWHERE <= v5, v5
    assert all(mutant_patch(m, base).is_file() for m in must_fail)


def failed_expectations(runs, tree):
    """The EXPECT scenarios whose expectation fails on `tree`."""
    got = set()
    for scenario, expect in EXPECT.items():
        try:
            expect(runs, tree)
        except AssertionError:
            got.add(scenario)
    return got


@pytest.mark.parametrize(
    "base,mutant", [(b, m) for b in BASES for m in sorted(GUARD_MUTANT_MUST_FAIL_BY_BASE[b])]
)
def test_guard_mutants_are_caught(runs, tmp_path, base, mutant):
    if base != "0.17.1":
        _skip_without_019()
    tree = make_mutant_tree(mutant_patch(mutant, base), tmp_path / "tree", BASES[base][1])
    got = failed_expectations(runs, tree)
    want = GUARD_MUTANT_MUST_FAIL_BY_BASE[base][mutant]
    assert got == want, f"not failed {sorted(want - got)}; failed unexpectedly {sorted(got - want)}"


# ------------------------------------------------------------------ the 0.19 base
def _skip_without_019():
    if not (REPO_ROOT / "build" / "patched-0.19" / "megatron" / "core").is_dir():
        pytest.skip("build/patched-0.19 is missing; run scripts/setup.sh")


def test_019_series_equals_the_0171_series_in_every_scenario(runs):
    """0.19.2 + patches/0.19 against 0.17.1 + patches/0.17.1, every scenario: the same
    outcome (the same error, step and phase where the guards raise, state kept alike),
    the same receive temporaries, and bitwise the same params, main_grads and grad norms
    at every step. The guard contract, checked scenario by scenario above on 0.17.1, then
    holds on 0.19 too."""
    _skip_without_019()
    for scenario in SCENARIOS.split(","):
        s19, r19 = record(runs, "patched-0.19", scenario)
        s17, r17 = record(runs, "patched", scenario)
        assert {k: v for k, v in s19.items() if k != "grad_norms"} == {k: v for k, v in s17.items() if k != "grad_norms"}, (
            scenario, s19, s17)
        assert_bitwise(r19, r17, f"{scenario}: 0.19 series vs 0.17.1 series")


def test_019_pristine_forced_sync_before_step_zeroes_every_grad(runs):
    """Pristine 0.19.2 (#3751 + #4609 on its legacy path): a forced param sync between
    finish_grad_sync() and step() receives into grad_data and zeroes each gathered
    bucket's whole grad_data, so every step's grad norm is 0.0, silently: dense, MoE,
    without --overlap-grad-reduce, and during the grad all-reduce. 0.17.1 keeps the
    grads there (it receives into temporaries); the 0.19 series equals its run without
    the call (test above)."""
    _skip_without_019()
    baseline, _ = record(runs, "upstream-0.19", "baseline")
    assert baseline["error"] is None and all(n > 0 for n in baseline["grad_norms"]), baseline
    for scenario in ("forced_before_step", "forced_before_step_no_ogr", "forced_before_step_moe",
                     "forced_during_reduce"):
        summary, _ = record(runs, "upstream-0.19", scenario)
        assert summary["error"] is None and summary["grad_norms"] == [0.0] * 3, (scenario, summary)
        ok, _ = record(runs, "upstream", scenario)
        assert all(n > 0 for n in ok["grad_norms"]), (scenario, ok)


def test_019_every_expectation_holds_on_the_series(runs):
    """Control of the 0.19 guard mutants: every scenario's expectation (EXPECT, references
    pristine 0.17.1) holds on 0.19 + its series."""
    _skip_without_019()
    assert not failed_expectations(runs, "patched-0.19")


def test_019_series_trains_like_pristine_019_where_it_is_right(runs):
    """The runs without a hazard: 0.19 + series bitwise equal to pristine 0.19.2."""
    _skip_without_019()
    for scenario in ("baseline", "baseline_no_ogr", "baseline_moe"):
        trains_like(runs, "patched-0.19", scenario, ref_tree="upstream-0.19")
