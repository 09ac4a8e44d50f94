"""``cpu_gloo_plugin`` item 8: every upstream test is called from ``torch.manual_seed(SEED)``.

Two tests that draw from the default generator, run by the plugin in one pytest session (as
upstream's files are, ``upstream_runner.command``), must draw the same numbers, those of a
fresh ``torch.manual_seed(SEED)``. Without the seeding the second draws after the first, and
the parameter-update tests' outcomes would again depend on the tests run before them.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.upstream_tests import upstream_runner as ur

pytestmark = [pytest.mark.gloo]

#: cpu_gloo_plugin.SEED (importing the plugin here would install the CPU runtime in this process).
SEED = 0

DRAWS = '''
import json, os, torch
def _draw(name):
    with open(os.path.join(os.environ["DRAWS_DIR"], name + ".json"), "w") as f:
        json.dump(torch.rand(4).tolist() + torch.randn(2).tolist(), f)
def test_first():
    _draw("first")
def test_second():
    _draw("second")
'''


def test_every_test_is_called_from_the_same_seed(tmp_path):
    checkout = ur.CHECKOUTS["pristine"]
    if not (checkout / "tests" / "unit_tests").is_dir():
        pytest.skip(f"{checkout} missing (scripts/setup.sh)")
    test_file = tmp_path / "test_draws.py"
    test_file.write_text(DRAWS)
    argv, env = ur.command(checkout, [str(test_file)], 1, tmp_path / "results")
    env["DRAWS_DIR"] = str(tmp_path)
    proc = subprocess.run(argv, env=env, cwd=checkout, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    torch.manual_seed(SEED)
    expected = torch.rand(4).tolist() + torch.randn(2).tolist()
    for name in ("first", "second"):
        assert json.loads((tmp_path / f"{name}.json").read_text()) == expected, name
