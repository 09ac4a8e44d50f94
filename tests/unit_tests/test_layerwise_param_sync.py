"""Unit tests of the series: the layer-wise param all-gather received into grad_data.

Real megatron-core objects on several gloo ranks (CPU runtime layer): DDP built the way
training builds it, so `main_grad` IS a view into `grad_data` (upstream's own tests
replaced main_grad with a clone, which hid the zeroing bug of PR #3751). The ranks run
tests/unit_tests/layerwise_worker.py under torchrun, once per (tree, world size); the
tests below assert on its JSON results.

Every check runs on the patched tree. Where the behaviour differs, the pristine tree is
run too and the test pins what it does (marked "pristine:" in the docstring): a crash,
stale params, or the temporaries the series removes. tests/mutants
holds deliberate bugs; test_mutants_are_caught shows that these tests catch them.
"""

from __future__ import annotations

import difflib
import json
import time
from pathlib import Path

import pytest

from harness.launch import LaunchError, run_command, torchrun_command
from harness.ranks import FIRST_FAILURE
from harness.trees import (
    REPO_ROOT,
    make_mutant_tree,
    make_prefix_tree,
    series_patches,
)

WORKER = Path(__file__).with_name("layerwise_worker.py")
PROGRESS = "[layerwise_worker] done"  # the worker's per-scenario progress line
MUTANTS = REPO_ROOT / "tests" / "mutants"
CONFIGS = ("bf16-fp32grad-many", "fp32-fp32grad-one")
MAIN_SCENARIOS = "gather,microbatches,training,forced_sync,free_overlap_buffers,offload,alloc"

pytestmark = [pytest.mark.gloo]


def launch_worker(tree, nproc, out: Path, scenarios, configs=CONFIGS, expert_parallel=1, extra_env=None):
    """Run the worker on `nproc` gloo ranks importing `tree`, logs next to `out`.

    The run is killed when no scenario finishes for 5 x the slowest one so far (at
    least 180 s, start-up included in the first): a limit from the measured pace.

    Raises:
        LaunchError: a rank failed (with the first failing rank's traceback), or a stall.
    """
    cmd, env = torchrun_command(
        WORKER,
        [
            "--out",
            str(out),
            "--scenarios",
            scenarios,
            "--configs",
            ",".join(configs),
            "--expert-parallel",
            str(expert_parallel),
        ],
        nproc,
        tree=tree,
        extra_env=extra_env,
    )
    return run_command(
        cmd,
        env,
        run_dir=out.with_suffix(".logs"),
        timeout_s=None,
        what=f"layerwise worker on {tree} x{nproc}",
        tail_lines=80,
        progress_marker=PROGRESS,
    )


def first_failure(error: LaunchError) -> str:
    """The worker's first-failing-rank block from a LaunchError's log, or the message."""
    stderr = error.stderr_path.read_text(errors="replace") if error.stderr_path else ""
    start = stderr.find(FIRST_FAILURE)
    return stderr[start : stderr.find("=== end ===", start)] if start >= 0 else str(error)


def run_worker(tree, nproc, out: Path, scenarios, configs=CONFIGS, expert_parallel=1):
    """``launch_worker`` and its JSON results.

    Raises:
        AssertionError: a rank failed or the worker wrote no results (with the first
            failing rank's traceback and the log tail).
    """
    try:
        launch_worker(tree, nproc, out, scenarios, configs, expert_parallel)
    except LaunchError as exc:
        raise AssertionError(f"{first_failure(exc)}\n{exc}") from None
    assert out.exists(), f"worker wrote no results on {tree} x{nproc}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Lazily computed worker results, keyed by (tree, nproc, scenarios, ep)."""
    cache = {}
    tmp = tmp_path_factory.mktemp("layerwise")

    def get(tree, nproc, scenarios=MAIN_SCENARIOS, configs=CONFIGS, ep=1):
        key = (str(tree), nproc, scenarios, tuple(configs), ep)
        if key not in cache:
            out = tmp / f"r{len(cache)}.json"
            cache[key] = run_worker(tree, nproc, out, scenarios, configs, ep)
        return cache[key]

    return get


def result(results, config, scenario):
    r = results[f"{config}/{scenario}"]
    assert "error" not in r, f"{config}/{scenario} raised: {r['error']}"
    return r


WORLDS = [2, 4]
CASES = [(w, c) for w in WORLDS for c in CONFIGS]


@pytest.mark.parametrize("world,config", CASES)
def test_gathered_params_equal_owner_values(runs, world, config):
    """Uneven per-rank shares; bf16 params with fp32 grads and fp32/fp32; many small
    buckets (including buckets where a rank owns nothing) and a single bucket."""
    r = result(runs("patched", world), config, "gather")
    assert r["params_equal_owner_values"]
    if config.endswith("many"):
        assert r["num_buckets"] >= 10
        assert r["buckets_with_empty_rank_slot"] > 0, "no bucket exercised an empty rank slot"


@pytest.mark.parametrize("world,config", CASES)
def test_grad_data_zero_after_gather_and_main_grad_matches_overlap_off(runs, world, config):
    r = result(runs("patched", world), config, "gather")
    assert r["grad_data_zero_after_gather"]
    assert r["main_grad_equals_overlap_off"], f"max |diff| = {r['main_grad_max_abs_diff']}"


@pytest.mark.parametrize("world,config", CASES)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_microbatch_accumulation(runs, world, config, n):
    """Grads over n microbatches equal overlap-off (bitwise) and the per-microbatch sum."""
    r = result(runs("patched", world), config, "microbatches")
    assert r[f"mb{n}_equals_overlap_off"], r[f"mb{n}_max_abs_diff"]
    assert r[f"mb{n}_equals_sum_of_microbatches"], r[f"mb{n}_sum_max_abs_diff"]


@pytest.mark.parametrize("world,config", CASES)
def test_training_steps_equal_the_pristine_tree(runs, world, config):
    """4 real optimizer steps, overlapped gather and the optimizer's synchronous gather:
    params (sha256 of their bytes) and grad norms equal the pristine tree's, which
    receives into fresh temporaries and never touches grad_data; and equal each other."""
    r = result(runs("patched", world), config, "training")
    u = result(runs("upstream", world), config, "training")
    for path in ("overlap", "sync"):
        assert r[f"params_sha256_{path}"] == u[f"params_sha256_{path}"], f"{path} params differ from pristine"
        assert r[f"grad_norms_{path}"] == u[f"grad_norms_{path}"], (path, r[f"grad_norms_{path}"], u)
    assert r["params_overlap_equal_sync"], r["params_max_abs_diff"]
    assert r["params_equal_across_ranks"]


@pytest.mark.parametrize("world,config", CASES)
def test_zero_temporaries_in_layerwise_param_sync(runs, world, config):
    """Patched: 0 bytes and 0 allocator calls on the async, forced and optimizer paths.
    The CPU runtime layer's uneven all_gather alone allocates 0 bytes (control), so the
    count is the series' own. Pristine: exactly the theoretical temporaries (> 0)."""
    p = result(runs("patched", world), config, "alloc")
    for path in ("async", "forced", "optimizer"):
        assert p[f"{path}_bytes"] == 0 and p[f"{path}_alloc_calls"] == 0, p
        assert p[f"{path}_params_synced"]
    assert p["runtime_layer_all_gather_bytes"] == 0
    u = result(runs("upstream", world), config, "alloc")
    assert u["runtime_layer_all_gather_bytes"] == 0
    assert u["theory_upstream_bytes"] > 0
    assert u["async_bytes"] == u["forced_bytes"] == u["theory_upstream_bytes"], u
    assert u["optimizer_bytes"] == u["theory_upstream_optimizer_bytes"] > 0, u


@pytest.mark.parametrize("world,config", CASES)
def test_forced_sync(runs, world, config):
    """Forced sync (eval/checkpoint) idle and with a gather pending: params synced,
    grad_data zero, the next pre-hook neither re-gathers nor skips a needed gather.
    Pristine: a forced sync with a gather pending drops the data (params stay stale)."""
    r = result(runs("patched", world), config, "forced_sync")
    bad = [k for k, v in r.items() if v is not True]
    assert not bad, f"failed checks: {bad}"
    u = result(runs("upstream", world), config, "forced_sync")
    assert u["idle_params_synced"] and not u["pending_params_synced"]


@pytest.mark.parametrize("world,config", CASES)
def test_free_overlap_buffers_with_pending_gather(runs, world, config):
    """Pristine: free_overlap_buffers() drops a pending gather; params stay stale even
    after the next forward (param_gather_dispatched says they are synced)."""
    r = result(runs("patched", world), config, "free_overlap_buffers")
    bad = [k for k, v in r.items() if v is not True]
    assert not bad, f"failed checks: {bad}"
    u = result(runs("upstream", world), config, "free_overlap_buffers")
    assert not u["params_synced_after_forward"]


@pytest.mark.parametrize("world,config", CASES)
def test_offload_sync_restore(runs, world, config):
    """offload_grad_buffers() -> forced sync -> restore: temporary receive buffer, warned
    once per bucket, storage never written, grads right after restore."""
    r = result(runs("patched", world), config, "offload")
    bad = [k for k, v in r.items() if v is not True and k != "fallback_warnings"]
    assert not bad, f"failed checks: {bad}"
    assert r["fallback_warnings"] >= 1


def test_one_rank_failure_ends_the_run_fast_with_its_traceback(tmp_path):
    """Rank 1 raises at the start of a scenario while rank 0 is inside its collectives:
    the run fails within 60 s of the failure (not at the process-group timeout), and the
    report names rank 1 and holds its traceback."""
    with pytest.raises(LaunchError) as info:
        launch_worker("patched", 2, tmp_path / "r.json", "gather", CONFIGS[:1],
                      extra_env={"LAYERWISE_WORKER_FAIL": "gather:1"})
    ended = time.time()
    report = first_failure(info.value)
    assert report.startswith(f"{FIRST_FAILURE}: 1 "), report
    assert "Traceback" in report and "forced failure of bf16-fp32grad-many/gather on rank 1" in report
    failed_at = float(report.split("at t=", 1)[1].split(":", 1)[0])
    assert ended - failed_at < 60, f"the run ended {ended - failed_at:.0f} s after rank 1 failed"


def test_dp_size_1(runs):
    """DP=1: optimizer builds and trains, overlap == sync. Pristine: TypeError while
    building the optimizer (set_bucket_layerwise_params_list zips over None)."""
    r = result(runs("patched", 1, "small_dp,gather,alloc"), CONFIGS[0], "small_dp")
    assert r["trains"] and r["params_overlap_equal_sync"] and r["grad_norms_equal"]
    a = result(runs("patched", 1, "small_dp,gather,alloc"), CONFIGS[0], "alloc")
    assert a["async_bytes"] == a["forced_bytes"] == a["optimizer_bytes"] == 0
    u = runs("upstream", 1, "small_dp,gather,alloc")[f"{CONFIGS[0]}/small_dp"]
    assert u.get("error", "").startswith("TypeError"), u


def test_expert_dp_size_1(runs):
    """EP=2 on 2 ranks gives expert-DP size 1: trains, overlap == sync.
    Pristine: TypeError from max(None) in the first forward pre-hook."""
    r = result(runs("patched", 2, "expert_dp1", CONFIGS[:1], ep=2), CONFIGS[0], "expert_dp1")
    assert r["trains"] and r["params_overlap_equal_sync"] and r["grad_norms_equal"]
    u = runs("upstream", 2, "expert_dp1", CONFIGS[:1], ep=2)[f"{CONFIGS[0]}/expert_dp1"]
    assert u.get("error", "").startswith("TypeError"), u


def _failed_checks(results):
    """Names of every failed boolean check (or error) in a worker result."""
    failed = []
    for key, checks in results.items():
        if key == "_meta":
            continue
        if "error" in checks:
            failed.append(f"{key}: {checks['error']}")
        failed += [f"{key}.{c}" for c, v in checks.items() if v is False]
    return failed


# The checks each mutant must fail, by "scenario.check" (2 ranks, CONFIGS[0]), and no
# others: a mutant that fails something else (a crash, an import error) fails the test.
MUTANT_SCENARIOS = "gather,microbatches,training,forced_sync,free_overlap_buffers"
_PARAMS_STALE = {
    "gather.params_equal_owner_values",
    "forced_sync.idle_params_synced",
    "forced_sync.params_still_synced_after_forward",
    "forced_sync.next_step_gathers_fresh_values",
    "forced_sync.pending_params_synced",
    "forced_sync.pending_params_synced_after_forward",
    "free_overlap_buffers.params_synced",
    "free_overlap_buffers.params_synced_after_forward",
}
_GRADS_WRONG = {"gather.main_grad_equals_overlap_off"} | {
    f"microbatches.mb{n}_{c}"
    for n in (1, 2, 4)
    for c in ("equals_overlap_off", "equals_sum_of_microbatches")
}
_TRAINING_DIVERGES = {"training.params_overlap_equal_sync", "training.grad_norms_equal"}
_DIRTY_AFTER_SYNC = {
    "forced_sync.idle_written_region_zero_rest_untouched",
    "forced_sync.pending_grad_data_zero",
    "free_overlap_buffers.grad_data_zero",
}
_RANKS_DIFFER = {"training.params_equal_across_ranks"}
MUTANT_MUST_FAIL = {
    # Backward accumulates onto the gathered bytes; every sync leaves grad_data dirty.
    "no_zeroing": {"gather.grad_data_zero_after_gather"}
    | _DIRTY_AFTER_SYNC
    | _GRADS_WRONG
    | _TRAINING_DIVERGES,
    # Only syncs that no pre-hook completes leave grad_data dirty; numerics unchanged.
    "zeroing_only_in_pre_hooks": _DIRTY_AFTER_SYNC,
    # Rank 1's params stay stale everywhere; both training paths skip them alike, so
    # overlap == sync still holds, but the ranks disagree.
    "copy_back_skips_rank1": _PARAMS_STALE | _GRADS_WRONG | _RANKS_DIFFER,
    # Wrong data in the params (equal-width padded slots, so no size error).
    "slot_offset_shifted": _PARAMS_STALE | _GRADS_WRONG | _TRAINING_DIVERGES | _RANKS_DIFFER,
    "padded_slots_at_exact_offsets": _PARAMS_STALE
    | _GRADS_WRONG
    | _TRAINING_DIVERGES
    | _RANKS_DIFFER,
}


def assert_mutant_fails_exactly(runs, tree, must_fail):
    """Run the mutant tree's checks; AssertionError unless exactly `must_fail` fail
    (a worker that cannot start, e.g. a broken import, raises from run_worker)."""
    res = runs(tree, 2, MUTANT_SCENARIOS, CONFIGS[:1])
    failed = {f.split("/", 1)[1] for f in _failed_checks(res)}
    missed, extra = must_fail - failed, failed - must_fail
    assert (
        not missed and not extra
    ), f"mutant checks differ: not failed {sorted(missed)}; failed unexpectedly {sorted(extra)}"


def test_every_mutant_has_its_checks():
    assert set(MUTANT_MUST_FAIL) == {p.stem for p in MUTANTS.glob("*.patch")}


@pytest.mark.parametrize("mutant", sorted(MUTANT_MUST_FAIL))
def test_mutants_are_caught(runs, tmp_path, mutant):
    """Each planted bug fails exactly the checks named for it (2 ranks)."""
    tree = make_mutant_tree(MUTANTS / f"{mutant}.patch", tmp_path / "tree")
    assert_mutant_fails_exactly(runs, tree, MUTANT_MUST_FAIL[mutant])


def test_mutant_with_a_broken_import_fails_the_mutant_check(runs, tmp_path):
    """A mutant that breaks the import must not count as caught."""
    rel = "megatron/core/distributed/param_and_grad_buffer.py"
    old = (REPO_ROOT / rel).read_text().splitlines(keepends=True)
    i = old.index("import torch\n") + 1
    new = old[:i] + ["import megatron.core.no_such_module  # deliberately broken\n"] + old[i:]
    patch = tmp_path / "broken_import.patch"
    patch.write_text("".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")))
    tree = make_mutant_tree(patch, tmp_path / "tree")
    with pytest.raises(AssertionError, match="no_such_module"):
        assert_mutant_fails_exactly(runs, tree, MUTANT_MUST_FAIL["no_zeroing"])


@pytest.mark.parametrize("k", range(1, len(series_patches())))
def test_every_prefix_of_the_series_keeps_numerics(runs, tmp_path, k):
    """Pristine + the first k patches (the full series is covered above): params gathered
    right, grad_data zero before backward, grads equal overlap-off, and real training
    steps overlap == sync, on 2 ranks."""
    tree = make_prefix_tree(k, tmp_path / "tree")
    res = runs(tree, 2, "gather,microbatches,training", CONFIGS[:1])
    failed = _failed_checks(res)
    assert not failed, f"prefix of {k} patches fails: {failed}"


def test_bf16_grad_buffer_is_an_exact_fit(runs):
    """bf16 params with bf16 grad_data (--grad-reduce-in-bf16): the receive buffer is
    exactly grad_data, element for element; gather, zeroing, grads and 0 temporaries."""
    cfg = "bf16-samegrad-many"
    res = runs("patched", 2, "gather,microbatches,alloc", (cfg,))
    g, m, a = (result(res, cfg, s) for s in ("gather", "microbatches", "alloc"))
    assert g["params_equal_owner_values"] and g["grad_data_zero_after_gather"]
    assert g["main_grad_equals_overlap_off"], g["main_grad_max_abs_diff"]
    assert all(m[f"mb{n}_equals_overlap_off"] for n in (1, 2, 4)), m
    assert a["async_bytes"] == a["forced_bytes"] == a["optimizer_bytes"] == 0, a


COLLECTIVE_CONFIGS = ("bf16-fp32grad-many", "fp32-fp32grad-one", "bf16-samegrad-one")


@pytest.mark.parametrize("world", WORLDS)
def test_each_path_calls_the_planned_collective_into_grad_data(runs, world):
    """Async (pre-hook), forced and optimizer paths, on an uneven model and on identical
    layers: one collective per bucket, the one the rule gives (all_gather_into_tensor for
    equal shares; padded all_gather_into_tensor where dp x max share fits in grad_data,
    else the exact-size list all_gather), with output and input inside grad_data's
    storage; params synced. Every form is exercised somewhere."""
    res = runs("patched", world, "collectives", COLLECTIVE_CONFIGS)
    seen = set()
    for cfg in COLLECTIVE_CONFIGS:
        r = result(res, cfg, "collectives")
        bad = [k for k, v in r.items() if v is False]
        assert not bad, f"{cfg}: failed checks {bad}"
        for path in ("async", "forced", "optimizer"):
            equal_calls = r[f"equal_{path}_calls"]
            if cfg.endswith("one"):  # a single bucket of identical layers: equal shares
                assert equal_calls == ["all_gather_into_tensor"], (cfg, path, equal_calls)
            seen.update((cfg, n) for n in r[f"uneven_{path}_calls"] + equal_calls)
    assert ("fp32-fp32grad-one", "all_gather") in seen  # unequal, padding does not fit
    # One param per bucket, one owner: padding needs world x numel; fp32 grad_data holds
    # 2 x numel bf16 elements, so it fits at 2 ranks (padded) and not at 4 (list).
    many = "all_gather_into_tensor" if world == 2 else "all_gather"
    assert {n for c, n in seen if c == "bf16-fp32grad-many"} == {many}, seen
