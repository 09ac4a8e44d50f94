"""scripts/device_check.sh and scripts/prepare_device_carry.sh: command construction only.

No GPU is needed: --dry-run prints the plan (steps, timeouts, commands, output files), and the
tests check it fits the device budget (8 minutes including setup), writes what the device
tool can bring back (at most 8 flat files with plain names), selects the trees the way
harness/trees.py does, and that missing wheels stop it with a clear message before anything
runs. The training flags are checked with megatron's own parser.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from megatron_argcheck import validate_megatron_args

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "device_check.sh"
PREPARE = ROOT / "scripts" / "prepare_device_carry.sh"
LIMIT_S = 8 * 60
MCORE_WHEEL = re.search(r"^MCORE_WHEEL=(\S+)$", (ROOT / "requirements" / "megatron-core.lock").read_text(), re.M)[1]
DEVICE_ENV = ("OUT", "DEVICE_CHECK_PYTEST_MARKERS", "DEVICE_CHECK_BENCH_ARGS", "DEVICE_CHECK_TRAIN_ITERS",
              "DEVICE_CHECK_SITE")


def run(script, *args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k not in DEVICE_ENV}
    full_env.update(env or {})
    return subprocess.run(["bash", str(script), *map(str, args)], env=full_env, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def wheels(tmp_path):
    """A wheel folder as prepare_device_carry.sh makes it (empty files: a dry run reads names)."""
    d = tmp_path / "whl"
    d.mkdir()
    for name in (MCORE_WHEEL, "emerging_optimizers-0.3.0-py3-none-any.whl",
                 "dockerfile_parse-2.0.1-py2.py3-none-any.whl"):
        (d / name).write_bytes(b"")
    return d


def plan(*args, env=None):
    """Parse a dry run into {"steps": {name: (timeout, kill, cmd)}, "runs": {...}, ...}."""
    proc = run(CHECK, "--dry-run", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    out = {"steps": {}, "runs": {}, "text": proc.stdout}
    for line in proc.stdout.splitlines():
        m = re.match(r"^(step|run) (\S+) timeout=(\d+)s kill_after=(\d+)s: (.*)$", line)
        if m:
            out[m[1] + "s"][m[2]] = (int(m[3]), int(m[4]), m[5])
        elif line.startswith(("out: ", "files: ", "mode: ", "budget: ")):
            key, value = line.split(": ", 1)
            out[key] = value
    return out


def test_steps_fit_the_eight_minute_budget(wheels):
    p = plan("--wheels", wheels)
    assert list(p["steps"]) == ["setup", "unit_tests", "bench", "pretrain"]
    total = sum(t + k for t, k, _ in p["steps"].values())
    assert total < LIMIT_S, f"step timeouts add up to {total} s"
    assert p["budget"] == f"total_s={total} limit_s={LIMIT_S}"
    pretrain_t = p["steps"]["pretrain"][0]
    assert sum(t + k for t, k, _ in p["runs"].values()) < pretrain_t, "training runs overrun their step"
    assert p["steps"]["setup"][0] <= 60, "setup must stay short"


def test_out_layout_is_what_the_device_tool_brings_back(tmp_path, wheels):
    p = plan("--wheels", wheels, env={"OUT": str(tmp_path / "o")})
    assert p["out"] == str(tmp_path / "o")
    files = p["files"].split()
    assert len(files) <= 8 and len(set(files)) == len(files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert {"summary.json", "pretrain_compare.json", "param_sync.json", "unit_tests.log"} <= set(files)
    assert all(f"{step}.log" in files for step in p["steps"]), "every step keeps its log"
    assert f"--junitxml {tmp_path}/o/unit_tests.xml" in p["steps"]["unit_tests"][2]
    assert plan("--wheels", wheels, "--out", tmp_path / "x")["out"] == str(tmp_path / "x")
    assert plan("--wheels", wheels)["out"] == str(ROOT / "build" / "device_check" / "out")


def test_setup_installs_carried_wheels_offline(wheels):
    p = plan("--wheels", wheels)
    assert p["mode"] == f"wheels (wheels: {wheels})"
    setup = p["steps"]["setup"][2]
    pip, rest = setup.split(" && ", 1)
    words = shlex.split(pip)
    assert words[:4] == ["python3", "-m", "pip", "install"]
    assert {"--no-index", "--no-deps"} <= set(words)
    assert words[words.index("--target") + 1] == "/tmp/site"
    assert str(wheels / "emerging_optimizers-0.3.0-py3-none-any.whl") in words
    # megatron-core is not installed: setup.sh makes the pristine and patched trees from it.
    assert not any(MCORE_WHEEL in w for w in words)
    assert "build/wheels/" in rest and rest.endswith("scripts/setup.sh")
    site = plan("--wheels", wheels, env={"DEVICE_CHECK_SITE": "/opt/s"})["steps"]["setup"][2]
    assert "--target /opt/s" in site


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "absent", "no wheel folder"),
        (lambda d: d, f"missing {MCORE_WHEEL}"),
        (lambda d: (d / MCORE_WHEEL).write_bytes(b"") or d, "missing emerging_optimizers-*.whl"),
    ],
    ids=["no-folder", "no-megatron-core", "no-emerging-optimizers"],
)
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
def test_missing_wheels_stop_before_anything_runs(tmp_path, make, message, dry):
    (tmp_path / "whl").mkdir()
    folder = make(tmp_path / "whl")
    out = tmp_path / "out"
    proc = run(CHECK, *(["--dry-run"] if dry else []), "--wheels", folder, "--out", out)
    assert proc.returncode == 2
    assert message in proc.stderr and "prepare_device_carry.sh" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert not out.exists(), "nothing may run when inputs are missing"


def test_unit_test_step_uses_a_valid_marker_expression(wheels):
    cmd = shlex.split(plan("--wheels", wheels)["steps"]["unit_tests"][2])
    assert cmd[0] == "env" and cmd[1] == f"PYTHONPATH={ROOT}"
    assert cmd[3:6] == ["-m", "pytest", "tests/unit_tests"]
    expr = cmd[cmd.index("-m", 4) + 1]
    ini = (ROOT / "pytest.ini").read_text()
    known = set(re.findall(r"^\s+(\w+):", ini, re.M))
    assert set(re.findall(r"\b(?!and\b|or\b|not\b)\w+", expr)) <= known, expr
    compiled = Expression.compile(expr)
    assert compiled.evaluate(lambda m: False), "plain unit tests must be selected"
    assert not compiled.evaluate(lambda m: m == "gloo") and not compiled.evaluate(lambda m: m == "slow")
    custom = plan("--wheels", wheels, env={"DEVICE_CHECK_PYTEST_MARKERS": "not slow"})
    assert "-m not\\ slow " in custom["steps"]["unit_tests"][2]


def test_bench_step_runs_on_cuda(wheels):
    cmd = shlex.split(plan("--wheels", wheels)["steps"]["bench"][2])
    assert cmd[3:] == ["scripts/bench_param_sync.py", "--device", "cuda"]
    custom = plan("--wheels", wheels, env={"DEVICE_CHECK_BENCH_ARGS": "--device cuda --quick"})
    assert shlex.split(custom["steps"]["bench"][2])[-3:] == ["--device", "cuda", "--quick"]


def parse_run(line):
    cd, cmd = line.split(" && ", 1)
    words = shlex.split(cmd)
    assert words[0] == "env"
    env = dict(w.split("=", 1) for w in words[1:] if re.match(r"^[A-Z_]+=", w))
    i = words.index("harness.pretrain_gpt")
    return shlex.split(cd)[1], env, words[: i + 1], words[i + 1:]


def test_pretrain_runs_select_trees_like_the_harness(wheels):
    runs = {name: parse_run(cmd) for name, (_, _, cmd) in plan("--wheels", wheels)["runs"].items()}
    assert set(runs) == {"upstream_dist_muon", "patched_dist_muon", "upstream_muon"}
    upstream = ROOT / "build" / "upstream"
    for name, (cwd, env, launcher, argv) in runs.items():
        parent = upstream if name.startswith("upstream") else ROOT
        assert env["PYTHONPATH"].split(os.pathsep) == list(dict.fromkeys([str(parent), str(ROOT)]))
        assert env["MEGATRON_EXPECT_TREE"] == str(parent / "megatron")
        # `python -m` puts the working directory first on sys.path: never the repo root.
        assert Path(cwd) != ROOT and Path(cwd).parent == ROOT / "build" / "device_check"
        assert launcher[launcher.index("--nproc-per-node") + 1] == "1", "one GPU: DP=1"
        assert launcher[-2:] == ["-m", "harness.pretrain_gpt"]
        assert argv[argv.index("--distributed-backend") + 1] == "nccl"
        assert argv[argv.index("--tensorboard-dir") + 1] == f"{cwd}/tb"
        assert "--bf16" in argv and "--use-distributed-optimizer" not in argv
    ports = {launcher[launcher.index("--master-port") + 1] for _, _, launcher, _ in runs.values()}
    assert len(ports) == 3
    for name in ("upstream_dist_muon", "patched_dist_muon"):
        argv = runs[name][3]
        assert argv[argv.index("--optimizer") + 1] == "dist_muon"
        assert {"--overlap-param-gather", "--overlap-grad-reduce"} <= set(argv)
    ref = runs["upstream_muon"][3]
    assert ref[ref.index("--optimizer") + 1] == "muon" and "--overlap-param-gather" not in ref
    iters = plan("--wheels", wheels, env={"DEVICE_CHECK_TRAIN_ITERS": "7"})["runs"]["patched_dist_muon"][2]
    assert "--train-iters 7 " in iters

    results = validate_megatron_args(
        [{"argv": argv, "world_size": 1, "attrs": ["optimizer", "overlap_param_gather", "data_parallel_size"]}
         for _, _, _, argv in runs.values()])
    assert all(r["ok"] for r in results), results
    assert [r["attrs"]["optimizer"] for r in results] == [
        "dist_muon" if n.endswith("dist_muon") else "muon" for n in runs]


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--bogus"], {}, "unknown argument '--bogus'"),
        (["--wheels"], {}, "--wheels needs a folder"),
        ([], {"DEVICE_CHECK_TRAIN_ITERS": "0"}, "DEVICE_CHECK_TRAIN_ITERS must be a positive integer"),
    ],
)
def test_bad_usage(wheels, args, env, message):
    proc = run(CHECK, "--dry-run", *(args or ["--wheels", wheels]), env=env)
    assert proc.returncode == 2 and message in proc.stderr


def test_prepare_prints_the_device_call():
    proc = run(PREPARE, "--print-only")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    command = re.search(r"^\s+command:\s+(.*)$", text, re.M)[1]
    timeout = int(re.search(r"^\s+timeout_s:\s+(\d+)$", text, re.M)[1])
    carry = json.loads(re.search(r"^\s+carry:\s+(\[.*\])$", text, re.M)[1])
    assert command == "bash scripts/device_check.sh" and len(command) <= 2000
    assert LIMIT_S < timeout <= 600, "the tool's limit for one command is 600 s"
    assert len(carry) <= 8 and ".whl" in carry
    # Everything device_check.sh needs that git does not carry: the wheels, and the generated
    # trees with their stamps so that setup.sh on the device has nothing to rebuild.
    assert {"megatron", "build/upstream", "build/stamps"} <= set(carry)
    assert run(PREPARE, "--bogus").returncode == 2
