"""scripts/gpu_check.sh (harness/gpu_check): what it would launch, how it refuses bad input,
and the summary and report it makes from a results folder. No GPU needed:

- ``--dry-run`` prints the plan; ``--assume-gpus`` plans for a machine with that many GPUs.
  The launched command lines are parsed (shlex) and their megatron flags go through
  megatron's own argument parser, so "the last --distributed-backend wins" is megatron's
  behaviour, not ours.
- Bad arguments and an unusable machine exit with 2 before anything is written.
- ``report`` turns a results folder (``write_results``: a 2-GPU run's four runs, made-up
  numbers) into summary.json and report.txt; damaged copies of it must fail the right run for
  the right reason.
- ``shared_gpu``'s model of what ProcessGroupNCCL allocates per call form, and the memory
  worker end to end on 2 CPU gloo ranks of both trees (slow).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.gpu_check import plan as plan_mod
from harness.gpu_check import report, shared_gpu
from megatron_argcheck import validate_megatron_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_check(*args, timeout=120):
    env = {**os.environ, "PYTHON": sys.executable}  # the Docker build has python3, no .venv
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def dry_plan(tmp_path, *args):
    """(plan dict from --json, text lines of the plain dry run) for the same arguments."""
    out = tmp_path / "out"
    js = gpu_check("--dry-run", "--json", *args, out)
    assert js.returncode == 0, js.stderr
    text = gpu_check("--dry-run", *args, out)
    assert text.returncode == 0, text.stderr
    assert not out.exists(), "a dry run writes nothing"
    return json.loads(js.stdout), text.stdout.splitlines()


def parse_launch(command: str):
    """``env VAR=value ... argv`` -> (env dict, argv list)."""
    words = shlex.split(command)
    assert words[0] == "env"
    env, i = {}, 1
    while "=" in words[i] and not words[i].startswith("-"):
        k, v = words[i].split("=", 1)
        env[k] = v
        i += 1
    return env, words[i:]


def torchrun_parts(argv):
    """(nproc, script, script args) of a torch.distributed.run command line."""
    assert argv[1:3] == ["-m", "torch.distributed.run"], argv[:3]
    nproc = int(argv[argv.index("--nproc-per-node") + 1])
    script_at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    return nproc, Path(argv[script_at]), argv[script_at + 1:]


H200 = ("--assume-gpu-name", "NVIDIA H200")


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    return dry_plan(tmp_path_factory.mktemp("one"), "--assume-gpus", "1", *H200)


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    return dry_plan(tmp_path_factory.mktemp("two"), "--assume-gpus", "2", *H200)


def test_without_a_gpu_the_dry_run_plans_for_one_and_a_real_run_refuses(tmp_path, one_gpu):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    proc = gpu_check("--dry-run", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "no GPU here; planning for 1 (NVIDIA H200)" in proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["gpus"] == 1 and [r["name"] for r in plan["runs"]] == [r["name"] for r in one_gpu[0]["runs"]]
    proc = gpu_check(out)
    assert proc.returncode == 2 and "no CUDA GPU found" in proc.stderr
    assert not out.exists()


ONE_GPU_NCCL = {"functional_nccl", "functional_nccl_te", "functional_nccl_sync", "functional_nccl_eval",
                "memory_nccl", "memory_nccl_equal_shares", "memory_nccl_llama3_8b_layers",
                "functional_nccl_019_legacy", "functional_nccl_019_sync", "functional_nccl_019_moe",
                "functional_nccl_019_vpp", "functional_nccl_019_layout", "timing_nccl_optimizer_gather"}


def test_one_gpu_runs_every_rank_on_cuda0_on_both_bases_within_8_minutes(one_gpu):
    """On one GPU: the gloo runs and the NCCL plan, every rank on cuda:0, on both bases; the
    schedule (exclusive runs, then the longest lane) fits 8 minutes, while the timeouts added
    up would not (runs share the GPU at once)."""
    plan, _ = one_gpu
    assert plan["gpus"] == 1 and plan["schedule_s"] <= plan["budget_s"] == 480 < plan["total_timeout_s"]
    runs = {r["name"]: r for r in plan["runs"]}
    assert set(runs) == {"functional_gloo_shared_gpu", "memory_gloo_shared_gpu"} | ONE_GPU_NCCL
    cases_019 = {"functional_nccl_019_" + k: v for k, v in plan_mod.CASES_019.items()}
    for run in runs.values():
        assert run["devices"] == ["cuda:0"] * run["nproc"] and run["shared_gpu"]
        base = "0.19" if run["name"] in cases_019 else "0.17.1"
        assert run["base"] == base
        assert run["nproc"] == (4 if run["name"].endswith(("_moe", "_vpp")) else 2)
        if run["name"] in cases_019:
            assert run["case"] == cases_019[run["name"]]
        assert run["timeout_s"] >= run["time_s"] * plan_mod.HEADROOM and run["time_kind"] in ("measured", "estimate")
        trees = [f"pristine-{base}", f"series-{base}"]
        if run["kind"] == "timing":
            trees = ["series-0.17.1"]  # one process times its own gather and the pristine one
        assert [x["tree"] for x in run["launches"]] == trees
        for x in run["launches"]:
            env, argv = parse_launch(x["command"])
            nproc, script, args = torchrun_parts(argv)
            assert nproc == run["nproc"]
            assert env["MEGATRON_SHARED_GPU"] == "1", "ranks share cuda:0"
            assert env.get("NCCL_SOCKET_IFNAME") == ("lo" if run["backend"] == "nccl" else None)
            assert "MEGATRON_CPU_RUNTIME" not in env, "CUDA runs, not the CPU runtime layer"
            from harness.trees import tree_parent

            assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tree_parent(x["tree"]))
            assert Path(env["MEGATRON_EXPECT_TREE"]) == tree_parent(x["tree"]) / "megatron"
            if run["kind"] == "memory":
                assert script.name == "memory_worker.py"
                assert args[args.index("--backend") + 1] == run["backend"]
                side = next(s for s, t in plan_mod.TREES.items() if t == x["tree"])
                assert Path(args[args.index("--out") + 1]).name == f"{side}.json"
            elif run["kind"] == "timing":
                assert script.name == "gather_timing_worker.py" and args[:2] == ["--config", "llama_tiny"]
                assert args[args.index("--backend") + 1] == "nccl"
            else:
                assert script.name == "upstream_pretrain_gpt.py"
                assert args[-2:] == ["--distributed-backend", run["backend"]]
                assert ("--use-cpu-initialization" in args) == (base == "0.17.1" and run["runtime_flags"])
    assert sum(r["exclusive"] for r in runs.values()) == 1 and runs["memory_nccl_llama3_8b_layers"]["exclusive"]
    assert runs["functional_nccl"]["golden_file"] == "golden_values_h200_nccl_1gpu.json"
    assert (runs["functional_nccl_te"]["skip_reason"] is None) == plan_mod.te_available(), "TE as this machine has it"


@pytest.mark.extended
def test_one_gpu_nccl_launches_pass_megatrons_parser_on_their_base(one_gpu):
    """The flags of the 1-GPU NCCL launches of both bases, through each base's own parser."""
    from harness.trees import tree_parent

    plan, _ = one_gpu
    for name, tree in (("functional_nccl", "series-0.17.1"), ("functional_nccl_019_legacy", "series-0.19"),
                       ("functional_nccl_019_moe", "series-0.19")):
        run = next(r for r in plan["runs"] if r["name"] == name)
        _, argv = parse_launch(run["launches"][1]["command"])
        nproc, _, args = torchrun_parts(argv)
        got = validate_megatron_args([{"argv": args, "world_size": nproc, "attrs": ["distributed_backend"]}],
                                     tree_parent(tree))[0]
        assert got["ok"] and got["attrs"]["distributed_backend"] == "nccl", (name, got)


@pytest.mark.parametrize("with_te", [True, False])
def test_the_te_run_is_planned_and_skipped_where_te_is_missing(tmp_path, with_te):
    plan = plan_mod.make_plan(1, "NVIDIA H200", tmp_path, with_te=with_te)
    te = next(r for r in plan.runs if r.name == "functional_nccl_te")
    assert not te.runtime_flags and te.golden_file == "golden_values_h200_nccl_1gpu_te.json"
    assert te.skip_reason == (None if with_te else "skipped: Transformer Engine not installed")
    assert plan.schedule_s <= 480, "with TE the plan still fits"
    text = plan_mod.format_plan(plan)
    assert ("  skipped: Transformer Engine not installed" in text.splitlines()) is not with_te


def test_functional_launch_is_the_default_case_on_gloo_for_megatron(one_gpu, two_gpus):
    cases = []
    for plan, backend in ((one_gpu[0], "gloo"), (two_gpus[0], "nccl")):
        run = next(r for r in plan["runs"] if r["kind"] == "functional" and r["backend"] == backend)
        assert run["golden_file"] == f"golden_values_h200_{backend}.json"
        for x in run["launches"]:
            _, argv = parse_launch(x["command"])
            _, _, args = torchrun_parts(argv)
            cases.append({"argv": args, "world_size": 2,
                          "attrs": ["distributed_backend", "optimizer", "overlap_param_gather", "data_parallel_size"]})
    results = validate_megatron_args(cases)
    assert all(r["ok"] for r in results), results
    assert [r["attrs"]["distributed_backend"] for r in results] == ["gloo", "gloo", "nccl", "nccl"]
    assert all(r["attrs"]["optimizer"] == "dist_muon" and r["attrs"]["overlap_param_gather"]
               and r["attrs"]["data_parallel_size"] == 2 for r in results)


def test_with_two_or_more_gpus_nccl_ranks_get_a_gpu_each(two_gpus, tmp_path):
    plan, _ = two_gpus
    nccl = {r["name"]: r for r in plan["runs"] if r["backend"] == "nccl"}
    assert set(nccl) == ONE_GPU_NCCL
    for run in nccl.values():
        shared = run["nproc"] > 2
        assert run["devices"] == [f"cuda:{i % 2}" for i in range(run["nproc"])] and run["shared_gpu"] is shared
        for x in run["launches"]:
            env, argv = parse_launch(x["command"])
            assert ("MEGATRON_SHARED_GPU" in env) is shared and "MEGATRON_CPU_RUNTIME" not in env
            assert torchrun_parts(argv)[0] == run["nproc"]
    assert nccl["memory_nccl_equal_shares"]["config"] == "equal_shares"
    assert plan["schedule_s"] <= plan["budget_s"]
    big, _ = dry_plan(tmp_path, "--assume-gpus", "16", "--assume-gpu-name", "NVIDIA A100-SXM4-80GB")
    mem = next(r for r in big["runs"] if r["name"] == "memory_nccl")
    assert mem["nproc"] == 8 and big["gpu_slug"] == "a100"
    assert all(not r["shared_gpu"] for r in big["runs"] if r["backend"] == "nccl")


def test_text_dry_run_lists_the_same_runs_and_commands(two_gpus):
    plan, lines = two_gpus
    run_lines = [l.split() for l in lines if l.startswith("run ")]
    assert [w[1] for w in run_lines] == [r["name"] for r in plan["runs"]]
    for words, run in zip(run_lines, plan["runs"]):
        fields = dict(w.split("=", 1) for w in words[2:])
        assert fields["backend"] == run["backend"] and int(fields["ranks"]) == run["nproc"]
        assert fields["devices"].split(",") == run["devices"] and int(fields["timeout_s"]) == run["timeout_s"]
    launches = [l.split(": ", 1)[1] for l in lines if l.startswith("  launch ")]
    assert launches == [x["command"] for r in plan["runs"] for x in r["launches"]]


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: out"),
    (["--assume-gpus", "2", "OUT"], "--assume-gpus is only for --dry-run"),
    (["--json", "OUT"], "--json is only for --dry-run"),
    (["--dry-run", "--assume-gpus", "0", "OUT"], "--assume-gpus must be >= 1"),
    (["--dry-run", "--assume-gpus", "two", "OUT"], "invalid int value"),
    (["--dry-run", "--assume-gpus", "1", "--assume-gpu-name", "NVIDIA", "OUT"], "cannot make a GPU type"),
    (["--bogus", "OUT"], "unrecognized arguments: --bogus"),
    (["FILE"], "exists and is not a folder"),
    (["FULL"], "is not empty"),
])
def test_bad_input_exits_2_with_a_message_and_writes_nothing(tmp_path, args, message):
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "old.json").write_text("{}")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = gpu_check(*[str(tmp_path / a) if a in ("OUT", "FILE", "FULL") else a for a in args])
    assert proc.returncode == 2, proc
    assert message in proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_runner_records_ok_failed_and_timed_out_runs(tmp_path):
    """execute() on a plan whose launches are small stand-in commands: each run's status,
    exit code and time land in runs.json, a run past its timeout is killed (with its child
    processes), and the report then names what failed."""
    import sys
    import time

    from harness.gpu_check.__main__ import execute

    def stand_in(code):
        return plan_mod.Launch("pristine-0.17.1", [sys.executable, "-c", code], dict(os.environ))

    runs = [plan_mod.Run("memory_ok", "memory", "gloo", 2, ["cuda:0", "cuda:0"], 30, [stand_in("pass")], config="tiny"),
            plan_mod.Run("memory_fails", "memory", "gloo", 2, ["cuda:0", "cuda:0"], 30,
                         [stand_in("import sys; sys.exit(3)"), stand_in("open('second_ran', 'w')")], config="tiny"),
            plan_mod.Run("memory_hangs", "memory", "gloo", 2, ["cuda:0", "cuda:0"], 2,
                         [stand_in("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
                                   "'import time; time.sleep(60)']); "
                                   f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(c.pid)); time.sleep(60)")],
                         config="tiny")]
    plan = plan_mod.Plan(1, "NVIDIA H200", tmp_path, runs)
    (tmp_path / "plan.json").write_text(json.dumps(plan.as_dict()))
    t0 = time.monotonic()
    execute(plan)
    assert time.monotonic() - t0 < 25, "the hanging run is killed at its timeout"
    status = {s["name"]: (s["status"], s["returncode"]) for s in json.loads((tmp_path / "runs.json").read_text())}
    assert status == {"memory_ok": ("ok", 0), "memory_fails": ("failed", 3), "memory_hangs": ("timeout", None)}
    assert not (ROOT / "second_ran").exists(), "a failed launch stops its run"
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):  # killed with the run's process group; reaped by init shortly after
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the timed-out run's child process survived")
    summary = report.summarize(tmp_path)
    problems = {r["name"]: r["problems"][0] for r in summary["runs"]}
    assert problems == {"memory_ok": "pristine: no result ({}/memory_ok/pristine.json missing or holds an error)"
                        .format(tmp_path), "memory_fails": "run failed (exit 3)", "memory_hangs": "run timeout"}
    assert not summary["ok"]


@pytest.mark.parametrize("name, slug", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla V100-SXM2-32GB", "v100"),
                                        ("NVIDIA GeForce RTX 4090", "rtx")])
def test_golden_file_is_per_gpu_type_and_backend(name, slug):
    assert plan_mod.gpu_slug(name) == slug
    assert plan_mod.golden_file(name, "gloo") == f"golden_values_{slug}_gloo.json"


# ----------------------------------------------------------------------------- report
MiB = 2**20
Mi = 2**20  # elements: the buckets' sizes and shares below count binary millions of elements

#: The report tests' results folder (``write_results``): a made-up run on 2 GPUs of these
#: runs, (name, kind, backend, devices of its 2 ranks, seconds it took), in a schedule budget.
RUNS = [("functional_gloo_shared_gpu", "functional", "gloo", ["cuda:0", "cuda:0"], 95.5),
        ("memory_gloo_shared_gpu", "memory", "gloo", ["cuda:0", "cuda:0"], 120.0),
        ("functional_nccl", "functional", "nccl", ["cuda:0", "cuda:1"], 80.25),
        ("memory_nccl", "memory", "nccl", ["cuda:0", "cuda:1"], 100.0)]
BUDGET_S = 900
#: Both trees' model in a memory run: its buckets as (numel, share of each DP rank), elements
#: of bf16 (2 B); bucket 0's shares are equal, bucket 1's are not.
BUCKETS = [(40 * Mi, [20 * Mi, 20 * Mi]), (41 * Mi, [30 * Mi, 11 * Mi])]
#: The lm loss at steps 1 and 2 (10.0, 9.75), the same in both trees.
LOSSES_HEX = ["0x1.4000000000000p+3", "0x1.3800000000000p+3"]


def gather_calls(ops, launches, nccl_temporary_bytes=0, **forms):
    """DP rank 0's calls in one gather of both buckets (``memory_worker.summarize_records``):
    ``forms`` counts calls per form; rank 0 receives rank 1's shares, (20 + 11) Mi x 2 B."""
    counts = {**dict.fromkeys(("list_equal", "list_unequal", "into_tensor", "broadcast"), 0), **forms}
    return {"calls": sum(counts.values()), **counts, "ops": ops, "zero_size_ops": 0, "launches": launches,
            "wire_bytes": (20 + 11) * Mi * 2, "nccl_temporary_bytes": nccl_temporary_bytes}


#: Per tree, bytes over allocated: the forward's peak on DP rank 0's first step (each later step
#: adds 1 MiB, DP rank 1 adds 10 MiB), the optimizer step's peak, and, alike on both DP ranks,
#: the param sync's (``sync``) and the optimizer gather's (``sync_optimizer``); with their calls.
FIGURES = {
    "pristine": {"forward": 800 * MiB, "step": 3800 * MiB, "sync": 700 * MiB, "sync_optimizer": 1070 * MiB,
                 # bucket 0: a list all_gather of equal shares, whose flat output NCCL allocates
                 # (2 ranks x 20 Mi x 2 B); bucket 1: a list all_gather of unequal shares, one
                 # broadcast per rank. The optimizer: one list all_gather of unequal shares.
                 "sync_calls": gather_calls(ops=1 + 2, launches=2, nccl_temporary_bytes=2 * 20 * Mi * 2,
                                            list_equal=1, list_unequal=1),
                 "sync_optimizer_calls": gather_calls(ops=2, launches=1, list_unequal=1)},
    "series": {"forward": 100 * MiB, "step": 3100 * MiB, "sync": 0, "sync_optimizer": 0,
               # bucket 0: all_gather_into_tensor; bucket 1: a broadcast per rank, in one launch.
               # The optimizer: a broadcast per param (2 here) in one group.
               "sync_calls": gather_calls(ops=1 + 2, launches=2, into_tensor=1, broadcast=2),
               "sync_optimizer_calls": gather_calls(ops=2, launches=1, broadcast=2)},
}


def memory_result(tree: str, devices: list) -> dict:
    """A memory_worker result of ``tree`` (``FIGURES``) on DP ranks on ``devices``: the fields
    the report reads."""
    fig, numel = FIGURES[tree], sum(n for n, _ in BUCKETS)
    ranks = []
    for rank, device in enumerate(devices):
        steps = []
        for i, loss_hex in enumerate(LOSSES_HEX):
            peak = fig["forward"] + rank * 10 * MiB + i * MiB
            steps.append({"loss_hex": loss_hex, "step_peak_extra_bytes": fig["step"],
                          "forward": {"peak_extra_bytes": peak, "reserved_bytes": peak + 2 * MiB}})
        ranks.append({"rank": rank, "device": device, "param_count": numel, "param_bytes": 2 * numel,
                      "buckets": [{"numel": n, "shares": s, "shares_equal": s[0] == s[1]} for n, s in BUCKETS],
                      "sync": {"peak_extra_bytes": fig["sync"], "gather_calls": fig["sync_calls"]},
                      "sync_optimizer": {"peak_extra_bytes": fig["sync_optimizer"],
                                         "gather_calls": fig["sync_optimizer_calls"]},
                      "init_params_checksum": "0x1.0p+9", "params_checksum": "0x1.0p+10", "steps": steps})
    return {"ranks": ranks}


def write_json(path: Path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def write_results(out: Path, older: bool = False) -> Path:
    """Write into ``out`` a results folder of ``RUNS``, all "ok": every functional run
    "identical", every memory run ``memory_result`` of both trees. ``older``: as written before
    the memory runs' sides were named pristine and series (``report.OLD_FILES``: upstream.json,
    patched.json) and before the plan named each run's base and case."""
    runs = []
    for name, kind, backend, devices, _ in RUNS:
        run = {"name": name, "kind": kind, "backend": backend, "nproc": len(devices), "devices": devices,
               "timeout_s": 300, "shared_gpu": len(set(devices)) < len(devices)}
        if kind == "memory":
            run["config"] = "param_dominated"
            for tree in report.TREES:
                write_json(out / name / (report.OLD_FILES[tree] if older else f"{tree}.json"),
                           memory_result(tree, devices))
        else:
            golden = f"tests/functional_tests/test_cases/gpt/{plan_mod.CASE}/golden_values_h200_{backend}.json"
            write_json(out / name / plan_mod.CASE / "comparison.json",
                       {"verdict": "identical", "verdict_line": "identical", "golden_file": golden, "failures": []})
            if not older:
                run["case"] = plan_mod.CASE
        if not older:
            run["base"] = "0.17.1"
        runs.append(run)
    write_json(out / "plan.json", {"gpus": 2, "gpu_name": "NVIDIA H200", "budget_s": BUDGET_S, "runs": runs})
    write_json(out / "runs.json", [{"name": name, "status": "ok", "returncode": 0, "seconds": seconds}
                                   for name, *_, seconds in RUNS])
    write_json(out / "environment.json", {"date_utc": "2026-12-01T00:00:00Z", "driver": "580.95.05",
                                          "torch": "2.10.0a0", "megatron_core": "0.17.1"})
    return out


@pytest.fixture
def results(tmp_path):
    """``write_results`` of today, in tmp_path/results."""
    return write_results(tmp_path / "results")


def edit_json(path: Path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def edit_run(results: Path, name: str, **fields):
    """Set ``fields`` of run ``name`` in ``results/plan.json``."""
    edit_json(results / "plan.json", lambda d: next(r for r in d["runs"] if r["name"] == name).update(fields))


def summary_run(results: Path, name: str) -> dict:
    return next(r for r in report.summarize(results)["runs"] if r["name"] == name)


def test_report_of_a_recorded_run(results):
    summary = report.write(results)
    # RUNS' seconds: 95.5 + 120 + 80.25 + 100.
    assert summary["ok"] and summary["gpus"] == 2 and summary["total_seconds"] == pytest.approx(395.75)
    runs = {r["name"]: r for r in summary["runs"]}
    mem = runs["memory_gloo_shared_gpu"]
    # Last step, maximum over ranks (FIGURES): pristine 800 + 10 (rank 1) + 1 (step 2) MiB, series 111 MiB.
    assert mem["trees"]["pristine"]["forward_peak_extra_bytes"] == 811 * MiB
    assert mem["trees"]["series"]["forward_peak_extra_bytes"] == 111 * MiB
    assert mem["forward_peak_extra_saved_bytes"] == 700 * MiB
    assert mem["sync_peak_extra_saved_bytes"] == 700 * MiB and mem["losses_bitwise_equal"]
    assert mem["trees"]["pristine"]["sync_gather_calls"]["nccl_temporary_bytes"] == 80 * MiB  # 2 x 20 Mi x 2 B
    assert mem["trees"]["pristine"]["buckets_with_equal_shares"] == 1  # BUCKETS[0]
    assert runs["functional_nccl"]["verdict"] == "identical"
    assert json.loads((results / "summary.json").read_text()) == summary
    text = (results / "report.txt").read_text()
    lines = text.splitlines()
    assert lines[1] == "PASS: 4/4 runs ok in 396 s of run time (budget 900 s for the schedule)"
    assert "memory_gloo_shared_gpu: ok (megatron-core 0.17.1, gloo, 2 ranks on cuda:0,cuda:0; ok, 120 s)" in lines
    row = next(l for l in lines if l.strip().startswith("forward peak over allocated")).split()
    assert row[-6:] == ["811.00", "MiB", "111.00", "MiB", "700.00", "MiB"]
    # FIGURES' sync_calls: rank 0 receives (20 + 11) Mi x 2 B = 62 MiB.
    pristine_calls = next(l for l in lines if l.strip().startswith("pristine param all-gather"))
    assert "1 list (equal shares), 1 list (unequal), 0 into_tensor, 0 broadcast; 3 NCCL calls (0 zero-size) " \
        "in 2 launches, 62.00 MiB received; NCCL would allocate 80.00 MiB" in pristine_calls
    series_calls = next(l for l in lines if l.strip().startswith("series param all-gather"))
    assert "1 into_tensor, 2 broadcast; 3 NCCL calls (0 zero-size) in 2 launches" in series_calls
    assert "  lm loss over 2 steps: bitwise equal" in lines


def test_report_reads_a_results_folder_written_before_the_sides_were_renamed(tmp_path):
    """A results folder of today (pristine.json, series.json; runs with their base and case)
    gives the same summary as the same results written by an older check (upstream.json:
    pristine, patched.json: series; no base or case: 0.17.1 and the default case)."""
    today = report.summarize(write_results(tmp_path / "today"))
    assert today["ok"] and today["runs"][1]["trees"]["pristine"]["forward_peak_extra_bytes"] == 811 * MiB
    older = write_results(tmp_path / "older", older=True)
    assert sorted(p.name for p in (older / "memory_nccl").iterdir()) == ["patched.json", "upstream.json"]
    assert report.summarize(older) == today


#: Damage to a memory run's series result (series.json), by name.
DAMAGE = {
    "loss": lambda doc: doc["ranks"][0]["steps"][1].update(loss_hex="0x1.3800000000001p+3"),
    "sync_allocates": lambda doc: doc["ranks"][1]["sync"].update(peak_extra_bytes=4096),
    "no_equal_bucket": lambda doc: [b.update(shares_equal=False) for r in doc["ranks"] for b in r["buckets"]],
    "no_into_tensor": lambda doc: [r["sync"]["gather_calls"].update(into_tensor=0) for r in doc["ranks"]],
}


@pytest.mark.parametrize("run, config, damage, problem", [
    ("memory_gloo_shared_gpu", None, "loss",
     "lm loss differs at step 2: pristine 0x1.3800000000000p+3, series 0x1.3800000000001p+3"),
    ("memory_nccl", None, "sync_allocates", "series param sync allocated on NCCL: ['0 B', '4.00 KiB'] per rank"),
    ("memory_gloo_shared_gpu", None, "sync_allocates", None),  # on gloo the CUDA bytes are reported, not required
    # The equal_shares run requires a bucket with equal shares and an all_gather_into_tensor.
    ("memory_nccl", "equal_shares", None, None),
    ("memory_nccl", "equal_shares", "no_equal_bucket",
     "equal_shares: no bucket with equal shares (the model config does not make them at this DP size)"),
    ("memory_nccl", "equal_shares", "no_into_tensor", "equal_shares: the series param sync made no all_gather_into_tensor"),
])
def test_a_damaged_memory_result_fails_its_run_for_its_reason(results, run, config, damage, problem):
    if config:
        edit_run(results, run, config=config)
    if damage:
        edit_json(results / run / "series.json", DAMAGE[damage])
    summary = report.summarize(results)
    entry = next(r for r in summary["runs"] if r["name"] == run)
    assert entry["problems"] == ([problem] if problem else [])
    assert entry["ok"] is summary["ok"] is (problem is None)
    assert entry["losses_bitwise_equal"] is (damage != "loss")
    assert report.render(summary).splitlines()[1].startswith("PASS: 4/4 runs ok" if problem is None else "FAIL: 3/4 runs ok")


def test_report_of_runs_that_timed_out_or_left_nothing(results):
    def timeout(doc):
        doc[3].update(status="timeout", returncode=None)
    edit_json(results / "runs.json", timeout)
    (results / "memory_gloo_shared_gpu" / "series.json").unlink()
    shutil.rmtree(results / "functional_nccl")
    runs = {r["name"]: r for r in report.summarize(results)["runs"]}
    assert runs["memory_nccl"]["problems"][0] == "run timeout" and not runs["memory_nccl"]["ok"]
    assert runs["memory_gloo_shared_gpu"]["problems"][0].startswith("series: no result")
    assert runs["functional_nccl"]["verdict"] == "no result" and not runs["functional_nccl"]["ok"]
    assert runs["functional_gloo_shared_gpu"]["ok"]


def test_summarize_refuses_a_folder_that_is_not_results(tmp_path):
    with pytest.raises(report.ResultsError, match="plan.json"):
        report.summarize(tmp_path)


@pytest.mark.parametrize("n, text", [(None, "n/a"), (0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"),
                                     (3 * 2**30, "3.00 GiB"), (-2**20, "-1.00 MiB")])
def test_fmt_bytes(n, text):
    assert report.fmt_bytes(n) == text


# ----------------------------------------------------------------------------- rank side
def test_window_summary_of_collective_records():
    import torch

    from harness.cpu_runtime import collectives as col
    from harness.gpu_check.memory_worker import summarize_records

    records = [col.model_call(col.FORM_LIST_EQUAL, [10] * 4, 0, torch.bfloat16),
               col.model_call(col.FORM_LIST_UNEQUAL, [10, 12, 10, 0], 0, torch.bfloat16),
               col.model_call(col.FORM_INTO_TENSOR, [10] * 4, 0, torch.bfloat16),
               col.model_call(col.FORM_BROADCAST, [12], 0, torch.bfloat16, world=4, src=1, launch_id=-7),
               col.model_call(col.FORM_BROADCAST, [10], 0, torch.bfloat16, world=4, src=2, launch_id=-7)]
    assert summarize_records(records) == {
        "calls": 5, "list_equal": 1, "list_unequal": 1, "into_tensor": 1, "broadcast": 2,
        "ops": 1 + 4 + 1 + 2, "zero_size_ops": 1, "launches": 4,
        "wire_bytes": (30 + 22 + 30 + 22) * 2,
        "nccl_temporary_bytes": 4 * 10 * 2}  # only the equal-size list form: one flat output


class FakeCuda:
    """The five ``torch.cuda`` memory functions ``memory_probe.CudaProbe`` reads, over a
    caching allocator reduced to its counters (bytes)."""

    def __init__(self, allocated=4096):
        self.allocated = self.top = allocated

    def synchronize(self):
        pass

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.top

    def reset_peak_memory_stats(self):
        self.top = self.allocated

    def memory_reserved(self):
        return 2**21 + self.allocated  # one 2 MiB segment more than allocated

    def alloc(self, n):
        self.allocated += n
        self.top = max(self.top, self.allocated)
        return n

    def free(self, n):
        self.allocated -= n


def probed_step(probe, alloc, free):
    """A step's allocations (KiB) in the memory worker's phases, the gather nested in the
    optimizer step, measured by ``probe``."""
    k = 1024
    with probe.region():
        with probe.phase("forward"):
            a = alloc(300 * k)
            free(alloc(200 * k))  # forward: 500 KiB above the start
        with probe.phase("optimizer step"):
            c = alloc(100 * k)  # 400 alive when the gather starts: its floor
            with probe.phase("optimizer gather"):
                free(alloc(250 * k))  # 650: the gather's peak, and the step's
            free(c)
            e = alloc(50 * k)
        free(a)
        free(e)
    return probe


def test_both_memory_probes_give_each_phase_its_peak_above_the_steps_start():
    """The memory worker's one device-specific part: the CUDA probe (allocator statistics,
    here a stand-in allocator) and the CPU probe (torch.profiler's events of real CPU
    tensors) give the same peaks for the same allocations, nested phases included."""
    import torch

    from harness import memory_probe

    want = {"forward": 500 * 1024, "optimizer step": 650 * 1024, "optimizer gather": 650 * 1024}
    cuda = FakeCuda()
    gpu = probed_step(memory_probe.CudaProbe(cuda), cuda.alloc, cuda.free)
    assert (gpu.phase_peaks, gpu.peak, gpu.base) == (want, 650 * 1024, 4096)
    assert gpu.reserved["forward"] == 2**21 + 4096 + 300 * 1024 and gpu.reserved_end == 2**21 + 4096
    assert cuda.allocated == 4096

    live, ids = {}, iter(range(10))

    def alloc(n):
        i = next(ids)
        live[i] = torch.empty(n, dtype=torch.uint8)
        return i

    cpu = probed_step(memory_probe.CpuProbe(), alloc, lambda i: live.pop(i))
    assert (cpu.phase_peaks, cpu.peak, cpu.base, cpu.reserved_end) == (want, 650 * 1024, None, None)
    assert cpu.reserved == dict.fromkeys(want)


@pytest.mark.parametrize("local, count, want", [(0, 1, 0), (1, 1, 0), (3, 2, 1), (5, 8, 5), (1, 0, None)])
def test_ranks_sharing_gpus_get_a_device_and_a_nccl_host_id_each(monkeypatch, local, count, want):
    """``LOCAL_RANK`` modulo the GPUs (megatron calls ``set_device(local_rank)``) and, since NCCL
    refuses two ranks of one host on one GPU, an ``NCCL_HOSTID`` per rank, so that it connects
    them through sockets. Without a GPU: an error."""
    import torch

    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("NCCL_HOSTID", "box")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if want is None:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            shared_gpu.share_device()
        return
    shared_gpu.share_device()
    assert (os.environ["LOCAL_RANK"], os.environ["NCCL_HOSTID"]) == (str(want), f"box-rank{local}")


def test_recorded_gathers_on_a_one_rank_gloo_group(tmp_path):
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    # A FileStore: no TCP port to collide with other runs on the machine.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        from harness.cpu_runtime import collectives as col

        shared_gpu.install_collectives()
        out = [torch.zeros(3)]
        flat = torch.zeros(3)
        with col.record_collectives() as records:
            dist.all_gather(out, torch.arange(3.0))
            dist.all_gather_into_tensor(flat, torch.arange(3.0))
        assert out[0].tolist() == flat.tolist() == [0.0, 1.0, 2.0]
        assert [r.form for r in records] == [col.FORM_LIST_EQUAL, col.FORM_INTO_TENSOR]
        # A gloo coalescing block captures its all-reduces and runs each on its own at the end.
        a, b = torch.ones(4), torch.full((2,), 3.0)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a, async_op=True)
            dist.all_reduce(b, async_op=True)
            assert cm.works == [], "captured, not yet run"
        assert isinstance(cm, shared_gpu.CollectedWork) and len(cm.works) == 2
        assert cm.wait() and a.tolist() == [1.0] * 4 and b.tolist() == [3.0, 3.0]
        assert not dist.distributed_c10d._world.pg_coalesce_state, "no capture left open"
        with pytest.raises(RuntimeError, match="boom"):
            with dist._coalescing_manager(async_ops=True):
                dist.all_reduce(a, async_op=True)
                raise RuntimeError("boom")
        assert not dist.distributed_c10d._world.pg_coalesce_state, "an exception closes the capture too"
    finally:
        shared_gpu.uninstall()
        dist.destroy_process_group()
    assert dist._coalescing_manager is dist.distributed_c10d._coalescing_manager


@pytest.mark.gloo
def test_shared_gpu_collectives_on_two_gloo_ranks(tmp_path):
    """The coalescing replacement and the uneven gather with 2 real ranks (gloo on CPU: the
    same code paths the CUDA run takes, minus gloo's host staging)."""
    from harness import launch

    argv, env = launch.torchrun_command(Path(__file__).with_name("shared_gpu_worker.py"),
                                        ["--out", str(tmp_path / "r.json")], 2, tree=None, cpu=False)
    launch.run_command(argv, env, run_dir=tmp_path / "log", timeout_s=300, what="shared_gpu worker")
    assert json.loads((tmp_path / "r.json").read_text()) == {
        "coalesced_sum": True, "sync_block": True, "uneven_gather": True, "gather_in_block": True}


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.gloo
def test_memory_worker_on_cpu_ranks_gives_equal_losses_on_both_trees(tmp_path):
    """The memory worker end to end on 2 CPU gloo ranks (CPU runtime layer; no CUDA figures),
    pristine and series: the report finds the same lm loss bit for bit and the same params."""
    from harness import launch

    run_dir = tmp_path / "memory"
    for side, tree in plan_mod.TREES.items():
        argv, env = launch.torchrun_command(
            plan_mod.MEMORY_WORKER, ["--backend", "gloo", "--config", "tiny", "--steps", "2",
                                     "--out", str(run_dir / f"{side}.json")], 2, tree=tree, cpu=True)
        launch.run_command(argv, env, run_dir=tmp_path / f"log_{side}", timeout_s=400, what=f"memory worker {tree}")
    doc = json.loads((run_dir / "series.json").read_text())
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["gpu"] is None
    sync = doc["ranks"][0]["sync"]
    assert sync["reserved_bytes"] is None and sync["peak_extra_bytes"] >= 0, "CPU probe: no allocator to ask"
    assert all(r["grad_sync_coalescing_replaced"] for r in doc["ranks"]), \
        "DDP's grad sync goes through shared_gpu's coalescing manager"
    summary = report.summarize_memory({"backend": "gloo"}, run_dir)
    assert summary["ok"], summary["problems"]
    assert summary["losses_bitwise_equal"] and len(summary["trees"]["pristine"]["losses_hex"]) == 2
    calls = summary["trees"]["series"]["sync_gather_calls"]
    buckets = doc["ranks"][0]["buckets"]
    own = sum(b["shares"][0] for b in buckets) * 2  # rank 0's bf16 share
    # The series never pads: rank 0 receives every other rank's share, exactly.
    exact = summary["trees"]["series"]["param_bytes"] - own
    assert calls["calls"] >= 1 and calls["wire_bytes"] == exact, (calls, exact)


# ------------------------------------------------------- first run on a GPU type: no golden values
def write_variant_metrics(case_out: Path, variant: str, lm_loss: dict):
    from tests.functional_tests.python_test_utils import golden_schema
    from tests.functional_tests.python_test_utils import tensorboard_reader as tbr

    steps = sorted(lm_loss)
    base = {"lm loss": lm_loss, "grad-norm": {s: 1.0 + s for s in steps}, "num-zeros": {s: 0.0 for s in steps},
            "params-norm": {s: 10.0 for s in steps}, "learning-rate": {s: 3e-3 for s in steps},
            "iteration-time": {s: 0.1 for s in steps}}
    metrics = {m: golden_schema.MetricSeries(steps[0], steps[-1], 1, v) for m, v in base.items()}
    (case_out / variant).mkdir(parents=True)
    golden_schema.save(case_out / variant / tbr.EXACT_FILE, metrics)
    golden_schema.save(case_out / variant / tbr.ROUNDED_FILE, golden_schema.round_all(metrics))


def no_golden_comparison(results: Path, run: str) -> dict:
    path = results / run / plan_mod.CASE / "comparison.json"
    doc = json.loads(path.read_text())
    doc.update(verdict="no_golden", verdict_line="no golden values: ... does not exist (series == pristine exactly)",
               failures=["no golden values: ... does not exist"])
    return doc


@pytest.mark.parametrize("equal", [True, False], ids=["bit_identical", "divergent"])
def test_a_run_without_golden_values_records_them_in_out_only_when_bit_identical(results, equal):
    from harness.gpu_check import functional
    from tests.functional_tests.python_test_utils import golden_schema, run_case, tolerances

    run = "functional_gloo_shared_gpu"
    case_out = results / run / plan_mod.CASE
    loss = {1: 8.328125, 2: 7.5, 3: 7.0}
    write_variant_metrics(case_out, "pristine", loss)
    write_variant_metrics(case_out, "series", loss if equal else {**loss, 2: 7.500001})
    golden_out = results / run / "golden" / "golden_values_h200_gloo.json"
    case = run_case.load_case(run_case.find_case(plan_mod.CASE))
    comparison = functional.record_golden(no_golden_comparison(results, run), case_out, golden_out,
                                          tolerances.rules_for(case.metrics))
    if equal:
        assert functional.passed(comparison) and comparison["golden_recorded"] == str(golden_out)
        assert golden_schema.load(golden_out)["lm loss"].values == {s: round(v, 5) for s, v in loss.items()}
        comparison["golden_commit_command"] = functional.commit_command(
            golden_out, results, run_case.find_case(plan_mod.CASE))
        # The command, run from a checkout next to OUT, copies the file into the case folder.
        assert shlex.split(comparison["golden_commit_command"])[:3] == [
            "cp", f"OUT/{run}/golden/golden_values_h200_gloo.json",
            f"tests/functional_tests/test_cases/gpt/{plan_mod.CASE}/"]
    else:
        assert not functional.passed(comparison) and comparison["verdict"] == "failed"
        assert not golden_out.exists(), "values of runs that differ are never recorded"
    (case_out / "comparison.json").write_text(json.dumps(comparison))
    summary = report.write(results)
    text = (results / "report.txt").read_text()
    entry = next(r for r in summary["runs"] if r["name"] == run)
    if equal:
        assert summary["ok"] and entry["ok"] and text.splitlines()[1].startswith("PASS: 4/4 runs ok")
        assert f"  golden values recorded in OUT: {golden_out}" in text.splitlines()
        assert "golden values recorded in OUT" in text.splitlines()[1]
    else:
        assert not summary["ok"] and not entry["ok"] and text.splitlines()[1].startswith("FAIL: 3/4 runs ok")
        assert any("golden values not recorded" in p for p in entry["problems"])


def test_a_no_golden_verdict_without_recorded_values_fails(results):
    run = "functional_nccl"
    (results / run / plan_mod.CASE / "comparison.json").write_text(json.dumps(no_golden_comparison(results, run)))
    entry = summary_run(results, run)
    assert not entry["ok"] and entry["problems"], "no golden values and nothing recorded is not a pass"


def test_nccl_plan_trains_with_te_fused_wgrad_the_optimizer_path_and_eval(two_gpus):
    """Each NCCL functional run, as megatron parses its flags: the TE run has none of the
    harness's local flags (Transformer Engine, fused wgrad into main_grad); the sync run has
    no --overlap-param-gather (the optimizer's gather); the eval run evaluates every 10 steps."""
    plan, _ = two_gpus
    runs = {r["name"]: r for r in plan["runs"]
            if r["kind"] == "functional" and r["backend"] == "nccl" and r["base"] == "0.17.1"}
    attrs = ["transformer_impl", "gradient_accumulation_fusion", "overlap_param_gather", "eval_interval",
             "distributed_backend", "optimizer", "accumulate_allreduce_grads_in_fp32"]
    cases, names = [], []
    for name, run in runs.items():
        for x in run["launches"]:
            _, argv = parse_launch(x["command"])
            cases.append({"argv": torchrun_parts(argv)[2], "world_size": 2, "attrs": attrs})
            names.append(name)
    results = validate_megatron_args(cases)
    by_name = {}
    for name, r in zip(names, results):
        assert r["ok"], (name, r)
        assert by_name.setdefault(name, r["attrs"]) == r["attrs"], "both trees get the same flags"
    assert all(a["distributed_backend"] == "nccl" and a["optimizer"] == "dist_muon" for a in by_name.values())
    te, plain = by_name["functional_nccl_te"], by_name["functional_nccl"]
    assert (te["transformer_impl"], te["gradient_accumulation_fusion"]) == ("transformer_engine", True)
    assert te["accumulate_allreduce_grads_in_fp32"], "fused wgrad accumulates into an fp32 main_grad"
    assert (plain["transformer_impl"], plain["gradient_accumulation_fusion"]) == ("local", False)
    assert runs["functional_nccl_te"]["golden_file"] == "golden_values_h200_nccl_te.json"
    assert plain["overlap_param_gather"] and not by_name["functional_nccl_sync"]["overlap_param_gather"]
    assert by_name["functional_nccl_eval"]["eval_interval"] == 10 and plain["eval_interval"] > 50
    assert plan["schedule_s"] <= plan["budget_s"]


@pytest.mark.extended
@pytest.mark.gloo
def test_memory_workers_start_from_the_same_weights_whatever_their_cpu_generator_was(tmp_path):
    """Two memory-worker processes whose CPU generators were in different states before the
    worker ran, with the CUDA generator separate from the CPU one as on a GPU
    (memory_worker_rng_wrapper.py), start from the same weights: the worker seeds the CPU
    generator that draws the weights built on CPU (on a GPU, at least the learned position
    embedding). Without its torch.manual_seed the two checksums differ."""
    from harness import launch

    wrapper = Path(__file__).with_name("memory_worker_rng_wrapper.py")
    checksums = []
    for prior in (1, 2):
        out = tmp_path / f"prior{prior}.json"
        argv, env = launch.torchrun_command(
            wrapper, [str(prior), "--", "--backend", "gloo", "--config", "tiny", "--steps", "1", "--out", str(out)],
            2, tree="series-0.17.1", cpu=True)
        launch.run_command(argv, env, run_dir=tmp_path / f"log{prior}", timeout_s=400, what=f"memory worker {prior}")
        ranks = json.loads(out.read_text())["ranks"]
        assert len({r["init_params_checksum"] for r in ranks}) == 1, "DP ranks start from the same weights"
        checksums.append(ranks[0]["init_params_checksum"])
    assert checksums[0] == checksums[1], checksums


# ------------------------------------------------------------- real shapes on the real allocator
def test_the_real_shape_config_is_llama3_8b_with_the_layers_that_fit_two_ranks_on_80gb():
    from harness.gpu_check import memory_worker, real_shapes

    cfg = memory_worker.CONFIGS["llama3_8b_layers"]
    assert (cfg["hidden_size"], cfg["ffn_hidden_size"], cfg["num_attention_heads"], cfg["num_query_groups"],
            cfg["vocab"]) == (4096, 14336, 32, 8, 128256)
    layers = cfg["num_layers"]
    assert layers == real_shapes.LAYERS == real_shapes.layers_that_fit() == 8
    usable = (1 - real_shapes.MARGIN) * real_shapes.GPU_BYTES
    assert 2 * sum(real_shapes.rank_bytes(layers).values()) <= usable < 2 * sum(real_shapes.rank_bytes(layers + 1).values())
    assert real_shapes.model_numel(32) == 8_030_261_248, "Llama-3-8B's parameter count"


def test_the_real_shape_run_carries_the_audits_prediction(one_gpu):
    """The audit (harness/audit/worker.run_cell), run now on the real-shape
    configuration at DP 2, predicts the bytes that the plan carries and the dry run prints:
    the pristine tree's temporaries per DP rank and path, and 0 for the series."""
    from harness.gpu_check import real_shapes

    plan, lines = one_gpu
    run = next(r for r in plan["runs"] if r["name"] == "memory_nccl_llama3_8b_layers")
    assert (run["config"], run["nproc"], run["exclusive"]) == ("llama3_8b_layers", 2, True)
    fresh = real_shapes.prediction_doc()
    assert fresh["trees"]["pristine"]["ranks"][0]["param_numel"] == real_shapes.model_numel(real_shapes.LAYERS)
    text = "\n".join(lines)
    for tree, rec in fresh["trees"].items():
        for rank in rec["ranks"]:
            carried = run["prediction"]["trees"][tree]["ranks"][rank["dp_rank"]]
            # The whole record, calls and operations per path too: a stored prediction older
            # than the series (2 optimizer-path broadcasts where patch 0006 makes one per param)
            # fails here, not first on a GPU.
            assert carried == rank, (tree, rank["dp_rank"])
            for window, label in (("sync", "param sync"), ("sync_optimizer", "optimizer gather")):
                want = rank["predicted"][window]
                assert carried["predicted"][window] == want, (tree, window, rank["dp_rank"])
                line = next(l for l in lines if l.startswith(f"    {tree} {label}: "))
                assert f"rank {rank['dp_rank']}: {want['bytes']} B (+-{want['tolerance_bytes']})" in line
                assert (want["bytes"] > 0) is (tree == "pristine"), (tree, window, want)
    assert "predicted by the real-shape audit (8 layers, DP 2" in text


def llama_results(results: Path, offset=0):
    """``results``' memory_nccl run as the real-shape run, with a prediction whose buckets are
    the measured ones (``BUCKETS``) and whose bytes are the measured peaks (``FIGURES``' sync and
    sync_optimizer, alike on both DP ranks) plus ``offset`` for the pristine tree."""
    pred = {"trees": {tree: {"ranks": [
        {"dp_rank": rank, "buckets": [{"numel": n, "shares": list(s)} for n, s in BUCKETS],
         "predicted": {w: {"bytes": fig[w] + (offset if tree == "pristine" else 0), "tolerance_bytes": 512 * 4}
                       for w in ("sync", "sync_optimizer")}} for rank in (0, 1)]} for tree, fig in FIGURES.items()}}
    edit_run(results, "memory_nccl", config="llama3_8b_layers", prediction=pred)
    return pred


@pytest.mark.parametrize("offset, ok", [(0, True), (2048, True), (2049, False), (-4096, False)])
def test_the_real_shape_run_fails_where_measured_and_predicted_disagree_beyond_rounding(results, offset, ok):
    llama_results(results, offset)
    summary = report.summarize(results)
    run = next(r for r in summary["runs"] if r["name"] == "memory_nccl")
    rows = run["prediction"]["rows"]
    assert len(rows) == 2 * 2 * 2, "2 trees x 2 windows x 2 DP ranks"
    assert run["ok"] is ok, run["problems"]
    if not ok:
        assert any("beyond the allocator rounding of 2048 B" in p for p in run["problems"]), run["problems"]
    text = report.render(summary)
    assert "measured CUDA peak beside the real-shape audit's prediction" in text
    assert ("DISAGREES" in text) is not ok


def test_the_real_shape_comparison_is_void_when_the_buckets_are_not_the_audits(results):
    pred = llama_results(results)
    pred["trees"]["pristine"]["ranks"][0]["buckets"][0]["shares"] = [1, 2]
    edit_run(results, "memory_nccl", prediction=pred)
    run = summary_run(results, "memory_nccl")
    assert not run["ok"] and any("buckets and shares differ from the audit's model" in p for p in run["problems"])


def test_a_skipped_run_neither_passes_nor_fails(results):
    edit_json(results / "plan.json", lambda d: d["runs"].append(
        {**next(r for r in d["runs"] if r["name"] == "functional_nccl"), "name": "functional_nccl_te",
         "skip_reason": plan_mod.TE_MISSING}))
    edit_json(results / "runs.json", lambda d: d.append(
        {"name": "functional_nccl_te", "status": "skipped", "returncode": None, "seconds": 0.0,
         "reason": plan_mod.TE_MISSING}))
    summary = report.summarize(results)
    te = next(r for r in summary["runs"] if r["name"] == "functional_nccl_te")
    assert te["ok"] is None and te["skipped"] and summary["ok"] and summary["skipped"] == ["functional_nccl_te"]
    lines = report.render(summary).splitlines()
    assert lines[1].startswith("PASS: 4/4 runs ok, 1 skipped")
    i = next(i for i, l in enumerate(lines) if l.startswith("functional_nccl_te: skipped"))
    assert lines[i + 1] == "  skipped: Transformer Engine not installed"


def test_lanes_run_side_by_side_and_exclusive_runs_alone(tmp_path):
    """execute(): an exclusive run first, alone; then the lanes at once (two runs of 1.5 s in
    two lanes end in well under 3 s); runs.json keeps the plan's order."""
    import time

    from harness.gpu_check.__main__ import execute

    def run(name, lane, exclusive=False):
        code = f"import time; time.sleep(1.5); open({str(tmp_path / (name + '.end'))!r}, 'w').write(str(time.time()))"
        return plan_mod.Run(name, "memory", "nccl", 2, ["cuda:0", "cuda:0"], 30,
                            [plan_mod.Launch("pristine-0.17.1", [sys.executable, "-c", code], dict(os.environ))],
                            config="tiny", lane=lane, exclusive=exclusive)

    plan = plan_mod.Plan(1, "NVIDIA H200", tmp_path, [run("a", 0), run("b", 1), run("x", -1, exclusive=True)])
    t0 = time.monotonic()
    statuses = execute(plan)
    assert [s["name"] for s in statuses] == ["a", "b", "x"] and all(s["status"] == "ok" for s in statuses)
    ends = {n: float((tmp_path / f"{n}.end").read_text()) for n in "abx"}
    assert ends["x"] < min(ends["a"], ends["b"]) - 1.0, "the exclusive run ends before the lanes start"
    assert abs(ends["a"] - ends["b"]) < 1.0 and time.monotonic() - t0 < 5.5


def test_a_base_that_is_not_set_up_is_planned_as_skipped(tmp_path, monkeypatch):
    """An image built for one base has no 0.19 trees or checkout: its 0.19 runs are planned
    with the reason and no launches (the report: skipped), and the rest of the plan stands."""
    from tests.functional_tests.python_test_utils import run_case

    monkeypatch.setattr(run_case, "missing_checkouts",
                        lambda names: [f"no checkout for {names[0]}"] if "gpt019" in names[0] else [])
    plan = plan_mod.make_plan(1, "NVIDIA H200", tmp_path, with_te=True)
    for r in plan.runs:
        assert (r.skip_reason is not None) is (r.base == "0.19"), r.name
        assert bool(r.launches) is (r.base != "0.19")
    assert "skipped: no checkout for gpt019_dp2_bf16_fp32grad_overlap_legacy" in plan_mod.format_plan(plan)


@pytest.mark.extended
@pytest.mark.gloo
def test_the_memory_workers_llama_model_has_the_audits_buckets_and_shares(tmp_path):
    """The memory worker builds its Llama-shaped configs as the audit does: on 2 CPU ranks, the
    same code at ``llama_tiny``'s size gives the buckets and per-rank shares that the audit
    (predict_worker, run_cell) computes for ``real_shapes.model_spec`` of that config; with the
    real config the report compares the two at run time."""
    from harness import launch
    from harness.gpu_check import memory_worker, real_shapes

    out = tmp_path / "series.json"
    argv, env = launch.torchrun_command(plan_mod.MEMORY_WORKER, ["--backend", "gloo", "--config", "llama_tiny",
                                                                 "--steps", "1", "--out", str(out)], 2,
                                        tree=plan_mod.TREES["series"])
    launch.run_command(argv, env, run_dir=tmp_path / "log", timeout_s=400, what="memory worker llama_tiny")
    measured = json.loads(out.read_text())["ranks"][0]
    predicted = real_shapes.predict("series", cfg=memory_worker.CONFIGS["llama_tiny"])["ranks"][0]
    assert measured["param_count"] == predicted["param_numel"]
    assert [[b["numel"], b["shares"]] for b in measured["buckets"]] == \
        [[b["numel"], b["shares"]] for b in predicted["buckets"]]


# ------------------------------------------------------------- the optimizer gather's time
def test_the_gather_timing_runs_alone_on_the_whole_llama3_8b_where_each_rank_has_a_gpu(tmp_path):
    """With a GPU per rank the timing run is exclusive (nothing else on the GPUs), DP = the GPUs
    up to 8, the whole Llama-3-8B; on one GPU it runs the tiny model in a lane (its times mean
    nothing there) and the plan still fits 8 minutes."""
    for gpus, nproc in ((1, 2), (2, 2), (8, 8), (16, 8)):
        plan = plan_mod.make_plan(gpus, "NVIDIA H100 80GB HBM3", tmp_path, with_te=True)
        run = next(r for r in plan.runs if r.name == "timing_nccl_optimizer_gather")
        _, _, args = torchrun_parts(run.launches[0].argv)
        assert run.kind == "timing" and run.nproc == nproc and run.exclusive is (gpus > 1)
        assert run.shared_gpu is (gpus == 1) and [x.tree for x in run.launches] == ["series-0.17.1"]
        config = args[args.index("--config") + 1]
        assert config == ("llama_tiny" if gpus == 1 else "llama3_8b")
        assert ("--layers" in args and args[args.index("--layers") + 1] == "32") is (gpus > 1)
        assert args[args.index("--pristine-tree") + 1] == "pristine-0.17.1"
        assert args[args.index("--max-seconds") + 1] == str(plan_mod.GATHER_TIMING["max_seconds"])
        assert plan.schedule_s <= plan.budget_s


def test_pristine_allgather_params_is_the_pristine_trees_source():
    """The pristine path the worker times is the pristine tree's own method, not a copy."""
    from harness.gpu_check import gather_timing_worker as w
    from harness.trees import tree_parent

    pristine = w.method_source(tree_parent("pristine-0.17.1") / w.OPTIMIZER_FILE)
    series = w.method_source(tree_parent("series-0.17.1") / w.OPTIMIZER_FILE)
    assert pristine.startswith("@torch.no_grad()\ndef allgather_params(self)")
    assert "torch.distributed.all_gather(gather_list, src, group=group)" in pristine
    assert "_coalescing_manager" not in pristine
    assert "_coalescing_manager(group" in series and "torch.distributed.broadcast(p.data" in series


@pytest.mark.gloo
def test_gather_timing_on_two_gloo_ranks_gives_the_report_its_row(tmp_path):
    """The timing stage end to end on 2 CPU gloo ranks, the code the GPU runs: both paths leave
    every param at its owner's value, the pristine path is the pristine list all_gather and the
    series' its grouped broadcasts, and the report prints the times, the ratio with its CI and
    that gloo's times decide nothing."""
    from harness import launch

    run_dir = tmp_path / "results" / "timing_nccl_optimizer_gather"
    argv, env = launch.torchrun_command(
        plan_mod.GATHER_TIMING_WORKER, ["--backend", "gloo", "--config", "llama_tiny", "--rounds", "4", "--block", "2",
                                        "--out", str(run_dir / "gather_timing.json")], 2, tree="series-0.17.1", cpu=True)
    launch.run_command(argv, env, run_dir=tmp_path / "log", timeout_s=300, what="gather timing worker")
    doc = json.loads((run_dir / "gather_timing.json").read_text())
    assert doc["world"] == 2 and doc["backend"] == "gloo" and doc["layers"] == 2
    assert doc["param_count"] == 2 * 6 + 3 == sum(doc["params_per_rank"])
    assert doc["nccl_ops"] == {"pristine": 2, "series": 15}, "unequal shares: one broadcast per rank (pristine)"
    assert all(doc["checks"][p]["synced"] for p in ("pristine", "series"))
    assert doc["series_in_place"] and doc["pristine_uses_list_all_gather"] and doc["series_uses_coalescing_manager"]
    assert doc["pristine_source_sha256"] != doc["series_source_sha256"]
    assert [len(doc["block_median_s"][p]) for p in ("pristine", "series")] == [4, 4]
    assert doc["ratio"]["rounds"] == 4 and doc["ratio"]["ci_lo"] <= doc["ratio"]["ratio"] <= doc["ratio"]["ci_hi"]

    results = run_dir.parent
    (results / "plan.json").write_text(json.dumps({"gpus": 1, "gpu_name": "NVIDIA H200", "budget_s": 480, "runs": [
        {"name": run_dir.name, "kind": "timing", "backend": "nccl", "nproc": 2, "devices": ["cuda:0", "cuda:0"],
         "timeout_s": 90, "base": "0.17.1", "shared_gpu": True}]}))
    (results / "runs.json").write_text(json.dumps([{"name": run_dir.name, "status": "ok", "returncode": 0,
                                                    "seconds": 9.0}]))
    summary = report.write(results)
    assert summary["ok"] and summary["runs"][0]["timing"]["ratio"] == doc["ratio"]
    lines = (results / "report.txt").read_text().splitlines()
    r = doc["ratio"]
    assert f"    series/pristine time: {r['ratio']:.2f} [{r['ci_lo']:.2f}, {r['ci_hi']:.2f}] (median of 4 " \
        "per-round ratios, 95 % bootstrap CI)" in lines
    assert any(l.startswith("    pristine (list all_gather, 2 NCCL ops): median ") for l in lines)
    assert any(l.startswith("    series (in-place broadcasts, 15 NCCL ops in one group): median ") for l in lines)
    assert "    these times decide nothing: gloo runs every broadcast as its own call" in lines

    doc["checks"]["series"]["synced"] = False
    doc["series_in_place"] = False
    (run_dir / "gather_timing.json").write_text(json.dumps(doc))
    bad = report.summarize(results)["runs"][0]
    assert not bad["ok"] and bad["problems"] == [
        "series: a param differs from its owner's after the gather",
        "series: a param is not a plain contiguous tensor (the flatten-and-gather fallback ran)"]


@pytest.mark.parametrize("max_seconds, warm, want", [(None, [9.0, 9.0], 20), (30, [0.05, 0.05], 20),
                                                     (30, [1.0, 1.0], 5), (30, [0.4, 0.3], 14)])
def test_the_gather_timing_takes_fewer_rounds_where_gathers_are_slow(max_seconds, warm, want):
    """A slow interconnect (the warm-up gathers say 20 rounds of 3 per path would not end within
    --max-seconds) gets fewer rounds, never fewer than 5, so that the run ends within its timeout."""
    from harness.gpu_check import gather_timing_worker as w

    assert w.rounds_within(20, max_seconds, 3, warm) == want
