"""Unit tests of the series: the layer-wise param all-gather received into grad_data.

Real megatron-core objects on several gloo ranks (CPU runtime layer): DDP built the way
training builds it, so `main_grad` IS a view into `grad_data` (a clone of main_grad
would hide the zeroing bug of PR #3751). The ranks run
tests/unit_tests/layerwise_worker.py under torchrun, once per (tree, world size); the
tests below assert on its JSON results.

Every check runs on the series tree. Where the behaviour differs, the pristine tree is
run too and the test pins what it does (marked "pristine:" in the docstring): a crash,
stale params, the temporaries and zero-size NCCL ops the series removes. The collective
counts come from the CPU runtime layer's collective model (harness/cpu_runtime/
collectives.py: ops, zero-size ops, NCCL group launches, NCCL temporaries as
ProcessGroupNCCL issues them), measured on both trees in the same test. tests/mutants
holds deliberate bugs; test_mutants_are_caught shows that these tests catch each of them
for its own reason, on both bases (tests/mutants/0.19/: the same bugs on patches/0.19).
"""

from __future__ import annotations

import difflib
import itertools
import json
import re
import time
from pathlib import Path

import pytest

from harness.launch import CORE_PRELOAD, LaunchError, run_command, torchrun_command
from harness.ranks import FIRST_FAILURE
from harness.trees import (
    BASES,
    REPO_ROOT,
    make_mutant_tree,
    make_prefix_tree,
    series_patches,
)
from tests.tiers import tiered

WORKER = Path(__file__).with_name("layerwise_worker.py")
PROGRESS = "[layerwise_worker] done"  # the worker's per-scenario progress line
MUTANTS = REPO_ROOT / "tests" / "mutants"
#: Base (harness.trees.BASES) -> its mutants: tests/mutants/<base>/ (as patches/<base>/), the
#: same bugs at the same relative paths, each written against its base's series tree.
MUTANT_DIRS = {"0.17.1": MUTANTS / "0.17.1", "0.19": MUTANTS / "0.19"}
# Models (layerwise_worker.MODELS) by the share patterns of their buckets:
# - mixed: at DP 2 one bucket with equal shares (all_gather_into_tensor) and unequal ones
#   with single-param, multi-param and empty owners; at DP 4 unequal ones only, one with two
#   multi-param owners; bf16 params in fp32 grad_data (twice the receive size);
# - one: one bucket, unequal shares, every owner several params; bf16 grad_data, exactly
#   the receive size;
# - equal: one bucket of identical layers, equal shares at DP 2 and 4; fp32.
CONFIGS = ("bf16-fp32grad-mixed", "bf16-samegrad-one", "fp32-fp32grad-equal")
MAIN_SCENARIOS = (
    "gather,microbatches,training,forced_sync,free_overlap_buffers,offload,alloc,async_without_ddp"
)
# The collectives scenario checks the calls against the design; it builds its own models.
SERIES_SCENARIOS = MAIN_SCENARIOS + ",collectives"
ITEMSIZE = {"bf16": 2, "fp32": 4}

pytestmark = [pytest.mark.gloo]


def launch_worker(tree, nproc, out: Path, scenarios, configs=CONFIGS, expert_parallel=1, extra_env=None, tp=1):
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
            "--tensor-parallel",
            str(tp),
        ],
        nproc,
        tree=tree,
        extra_env=extra_env,
        preload=CORE_PRELOAD,
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


def run_worker(tree, nproc, out: Path, scenarios, configs=CONFIGS, expert_parallel=1, tp=1):
    """``launch_worker`` and its JSON results.

    Raises:
        AssertionError: a rank failed or the worker wrote no results (with the first
            failing rank's traceback and the log tail).
    """
    try:
        launch_worker(tree, nproc, out, scenarios, configs, expert_parallel, tp=tp)
    except LaunchError as exc:
        raise AssertionError(f"{first_failure(exc)}\n{exc}") from None
    assert out.exists(), f"worker wrote no results on {tree} x{nproc}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Lazily computed worker results, keyed by (tree, nproc, scenarios, configs, ep).
    Without `scenarios`: the main run of the tree (the series one with collectives)."""
    cache = {}
    tmp = tmp_path_factory.mktemp("layerwise")

    def get(tree, nproc, scenarios=None, configs=CONFIGS, ep=1, tp=1):
        if scenarios is None:
            scenarios = SERIES_SCENARIOS if tree == "series-0.17.1" else MAIN_SCENARIOS
        key = (str(tree), nproc, scenarios, tuple(configs), ep, tp)
        if key not in cache:
            out = tmp / f"r{len(cache)}.json"
            cache[key] = run_worker(tree, nproc, out, scenarios, configs, ep, tp)
        return cache[key]

    return get


def result(results, config, scenario):
    r = results[f"{config}/{scenario}"]
    assert "error" not in r, f"{config}/{scenario} raised: {r['error']}"
    return r


def failed(r):
    """Names of the failed boolean checks of one scenario result."""
    return [k for k, v in r.items() if v is False]


def passing(results, config, scenario):
    """result() whose boolean checks all hold."""
    r = result(results, config, scenario)
    assert not failed(r), f"{config}/{scenario} failed checks: {failed(r)}"
    return r


WORLDS = [2, 4]
CASES = [(w, c) for w in WORLDS for c in CONFIGS]


@pytest.mark.parametrize("world", WORLDS)
def test_the_configs_cover_every_share_pattern(runs, world):
    """The models give what the other tests need: buckets with equal shares, unequal ones
    with single-param and multi-param owners side by side, and owners of nothing."""
    patterns = [
        p for c in CONFIGS for p in result(runs("series-0.17.1", world), c, "gather")["bucket_patterns"]
    ]
    assert any(p["kind"] == "equal" for p in patterns)
    unequal = [p for p in patterns if p["kind"] == "unequal"]
    assert any(p["single_param_owner"] and p["multi_param_owner"] for p in unequal)
    assert any(p["empty_owner"] for p in unequal)
    assert any(p["multi_param_owners"] >= 2 for p in unequal)
    mixed = result(runs("series-0.17.1", world), CONFIGS[0], "gather")
    assert all(n == 1 for n in mixed["buckets_per_group"]) and mixed["num_buckets"] >= 4


@pytest.mark.parametrize("world,config", CASES)
def test_gathered_params_equal_owner_values(runs, world, config):
    r = result(runs("series-0.17.1", world), config, "gather")
    assert r["params_equal_owner_values"]


@pytest.mark.parametrize("world,config", CASES)
def test_grad_data_zero_after_gather_and_main_grad_matches_overlap_off(runs, world, config):
    """grad_data zero after the pre-hooks' gather, before backward; main_grad after
    backward bitwise that of the same model without overlap; and the pre-hook pair over
    idle grad_data holding bytes (0x11 everywhere) zeroes exactly the slots it wrote, every
    rank's share packed in rank order from element 0 (sum of the shares x the param
    itemsize), and leaves every byte after them as it was."""
    r = result(runs("series-0.17.1", world), config, "gather")
    assert r["grad_data_zero_after_gather"]
    assert r["main_grad_equals_overlap_off"], f"max |diff| = {r['main_grad_max_abs_diff']}"
    assert r["async_zeroed_exactly_where_written"]


@pytest.mark.parametrize("world,config", CASES)
def test_pre_hook_gather_over_grads_not_reset_receives_into_temporaries(runs, world, config):
    """The pre-hook pair after a backward that no zero_grad_buffer() followed (grad_data
    not idle: DDP's backward hook and start_grad_sync() cleared grad_data_idle): params
    synced, every grad_data byte (so main_grad) as it was, and exactly one temporary per
    gathered bucket of its shares' bytes, as pristine 0.17.1 allocates (by design: patch
    0003 receives into grad_data only while it is idle)."""
    r = result(runs("series-0.17.1", world), config, "gather")
    assert r["not_idle_grad_data_untouched"] and r["not_idle_params_synced"], r
    assert r["not_idle_temporaries_are_the_gathered_size"] and r["not_idle_temporary_bytes"] > 0, r


@pytest.mark.parametrize("world,config", CASES)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_microbatch_accumulation(runs, world, config, n):
    """Grads over n microbatches equal overlap-off (bitwise) and the per-microbatch sum."""
    r = result(runs("series-0.17.1", world), config, "microbatches")
    assert r[f"mb{n}_equals_overlap_off"], r[f"mb{n}_max_abs_diff"]
    assert r[f"mb{n}_equals_sum_of_microbatches"], r[f"mb{n}_sum_max_abs_diff"]


@pytest.mark.parametrize("world,config", CASES)
def test_training_steps_equal_the_pristine_tree(runs, world, config):
    """4 real optimizer steps, overlapped gather and the optimizer's synchronous gather:
    params (sha256 of their bytes) and grad norms equal the pristine tree's, which
    receives into fresh temporaries and never touches grad_data; and equal each other."""
    r = result(runs("series-0.17.1", world), config, "training")
    u = result(runs("pristine-0.17.1", world), config, "training")
    for path in ("overlap", "sync"):
        assert r[f"params_sha256_{path}"] == u[f"params_sha256_{path}"], f"{path} params differ from pristine"
        assert r[f"grad_norms_{path}"] == u[f"grad_norms_{path}"], (path, r[f"grad_norms_{path}"], u)
    assert r["params_overlap_equal_sync"], r["params_max_abs_diff"]
    assert r["params_equal_across_ranks"]


@pytest.mark.parametrize("world,config", CASES)
def test_main_grad_keeps_the_reduced_grads_when_the_optimizer_step_returns(runs, world, config):
    """Without --overlap-param-gather step() broadcasts the params in place (patch 0006)
    and never touches grad_data: when it returns, after each of 4 steps, every grad_data
    byte (so every main_grad) is bitwise the reduced grad it held before the step, none
    zeroed, never param bytes. Pristine (temporaries): the same."""
    for tree in ("series-0.17.1", "pristine-0.17.1"):
        r = result(runs(tree, world), config, "training")
        assert r["grad_data_untouched_by_step"] and r["main_grad_elements_zeroed_by_step"] == 0, (tree, r)


@pytest.mark.parametrize("world,config", CASES)
def test_zero_temporaries_in_layerwise_param_sync(runs, world, config):
    """Series: 0 bytes and 0 allocator calls on the async (pre-hook, idle grad_data) and
    optimizer paths, NCCL's modelled temporaries included. The forced sync never receives
    into grad_data (a grad may be there): by design exactly one temporary per gathered
    bucket, of its shares' bytes (pristine 0.17.1 allocates the others' shares and its flat
    local copy there; no NCCL temporary). The CPU runtime layer's uneven all_gather alone
    allocates 0 bytes (control). Pristine: exactly megatron's theoretical temporaries plus
    the collective model's NCCL temporaries (the flat output of an equal-shape list
    all_gather)."""
    p = result(runs("series-0.17.1", world), config, "alloc")
    for path in ("async", "optimizer"):
        assert p[f"{path}_bytes"] == 0 and p[f"{path}_alloc_calls"] == 0, p
    assert p["forced_bytes"] == p["gathered_bytes"] > 0, p
    assert p["forced_alloc_calls"] == p["gathered_buckets"], p
    for path in ("async", "forced", "optimizer"):
        assert p[f"{path}_params_synced"]
    assert p["runtime_layer_all_gather_bytes"] == 0
    u = result(runs("pristine-0.17.1", world), config, "alloc")
    assert u["runtime_layer_all_gather_bytes"] == 0
    assert u["theory_pristine_bytes"] > 0
    for path in ("async", "forced"):
        nccl = sum(b["nccl_temporary_bytes"] for b in u[f"{path}_per_bucket_group"])
        assert u[f"{path}_bytes"] == u["theory_pristine_bytes"] + nccl, (path, u)
    nccl = u["optimizer_step"]["nccl_temporary_bytes"]
    assert u["optimizer_bytes"] == u["theory_pristine_optimizer_bytes"] + nccl > 0, u
    # (Pristine's forced temporaries are the other ranks' shares plus its flattened copy of
    # its own, a view of 0 bytes where it owns one param: the series' one temporary per
    # bucket can exceed them by this rank's share.)


#: The collective model's summary of a gather (harness.cpu_runtime.summarize) that tests compare.
KEYS = ("ops", "zero_size_ops", "launches", "nccl_temporary_bytes")


def summary(ops, zero_size_ops=0, nccl_temporary_bytes=0):
    """A summary of `ops` NCCL ops in one launch (none where there is no op)."""
    return dict(zip(KEYS, (ops, zero_size_ops, int(ops > 0), nccl_temporary_bytes)))


def expected_pristine(shares, itemsize):
    """0.17.1's list all_gather of one bucket (or of the whole model, in step()) in the
    collective model: one launch; equal shapes one ncclAllGather into a DP x share flat
    temporary; unequal ones one broadcast per rank, zero-size shares included."""
    if not shares or max(shares) == 0:
        return summary(0)
    if min(shares) == max(shares):
        return summary(1, nccl_temporary_bytes=len(shares) * shares[0] * itemsize)
    return summary(len(shares), zero_size_ops=shares.count(0))


def expected_series(shares):
    """The series' pre-hook or forced gather of one bucket (patch 0005): one launch, no NCCL
    temporary, no zero-size op; one all_gather_into_tensor for equal shares, else one
    broadcast per rank that owns something."""
    if not shares or max(shares) == 0:
        return summary(0)
    return summary(1 if min(shares) == max(shares) else sum(1 for s in shares if s))


def observed(*summaries):
    """The KEYS of the collective model's summaries, summed."""
    return {k: sum(s[k] for s in summaries) for k in KEYS}


@pytest.mark.parametrize("world,config", CASES)
def test_nccl_ops_and_launches_at_most_pristine_per_bucket_and_per_step(runs, world, config):
    """Both trees on the same model, from the collective model's records: per bucket on the
    async (pre-hook) and forced paths, and per step on those, the series issues at most
    pristine's NCCL ops and launches, no zero-size op and no NCCL temporary, exactly as
    designed from the shares. On the optimizer's path (patch 0006: each param broadcast in
    place by its owner, one NCCL group per DP group) the series issues one op per param,
    which can exceed pristine's DP-rank count at small DP: there it issues at most
    pristine's launches, exactly one op per param, no zero-size op, no NCCL temporary (and
    no megatron temporary: test_zero_temporaries_in_layerwise_param_sync). Pristine: as
    0.17.1's list all_gather issues them (zero-size broadcasts for owners of nothing, a
    flat temporary for equal shares)."""
    p = result(runs("series-0.17.1", world), config, "alloc")
    u = result(runs("pristine-0.17.1", world), config, "alloc")
    itemsize = ITEMSIZE[config.split("-")[0]]
    assert p["bucket_shares"] == u["bucket_shares"] and p["optimizer_shares"] == u["optimizer_shares"]
    shares = [b for group in p["bucket_shares"] for b in group]
    assert all(len(group) == 1 for group in p["bucket_shares"])  # one bucket per group here
    for path in ("async", "forced"):
        ps, us = p[f"{path}_per_bucket_group"], u[f"{path}_per_bucket_group"]
        assert len(ps) == len(us) == len(shares)
        for i, (pb, ub, sh) in enumerate(zip(ps, us, shares)):
            assert observed(pb) == expected_series(sh), (path, i, sh, pb)
            assert observed(ub) == expected_pristine(sh, itemsize), (path, i, sh, ub)
            assert pb["ops"] <= ub["ops"] and pb["launches"] <= ub["launches"], (path, i, pb, ub)
        pt, ut = observed(*ps), observed(*us)
        assert pt["ops"] <= ut["ops"] and pt["launches"] <= ut["launches"], (path, pt, ut)
        assert pt["zero_size_ops"] == pt["nccl_temporary_bytes"] == 0, (path, pt)
    po, uo = p["optimizer_step"], u["optimizer_step"]
    # Every param of the model, each owned by one rank (the overlapped run's bucket lists).
    n_params = sum(n for group in p["bucket_param_counts"] for counts in group for n in counts)
    assert p["optimizer_params"] == n_params > 0, p
    # The series' optimizer path (patch 0006): every param broadcast in place by its owner,
    # all in one launch.
    assert observed(po) == summary(p["optimizer_params"]), po
    assert observed(uo) == expected_pristine(u["optimizer_shares"], itemsize), uo
    assert po["launches"] <= uo["launches"], (po, uo)


@pytest.mark.parametrize("world,config", CASES)
def test_forced_sync(runs, world, config):
    """Forced sync (eval/checkpoint) with no gather pending, over idle grad_data holding
    consumed grads (nonzero bytes): params synced, every grad_data byte untouched (a forced
    sync never receives into grad_data, patch 0003), no gather state left; the next
    pre-hook neither re-gathers nor skips a needed gather. Pristine: params synced too.
    (A forced sync with a gather pending in idle grad_data, which pristine drops: the
    hazard gather_then_forced_before_step_idle of test_grad_data_guards.py.)"""
    passing(runs("series-0.17.1", world), config, "forced_sync")
    u = result(runs("pristine-0.17.1", world), config, "forced_sync")
    assert u["idle_params_synced"]


@pytest.mark.parametrize("world,config", CASES)
def test_free_overlap_buffers_with_pending_gather(runs, world, config):
    """Series: the pending gather is completed (params synced, grad_data zero, no
    re-gather in the next forward). Pristine: free_overlap_buffers() drops it; params
    stay stale even after the next forward (param_gather_dispatched says they are synced)."""
    passing(runs("series-0.17.1", world), config, "free_overlap_buffers")
    u = result(runs("pristine-0.17.1", world), config, "free_overlap_buffers")
    assert not u["params_synced_after_forward"]


@pytest.mark.parametrize("world,config", CASES)
def test_offload_sync_restore(runs, world, config):
    """offload_grad_buffers() -> forced sync -> restore: the gather receives into a
    temporary of exactly the gathered bytes per bucket, the freed storage is never
    written, grads are right after restore."""
    r = passing(runs("series-0.17.1", world), config, "offload")
    assert r["temporary_bytes"] > 0


@pytest.mark.parametrize("world", WORLDS)
def test_each_path_issues_the_designed_collectives(runs, world):
    """Async (pre-hook), forced and optimizer paths on four models, call by call
    (layerwise_worker.check_gather_calls, check_optimizer_calls). Pre-hook and forced, per
    bucket: equal shares -> one all_gather_into_tensor into the receive buffer, its input
    this rank's slot; unequal -> one broadcast per owning rank (none for the empty ones,
    a single-param owner's through its slot too), rooted at the owner, in one launch; the
    slots packed in rank order from element 0 of the receive buffer: grad_data on the
    pre-hook pair (idle), one temporary of exactly the gathered bytes on the forced sync.
    Optimizer path: one in-place broadcast per param (param.data), rooted at its owner,
    all in one launch. Every form is exercised at this world size."""
    r = passing(runs("series-0.17.1", world), "models", "collectives")
    seen = {k.split("_n_")[1] for k, v in r.items() if "_n_" in k and v}
    want = {"into_tensor", "broadcast_slot", "single_param_slot", "optimizer_in_place"}
    assert want <= seen, f"not exercised: {sorted(want - seen)}"
    for path in ("async", "forced"):
        assert r[f"equal_{path}_n_into_tensor"] >= 1 and r[f"mixed_{path}_n_broadcast_slot"] >= 1
    assert all(r[f"{m}_optimizer_n_optimizer_in_place"] > 0 for m in ("mixed", "one", "equal"))


@pytest.mark.parametrize("base", BASES)
def test_every_share_pattern_of_three_ranks(runs, base):
    """3 gloo ranks, every share pattern of one bucket (0 to 2 elements per rank, not all
    0; rank 1 a multi-param owner where its share is 2), set through the bucket's
    set_layerwise_params_list() as the optimizer sets it, in bf16 params over fp32 and over
    bf16 grad_data: the pre-hook pair and the forced sync each issue what the design says
    (equal shares: one all_gather_into_tensor whose input is this rank's slot; unequal:
    one broadcast per non-empty slot, rooted at its owner, in rank order; one launch; no
    zero-size op, no NCCL temporary: expected_series), their slots packed from element 0
    of grad_data (pre-hook pair) or of one temporary (forced); every param ends as its
    owner's value on every rank; grad_data is zero exactly where the pre-hook gather wrote
    and untouched by the forced sync. Both forms occur."""
    _skip_without_019(base)
    r = result(runs(f"series-{base}", 3, "share_patterns", CONFIGS[:1]), "models", "share_patterns")
    patterns = [s for s in itertools.product(range(3), repeat=3) if max(s) > 0]
    keys = {
        f"{d}/{'-'.join(map(str, shares))}:{path}": shares
        for d in ("bf16_in_fp32", "bf16_in_bf16") for shares in patterns for path in ("async", "forced")
    }
    assert set(r) == set(keys) and len(keys) == 104, sorted(set(r) ^ set(keys))
    forms = set()
    for key, shares in keys.items():
        got = r[key]
        assert not failed(got), (key, failed(got))
        assert observed(got["summary"]) == expected_series(list(shares)), (key, got)
        equal = min(shares) == max(shares)
        assert got["forms"] == (["all_gather_into_tensor"] if equal else ["broadcast"]), (key, got)
        forms |= set(got["forms"])
    assert forms == {"all_gather_into_tensor", "broadcast"}


@pytest.mark.parametrize("world", WORLDS)
def test_async_gather_without_ddp_chunks_fails_at_construction(runs, world):
    """--overlap-param-gather with model chunks that are not megatron's DDP (no bucket
    groups): the layer-wise optimizer fails at construction on every rank, as pristine
    does: AttributeError on bucket_groups."""
    for tree in ("series-0.17.1", "pristine-0.17.1"):
        error = error_of(runs(tree, world), "async_without_ddp")
        assert error.startswith("AttributeError") and "bucket_groups" in error, (tree, error)


def test_one_rank_failure_ends_the_run_fast_with_its_traceback(tmp_path):
    """Rank 1 raises at the start of a scenario while rank 0 is inside its collectives:
    the run fails soon after rank 1's wait for the others' outcome (here 5 s, not the
    process-group timeout), and the report names rank 1 and holds its traceback."""
    with pytest.raises(LaunchError) as info:
        launch_worker("series-0.17.1", 2, tmp_path / "r.json", "gather", CONFIGS[:1],
                      extra_env={"LAYERWISE_WORKER_FAIL": "gather:1",
                                 "LAYERWISE_WORKER_OUTCOME_FLOOR_S": "5"})
    ended = time.time()
    report = first_failure(info.value)
    assert report.startswith(f"{FIRST_FAILURE}: 1 "), report
    assert "Traceback" in report and f"forced failure of {CONFIGS[0]}/gather on rank 1" in report
    failed_at = float(report.split("at t=", 1)[1].split(":", 1)[0])
    assert ended - failed_at < 30, f"the run ended {ended - failed_at:.0f} s after rank 1 failed"


def error_of(results, scenario):
    """The error CONFIGS[0]/scenario raised on every rank ("" where none)."""
    return results[f"{CONFIGS[0]}/{scenario}"].get("error", "")


def assert_trains_like_pristine_sync(r, pristine, scenario):
    """r (a small_dp record of the series) trains overlap == sync, grad norms equal, params
    bitwise those of pristine's run `scenario` without --overlap-param-gather; returns
    that fingerprint."""
    ref = result(pristine, CONFIGS[0], scenario)["params_sha256_sync"]
    assert r["params_overlap_equal_sync"] and r["grad_norms_equal"], r
    assert r["params_sha256_overlap"] == r["params_sha256_sync"] == ref, (r, ref)
    return ref


def test_dp_size_1(runs):
    """DP=1: optimizer builds and trains like pristine's synchronous path (which works at
    DP 1), nothing gathered or allocated. Pristine: TypeError while building the optimizer
    (set_bucket_layerwise_params_list zips over None)."""
    r = result(runs("series-0.17.1", 1, "small_dp,gather,alloc"), CONFIGS[0], "small_dp")
    a = result(runs("series-0.17.1", 1, "small_dp,gather,alloc"), CONFIGS[0], "alloc")
    assert a["async_bytes"] == a["forced_bytes"] == a["optimizer_bytes"] == 0
    assert all(b["calls"] == 0 for b in a["async_per_bucket_group"] + a["forced_per_bucket_group"])
    u = runs("pristine-0.17.1", 1, "small_dp,small_dp_sync")
    assert error_of(u, "small_dp").startswith("TypeError"), u
    assert_trains_like_pristine_sync(r, u, "small_dp_sync")


@pytest.mark.parametrize("base", BASES)
def test_expert_dp_size_1(runs, base):
    """EP 2 on 2 ranks: dense DP 2, expert-DP 1. The series trains like pristine's
    synchronous path. Pristine's overlapped run: 0.17.1 raises TypeError (max(None) in the
    first forward pre-hook); 0.19.2 returns early from a gather over one rank and trains
    the same."""
    _skip_without_019(base)
    u = runs(f"pristine-{base}", 2, "expert_dp1,expert_dp1_sync", CONFIGS[:1], ep=2)
    r = result(runs(f"series-{base}", 2, "expert_dp1", CONFIGS[:1], ep=2), CONFIGS[0], "expert_dp1")
    ref = assert_trains_like_pristine_sync(r, u, "expert_dp1_sync")
    if base == "0.17.1":
        assert error_of(u, "expert_dp1").startswith("TypeError"), u
    else:
        assert result(u, CONFIGS[0], "expert_dp1")["params_sha256_overlap"] == ref, u


EDGE_SCENARIOS = "optimizer_without_ddp,optimizer_offloaded,unusual_params"


def edge(runs, tree, scenario):
    """CONFIGS[0]/scenario of the tree's one run of EDGE_SCENARIOS on 2 ranks."""
    return result(runs(tree, 2, EDGE_SCENARIOS, CONFIGS[:1]), CONFIGS[0], scenario)


def test_optimizer_path_without_ddp_chunks(runs):
    """Without --overlap-param-gather over a model chunk that is not megatron's DDP, step()
    gathers the 0.17.1 way (nothing to receive into): trains, ranks agree, bitwise equal
    to pristine. Such a chunk has no DDP ``buffers`` list (``nn.Module.buffers`` is a method),
    so the series must not look for grad buffers there."""
    r = edge(runs, "series-0.17.1", "optimizer_without_ddp")
    u = edge(runs, "pristine-0.17.1", "optimizer_without_ddp")
    assert r["params_equal_across_ranks"] and r["params_sha256"] == u["params_sha256"], (r, u)


def test_optimizer_path_with_offloaded_grad_buffers(runs):
    """allgather_params() while offload_grad_buffers() has freed grad_data: params
    gathered, the freed storage never written (zeroing it would write freed memory: SIGSEGV
    on CPU).
    Pristine (temporaries only): the same."""
    for tree in ("series-0.17.1", "pristine-0.17.1"):
        r = edge(runs, tree, "optimizer_offloaded")
        assert r["params_synced"] and r["storage_stayed_freed"], (tree, r)


def test_params_that_are_not_plain_tensors(runs):
    """A non-contiguous param (NCCL broadcasts contiguous tensors only, which the CPU
    runtime's collective model enforces) and grad buffers whose param_dtype is uint8 (as
    for FP8 params; the receive dtype comes from the params): overlapped and
    optimizer-path training bitwise equal to pristine, and to each other."""
    r = edge(runs, "series-0.17.1", "unusual_params")
    u = edge(runs, "pristine-0.17.1", "unusual_params")
    for case in ("non_contiguous", "uint8_buffer_dtype"):
        assert r[f"{case}_params_overlap_equal_sync"] and r[f"{case}_grad_norms_equal"], (case, r)
        for path in ("overlap", "sync"):
            key = f"{case}_params_sha256_{path}"
            assert r[key] == u[key], (key, r, u)


#: The series' runs of the bucket group of two: with the optimizer path over the same two
#: param dtypes (test_optimizer_gather_of_two_param_dtypes), in one launch.
TWO_DTYPES_SERIES = "bucket_group_of_two,optimizer_two_dtypes"


def _bucket_group_of_two(tree):
    r = result(tree, CONFIGS[0], "bucket_group_of_two")
    assert r["buckets_per_group"] == r["buckets_gathered_per_group"] == [2], r
    return r


@pytest.mark.parametrize("base", BASES)
def test_every_gather_of_a_bucket_group_is_waited_on(runs, base):
    """A bucket group of two buckets (disable_bucketing over bf16 and fp32 params, as for
    VPP chunks after the first), each bucket's gather landing only when its own work is
    waited on (collectives.defer_async_completion(), a schedule c10d allows and Gloo's
    worker threads can produce): the overlapped run equals, bitwise, the run that syncs
    synchronously after each step, on the same tree and on pristine (patch 0001).
    Pristine (waits on the last work only): the first bucket's params are copied from
    receive buffers nothing was written into, and the params part (0.17.1: the grad norms
    too). So does the mutant that reverts 0001 on the series
    (test_the_mutant_waiting_on_the_last_work_only_is_caught)."""
    _skip_without_019(base)
    r = _bucket_group_of_two(runs(f"series-{base}", 2, TWO_DTYPES_SERIES, CONFIGS[:1]))
    u = _bucket_group_of_two(runs(f"pristine-{base}", 2, "bucket_group_of_two", CONFIGS[:1]))
    assert r["params_overlap_equal_forced"] and r["grad_norms_equal"], r
    assert r["params_sha256_overlap"] == r["params_sha256_forced"] == u["params_sha256_forced"], (r, u)
    assert not u["params_overlap_equal_forced"], u
    assert base != "0.17.1" or not u["grad_norms_equal"], u


@pytest.mark.extended
@pytest.mark.parametrize("base", BASES)
def test_the_mutant_waiting_on_the_last_work_only_is_caught(runs, tmp_path, base):
    """Patch 0001 reverted on the base's series (handles/wait_on_last_handle_only.patch):
    the bucket group of two under deferred completion parts from its forced-sync run,
    which still equals the series'."""
    tree = base_mutant_tree(base, "handles/wait_on_last_handle_only.patch", tmp_path / "tree")
    r = _bucket_group_of_two(runs(f"series-{base}", 2, TWO_DTYPES_SERIES, CONFIGS[:1]))
    m = _bucket_group_of_two(runs(tree, 2, "bucket_group_of_two", CONFIGS[:1]))
    assert not m["params_overlap_equal_forced"] and m["params_sha256_forced"] == r["params_sha256_forced"], m


def _failed_checks(results):
    """Names of every failed boolean check (failed()) or error in a worker result."""
    out = []
    for key, checks in results.items():
        if key != "_meta":
            out += [f"{key}: {checks['error']}"] if "error" in checks else []
            out += [f"{key}.{c}" for c in failed(checks)]
    return out


# ----------------------------------------------------------------------------- mutants
# The checks each mutant must fail, by "scenario.check" (2 ranks, CONFIGS[0]), and no
# others: a mutant that fails something else (a crash, an import error) fails the test.
# Measured on both bases (the same sets). At DP 2 every bucket has at most two owners, so a
# broadcast never writes memory another broadcast of the same group sends or receives
# (disjoint slots): the value checks stay deterministic on gloo's worker threads. That is
# why the layout mutant puts the slots in reverse rank order rather than overlapping them
# (overlapping slots race with each other there). The layout is checked on the
# collectives scenario's own models, by address, without values.
MUTANT_CONFIGS = CONFIGS[:1]
MUTANT_SCENARIOS = "gather,microbatches,training,forced_sync,free_overlap_buffers,collectives"
_PARAMS_STALE = {
    "gather.params_equal_owner_values",
    "gather.not_idle_params_synced",
    "forced_sync.idle_params_synced",
    "forced_sync.params_still_synced_after_forward",
    "forced_sync.next_step_gathers_fresh_values",
    "free_overlap_buffers.params_synced",
    "free_overlap_buffers.params_synced_after_forward",
}
_GRADS_WRONG = {"gather.main_grad_equals_overlap_off"} | {
    f"microbatches.mb{n}_{c}"
    for n in (1, 2, 4)
    for c in ("equals_overlap_off", "equals_sum_of_microbatches")
}
_TRAINING_DIVERGES = {"training.params_overlap_equal_sync", "training.grad_norms_equal"}
_RANKS_DIFFER = {"training.params_equal_across_ranks"}
# A sync completed outside the pre-hooks leaves the pending gather's slots in grad_data.
_DIRTY_AFTER_COMPLETION = {"free_overlap_buffers.grad_data_zero"}
# Wrong values where the overlapped path gathers; the optimizer's path of CONFIGS[0] is
# right, so the two training paths part.
_WRONG_VALUES = _PARAMS_STALE | _GRADS_WRONG | _TRAINING_DIVERGES | _RANKS_DIFFER


def _calls(models, paths, checks):
    """collectives-scenario check names."""
    return {f"collectives.{m}_{p}_{c}" for m in models for p in paths for c in checks}


_PRE_HOOK_PATHS = ("async", "forced")
_MODELS = ("mixed", "one", "one_samegrad", "equal")
# The collectives scenario's models with unequal shares at DP 2 (broadcasts); equal's one
# bucket has equal shares (all_gather_into_tensor).
_BROADCASTS = _calls(("mixed", "one", "one_samegrad"), _PRE_HOOK_PATHS, ("form",))
MUTANT_MUST_FAIL = {
    # Backward accumulates onto the gathered bytes; a sync completed outside the pre-hooks
    # leaves them too. (The optimizer path does not use grad_data: nothing there.)
    "no_zeroing": {"gather.grad_data_zero_after_gather", "gather.async_zeroed_exactly_where_written"}
    | _DIRTY_AFTER_COMPLETION
    | _GRADS_WRONG
    | _TRAINING_DIVERGES,
    # Zeroing more than the slots: the idle sync's bytes past them, and the grads a forced
    # sync or a sync over grads not reset kept (both received into temporaries).
    "zeroes_all_of_grad_data": {
        "gather.async_zeroed_exactly_where_written",
        "gather.not_idle_grad_data_untouched",
        "forced_sync.idle_grad_data_untouched",
    },
    # Only syncs that no pre-hook completes leave grad_data dirty; numerics unchanged here.
    # (test_grad_data_guards.py's gather_then_forced_before_step_idle sees the numerics:
    # a forced sync that leaves them, then a backward.)
    "zeroing_only_in_pre_hooks": _DIRTY_AFTER_COMPLETION,
    # Other ranks keep stale values of what rank 1 sends: the training paths part and the
    # ranks disagree. The calls are right.
    "copy_back_skips_rank1": _WRONG_VALUES,
    # Every broadcast has the wrong root: wrong values, and the calls' roots are wrong.
    "broadcast_from_wrong_owner": _WRONG_VALUES | _BROADCASTS,
    # The last owner's broadcast is missing; a bucket owned by one rank gets no launch.
    "skipped_nonempty_share": _WRONG_VALUES
    | _BROADCASTS
    | _calls(("mixed",), _PRE_HOOK_PATHS, ("one_launch",)),
    # Slots in reverse rank order: the broadcasts still land in (disjoint) slots, out of
    # order and not packed from element 0; all_gather_into_tensor's input is not this
    # rank's chunk, and its chunks are read back as the wrong ranks' (wrong values where
    # mixed has its equal-share bucket).
    "slots_out_of_rank_order": _WRONG_VALUES
    | _calls(("mixed", "equal"), _PRE_HOOK_PATHS, ("form",))
    | _calls(("mixed", "one", "one_samegrad"), _PRE_HOOK_PATHS, ("disjoint", "packed")),
    # A sync over grads no zero_grad_buffer() reset receives into them and zeroes them.
    "gather_over_grads": {"gather.not_idle_grad_data_untouched", "gather.not_idle_temporaries_are_the_gathered_size"},
    # The forced sync receives into idle grad_data: the consumed grads there are zeroed,
    # and its calls are not in a temporary (mixed's buckets after the first also lie at an
    # offset of the grad buffer's storage, so not packed from a temporary's element 0).
    "forced_sync_into_grad_data": {"forced_sync.idle_grad_data_untouched"}
    | _calls(_MODELS, ("forced",), ("in_recv",))
    | {"collectives.mixed_forced_packed"},
    # step()'s in-place broadcasts rooted at the next rank: every param takes the
    # non-owner's stale value (the ranks agree), so the sync path parts from the
    # overlapped one; the tensors are still the params' own.
    "optimizer_broadcast_from_wrong_owner": _TRAINING_DIVERGES | _calls(_MODELS, ("optimizer",), ("form",)),
}


#: The mutants that run on the 0.19 series too: those of the rules whose code replaced
#: 0.19.2's own (the receive buffer and its zeroing, 0003; the optimizer's gather, 0006;
#: completion before zero_grad_buffer(), 0003, runs there in test_grad_data_guards.py). The
#: others mutate _layerwise_all_gather() and the copy-out, byte for byte the 0.17.1 series'
#: code there (tests/mutants/0.19/ holds them all; one pass per base would not fit the
#: suite's time).
MUTANTS_ON_019 = (
    "no_zeroing",
    "zeroes_all_of_grad_data",
    "gather_over_grads",
    "forced_sync_into_grad_data",
    "optimizer_broadcast_from_wrong_owner",
)
#: Base -> mutant -> the checks it must fail. 0.19: the same checks, measured mutant by
#: mutant (its series has the same code at every mutated line, and MUTANT_SCENARIOS and
#: MUTANT_CONFIGS, bf16, run there). Kept per base so that either can change alone.
MUTANT_MUST_FAIL_BY_BASE = {
    "0.17.1": MUTANT_MUST_FAIL,
    "0.19": {mutant: set(MUTANT_MUST_FAIL[mutant]) for mutant in MUTANTS_ON_019},
}
#: The default run (CI) catches no_zeroing (#3751's bug) on each base; every other mutant is in
#: the extended tier (scripts/test.sh --all: 15 more worker runs, about 3 min on 2 cores).
MUTANT_CASES = tiered([(b, m) for b in BASES for m in sorted(MUTANT_MUST_FAIL_BY_BASE[b])],
                      lambda bm: bm[1] == "no_zeroing")  # fmt: skip


def base_mutant_tree(base, rel, dest):
    """make_mutant_tree() of the base's mutant `rel` (a path in its MUTANT_DIRS folder) on
    the base's series tree; skips where build/patched-0.19 is missing."""
    _skip_without_019(base)
    return make_mutant_tree(MUTANT_DIRS[base] / rel, dest, f"series-{base}")


def series_main_run(runs, base):
    """The series tree's main run of `base` on 2 ranks (every main scenario, collectives)."""
    if base == "0.17.1":
        return runs("series-0.17.1", 2)
    _skip_without_019(base)
    return runs("series-0.19", 2, SERIES_SCENARIOS_019, CONFIGS_019)


def pristine_main_run(runs, base):
    """The pristine tree's main run of `base` on 2 ranks."""
    if base == "0.17.1":
        return runs("pristine-0.17.1", 2)
    _skip_without_019(base)
    return runs("pristine-0.19", 2, SCENARIOS_019, CONFIGS_019)


def assert_mutant_fails_exactly(runs, tree, must_fail):
    """Run the mutant tree's checks; AssertionError unless exactly `must_fail` fail
    (a worker that cannot start, e.g. a broken import, raises from run_worker)."""
    res = runs(tree, 2, MUTANT_SCENARIOS, MUTANT_CONFIGS)
    got = {f.split("/", 1)[1] for f in _failed_checks(res)}
    missed, extra = must_fail - got, got - must_fail
    assert (
        not missed and not extra
    ), f"mutant checks differ: not failed {sorted(missed)}; failed unexpectedly {sorted(extra)}"


@pytest.mark.parametrize("base", BASES)
def test_every_mutant_has_its_checks(base):
    """Every mutant of the base's folder (guards/ and handles/ aside) fails named checks
    here, or, for zero_grad_buffer_under_pending_gather (a gather pending in idle grad_data
    at zero_grad_buffer(), one of its hazards), in test_grad_data_guards.py
    (GUARD_MUTANT_MUST_FAIL_BY_BASE; this folder is on sys.path under pytest)."""
    from test_grad_data_guards import GUARD_MUTANT_MUST_FAIL_BY_BASE

    stems = {p.stem for p in MUTANT_DIRS[base].glob("*.patch")}
    assert set(MUTANT_MUST_FAIL) | set(GUARD_MUTANT_MUST_FAIL_BY_BASE[base]) >= stems
    assert set(MUTANT_MUST_FAIL) <= stems
    assert set(MUTANT_MUST_FAIL_BY_BASE[base]) <= set(MUTANT_MUST_FAIL)
    assert all(MUTANT_MUST_FAIL_BY_BASE[base].values())


def test_every_mutant_has_a_019_counterpart():
    """Every mutant of tests/mutants/0.17.1/ (guards/, handles/ included) has its 0.19
    counterpart at the same relative path of tests/mutants/0.19/, and nothing else is there."""

    def rel(folder, skip=()):
        paths = (p.relative_to(folder) for p in folder.rglob("*.patch"))
        return {p.as_posix() for p in paths if p.parts[0] not in skip}

    assert rel(MUTANT_DIRS["0.17.1"]) == rel(MUTANT_DIRS["0.19"])


@pytest.mark.parametrize("base", BASES)
def test_the_mutant_checks_pass_on_the_series(runs, base):
    """Control: the checks the mutants are measured by all pass on the base's series tree
    (its main run holds them)."""
    res = series_main_run(runs, base)
    keys = [f"{c}/{s}" for c in MUTANT_CONFIGS for s in MUTANT_SCENARIOS.split(",") if s != "collectives"]
    assert not _failed_checks({k: res[k] for k in keys + ["models/collectives"]})


@pytest.mark.parametrize("base,mutant", MUTANT_CASES)
def test_mutants_are_caught(runs, tmp_path, base, mutant):
    """Each planted bug fails exactly the checks named for it (2 ranks), on each base."""
    tree = base_mutant_tree(base, f"{mutant}.patch", tmp_path / "tree")
    assert_mutant_fails_exactly(runs, tree, MUTANT_MUST_FAIL_BY_BASE[base][mutant])


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


# ---------------------------------------------------------------------------- the 0.19 base
# 0.19.2's LayerWiseDistributedOptimizer wraps its base optimizers in Float16 wrappers only
# with bf16, so an fp32 step raises AttributeError ('TensorParallelMuon' object has no
# attribute 'prepare_grads') on pristine 0.19.2 too: the 0.19 runs use the bf16 configs.
CONFIGS_019 = CONFIGS[:2]
# async_without_ddp: 0.19.2 raises AttributeError on bucket_groups there, with and without the
# series (the 0.17.1 series' assertion is not carried).
SCENARIOS_019 = MAIN_SCENARIOS.replace(",async_without_ddp", "")
# The series' main run (series_main_run), as on 0.17.1: with the collectives scenario.
SERIES_SCENARIOS_019 = SCENARIOS_019 + ",collectives"


def _skip_without_019(base="0.19"):
    """Skip a test of `base` 0.19 where build/patched-0.19 is missing."""
    if base != "0.17.1" and not (REPO_ROOT / "build" / "patched-0.19" / "megatron" / "core").is_dir():
        pytest.skip("build/patched-0.19 is missing; run scripts/setup.sh")


def test_019_series_passes_every_check_and_trains_like_pristine(runs):
    """0.19.2 + patches/0.19, 2 ranks: every check of the main scenarios holds (gathered
    params, grad_data zero after the gather, microbatch accumulation, forced sync,
    free_overlap_buffers with a gather pending, offload, 0 bytes of temporaries on the
    pre-hook and optimizer paths and the forced sync's one temporary per bucket, the
    designed collectives on every path), and training is bitwise equal to pristine
    0.19.2's on both paths.
    Pristine 0.19.2: a forced sync that zeroes the grads in grad_data, stale params after
    free_overlap_buffers() with a gather pending, a crash on offloaded grad buffers, and
    temporaries on every path. (Its stale params after a forced sync or zero_grad_buffer()
    with a gather pending: test_019_every_copy_back_happens_before_post_param_sync, and
    test_grad_data_guards.py's test_019_pristine_zero_grad_buffer_drops_a_gather_pending_in_grad_data.)"""
    r = series_main_run(runs, "0.19")
    assert not _failed_checks(r), _failed_checks(r)
    u = pristine_main_run(runs, "0.19")
    for c in CONFIGS_019:
        for key in ("params_sha256_overlap", "params_sha256_sync", "grad_norms_overlap"):
            assert result(r, c, "training")[key] == result(u, c, "training")[key], (c, key)
        a, ua = result(r, c, "alloc"), result(u, c, "alloc")
        assert a["async_bytes"] == a["optimizer_bytes"] == 0, a
        # (pristine 0.19.2's forced sync receives into grad_data: only its flattened copy)
        assert a["forced_bytes"] == a["gathered_bytes"] > 0, (a, ua)
        assert ua["async_bytes"] > 0 and ua["optimizer_bytes"] > 0, ua
    bad = {f.split("/", 1)[1].split(".")[0].split(":")[0] for f in _failed_checks(u)}
    assert {"forced_sync", "free_overlap_buffers", "offload"} <= bad, bad


def test_019_expert_dp_index_error_confirmed_and_fixed(runs):
    """TP 2 on 2 ranks: dense DP (dp_cp) 1, expert-DP 2. Pristine 0.19.2 gives the expert
    buckets one-entry params lists while their group has 2 ranks: IndexError in the first
    forward's gather. The series leaves unsharded buckets unset: it trains, overlap ==
    sync, bitwise equal to pristine's synchronous path (which works there)."""
    _skip_without_019()
    u = runs("pristine-0.19", 2, "dp1_expert_dp2,expert_dp1_sync", CONFIGS[:1], tp=2)
    assert error_of(u, "dp1_expert_dp2").startswith("IndexError"), u
    r = result(runs("series-0.19", 2, "dp1_expert_dp2", CONFIGS[:1], tp=2), CONFIGS[0], "dp1_expert_dp2")
    assert_trains_like_pristine_sync(r, u, "expert_dp1_sync")


# ---------------------------------------------------------------------------- prefixes
PREFIX_SCENARIOS = "gather,microbatches,training"
# Claims of the finished series beyond numerics: the exact bytes the pre-hook gather writes
# into idle grad_data (0004's packed slots; before it 0.17.1 receives into temporaries and
# 0.19.2 zeroes the whole grad_data), and the one temporary per bucket of a sync over grads
# not reset (before 0004 the flattened local copy is one more). Every prefix must still
# gather right, leave grad_data zero before backward and train like pristine.
NOT_NUMERICS = {"gather.async_zeroed_exactly_where_written", "gather.not_idle_temporaries_are_the_gathered_size"}
# Before 0004 (grad_data_idle) pristine 0.19.2's pre-hook gather receives into grad_data
# whatever it holds and zeroes it: a sync over grads not reset loses them (0.17.1 receives
# into temporaries and keeps them).
BEFORE_0004_019 = {"gather.not_idle_grad_data_untouched"}


def allowed_prefix_failures(base, k):
    """The checks the first k patches of `base` may fail (see NOT_NUMERICS)."""
    return NOT_NUMERICS | (BEFORE_0004_019 if base == "0.19" and k < 4 else set())


#: The whole series (the series trees' main runs) in the default run; the shorter prefixes in
#: the extended tier (10 worker runs, about 2 min on 2 cores).
PREFIX_CASES = tiered([(b, k) for b in BASES for k in range(1, len(series_patches(base=b)) + 1)],
                      lambda bk: bk[1] == len(series_patches(base=bk[0])))  # fmt: skip


@pytest.mark.parametrize("base,k", PREFIX_CASES)
def test_every_prefix_of_the_series_keeps_numerics(runs, tmp_path, base, k):
    """Pristine + the first k patches of the base's series (k = all: the series tree's
    main run): params gathered right, grad_data zero before backward, grads equal
    overlap-off, real training steps overlap == sync and bitwise equal to the pristine
    tree's, on 2 ranks."""
    if k == len(series_patches(base=base)):
        res = series_main_run(runs, base)
    else:
        _skip_without_019(base)
        tree = make_prefix_tree(k, tmp_path / "tree", base)
        res = runs(tree, 2, PREFIX_SCENARIOS, CONFIGS[:1])
    keep = {f"{CONFIGS[0]}/{s}" for s in PREFIX_SCENARIOS.split(",")}
    checks = _failed_checks({key: res[key] for key in keep})
    bad = [f for f in checks if f.split("/", 1)[1] not in allowed_prefix_failures(base, k)]
    assert not bad, f"prefix of {k} patches of {base} fails: {bad}"
    mine = result(res, CONFIGS[0], "training")
    pristine = result(pristine_main_run(runs, base), CONFIGS[0], "training")
    for path in ("overlap", "sync"):
        assert mine[f"params_sha256_{path}"] == pristine[f"params_sha256_{path}"], path


# ------------------------------------------------------------- what every rank must agree on
# One launch per tree (bf16 configs: pristine 0.19.2's fp32 step raises, see CONFIGS_019):
# the optimizer's gather with private per-rank state, a plain DDP's zero_grad_buffer(), the
# order of copy-back and _post_param_sync() (0.19), and CUDA graph configs.
AGREEMENT_SCENARIOS = "private_state_gather,plain_ddp_zero_grad,post_param_sync_order,local_cuda_graphs"
AGREEMENT_CONFIGS = CONFIGS_019
PRIVATE_STATES = ("offloaded", "unconsumed_grads")


def agreement_run(runs, tree):
    _skip_without_019("0.19" if "0.19" in str(tree) else "0.17.1")
    return runs(tree, 2, AGREEMENT_SCENARIOS, AGREEMENT_CONFIGS)


@pytest.mark.parametrize("base", BASES)
def test_optimizer_gather_takes_the_same_collective_whatever_a_rank_holds(runs, base):
    """allgather_params() (the optimizer path, no --overlap-param-gather) called
    directly while rank 0 holds private state and rank 1 is idle: offloaded grad buffers,
    or grads no step consumed (a no_sync() backward). Both ranks issue the same collectives
    (form, group size, dtype, sizes, roots: patch 0006's in-place broadcast of every param
    from its owner, on both configs), the params equal the owners' values on every rank,
    and rank 0's state is untouched (its storage stays freed, its grads keep their bytes):
    the series' optimizer path does not look at grad_data at all (a collective chosen from
    a rank's own state would differ between ranks: on NCCL, a hang or wrong params).
    Pristine, for reference: every rank its list all_gather of flattened
    temporaries."""
    _skip_without_019(base)
    r = agreement_run(runs, f"series-{base}")
    for config in AGREEMENT_CONFIGS:
        res = result(r, config, "private_state_gather")
        for state in PRIVATE_STATES:
            forms = res[f"{state}_forms_by_rank"]
            assert res[f"{state}_same_collective_on_every_rank"], (config, state, forms)
            assert res[f"{state}_params_equal_owner_values"], (config, state)
            assert res[f"{state}_private_state_kept"], (config, state)
    forms = {
        c: result(r, c, "private_state_gather")["offloaded_forms_by_rank"][0] for c in AGREEMENT_CONFIGS
    }
    assert forms == {"bf16-fp32grad-mixed": ["broadcast"], "bf16-samegrad-one": ["broadcast"]}
    for config in AGREEMENT_CONFIGS:
        u = result(agreement_run(runs, f"pristine-{base}"), config, "private_state_gather")
        for state in PRIVATE_STATES:
            assert u[f"{state}_same_collective_on_every_rank"] and u[f"{state}_params_equal_owner_values"]
            assert all(f[0].startswith("all_gather/") for f in u[f"{state}_forms_by_rank"]), u


@pytest.mark.parametrize("base", BASES)
def test_zero_grad_buffer_of_plain_ddp_runs_no_param_sync_work(runs, base):
    """DDP without the distributed optimizer and with Adam (no layer-wise bucket,
    no param gather): zero_grad_buffer() in 2 training steps, offload_grad_buffers() and
    restore_grad_buffers() call exactly the bucket-group methods pristine calls there
    (reset()), no param-sync entry point (free_overlap_buffers(), start/finish_param_sync())
    or layer-wise helper, and issue no gather collective: the series' param-sync work stays
    on layer-wise buckets."""
    _skip_without_019(base)
    r = agreement_run(runs, f"series-{base}")
    u = agreement_run(runs, f"pristine-{base}")
    for config in AGREEMENT_CONFIGS:
        mine, pristine = result(r, config, "plain_ddp_zero_grad"), result(u, config, "plain_ddp_zero_grad")
        assert mine["no_param_sync_work"], mine
        assert pristine["bucket_group_methods_called"] == ["reset"], pristine
        assert mine["bucket_group_methods_called"] == pristine["bucket_group_methods_called"], mine


CUDA_GRAPH_VARIANTS = {
    # variant -> the cuda_graph_impl TransformerConfig ends with, by base
    "local": {"0.17.1": "local", "0.19": "local"},
    "full_iteration": {"0.17.1": "local", "0.19": "full_iteration"},
    "inference_only": {"0.17.1": "local", "0.19": "local"},
}


@pytest.mark.parametrize("base", BASES)
def test_cuda_graph_configs_build_and_train_like_without_them(runs, base):
    """DDP and the layer-wise optimizer with --overlap-param-gather on a model whose
    TransformerConfig asks for CUDA graphs: cuda_graph_impl "local"; full-iteration graphs
    (0.19: cuda_graph_impl "full_iteration"; 0.17.1: "local" with cuda_graph_scope
    "full_iteration"); RL's inference-only graphs (cuda_graph_scope
    "full_iteration_inference"). On the series and on pristine, each builds and trains 3
    steps bitwise equal (params and grad norms) to the run without the config, params equal
    on every rank. The series' grad_data_idle flag needs no backward hook to keep a forced
    sync out of grad_data, so it accepts "local" graphs, which skip DDP's hooks."""
    _skip_without_019(base)
    for tree in (f"pristine-{base}", f"series-{base}"):
        for config in AGREEMENT_CONFIGS:
            r = result(agreement_run(runs, tree), config, "local_cuda_graphs")
            for variant, impl in CUDA_GRAPH_VARIANTS.items():
                assert r[f"{variant}_built"] and r[f"{variant}_cuda_graph_impl"] == impl[base], (tree, config, r)
                assert r[f"{variant}_trains_equal_without_cuda_graphs"], (tree, config, variant, r)
                assert r[f"{variant}_params_equal_across_ranks"], (tree, config, variant, r)


def test_019_every_copy_back_happens_before_post_param_sync(runs):
    """0.19 only (0.17.1 has no _post_param_sync()). On each path that
    calls it (the pre-hook pair; a forced sync idle and with a gather pending;
    free_overlap_buffers() and zero_grad_buffer() with a gather pending), every
    _post_param_sync() call finds every param of its bucket group already holding the
    gathered value (MXFP8's post-processing reads them; on CPU no param is quantized, so
    the order shows only here), and the params end synced. Pristine 0.19.2, for reference:
    its forced sync with a gather pending drops the gather and calls _post_param_sync()
    over stale params."""
    _skip_without_019()
    paths = ("async", "forced_idle", "forced_pending", "free_overlap_buffers", "zero_grad_buffer")
    for config in AGREEMENT_CONFIGS:
        r = result(agreement_run(runs, "series-0.19"), config, "post_param_sync_order")
        for path in paths:
            assert r[f"{path}_calls"] > 0, (config, path, r)
            assert r[f"{path}_copied_back_before_post_param_sync"], (config, path, r)
            assert r[f"{path}_params_synced"], (config, path, r)
        u = result(agreement_run(runs, "pristine-0.19"), config, "post_param_sync_order")
        assert not u["forced_pending_copied_back_before_post_param_sync"], u
        assert not u["forced_pending_params_synced"], u


@pytest.mark.parametrize("base", BASES)
def test_optimizer_gather_of_two_param_dtypes(runs, base):
    """The optimizer path (no --overlap-param-gather) on a model with
    bf16 and fp32 params (both buffers' buckets in one bucket group): after a simulated
    step every rank holds the owners' values of both dtypes (patch 0006's in-place
    broadcasts ran in both), and 3 real steps equal the overlapped run bitwise, params
    equal on every rank, grad_data untouched by each step(). Pristine 0.17.1's helper
    raises on rank 0 only (a dtype mismatch) while rank 1 waits in the collective."""
    _skip_without_019(base)
    r = result(runs(f"series-{base}", 2, TWO_DTYPES_SERIES, CONFIGS[:1]), CONFIGS[0], "optimizer_two_dtypes")
    assert r["param_dtypes"] == ["torch.bfloat16", "torch.float32"], r
    assert r["gather_dtypes"] == ["torch.bfloat16", "torch.float32"], r
    assert r["params_equal_owner_values"] and r["training_equals_overlapped"], r
    assert r["params_equal_across_ranks"] and r["grad_data_untouched_by_step"], r
