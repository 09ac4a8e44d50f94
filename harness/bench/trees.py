"""The megatron trees the bench compares, by label.

| label | tree |
|---|---|
| ``upstream`` | pristine megatron-core 0.17.1 (``build/upstream``) |
| ``exact_list_slots`` | pristine + ``harness/bench/trees/exact_list_slots.diff``: every bucket receives into ``grad_data`` through a list ``all_gather`` with one exact-size slot per DP rank (the NVIDIA/Megatron-LM#3751 design, with zeroing) |
| ``patched`` | pristine + ``patches/0.17.1/series`` (``megatron/`` at the repo root) |
| ``mcore_0.19`` | megatron-core 0.19.2 from PyPI (anchor: its full_param_layout path), optional |

The anchor tree is the 0.19.2 wheel (``pip download --no-deps``, sha256 pinned below),
unzipped under ``build/bench/trees``; it runs on the same torch (it requires torch>=2.6)
and needs nothing else that the 0.17.1 tree does not. Comparison trees are not part of
``patches/``; they are rebuilt under ``build/bench/trees``
with ``patch -p1 --fuzz=0`` (harness.trees) whenever their diff's sha256 differs from the one they were built from.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, Union

from harness import trees as _trees

DIFF_DIR = Path(__file__).resolve().parent / "trees"
BUILD_DIR = _trees.REPO_ROOT / "build" / "bench" / "trees"
#: Labels in the order tables show them.
BENCH_TREES = ("upstream", "exact_list_slots", "patched")


def comparison_tree(label: str, build_dir: Path = BUILD_DIR) -> Path:
    """Build (if stale) and return the directory holding comparison tree `label`'s megatron/.

    Raises:
        ValueError: no ``harness/bench/trees/<label>.diff``.
        RuntimeError: the diff does not apply to the pristine tree (patch's output quoted).
    """
    diff = DIFF_DIR / f"{label}.diff"
    if not diff.is_file():
        known = sorted(p.stem for p in DIFF_DIR.glob("*.diff"))
        raise ValueError(f"no comparison tree {label!r}; known: {known}")
    dest = Path(build_dir) / label
    stamp = dest / ".built-from"
    key = f"{hashlib.sha256(diff.read_bytes()).hexdigest()} {_trees.tree_parent('upstream')}"
    if not (stamp.is_file() and stamp.read_text() == key):
        # The builder of the prefix and mutant trees.
        _trees._tree_with_patches(_trees.tree_parent("upstream"), [diff], dest)
        stamp.write_text(key)
    return dest


#: label -> (pip requirement, sha256 of the wheel) of the optional anchor trees.
ANCHORS = {
    "mcore_0.19": (
        "megatron-core==0.19.2",
        "8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5",
    ),
}


def anchor_tree(label: str, build_dir: Path = BUILD_DIR) -> Path:
    """Download (pip, --no-deps), verify and unzip anchor `label`'s wheel once; its dir.

    Raises:
        ValueError: unknown anchor.
        RuntimeError: pip fails, or the wheel's sha256 is not the pinned one.
    """
    if label not in ANCHORS:
        raise ValueError(f"no anchor tree {label!r}; known: {sorted(ANCHORS)}")
    requirement, sha = ANCHORS[label]
    dest = Path(build_dir) / label
    stamp = dest / ".built-from"
    if stamp.is_file() and stamp.read_text() == sha:
        return dest
    wheels = _trees.REPO_ROOT / "build" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "-d", str(wheels), requirement], capture_output=True, text=True)  # fmt: skip
    name = requirement.split("==")[0].replace("-", "_") + "-" + requirement.split("==")[1] + "-"
    found = [w for w in wheels.glob(name + "*.whl")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"pip download {requirement} failed: {proc.stdout}{proc.stderr}")
    got = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if got != sha:
        raise RuntimeError(f"{found[0]}: sha256 {got}, expected {sha}")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("megatron/")])
    stamp.write_text(sha)
    return dest


def tree_for(label: str) -> Union[str, Path]:
    """What harness.trees.env_for_tree / harness.launch.torchrun_command take for `label`."""
    if label in _trees.TREES:
        return label
    if label in ANCHORS:
        return anchor_tree(label)
    return comparison_tree(label)


def all_trees(labels=BENCH_TREES) -> Dict[str, Union[str, Path]]:
    """{label: tree} for every label, building the comparison trees first."""
    return {label: tree_for(label) for label in labels}
