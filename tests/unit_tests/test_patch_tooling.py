"""Tests of the patch tooling: scripts/refresh_patches.sh, apply_patches.sh, review_diff.sh.

Every test runs the scripts as a user would (subprocess). Two series are exercised:
  * "real": patches/0.17.1/ as committed;
  * "synthetic": a two-patch series built here from a throwaway series repo with
    scripts/refresh_patches.sh, so the tooling is tested independently of the real patches.
Targets are full copies of build/upstream/megatron (about 20 ms each). Every bad-input case
checks that the message is there, that stderr is one line, and that every file of the
target is byte-identical afterwards.
"""

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
APPLY = str(SCRIPTS / "apply_patches.sh")
REFRESH = str(SCRIPTS / "refresh_patches.sh")
REVIEW = str(SCRIPTS / "review_diff.sh")
UPSTREAM = ROOT / "build" / "upstream"
SERIES_GIT = ROOT / "build" / "series-git"
REAL_PATCHES = ROOT / "patches" / "0.17.1"
SERIES_019 = ROOT / "patches" / "0.19"
UPSTREAM_019 = ROOT / "build" / "upstream-0.19"
MLM = ROOT / "build" / "megatron-lm"

# Exit codes of apply_patches.sh (see its header).
OK, ERROR, USAGE, NOT_APPLIED, PARTIAL, WRONG_BASE = 0, 1, 2, 3, 4, 5

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Patch Tooling Test", "GIT_AUTHOR_EMAIL": "test@invalid",
    "GIT_COMMITTER_NAME": "Patch Tooling Test", "GIT_COMMITTER_EMAIL": "test@invalid",
    "GIT_AUTHOR_DATE": "2001-02-03T04:05:06Z", "GIT_COMMITTER_DATE": "2001-02-03T04:05:06Z",
    "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1",
}

PGB = "megatron/core/distributed/param_and_grad_buffer.py"
LWO = "megatron/core/optimizer/layer_wise_optimizer.py"
NEW_FILE = "megatron/core/distributed/_patch_tooling_fixture.py"


def run(*cmd, env=None, cwd=None, check=False):
    full_env = {**os.environ, **GIT_ENV, **(env or {})}
    proc = subprocess.run(
        [str(c) for c in cmd], env=full_env, cwd=cwd, capture_output=True, text=True, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def git(repo, *args):
    return run("git", "-C", repo, *args, check=True).stdout


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_hashes(root):
    """sha256 of every file under root (not .git), keyed by relative path; mode bits too."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts and rel.parts[0] == ".git":
            continue
        if p.is_symlink():
            out[str(rel)] = ("link", os.readlink(p))
        elif p.is_file():
            out[str(rel)] = (sha256(p), p.stat().st_mode)
        elif p.is_dir():
            out[str(rel)] = ("dir", p.stat().st_mode)
    return out


def read_series(patches_dir):
    """Patch names in order (comments and blank lines skipped)."""
    lines = (Path(patches_dir) / "series").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def read_manifest(patches_dir, checkout=False):
    """{path: (pristine_sha, patched_sha)} from manifest.sha256; by default megatron/ only."""
    files = {}
    for ln in (Path(patches_dir) / "manifest.sha256").read_text().splitlines():
        f = ln.split()
        if f and f[0] == "file" and (checkout or f[3].startswith("megatron/")):
            files[f[3]] = (f[1], f[2])
    return files


def copy_upstream(dest, pristine=UPSTREAM):
    """A site-packages-like target: dest/megatron, a full copy of a pristine tree (the
    0.17.1 wheel's unless `pristine` says otherwise)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(pristine / "megatron", dest / "megatron", symlinks=True)
    return dest


def make_git_checkout(dest, message="megatron-core 0.17.1"):
    """A git repository of a copy of the 0.17.1 wheel's megatron/, one commit."""
    copy_upstream(dest)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", message)
    return dest


def set_version(tree, field, value):
    """Rewrite MAJOR, MINOR or PATCH in tree's megatron/core/package_info.py."""
    pinfo = Path(tree) / "megatron/core/package_info.py"
    pinfo.write_text(re.sub(rf"^{field} = \d+$", f"{field} = {value}", pinfo.read_text(), flags=re.M))


def one_line_error(proc, *needles):
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, f"expected a one-line error, got:\n{proc.stderr}"
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    return err


# ---------------------------------------------------------------------------- series fixtures


def _insert_before(text, pattern, new_line):
    m = re.search(pattern, text, flags=re.M)
    assert m, pattern
    return text[: m.start()] + new_line + text[m.start():]


def build_synthetic_series(base):
    """A throwaway series repo (pristine + 2 commits) and its refreshed patches dir.

    Patch 1 adds comment lines in two places of param_and_grad_buffer.py. Patch 2 edits it
    again, edits layer_wise_optimizer.py and creates a new file, so the series has a
    multi-patch file, a second file and a file that only exists when patched.
    """
    sg = make_git_checkout(Path(base) / "series-git", "megatron-core 0.17.1 pristine")
    git(sg, "tag", "pristine")

    p = sg / PGB
    t = p.read_text()
    t = _insert_before(t, r"^import ", "# patch-tooling fixture: first change\n")
    t = t + "\n# patch-tooling fixture: end of file\n"
    p.write_text(t)
    git(sg, "commit", "-q", "-a", "-m", "fixture: mark param_and_grad_buffer\n\nWhy: test the tooling.")

    t = p.read_text()
    t = _insert_before(t, r"^class ", "# patch-tooling fixture: second change\n")
    p.write_text(t)
    q = sg / LWO
    q.write_text(_insert_before(q.read_text(), r"^class ", "# patch-tooling fixture: optimizer\n"))
    (sg / NEW_FILE).write_text('"""Created by the patch-tooling fixture."""\n')
    git(sg, "add", "-A")
    git(sg, "commit", "-q", "-m", "fixture: mark optimizer, add a module\n\nWhy: test the tooling.")

    pd = Path(base) / "patches"
    pd.mkdir()
    (pd / "series").write_text("# Synthetic series against megatron-core 0.17.1.\n")
    run(REFRESH, env={"SERIES_GIT": str(sg), "PATCHES_DIR": str(pd)}, check=True)
    return sg, pd


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return build_synthetic_series(tmp_path_factory.mktemp("synthetic"))


@pytest.fixture(params=["real", "synthetic"])
def series(request):
    """(patches_dir, env) for each series."""
    pd = REAL_PATCHES if request.param == "real" else request.getfixturevalue("synthetic")[1]
    return pd, {"PATCHES_DIR": str(pd)}


@pytest.fixture
def series_copy(synthetic, tmp_path):
    """A writable copy of the synthetic patches dir, to corrupt."""
    dst = tmp_path / "patches-copy"
    shutil.copytree(synthetic[1], dst)
    return dst


# ---------------------------------------------------------------------------- refresh


def test_refresh_reproduces_committed_patches(tmp_path):
    """The committed patches/ equal what refresh_patches.sh writes from build/series-git."""
    assert SERIES_GIT.is_dir(), "run scripts/setup.sh first"
    proc = run(REFRESH, "--check")
    assert proc.returncode == 0, (
        "patches/ differs from build/series-git: run scripts/refresh_patches.sh\n" + proc.stderr
    )
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(REAL_PATCHES / "series", out / "series")  # the hand-written header comes from here
    # and the cover letter's subject and blurb (its shortlog and diffstat are regenerated: a
    # stale one is rewritten)
    cover = (REAL_PATCHES / "0000-cover-letter.patch").read_text()
    (out / "0000-cover-letter.patch").write_text(cover.replace("\n  ddp: wait on", "\n  stale: wait on", 1))
    for _ in range(2):
        run(REFRESH, env={"PATCHES_DIR": str(out)}, check=True)
        generated = sorted(p.name for p in out.iterdir())
        committed = sorted(p.name for p in REAL_PATCHES.iterdir() if p.name != "README.md")
        assert generated == committed
        for name in generated:
            assert (out / name).read_bytes() == (REAL_PATCHES / name).read_bytes(), name


def test_refresh_is_byte_stable_and_removes_stale(synthetic, tmp_path):
    sg, pd = synthetic
    out = tmp_path / "out"
    shutil.copytree(pd, out)
    (out / "9999-stale.patch").write_text("old\n")
    env = {"SERIES_GIT": str(sg), "PATCHES_DIR": str(out)}
    assert run(REFRESH, "--check", env=env).returncode == 3
    run(REFRESH, env=env, check=True)
    first = tree_hashes(out)
    proc = run(REFRESH, env=env, check=True)
    assert "up to date" in proc.stdout
    assert tree_hashes(out) == first == tree_hashes(pd)
    assert run(REFRESH, "--check", env=env).returncode == 0
    names = read_series(out)
    assert names == sorted(p.name for p in out.glob("*.patch"))
    assert [n[:5] for n in names] == ["0001-", "0002-"]
    text = (out / names[0]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] fixture: mark param_and_grad_buffer" in text
    assert not re.search(r"^-- $", text, re.M), "no signature / git version"
    assert (out / "series").read_text().startswith("# Synthetic series")
    man = read_manifest(out)
    assert set(man) == {PGB, LWO, NEW_FILE}
    assert man[NEW_FILE][0] == "-"
    assert man[PGB][0] == sha256(UPSTREAM / PGB)


def test_refresh_refuses_dirty_series_git(synthetic, tmp_path):
    sg, pd = synthetic
    sg2 = tmp_path / "sg"
    shutil.copytree(sg, sg2, symlinks=True)
    (sg2 / LWO).write_text((sg2 / LWO).read_text() + "# uncommitted\n")
    out = tmp_path / "out"
    shutil.copytree(pd, out)
    before = tree_hashes(out)
    proc = run(REFRESH, env={"SERIES_GIT": str(sg2), "PATCHES_DIR": str(out)})
    assert proc.returncode == 1
    one_line_error(proc, "uncommitted changes")
    assert tree_hashes(out) == before


# ---------------------------------------------------------------------------- the generated trees


def test_check_on_generated_trees():
    """--check: repo root (megatron/, patched) says applied; build/upstream says not applied."""
    proc = run(APPLY, ROOT, "--check")
    assert proc.returncode == OK and proc.stdout.startswith("applied"), proc.stdout + proc.stderr
    proc = run(APPLY, UPSTREAM, "--check")
    assert proc.returncode == NOT_APPLIED and proc.stdout.startswith("not applied"), proc.stdout


def test_review_diff_reproduces_patched_tree(series, tmp_path):
    """review_diff.sh: diffstat + a diff that turns the pristine tree into the patched one."""
    pd, env = series
    patched = copy_upstream(tmp_path / "patched")
    run(APPLY, patched, env=env, check=True)
    proc = run(REVIEW, UPSTREAM, patched, check=True)
    man = read_manifest(pd)
    for f in man:
        assert f in proc.stdout
    assert re.search(r"\d+ files? changed", proc.stdout)
    diff = proc.stdout[re.search(r"^--- ", proc.stdout, re.M).start():]
    target = copy_upstream(tmp_path / "pristine")
    (tmp_path / "review.diff").write_text(diff)
    run("patch", "-p1", "--fuzz=0", "-s", "-d", target, "-i", tmp_path / "review.diff", check=True)
    assert tree_hashes(target) == tree_hashes(patched)
    same = run(REVIEW, UPSTREAM, UPSTREAM, check=True)
    assert same.stdout.startswith("no differences")
    assert run(REVIEW).returncode == 0  # the default: megatron/ against build/upstream


# ---------------------------------------------------------------------------- happy paths


def test_gnu_patch_applies_each_patch_without_fuzz_or_offset(series, tmp_path):
    """`patch -p1 --fuzz=0`, one patch after another, on a copy of the wheel tree."""
    pd, _ = series
    target = copy_upstream(tmp_path / "t")
    for name in read_series(pd):
        for extra in (["--dry-run"], []):
            proc = run("patch", "-p1", "--fuzz=0", *extra, "-d", target, "-i", pd / name)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert not re.search(r"offset|fuzz", proc.stdout + proc.stderr, re.I), proc.stdout
    for f, (_, patched_sha) in read_manifest(pd).items():
        assert sha256(target / f) == patched_sha, f


def test_apply_check_reverse_plain_dir(series, tmp_path):
    pd, env = series
    target = copy_upstream(tmp_path / "site-packages")
    pristine = tree_hashes(target)
    proc = run(APPLY, target, "--check", env=env)
    assert proc.returncode == NOT_APPLIED and "not applied" in proc.stdout
    proc = run(APPLY, target, env=env)
    assert proc.returncode == OK, proc.stderr
    # The patches' own tests (tests/unit_tests/) go to Megatron-LM checkouts only.
    assert not (target / "tests").exists()
    for f, (_, patched_sha) in read_manifest(pd).items():
        assert sha256(target / f) == patched_sha
    if pd == REAL_PATCHES:  # the patched tree equals the generated megatron/
        for f in read_manifest(pd):
            assert sha256(target / f) == sha256(ROOT / f)
    proc = run(APPLY, target, "--check", env=env)
    assert proc.returncode == OK and proc.stdout.startswith("applied")
    patched = tree_hashes(target)
    proc = run(APPLY, target, env=env)
    assert proc.returncode == OK and "already applied" in proc.stdout and "nothing to do" in proc.stdout
    assert tree_hashes(target) == patched
    # Mode bits survive the rewrite.
    assert {k: v[1] for k, v in tree_hashes(target).items() if k in pristine} == {
        k: v[1] for k, v in pristine.items()
    }
    proc = run(APPLY, target, "--reverse", env=env)
    assert proc.returncode == OK, proc.stderr
    assert tree_hashes(target) == pristine
    proc = run(APPLY, target, "--reverse", env=env)
    assert proc.returncode == OK and "nothing to reverse" in proc.stdout
    assert tree_hashes(target) == pristine


def test_apply_on_git_checkout_makes_one_commit_per_patch(series, tmp_path):
    pd, env = series
    repo = make_git_checkout(tmp_path / "Megatron-LM")
    base = git(repo, "rev-parse", "HEAD").strip()
    pristine = tree_hashes(repo)
    proc = run(APPLY, repo, env=env)
    assert proc.returncode == OK, proc.stderr
    assert not (repo / "tests").exists()  # a git repo of megatron/ alone: no checkout's tests
    names = read_series(pd)
    subjects = git(repo, "log", "--format=%s", f"{base}..HEAD").splitlines()[::-1]
    assert len(subjects) == len(names)
    for name, subj in zip(names, subjects):
        m = re.search(r"^Subject: \[PATCH\] (.*)$", (pd / name).read_text(), re.M)
        assert subj.startswith(m.group(1)), (subj, m.group(1))
    assert git(repo, "status", "--porcelain") == ""
    assert run(APPLY, repo, "--check", env=env).returncode == OK
    head = git(repo, "rev-parse", "HEAD")
    proc = run(APPLY, repo, env=env)
    assert proc.returncode == OK and "already applied" in proc.stdout
    assert git(repo, "rev-parse", "HEAD") == head

    proc = run(APPLY, repo, "--reverse", env=env)
    assert proc.returncode == OK, proc.stderr
    reverts = git(repo, "log", "--format=%s", f"{head.strip()}..HEAD").splitlines()[::-1]
    assert len(reverts) == len(names) and all(r.startswith('Revert "') for r in reverts)
    assert subjects[-1] in reverts[0]  # newest patch reverted first
    assert tree_hashes(repo) == pristine
    assert git(repo, "diff", base, "HEAD") == ""
    assert git(repo, "status", "--porcelain") == ""
    assert run(APPLY, repo, "--check", env=env).returncode == NOT_APPLIED


# ---------------------------------------------------------------------------- bad input


def expect_refusal(target, args, env, code, *needles):
    """Run apply_patches.sh, expect exit `code`, the message, and an unchanged target."""
    before = tree_hashes(target) if Path(target).exists() else None
    proc = run(APPLY, target, *args, env=env)
    assert proc.returncode == code, f"exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    msg = one_line_error(proc, *needles)
    after = tree_hashes(target) if Path(target).exists() else None
    assert after == before, "target changed"
    return msg


@pytest.mark.parametrize("args", [[], ["--check", "--reverse"], ["--bogus"], ["a", "b"]])
def test_usage_errors(args, tmp_path):
    proc = run(APPLY, *args)
    assert proc.returncode == USAGE
    one_line_error(proc, "usage: scripts/apply_patches.sh TARGET")


@pytest.mark.parametrize("env", [{}, "synthetic"], ids=["patches", "PATCHES_DIR"])
def test_a_wrong_path_gets_one_line_saying_what_belongs_there(synthetic, tmp_path, env):
    """Without PATCHES_DIR the series is picked by TARGET's version, which a wrong path lacks:
    a missing path, an empty directory, a plain file, a directory without megatron/core and
    the megatron package itself each get one line and exit 1 (the header's code for "TARGET
    missing or not megatron"), in every mode, with or without PATCHES_DIR."""
    env = {"PATCHES_DIR": str(synthetic[1])} if env == "synthetic" else {}
    expected = "pass a Megatron-LM git checkout or the directory that holds megatron/core"
    empty = tmp_path / "empty"
    empty.mkdir()
    plain = tmp_path / "file"
    plain.write_text("x")
    other = tmp_path / "not-megatron"
    (other / "src").mkdir(parents=True)
    (other / "src" / "x.py").write_text("print(1)\n")
    sp = copy_upstream(tmp_path / "sp")
    for target, needles in (
        (tmp_path / "nope", ("does not exist", expected)),
        (empty, ("is an empty directory", expected)),
        (plain, ("is not a directory", expected)),
        (other, ("holds no megatron/core/package_info.py, so it is not megatron-core", expected)),
        (sp / "megatron", (f"is the megatron package itself: pass the directory above it, {sp}",)),
    ):
        for mode in ([], ["--check"], ["--reverse"]):
            msg = expect_refusal(target, mode, env, ERROR, f"TARGET '{target}' {needles[0]}", *needles[1:])
            assert msg.startswith("apply_patches.sh: error: "), msg


@pytest.mark.parametrize("minor", ["16", "18"])
def test_wrong_base_version(series, tmp_path, minor):
    _, env = series
    target = copy_upstream(tmp_path / "t")
    set_version(target, "MINOR", minor)
    for mode in ([], ["--check"], ["--reverse"]):
        # 0.16 is older than the 0.17.1 series' exact base; 0.18 lies between the two series.
        words = "exact base" if minor == "16" else "apply neither"
        expect_refusal(target, mode, env, WRONG_BASE, f"0.{minor}.1", "0.17.1", words)


def test_partly_applied(synthetic, tmp_path):
    """Only the first patch is in: apply, check and reverse all refuse with exit 4."""
    _, pd = synthetic
    env = {"PATCHES_DIR": str(pd)}
    target = copy_upstream(tmp_path / "t")
    first = read_series(pd)[0]
    run("patch", "-p1", "-s", "--fuzz=0", "-d", target, "-i", pd / first, check=True)
    for mode in ([], ["--reverse"]):
        expect_refusal(target, mode, env, PARTIAL, "partly applied or foreign changes", PGB)
    before = tree_hashes(target)
    proc = run(APPLY, target, "--check", env=env)
    assert proc.returncode == PARTIAL and "partly applied" in proc.stdout
    assert f"{LWO}: pristine" in proc.stdout and f"{PGB}: foreign changes" in proc.stdout
    assert tree_hashes(target) == before


def test_hand_edited_touched_file(series, tmp_path):
    pd, env = series
    touched = sorted(read_manifest(pd))[0]
    for state in ("pristine", "patched"):
        target = copy_upstream(tmp_path / state)
        if state == "patched":
            run(APPLY, target, env=env, check=True)
        with open(target / touched, "a") as fh:
            fh.write("# a local edit\n")
        for mode in ([], ["--reverse"]):
            expect_refusal(target, mode, env, PARTIAL, "foreign changes", touched)
        assert run(APPLY, target, "--check", env=env).returncode == PARTIAL


def test_git_checkout_with_uncommitted_changes(series, tmp_path):
    pd, env = series
    repo = make_git_checkout(tmp_path / "repo")
    touched = sorted(read_manifest(pd))[0]
    with open(repo / touched, "a") as fh:
        fh.write("# work in progress\n")
    head = git(repo, "rev-parse", "HEAD")
    expect_refusal(repo, [], env, ERROR, "uncommitted changes", touched, "commit or stash")
    assert git(repo, "rev-parse", "HEAD") == head


def test_git_am_failure_is_rolled_back(series, tmp_path):
    """A hook that rejects the second commit: git am stops; everything is restored."""
    _, env = series
    repo = make_git_checkout(tmp_path / "repo")
    head = git(repo, "rev-parse", "HEAD")
    hook = repo / ".git/hooks/applypatch-msg"
    hook.write_text(
        '#!/bin/sh\n[ -f "$(dirname "$0")/seen" ] && exit 1\ntouch "$(dirname "$0")/seen"\n'
    )
    hook.chmod(0o755)
    expect_refusal(repo, [], env, ERROR, "git am failed", "restored")
    assert git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "status", "--porcelain") == ""


def _rehash_in_manifest(patches_dir, patch):
    """Make manifest.sha256 vouch for a modified patch (a consistent but broken series)."""
    man = patches_dir / "manifest.sha256"
    text = re.sub(
        rf"^patch [0-9a-f]{{64}} {re.escape(patch.name)}$",
        f"patch {sha256(patch)} {patch.name}",
        man.read_text(),
        flags=re.M,
    )
    man.write_text(text)


def break_series(pd, how):
    """Break the series copy in ``pd`` as ``how`` says; returns the name of the patch it broke."""
    p1, p2 = (pd / n for n in read_series(pd))
    series = pd / "series"
    lines = p2.read_text().splitlines(keepends=True)
    if how == "garbage in a hunk":  # the manifest's sha256 catches it
        i = next(k for k, ln in enumerate(lines) if ln.startswith("@@"))
        lines[i + 2] = "garbage that is not a diff line\n"
        p2.write_text("".join(lines))
    elif how in ("cut in half", "emptied"):
        data = p1.read_bytes()
        p1.write_bytes(data[: len(data) // 2] if how == "cut in half" else b"")
        return p1.name
    elif how == "context not in the file":  # the manifest vouches for it: git apply fails
        i = next(k for k, ln in enumerate(lines) if ln.startswith(f"--- a/{LWO}"))
        assert lines[i + 2].startswith("@@") and lines[i + 3].startswith(" ")
        lines[i + 3] = " context that is not in the file\n"
        p2.write_text("".join(lines))
        _rehash_in_manifest(pd, p2)
    elif how == "cut after a whole hunk":  # still a valid patch, but the result has the wrong sha256
        text = p2.read_text()
        p2.write_text(text[: text.index("\ndiff --git", text.index("\ndiff --git") + 1) + 1])  # drop the 2nd+ file
        _rehash_in_manifest(pd, p2)
    elif how == "hunk 3 lines off":  # git apply finds it only at an offset
        p1.write_text(re.sub(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@",
                             lambda m: f"@@ -{int(m[1]) + 3},{m[2]} +{int(m[3]) + 3},{m[4]} @@",
                             p1.read_text(), count=1, flags=re.M))
        _rehash_in_manifest(pd, p1)
        return p1.name
    elif how == "series names a missing file":
        with open(series, "a") as fh:
            fh.write("0003-not-there.patch\n")
    elif how == "series reordered":
        series.write_text(f"# reordered\n{p2.name}\n{p1.name}\n")
    else:  # each on top of the one before: a series that names no patch, no manifest, no series
        series.write_text("# a series that names no patch\n")
        if how != "series names no patch":
            (pd / "manifest.sha256").unlink()
        if how == "series file missing":
            series.unlink()
    return p2.name


ALL_MODES = ([], ["--check"], ["--reverse"])


@pytest.mark.parametrize("how, modes, needles", [pytest.param(*row, id=row[0]) for row in [
    ("garbage in a hunk", ALL_MODES, ("{patch}", "corrupt or truncated", "restore")),
    ("cut in half", ([],), ("{patch}", "corrupt or truncated")),
    ("emptied", ([],), ("{patch}", "corrupt or truncated")),
    ("context not in the file", ([],), ("dry run", "{patch}", "does not apply", "nothing was changed")),
    ("cut after a whole hunk", ([],), ("dry run", "does not expect")),
    ("hunk 3 lines off", ([],), ("shifted lines", "offset")),
    ("series names a missing file", ALL_MODES, ("0003-not-there.patch", "does not exist")),
    ("series names no patch", (["--check"],), ("series names no patch",)),
    ("manifest missing", ([],), ("manifest.sha256 is missing",)),
    ("series file missing", ([],), ("no series file",)),
    ("series reordered", ([],), ("list different patches",)),
]])
def test_a_broken_series_is_refused_before_anything_is_written(series_copy, tmp_path, how, modes, needles):
    """A corrupt or truncated patch (its sha256), one the manifest vouches for (the dry run: it
    does not apply, gives the wrong sha256 or applies only at an offset), a series file or
    manifest that is missing or disagrees: one line, exit 1, the target unchanged."""
    target = copy_upstream(tmp_path / "t")
    patch = break_series(series_copy, how)
    for mode in modes:
        expect_refusal(target, mode, {"PATCHES_DIR": str(series_copy)}, ERROR,
                       *(n.format(patch=patch) for n in needles))


# ---------------------------------------------------------------------------- read-only targets
#
# The tests run as root, and root ignores permission bits, so chmod cannot make a tree
# read-only. Two ways that do stop root, each skipped where the machine cannot do it:
#   immutable: `chattr +i` (ext4/xfs/btrfs; needs CAP_LINUX_IMMUTABLE);
#   ro-mount:  a read-only bind mount inside `unshare -rm` (a private user+mount namespace).
# As a non-root user, chmod a-w is used instead. The script probes writability explicitly
# (test -w on each touched file, and creating a probe file in its directory), so it refuses
# before it writes anything in all three cases.


def _immutable_supported(tmp_path):
    probe = tmp_path / "immutable-probe"
    probe.write_text("x")
    if run("chattr", "+i", probe).returncode != 0:
        return False
    try:
        with open(probe, "a"):
            pass
        ok = False
    except PermissionError:
        ok = True
    run("chattr", "-i", probe)
    return ok


@contextlib.contextmanager
def immutable(paths):
    done = []
    try:
        for p in paths:
            run("chattr", "+i", p, check=True)
            done.append(p)
        yield
    finally:
        for p in reversed(done):
            run("chattr", "-i", p)


def _read_only_variants():
    return ["immutable", "ro-mount"] if os.geteuid() == 0 else ["chmod"]


@pytest.mark.parametrize("how", _read_only_variants())
def test_read_only_target(series, tmp_path, how):
    pd, env = series
    target = copy_upstream(tmp_path / "t")
    touched = [target / f for f in read_manifest(pd) if (target / f).exists()]
    dirs = sorted({p.parent for p in touched} | {target / Path(f).parent for f in read_manifest(pd)})
    dirs = [d for d in dirs if d.exists()]
    before = tree_hashes(target)
    needles = ("not writable", "nothing was changed")
    if how == "immutable":
        if not _immutable_supported(tmp_path):
            pytest.skip("chattr +i does not work here")
        with immutable(touched + dirs):
            proc = run(APPLY, target, env=env)
            assert run(APPLY, target, "--check", env=env).returncode == NOT_APPLIED
        # Only the last touched file immutable: the earlier ones must not be written either.
        last = [target / f for f in sorted(read_manifest(pd)) if (target / f).exists()][-1]
        with immutable([last]):
            partly = run(APPLY, target, env=env)
        assert partly.returncode == ERROR
        one_line_error(partly, "not writable", str(last.relative_to(target)))
    elif how == "ro-mount":
        if run("unshare", "-rm", "true").returncode != 0:
            pytest.skip("unshare -rm (user + mount namespace) is not available")
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && exec "$2" "$1"'
        proc = run("unshare", "-rm", "sh", "-c", script, "sh", target, APPLY, env=env)
        if "mount" in proc.stderr and "apply_patches" not in proc.stderr:
            pytest.skip(f"read-only bind mount failed: {proc.stderr.strip()}")
    else:
        for p in touched + dirs:
            p.chmod(p.stat().st_mode & ~0o222)
        proc = run(APPLY, target, env=env)
    assert proc.returncode == ERROR, proc.stdout + proc.stderr
    one_line_error(proc, *needles)
    assert tree_hashes(target) == before


# ---------------------------------------------------------------------------- real checkouts
# scripts/setup.sh builds build/megatron-lm/<tag>: upstream Megatron-LM (tarball or clone,
# verified) as a git repository with one commit tagged <tag>, so the series is tested on the
# tree users apply it to, with git am as they run it.

def clone_checkout(tag, dest):
    """A throwaway clone of the checkout setup.sh built for `tag` (skip if there is none)."""
    src = MLM / tag
    if not (src / ".git").is_dir():
        pytest.skip(f"{src} is missing (scripts/setup.sh found no Megatron-LM {tag} source)")
    run("git", "clone", "-q", src, dest, check=True)
    return Path(dest)


@pytest.mark.parametrize("tag, pd", [("core_v0.17.1", REAL_PATCHES), ("core_v0.19.0", SERIES_019)])
def test_real_checkout_check_apply_reapply_reverse(tmp_path, tag, pd):
    """Each series on its Megatron-LM checkout, picked by version, as a user runs it (core_v0.19.0's
    package_info.py reads 0.19.1, a manifest 'also' version): one commit per patch with the
    series' subjects, --check, a no-op re-apply, then --reverse back to the tag."""
    repo = clone_checkout(tag, tmp_path / "Megatron-LM")
    names = read_series(pd)
    manifest = read_manifest(pd, checkout=True)
    base = git(repo, "rev-parse", "HEAD").strip()
    assert git(repo, "describe", "--tags", "--exact-match").strip() == tag

    proc = run(APPLY, repo, "--check")
    assert proc.returncode == NOT_APPLIED and "not applied" in proc.stdout, proc.stdout + proc.stderr
    proc = run(APPLY, repo)
    assert proc.returncode == OK, proc.stderr
    subjects = git(repo, "log", "--format=%s", f"{base}..HEAD").splitlines()[::-1]
    assert len(subjects) == len(names)  # one commit per patch
    for name, subj in zip(names, subjects):
        m = re.search(r"^Subject: \[PATCH[^]]*\] (.*)$", (pd / name).read_text(), re.M)
        assert subj.startswith(m.group(1)), (subj, m.group(1))
    assert git(repo, "status", "--porcelain") == ""
    for f, (_, patched_sha) in manifest.items():
        assert sha256(repo / f) == patched_sha, f
        if f.startswith("megatron/") and pd == REAL_PATCHES:  # byte-identical to the generated tree of the wheel
            assert sha256(repo / f) == sha256(ROOT / f), f
    # Nothing outside the manifest's files changed.
    changed = set(git(repo, "diff", "--name-only", base, "HEAD").split())
    assert changed == set(manifest)

    proc = run(APPLY, repo, "--check")
    assert proc.returncode == OK and proc.stdout.startswith("applied"), proc.stdout
    head = git(repo, "rev-parse", "HEAD")
    proc = run(APPLY, repo)
    assert proc.returncode == OK and "already applied" in proc.stdout
    assert git(repo, "rev-parse", "HEAD") == head

    proc = run(APPLY, repo, "--reverse")
    assert proc.returncode == OK, proc.stderr
    reverts = git(repo, "log", "--format=%s", f"{head.strip()}..HEAD").splitlines()
    assert len(reverts) == len(names) and all(r.startswith('Revert "') for r in reverts)
    assert git(repo, "diff", tag, "HEAD") == ""
    assert run(APPLY, repo, "--check").returncode == NOT_APPLIED


def test_setup_patched_checkout_is_the_series_on_core_v0_17_1():
    """build/megatron-lm/patched (setup.sh: apply_patches.sh on the checkout) holds the series."""
    pc = MLM / "patched"
    if not (pc / ".git").is_dir():
        pytest.skip(f"{pc} is missing; run scripts/setup.sh")
    subjects = git(pc, "log", "--format=%s", "core_v0.17.1..HEAD").splitlines()
    assert len(subjects) == len(read_series(REAL_PATCHES))
    for f, (_, patched_sha) in read_manifest(REAL_PATCHES, checkout=True).items():
        assert sha256(pc / f) == patched_sha, f
    assert run(APPLY, pc, "--check").returncode == OK


@pytest.mark.parametrize("mode", [[], ["--check"]])
def test_core_v0_18_2_checkout_is_refused_with_what_it_has_and_lacks(tmp_path, mode):
    repo = clone_checkout("core_v0.18.2", tmp_path / "Megatron-LM-0.18.2")
    head = git(repo, "rev-parse", "HEAD")
    before = tree_hashes(repo / "megatron" / "core" / "distributed")
    proc = run(APPLY, repo, *mode)
    assert proc.returncode == WRONG_BASE, proc.stdout + proc.stderr
    msg = one_line_error(
        proc,
        "megatron-core 0.18.2", "0.17.1", "patches/0.19/", "apply neither",
        # what 0.18 has
        "grad_data", "#3751", "#4609", "zeroes grad_data after the copy-back",
        # what it lacks that the series fixes
        "force_sync=True", "free_overlap_buffers()", "offloaded", "temporary",
    )
    assert "full_param_layout" not in msg  # that is 0.19's, not 0.18's
    assert git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "status", "--porcelain") == ""
    assert tree_hashes(repo / "megatron" / "core" / "distributed") == before


@pytest.mark.parametrize("mode", [[], ["--check"], ["--reverse"]])
def test_core_v0_17_0_tree_gets_one_line_what_it_has_and_what_to_do(tmp_path, mode):
    """A 0.17.0 tree (a copy of the 0.17.1 checkout with 0.17.0's version): one line."""
    repo = clone_checkout("core_v0.17.1", tmp_path / "Megatron-LM-0.17.0")
    set_version(repo, "PATCH", "0")
    git(repo, "commit", "-q", "-a", "-m", "megatron-core 0.17.0")
    msg = expect_refusal(repo, mode, {}, WRONG_BASE, "has megatron-core 0.17.0", "not 0.17.1",
                         "exact base", "update to 0.17.1 first", "git checkout core_v0.17.1",
                         "pip install megatron-core==0.17.1")
    assert "#3751" not in msg  # the 0.18 story is not told to a 0.17.0 user


# ------------------------------------------------------------------ the 0.19 base material
#: The files a layer-wise series touches on 0.19 (UPSTREAM_NOTES: "megatron-core 0.19.x for a port").
TOUCHED_019 = ("megatron/core/distributed/param_and_grad_buffer.py",
               "megatron/core/distributed/distributed_data_parallel.py",
               "megatron/core/optimizer/layer_wise_optimizer.py")


def test_019_wheel_carries_core_v0_19_0s_touched_files():
    """setup.sh's 0.19 material: the pinned 0.19.2 wheel tree and the core_v0.19.0 checkout
    (whose pretrain_gpt.py and tests/unit_tests serve it) hold the same touched files, byte
    for byte, and the versions the lock names (the tag's package_info.py reads 0.19.1)."""
    ckpt = MLM / "core_v0.19.0"
    if not (ckpt / ".git").is_dir() or not (UPSTREAM_019 / "megatron").is_dir():
        pytest.skip("the 0.19 trees are missing; run scripts/setup.sh")
    for f in TOUCHED_019:
        assert sha256(UPSTREAM_019 / f) == sha256(ckpt / f), f
    version = lambda root: ".".join(re.findall(r"^(?:MAJOR|MINOR|PATCH) = (\d+)$",
                                               (root / "megatron/core/package_info.py").read_text(), re.M))
    assert (version(UPSTREAM_019), version(ckpt)) == ("0.19.2", "0.19.1")


def _019_wheel_copy(dest):
    if not (UPSTREAM_019 / "megatron").is_dir():
        pytest.skip("build/upstream-0.19 is missing; run scripts/setup.sh")
    return copy_upstream(dest, UPSTREAM_019)


def test_the_series_is_picked_by_the_targets_version(tmp_path):
    """Without PATCHES_DIR, apply_patches.sh takes the patches/<base>/ folder whose manifest
    names TARGET's version: the 0.17.1 tree gets the patches of patches/0.17.1/, a fresh
    0.19.2 wheel tree those of patches/0.19/ (--check 3, apply gives the manifest's patched
    files, --check 0, --reverse restores every byte); with patches/0.19/ gone, 0.19.2 is
    refused (exit 5) with the bases that remain."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copytree(ROOT / "patches", repo / "patches")
    apply = repo / "scripts" / "apply_patches.sh"
    t17 = copy_upstream(tmp_path / "t17")
    proc = run(apply, t17, "--check")
    assert proc.returncode == NOT_APPLIED and "megatron-core 0.17.1" in proc.stdout, proc.stdout + proc.stderr
    n17 = len(read_series(ROOT / "patches" / "0.17.1"))
    assert run(apply, t17).returncode == OK
    assert run(apply, t17, "--check").stdout.startswith(f"applied: all {n17} patches")
    t19 = _019_wheel_copy(tmp_path / "t19")
    before = tree_hashes(t19)
    proc = run(apply, t19, "--check")
    assert proc.returncode == NOT_APPLIED and "megatron-core 0.19.2" in proc.stdout, proc.stdout + proc.stderr
    proc = run(apply, t19)
    n19 = len(read_series(SERIES_019))
    assert proc.returncode == OK and f"applied {n19} patches" in proc.stdout, proc.stdout + proc.stderr
    for f, (_, patched_sha) in read_manifest(SERIES_019).items():
        assert sha256(t19 / f) == patched_sha, f
    assert run(apply, t19, "--check").returncode == OK
    assert run(apply, t19, "--reverse").returncode == OK
    assert tree_hashes(t19) == before
    shutil.rmtree(repo / "patches" / "0.19")
    proc = run(apply, t19, "--check")
    assert proc.returncode == WRONG_BASE and "series for: 0.17.1." in proc.stderr, proc.stderr


# ------------------------------------------------------------------ three-way conflicts: the report
# A git checkout of 0.17.1 with its own commit in the touched files (a fork) gets the synthetic
# series by git am -3 in a scratch clone. Patch 2 inserts a line before the first class of both
# param_and_grad_buffer.py and layer_wise_optimizer.py.


def _edit_before_first_class(repo, path, how):
    """``how`` = "insert": a line of the fork's own right before the file's first class (where patch
    2 inserts its own: a conflict); "context": the fork edits the third line above it, the first
    context line of patch 2's hunk (git apply rejects the hunk; the three-way merge is clean)."""
    p = Path(repo) / path
    text = p.read_text()
    m = re.search(r"^class ", text, re.M)
    head, tail = text[: m.start()], text[m.start():]
    if how == "insert":
        p.write_text(head + "# a fork's own line\n" + tail)
    else:
        lines = head.split("\n")  # head ends with "\n": lines[-1] == ""
        assert lines[-4].strip(), lines[-4:]
        lines[-4] += "  # a fork's edit"
        p.write_text("\n".join(lines) + tail)


def _hunk_header(patch, path):
    part = re.search(rf"^diff --git a/{re.escape(path)} .*?(?=^diff --git |\Z)", Path(patch).read_text(), re.M | re.S)
    return re.search(r"^@@ .*$", part.group(0), re.M).group(0)


def _git_state(repo):
    """What a refusal must leave as it was: HEAD, every ref, git status, the work tree."""
    return (git(repo, "rev-parse", "HEAD"), git(repo, "for-each-ref"),
            git(repo, "status", "--porcelain", "--untracked-files=all"), tree_hashes(repo))


def _fork(tmp_path, edits):
    repo = make_git_checkout(tmp_path / "fork")
    for path, how in edits:
        _edit_before_first_class(repo, path, how)
    git(repo, "commit", "-q", "-a", "-m", "fork: its own lines in the touched files")
    return repo


def _refused_with_conflict(repo, pd, env):
    """--check, then apply: exit 6, one line, HEAD/refs/status/files as before; the messages."""
    out = []
    for mode in (["--check"], []):
        before = _git_state(repo)
        proc = run(APPLY, repo, *mode, env=env)
        assert proc.returncode == 6, f"exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        out.append((proc.stdout, one_line_error(proc, "conflict: ", "nothing was changed", "git am --continue")))
        assert _git_state(repo) == before, "HEAD, refs, status or files changed"
    return out


def _hand_merge_stops_at(repo, pd):
    """The advised hand merge (git am -3 the whole series): the unmerged files and the line of
    each one's first <<<<<<< marker; then git am --abort."""
    proc = run("git", "-C", repo, "am", "-3", *[pd / n for n in read_series(pd)])
    assert proc.returncode != 0, proc.stdout
    assert "lacks necessary blobs" not in proc.stderr, proc.stderr
    files = git(repo, "diff", "--name-only", "--diff-filter=U").split()
    marks = {f: next(i for i, ln in enumerate((repo / f).read_text().splitlines(), 1) if ln.startswith("<<<<<<<"))
             for f in files}
    git(repo, "am", "--abort")
    return marks


def test_three_way_conflict_names_the_file_that_conflicts_not_the_first_one_git_apply_rejects(synthetic, tmp_path):
    """The fork edits a context line of patch 2's hunk in param_and_grad_buffer.py (git apply
    rejects it, it merges cleanly) and inserts its own line where patch 2 inserts one in
    layer_wise_optimizer.py (a conflict). git apply --check names param_and_grad_buffer.py
    first; the report names layer_wise_optimizer.py alone, its hunk and the marker line the
    advised hand merge leaves."""
    _, pd = synthetic
    env = {"PATCHES_DIR": str(pd)}
    p1, p2 = read_series(pd)
    repo = _fork(tmp_path, [(PGB, "context"), (LWO, "insert")])
    scratch = tmp_path / "probe"
    run("git", "clone", "-q", "--shared", repo, scratch, check=True)
    git(scratch, "am", "-q", pd / p1)
    rejected = run("git", "-C", scratch, "apply", "--check", pd / p2).stderr
    assert re.search(r"^error: patch failed: (\S+):", rejected, re.M).group(1) == PGB, rejected

    (stdout, msg), _ = _refused_with_conflict(repo, pd, env)
    conflict_line = next(ln for ln in stdout.splitlines() if ln.startswith(f"  {p2}: conflicts in "))
    assert PGB not in conflict_line and PGB not in msg.split(" (lines of")[0], (conflict_line, msg)
    hunk = _hunk_header(pd / p2, LWO)
    assert f"conflicts in {LWO}, hunk {hunk} (markers from line " in conflict_line, conflict_line
    marks = _hand_merge_stops_at(repo, pd)
    assert marks == {LWO: marks[LWO]} and f"{LWO}, hunk '{hunk}', conflict markers from line {marks[LWO]}" in msg, msg
    assert f"resolve {LWO}, git add it" in msg


def test_three_way_conflict_in_two_files_names_both(synthetic, tmp_path):
    """The fork inserts its own line where patch 2 inserts one, in both files: the report names
    each file, its hunk and its first marker's line, and the hand merge resolves both."""
    _, pd = synthetic
    env = {"PATCHES_DIR": str(pd)}
    p2 = read_series(pd)[1]
    repo = _fork(tmp_path, [(PGB, "insert"), (LWO, "insert")])
    (stdout, _), (_, msg) = _refused_with_conflict(repo, pd, env)
    marks = _hand_merge_stops_at(repo, pd)
    assert sorted(marks) == sorted([PGB, LWO])
    for f in (PGB, LWO):
        hunk = _hunk_header(pd / p2, f)
        assert f"{f}, hunk {hunk} (markers from line {marks[f]})" in stdout, stdout
        assert f"{f}, hunk '{hunk}', conflict markers from line {marks[f]}" in msg, msg
    assert f"resolve {PGB} and {LWO}, git add them" in msg


# ------------------------------------------------------------------ --help and the refusals' tags


def test_help_names_every_base_of_patches_and_the_tags_the_refusals_name():
    """--help lists each series under patches/ with the versions its manifest names, and no
    longer says the base is 0.17.1 alone."""
    text = run(APPLY, "--help", check=True).stdout
    for manifest in sorted((ROOT / "patches").glob("*/manifest.sha256")):
        fields = [ln.split() for ln in manifest.read_text().splitlines() if ln.strip()]
        versions = [v for f in fields if f[0] in ("base", "also") for v in f[1:]]
        assert f"patches/{manifest.parent.name}/" in text
        for v in versions:
            assert v in text, (manifest, v)
    assert "The base is exactly megatron-core 0.17.1" not in text
    assert "0.18 and later: do not apply" not in text
    assert "core_v0.19.2" not in text


@pytest.mark.parametrize("tree, field, value, needles, absent", [
    pytest.param("0.17.1", "MINOR", "20", ("0.20.1", "the series of 0.19.2", "three-way merge", "not a git checkout"),
                 (), id="0.20-not-git"),
    pytest.param("0.19", "PATCH", "3", ("0.19.3", "update to 0.19.2 first", "git checkout core_v0.19.0",
                                        "pip install megatron-core==0.19.2"), ("core_v0.19.2",), id="0.19.3"),
    pytest.param("0.19", "MINOR", "21", ("megatron-core 0.21", "no series here", "series for: 0.17.1; 0.19.2"),
                 ("#3751", "What 0.18 still lacks"), id="0.21"),
])
def test_a_version_no_series_is_for_gets_one_line_exit_5(tmp_path, tree, field, value, needles, absent):
    """Picked by version, --check. 0.20.x (upstream main's version after 0.19) gets patches/0.19
    three-way, on a git checkout only (test_own_tree.py): a plain directory hears so. 0.19.3
    (not a version of patches/0.19's manifest) is sent to 0.19.2, by pip or by the Megatron-LM
    tag that exists, core_v0.19.0 (the exit-7 fetch names the same tag). 0.21, two minors past
    the newest base, hears there is no series, without the 0.18 story."""
    target = copy_upstream(tmp_path / "t") if tree == "0.17.1" else _019_wheel_copy(tmp_path / "t")
    set_version(target, field, value)
    msg = expect_refusal(target, ["--check"], {}, WRONG_BASE, *needles)
    assert not [a for a in absent if a in msg], msg
