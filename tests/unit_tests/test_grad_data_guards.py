"""grad_data is shared state: public DDP calls while a layer-wise param all-gather is pending.

The series receives the layer-wise param all-gather into the bucket's grad_data, so any
call that writes, frees or reduces grad_data while a gather is in flight reaches the
params. Pristine 0.17.1 received into private temporaries. Each scenario below trains 3
steps on 2 gloo ranks with real DDP and LayerWiseDistributedOptimizer, once on each tree
(tests/unit_tests/grad_data_guard_worker.py), and pins:

- pristine: what it does (correct, or the assertion it trips);
- patched, where the right result is well defined: the params after every step and the
  main_grad of every step, bitwise equal to pristine's;
- patched, where it is not (grads accumulated into a receive slot): a
  LayerwiseParamGatherPendingError (a RuntimeError) that names the bucket group, the
  param all-gather and what to do, raised before anything was changed (params and
  grad_data equal a snapshot taken right before the call that raised).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from harness.launch import torchrun_command
from harness.trees import REPO_ROOT

WORKER = Path(__file__).with_name("grad_data_guard_worker.py")
MANY = "bf16-fp32grad-many"  # about one param per bucket group: chained gathers
ONE = "fp32-fp32grad-one"  # a single bucket
# offload may crash a rank (writes into freed storage): its own run, so that a crash
# fails only its tests.
GROUPS = {
    "main": (
        "baseline,zero_grad,forward_only,bypass_prehook,gather_after_backward,reentry,"
        "start_grad_sync,skip_last_reference",
        (MANY,),
    ),
    "offload": ("offload", (MANY, ONE)),
}
RANKS = (0, 1)
TIMEOUT_S = 600
# A guard error: LayerwiseParamGatherPendingError (a RuntimeError) naming the bucket
# group and the param all-gather, what to do, and that nothing was changed.
GUARD_ERROR = "LayerwiseParamGatherPendingError"
GUARD_MESSAGE = re.compile(
    r"bucket group \(buckets \[.*param all-gather.*(finish_param_sync|finish_grad_sync)"
    r".*(left as they were|Nothing was changed)",
    re.S,
)

pytestmark = [pytest.mark.gloo]

def run_worker(tree, out: Path, scenarios: str, configs) -> dict:
    """Run the worker on 2 gloo ranks importing `tree`; return results.json.

    torchrun stops every rank when one dies (e.g. SIGSEGV), so a crash is an
    AssertionError here, not a hang; TIMEOUT_S bounds the rest.
    """
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = torchrun_command(
        WORKER,
        ["--out", str(out), "--scenarios", scenarios, "--configs", ",".join(configs)],
        nproc=len(RANKS),
        tree=tree,
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
    """get(tree, group) -> (results.json dict, output dir); each run once per module."""
    cache = {}
    tmp = tmp_path_factory.mktemp("guards")

    def get(tree, group):
        if (tree, group) not in cache:
            out = tmp / f"{tree}-{group}"
            scenarios, configs = GROUPS[group]
            cache[(tree, group)] = (run_worker(tree, out, scenarios, configs), out)
        return cache[(tree, group)]

    return get


def record(runs, tree, group, config, scenario):
    """(summary, [per-rank record]) of one scenario (see the worker's docstring)."""
    results, out = runs(tree, group)
    recs = [torch.load(out / f"{config}.{scenario}.rank{r}.pt") for r in RANKS]
    return results[f"{config}/{scenario}"], recs


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


def assert_trains_like_pristine(runs, group, config, scenario):
    ps, p = record(runs, "patched", group, config, scenario)
    us, u = record(runs, "upstream", group, config, scenario)
    assert us["error"] is None, f"pristine raised: {us}"
    assert ps["error"] is None, f"patched raised: {ps}"
    assert len(u[0]["params"]) == 4  # 3 steps + the final forward
    assert_bitwise(p, u, f"{scenario}: patched vs pristine")


def assert_guard_error(summary, step, phases, kept="state_kept"):
    """The patched guard raised a clear error at `step` in one of `phases`, leaving
    params and grad_data (`kept`: all of it, or that of the pending bucket groups) as
    the snapshot before that call."""
    assert summary["error"] is not None, f"no error: the scenario trained silently: {summary}"
    assert summary["error"].startswith(GUARD_ERROR), summary["error"]
    assert summary["error_is_runtime_error"] is True, summary
    assert GUARD_MESSAGE.search(summary["error"]), summary["error"]
    assert summary["error_step"] == step and summary["error_phase"] in phases, summary
    assert summary[kept] is True, f"params or grad_data changed before raising: {summary}"


def assert_pristine_assertion(summary, step, phase):
    assert summary["error"] is not None and summary["error"].startswith("AssertionError"), summary
    assert (summary["error_step"], summary["error_phase"]) == (step, phase), summary


# ----------------------------------------------------------------------------- control
def test_baseline_trees_agree(runs):
    """Control: nothing injected, the trees agree bitwise (3 steps, params and main_grad)."""
    assert_trains_like_pristine(runs, "main", MANY, "baseline")


# --------------------------------------------------- (a) zero_grad_buffer with a gather pending
def test_zero_grad_buffer_with_gather_pending(runs):
    """start_param_sync() after the step, then the next step's zero_grad_buffer() before
    the pre-hooks finish the gathers. Pristine: correct. Patched: equal to pristine."""
    assert_trains_like_pristine(runs, "main", MANY, "zero_grad")


# --------------------------------------- (b) offload/restore of grad buffers with a gather pending
@pytest.mark.parametrize("config", [MANY, ONE])
def test_offload_restore_with_gather_pending(runs, config):
    """start_param_sync(), offload_grad_buffers(), restore_grad_buffers(), next step.
    Pristine: correct. Patched: no crash, equal to pristine."""
    assert_trains_like_pristine(runs, "offload", config, "offload")


def test_offload_restore_with_gather_pending_pristine(runs):
    """Pristine keeps its receive buffers out of grad_data: it trains the 3 steps."""
    for config in (MANY, ONE):
        summary, recs = record(runs, "upstream", "offload", config, "offload")
        assert summary["error"] is None and len(recs[0]["params"]) == 4, summary


# ------------------------------------ (c) forward-only pass leaving a chained gather pending
def test_forward_only_pass_leaves_chained_gather_pending(runs):
    """A no_grad forward over the first layers (pre-hooks on) after each step leaves
    next_param_gather_bucket_group's gather pending into the next step.
    Pristine: correct. Patched: equal to pristine."""
    assert_trains_like_pristine(runs, "main", MANY, "forward_only")


# ----------------------------------- (d) params used without their module's forward pre-hook
def test_prehook_bypass_pristine(runs):
    """Pristine: the bypassed layer's gather is never waited on; the next step's chained
    dispatch trips `assert self.param_gather_handle is None` (step 1, forward)."""
    summary, _ = record(runs, "upstream", "main", MANY, "bypass_prehook")
    assert_pristine_assertion(summary, step=1, phase="forward")


def test_prehook_bypass_raises(runs):
    """F.linear(x, layer.weight) from the parent: backward accumulates into the receive
    slot of a pending gather. Patched: the guard error in step 0 (backward or
    finish_grad_sync); params, and the grad_data of the bucket groups whose gather is
    pending, unchanged (other bucket groups take their grads as usual)."""
    summary, _ = record(runs, "patched", "main", MANY, "bypass_prehook")
    assert_guard_error(
        summary, step=0, phases={"backward", "finish_grad_sync"}, kept="pending_state_kept"
    )


# ------------------------------------- (e) a gather pending in bucket groups that hold grads
def test_gather_after_backward_pristine(runs):
    """Pristine: finish_grad_sync() resets param_gather_dispatched without waiting; the
    next step's first pre-hook trips `assert self.param_gather_handle is None`."""
    summary, _ = record(runs, "upstream", "main", MANY, "gather_after_backward")
    assert_pristine_assertion(summary, step=1, phase="forward")


def test_gather_after_backward_raises(runs):
    """start_param_sync() between the last backward and finish_grad_sync(). Patched: the
    guard error in step 0, before the gather overwrites or zeroes the grads."""
    summary, _ = record(runs, "patched", "main", MANY, "gather_after_backward")
    assert_guard_error(summary, step=0, phases={"start_param_sync", "finish_grad_sync"})


# ------------------------------------------------- start_param_sync with a gather pending
def test_start_param_sync_reentry_pristine(runs):
    """Pristine: a bare AssertionError each step, state unchanged; training goes on."""
    summary, _ = record(runs, "upstream", "main", MANY, "reentry")
    assert summary["error"] is None, summary
    assert summary["reentry_errors"] == ["AssertionError: "] * 3, summary
    assert summary["reentry_state_kept"] == [True] * 3


def test_start_param_sync_reentry(runs):
    """Patched: the second start_param_sync() raises the guard error, changes nothing,
    and the 3 steps equal pristine's."""
    summary, _ = record(runs, "patched", "main", MANY, "reentry")
    assert len(summary["reentry_errors"]) == 3, summary
    for err in summary["reentry_errors"]:
        assert err.startswith(GUARD_ERROR) and GUARD_MESSAGE.search(err), err
    assert summary["reentry_state_kept"] == [True] * 3
    assert_trains_like_pristine(runs, "main", MANY, "reentry")


# -------------------------------------------------- start_grad_sync with a gather pending
def test_start_grad_sync_with_gather_pending_pristine(runs):
    """Pristine: step 0 is right; a module unused in forward leaves its chained gather
    pending past finish_grad_sync, so step 1's chained dispatch trips its assertion
    (with or without the start_grad_sync() call)."""
    for scenario in ("start_grad_sync", "skip_last_reference"):
        summary, _ = record(runs, "upstream", "main", MANY, scenario)
        assert_pristine_assertion(summary, step=1, phase="forward")


def test_start_grad_sync_with_gather_pending(runs):
    """The last layer unused in forward, start_grad_sync() called in step 0. Patched:
    step 0 equals pristine's; all 3 steps equal the same loop without the call."""
    ps, p = record(runs, "patched", "main", MANY, "start_grad_sync")
    _, u = record(runs, "upstream", "main", MANY, "start_grad_sync")
    rs, ref = record(runs, "patched", "main", MANY, "skip_last_reference")
    assert ps["error"] is None and rs["error"] is None, (ps, rs)
    assert_bitwise(p, u, "start_grad_sync step 0: patched vs pristine", steps=1)
    assert_bitwise(p, ref, "start_grad_sync vs without the call (patched)")
