"""Dockerfile: docker cannot build here, so parse it (dockerfile_parse) and check the contract.

- the base is an NGC PyTorch image pinned by a release tag (not latest, not untagged), whose
  Python (recorded in a LABEL and asserted by a RUN) is >= 3.12;
- Megatron-LM is cloned at an ARG ref that defaults to core_v0.17.1;
- the series is applied with scripts/apply_patches.sh, so a series that does not apply fails
  the build;
- the harness's requirements come from requirements/docker.txt, never torch & co;
- the fast unit tests run as a build step, selected by a valid marker expression.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

dockerfile_parse = pytest.importorskip("dockerfile_parse")

ROOT = Path(__file__).resolve().parents[2]
LABEL_PY = "io.megatron-layerwise-ag.python"


@pytest.fixture(scope="module")
def df():
    return dockerfile_parse.DockerfileParser(path=str(ROOT / "Dockerfile"))


def instructions(df, kind):
    return [(i, s) for i, s in enumerate(df.structure) if s["instruction"] == kind]


def runs(df):
    return instructions(df, "RUN")


def run_index(df, needle):
    """Index (in df.structure) of the single RUN whose command contains needle."""
    hits = [i for i, s in runs(df) if needle in s["value"]]
    assert len(hits) == 1, f"expected one RUN with {needle!r}, found {len(hits)}"
    return hits[0]


def test_base_is_an_ngc_pytorch_release_pinned_by_tag(df):
    froms = instructions(df, "FROM")
    assert len(froms) == 1 and not df.is_multistage
    image = df.baseimage
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d{2})\.(\d{2})-py3", image)
    assert m, f"base {image!r} must be nvcr.io/nvidia/pytorch:YY.MM-py3 (a release tag)"
    assert "latest" not in image and "$" not in image
    # Python 3.12 arrived with the 25.xx images (Ubuntu 24.04); 24.xx ships 3.10.
    assert (int(m[1]), int(m[2])) >= (25, 1)
    assert df.labels["org.opencontainers.image.base.name"] == image


def test_python_is_at_least_3_12_and_checked_at_build_time(df):
    major, minor = map(int, df.labels[LABEL_PY].split(".")[:2])
    assert (major, minor) >= (3, 12)
    check = df.structure[run_index(df, "sys.version_info >= (3, 12)")]["value"]
    assert "assert" in check
    # The base's own packages are checked, not installed: TE and apex come with NGC images.
    assert "transformer_engine" in check and "apex" in check
    comments = " ".join(s["value"] for _, s in instructions(df, "COMMENT"))
    assert "Python 3.12" in comments and df.baseimage.split(":")[1] in comments, "say which tag and why"


def test_megatron_lm_cloned_at_the_ref_arg(df):
    assert df.args["MEGATRON_LM_REF"] == "core_v0.17.1"
    assert df.args["MEGATRON_LM_REPO"].endswith("NVIDIA/Megatron-LM.git")
    i = run_index(df, "git clone")
    clone = df.structure[i]["value"]
    assert re.search(r'git clone --depth 1 --branch "\$\{MEGATRON_LM_REF\}" "\$\{MEGATRON_LM_REPO\}" '
                     r"/workspace/Megatron-LM\b", clone), clone
    arg_line = next(s["startline"] for _, s in instructions(df, "ARG") if s["value"].startswith("MEGATRON_LM_REF="))
    assert arg_line < df.structure[i]["startline"]


def test_series_applied_with_apply_patches_and_failures_fail_the_build(df):
    assert (ROOT / "scripts" / "apply_patches.sh").exists() or pytest.skip("apply_patches.sh not here yet")
    i = run_index(df, "scripts/apply_patches.sh /workspace/Megatron-LM")
    cmd = df.structure[i]["value"]
    steps = [s.strip() for s in cmd.split("&&")]
    assert "bash scripts/apply_patches.sh /workspace/Megatron-LM" in steps
    assert "bash scripts/apply_patches.sh /workspace/Megatron-LM --check" in steps
    # Nothing may swallow a failing apply: only && chains, no `|| true`, no `;`.
    assert "||" not in cmd and ";" not in cmd
    shell = instructions(df, "SHELL")
    assert shell and "pipefail" in shell[0][1]["value"]
    clone = run_index(df, "git clone")
    copy_repo = next(j for j, s in instructions(df, "COPY") if s["value"].split()[0] == ".")
    pristine = run_index(df, "build/upstream/megatron")
    assert clone < copy_repo < pristine < i, "clone, copy the repo, keep a pristine copy, then patch"


def test_harness_requirements_are_installed_not_torch(df):
    i = run_index(df, "pip install")
    assert "-r /tmp/requirements-docker.txt" in df.structure[i]["value"]
    copies = [s["value"].split() for _, s in instructions(df, "COPY")]
    assert ["requirements/docker.txt", "/tmp/requirements-docker.txt"] in copies
    names = []
    for line in (ROOT / "requirements" / "docker.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.split(r"[=<>!~\[ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    lock = {l.split("==")[0].lower().replace("_", "-"): l.split("==")[1]
            for l in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
            if "==" in l and not l.startswith("#")}
    forbidden = {"torch", "transformer-engine", "apex", "numpy", "triton"}
    assert not forbidden & set(names) and not any(n.startswith("nvidia-") for n in names)
    assert {"emerging-optimizers", "pytest", "pyyaml", "tensorboard"} <= set(names)
    assert set(names) <= set(lock), f"not in requirements/lock.txt: {set(names) - set(lock)}"
    for line in (ROOT / "requirements" / "docker.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            assert lock[m[1].lower().replace("_", "-")] == m[2], f"{m[1]} pinned differently from lock.txt"


def test_fast_unit_tests_run_as_a_build_step(df):
    i = run_index(df, "pytest")
    cmd = df.structure[i]["value"]
    assert "python3 -m pytest tests/unit_tests" in cmd and '-m "${UNIT_TEST_MARKERS}"' in cmd
    assert "PYTHONPATH=/workspace/megatron-layerwise-ag" in cmd
    assert i > run_index(df, "scripts/apply_patches.sh /workspace/Megatron-LM"), "test the patched tree"
    expr = df.args["UNIT_TEST_MARKERS"]
    known = set(re.findall(r"^\s+(\w+):", (ROOT / "pytest.ini").read_text(), re.M))
    assert set(re.findall(r"\b(?!and\b|or\b|not\b)\w+", expr)) <= known, expr
    compiled = Expression.compile(expr)
    assert compiled.evaluate(lambda m: False)
    assert not compiled.evaluate(lambda m: m == "slow"), "slow training runs stay out of the build"


def test_dockerignore_keeps_generated_trees_out():
    ignored = {l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")}
    assert {".venv", "build", "megatron", ".git", ".whl"} <= ignored
