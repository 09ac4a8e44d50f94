"""Each patch's own tests, on every prefix of each series, in checkout form.

Every patch of ``patches/<base>/`` adds its tests to one upstream-style file,
``tests/unit_tests/distributed/test_layer_wise_param_gather.py`` (built like upstream's
``tests/unit_tests/test_layer_wise_optimizer.py``: ``Utils``, DDP without the distributed
optimizer, the layer-wise Muon optimizer). A *prefix* k of a series is the base plus its first k
patches. Here the file runs on 2 CPU gloo ranks (``upstream_runner``, ``cpu_gloo_plugin``) in a
clone of the series' Megatron-LM checkout (``scripts/setup.sh``: the base's tag + one commit per
patch, by ``scripts/apply_patches.sh``) at that prefix, and it is asserted that:

* at prefix k the file holds exactly the tests that patches 1..k add (read from the patches'
  ``+def test_`` lines), and every one passes: each patch stands alone with its tests;
* patch k's tests, run on prefix k-1 (the file as patch k leaves it, the code without patch k),
  fail: they test what patch k changes. The exceptions are named in ``ALREADY_ON_BASE``, with
  why the base already passes them.

The default run (CI) checks that the whole series of each base (k = N) passes its tests; the
shorter prefixes, and each patch's tests without it (on prefix k-1), are ``extended``
(``scripts/test.sh --all``): about 40 s of wall time per run on 2 cores.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.trees import series_patches
from tests.tiers import tiered
from tests.upstream_tests import upstream_runner as ur

pytestmark = [pytest.mark.slow, pytest.mark.gloo]

OWN_FILE = ur.SERIES_TESTS
CHECKOUT_OF = ur.CHECKOUTS_OF_BASE
#: Tests a patch adds that its base passes already (node names): they pin down behaviour the
#: patch must keep, not behaviour it adds.
ALREADY_ON_BASE = {
    "0.19": {
        # 0.19.2 receives the forward's gather into grad_data (upstream #3751); patch 0004 keeps
        # that for a gather started while grad_data is idle and adds the rest of its tests.
        "test_forward_gather_receives_into_idle_grad_data",
        # 0.19.2 skips the gather at DP size 1 (upstream #4138); patch 0003 fixes the expert
        # buckets ([expert]), and expert-DP size 1 already works there.
        "test_dp_size_one_builds_and_trains[dense]",
        "test_expert_dp_size_one_builds_and_trains",
        # Nothing is gathered at DP size 1, so no backward can meet a gather.
        "test_backward_without_pre_hooks_is_fine_where_nothing_is_gathered",
    },
    "0.17.1": {
        # 0.17.1 receives every gather into temporaries, so these rules of patch 0004 (what a
        # gather into grad_data must leave alone) hold there already: the patch keeps them.
        "test_param_sync_after_backward_leaves_main_grad_unchanged",
        "test_forced_sync_between_backward_and_step_keeps_main_grad",
        "test_backward_after_step_without_zero_grad_buffer_adds_onto_the_grads",
        "test_backward_without_pre_hooks_is_fine_where_nothing_is_gathered",
    },
}
_RUNS: dict = {}


def added_tests(patch: Path) -> list:
    """The test functions ``patch`` adds to OWN_FILE (its ``+def test_`` lines there), in order."""
    text = patch.read_text()
    sections = re.split(r"^diff --git ", text, flags=re.M)[1:]
    own = [s for s in sections if s.startswith(f"a/{OWN_FILE} ")]
    return re.findall(r"^\+def (test_\w+)\(", own[0], flags=re.M) if own else []


def _n(base: str) -> int:
    return len(series_patches(base=base))


def prefix_checkout(base: str, k: int, tests_of: int, dest: Path) -> Path:
    """A clone of the series checkout of ``base`` at prefix ``k`` (its tag + the first k
    commits), with OWN_FILE as prefix ``tests_of`` (1..N) has it.

    Raises:
        AssertionError: the checkout's commits are not the series' patches (rerun setup.sh).
    """
    pristine, series = (ur.CHECKOUTS[t] for t in CHECKOUT_OF[base])
    if not (series / ".git").is_dir():
        pytest.skip(f"{series} missing (scripts/setup.sh found no source of its base)")
    git = ["git", "-c", "advice.detachedHead=false"]
    subprocess.run([*git, "clone", "-q", "--shared", "--no-checkout", str(series), str(dest)], check=True)
    tag = pristine.name
    commits = subprocess.run([*git, "-C", str(dest), "rev-list", "--reverse", f"{tag}..HEAD"],
                             check=True, capture_output=True, text=True).stdout.split()
    assert len(commits) == _n(base), f"{series} has {len(commits)} commits over {tag}, the series {_n(base)}; rerun scripts/setup.sh"
    at = [tag, *commits]
    subprocess.run([*git, "-C", str(dest), "checkout", "-q", "--detach", at[k]], check=True)
    if tests_of != k:
        blob = subprocess.run([*git, "-C", str(dest), "show", f"{at[tests_of]}:{OWN_FILE}"],
                              check=True, capture_output=True).stdout
        (dest / OWN_FILE).write_bytes(blob)
    return dest


def _run(base: str, k: int, form: str, tmp_root: Path) -> ur.Run:
    """The run of OWN_FILE as prefix k has it, on prefix k (``form`` "own") or on prefix k-1
    ("before"); once per session. Below the whole series both forms start together, side by
    side (the sweeps need both); the default run (k = N) makes only the one it asks for."""
    forms = ("own", "before") if k < _n(base) else (form,)
    todo = [f for f in forms if (base, k, f) not in _RUNS]

    def one(f):
        dest = tmp_root / f"{base}-{f}-{k}"
        checkout = prefix_checkout(base, k if f == "own" else k - 1, k, dest)
        return ur.run(CHECKOUT_OF[base][1], 2, [OWN_FILE], timeout_s=600, checkout=checkout,
                      out_dir=ur.RESULTS_DIR / f"own-{base}-prefix{k}-{f}")

    if todo:
        with ThreadPoolExecutor(len(todo)) as pool:
            _RUNS.update({(base, k, f): r for f, r in zip(todo, pool.map(one, todo))})
    return _RUNS[(base, k, form)]


def _name(nodeid: str) -> str:
    """The test of a node id, parameters included: ``test_x[dense]``."""
    return nodeid.split("::")[-1]


def _function(nodeid: str) -> str:
    """The test function of a node id: ``test_x``."""
    return _name(nodeid).split("[")[0]


PREFIXES = [(b, k) for b in CHECKOUT_OF for k in range(1, _n(b) + 1)]


def test_every_patch_adds_tests():
    """Each patch of each base carries its own tests (and no test is added twice)."""
    for base in CHECKOUT_OF:
        added = [added_tests(p) for p in series_patches(base=base)]
        assert all(added), f"{base}: patches without tests: {[i + 1 for i, a in enumerate(added) if not a]}"
        flat = [t for a in added for t in a]
        assert len(flat) == len(set(flat)), f"{base}: a test added twice: {flat}"


@pytest.mark.parametrize("base,k", tiered(PREFIXES, lambda v: v[1] == _n(v[0])))
def test_prefix_passes_the_tests_of_its_patches(base, k, tmp_path_factory):
    run = _run(base, k, "own", tmp_path_factory.mktemp("own"))
    want = {t for p in series_patches(base=base)[:k] for t in added_tests(p)}
    got = {_function(n) for n in run.results}
    assert got == want, f"prefix {k} of {base}: tests {sorted(got)}, its patches add {sorted(want)}; see {run.log}"
    bad = {_name(n): run.fail_reasons.get(n, v) for n, v in run.results.items() if v != "passed"}
    assert not bad, f"prefix {k} of {base}: {bad}; see {run.log}"


@pytest.mark.extended  # prefix k-1 of every k: a shorter prefix, as the sweeps' other checks
@pytest.mark.parametrize("base,k", PREFIXES)
def test_patch_tests_fail_without_the_patch(base, k, tmp_path_factory):
    run = _run(base, k, "before", tmp_path_factory.mktemp("own"))
    patches = series_patches(base=base)
    earlier = {t for p in patches[: k - 1] for t in added_tests(p)}
    new = set(added_tests(patches[k - 1]))
    assert {_function(n) for n in run.results} == earlier | new, run.log
    known = ALREADY_ON_BASE.get(base, set())
    for nodeid, outcome in run.results.items():
        name = _name(nodeid)
        if _function(nodeid) in earlier:
            assert outcome == "passed", f"{name} (an earlier patch's) {outcome} on prefix {k - 1}; see {run.log}"
        elif name in known:
            assert outcome == "passed", f"{name} is in ALREADY_ON_BASE but {outcome} on prefix {k - 1}; see {run.log}"
        else:
            assert outcome == "failed", f"{name} of patch {k} {outcome} without it (prefix {k - 1} of {base}); see {run.log}"
