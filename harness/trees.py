"""Select the megatron tree a process imports: pristine megatron-core, or it with the series.

scripts/setup.sh materializes four trees from the pinned megatron-core wheels. Their labels
say, per base (a folder of patches/), which of the two a tree is: ``pristine-<base>`` (the
release as published) or ``series-<base>`` (it with patches/<base>/series applied):

    build/upstream/megatron        pristine megatron-core 0.17.1         ("pristine-0.17.1")
    megatron/                      pristine + patches/0.17.1/series      ("series-0.17.1", repo root)
    build/upstream-0.19/megatron   pristine megatron-core 0.19.2         ("pristine-0.19")
    build/patched-0.19/megatron    pristine 0.19.2 + patches/0.19/series ("series-0.19")

The real-shape audit (harness.audit.grid) uses the same labels for these trees and names its
other trees alike (``pristine-0.18.2``; ``-layout`` for a release's layer-wise param layout
path). "upstream", in this repository, is Megatron-LM's own test suite (tests/upstream_tests/);
the build folders keep their older names (build/upstream, build/patched-0.19).

`megatron` is a namespace package (the wheel has no megatron/__init__.py), so the first
entry of sys.path that holds megatron/core wins. The harness therefore puts the chosen
tree's parent first on PYTHONPATH, then the repo root (for our `harness` package). A
child process can verify the choice through MEGATRON_EXPECT_TREE (see
check_expected_tree()).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Tree label -> the directory holding its megatron/ (relative to the repo root).
TREE_PARENTS = {"pristine-0.17.1": "build/upstream", "series-0.17.1": ".", "pristine-0.19": "build/upstream-0.19",
                "series-0.19": "build/patched-0.19"}
TREES = tuple(TREE_PARENTS)
#: Base (a folder of patches/) -> (its pristine tree, its series tree).
BASES = {base: (f"pristine-{base}", f"series-{base}") for base in ("0.17.1", "0.19")}


def is_tree_label(tree) -> bool:
    """Whether ``tree`` is a label tree_parent() takes (one of TREES)."""
    return isinstance(tree, str) and tree in TREES


def tree_parent(tree: Union[str, Path]) -> Path:
    """Directory to put first on PYTHONPATH so that `import megatron.core` gets `tree`.

    Args:
        tree: a label of TREES ("pristine-<base>", "series-<base>"), or a Path to a directory that holds a megatron/ tree (e.g. a
            mutant tree from make_mutant_tree()).

    Raises:
        ValueError: unknown tree name.
        FileNotFoundError: the tree was not generated yet (run scripts/setup.sh).
    """
    if isinstance(tree, Path):
        parent = tree
    elif is_tree_label(tree):
        parent = (REPO_ROOT / TREE_PARENTS[tree]).resolve()
    else:
        raise ValueError(f"unknown tree {tree!r}; expected one of {TREES} or a Path")
    if not (parent / "megatron" / "core" / "__init__.py").is_file():
        raise FileNotFoundError(
            f"{parent / 'megatron'} is missing; run scripts/setup.sh to generate the trees"
        )
    return parent


def env_for_tree(tree: Union[str, Path]) -> Dict[str, str]:
    """Environment for a child process that must import `tree` (see tree_parent()).

    A copy of os.environ with PYTHONPATH set to "<tree parent>:<repo root>" (dropping any
    inherited entries, so that nothing can shadow the choice) and MEGATRON_EXPECT_TREE to
    the tree's megatron directory.
    """
    env = dict(os.environ)
    parent = tree_parent(tree)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(parent), str(REPO_ROOT)]))
    env["MEGATRON_EXPECT_TREE"] = str(parent / "megatron")
    return env


def tree_version(tree: Union[str, Path]) -> Optional[Tuple[int, int, int]]:
    """(MAJOR, MINOR, PATCH) of the megatron-core tree `tree` (a label of TREES or a Path, as
    tree_parent()), read from its megatron/core/package_info.py without importing it; None
    when the file lacks one of those fields.

    Raises:
        ValueError / FileNotFoundError: as tree_parent().
    """
    text = (tree_parent(tree) / "megatron" / "core" / "package_info.py").read_text()
    parts = [re.search(rf"^{key}\s*=\s*(\d+)", text, re.M) for key in ("MAJOR", "MINOR", "PATCH")]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None


def check_expected_tree() -> str:
    """Raise RuntimeError unless megatron.core comes from $MEGATRON_EXPECT_TREE (if set).

    Returns the directory megatron.core was imported from.
    """
    import megatron.core

    got = Path(megatron.core.__file__).resolve().parent.parent
    want = os.environ.get("MEGATRON_EXPECT_TREE")
    if want and got != Path(want).resolve():
        raise RuntimeError(
            f"imported megatron from {got}, expected {want}; check PYTHONPATH "
            "(harness.trees.env_for_tree builds it)"
        )
    return str(got)


def megatron_part(patch_text: str) -> str:
    """The part of a git patch's text that a megatron/ tree takes: the message and the diffs of
    files outside tests/ (a patch's own tests, tests/unit_tests/..., go to checkouts only, as
    scripts/apply_patches.sh leaves them out of any tree that is not a Megatron-LM checkout)."""
    parts = re.split(r"^(?=diff --git )", patch_text, flags=re.M)
    return "".join(p for p in parts if not p.startswith("diff --git a/tests/"))


def _tree_with_patches(base: Path, patches: list, dest: Path) -> Path:
    """Copy base/megatron to dest/megatron and apply the megatron/ part (megatron_part) of
    `patches` in order with ``patch -p1 --fuzz=0``. On failure dest is removed and RuntimeError
    names the patch and quotes patch's output."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(
        base / "megatron", dest / "megatron", ignore=shutil.ignore_patterns("__pycache__")
    )
    for patch in patches:
        patch = Path(patch).resolve()
        proc = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch"],
            input=megatron_part(patch.read_text()),
            cwd=dest,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            shutil.rmtree(dest)
            raise RuntimeError(f"{patch} does not apply: {proc.stdout}{proc.stderr}")
    return dest


def make_mutant_tree(mutant_patch: Path, dest: Path, tree: str = "series-0.17.1") -> Path:
    """Copy `tree` (a label of TREES, by default the 0.17.1 series) to dest/megatron and
    apply a mutant patch on top of it.

    Mutants (tests/mutants/*.patch; tests/mutants/0.19/ for "series-0.19") are deliberate
    bugs used to prove that the tests catch them; they are never part of patches/.

    Returns:
        dest, to pass to env_for_tree().

    Raises:
        RuntimeError: the mutant does not apply cleanly (patch -p1 --fuzz=0), with
            patch's output; dest is removed.
    """
    return _tree_with_patches(tree_parent(tree), [mutant_patch], dest)


def series_patches(base: str) -> list:
    """Patch files of patches/<base>/series, in order (comments and blank lines skipped).

    Args:
        base: a key of BASES.

    Raises:
        ValueError: unknown base.
    """
    if base not in BASES:
        raise ValueError(f"unknown base {base!r}; expected one of {tuple(BASES)}")
    series_dir = REPO_ROOT / "patches" / base
    lines = (series_dir / "series").read_text().splitlines()
    return [series_dir / ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def make_prefix_tree(k: int, dest: Path, base: str) -> Path:
    """Pristine tree of `base` (a key of BASES) plus the first k patches of its series, in
    dest/megatron.

    Used to check that every prefix of the series is correct on its own.

    Returns:
        dest, to pass to env_for_tree().

    Raises:
        ValueError: k outside 0..len(series).
        RuntimeError: a patch does not apply cleanly (patch -p1 --fuzz=0); dest removed.
    """
    patches = series_patches(base=base)
    if not 0 <= k <= len(patches):
        raise ValueError(f"prefix length {k} outside 0..{len(patches)}")
    return _tree_with_patches(tree_parent(BASES[base][0]), patches[:k], dest)
