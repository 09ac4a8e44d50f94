"""What a GPU rank of megatron.training runs that the CPU runtime layer stubs, run for real.

On GPU ranks ``megatron/training/initialize.py:_compile_dependencies`` has rank 0 call
``megatron.core.datasets.utils.compile_helpers()``, i.e. ``make -C
<tree>/megatron/core/datasets``, and exits 1 when make fails. The CPU runtime layer makes
``compile_helpers`` a no-op (``harness/cpu_runtime/installer.py``), so no training run of the
suite takes that step. Here megatron's own ``compile_helpers()`` runs on every tree
``scripts/setup.sh`` builds (the wheel trees and the Megatron-LM checkouts), each in its own
process with that tree first on ``PYTHONPATH`` and no CPU runtime layer, as a GPU rank imports
it; then ``helpers_cpp`` is imported from the same tree. Before setup.sh's ``place_helpers``
put Megatron-LM's Makefile (and the GNUmakefile that names the target for .venv's Python) into
the wheel trees, make failed there with "No targets specified and no makefile found".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.trees import REPO_ROOT, TREES, tree_parent

CHECKOUTS = REPO_ROOT / "build" / "megatron-lm"

# Run as a file (not -c), so that sys.path[0] is its folder, not the working directory (the
# repo root, which holds series-0.17.1's megatron/): the tree on PYTHONPATH is what imports.
RANK_STEP = r"""
import json, sys
from pathlib import Path
from megatron.core.datasets import utils
utils.compile_helpers()  # sys.exit(1) when make fails
from megatron.core.datasets import helpers_cpp
print("RESULT " + json.dumps({"utils": utils.__file__, "helpers_cpp": helpers_cpp.__file__}))
"""


def rank_step(tmp_path: Path, parent: Path) -> subprocess.Popen:
    """``RANK_STEP`` in its own process, ``parent`` (the folder holding megatron/) first on
    PYTHONPATH and no CPU runtime layer, as a GPU rank imports it; output in ``stdout``."""
    script = tmp_path / "rank_step.py"
    script.write_text(RANK_STEP)
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CPU_RUNTIME"}
    return subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(env, PYTHONPATH=f"{parent}{os.pathsep}{REPO_ROOT}", PYTHONWARNINGS="ignore"))


def built_trees():
    """(label, directory holding megatron/) of every tree setup.sh built on this machine."""
    out = []
    for label in TREES:
        try:
            out.append((label, tree_parent(label)))
        except FileNotFoundError:
            pass
    if CHECKOUTS.is_dir():
        out += [(f"megatron-lm/{d.name}", d) for d in sorted(CHECKOUTS.iterdir())
                if (d / "pretrain_gpt.py").is_file() and not d.name.endswith(".tmp")]
    return out


@pytest.mark.extended
def test_every_tree_passes_the_dataset_helper_step_of_a_gpu_rank(tmp_path):
    trees = built_trees()
    labels = [label for label, _ in trees]
    assert {"pristine-0.17.1", "series-0.17.1", "megatron-lm/core_v0.17.1", "megatron-lm/patched"} <= set(labels), labels
    procs = {label: (parent, rank_step(tmp_path, parent)) for label, parent in trees}
    failures = []
    for label, (parent, proc) in procs.items():
        out, _ = proc.communicate(timeout=300)
        datasets = (parent / "megatron" / "core" / "datasets").resolve()
        if proc.returncode != 0:
            failures.append(f"{label}: exit {proc.returncode}: {out[-1500:]}")
            continue
        got = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
        assert Path(got["utils"]).resolve().parent == datasets, (label, got)
        assert Path(got["helpers_cpp"]).resolve().parent == datasets, (label, got)
        assert "Nothing to be done" in out, f"{label}: make rebuilt the helpers:\n{out[-1500:]}"
    assert not failures, "\n".join(failures)


def test_the_step_still_fails_where_the_helpers_source_changed(tmp_path, label="series-0.19"):
    """make is asked for real: a copy of the tree whose helpers.cpp is newer than its
    helpers_cpp and not compilable here makes the step fail (not a stub that always passes)."""
    import shutil

    src = tree_parent(label) / "megatron" / "core" / "datasets"
    tree = tmp_path / "tree"
    shutil.copytree(tree_parent(label) / "megatron", tree / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cpp = tree / "megatron" / "core" / "datasets" / "helpers.cpp"
    cpp.write_text((src / "helpers.cpp").read_text() + "\n#error changed after the build\n")
    proc = rank_step(tmp_path, tree)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "Failed to compile the C++ dataset helper functions" in out
