"""The cause of the rare failures of upstream's layer-wise parameter-update tests, pinned.

``test_parameter_updates`` and ``test_overlap_param_gather_parameter_updates``
(core_v0.17.1 ``tests/unit_tests/test_layer_wise_optimizer.py``) compare the layer-wise
optimizer's bf16 params after one step with a reference optimizer's at rtol 1e-5, from
unseeded random inputs. ``scripts/seed_sweep_upstream_test.py`` calls them once per seed:
over seeds 0-599 at 4 ranks, seeds 264, 452 and 529 fail, on pristine and patched alike and
with the same values. The layer-wise optimizer adds per-rank partial sums of squares for the
grad norm, the reference sums all grads on one rank; the last bits differ, the clip
coefficient moves by one fp32 ulp, and Muon's bf16 Newton-Schulz (``muon_fp32_matmul_prec``
'medium') rounds a few elements that sit on bf16 ties the other way, then spreads them.
With the reference clipping by the layer-wise norm (``--share-grad-norm``) no seed fails.
So the failures are the test's, not the series'. Seed 264 (fc1.weight, 752 of 3840 elements)
stands for them here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.trees import REPO_ROOT
from tests.upstream_tests import upstream_runner as ur

pytestmark = [pytest.mark.slow, pytest.mark.gloo]
SCRIPT = REPO_ROOT / "scripts" / "seed_sweep_upstream_test.py"
SEED = 264
TESTS = ("test_parameter_updates", "test_overlap_param_gather_parameter_updates")


def sweep(tmp_path, *options):
    missing = [t for t in ("pristine", "patched") if not (ur.CHECKOUTS[t] / ".git").is_dir()]
    if missing:
        pytest.skip(f"{missing} checkouts missing (scripts/setup.sh)")
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seeds", str(SEED), "--nproc", "4",
                           "--out-dir", str(out), *options],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())["trees"]


@pytest.mark.extended
def test_seed_264_fails_alike_on_both_trees_and_passes_with_one_grad_norm(tmp_path):
    trees = sweep(tmp_path)
    for tree, got in trees.items():
        assert got["ranks_reported"] == 4 and got["ranks_agree"], (tree, got)
        for test in TESTS:
            result = got["tests"][test]
            assert result["failing_seeds"] == [SEED], (tree, test, result)
            assert result["seeds_grad_norm_differs"] == [SEED], (tree, test)
            params = result["failures"][0]["params"]
            assert [(p["param"], p["mismatched"]) for p in params] == [("fc1.weight", 752)], (tree, test, params)
    assert trees["pristine"]["tests"] == trees["patched"]["tests"]
    shared = sweep(tmp_path, "--tree", "pristine", "--share-grad-norm")["pristine"]
    for test in TESTS:
        assert shared["tests"][test]["failing_seeds"] == [], (test, shared["tests"][test])
