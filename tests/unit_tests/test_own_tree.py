"""scripts/apply_patches.sh on a tree that is not exactly a base (docs/own_tree.md).

A git checkout of a fork of a base, or of upstream main (the minor version after the newest
base), gets the series by a three-way merge, one commit per patch; a tree the series cannot
serve gets one line and stays as it was. The tests read what they need from the series at test
time (its patch count, subjects, first hunks), so they hold for any version of it.

Trees: most tests use a small repository holding core_v0.19.0's files that the series and the
run read (``mini_019``: the touched files, package_info.py, pretrain_gpt.py, helpers.cpp; a
fork is a local commit on top), which clones and packs in milliseconds where the whole
checkout takes seconds; the script sees the same version, files and blobs. One test takes
upstream main itself, build/megatron-lm/main-d98e8a64dd (scripts/setup.sh: main committed on
top of core_v0.19.0, as a clone of main holds 0.19's blobs). Tests skip where a tree is missing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPLY = str(ROOT / "scripts" / "apply_patches.sh")
MLM = ROOT / "build" / "megatron-lm"
BASE019 = MLM / "core_v0.19.0"
MAIN = MLM / "main-d98e8a64dd"
SERIES019 = ROOT / "patches" / "0.19"

OK, ERROR, NOT_APPLIED, PARTIAL, CANNOT_SERVE, CONFLICT, LACKS_BLOBS = 0, 1, 3, 4, 5, 6, 7

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Own Tree Test", "GIT_AUTHOR_EMAIL": "test@invalid",
    "GIT_COMMITTER_NAME": "Own Tree Test", "GIT_COMMITTER_EMAIL": "test@invalid",
    "GIT_AUTHOR_DATE": "2001-02-03T04:05:06Z", "GIT_COMMITTER_DATE": "2001-02-03T04:05:06Z",
    "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1",
}


def run(*cmd, check=False):
    proc = subprocess.run([str(c) for c in cmd], env={**os.environ, **GIT_ENV}, capture_output=True,
                          text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def git(repo, *args):
    return run("git", "-C", repo, *args, check=True).stdout


def series(patches_dir=SERIES019):
    lines = (patches_dir / "series").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def subject(patch: Path) -> str:
    """The Subject of a format-patch file, unfolded, without [PATCH]."""
    text = patch.read_text()
    m = re.search(r"^Subject: (.*(?:\n[ \t].*)*)", text, re.M)
    return re.sub(r"^\[PATCH[^]]*\] *", "", re.sub(r"\n[ \t]", " ", m.group(1)))


def touched(patches_dir=SERIES019):
    """Every path a patch of the series names."""
    out = set()
    for name in series(patches_dir):
        out |= set(re.findall(r"^diff --git a/(\S+) b/", (patches_dir / name).read_text(), re.M))
    return out


def fingerprint(repo: Path) -> dict:
    """What 'nothing changed' means for a checkout: HEAD, its refs, status, the touched files."""
    out = {"files": {}}
    for f in sorted(touched()):
        p = repo / f
        out["files"][f] = hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None
    if (repo / ".git").exists():
        out["head"] = git(repo, "rev-parse", "HEAD")
        out["refs"] = git(repo, "for-each-ref")
        out["status"] = git(repo, "status", "--porcelain", "--untracked-files=all")
    return out


def clone(src: Path, dest: Path, *args) -> Path:
    if not (src / ".git").is_dir():
        pytest.skip(f"{src} is missing (scripts/setup.sh builds it from ../shared/upstream/)")
    run("git", "clone", "-q", *args, src, dest, check=True)
    return dest


def commit_edit(repo: Path, path: str, old: str, new: str, message: str) -> None:
    p = repo / path
    text = p.read_text()
    assert text.count(old) >= 1, (path, old)
    p.write_text(text.replace(old, new, 1))
    git(repo, "commit", "-q", "-a", "-m", message)


def one_line(proc) -> str:
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, f"expected a one-line error, got:\n{proc.stderr}"
    return err


def refused(repo: Path, args, code: int, *needles) -> str:
    before = fingerprint(repo)
    proc = run(APPLY, repo, *args)
    assert proc.returncode == code, f"exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    msg = one_line(proc)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert fingerprint(repo) == before, "the checkout changed"
    return msg


def first_hunk_line(patch: Path):
    """(file, line) of the first hunk of ``patch``: a line it removes, or else the context line
    just before the first line it adds; a local edit of that line conflicts with the hunk."""
    file, prev = None, None
    for ln in patch.read_text().splitlines():
        if ln.startswith("diff --git a/"):
            file, prev = ln.split()[2][2:], None
        elif ln.startswith("@@ "):
            prev = None
        elif file and ln.startswith("-") and not ln.startswith("---") and ln[1:].strip():
            return file, ln[1:]
        elif file and ln.startswith("+") and not ln.startswith("+++") and prev:
            return file, prev
        elif file and ln.startswith(" ") and ln.strip():
            prev = ln[1:]
    raise AssertionError(f"{patch} has no hunk")


#: What a mini tree copies from core_v0.19.0 besides the touched files.
#: tests/unit_tests/__init__.py: with pretrain_gpt.py, what makes apply_patches.sh treat the tree as
#: a Megatron-LM checkout, so that a patch touching only upstream's tests/unit_tests/ applies too.
MINI_EXTRA = ("megatron/core/package_info.py", "megatron/core/__init__.py", "pretrain_gpt.py",
              "megatron/core/datasets/helpers.cpp", "tests/unit_tests/__init__.py")


def mini_019(tmp_path: Path, name="mini") -> Path:
    """A git repository with one commit: core_v0.19.0's touched files and ``MINI_EXTRA``, bytes
    and blobs as the tag has them (a Megatron-LM tree as far as the series and the run look)."""
    if not (BASE019 / ".git").is_dir():
        pytest.skip(f"{BASE019} is missing (scripts/setup.sh builds it from ../shared/upstream/)")
    repo = tmp_path / name
    for f in sorted(touched() | set(MINI_EXTRA)):
        if (BASE019 / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(BASE019 / f, repo / f)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "core_v0.19.0, the files the series reads")
    git(repo, "tag", "core_v0.19.0")
    return repo


def fork_019(tmp_path: Path, name="fork") -> Path:
    """``mini_019`` with a local commit in a touched file, away from every hunk: a line
    appended to the end of the file no patch's hunk reaches."""
    repo = mini_019(tmp_path, name)
    for f in sorted(touched()):
        text = (repo / f).read_text() if (repo / f).exists() else None
        if text is None:
            continue
        n = len(text.splitlines())
        ends = [int(s) + int(c or 1) for name in series()
                for s, c in re.findall(rf"^@@ -(\d+)(?:,(\d+))? ", _hunks_of((SERIES019 / name).read_text(), f), re.M)]
        if ends and max(ends) < n - 5:
            (repo / f).write_text(text + "\n# a fork's own line\n")
            git(repo, "commit", "-q", "-a", "-m", "fork: a local line in " + f)
            return repo
    pytest.skip("every touched file has a hunk at its end")


def _hunks_of(patch_text: str, path: str) -> str:
    parts = re.split(r"^(?=diff --git )", patch_text, flags=re.M)
    return "".join(p for p in parts if p.startswith(f"diff --git a/{path} "))


# ---------------------------------------------------------------- the series reaches the tree


def test_a_fork_of_the_base_gets_the_series_three_way_one_commit_per_patch(tmp_path):
    repo = fork_019(tmp_path)
    local = git(repo, "rev-parse", "HEAD").strip()
    names = series()
    before = fingerprint(repo)
    proc = run(APPLY, repo, "--check")
    assert proc.returncode == NOT_APPLIED, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"series: {SERIES019} (megatron-core 0.19"), proc.stdout
    for name in names:
        assert re.search(rf"^  {re.escape(name)}: (applies|applies at shifted lines|merges three-way)$",
                         proc.stdout, re.M), proc.stdout
    assert fingerprint(repo) == before, "--check changed the checkout"

    proc = run(APPLY, repo)
    assert proc.returncode == OK, proc.stdout + proc.stderr
    assert f"applied {len(names)} patches three-way" in proc.stdout
    subjects = git(repo, "log", "--format=%s", f"{local}..HEAD").splitlines()[::-1]
    assert subjects == [subject(SERIES019 / n) for n in names]
    assert git(repo, "status", "--porcelain") == ""
    assert "# a fork's own line" in "".join((repo / f).read_text() for f in touched() if (repo / f).exists())
    assert set(git(repo, "diff", "--name-only", local, "HEAD").split()) <= touched()
    assert run(APPLY, repo, "--check").returncode == OK
    head = git(repo, "rev-parse", "HEAD")
    proc = run(APPLY, repo)
    assert proc.returncode == OK and "already applied" in proc.stdout
    assert git(repo, "rev-parse", "HEAD") == head

    proc = run(APPLY, repo, "--reverse")
    assert proc.returncode == OK, proc.stdout + proc.stderr
    assert git(repo, "diff", local, "HEAD") == ""
    assert len(git(repo, "log", "--format=%s", f"{head.strip()}..HEAD").splitlines()) == len(names)
    assert run(APPLY, repo, "--check").returncode == NOT_APPLIED


def test_upstream_main_gets_the_019_series_three_way(tmp_path):
    """Upstream main at d98e8a64dd (0.20.0, committed on core_v0.19.0): the 0.19 series, every
    patch one commit, and the line says which series and why."""
    repo = clone(MAIN, tmp_path / "main", "--shared")
    base = git(repo, "rev-parse", "HEAD").strip()
    names = series()
    proc = run(APPLY, repo)
    assert proc.returncode == OK, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"series: {SERIES019} (megatron-core 0.20.0 is the minor version after 0.19"), first
    assert f"applied {len(names)} patches three-way" in proc.stdout
    subjects = git(repo, "log", "--format=%s", f"{base}..HEAD").splitlines()[::-1]
    assert subjects == [subject(SERIES019 / n) for n in names]
    assert git(repo, "status", "--porcelain") == ""
    assert set(git(repo, "diff", "--name-only", base, "HEAD").split()) <= touched()


# ---------------------------------------------------------------- conflicts: nothing changes


def test_a_local_commit_on_a_hunks_line_conflicts_names_patch_file_hunk_and_changes_nothing(tmp_path):
    """The first patch's first hunk: a local commit edits a line it changes. apply and --check
    stop at that patch, name it, its file and the hunk, and leave HEAD and status as they were."""
    repo = mini_019(tmp_path, "fork")
    first = series()[0]
    path, line = first_hunk_line(SERIES019 / first)
    commit_edit(repo, path, line + "\n", line.rstrip() + "  # a fork's edit\n", "fork: edit a line the series changes")
    hunk = re.search(r"^@@ .*$", _hunks_of((SERIES019 / first).read_text(), path), re.M).group(0)
    for mode in ([], ["--check"]):
        msg = refused(repo, mode, CONFLICT, f"conflict: {first}", path, hunk, "nothing was changed",
                      "git am --continue", "am -3 ")
    proc = run(APPLY, repo, "--check")
    assert re.search(rf"^  {re.escape(first)}: conflicts in {re.escape(path)}, hunk ", proc.stdout, re.M), proc.stdout
    assert "not tried (after the conflict)" in proc.stdout or len(series()) == 1
    assert msg


# ---------------------------------------------------------------- trees the series cannot serve


def test_a_shallow_clone_lacks_the_blobs_says_so_and_how_to_fetch_them(tmp_path):
    fork = fork_019(tmp_path)
    repo = tmp_path / "shallow"
    run("git", "clone", "-q", "--depth", "1", f"file://{fork}", repo, check=True)
    assert git(repo, "rev-parse", "--is-shallow-repository").strip() == "true"
    for mode in ([], ["--check"]):
        refused(repo, mode, LACKS_BLOBS, "lacks the git objects", "shallow clone", "fetch --unshallow",
                "nothing was changed")
    # The advice works: after the fetch, the series goes in.
    git(repo, "fetch", "-q", "--unshallow")
    proc = run(APPLY, repo)
    assert proc.returncode == OK, proc.stdout + proc.stderr


def test_a_checkout_without_history_lacks_the_blobs(tmp_path):
    fork = fork_019(tmp_path)
    repo = tmp_path / "no-history"
    shutil.copytree(fork, repo, ignore=shutil.ignore_patterns(".git"))  # the same files, no history
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a copy without history")
    msg = refused(repo, [], LACKS_BLOBS, "lacks the git objects", "without history",
                  "fetch https://github.com/NVIDIA/Megatron-LM tag core_v0.19.0")
    assert "unshallow" not in msg


def test_a_directory_that_is_not_a_checkout(tmp_path):
    """The minor version after the newest base (upstream main's version), not a git checkout:
    one line, exit 5, nothing changed. (A fork of the base outside git: exit 4, as before.)"""
    fork = fork_019(tmp_path)
    target = tmp_path / "plain"
    shutil.copytree(fork, target, ignore=shutil.ignore_patterns(".git"))
    pinfo = target / "megatron/core/package_info.py"
    pinfo.write_text(re.sub(r"^MINOR = 19$", "MINOR = 20", pinfo.read_text(), flags=re.M))
    for mode in ([], ["--check"]):
        refused(target, mode, CANNOT_SERVE, "0.20", "three-way merge", "not a git checkout", "nothing was changed")
    pinfo.write_text(re.sub(r"^MINOR = 20$", "MINOR = 19", pinfo.read_text(), flags=re.M))
    refused(target, [], PARTIAL, "foreign changes", "three-way")


def test_a_016_era_checkout_is_refused(tmp_path):
    repo = mini_019(tmp_path, "old")
    pinfo = repo / "megatron/core/package_info.py"
    pinfo.write_text(re.sub(r"^MINOR = 19$", "MINOR = 16", pinfo.read_text(), flags=re.M))
    git(repo, "commit", "-q", "-a", "-m", "a 0.16-era tree")
    for mode in ([], ["--check"]):
        refused(repo, mode, CANNOT_SERVE, "megatron-core 0.16", "older than 0.17.1", "update to 0.17.1 first")


def test_two_minor_versions_past_the_newest_base_is_refused(tmp_path):
    repo = mini_019(tmp_path, "far")
    pinfo = repo / "megatron/core/package_info.py"
    pinfo.write_text(re.sub(r"^MINOR = 19$", "MINOR = 21", pinfo.read_text(), flags=re.M))
    git(repo, "commit", "-q", "-a", "-m", "0.21")
    refused(repo, [], CANNOT_SERVE, "megatron-core 0.21")


def test_a_fork_without_the_grad_data_gather_is_refused_by_name(tmp_path):
    """A fork whose layer-wise param sync no longer receives into grad_data: the series builds
    on that gather, so one line names it instead of a conflict."""
    repo = mini_019(tmp_path, "fork")
    pgb = "megatron/core/distributed/param_and_grad_buffer.py"
    text = (repo / pgb).read_text()
    assert "grad_data.view(" in text
    (repo / pgb).write_text(text.replace("grad_data.view(", "grad_data_copy_for_gather("))
    git(repo, "commit", "-q", "-a", "-m", "fork: gather into temporaries")
    for mode in ([], ["--check"]):
        refused(repo, mode, CANNOT_SERVE, "cannot take the series", pgb, "grad_data gather", "nothing was changed")


# ---------------------------------------------------------------- the main job on your own tree


def all_files(repo: Path) -> dict:
    """Every path under repo with its size and mtime (.git included): a write anywhere shows."""
    out = {}
    for p in sorted(repo.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(repo))] = (st.st_size, st.st_mtime_ns, p.is_dir())
    return out


def test_prepare_trains_scratch_clones_and_never_writes_the_checkout(tmp_path):
    """--checkout's trees: PATH's HEAD as it is and with the series (one commit per patch), in
    two clones with the dataset helpers a rank imports; PATH itself unchanged to the byte and
    the mtime, .git included. A second prepare reuses the clones."""
    from harness import own_tree

    fork = fork_019(tmp_path)
    before = all_files(fork)
    logs = []
    tree = own_tree.prepare(fork, work_root=tmp_path / "work", log=logs.append)
    assert all_files(fork) == before, "PATH was written"
    head = git(fork, "rev-parse", "HEAD").strip()
    assert (tree.head, tree.version, tree.series, tree.base, tree.release) == (head, "0.19.1", SERIES019, "0.19", False)
    assert "three-way" in tree.why
    assert git(tree.pristine_clone, "rev-parse", "HEAD").strip() == head
    subjects = git(tree.series_clone, "log", "--format=%s", f"{head}..HEAD").splitlines()[::-1]
    assert subjects == [subject(SERIES019 / n) for n in series()]
    for clone in (tree.pristine_clone, tree.series_clone):
        assert git(clone, "status", "--porcelain") == ""
        assert (clone / "pretrain_gpt.py").read_bytes() == (fork / "pretrain_gpt.py").read_bytes()
        if (ROOT / "build/upstream-0.19/megatron/core/datasets").is_dir():
            assert list((clone / "megatron/core/datasets").glob("helpers_cpp*.so")), clone
    again = own_tree.prepare(fork, work_root=tmp_path / "work", log=logs.append)
    assert again == tree and "up to date" in logs[-1]


def test_prepare_of_a_release_checkout_counts_the_golden_values(tmp_path):
    from harness import own_tree

    repo = mini_019(tmp_path, "release")
    tree = own_tree.prepare(repo, work_root=tmp_path / "work", log=lambda m: None)
    assert tree.release and tree.why == "" and tree.series == SERIES019
    assert len(git(tree.series_clone, "log", "--format=%s", "core_v0.19.0..HEAD").splitlines()) == len(series())


def _fake_tree(root: Path, minor: int, git_init: bool) -> Path:
    """A tiny Megatron-LM-shaped tree: package_info.py and pretrain_gpt.py only."""
    (root / "megatron/core").mkdir(parents=True)
    (root / "megatron/core/package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\n")
    (root / "pretrain_gpt.py").write_text("")
    if git_init:
        git(root, "init", "-q", "-b", "main")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "tree")
    return root


def test_run_functional_test_checkout_refuses_what_it_cannot_train_in_one_line(tmp_path, capsys):
    """scripts/run_functional_test.sh --checkout PATH: exit 2 and one line, before training and
    with PATH unchanged, for a missing path, a file, an empty directory, a non-git tree, a dirty
    checkout, a tree the series cannot serve (apply_patches.sh's reason), a case of another base,
    and --update-golden."""
    from tests.functional_tests.python_test_utils import run_case

    def refuse(args, *needles, path=None):
        before = all_files(path) if path else None
        assert run_case.main(["--checkout", *map(str, args)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        for n in needles:
            assert n in err, (n, err)
        if path:
            assert all_files(path) == before, "PATH changed"

    refuse([tmp_path / "nope"], "does not exist")
    plain = _fake_tree(tmp_path / "plain", 19, git_init=False)
    refuse([plain], "not a git checkout", path=plain)
    old = _fake_tree(tmp_path / "old", 16, git_init=True)
    refuse([old], "the series cannot be applied", "megatron-core 0.16", path=old)
    fork = fork_019(tmp_path)
    (fork / "pretrain_gpt.py").write_text((fork / "pretrain_gpt.py").read_text() + "# wip\n")
    refuse([fork], "uncommitted changes", "pretrain_gpt.py", path=fork)
    git(fork, "checkout", "-q", "--", "pretrain_gpt.py")
    refuse([fork, "gpt_dp2_bf16_fp32grad_overlap_layerwise"], "not cases of megatron-core 0.19")
    refuse([fork, "--update-golden"], "--update-golden")
    empty = tmp_path / "empty"
    empty.mkdir()
    refuse([empty], "is an empty directory", "Megatron-LM git checkout", path=empty)
    refuse([tmp_path / "nope"], "does not exist", "Megatron-LM git checkout")
    (tmp_path / "file").write_text("x")
    refuse([tmp_path / "file"], "is not a directory", "Megatron-LM git checkout")


def _resolve_by_hand(path: Path) -> None:
    """Resolve every conflict block of ``path`` as a user may: the patch's side, and a comment
    line of the user's own after it (so the result is neither the base's nor the series' file)."""
    out, side = [], None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("<<<<<<< "):
            side = "ours"
        elif side and line.startswith("||||||| "):
            side = "base"
        elif side and line.startswith("======="):
            side = "theirs"
        elif side and line.startswith(">>>>>>> "):
            side = None
            out.append("# resolved by hand\n")
        elif side in (None, "theirs"):
            out.append(line)
    path.write_text("".join(out))


def test_prepare_of_a_checkout_that_carries_the_series_compares_it_with_the_commit_before_it(tmp_path):
    """README's order taken literally: apply_patches.sh PATH, then --checkout PATH. A fork whose
    local commit conflicts with the first patch gets the series by hand, as the exit-6 line says
    (git am -3, resolve, git am --continue, the rest); --checkout accepts it and compares HEAD, the
    hand-resolved commits included, with the parent of the first series commit, applying nothing;
    PATH stays unchanged. (On that parent the series conflicts, so applying it there cannot work.)"""
    from harness import own_tree

    repo = mini_019(tmp_path, "fork")
    names = series()
    path, line = first_hunk_line(SERIES019 / names[0])
    commit_edit(repo, path, line + "\n", line.rstrip() + "  # a fork's edit\n", "fork: edit a line the series changes")
    pre = git(repo, "rev-parse", "HEAD").strip()
    assert run(APPLY, repo, "--check").returncode == CONFLICT
    with pytest.raises(own_tree.OwnTreeError, match="conflict"):
        own_tree.prepare(repo, work_root=tmp_path / "work0", log=lambda m: None)

    am = run("git", "-C", repo, "am", "-3", SERIES019 / names[0])
    assert am.returncode != 0, am.stdout + am.stderr
    unmerged = git(repo, "diff", "--name-only", "--diff-filter=U").split()
    assert path in unmerged, unmerged
    for f in unmerged:
        _resolve_by_hand(repo / f)
        git(repo, "add", f)
    git(repo, "am", "--continue")
    if names[1:]:
        git(repo, "am", "-3", *[SERIES019 / n for n in names[1:]])
    head = git(repo, "rev-parse", "HEAD").strip()
    assert run(APPLY, repo, "--check").returncode == OK

    before = all_files(repo)
    logs = []
    tree = own_tree.prepare(repo, work_root=tmp_path / "work", log=logs.append)
    assert all_files(repo) == before, "PATH was written"
    assert (tree.head, tree.pre_series, tree.series, tree.release) == (head, pre, SERIES019, False)
    assert len(tree.series_commits) == len(names) and tree.series_commits[-1] == head
    assert git(tree.pristine_clone, "rev-parse", "HEAD").strip() == pre
    assert git(tree.series_clone, "rev-parse", "HEAD").strip() == head  # nothing applied on top
    assert git(tree.series_clone, "diff", "--stat", head) == ""
    assert "comparing HEAD" in tree.apply_log and pre[:10] in tree.apply_log
    assert any("carries patches/0.19" in m for m in logs), logs
    assert tree.tree_labels()["pristine"].endswith("(before the series)")
    again = own_tree.prepare(repo, work_root=tmp_path / "work", log=logs.append)
    assert again == tree and "up to date" in logs[-1]


def test_prepare_of_a_release_that_carries_the_series_counts_the_golden_values(tmp_path):
    """apply_patches.sh on core_v0.19.0 (git am, one commit per patch), then --checkout: the
    release is the commit before the series, so the golden values count."""
    from harness import own_tree

    repo = mini_019(tmp_path, "release")
    tag = git(repo, "rev-parse", "HEAD").strip()
    run(APPLY, repo, check=True)
    tree = own_tree.prepare(repo, work_root=tmp_path / "work", log=lambda m: None)
    assert (tree.pre_series, tree.release, len(tree.series_commits)) == (tag, True, len(series()))


def test_prepare_refuses_a_series_it_cannot_find_as_commits(tmp_path):
    """The series' files committed as one squashed commit: the commit before it is unknown."""
    from harness import own_tree

    repo = mini_019(tmp_path, "squashed")
    run(APPLY, repo, check=True)
    git(repo, "reset", "-q", "--soft", "core_v0.19.0")
    git(repo, "commit", "-q", "-m", "the series, squashed")
    with pytest.raises(own_tree.OwnTreeError, match="no commit with the subject of"):
        own_tree.prepare(repo, work_root=tmp_path / "work", log=lambda m: None)


def test_golden_values_are_information_only_where_the_tree_is_not_a_release():
    from tests.functional_tests.python_test_utils.run_case import golden_for_information

    base = {"case": "c", "first_divergent_step": None, "metrics": {}, "golden_file": "g.json"}
    outside = {**base, "verdict": "outside_golden", "verdict_line": "outside golden tolerance",
               "failures": ["series: lm loss: step 6 off"], "golden_failures": ["series: lm loss: step 6 off"]}
    got = golden_for_information(outside)
    assert (got["verdict"], got["verdict_line"], got["failures"]) == ("identical", "identical", [])
    assert got["golden_findings"] == ["series: lm loss: step 6 off"] and "for information" in got["golden_note"]
    same = golden_for_information({**base, "verdict": "identical", "verdict_line": "identical",
                                   "failures": [], "golden_failures": []})
    assert same["verdict"] == "identical" and "within the golden tolerance" in same["golden_note"]
    for verdict in ("diverged", "failed"):
        bad = {**base, "verdict": verdict, "verdict_line": verdict, "failures": ["x"], "golden_failures": []}
        assert golden_for_information(bad) == bad


def test_gpu_check_plan_on_a_checkout_trains_its_clones(tmp_path):
    """scripts/gpu_check.sh --checkout PATH: the functional runs of the series' base launch the
    two clones (each its own tree and pretrain_gpt.py) and their drivers get --checkout; the
    runs of the pinned 0.17.1 trees are planned as skipped, saying why."""
    from harness import own_tree
    from harness.gpu_check import plan as plan_mod

    tree = own_tree.prepare(fork_019(tmp_path), work_root=tmp_path / "work", log=lambda m: None)
    plan = plan_mod.make_plan(1, "NVIDIA H200", tmp_path / "out", with_te=False, own=tree)
    ran = [r for r in plan.runs if not r.skip_reason]
    assert ran and all(r.base == "0.19" and r.kind == "functional" for r in ran)
    for r in ran:
        assert [x.env["MEGATRON_LM_CHECKOUT"] for x in r.launches] == [str(tree.pristine_clone), str(tree.series_clone)]
        assert [x.env["PYTHONPATH"].split(os.pathsep)[0] for x in r.launches] == [str(tree.pristine_clone), str(tree.series_clone)]
        assert plan_mod.functional_command(r, plan)[-2:] == ["--checkout", str(tree.source)]
    skipped = [r for r in plan.runs if r.skip_reason]
    assert skipped and all(r.base == "0.17.1" and not r.launches and "--checkout" in r.skip_reason for r in skipped)
    assert {r.name for r in ran} == {r.name for r in plan_mod.make_plan(1, "NVIDIA H200", tmp_path / "o2", with_te=False).runs
                                     if r.base == "0.19"}


def test_upstream_tests_of_an_own_tree_are_the_files_and_tests_it_has(tmp_path):
    """upstream_runner --checkout: FILES_OWN_019 as far as the tree has them; a missing file or
    test function is left out (it would count as a failure on both trees)."""
    from tests.upstream_tests import upstream_runner as ur

    tree = tmp_path / "t"
    (tree / "tests/unit_tests/distributed").mkdir(parents=True)
    (tree / "tests/unit_tests/distributed/test_param_and_grad_buffer.py").write_text("def test_x():\n    pass\n")
    (tree / "tests/unit_tests/test_emerging_optimizers.py").write_text(
        "class TestMuonOptimizerMultiRank:\n    def test_get_megatron_optimizer_layer_wise(self):\n        pass\n")
    got = ur.own_files(tree, "0.19")
    assert got == ["tests/unit_tests/distributed/test_param_and_grad_buffer.py",
                   "tests/unit_tests/test_emerging_optimizers.py::TestMuonOptimizerMultiRank::"
                   "test_get_megatron_optimizer_layer_wise"]
    if (MAIN / ".git").is_dir():
        assert ur.own_files(MAIN, "0.19") == list(ur.FILES_OWN_019)


def test_an_own_tree_with_the_series_runs_the_series_own_tests_on_the_series_side(tmp_path):
    """The series clone has the series' own tests (each patch adds its own), the tree as it
    is does not: they run on the series side only, and the table says so."""
    from tests.upstream_tests import upstream_runner as ur

    upstream, patched = tmp_path / "u", tmp_path / "p"
    for tree in (upstream, patched):
        (tree / "tests/unit_tests/distributed").mkdir(parents=True)
        (tree / "tests/unit_tests/distributed/test_param_and_grad_buffer.py").write_text("def test_x():\n    pass\n")
    (patched / ur.SERIES_TESTS).write_text("def test_y():\n    pass\n")
    pri, pat = ur.own_run_files(upstream, patched, "0.19")
    assert pri == ["tests/unit_tests/distributed/test_param_and_grad_buffer.py"]
    assert pat == [*pri, ur.SERIES_TESTS]
    runs = [ur.Run(tree=t, nproc=2, files=f, results={f"{x}::test_{t}": "passed" for x in f})
            for t, f in (("pristine", pri), ("series", pat))]
    rows = ur.own_table(*runs).splitlines()[2:]
    assert rows[-1] == "| `distributed/test_layer_wise_param_gather.py` | 2 | not in the tree | 1 / 0 / 0 |"
    assert ur.new_test_failures(*runs) == []
    runs[1].results[f"{ur.SERIES_TESTS}::test_series"] = "failed"
    assert ur.new_test_failures(*runs) == [f"{ur.SERIES_TESTS}::test_series: failed"]
