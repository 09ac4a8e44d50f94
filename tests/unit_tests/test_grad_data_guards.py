"""grad_data is shared state: public DDP calls while a layer-wise param all-gather is pending.

The series receives the layer-wise param all-gather into the bucket's grad_data (slots of
the owners of several params, the equal-shares region; a single param is broadcast in
place), so any call that writes, frees or reduces grad_data while a gather is in flight
reaches the params or the grads. Pristine 0.17.1 received into private temporaries. Each
scenario below trains 3 steps on 2 gloo ranks with real DDP and
LayerWiseDistributedOptimizer, once on each tree (tests/unit_tests/
grad_data_guard_worker.py, config bf16-fp32grad-layers: one bucket group per layer, slots
in most of them), and pins:

- pristine: what it does (correct, or the assertion it trips);
- patched, where the right result is well defined (zero_grad_buffer(), offload/restore
  and a forward-only pass with a gather pending; start_param_sync() re-entry): the params
  after every step and the main_grad of every step, bitwise equal to pristine's;
- patched, where it is not: LayerwiseGradDataConflictError (a RuntimeError) from the call
  that found the conflict, naming it and what went wrong. Raised by start_param_sync()
  before it changes anything; by start_grad_sync() only once backward has run (under
  Transformer Engine's fused wgrad the GEMM has already added into main_grad then), so
  nothing is claimed about the state there.

test_guard_mutants_are_caught runs the same scenarios on the mutant that zeroes grad_data
under a pending gather.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from harness.launch import CORE_PRELOAD, torchrun_command
from harness.trees import REPO_ROOT, make_mutant_tree

WORKER = Path(__file__).with_name("grad_data_guard_worker.py")
MUTANTS = REPO_ROOT / "tests" / "mutants"
CONFIG = "bf16-fp32grad-layers"
SCENARIOS = (
    "baseline,zero_grad,offload,forward_only,bypass_prehook,gather_after_backward,reentry,"
    "start_grad_sync,skip_last_reference"
)
RANKS = (0, 1)
TIMEOUT_S = 600
GUARD_ERROR = "LayerwiseGradDataConflictError"
# What each guard says: the call, what it found, and (start_param_sync) what to do.
GRAD_SYNC_MESSAGE = re.compile(
    r"start_grad_sync\(\): a layer-wise param all-gather into grad_data was still pending "
    r".*forward pre-hook.*did not run in forward",
    re.S,
)
PARAM_SYNC_MESSAGE = re.compile(
    r"start_param_sync\(\): grad_data holds grads of this step .*no optimizer step has "
    r"consumed yet.*Start it after the optimizer step",
    re.S,
)

pytestmark = [pytest.mark.gloo]


def run_worker(tree, out: Path) -> dict:
    """Run every scenario on 2 gloo ranks importing `tree`; return results.json.

    torchrun stops every rank when one dies (e.g. SIGSEGV), so a crash is an
    AssertionError here, not a hang; TIMEOUT_S bounds the rest.
    """
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = torchrun_command(
        WORKER,
        ["--out", str(out), "--scenarios", SCENARIOS, "--configs", CONFIG],
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


def trains_like_pristine(runs, tree, scenario):
    ps, p = record(runs, tree, scenario)
    us, u = record(runs, "upstream", scenario)
    assert us["error"] is None, f"pristine raised: {us}"
    assert ps["error"] is None, f"{tree} raised: {ps}"
    assert len(u[0]["params"]) == 4  # 3 steps + the final forward
    assert_bitwise(p, u, f"{scenario}: {tree} vs pristine")


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
def expect_reentry(runs, tree):
    """start_param_sync() twice: 0.17.1's bare assertion each step (kept by the series),
    nothing changed by it, and the 3 steps equal pristine's."""
    summary, _ = record(runs, tree, "reentry")
    assert summary["reentry_errors"] == ["AssertionError: "] * 3, summary
    assert summary["reentry_state_kept"] == [True] * 3, summary
    trains_like_pristine(runs, tree, "reentry")


def expect_bypass_raises(runs, tree):
    """F.linear(x, layer.weight) from the parent: the layer's pre-hook never finishes its
    chained gather, backward accumulates into the pending gather's receive buffer: its
    grad sync raises in step 0 (from finish_grad_sync in the first step, from the backward
    hook later)."""
    summary, _ = record(runs, tree, "bypass_prehook")
    assert_guard_error(summary, 0, {"backward", "finish_grad_sync"}, GRAD_SYNC_MESSAGE)


def expect_gather_after_backward_raises(runs, tree):
    """start_param_sync() between backward and finish_grad_sync() would receive over the
    unreduced grads: it raises before anything is changed (params and grad_data equal the
    snapshot taken right before the call)."""
    summary, _ = record(runs, tree, "gather_after_backward")
    assert_guard_error(summary, 0, {"start_param_sync"}, PARAM_SYNC_MESSAGE)
    assert summary["state_kept"] is True, f"the refused call changed state: {summary}"


def expect_start_grad_sync_raises(runs, tree):
    """The last layer unused in forward leaves its chained gather pending, receiving into
    the grad_data its bucket group is about to reduce: the caller's start_grad_sync()
    raises in step 0; without the call, finish_grad_sync() does (first step)."""
    for scenario, phase in (
        ("start_grad_sync", "start_grad_sync"),
        ("skip_last_reference", "finish_grad_sync"),
    ):
        summary, _ = record(runs, tree, scenario)
        assert (summary["error"] or "").startswith(GUARD_ERROR + ": start_grad_sync(): "), summary
        assert (summary["error_step"], summary["error_phase"]) == (0, phase), summary
        assert summary["error_is_runtime_error"] is True


EXPECT = {
    "baseline": lambda runs, tree: trains_like_pristine(runs, tree, "baseline"),
    "zero_grad": lambda runs, tree: trains_like_pristine(runs, tree, "zero_grad"),
    "offload": lambda runs, tree: trains_like_pristine(runs, tree, "offload"),
    "forward_only": lambda runs, tree: trains_like_pristine(runs, tree, "forward_only"),
    "reentry": expect_reentry,
    "bypass_prehook": expect_bypass_raises,
    "gather_after_backward": expect_gather_after_backward_raises,
    "start_grad_sync": expect_start_grad_sync_raises,
}


# ----------------------------------------------------------------------------- control
def test_baseline_trees_agree(runs):
    """Control: nothing injected, the trees agree bitwise (3 steps, params and main_grad)."""
    EXPECT["baseline"](runs, "patched")


# --------------------------------------------------- (a) zero_grad_buffer with a gather pending
def test_zero_grad_buffer_with_gather_pending(runs):
    """start_param_sync() after the step, then the next step's zero_grad_buffer() before
    the pre-hooks finish the gathers. Pristine: correct. Patched: zero_grad_buffer()
    completes the gathers first; equal to pristine."""
    EXPECT["zero_grad"](runs, "patched")


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
    Pristine: correct. Patched: equal to pristine."""
    EXPECT["forward_only"](runs, "patched")


# ----------------------------------- (d) params used without their module's forward pre-hook
def test_prehook_bypass_pristine(runs):
    """Pristine: the bypassed layer's gather is never waited on; the next step's chained
    dispatch trips `assert self.param_gather_handle is None` (step 1, forward)."""
    summary, _ = record(runs, "upstream", "bypass_prehook")
    assert_pristine_assertion(summary, step=1, phase="forward")


def test_prehook_bypass_raises(runs):
    EXPECT["bypass_prehook"](runs, "patched")


# ----------------------------- (e) a gather started between backward and finish_grad_sync
def test_gather_after_backward_pristine(runs):
    """Pristine: finish_grad_sync() resets param_gather_dispatched without waiting; the
    next step's first pre-hook trips `assert self.param_gather_handle is None`."""
    summary, _ = record(runs, "upstream", "gather_after_backward")
    assert_pristine_assertion(summary, step=1, phase="forward")


def test_gather_after_backward_raises(runs):
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


def test_start_grad_sync_with_gather_pending(runs):
    EXPECT["start_grad_sync"](runs, "patched")


# ----------------------------------------------------------------------------- mutants
#: Scenarios (EXPECT keys) each guard mutant must fail, and no others. The scenarios let a
#: pending gather's data land before the call under test (wait_for_pending_gathers in the
#: worker), so the outcome does not depend on timing.
GUARD_MUTANT_MUST_FAIL = {
    # zero_grad_buffer() zeroes the received slots before the pre-hooks copy them out:
    # wherever a gather is pending at the next step's zero_grad_buffer() (dispatched after
    # the step, chained by a forward-only pass, left by a refused re-entry).
    "zero_grad_buffer_under_pending_gather": {"zero_grad", "forward_only", "reentry"},
}


def test_guard_mutants_exist():
    assert all((MUTANTS / f"{m}.patch").is_file() for m in GUARD_MUTANT_MUST_FAIL)


@pytest.mark.parametrize("mutant", sorted(GUARD_MUTANT_MUST_FAIL))
def test_guard_mutants_are_caught(runs, tmp_path, mutant):
    tree = make_mutant_tree(MUTANTS / f"{mutant}.patch", tmp_path / "tree")
    got = set()
    for scenario, expect in EXPECT.items():
        try:
            expect(runs, tree)
        except AssertionError:
            got.add(scenario)
    want = GUARD_MUTANT_MUST_FAIL[mutant]
    assert got == want, f"not failed {sorted(want - got)}; failed unexpectedly {sorted(got - want)}"
