"""Dockerfile: docker cannot build here, so parse its instructions and run what can run.

The parser is dockerfile_parse (pinned in requirements/lock.txt). What is checked:

- the base is an NGC PyTorch release pinned by tag, and the LABEL says which;
- the build steps that touch the series, run here with the Dockerfile's own SHELL against a
  copy of the pristine tree: the series applies, the harness keeps a pristine copy, and a
  target the series does not apply to makes the step (and so the build) fail;
- every COPY source exists and survives .dockerignore, and the files the image's commands
  run (scripts/gpu_check.sh, the harness, the functional-test runner) are in the context,
  executable where they are run as programs;
- the harness requirements are a subset of requirements/lock.txt without torch & co;
- the unit-test build step's marker expression is valid and keeps slow and gloo tests out;
- CMD is an exec-form command that exists in the image.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

dockerfile_parse = pytest.importorskip("dockerfile_parse")

ROOT = Path(__file__).resolve().parents[2]
PRISTINE = ROOT / "build" / "upstream" / "megatron"


@pytest.fixture(scope="module")
def df():
    return dockerfile_parse.DockerfileParser(path=str(ROOT / "Dockerfile"))


def instructions(df, kind):
    return [s for s in df.structure if s["instruction"] == kind]


def env_of(df) -> dict:
    """ARG defaults and ENV values, as the build's RUN steps see them (dockerfile_parse
    expands references to earlier ones)."""
    return {**df.args, **df.envs}


def shell_of(df) -> list:
    shell = instructions(df, "SHELL")
    return json.loads(shell[-1]["value"]) if shell else ["/bin/sh", "-c"]


def build_steps(df, *needles) -> list:
    """The RUN commands that mention any of ``needles`` (an environment variable name or a
    script), in Dockerfile order; fails unless each needle selects at least one."""
    runs = [s["value"] for s in instructions(df, "RUN")]
    for n in needles:
        assert any(n in r for r in runs), f"no RUN uses {n}"
    return [r for r in runs if any(n in r for n in needles)]


def run_step(df, cmd: str, workdir: Path, env: dict) -> subprocess.CompletedProcess:
    """Run one RUN command as the image's shell would, in ``workdir``, with ``env``."""
    return subprocess.run([*shell_of(df), cmd], cwd=workdir, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=240)


def test_base_is_an_ngc_pytorch_release_pinned_by_tag(df):
    froms = instructions(df, "FROM")
    assert len(froms) == 1 and not df.is_multistage
    image = df.baseimage
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d{2})\.(\d{2})-py3", image)
    assert m, f"base {image!r} must be nvcr.io/nvidia/pytorch:YY.MM-py3 (a release tag)"
    # Python 3.12 arrived with the 25.xx images (Ubuntu 24.04); 24.xx ships 3.10.
    assert (int(m[1]), int(m[2])) >= (25, 1)
    assert df.labels["org.opencontainers.image.base.name"] == image


def test_megatron_lm_is_cloned_at_core_v0_17_1(df):
    assert df.args["MEGATRON_LM_REF"] == "core_v0.17.1"
    assert df.args["MEGATRON_LM_REPO"] == "https://github.com/NVIDIA/Megatron-LM.git"


@pytest.fixture
def image_layout(tmp_path, df):
    """A stand-in for the image after step 3: ``$MEGATRON_LM`` holds a pristine megatron/
    (the wheel's, which has the same files the series touches), ``$HARNESS`` this repo's
    scripts and patches."""
    if not (PRISTINE / "core" / "__init__.py").is_file():
        pytest.skip("build/upstream/megatron missing: run scripts/setup.sh")
    env = env_of(df)
    assert {"MEGATRON_LM", "HARNESS"} <= set(env)
    target = tmp_path / "Megatron-LM"
    shutil.copytree(PRISTINE, target / "megatron", symlinks=True)
    harness = tmp_path / "harness"
    harness.mkdir()
    for name in ("scripts", "patches"):
        (harness / name).symlink_to(ROOT / name)
    return {"MEGATRON_LM": str(target), "HARNESS": str(harness)}, target, harness


def apply(target: Path, *flags) -> int:
    return subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(target), *flags],
                          capture_output=True, text=True, timeout=120).returncode


def test_build_keeps_a_pristine_tree_and_applies_the_series(df, image_layout):
    env, target, harness = image_layout
    for cmd in build_steps(df, "build/upstream", "apply_patches.sh"):
        proc = run_step(df, cmd, harness, env)
        assert proc.returncode == 0, f"{cmd}\n{proc.stderr}"
    assert apply(target, "--check") == 0, "the clone is patched"
    assert apply(harness / "build" / "upstream", "--check") == 3, "build/upstream stays pristine"
    assert (harness / "megatron").resolve() == (target / "megatron").resolve(), "megatron/ is the patched tree"


@pytest.mark.parametrize("damage", ["foreign_change", "not_megatron"])
def test_build_fails_when_the_series_does_not_apply(df, image_layout, damage):
    env, target, harness = image_layout
    if damage == "foreign_change":
        victim = target / "megatron" / "core" / "distributed" / "param_and_grad_buffer.py"
        victim.write_text(victim.read_text() + "\n# a local change\n")
    else:
        shutil.rmtree(target / "megatron")
        target.mkdir(exist_ok=True)
    before = {p: p.read_bytes() for p in target.rglob("*.py")}
    (cmd,) = build_steps(df, "apply_patches.sh")
    proc = run_step(df, cmd, harness, env)
    assert proc.returncode != 0, "a series that does not apply must fail the build step"
    assert "apply_patches.sh: error" in proc.stderr
    assert {p: p.read_bytes() for p in target.rglob("*.py")} == before, "nothing half-applied"
    assert not (harness / "megatron").exists(), "no step after the failing one ran"


def dockerignore_patterns() -> list:
    return [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
            if l.strip() and not l.startswith("#")]


def in_context(rel: str) -> bool:
    """Whether ``rel`` (a repo-relative path) is sent to the build (.dockerignore rules:
    a pattern matches the path or one of its parent folders; ``**/`` matches any depth)."""
    parts = Path(rel).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in dockerignore_patterns():
        pats = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        for pat in pats:
            if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p.split("/")[-1], pat) and "/" not in pat
                   and pattern.startswith("**/") for p in prefixes):
                return False
    return True


def test_copy_sources_exist_and_reach_the_build(df):
    copies = instructions(df, "COPY")
    assert copies
    for s in copies:
        *sources, _dest = s["value"].split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} is not in the repo"
            assert src == "." or in_context(src), f"COPY source {src} is excluded by .dockerignore"
    assert not in_context("build/upstream/megatron/core/__init__.py") and not in_context(".venv/bin/python")
    assert not in_context("harness/__pycache__/x.pyc")


def tracked_mode(rel: str) -> str:
    out = subprocess.run(["git", "ls-files", "-s", rel], cwd=ROOT, capture_output=True, text=True).stdout
    return out.split()[0] if out else ""


def test_the_image_ships_the_gpu_check_and_what_it_runs(df):
    repo_copy = [s for s in instructions(df, "COPY") if s["value"].split()[0] == "."]
    assert repo_copy, "the repo is copied into the image"
    needed = ["scripts/gpu_check.sh", "harness/gpu_check/__main__.py", "harness/gpu_check/memory_worker.py",
              "harness/upstream_pretrain_gpt.py", "harness/launch.py", "tests/functional_tests/python_test_utils/run_case.py",
              "scripts/launch_pretrain_gpt.sh", "scripts/apply_patches.sh"]
    for rel in needed:
        assert (ROOT / rel).is_file() and in_context(rel), rel
    for script in ("scripts/gpu_check.sh", "scripts/launch_pretrain_gpt.sh"):
        # `docker run IMAGE scripts/x.sh` execs the file: COPY keeps the mode git checks out.
        assert tracked_mode(script) in ("100755", ""), f"{script} is not executable in git"
        assert os.access(ROOT / script, os.X_OK), script


def test_gpu_check_in_the_image_plans_without_a_gpu(df, tmp_path):
    """What a build (no GPU) can run of the shipped check: its dry run, with this test's
    interpreter (the image's python3 during a build)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^run functional_gloo_shared_gpu .*backend=gloo", proc.stdout, re.M)


def test_harness_requirements_are_in_the_lock_and_leave_the_base_alone():
    names, pins = [], {}
    for line in (ROOT / "requirements" / "docker.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.split(r"[=<>!~\[ ]", line, maxsplit=1)[0].lower().replace("_", "-")
            names.append(name)
            if "==" in line:
                pins[name] = line.split("==")[1].strip()
    lock = {l.split("==")[0].lower().replace("_", "-"): l.split("==")[1].strip()
            for l in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
            if "==" in l and not l.startswith("#")}
    forbidden = {"torch", "transformer-engine", "apex", "numpy", "triton"}
    assert not forbidden & set(names) and not any(n.startswith("nvidia-") for n in names)
    assert {"emerging-optimizers", "pytest", "pyyaml", "tensorboard", "tokenizers"} <= set(names)
    assert set(names) <= set(lock), f"not in requirements/lock.txt: {set(names) - set(lock)}"
    assert all(lock[n] == v for n, v in pins.items()), "pinned differently from lock.txt"


def test_unit_test_step_selects_the_fast_tests(df):
    expr = df.args["UNIT_TEST_MARKERS"]
    known = set(re.findall(r"^\s+(\w+):", (ROOT / "pytest.ini").read_text(), re.M))
    assert set(re.findall(r"\b(?!and\b|or\b|not\b)\w+", expr)) <= known, expr
    compiled = Expression.compile(expr)
    assert compiled.evaluate(lambda m: False), "unmarked tests run"
    assert not compiled.evaluate(lambda m: m == "slow") and not compiled.evaluate(lambda m: m == "gloo")
    (step,) = build_steps(df, "pytest")
    assert "UNIT_TEST_MARKERS" in step


def test_cmd_is_an_exec_form_command_that_exists(df):
    (cmd,) = instructions(df, "CMD")
    argv = json.loads(cmd["value"])
    assert isinstance(argv, list) and argv
    assert shutil.which(argv[0]) or (ROOT / argv[0]).is_file(), argv
