"""Dockerfile: docker cannot build here, so its own instructions are executed on a copy of
the build context, the way the builder would, with the base image's packages taken from
the repo's .venv.

The parser is dockerfile_parse (pinned in requirements/lock.txt). ``build_image`` walks the
Dockerfile in order: a COPY copies from the build context (the repo's files minus what
.dockerignore excludes, by Docker's rules) into a stand-in image folder; a RUN runs its
command with the Dockerfile's SHELL, ARG/ENV values and WORKDIR. Only what a machine without
Docker, GPU or network cannot have is replaced, by environment, never by editing a step:

- ``BASE_MODULES=torch``: the .venv has no Transformer Engine or apex;
- ``MEGATRON_LM_REPO``: the local Megatron-LM checkout of scripts/setup.sh (git, tag
  core_v0.17.1) instead of GitHub; it is made from the release tarball, so its commit is
  not upstream's and ``MEGATRON_LM_COMMIT`` names it (the commit check still runs);
- ``MEGATRON_LM_HELPERS=0``: pybind11 is not in the lock (the wheel's tree has the helpers);
- pip offline (``PIP_NO_INDEX``, ``PIP_FIND_LINKS=build/wheels``) and ``PIP_DRY_RUN`` for the
  requirements step (the .venv is shared);
- the unit-test step runs one test_data.py test that needs the wheel, and collects all the
  others.

A file the steps need and that .dockerignore excludes, or that is missing, fails the build.
"""

from __future__ import annotations

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
LOCAL_MLM = ROOT / "build" / "megatron-lm" / "core_v0.17.1"
WHEELS = ROOT / "build" / "wheels"
BUILD_SCRIPT = ROOT / "scripts" / "image_build.sh"
GOLDEN_DATA = ROOT / "tests" / "functional_tests" / "test_cases" / "golden_data.json"


@pytest.fixture(scope="module")
def df():
    return dockerfile_parse.DockerfileParser(path=str(ROOT / "Dockerfile"))


def instructions(df, kind):
    return [s for s in df.structure if s["instruction"] == kind]


# ------------------------------------------------------------------ .dockerignore, Docker's rules
def _pattern_regex(pattern: str) -> re.Pattern:
    """One .dockerignore pattern as a regex over '/'-separated relative paths (Go's
    filepath.Match plus '**', as Docker's pattern matcher reads it)."""
    pattern = os.path.normpath(pattern.strip().lstrip("/")).replace(os.sep, "/")
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            j = pattern.index("]", i)
            out += "[" + pattern[i + 1:j].replace("!", "^", 1) + "]"
            i = j
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_rules(text: str) -> list:
    """(exclude?, regex) per pattern of a .dockerignore, in order ('!' re-includes)."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        rules.append((not include, _pattern_regex(line[1:] if include else line)))
    return rules


def excluded(rel: str, rules) -> bool:
    """Whether Docker leaves ``rel`` out of the context: the last rule matching the path or
    one of its parent folders decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for exclude, rx in rules:
        if any(rx.match(p) for p in prefixes):
            verdict = exclude
    return verdict


@pytest.mark.parametrize("rel, pattern, out", [
    ("build/wheels/x.whl", "build", True),
    ("tests/x/build/y.py", "build", False),           # not gitignore: anchored at the root
    ("harness/__pycache__/a.pyc", "**/__pycache__", True),
    ("a.pyc", "**/*.pyc", True),
    ("harness/data.py", "harness/*.py", True),
    ("harness/gpu_check/plan.py", "harness/*.py", False),  # '*' stops at '/'
])
def test_dockerignore_matching_follows_dockers_rules(rel, pattern, out):
    assert excluded(rel, dockerignore_rules(pattern)) is out
    assert excluded(rel, dockerignore_rules(f"{pattern}\n!{rel}")) is False


def context_files(dockerignore: str) -> list:
    """The repo's files (tracked and untracked, not git-ignored) that reach the build."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    rules = dockerignore_rules(dockerignore)
    return [f for f in listed if f and (ROOT / f).is_file() and not excluded(f, rules)]


# ------------------------------------------------------------------ the stand-in builder
class BuildFailed(AssertionError):
    pass


def build_image(df, where: Path, dockerignore: str, extra_env: dict, step_env=None) -> dict:
    """Execute the Dockerfile's COPY/WORKDIR/RUN instructions in order into ``where``.

    Returns the environment of the last RUN. Raises ``BuildFailed`` naming the RUN, with its
    output, when one exits non-zero.
    """
    context = where / "context"
    for rel in context_files(dockerignore):
        dst = context / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst)
    image = where / "image"
    values = {**df.args, **df.envs}
    values.update(MEGATRON_LM=str(image / "workspace" / "Megatron-LM"),
                  HARNESS=str(image / "workspace" / "megatron-layerwise-ag"))

    def expand(text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)

    shell = json.loads(instructions(df, "SHELL")[-1]["value"]) if instructions(df, "SHELL") else ["/bin/sh", "-c"]
    workdir = image
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PIP_"))}
    env = {}
    for ins in df.structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "COPY":
            *sources, dest = expand(value).split()
            for src in sources:
                s, d = context / src, Path(dest)
                if not s.exists():
                    raise BuildFailed(f"COPY {src}: not in the build context (missing or excluded by .dockerignore)")
                if s.is_dir():
                    shutil.copytree(s, d, symlinks=True, dirs_exist_ok=True)
                else:
                    d.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(s, d)
        elif kind == "WORKDIR":
            workdir = Path(expand(value))
            workdir.mkdir(parents=True, exist_ok=True)
        elif kind == "RUN":
            env = {**base_env, **values, **extra_env, **((step_env or {}).get(value, {}))}
            proc = subprocess.run([*shell, value], cwd=workdir, env=env, capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise BuildFailed(f"RUN {value} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return env


def offline_env() -> dict:
    for need, what in ((LOCAL_MLM / ".git", "the Megatron-LM checkout"), (WHEELS, "the megatron-core wheel")):
        if not need.exists():
            pytest.skip(f"{what} missing ({need}): run scripts/setup.sh")
    head = subprocess.run(["git", "-C", str(LOCAL_MLM), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    return {
        "PYTHON": str(ROOT / ".venv" / "bin" / "python"), "BASE_MODULES": "torch",
        "MEGATRON_LM_REPO": f"file://{LOCAL_MLM}", "MEGATRON_LM_COMMIT": head, "MEGATRON_LM_HELPERS": "0",
        "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELS), "PIP_DRY_RUN": "1",
        "UNIT_TEST_PATHS": "tests/unit_tests/test_data.py", "UNIT_TEST_ARGS": "-k indexed_dataset_reads_back",
        "GIT_CONFIG_GLOBAL": "/dev/null",
    }


def apply(target: Path, *flags) -> int:
    return subprocess.run(["bash", str(BUILD_SCRIPT.parent / "apply_patches.sh"), str(target), *flags],
                          capture_output=True, text=True, timeout=120).returncode


@pytest.fixture(scope="module")
def built(df, tmp_path_factory):
    where = tmp_path_factory.mktemp("docker")
    env = build_image(df, where, (ROOT / ".dockerignore").read_text(), offline_env())
    return where, env


@pytest.mark.extended
def test_the_build_runs_green_from_the_build_context_alone(built):
    where, env = built
    harness, clone = Path(env["HARNESS"]), Path(env["MEGATRON_LM"])
    assert apply(clone, "--check") == 0, "the clone is patched"
    assert apply(harness / "build" / "upstream", "--check") == 3, "build/upstream stays pristine"
    assert (harness / "megatron").resolve() == (clone / "megatron").resolve(), "megatron/ is the patched tree"
    # The data step made the dataset the golden values were made from, out of the wheel the
    # wheel step fetched.
    golden = json.loads(GOLDEN_DATA.read_text())
    made = json.loads(subprocess.run(
        [env["PYTHON"], "-c", "import json; from harness import data; "
         "print(json.dumps(data.provenance(data.prepare(log=lambda *a: None))))"],
        cwd=harness, env={**env, "PYTHONPATH": str(harness)}, capture_output=True, text=True, check=True,
        timeout=120).stdout)
    assert [made["dataset"][k] for k in (".bin", ".idx")] == [golden["dataset"][k] for k in (".bin", ".idx")]


@pytest.mark.extended
def test_a_file_the_build_needs_excluded_from_the_context_fails_it(df, tmp_path):
    """The wheel step reads the lock; excluded from the context, the build stops there."""
    with pytest.raises(BuildFailed, match=r"requirements/megatron-core.lock has no MCORE_VERSION"):
        build_image(df, tmp_path, (ROOT / ".dockerignore").read_text() + "\nrequirements/megatron-core.lock\n",
                    offline_env())


@pytest.mark.parametrize("commit, ok", [(None, True), pytest.param("0" * 40, False, marks=pytest.mark.extended)], ids=["locked", "moved"])
def test_the_clone_is_checked_against_the_locked_commit(tmp_path, commit, ok):
    env = {**os.environ, **offline_env(), "MEGATRON_LM": str(tmp_path / "clone")}
    if commit:
        env["MEGATRON_LM_COMMIT"] = commit
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), "megatron-lm"], capture_output=True, text=True,
                          env=env, timeout=120)
    if ok:
        assert proc.returncode == 0 and "(the expected commit)" in proc.stdout, proc.stderr
    else:
        assert proc.returncode != 0 and f"pins {commit}: the tag moved" in proc.stderr, proc.stderr


def test_a_series_that_does_not_apply_fails_the_trees_step(df, tmp_path):
    """A foreign change in the clone: apply_patches.sh refuses, nothing is half-applied and
    no later step runs (megatron/ is not linked)."""
    where = tmp_path
    env = offline_env()
    values = {**df.args, **df.envs}
    clone = where / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", "--branch", values["MEGATRON_LM_REF"],
                    env["MEGATRON_LM_REPO"], str(clone)], check=True, capture_output=True)
    victim = clone / "megatron" / "core" / "distributed" / "param_and_grad_buffer.py"
    victim.write_text(victim.read_text() + "\n# a local change\n")
    before = {p: p.read_bytes() for p in (clone / "megatron").rglob("*.py")}
    harness = where / "harness"
    shutil.copytree(ROOT / "scripts", harness / "scripts")
    shutil.copytree(ROOT / "patches", harness / "patches")
    proc = subprocess.run(["bash", "scripts/image_build.sh", "trees"], cwd=harness, capture_output=True, text=True,
                          env={**os.environ, **env, "MEGATRON_LM": str(clone)}, timeout=120)
    assert proc.returncode != 0 and "step trees failed" in proc.stderr, proc.stderr
    assert {p: p.read_bytes() for p in (clone / "megatron").rglob("*.py")} == before, "nothing half-applied"
    assert not (harness / "megatron").exists(), "no command after the failing one ran"


def test_a_base_without_the_modules_it_relies_on_fails_the_build(tmp_path):
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), "base"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "BASE_MODULES": "torch no_such_module_xyz"})
    assert proc.returncode != 0 and "the base image lacks ['no_such_module_xyz']" in proc.stderr


def test_every_build_step_is_run_by_the_dockerfile_in_order(df):
    """The Dockerfile's RUNs are scripts/image_build.sh calls that, together, run each step of
    the script once, in the script's order: what the test above runs is the whole build."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    steps = proc.stderr.split("steps:", 1)[1].split()
    run = []
    for ins in instructions(df, "RUN"):
        words = ins["value"].split()
        assert words[:2] == ["bash", "scripts/image_build.sh"], ins["value"]
        run += words[2:]
    assert run == steps


# ------------------------------------------------------------------ contracts of the inputs
def test_base_is_an_ngc_pytorch_release_with_python_3_12(df):
    """The BASE_IMAGE default: an NGC PyTorch release from 25.01 on (Python 3.12; 24.xx ships
    3.10, and megatron-core 0.17.1's wheel is cp312), optionally pinned by digest too."""
    (froms,) = instructions(df, "FROM")
    assert froms["value"] == "${BASE_IMAGE}"
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d{2})\.(\d{2})-py3(@sha256:[0-9a-f]{64})?", df.args["BASE_IMAGE"])
    assert m, f"BASE_IMAGE {df.args['BASE_IMAGE']!r} must be nvcr.io/nvidia/pytorch:YY.MM-py3[@sha256:...]"
    assert (int(m[1]), int(m[2])) >= (25, 1)


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
    assert set(names) <= set(lock), f"not in requirements/lock.txt: {set(names) - set(lock)}"
    assert all(lock[n] == v for n, v in pins.items()), "pinned differently from lock.txt"
    # The image's BPE is the one the golden data was made with (another BPE, another dataset).
    golden = json.loads(GOLDEN_DATA.read_text())
    assert f"tokenizers {pins.get('tokenizers')}" == golden["tokenizer"]["library"]


def test_unit_test_step_selects_the_fast_tests(df):
    expr = df.args["UNIT_TEST_MARKERS"]
    known = set(re.findall(r"^\s+(\w+):", (ROOT / "pytest.ini").read_text(), re.M))
    assert set(re.findall(r"\b(?!and\b|or\b|not\b)\w+", expr)) <= known, expr
    compiled = Expression.compile(expr)
    assert compiled.evaluate(lambda m: False), "unmarked tests run"
    assert not compiled.evaluate(lambda m: m == "slow") and not compiled.evaluate(lambda m: m == "gloo")


def test_cmd_is_an_exec_form_command_that_exists(df):
    (cmd,) = instructions(df, "CMD")
    argv = json.loads(cmd["value"])
    assert isinstance(argv, list) and argv
    assert shutil.which(argv[0]) or (ROOT / argv[0]).is_file(), argv


@pytest.mark.extended
def test_gpu_check_in_the_image_plans_without_a_gpu(built, tmp_path):
    """What a build (no GPU) can run of the shipped check: its dry run, from the image's files."""
    _, env = built
    harness = Path(env["HARNESS"])
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", str(tmp_path / "o")], cwd=harness,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": env["PYTHON"]})
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^run functional_gloo_shared_gpu .*backend=gloo", proc.stdout, re.M)


def test_the_trees_step_applies_the_019_series_to_a_core_v0_19_0_clone(tmp_path):
    """--build-arg MEGATRON_LM_REF=core_v0.19.0: the trees step patches that clone with
    patches/0.19/ (picked by its version), one commit per patch, and the check passes."""
    src = ROOT / "build" / "megatron-lm" / "core_v0.19.0"
    if not (src / ".git").is_dir():
        pytest.skip(f"{src} is missing: run scripts/setup.sh")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--branch", "core_v0.19.0", f"file://{src}", str(clone)],
                   check=True, capture_output=True)
    harness = tmp_path / "harness"
    shutil.copytree(ROOT / "scripts", harness / "scripts")
    shutil.copytree(ROOT / "patches", harness / "patches")
    proc = subprocess.run(["bash", "scripts/image_build.sh", "trees"], cwd=harness, capture_output=True, text=True,
                          env={**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "MEGATRON_LM": str(clone)}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    subjects = subprocess.run(["git", "-C", str(clone), "log", "--format=%s", "core_v0.19.0..HEAD"],
                              capture_output=True, text=True, check=True).stdout.splitlines()
    names = [ln for ln in (ROOT / "patches" / "0.19" / "series").read_text().splitlines() if ln and not ln.startswith("#")]
    first = re.search(r"^Subject: \[PATCH[^\]]*\] (.+)$", (ROOT / "patches" / "0.19" / names[0]).read_text(), re.M).group(1)
    assert len(subjects) == len(names) and first.startswith(subjects[-1][:40]), subjects
    assert apply(clone, "--check") == 0
