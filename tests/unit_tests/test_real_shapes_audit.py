"""Tests of the real-shape audit (scripts/audit_param_sync.py, harness/bench/real_shapes*.py).

1. The audit is faithful: for a small MoE config at DP 4 (harness/bench/real_shapes.py
   CHECK_MODELS), its storage-free, fake-process-group run yields exactly the buckets
   (param names, numel) and per-rank shares (which params each DP and expert-DP rank owns
   in each bucket) of an ALLOCATED megatron DDP + LayerWiseDistributedOptimizer on 4 real
   gloo ranks (tests/unit_tests/real_shapes_check_worker.py). The comparison has teeth:
   the audit of a tree whose ping-pong sharding order is reversed fails it.
2. The audit runs (``--quick``: Llama-3-8B TP 1 and the DeepSeek-V2-Lite-like MoE at DP 8 and
   64, every tree; about 30 s on 2 cores): every cell is there, its structural checks hold,
   the collective counts of the pristine tree follow from the shares the optimizer made (two
   sources of one run), 0.18.2's layout padding equals what megatron itself logs, and the
   report has a table per model and a plot.
3. The README's claims for the series hold on every series cell of that run, on every path
   (async, forced, optimizer): 0 bytes of megatron temporaries and of NCCL temporaries, no
   zero-size NCCL call, no more NCCL calls and group launches than 0.17.1 wherever 0.17.1
   runs, and exactly the other ranks' shares on the wire (``series_claim_failures``). The
   same check on a tree with a deliberate bug (``tests/mutants/``) fails.

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

from harness.bench import real_shapes
from harness.launch import CORE_PRELOAD, LaunchError, run_command, torchrun_command
from harness.trees import REPO_ROOT, env_for_tree, make_mutant_tree, tree_parent

SCRIPT = REPO_ROOT / "scripts" / "audit_param_sync.py"
WORKER = REPO_ROOT / "harness" / "bench" / "real_shapes_worker.py"
CHECK_WORKER = Path(__file__).with_name("real_shapes_check_worker.py")
CHECK_MODEL = "check_moe_ep2"
CHECK_DP = 4
AUDIT_MODEL = "dsv2_lite_ep8"  # the MoE of the quick audit: expert-DP buckets, 0.17.1's crash
PATHS = ("async", "forced", "optimizer")
#: A deliberate bug for the claims' check: a single-param owner's broadcast goes through a
#: copy of the param (megatron allocates it), on the model whose owners mostly send one param.
CLAIM_MUTANT = REPO_ROOT / "tests" / "mutants" / "audit" / "grad_data_never_idle.patch"
CLAIM_MUTANT_CELL = "llama3_8b_tp1:64"
TIMEOUT_S = 600
#: The ping-pong deal of LayerWiseDistributedOptimizer.shard_params (0.17.1), and reversed.
PING_PONG = "dp_cp_loop = list(range(dp_cp_size)) + list(range(dp_cp_size))[::-1]"
PING_PONG_REVERSED = "dp_cp_loop = list(range(dp_cp_size))[::-1] + list(range(dp_cp_size))"

pytestmark = [pytest.mark.gloo]


def audit_cell(tree_label: str, tree_dir, out: Path) -> dict:
    """The audit worker's record of the check model at DP 4 (bucket detail on) on ``tree_dir``."""
    env = env_for_tree(tree_dir)
    env.update(MEGATRON_CPU_RUNTIME="force", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--tree", tree_label, "--cells", f"{CHECK_MODEL}:{CHECK_DP}",
         "--paths", "async", "--bucket-detail", "--out", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
    """The check model's buckets on 4 real gloo ranks, allocated, on the patched tree."""
    out = tmp_path_factory.mktemp("allocated") / "real.json"
    cmd, env = torchrun_command(CHECK_WORKER, ["--model", CHECK_MODEL, "--out", str(out)], CHECK_DP,
                                tree="patched", extra_env={"PYTHONWARNINGS": "ignore"}, preload=CORE_PRELOAD)  # fmt: skip
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
    audit = audit_cell("patched", "patched", tmp_path / "audit.json")
    assert (audit["dp"], audit["expert_dp"]) == (CHECK_DP, 2)
    assert bucket_mismatches(audit, real) == []


def test_comparison_fails_with_reversed_ping_pong(allocated, tmp_path):
    """Teeth: the audit of a copy of the tree whose layer-wise sharding deals params
    ping-pong in reverse order (rank N-1 first) no longer matches the allocated run, in
    the per-rank shares only (the buckets themselves do not change)."""
    tree = tmp_path / "reversed"
    shutil.copytree(tree_parent("patched") / "megatron", tree / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    lwo = tree / "megatron" / "core" / "optimizer" / "layer_wise_optimizer.py"
    text = lwo.read_text()
    assert text.count(PING_PONG) == 1, f"{lwo}: the ping-pong line moved; update PING_PONG"
    lwo.write_text(text.replace(PING_PONG, PING_PONG_REVERSED))
    audit = audit_cell("patched", tree, tmp_path / "audit.json")
    fails = bucket_mismatches(audit, allocated)
    assert fails, "reversing the ping-pong order went unnoticed"
    assert all(" share_names: " in f or " shares: " in f for f in fails), fails


# ---------------------------------------------------------------- the audit itself
@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    """``audit_param_sync.py --quick`` into a temporary directory: (out_dir, rc, data)."""
    out = tmp_path_factory.mktemp("audit")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
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
    assert got == {(t, m, dp) for t in real_shapes.TREES for m in real_shapes.QUICK_MODELS
                   for dp in real_shapes.QUICK_DP_SIZES}  # fmt: skip
    for c in data["cells"]:
        assert "error" not in c, (c["tree"], c["dp"], c["error"])
        assert c["expert_dp"] == c["dp"] // real_shapes.MODELS[c["model"]].ep
        for path in PATHS:
            r = c["paths"][path]
            if c["tree"] == "upstream" and c["expert_dp"] == 1 and path != "optimizer":
                assert r["error"].startswith("TypeError: 'NoneType' object is not iterable"), r
            else:
                assert "error" not in r, (c["tree"], c["dp"], path, r["error"])


def test_pristine_collectives_follow_the_optimizers_shares(audit):
    """0.17.1's async path issues one list all_gather per bucket that some rank owns part
    of: ProcessGroupNCCL's rule then gives, from the optimizer's shares alone, 1 op for
    equal shares (flat output) and one broadcast per rank otherwise, zero-size where a
    rank owns nothing; the collective model's records must say the same."""
    _, _, data = audit
    for c in _cells(data, tree="upstream", dp=64):
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
    (c,) = _cells(data, tree="upstream", model=AUDIT_MODEL, dp=64)
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
    layout_trees = [t for t, spec in real_shapes.TREES.items() if spec.layout]
    assert layout_trees == ["mcore_0.18_layout", "mcore_0.19_layout"]
    for tree in layout_trees:
        for model in real_shapes.QUICK_MODELS:
            _layout_padding_is_megatrons_own(sorted(_cells(data, tree=tree, model=model), key=lambda c: c["dp"]))
    for c in _cells(data, tree="upstream"):
        assert c["padding_elements"] == 0


def _layout_padding_is_megatrons_own(cells):
    assert [c["dp"] for c in cells] == sorted(real_shapes.QUICK_DP_SIZES)
    for c in cells:
        layerwise_pad = sum(b["numel"] - b["param_numel"] for b in c["buckets"] if b["layerwise"])
        assert c["megatron_layout_log"], "megatron logged no layout"
        assert layerwise_pad == sum(e["total_padding"] for e in c["megatron_layout_log"])
        assert c["padding_elements"] >= layerwise_pad
        r = c["paths"]["async"]
        assert set(r["forms"]) == {"all_gather_into_tensor"}
        assert r["megatron_peak_bytes"] == 0 == r["nccl_temporary_bytes"]
    assert cells[-1]["padding_bytes"] > cells[0]["padding_bytes"] > 0


def test_markdown_and_plot(audit):
    out, _, data = audit
    md = (out / "real_shapes.md").read_text()
    assert data["meta"]["command"] in md
    for model in real_shapes.QUICK_MODELS:
        section = md.split("## " + real_shapes.MODELS[model].title, 1)[1]
        rows = [ln for ln in section.split("\n## ", 1)[0].splitlines() if ln.startswith("| ") and ln[2:3].isdigit()]
        assert len(rows) == len(real_shapes.TREES) * len(real_shapes.QUICK_DP_SIZES), model
    assert "real_shapes.png" in md
    png = (out / "real_shapes.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# ---------------------------------------------------------------- the series' claims
def series_claim_failures(cells: list, pristine: list) -> list:
    """The README's claims for the series, one message per failure (empty: all hold).

    For every series cell (``cells``) and every path: it ran; NCCL would allocate 0 bytes
    (temporaries and peaks); no zero-size NCCL call; at least one NCCL call; and wherever
    0.17.1 ran the same cell and path (``pristine``, same model and DP), at most its group
    launches. By path:

    - async (the forward's gathers into idle grad_data): megatron allocates 0 bytes, and the
      NCCL calls are at most 0.17.1's;
    - forced: a temporary per bucket, one bucket at a time, as 0.17.1 (megatron's peak at
      most the largest layer-wise bucket's params), and the NCCL calls at most 0.17.1's;
    - optimizer (each param broadcast in place): megatron allocates 0 bytes, and there is
      one NCCL call per param of the model on this rank (more than 0.17.1's one per DP
      rank where DP is below the param count).

    On the async and optimizer paths, exactly the bytes of the params other ranks own are on
    the wire (the series never pads)."""
    fails = []
    up = {(c["model"], c["dp"]): c for c in pristine}
    for c in cells:
        for path in PATHS:
            where = f"{c['tree']}/{c['model']}/dp{c['dp']}/{path}"
            r = c.get("paths", {}).get(path)
            if r is None or "error" in r:
                fails.append(f"{where}: did not run: {r and r['error']}")
                continue
            zero = ["nccl_temporary_bytes", "nccl_peak_bytes", "zero_size_ops"]
            if path != "forced":
                zero += ["megatron_temporary_bytes", "megatron_peak_bytes"]
            for key in zero:
                if r[key] != 0:
                    fails.append(f"{where}: {key} {r[key]}, claimed 0")
            if r["ops"] < 1:
                fails.append(f"{where}: no NCCL call")
            layerwise = [b for b in c["buckets"] if b["layerwise"]]
            if path == "optimizer" and r["ops"] != sum(b["params"] for b in layerwise if b.get("ranks", 1) > 1):
                fails.append(f"{where}: {r['ops']} NCCL calls, claimed one per sharded param")
            largest = max(b["param_numel"] for b in layerwise) * c["param_bytes"] // c["param_numel"]
            if path == "forced" and r["megatron_peak_bytes"] > largest:
                fails.append(f"{where}: megatron peak {r['megatron_peak_bytes']} B > the largest bucket's {largest} B")
            u = up.get((c["model"], c["dp"]), {}).get("paths", {}).get(path)
            if u is not None and "error" not in u:
                keys = ("launches",) if path == "optimizer" else ("ops", "launches")
                for key in keys:
                    if r[key] > u[key]:
                        fails.append(f"{where}: {key} {r[key]} > 0.17.1's {u[key]}")
            if path != "forced" and r["wire_bytes"] != c["exact_receive_bytes"]:
                fails.append(f"{where}: received {r['wire_bytes']} B, others own {c['exact_receive_bytes']} B")
    return fails


def test_series_claims_hold_on_every_series_cell(audit):
    """0 bytes (megatron and NCCL), no zero-size call, NCCL calls and launches at most
    0.17.1's, on every cell and path of the quick audit; every cell but 0.17.1's known
    crashes (expert-DP 1, async and forced paths) is compared with 0.17.1."""
    _, _, data = audit
    series, pristine = _cells(data, tree="patched"), _cells(data, tree="upstream")
    assert len(series) == len(real_shapes.QUICK_MODELS) * len(real_shapes.QUICK_DP_SIZES)
    assert series_claim_failures(series, pristine) == []
    compared = {(c["model"], c["dp"], p) for c in pristine for p in PATHS if "error" not in c["paths"][p]}
    crashed = {(c["model"], c["dp"], p) for c in pristine if c["expert_dp"] == 1 for p in ("async", "forced")}
    assert compared == {(c["model"], c["dp"], p) for c in series for p in PATHS} - crashed


def test_019_series_claims_hold_and_equal_the_0171_series(audit):
    """The 0.19 series (patched_0.19) against pristine 0.19.2's legacy path, on every quick
    cell and path: the same claims (0 bytes, no zero-size call, calls and launches at most
    0.19.2's, exact wire bytes); and every count equal to the 0.17.1 series' on the same
    cell. 0.19.2's legacy path is measured too: it equals 0.18.2's on every cell."""
    _, _, data = audit
    series, pristine = _cells(data, tree="patched_0.19"), _cells(data, tree="mcore_0.19_legacy")
    assert len(series) == len(real_shapes.QUICK_MODELS) * len(real_shapes.QUICK_DP_SIZES)
    assert series_claim_failures(series, pristine) == []
    keys = ("calls", "ops", "zero_size_ops", "launches", "wire_bytes", "zeroed_grad_bytes",
            "nccl_temporary_bytes", "megatron_temporary_bytes")
    for tree, other in (("patched_0.19", "patched"), ("mcore_0.19_legacy", "mcore_0.18_legacy")):
        for c in _cells(data, tree=tree):
            (o,) = _cells(data, tree=other, model=c["model"], dp=c["dp"])
            for path in PATHS:
                got, want = ({k: x["paths"][path].get(k) for k in keys} for x in (c, o))
                assert got == want, (tree, other, c["model"], c["dp"], path, got, want)


def test_series_claims_fail_on_a_mutant(audit, tmp_path):
    """Teeth: the same check on a tree whose forward gathers never receive into grad_data
    (``CLAIM_MUTANT``) fails on megatron's temporaries of the async path, and on nothing
    else."""
    _, _, data = audit
    tree = make_mutant_tree(CLAIM_MUTANT, tmp_path / "tree")
    env = env_for_tree(tree)
    env.update(MEGATRON_CPU_RUNTIME="force", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = tmp_path / "mutant.json"
    proc = subprocess.run([sys.executable, str(WORKER), "--tree", "patched", "--cells", CLAIM_MUTANT_CELL, "--out", str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from scripts.audit_param_sync import exact_receive_bytes

    cells = []
    for rec in json.loads(out.read_text()):
        rec["exact_receive_bytes"] = exact_receive_bytes(rec)
        cells.append(rec)
    fails = series_claim_failures(cells, _cells(data, tree="upstream"))
    assert fails and all("/async: megatron_" in f and "claimed 0" in f for f in fails), fails


VPP_MODEL = "llama3_70b_tp4_pp4_vpp5"


def test_series_claims_hold_with_vpp(tmp_path):
    """The interleaved-pipeline cell (VPP_MODEL at DP 64: 5 model chunks, one DDP each,
    one layer-wise optimizer) on 0.17.1 and the series: the series' claims hold there
    too, and the optimizer path gathers every chunk at once (1 launch, as 0.17.1's one
    list all_gather; series v3 launched one NCCL group per chunk)."""
    from scripts.audit_param_sync import exact_receive_bytes, worker_command

    cells = {}
    for tree in ("upstream", "patched"):
        out = tmp_path / f"{tree}.json"
        argv, env = worker_command(tree, f"{VPP_MODEL}:64", out)
        proc = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (cells[tree],) = json.loads(out.read_text())
        cells[tree]["exact_receive_bytes"] = exact_receive_bytes(cells[tree])
    up, series = cells["upstream"], cells["patched"]
    assert up["vpp"] == 5 and up["num_bucket_groups"] == series["num_bucket_groups"] == 5
    assert series_claim_failures([series], [up]) == []
    assert series["paths"]["optimizer"]["launches"] == up["paths"]["optimizer"]["launches"] == 1


# ---------------------------------------------------------------- worker pieces, in process
def test_meta_device_mode_puts_every_new_tensor_on_meta():
    """Whatever device megatron asks for, tensors are storage-free; CUDA type names."""
    import torch

    from harness.bench.real_shapes_worker import MetaDeviceMode

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
    from harness.bench.real_shapes_worker import SyncCounter

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
