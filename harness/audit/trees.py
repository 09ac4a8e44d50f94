"""Comparison trees of the real-shape audit, by label (``harness/audit/grid.py``).

| label | tree |
|---|---|
| ``pristine-0.17.1``, ``series-0.17.1`` | the trees of ``harness.trees`` (pristine 0.17.1, and with the series) |
| ``exact_list_slots`` | pristine + ``harness/audit/trees/exact_list_slots.diff``: every bucket receives into ``grad_data`` through a list ``all_gather`` with one exact-size slot per DP rank (the NVIDIA/Megatron-LM#3751 design, with zeroing) |

Comparison trees are not part of ``patches/``; they are rebuilt under ``build/bench/trees``
with ``patch -p1 --fuzz=0`` (harness.trees) whenever their diff's sha256 differs from the one
they were built from.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Union

from harness import trees as _trees

DIFF_DIR = Path(__file__).resolve().parent / "trees"
BUILD_DIR = _trees.REPO_ROOT / "build" / "bench" / "trees"


def comparison_tree(label: str, build_dir: Path = BUILD_DIR) -> Path:
    """Build (if stale) and return the directory holding comparison tree `label`'s megatron/.

    Raises:
        ValueError: no ``harness/audit/trees/<label>.diff``.
        RuntimeError: the diff does not apply to the pristine tree (patch's output quoted).
    """
    diff = DIFF_DIR / f"{label}.diff"
    if not diff.is_file():
        known = sorted(p.stem for p in DIFF_DIR.glob("*.diff"))
        raise ValueError(f"no comparison tree {label!r}; known: {known}")
    dest = Path(build_dir) / label
    stamp = dest / ".built-from"
    key = f"{hashlib.sha256(diff.read_bytes()).hexdigest()} {_trees.tree_parent('pristine-0.17.1')}"
    if not (stamp.is_file() and stamp.read_text() == key):
        # The builder of the prefix and mutant trees.
        _trees._tree_with_patches(_trees.tree_parent("pristine-0.17.1"), [diff], dest)
        stamp.write_text(key)
    return dest


def tree_for(label: str) -> Union[str, Path]:
    """What harness.trees.env_for_tree / harness.launch.torchrun_command take for `label`."""
    if _trees.is_tree_label(label):
        return label
    return comparison_tree(label)
