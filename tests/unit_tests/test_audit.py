"""Tests of the real-shape audit (scripts/audit_param_sync.py, harness/audit/).

1. The audit is faithful: for a small MoE config at DP 4 (harness/audit/grid.py
   CHECK_MODELS), its storage-free, fake-process-group run yields exactly the buckets
   (param names, numel) and per-rank shares (which params each DP and expert-DP rank owns
   in each bucket) of an ALLOCATED megatron DDP + LayerWiseDistributedOptimizer on 4 real
   gloo ranks (tests/unit_tests/audit_check_worker.py). The comparison has teeth:
   the audit of a tree whose ping-pong sharding order is reversed fails it.
2. The audit runs (``--quick``: Llama-3-8B TP 1 and the DeepSeek-V2-Lite-like MoE at DP 8 and
   64, every tree; about 30 s on 2 cores): every cell is there, its structural checks hold,
   the collective counts of the pristine tree follow from the shares the optimizer made (two
   sources of one run), 0.18.2's layout padding equals what megatron itself logs, and the
   report has a table per model and a plot.
3. The README's claims for the series hold on every cell of that run of each series (0.17.1,
   0.19), on every path (async, forced, optimizer), against its pristine tree: the audit's own
   ``series_claims`` (0 bytes of NCCL temporaries, no zero-size NCCL call, launches at most
   pristine's, ...), and exactly the other ranks' shares on the wire
   (``series_claim_failures``); 0.19's trees count what their 0.17.1 and 0.18.2 counterparts do.
   The same check on a tree with a deliberate bug (``tests/mutants/``) fails.

4. Your model (``audit_param_sync.py ... -- <pretrain_gpt.py flags>``): the flags of Llama-3-8B
   TP 1 (0.17.1, pristine and the series, DP 8 and 64) and of the MoE model (pristine 0.19.2,
   DP 64) give exactly the built-in model's cells of the same run (and pristine 0.17.1's
   published cells); megatron's default Transformer Engine spec gives TE's parameter layout
   (stand-in); each kind of bad input gets megatron's message, and bad input exits 2 with no
   traceback and nothing written.

5. What the flag path prints: the series' claim of each path in the README's words, with
   "holds" or "does not hold" from ``series_claims`` (constructed cells, and the mutant); a
   legend of paths and trees, the user's release only (0.19 by default) and the path the flags
   take; each path's peak next to megatron's step estimate, which equals a direct call of
   megatron's ``report_theoretical_memory`` on the same flags; a plot wide enough to read.

Nothing here pins a count of the series (only the claimed 0 bytes and 0 zero-size calls):
rerunning the audit after the series changes must change its numbers, not these tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.audit import grid
from harness.launch import CORE_PRELOAD, LaunchError, run_command, torchrun_command
from harness.trees import REPO_ROOT, env_for_tree, make_mutant_tree, tree_parent

SCRIPT = REPO_ROOT / "scripts" / "audit_param_sync.py"
WORKER = REPO_ROOT / "harness" / "audit" / "worker.py"
CHECK_WORKER = Path(__file__).with_name("audit_check_worker.py")
CHECK_MODEL = "check_moe_ep2"
CHECK_DP = 4
AUDIT_MODEL = "dsv2_lite_ep8"  # the MoE of the quick audit: expert-DP buckets, 0.17.1's crash
PATHS = ("async", "forced", "optimizer")
#: A deliberate bug for the claims' check: a single-param owner's broadcast goes through a
#: copy of the param (megatron allocates it), on the model whose owners mostly send one param.
CLAIM_MUTANT = REPO_ROOT / "tests" / "mutants" / "0.17.1" / "audit" / "grad_data_never_idle.patch"
CLAIM_MUTANT_CELL = "llama3_8b_tp1:64"
TIMEOUT_S = 600
#: The ping-pong deal of LayerWiseDistributedOptimizer.shard_params (0.17.1), and reversed.
PING_PONG = "dp_cp_loop = list(range(dp_cp_size)) + list(range(dp_cp_size))[::-1]"
PING_PONG_REVERSED = "dp_cp_loop = list(range(dp_cp_size))[::-1] + list(range(dp_cp_size))"

pytestmark = [pytest.mark.gloo]


def run_python(args, tree=None, ok=(0,)) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repo root: on ``tree`` (a tree label or directory, first on
    PYTHONPATH, the CPU runtime layer forced) or in this checkout's environment. Asserts an
    exit status in ``ok`` (None: any), showing the output's tail."""
    env = None
    if tree is not None:
        env = env_for_tree(tree)
        env.update(MEGATRON_CPU_RUNTIME="force", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)  # fmt: skip
    assert ok is None or proc.returncode in ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def audit_cell(tree_label: str, tree_dir, out: Path) -> dict:
    """The audit worker's record of the check model at DP 4 (bucket detail on) on ``tree_dir``."""
    run_python([WORKER, "--tree", tree_label, "--cells", f"{CHECK_MODEL}:{CHECK_DP}", "--paths", "async",
                "--bucket-detail", "--out", out], tree=tree_dir)  # fmt: skip
    (rec,) = json.loads(out.read_text())
    assert "error" not in rec, rec.get("traceback", rec["error"])
    return rec


def bucket_mismatches(audit: dict, real: dict) -> list:
    """Differences between the audit's buckets and the allocated run's, one message each.

    Compared per bucket, in DDP's order (dense bucket groups, then expert-parallel ones):
    numel, the bucket's param names, and per rank the names and elements of the params
    that rank owns in the bucket. Empty list: identical.
    """
    fails = []
    a_b, r_b = audit["buckets"], real["buckets"]
    if len(a_b) != len(r_b):
        return [f"{len(a_b)} buckets in the audit, {len(r_b)} in the allocated run"]
    for i, (a, r) in enumerate(zip(a_b, r_b)):
        for key in ("numel", "param_names", "share_names", "shares"):
            if a[key] != r[key]:
                fails.append(f"bucket {i} {key}: audit {a[key]} != allocated {r[key]}")
    return fails


@pytest.fixture(scope="module")
def allocated(tmp_path_factory):
    """The check model's buckets on 4 real gloo ranks, allocated, on the series-0.17.1 tree."""
    out = tmp_path_factory.mktemp("allocated") / "real.json"
    cmd, env = torchrun_command(CHECK_WORKER, ["--model", CHECK_MODEL, "--out", str(out)], CHECK_DP,
                                tree="series-0.17.1", extra_env={"PYTHONWARNINGS": "ignore"}, preload=CORE_PRELOAD)  # fmt: skip
    try:
        run_command(cmd, env, run_dir=out.with_suffix(".logs"), timeout_s=TIMEOUT_S, what="check worker x4")
    except LaunchError as exc:
        raise AssertionError(str(exc)) from None
    real = json.loads(out.read_text())
    assert real["ranks_agree"], "the ranks of the allocated run disagree on their buckets"
    return real


def test_audit_buckets_and_shares_equal_an_allocated_run(allocated, tmp_path):
    """Buckets and per-rank shares of the storage-free audit == allocated megatron objects
    on 4 gloo ranks, dense (DP 4) and expert-DP (2) buckets."""
    real = allocated
    assert (real["dp"], real["expert_dp"]) == (CHECK_DP, 2) and real["storage_bytes"] > 0
    # The config exercises what the real shapes do: several buckets of both kinds, and
    # buckets in which some rank owns nothing.
    assert len(real["buckets"]) >= 6
    assert {len(b["shares"]) for b in real["buckets"]} == {2, 4}
    assert any(0 in b["shares"] for b in real["buckets"])
    audit = audit_cell("series-0.17.1", "series-0.17.1", tmp_path / "audit.json")
    assert (audit["dp"], audit["expert_dp"]) == (CHECK_DP, 2)
    assert bucket_mismatches(audit, real) == []


def test_comparison_fails_with_reversed_ping_pong(allocated, tmp_path):
    """Teeth: the audit of a copy of the tree whose layer-wise sharding deals params
    ping-pong in reverse order (rank N-1 first) no longer matches the allocated run, in
    the per-rank shares only (the buckets themselves do not change)."""
    tree = tmp_path / "reversed"
    shutil.copytree(tree_parent("series-0.17.1") / "megatron", tree / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    lwo = tree / "megatron" / "core" / "optimizer" / "layer_wise_optimizer.py"
    text = lwo.read_text()
    assert text.count(PING_PONG) == 1, f"{lwo}: the ping-pong line moved; update PING_PONG"
    lwo.write_text(text.replace(PING_PONG, PING_PONG_REVERSED))
    audit = audit_cell("series-0.17.1", tree, tmp_path / "audit.json")
    fails = bucket_mismatches(audit, allocated)
    assert fails, "reversing the ping-pong order went unnoticed"
    assert all(" share_names: " in f or " shares: " in f for f in fails), fails


# ---------------------------------------------------------------- the audit itself
@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    """``audit_param_sync.py --quick`` into a temporary directory: (out_dir, rc, data)."""
    out = tmp_path_factory.mktemp("audit")
    proc = run_python([SCRIPT, "--quick", "--out-dir", out], ok=(0, 1))
    return out, proc.returncode, json.loads((out / "real_shapes.json").read_text())


def _cells(data, **want):
    return [c for c in data["cells"] if all(c[k] == v for k, v in want.items())]


def test_every_cell_ran_and_checks_hold(audit):
    """Every tree x DP cell is there and ran every path, except the pristine tree's known
    crash at expert-DP size 1 (0.17.1: ``max(None)`` over the unsharded expert buckets in
    start_param_sync), which the record keeps as data; the run's own checks hold."""
    _, rc, data = audit
    assert data["meta"]["checks_failed"] == [] and rc == 0
    got = {(c["tree"], c["model"], c["dp"]) for c in data["cells"]}
    assert got == {(t, m, dp) for t in grid.TREES for m in grid.QUICK_MODELS
                   for dp in grid.QUICK_DP_SIZES}  # fmt: skip
    for c in data["cells"]:
        assert "error" not in c, (c["tree"], c["dp"], c["error"])
        assert c["expert_dp"] == c["dp"] // grid.MODELS[c["model"]].ep
        for path in PATHS:
            r = c["paths"][path]
            if c["tree"] == "pristine-0.17.1" and c["expert_dp"] == 1 and path != "optimizer":
                assert r["error"].startswith("TypeError: 'NoneType' object is not iterable"), r
            else:
                assert "error" not in r, (c["tree"], c["dp"], path, r["error"])


def test_pristine_collectives_follow_the_optimizers_shares(audit):
    """0.17.1's async path issues one list all_gather per bucket that some rank owns part
    of: ProcessGroupNCCL's rule then gives, from the optimizer's shares alone, 1 op for
    equal shares (flat output) and one broadcast per rank otherwise, zero-size where a
    rank owns nothing; the collective model's records must say the same."""
    _, _, data = audit
    for c in _cells(data, tree="pristine-0.17.1", dp=64):
        gathered = [b for b in c["buckets"] if b.get("layerwise") and b.get("max_share", 0) > 0]
        r = c["paths"]["async"]
        assert r["calls"] == r["launches"] == len(gathered)
        assert r["ops"] == sum(1 if b["shares_equal"] else b["ranks"] for b in gathered)
        assert r["zero_size_ops"] == sum(0 if b["shares_equal"] else b["ranks"] - b["nonempty_shares"]
                                         for b in gathered)  # fmt: skip
        assert r["forms"] == {k: v for k, v in (
            ("all_gather/equal", sum(b["shares_equal"] for b in gathered)),
            ("all_gather/unequal", sum(not b["shares_equal"] for b in gathered))) if v}  # fmt: skip
        assert r["wire_bytes"] == c["exact_receive_bytes"] > 0


def test_pristine_temporaries(audit):
    """0.17.1 receives into fresh tensors: its async path allocates > 0 bytes, and its
    NCCL temporaries are the flat outputs of the equal-share buckets (DP x share x 2 B)."""
    _, _, data = audit
    (c,) = _cells(data, tree="pristine-0.17.1", model=AUDIT_MODEL, dp=64)
    r = c["paths"]["async"]
    assert r["megatron_peak_bytes"] > 0
    equal = [b for b in c["buckets"] if b.get("layerwise") and b.get("shares_equal") and b["max_share"] > 0]
    assert equal, "no equal-share bucket at DP 64: the MoE's expert buckets should have them"
    assert r["nccl_temporary_bytes"] == sum(b["ranks"] * b["max_share"] * 2 for b in equal)
    assert 0 < r["nccl_peak_bytes"] <= r["nccl_temporary_bytes"]


def test_layout_padding_is_megatrons_own(audit):
    """The layout path of 0.18.2 and of 0.19.2: the padding the audit reads off DDP's layer-wise buffers
    equals the total_padding megatron logs for its layout ("overhead=...%"), and it grows
    with DP; its gathers are all_gather_into_tensor in place (0 temporaries)."""
    _, _, data = audit
    layout_trees = [t for t, spec in grid.TREES.items() if spec.layout]
    assert layout_trees == ["pristine-0.18.2-layout", "pristine-0.19-layout"]
    for tree in layout_trees:
        for model in grid.QUICK_MODELS:
            cells = sorted(_cells(data, tree=tree, model=model), key=lambda c: c["dp"])
            assert [c["dp"] for c in cells] == sorted(grid.QUICK_DP_SIZES)
            for c in cells:
                layerwise_pad = sum(b["numel"] - b["param_numel"] for b in c["buckets"] if b["layerwise"])
                assert c["megatron_layout_log"], "megatron logged no layout"
                assert layerwise_pad == sum(e["total_padding"] for e in c["megatron_layout_log"])
                assert c["padding_elements"] >= layerwise_pad
                r = c["paths"]["async"]
                assert set(r["forms"]) == {"all_gather_into_tensor"}
                assert r["megatron_peak_bytes"] == 0 == r["nccl_temporary_bytes"]
            assert cells[-1]["padding_bytes"] > cells[0]["padding_bytes"] > 0
    for c in _cells(data, tree="pristine-0.17.1"):
        assert c["padding_elements"] == 0


def test_markdown_and_plot(audit):
    out, _, data = audit
    md = (out / "real_shapes.md").read_text()
    assert data["meta"]["command"] in md
    for model in grid.QUICK_MODELS:
        section = md.split("## " + grid.MODELS[model].title, 1)[1]
        rows = [ln for ln in section.split("\n## ", 1)[0].splitlines() if ln.startswith("| ") and ln[2:3].isdigit()]
        assert len(rows) == len(grid.TREES) * len(grid.QUICK_DP_SIZES), model
    assert "real_shapes.png" in md
    png = (out / "real_shapes.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# ---------------------------------------------------------------- the series' claims
def series_claim_failures(cells: list, pristine: list) -> list:
    """The README's claims for the series on ``cells`` (slim records of a series tree) against
    ``pristine`` (its pristine tree's same cells), one message per failure (empty: all hold):
    every claim of ``report.series_claims`` (0 bytes in NCCL, no zero-size operation, launches
    at most pristine's; per path: megatron's temporaries, NCCL operations), every path ran with
    at least one NCCL operation, and on the async and optimizer paths exactly the params other
    ranks own are on the wire (the series never pads)."""
    from harness.audit.report import series_claims

    fails = [f"{c['tree']}/{c['model']}/dp{c['dp']}/{c['path']}: {why}"
             for c in series_claims(cells + pristine) if not c["holds"] for why in c["why"].split("; ")]  # fmt: skip
    for c in cells:
        for path in PATHS:
            where, r = f"{c['tree']}/{c['model']}/dp{c['dp']}/{path}", c.get("paths", {}).get(path, {})
            if "error" in r:
                continue  # a failed claim above
            if r.get("ops", 0) < 1:
                fails.append(f"{where}: did not run, or no NCCL operation")
            elif path != "forced" and r["wire_bytes"] != c["exact_receive_bytes"]:
                fails.append(f"{where}: received {r['wire_bytes']} B, others own {c['exact_receive_bytes']} B")
    return fails


@pytest.mark.parametrize("series", sorted(grid.SERIES_PAIRS))
def test_series_claims_hold_on_every_series_cell(audit, series):
    """Every claim on every cell and path of the quick audit, each series against its pristine
    tree; every cell and path is compared but pristine 0.17.1's known crashes (expert-DP 1,
    async and forced paths)."""
    _, _, data = audit
    pristine = _cells(data, tree=grid.SERIES_PAIRS[series])
    assert len(_cells(data, tree=series)) == len(grid.QUICK_MODELS) * len(grid.QUICK_DP_SIZES)
    assert series_claim_failures(_cells(data, tree=series), pristine) == []
    crashed = {(c["model"], c["dp"], p) for c in pristine for p in PATHS if "error" in c["paths"][p]}
    known = {(c["model"], c["dp"], p) for c in pristine if c["expert_dp"] == 1 for p in ("async", "forced")}
    assert crashed == (known if series == "series-0.17.1" else set())


def test_019_trees_measure_as_their_0171_and_0182_counterparts(audit):
    """On every quick cell and path, the 0.19 series counts exactly what the 0.17.1 series
    does, and 0.19.2's legacy path what 0.18.2's does."""
    _, _, data = audit
    keys = ("calls", "ops", "zero_size_ops", "launches", "wire_bytes", "zeroed_grad_bytes",
            "nccl_temporary_bytes", "megatron_temporary_bytes")
    for tree, other in (("series-0.19", "series-0.17.1"), ("pristine-0.19", "pristine-0.18.2")):
        for c in _cells(data, tree=tree):
            (o,) = _cells(data, tree=other, model=c["model"], dp=c["dp"])
            for path in PATHS:
                got, want = ({k: x["paths"][path].get(k) for k in keys} for x in (c, o))
                assert got == want, (tree, other, c["model"], c["dp"], path, got, want)


def test_series_claims_fail_on_a_mutant(audit, tmp_path):
    """Teeth: the same check on a tree whose forward gathers never receive into grad_data
    (``CLAIM_MUTANT``) fails on megatron's temporaries of the async path, and on nothing
    else."""
    from harness.audit.report import CLAIMS, claims_lines, series_claims
    from harness.audit.run import published_cells

    _, _, data = audit
    out = tmp_path / "mutant.json"
    run_python([WORKER, "--tree", "series-0.17.1", "--cells", CLAIM_MUTANT_CELL, "--out", out],
               tree=make_mutant_tree(CLAIM_MUTANT, tmp_path / "tree"))  # fmt: skip
    cells = published_cells(json.loads(out.read_text()))
    fails = series_claim_failures(cells, _cells(data, tree="pristine-0.17.1"))
    assert fails and all("/async: megatron_" in f and "claimed 0" in f for f in fails), fails
    # The flag path prints the same verdict: the async path's claim does not hold.
    printed = claims_lines(series_claims(cells + _cells(data, tree="pristine-0.17.1")))
    assert any(ln.strip().startswith(f"async forward gather: {CLAIMS['async']}: does not hold: DP 64: megatron_")
               for ln in printed), printed  # fmt: skip


VPP_MODEL = "llama3_70b_tp4_pp4_vpp5"


@pytest.mark.extended
def test_series_claims_hold_with_vpp(tmp_path):
    """The interleaved-pipeline cell (VPP_MODEL at DP 64: 5 model chunks, one DDP each,
    one layer-wise optimizer) on 0.17.1 and the series: the series' claims hold there
    too, and the optimizer path gathers every chunk at once (1 launch, as 0.17.1's one
    list all_gather)."""
    from harness.audit.run import published_cells

    cells = {}
    for tree in ("pristine-0.17.1", "series-0.17.1"):
        out = tmp_path / f"{tree}.json"
        run_python([WORKER, "--tree", tree, "--cells", f"{VPP_MODEL}:64", "--out", out], tree=tree)
        (cells[tree],) = published_cells(json.loads(out.read_text()))
    up, series = cells["pristine-0.17.1"], cells["series-0.17.1"]
    assert up["vpp"] == 5 and up["num_bucket_groups"] == series["num_bucket_groups"] == 5
    assert series_claim_failures([series], [up]) == []
    assert series["paths"]["optimizer"]["launches"] == up["paths"]["optimizer"]["launches"] == 1


# ---------------------------------------------------------------- worker pieces, in process
def test_meta_device_mode_puts_every_new_tensor_on_meta():
    """Whatever device megatron asks for, tensors are storage-free; CUDA type names."""
    import torch

    from harness.audit.worker import MetaDeviceMode

    with MetaDeviceMode():
        made = [torch.zeros(3, device="cuda"), torch.empty(2, 2), torch.tensor([1.0, 2.0], device=0),
                torch.ones(4, dtype=torch.bfloat16).cuda(), torch.empty(5).to("cuda:0", non_blocking=True)]  # fmt: skip
        name = made[3].type()
    assert all(t.is_meta for t in made)
    assert name == "torch.cuda.BFloat16Tensor"
    assert torch.empty(1).device.type == "cpu"  # the mode is gone after the block


def test_sync_counter_counts_zeroing_of_grad_data_views():
    """zero_, fill_(0) and _foreach_zero_ on views of grad_data (any dtype view) count
    their bytes as zeroed grad_data; other tensors and non-zero fills do not."""
    import torch

    from harness.alloc_counter import storage_key
    from harness.audit.worker import SyncCounter

    grad = torch.empty(100, device="meta")
    other = torch.empty(10, device="meta", dtype=torch.bfloat16)
    with SyncCounter(grad_storages={storage_key(grad)}) as c:
        torch._foreach_zero_([grad[0:4], grad.view(torch.bfloat16)[20:30]])
        grad[50:60].fill_(0)
        grad[60:70].fill_(1.0)
        other.zero_()
        kept = torch.empty(7, device="meta")
    assert c.zeroed_grad_bytes == 4 * 4 + 10 * 2 + 10 * 4
    assert c.zeroed_other_bytes == 10 * 2
    assert (c.temporary_bytes, c.peak_extra_bytes, kept.is_meta) == (28, 28, True)


# ---------------------------------------------------------------- your model: the flag path
#: Volatile or flag-path-only keys of a cell record; every other key must be equal.
FLAGS_ONLY_KEYS = ("model", "wall_s", "init_s", "tree_dir", "flags", "layer_spec", "size")
#: The flag run of a built-in model through the driver: Llama-3-8B TP 1 on 0.17.1, pristine and
#: the series, at the quick DP sizes. The MoE model's flags run on pristine 0.19.2's parser and
#: gpt_builder in ``worker_019`` (one process for everything that needs no driver).
FLAGS_MODEL, FLAGS_TREES = "llama3_8b_tp1", ("pristine-0.17.1", "series-0.17.1")
#: Published cells of a pristine tree (they change only with megatron-core itself).
PUBLISHED = REPO_ROOT / "docs" / "bench" / "real_shapes.json"


def run_audit_flags(out: Path, flags, *options) -> subprocess.CompletedProcess:
    """``audit_param_sync.py OPTIONS --out-dir OUT -- FLAGS``."""
    return run_python([SCRIPT, *options, "--out-dir", out, "--", *flags], ok=None)


def cell_differences(got: dict, want: dict) -> list:
    """Keys (``path.key`` inside paths) whose values differ, flag-path-only keys left out."""
    keys = (set(got) | set(want)) - set(FLAGS_ONLY_KEYS) - {"paths"}
    diff = [k for k in sorted(keys) if got.get(k) != want.get(k)]
    for path in sorted(set(got.get("paths", {})) | set(want.get("paths", {}))):
        g, w = got.get("paths", {}).get(path, {}), want.get("paths", {}).get(path, {})
        diff += [f"{path}.{k}" for k in sorted(set(g) | set(w)) if g.get(k) != w.get(k)]
    return diff


@pytest.fixture(scope="module")
def flags_audit(tmp_path_factory):
    """(data, stdout) of the driver's flag path on FLAGS_MODEL's flags (FLAGS_TREES, quick DP sizes)."""
    d = tmp_path_factory.mktemp("flags")
    proc = run_audit_flags(d, grid.MODEL_FLAGS[FLAGS_MODEL], "--trees", ",".join(FLAGS_TREES),
                           "--label", FLAGS_MODEL, "--dp-sizes", ",".join(map(str, grid.QUICK_DP_SIZES)))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((d / "real_shapes.json").read_text()), proc.stdout


@pytest.mark.extended
def test_flags_reproduce_the_builtin_cells(audit, flags_audit):
    """The flags of Llama-3-8B TP 1 (grid.MODEL_FLAGS), parsed by 0.17.1's own
    megatron.training.arguments and built by its gpt_builder, give exactly the built-in model's
    cells of the same run (every key of every path: buckets, shares, collectives, temporaries,
    zeroing, padding) at DP 8 and 64, on pristine 0.17.1 and the series; and pristine's cells
    equal the published ones."""
    _, _, data = audit
    published = {(c["tree"], c["model"], c["dp"]): c for c in json.loads(PUBLISHED.read_text())["cells"]}
    fdata, stdout = flags_audit
    want_cells = {(t, dp) for t in FLAGS_TREES for dp in grid.QUICK_DP_SIZES}
    assert {(c["tree"], c["dp"]) for c in fdata["cells"]} == want_cells
    for c in fdata["cells"]:
        assert c["model"] == FLAGS_MODEL and c["layer_spec"] == "local"
        (want,) = _cells(data, tree=c["tree"], model=FLAGS_MODEL, dp=c["dp"])
        assert cell_differences(c, want) == [], (c["tree"], c["dp"])
        if c["tree"] == "pristine-0.17.1":
            assert cell_differences(c, published[("pristine-0.17.1", FLAGS_MODEL, c["dp"])]) == [], c["dp"]
    assert fdata["meta"]["checks_failed"] == [] and fdata["meta"]["flags_rejected"] == []
    assert f"== {FLAGS_MODEL} (pretrain_gpt.py flags)" in stdout


@pytest.mark.extended
def test_flags_report_the_series_claims_against_pristine(flags_audit):
    """The flag path's claims (``series_claims``) on Llama-3-8B: every series cell and path is
    judged against pristine, and holds; judged as if pristine were the series, every cell
    fails, named by the claim it breaks."""
    from harness.audit.report import CLAIMS, PATH_NAMES, series_claims

    data, stdout = flags_audit
    claims = data["meta"]["series_claims"]
    assert claims == series_claims(data["cells"])
    assert len(claims) == len(grid.QUICK_DP_SIZES) * len(PATHS)
    assert all(c["holds"] for c in claims), claims
    assert "  series-0.17.1 against pristine-0.17.1:" in stdout
    for path in PATHS:
        assert f"{PATH_NAMES[path]}: {CLAIMS[path]}: holds (DP 8, 64)" in stdout, path
    # A claim that fails is named: the pristine cell as the "series" one.
    pristine_as_series = series_claims(data["cells"], pairs={"pristine-0.17.1": "series-0.17.1"})
    assert pristine_as_series and not any(c["holds"] for c in pristine_as_series)
    assert all(
        ("zero_size_ops" if c["path"] == "forced" else "megatron_temporary_bytes") in c["why"]
        for c in pristine_as_series
    ), pristine_as_series


def _drop(flags, name: str, values: int = 1) -> list:
    i = flags.index(name)
    return [*flags[:i], *flags[i + 1 + values :]]


#: Bad flags, one per kind, and what megatron (or the audit) says of each.
_LLAMA = list(grid.MODEL_FLAGS["llama3_8b_tp1"])
BAD_FLAGS = {
    "unknown": (_LLAMA + ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    "contradictory": (_LLAMA + ["--fp16"], "assert not args.bf16"),
    "contradictory sizes": (_LLAMA + ["--seq-length", "16384"], "must be greater than or equal to seq_length"),
    "heads not divisible by TP": (_LLAMA + ["--tensor-model-parallel-size", "3"],
                                  "must be a multiple of tensor_model_parallel_size"),
    "FFN not divisible by TP": (_drop(_LLAMA, "--ffn-hidden-size") + ["--ffn-hidden-size", "14337",
                                "--tensor-model-parallel-size", "2"], "14337 is not divisible by 2"),
    "no vocabulary": (_drop(_LLAMA, "--vocab-size") + ["--tokenizer-type", "HuggingFaceTokenizer"], "add --vocab-size"),
    "not bf16": (_drop(_LLAMA, "--bf16", 0), "add --bf16"),
    "world not divisible by TP": (_LLAMA + ["--tensor-model-parallel-size", "8"],
                                  "world size (12) is not divisible by total_model_size"),
}  # fmt: skip
#: The kinds run at world size 12 (--world-size), the others at DP 8 (--dp-sizes).
AT_WORLD_12 = ("world not divisible by TP",)
#: What ``worker_019`` runs in one process of pristine 0.19.2 (pristine-0.19): each bad
#: kind through run_flags, --world-size 64's DP, Llama-3-8B with megatron's default
#: --transformer-impl (Transformer Engine, here its stand-in) at DP 8 (async path), and the
#: MoE model's flags at DP 64 (every path).
WORKER_019_TREE = "pristine-0.19"
WORKER_019_SCRIPT = """
import json, sys
from harness import model
from harness.audit import grid, worker as W
from harness.trees import check_expected_tree
check_expected_tree()
model.fake_all_gather_object(); W._member_groups_only(); mc = W._mc()
tree = grid.TREES[sys.argv[1]]
kinds, at_world_12, flags_te, moe = json.loads(sys.argv[2])
out = {}
for kind, flags in kinds.items():
    size = dict(world_sizes=[12]) if kind in at_world_12 else dict(dp_sizes=[8])
    (rec,) = W.run_flags(mc, tree, dict(label="bad", flags=flags, **size), ["async"])
    out[kind] = rec.get("flags_error")
out["dp_of_world_64"] = W.FlagsSpec("w", flags_te, world_size=64).dp
(out["moe"],) = W.run_flags(mc, tree, dict(label=moe, flags=grid.MODEL_FLAGS[moe], dp_sizes=[64]), W.PATHS)
(out["te"],) = W.run_flags(mc, tree, dict(label="te", flags=flags_te, dp_sizes=[8]), ["async"])
from harness.audit import te_standin
def fail():
    raise ImportError("cannot import name 'X' from 'transformer_engine.pytorch'")
te_standin.install = fail  # a release the stand-in cannot serve: the local spec, said so
out["fallback"] = W.layer_spec_for(flags_te)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def worker_019():
    """The output of WORKER_019_SCRIPT (one worker process on pristine 0.19.2)."""
    flags_te = _drop(_drop(_LLAMA, "--transformer-impl"), "--optimizer")
    job = [{k: f for k, (f, _) in BAD_FLAGS.items()}, AT_WORLD_12, flags_te, AUDIT_MODEL]
    proc = run_python(["-P", "-c", WORKER_019_SCRIPT, WORKER_019_TREE, json.dumps(job)], tree=WORKER_019_TREE)
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.mark.extended
def test_bad_flags_of_each_kind_get_megatrons_message(worker_019):
    """Each kind of bad input (BAD_FLAGS), on 0.19.2: the cell holds megatron's own message
    (argparse's, validate_args', TransformerConfig's, the layer's divide) or the audit's own,
    and no path ran; --world-size 64 at TP 1 is DP 64, as megatron derives it."""
    for kind, (_, message) in BAD_FLAGS.items():
        assert worker_019[kind] and message in worker_019[kind], (kind, worker_019[kind])
    assert worker_019["dp_of_world_64"] == 64


@pytest.mark.extended
def test_te_spec_gives_tes_parameter_layout(worker_019):
    """Llama-3-8B with megatron's default spec (Transformer Engine; its stand-in here, TE not
    installed) on pristine 0.19.2 at DP 8: 784 NCCL operations, 630 of them zero-size, against
    the local spec's 629 (pristine: these counts change only with megatron-core); the same
    8,030,261,248 params. Where the stand-in cannot serve a release, the local spec is audited
    and the layer spec says so, why, and what that changes."""
    te = worker_019["te"]
    assert te["layer_spec"].startswith("transformer_engine (stand-in"), te["layer_spec"]
    spec, more = worker_019["fallback"]  # where the stand-in fails: the local spec, and why, and what changes
    assert spec.startswith("local in place of transformer_engine") and "cannot import name 'X'" in spec
    assert "629" in spec and more == ["--transformer-impl", "local"]
    assert "error" not in te and "flags_error" not in te, te
    assert (te["paths"]["async"]["ops"], te["paths"]["async"]["zero_size_ops"]) == (784, 630)
    assert te["param_numel"] == 8_030_261_248


@pytest.mark.extended
def test_moe_flags_reproduce_the_builtin_cells(audit, worker_019):
    """The MoE model's flags on 0.19.2's own parser and gpt_builder at DP 64 (expert DP 8:
    expert buckets gathered) give exactly the built-in model's cell of the quick audit."""
    from harness.audit.run import published_cells

    _, _, data = audit
    rec = worker_019["moe"]
    assert "flags_error" not in rec and rec["layer_spec"] == "local", rec.get("flags_error")
    (want,) = _cells(data, tree=WORKER_019_TREE, model=AUDIT_MODEL, dp=64)
    assert cell_differences(published_cells([rec])[0], want) == []


def test_bad_flags_exit_2_with_no_traceback_and_nothing_written(tmp_path):
    """End to end: flags every tree refuses exit 2 with megatron's message per tree, no
    traceback, and no output directory."""
    out = tmp_path / "out"
    proc = run_audit_flags(out, BAD_FLAGS["unknown"][0], "--trees", "pristine-0.17.1", "--dp-sizes", "8")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pristine-0.17.1 (DP 8): pretrain_gpt.py: error: unrecognized arguments: --no-such-flag" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("options, message", [
    ([], "no pretrain_gpt.py flags after --"),
    (["--dp-sizes", "8", "--world-size", "64"], "one of the two"),
    (["--dp-sizes", "8,x"], "expected comma-separated integers"),
    (["--dp-sizes", "0"], "expected integers >= 1"),
    (["--dp-sizes", "8", "--label", "my model"], "letters, digits"),
    (["--dp-sizes", "8", "--quick"], "do not go with pretrain_gpt.py flags"),
    (["--dp-sizes", "8", "--trees", "nope"], "unknown trees"),
])  # fmt: skip
def test_bad_audit_options_exit_2(options, message, capsys, tmp_path):
    """The audit's own options, with flags: argparse's exit 2 and message, before any worker."""
    from harness.audit.run import main

    flags = [] if not options else ["--num-layers", "2"]
    with pytest.raises(SystemExit) as exc:
        main([*options, "--out-dir", str(tmp_path / "out"), "--", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_flags_refused_by_one_base_are_reported_per_tree():
    """sort_flags_results: a tree that refuses the flags is listed with megatron's message while
    the others' cells stand; a size every tree refuses, or flags no tree takes, are bad input."""
    from harness.audit.run import FlagsRejected, sort_flags_results

    ok = dict(tree="pristine-0.19", model="m", dp=8, size=["dp", 8], paths={})
    refused = dict(tree="pristine-0.17.1", model="m", size=["dp", 8], flags_error="pretrain_gpt.py: error: unrecognized")
    ran, rejected = sort_flags_results({"pristine-0.17.1": [refused], "pristine-0.19": [ok]}, [("dp", 8)])
    assert ran == [ok] and rejected == [dict(tree="pristine-0.17.1", size="DP 8", message=refused["flags_error"])]
    with pytest.raises(FlagsRejected, match="pristine-0.17.1 \\(DP 8\\): pretrain_gpt.py: error"):
        sort_flags_results({"pristine-0.17.1": [refused]}, [("dp", 8)])
    big = dict(refused, tree="pristine-0.19", size=["dp", 16], flags_error="validate_args: no")
    with pytest.raises(FlagsRejected, match="at DP 16 on every tree"):
        sort_flags_results({"pristine-0.17.1": [dict(refused, size=["dp", 16])], "pristine-0.19": [ok, big]},
                           [("dp", 8), ("dp", 16)])  # fmt: skip


# ---------------------------------------------------------------- what the flag path prints
def _claim_cells(series_async_peak: int = 0):
    """A pristine and a series cell (slim records, 2 layer-wise buckets of 4 params, DP 8) whose
    counts satisfy every claim; ``series_async_peak`` > 0 breaks the async path's."""
    buckets = [dict(expert=False, layerwise=True, numel=1000, param_numel=1000, params=4, max_param_numel=400,
                    ranks=8, nonempty_shares=3, max_share=400, shares_equal=False) for _ in range(2)]

    def path(ops, zero, launches, megatron=0, peak=0):
        return dict(calls=launches, forms={"broadcast": launches}, ops=ops, zero_size_ops=zero, launches=launches,
                    wire_bytes=2000, zeroed_grad_bytes=0, megatron_temporary_bytes=megatron,
                    megatron_peak_bytes=peak, nccl_temporary_bytes=0, nccl_peak_bytes=0)

    base = dict(model="m", dp=8, expert_dp=8, ep=1, param_bytes=4000, param_numel=2000, buckets=buckets,
                exact_receive_bytes=2000, theoretical_memory=dict(weight_and_optimizer_mb=1024.0, activation_mb=1024.0,
                                                                  total_mb=2048.0, num_microbatches=1))  # fmt: skip
    pristine = dict(base, tree="pristine-0.19", paths={
        "async": path(16, 10, 2, 4000, 2000), "forced": path(16, 10, 2, 4000, 2000),
        "optimizer": path(8, 0, 1, 4000, 4000)})  # fmt: skip
    series = dict(base, tree="series-0.19", paths={
        "async": path(6, 0, 2, series_async_peak, series_async_peak), "forced": path(6, 0, 2, 2000, 1000),
        "optimizer": path(8, 0, 1)})  # fmt: skip
    return [pristine, series]


def _flags_data(cells):
    from harness.audit.report import series_claims

    trees = {t: dict(title=grid.TREES[t].title, layout=False) for t in ("pristine-0.19", "series-0.19")}
    meta = dict(models={"m": dict(title="m (pretrain_gpt.py flags)", summary="", notes="")}, trees=trees, base="0.19",
                series_claims=series_claims(cells))  # fmt: skip
    return {"meta": meta, "cells": cells}


def test_printed_claims_are_series_claims_per_path():
    """The flag path prints, per path, the series' claim in the README's words and whether it
    holds, from ``series_claims`` (the same check): every claim holds on a series cell whose
    counts meet them (195 operations against pristine's 32 on the optimizer path is the claim:
    one per sharded param), and a cell with a temporary on the async path prints "does not
    hold" for that path and for no other."""
    from harness.audit.report import CLAIMS, PATH_NAMES, claims_lines, flags_text, series_claims

    good = _flags_data(_claim_cells())
    text = flags_text(good)
    assert claims_lines(series_claims(good["cells"])) == claims_lines(good["meta"]["series_claims"])
    assert "\n".join(claims_lines(good["meta"]["series_claims"])) in text
    for path in PATHS:
        assert f"    {PATH_NAMES[path]}: {CLAIMS[path]}: holds (DP 8)" in text, path
    assert "does not hold" not in text and "0 temporaries in megatron and NCCL" not in text
    bad = _flags_data(_claim_cells(series_async_peak=512))
    text = flags_text(bad)
    assert f"    async forward gather: {CLAIMS['async']}: does not hold: DP 8: megatron_temporary_bytes 512, " \
           "claimed 0; megatron_peak_bytes 512, claimed 0" in text
    assert text.count("does not hold") == 1


def test_flags_text_legend_and_the_users_path():
    """The flag path's stdout names every path (what it is, when megatron.training takes it)
    and every tree, says which rows are the user's release (``--base``) and path (from the
    flags megatron parsed), and shows each path's peak next to megatron's step estimate."""
    from harness.audit.report import PATH_WHEN, flags_text

    cells = _claim_cells()
    for c in cells:
        c["flags"] = dict(overlap_param_gather=False)
    cells[1]["paths"]["forced"]["megatron_peak_bytes"] = 1 << 29  # 0.5 GiB against an estimate of 2 GiB
    text = flags_text(_flags_data(cells))
    for path in PATHS:
        assert PATH_WHEN[path] in text
    assert "series-0.19             0.19.2 + its series" in text and "Rows of megatron-core 0.19 only (--base 0.19" in text
    assert "Your flags take the optimizer-step gather (no --overlap-param-gather)" in text
    opt = [ln for ln in text.splitlines() if ln.startswith(" * ")]
    assert len(opt) == 2 and all(" optimizer " in ln for ln in opt), opt
    assert "megatron's step estimate GiB, weights + optimizer state + activations: 2.00 (1.00 + 1.00)" in text
    forced = [ln for ln in text.splitlines() if "forced    series-0.19" in ln]
    assert len(forced) == 1 and forced[0].endswith(" 0.50 / 2.00 (25.0%)"), forced


def test_plot_is_readable_with_one_model(tmp_path):
    """One model's plot is at least PLOT_MIN_WIDTH_IN wide (880 px), title and legend inside."""
    from harness.audit.report import PLOT_MIN_WIDTH_IN, write_plot

    data = _flags_data(_claim_cells())
    data["meta"]["trees"] = {t: dict(m, layout=False) for t, m in data["meta"]["trees"].items()}
    write_plot(data, tmp_path / "p.png")
    png = (tmp_path / "p.png").read_bytes()
    width = int.from_bytes(png[16:20], "big")
    assert width >= PLOT_MIN_WIDTH_IN * 110 * 0.95, width


#: The user's run of the flag path's end-to-end test: Llama-3-8B TP 2 with the forward's gathers
#: overlapped, at DP 8, on the default base (0.19).
USER_FLAGS = [*grid.MODEL_FLAGS["llama3_8b_tp2"], "--overlap-grad-reduce", "--overlap-param-gather"]
DIRECT_THEORY = """
import json, sys
from harness.audit import worker as W
from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
from megatron.training.theoretical_memory_usage import report_theoretical_memory
flags, dp = json.loads(sys.argv[1])
args = W.parse_flags(flags, dp=dp)
args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args)
report_theoretical_memory(args, num_microbatches=1, verbose=False)
"""


@pytest.fixture(scope="module")
def user_audit(tmp_path_factory):
    """(data, stdout, out dir) of ``audit_param_sync.py --dp-sizes 8 -- USER_FLAGS`` (no --base)."""
    d = tmp_path_factory.mktemp("user")
    proc = run_audit_flags(d, USER_FLAGS, "--dp-sizes", "8", "--label", "llama8b_tp2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((d / "real_shapes.json").read_text()), proc.stdout, d


def test_flags_default_to_the_019_rows_and_say_the_users_path(user_audit):
    """No --base: only megatron-core 0.19's trees run and print; the flags' path (async and
    forced, --overlap-param-gather) is named and its legacy rows marked; the plot is readable."""
    from harness.audit.report import PLOT_MIN_WIDTH_IN

    data, stdout, out = user_audit
    assert list(data["meta"]["trees"]) == ["pristine-0.19", "series-0.19", "pristine-0.19-layout"]
    assert data["meta"]["base"] == "0.19" and "Rows of megatron-core 0.19 only" in stdout
    assert "Your flags take the async forward gather (--overlap-param-gather) every step, and a forced sync" in stdout
    marked = [ln.split()[1:3] for ln in stdout.splitlines() if ln.startswith(" * ")]
    assert sorted(marked) == sorted([p, t] for p in ("async", "forced") for t in ("pristine-0.19", "series-0.19"))
    png = (out / "real_shapes.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") >= PLOT_MIN_WIDTH_IN * 110 * 0.95


def test_step_estimate_is_megatrons_theoretical_memory(user_audit):
    """Every cell's step estimate is what megatron's own report_theoretical_memory prints for
    the same flags at that DP (a direct call in a process of the tree), and the stdout table,
    the Markdown table and the forced-sync section show it next to the forced sync's peak."""
    from harness.audit.report import forced_against_step, gib, theory_text, transient_peak

    data, stdout, out = user_audit
    proc = run_python(["-P", "-c", DIRECT_THEORY, json.dumps([USER_FLAGS, 8])], tree="pristine-0.19")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("Theoretical memory footprints:"))
    direct = [float(x) for x in __import__("re").findall(r"=([0-9.]+) MB", line)]
    assert len(direct) == 3 and direct[2] > 1000
    md = (out / "real_shapes.md").read_text()
    for c in data["cells"]:
        t = c["theoretical_memory"]
        assert [t["weight_and_optimizer_mb"], t["activation_mb"], t["total_mb"]] == direct, (c["tree"], t, line)
        assert t["num_microbatches"] == 1
        peak = transient_peak(c, "forced")
        assert f"{gib(peak)} / {gib(t['total_mb'] * 2**20)}" in md.split("## Forced syncs")[1]
        assert forced_against_step(c) in md.split("## Forced syncs")[0]  # the model table's column
    estimate = theory_text(data["cells"][0])
    assert f"megatron's step estimate GiB, weights + optimizer state + activations: {estimate}" in stdout
    forced = [ln for ln in stdout.splitlines() if ln.startswith(" * forced    series-0.19")]
    (series,) = _cells(data, tree="series-0.19")
    assert len(forced) == 1 and f"{gib(transient_peak(series, 'forced'))} / {gib(direct[2] * 2**20)}" in forced[0]


def test_render_from_a_published_json_runs_no_audit(tmp_path, capsys):
    """``--render-from``: the Markdown and plot again from a JSON whose cells all carry megatron's
    step estimate: no worker runs, the cells are unchanged, the forced-sync section is there;
    the cells of a tree the grid no longer has are dropped, with the tree."""
    from harness.audit.run import COLUMNS, dump_json, main

    data = _flags_data(_claim_cells())
    data["meta"].update(command="c", date="d", torch="t", wall_s=1.0, cpus=2, method="m", columns="old",
                        trees={t: dict(m, dir="x") for t, m in data["meta"]["trees"].items()})  # fmt: skip
    del data["meta"]["series_claims"]
    retired = [dict(c, tree="retired-tree") for c in data["cells"][:1]]
    src = tmp_path / "in.json"
    src.write_text(dump_json(dict(meta=dict(data["meta"], trees=dict(data["meta"]["trees"], **{
        "retired-tree": dict(title="gone", layout=False, dir="x")})), cells=data["cells"] + retired)))  # fmt: skip
    assert main(["--render-from", str(src), "--out-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "(0 given megatron's step estimate)" in out and "no longer in harness/audit/grid.py: retired-tree" in out
    got = json.loads((tmp_path / "out" / "real_shapes.json").read_text())
    assert got["cells"] == data["cells"] and got["meta"]["columns"] == COLUMNS
    assert list(got["meta"]["trees"]) == list(data["meta"]["trees"])
    md = (tmp_path / "out" / "real_shapes.md").read_text()
    assert "retired-tree" not in md
    assert "## Forced syncs against the step's peak" in md and "| m | 8 | 2.00 (1.00 + 1.00) |" in md
    assert not (tmp_path / "out" / "raw-theory").exists()
    with pytest.raises(SystemExit):
        main(["--render-from", str(src), "--trees", "pristine-0.17.1", "--out-dir", str(tmp_path / "o2")])
