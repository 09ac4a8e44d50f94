"""A user's own Megatron-LM checkout, as it is and with the series, in scratch clones.

``scripts/run_functional_test.sh --checkout PATH`` (and ``scripts/gpu_check.sh --checkout
PATH``) train the tree a user runs, not one this repository pins: a fork of a base, or upstream
main (docs/own_tree.md). ``prepare(PATH)`` makes two clones of PATH's HEAD under
``build/checkouts/<name>-<commit>/``:

    pristine/   PATH's HEAD as it is
    series/     the same + the series, by ``scripts/apply_patches.sh`` (three-way where PATH is
                not exactly a base: one commit per patch)

Both are ``git clone --shared`` (PATH's objects are borrowed, not copied) with PATH's own
``pretrain_gpt.py``, ``megatron/training`` and ``megatron/core``. PATH itself is never written:
no worktree, no ref, no ``__pycache__`` (nothing is imported from it). Each clone gets the
dataset helpers a training rank needs, as ``scripts/setup.sh`` gives its checkouts
(``place_helpers``): the prebuilt ``helpers_cpp`` of the base's wheel where ``helpers.cpp`` is
byte-identical to the wheel's, and the wheel tree's ``GNUmakefile`` (GPU ranks run ``make``).

Which series, and whether PATH is a release: from ``scripts/apply_patches.sh PATH --check``,
which picks the series by PATH's version and says why (its first line, ``series: DIR (...)``,
when PATH is not exactly a base). A tree the series cannot serve raises ``OwnTreeError`` with
that script's one line.

A PATH that already carries the series (``apply_patches.sh PATH`` ran, or the user merged it by
hand after a conflict: ``git am -3``, resolve, ``git am --continue``) is compared with the
commit before the series instead: ``series_commits`` finds the series' commits in HEAD's
history by their subjects, as apply_patches.sh's "applied" check does (the newest commit with
each patch's subject, unless a revert of it is newer), and ``pristine/`` is a clone at the
parent of the oldest of them, ``series/`` a clone at HEAD, with no patch applied: what PATH
runs, hand-resolved hunks included, against what it ran before the series.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from harness.trees import REPO_ROOT

APPLY = REPO_ROOT / "scripts" / "apply_patches.sh"
WORK_ROOT = REPO_ROOT / "build" / "checkouts"
#: Series folder name (patches/<name>) -> the wheel tree setup.sh extracts for that base: its
#: prebuilt dataset helpers and GNUmakefile serve a clone whose helpers.cpp is the same.
WHEEL_TREES = {"0.17.1": REPO_ROOT / "build" / "upstream", "0.19": REPO_ROOT / "build" / "upstream-0.19"}
#: What the two clones are made from, for the stamp that lets a rerun reuse them.
_STAMP = ".own_tree_stamp"


class OwnTreeError(RuntimeError):
    """PATH cannot be trained with the series: the message says why and what to do."""


@dataclass(frozen=True)
class OwnTree:
    """PATH and its two scratch clones.

    Attributes:
        source: the user's checkout (never written).
        head: its HEAD commit.
        version: its megatron-core MAJOR.MINOR.PATCH.
        series: the series folder (patches/<name>).
        release: PATH is exactly a base (its touched files are the base's): golden values count;
            otherwise they are shown for information.
        why: apply_patches.sh's line on the series choice ("" for a release).
        pristine_clone, series_clone: the clones (``pristine/``, ``series/``).
        apply_log: what apply_patches.sh printed when it made ``series/`` (for a PATH that
            carries the series: the line that names its commits).
        pre_series: where PATH carries the series, the commit before it (the parent of the
            oldest series commit), which ``pristine/`` holds; None where ``series/`` is PATH's
            HEAD + the series applied by apply_patches.sh.
        series_commits: where PATH carries the series, its commits, oldest first.
    """

    source: Path
    head: str
    version: str
    series: Path
    release: bool
    why: str
    pristine_clone: Path
    series_clone: Path
    apply_log: str
    pre_series: Optional[str] = None
    series_commits: Tuple[str, ...] = ()

    @property
    def base(self) -> str:
        """The functional cases' BASE of the series: its folder name (patches/<base>)."""
        return self.series.name

    @property
    def label(self) -> str:
        """"<name> at <commit>", for titles and headers."""
        return f"{self.source.name} at {self.head[:10]}"

    def checkouts(self) -> Dict[str, Path]:
        """The functional runner's variant ("pristine", "series") -> its clone."""
        return {"pristine": self.pristine_clone, "series": self.series_clone}

    def tree_labels(self) -> Dict[str, str]:
        """What each clone is, for titles: PATH's HEAD and HEAD + the series, or, where PATH
        carries the series, the commit before it and HEAD."""
        if self.pre_series:
            return {"pristine": f"{self.source.name} at {self.pre_series[:10]} (before the series)",
                    "series": f"{self.label} (with patches/{self.series.name}, {len(self.series_commits)} commits)"}
        return {"pristine": self.label, "series": f"{self.label} + patches/{self.series.name}"}


def _git(*args, cwd: Optional[Path] = None, check: bool = True, text: bool = True) -> subprocess.CompletedProcess:
    """``git ARGS`` in ``cwd``, output captured (bytes with ``text=False``); OwnTreeError on failure if ``check``."""
    # GIT_OPTIONAL_LOCKS=0: git status must not refresh PATH's index (PATH is never written)
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C", "GIT_OPTIONAL_LOCKS": "0"}
    proc = subprocess.run(["git", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=text)
    if check and proc.returncode != 0:
        raise OwnTreeError(f"git {' '.join(map(str, args))} failed: {proc.stderr.strip()}")
    return proc


def version_of(tree: Path) -> Optional[str]:
    """MAJOR.MINOR.PATCH of ``tree/megatron/core/package_info.py``, None without one."""
    try:
        text = (tree / "megatron" / "core" / "package_info.py").read_text()
    except OSError:
        return None
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def _series_for_version(version: str) -> Optional[Path]:
    """The patches/<name> folder whose manifest names ``version`` (base or also)."""
    for manifest in sorted((REPO_ROOT / "patches").glob("*/manifest.sha256")):
        for line in manifest.read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in ("base", "also") and version in fields[1:]:
                return manifest.parent
    return None


#: What --checkout PATH must be, for the one line a wrong path gets.
EXPECTED = "pass the top level of a Megatron-LM git checkout (a clone of github.com/NVIDIA/Megatron-LM or of a fork)"


def check_source(path: Path) -> tuple:
    """``(path, head, version)`` of a checkout the runner can train, or OwnTreeError."""
    path = Path(path).expanduser()
    if not path.exists():
        raise OwnTreeError(f"--checkout PATH '{path}' does not exist: {EXPECTED}")
    path = path.resolve()
    if not path.is_dir():
        raise OwnTreeError(f"--checkout PATH '{path}' is not a directory: {EXPECTED}")
    if not any(path.iterdir()):
        raise OwnTreeError(f"--checkout PATH '{path}' is an empty directory: {EXPECTED}")
    version = version_of(path)
    if version is None or not (path / "pretrain_gpt.py").is_file():
        raise OwnTreeError(
            f"--checkout PATH '{path}' is not a Megatron-LM tree (it needs megatron/core/package_info.py with "
            f"MAJOR, MINOR, PATCH and pretrain_gpt.py): {EXPECTED}")
    top = _git("rev-parse", "--show-toplevel", cwd=path, check=False)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != path:
        raise OwnTreeError(
            f"--checkout {path}: not a git checkout (or not its top level); the run trains its HEAD "
            "in scratch clones and reaches a tree that is not a base by a three-way merge, both in git. "
            "Clone Megatron-LM, check out the commit this tree came from, and pass the clone")
    head = _git("rev-parse", "-q", "--verify", "HEAD^{commit}", cwd=path, check=False).stdout.strip()
    if not head:
        raise OwnTreeError(f"--checkout {path}: the repository has no commit yet")
    dirty = [ln for ln in _git("status", "--porcelain", "--untracked-files=no", cwd=path).stdout.splitlines() if ln]
    if dirty:
        files = " ".join(line[3:] for line in dirty[:5])
        raise OwnTreeError(
            f"--checkout {path} has uncommitted changes to tracked files ({files}{' ...' if len(dirty) > 5 else ''}): "
            "the run trains its HEAD; commit or stash them, then rerun")
    return path, head, version


def _subject(patch: Path) -> str:
    """The Subject of a format-patch file, unfolded, without [PATCH] (apply_patches.sh's subject_of)."""
    m = re.search(r"^Subject: (.*(?:\n[ \t].*)*)", patch.read_text(), re.M)
    return re.sub(r"^\[PATCH[^]]*\] *", "", re.sub(r"\n([ \t])", r"\1", m.group(1))) if m else ""


def _series_patches(series: Path) -> List[Path]:
    names = [ln.strip() for ln in (series / "series").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    return [series / n for n in names]


def series_commits(source: Path, head: str, series: Path) -> Tuple[str, List[str]]:
    """``(pre_series, commits)`` of a checkout that carries ``series``: its commits in HEAD's
    history (by subject, as apply_patches.sh finds them: the newest commit with each patch's
    subject, unless a revert of it is newer), oldest first, and the first parent of the oldest.

    Raises:
        OwnTreeError: a patch has no such commit (the series came in as one squashed commit, or
            as files), or the oldest one is a root commit.
    """
    patches = _series_patches(series)
    touched = sorted({f for p in patches for f in re.findall(r"^diff --git a/(\S+) b/", p.read_text(), re.M)})
    log = _git("log", "--format=%H %s", "-n", "5000", head, "--", *touched, cwd=source).stdout.splitlines()
    found, missing = {}, []
    for p in patches:
        s = _subject(p)
        for line in log:
            sha, _, subj = line.partition(" ")
            if subj == f'Revert "{s}"':
                break
            if subj == s:
                found[p.name] = sha
                break
        if p.name not in found:
            missing.append(p.name)
    if missing:
        raise OwnTreeError(
            f"--checkout {source} carries the series (scripts/apply_patches.sh --check says applied) but HEAD's "
            f"history has no commit with the subject of {', '.join(missing)}, so the commit before the series is "
            "unknown (a squashed or file-copied series): check out the commit before the series and pass that "
            "(the run applies the series itself), or keep one commit per patch with the patches' subjects")
    order = _git("rev-list", "--topo-order", "--reverse", head, cwd=source).stdout.split()
    rank = {sha: i for i, sha in enumerate(order)}
    commits = sorted(set(found.values()), key=lambda sha: rank[sha])
    pre = _git("rev-parse", "-q", "--verify", f"{commits[0]}^1", cwd=source, check=False).stdout.strip()
    if not pre:
        raise OwnTreeError(f"--checkout {source}: the series' first commit {commits[0][:12]} has no parent, "
                           "so there is no tree before the series to compare with")
    return pre, commits


def is_release(source: Path, commit: str, series: Path) -> bool:
    """``commit`` of ``source`` is exactly a base of ``series``: its megatron-core version is the
    manifest's ``base`` or ``also`` and every touched file has the manifest's pristine sha256
    (absent where the manifest says '-'), as apply_patches.sh judges a tree it applies to exactly."""
    manifest = [ln.split() for ln in (series / "manifest.sha256").read_text().splitlines()]
    versions = {v for f in manifest if f and f[0] in ("base", "also") for v in f[1:]}
    pinfo = _git("show", f"{commit}:megatron/core/package_info.py", cwd=source, check=False).stdout
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", pinfo, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts) or ".".join(m.group(1) for m in parts) not in versions:
        return False
    for f in manifest:
        if not f or f[0] != "file":
            continue
        blob = _git("show", f"{commit}:{f[3]}", cwd=source, check=False, text=False)
        got = hashlib.sha256(blob.stdout).hexdigest() if blob.returncode == 0 else "-"
        if got != f[1]:
            return False
    return True


def _apply(target: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(APPLY), str(target), *args], capture_output=True, text=True,
                          env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_OPTIONAL_LOCKS": "0"})


def _stamp(head: str) -> str:
    h = hashlib.sha256()
    h.update(head.encode())
    h.update(APPLY.read_bytes())
    for p in sorted((REPO_ROOT / "patches").rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _clone(source: Path, head: str, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    _git("clone", "-q", "--shared", "--no-checkout", source, dest)
    _git("-c", "advice.detachedHead=false", "checkout", "-q", "--detach", head, cwd=dest)
    _git("config", "user.name", "megatron-layerwise-ag own tree", cwd=dest)
    _git("config", "user.email", "own-tree@invalid", cwd=dest)


def place_helpers(clone: Path, series: Path) -> None:
    """The dataset helpers of ``series``' wheel tree in ``clone`` (see the module docstring)."""
    wheel = WHEEL_TREES.get(series.name)
    dest = clone / "megatron" / "core" / "datasets"
    if wheel is None or not (wheel / "megatron" / "core" / "datasets").is_dir():
        return
    src = wheel / "megatron" / "core" / "datasets"
    if (dest / "helpers.cpp").is_file() and (src / "helpers.cpp").read_bytes() == (dest / "helpers.cpp").read_bytes():
        for so in src.glob("helpers_cpp*.so"):
            if not (dest / so.name).exists():
                shutil.copy2(so, dest / so.name)
    if (src / "GNUmakefile").is_file():
        shutil.copy2(src / "GNUmakefile", dest / "GNUmakefile")
    exclude = clone / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    for pattern in ("/megatron/core/datasets/GNUmakefile", "/megatron/core/datasets/helpers_cpp*.so"):
        if pattern not in lines:
            lines.append(pattern)
    exclude.write_text("\n".join(lines) + "\n")


def prepare(checkout: Path, work_root: Path = WORK_ROOT, log=print) -> OwnTree:
    """Check ``checkout`` and make (or reuse) its two scratch clones.

    Raises:
        OwnTreeError: not a clean git checkout of a Megatron-LM tree; a tree the series cannot
            serve, a conflict or missing blobs (apply_patches.sh's line); a tree that carries the
            series without one commit per patch (``series_commits``).
    """
    source, head, version = check_source(checkout)
    check = _apply(source, "--check")
    lines = check.stdout.splitlines()
    m = re.match(r"series: (\S+) \((.*)\)$", lines[0]) if lines else None
    if check.returncode not in (0, 3):
        why = check.stderr.strip().removeprefix("apply_patches.sh: error: ")
        raise OwnTreeError(f"--checkout {source}: the series cannot be applied: {why}")
    series = Path(m.group(1)) if m else _series_for_version(version)
    if series is None:
        raise OwnTreeError(f"--checkout {source}: no series here names megatron-core {version}")
    why = m.group(2) if m else ""
    release = "three-way" not in why
    pre, commits = series_commits(source, head, series) if check.returncode == 0 else (None, [])
    if pre:  # the golden values count where the tree before the series is a release
        release = is_release(source, pre, series)
    work = work_root / f"{source.name}-{head[:12]}"
    pristine, with_series = work / "pristine", work / "series"
    stamp = _stamp(head)
    apply_log = ""
    if pre:
        stamp = _stamp(f"{pre}..{head}")
        others = [c for c in _git("rev-list", f"{pre}..{head}", cwd=source).stdout.split() if c not in commits]
        apply_log = (f"carries patches/{series.name}: {len(commits)} commits {commits[0][:10]}..{commits[-1][:10]}; "
                     f"comparing HEAD {head[:10]} with the commit before the series, {pre[:10]}"
                     + (f" ({len(others)} other commits lie between them and are on the series side only)"
                        if others else "") + "\n")
        log(f"  {source} {apply_log.strip()}")
    if (work / _STAMP).is_file() and (work / _STAMP).read_text().split("\n", 1)[0] == stamp \
            and (pristine / ".git").is_dir() and (with_series / ".git").is_dir():
        apply_log = (work / _STAMP).read_text().split("\n", 1)[1]
        log(f"  scratch clones of {source} at {head[:10]} up to date: {work}")
    else:
        log(f"  scratch clones of {source} at {head[:10]}: {work}/{{pristine,series}}")
        work.mkdir(parents=True, exist_ok=True)
        (work / _STAMP).unlink(missing_ok=True)
        _clone(source, pre or head, pristine)
        _clone(source, head, with_series)
        if not pre:
            proc = _apply(with_series)
            if proc.returncode != 0:
                raise OwnTreeError(f"--checkout {source}: apply_patches.sh failed on the scratch clone {with_series}: "
                                   f"{proc.stderr.strip()}")
            apply_log = proc.stdout
        for clone in (pristine, with_series):
            place_helpers(clone, series)
        (work / _STAMP).write_text(stamp + "\n" + apply_log)
    return OwnTree(source=source, head=head, version=version, series=series, release=release, why=why,
                   pristine_clone=pristine, series_clone=with_series, apply_log=apply_log, pre_series=pre,
                   series_commits=tuple(commits))
