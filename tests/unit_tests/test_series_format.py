"""Review readiness of the series: upstream's formatting and the patch headers.

Megatron-LM formats megatron/core with black 24 (line length 100,
skip-string-normalization, skip-magic-trailing-comma) and isort (profile black, line
length 100); its CI rejects anything else. Every file the series touches must still pass
both, in the patched tree. The pristine versions are checked too, as a control that the
settings are upstream's (a wrong setting would fail them as well).

Each patch carries a real author (a name and a mail address that is not a placeholder),
a subject of at most ~75 characters, a body that says why, DEP-3-style provenance lines
(Origin, Forwarded, Last-Update) in the body and a Developer Certificate of Origin
trailer (`Signed-off-by:`) as its last line.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from harness.trees import REPO_ROOT, SERIES_DIR, series_patches, tree_parent

BLACK = [sys.executable, "-m", "black", "--check", "-q", "-l", "100", "-S", "-C"]
ISORT = [sys.executable, "-m", "isort", "--check-only", "-q", "--profile", "black", "-l", "100"]
# Names reserved for examples and placeholders (RFC 2606, RFC 6761): never a real mailbox.
PLACEHOLDER_MAIL = re.compile(
    r"[@.](invalid|example|test|localhost)$|@example\.(com|net|org)$", re.I
)


def touched_files():
    files = set()
    for patch in series_patches():
        files.update(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M))
    return sorted(files)


def test_series_touches_python_files():
    files = touched_files()
    assert files and all(f.startswith("megatron/core/") and f.endswith(".py") for f in files)


@pytest.mark.parametrize("tree", ["patched", "upstream"])
@pytest.mark.parametrize("tool", ["black", "isort"])
def test_touched_files_keep_upstream_format(tree, tool):
    cmd = (BLACK if tool == "black" else ISORT) + touched_files()
    proc = subprocess.run(cmd, cwd=tree_parent(tree), capture_output=True, text=True)
    assert proc.returncode == 0, f"{tool} rejects {tree} files:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("patch", series_patches(checkout=True), ids=lambda p: p.name[:4])
def test_patch_header(patch):
    text = patch.read_text()
    subject = re.search(r"^Subject: \[PATCH\] (.+)$", text, flags=re.M)
    assert subject, f"{patch.name}: no Subject"
    assert len(subject.group(1)) <= 78, f"{patch.name}: subject too long"
    body = text.split("\n\n", 1)[1].split("\n---\n", 1)[0]
    assert len(body.split()) >= 40, f"{patch.name}: the message must say why (body too short)"
    for field in ("Origin:", "Forwarded:", "Last-Update:"):
        assert re.search(rf"^{field} \S", body, flags=re.M), f"{patch.name}: no {field!r} line"
    headers = re.sub(r"\n[ \t]+", " ", text.split("\n\n", 1)[0])  # unfold (RFC 5322)
    author = re.search(r"^From: (.+) <([^>]+)>$", headers, flags=re.M)
    assert author, f"{patch.name}: no 'From: Name <mail>' author line"
    assert not PLACEHOLDER_MAIL.search(author.group(2)), f"{patch.name}: placeholder author mail"
    trailers = body.rstrip().splitlines()
    signed = re.fullmatch(r"Signed-off-by: (.+) <([^>]+)>", trailers[-1])
    assert signed, f"{patch.name}: the message must end with a Signed-off-by: trailer"
    assert signed.groups() == author.groups(), f"{patch.name}: Signed-off-by differs from author"


def test_series_header_names_the_base():
    first = (SERIES_DIR / "series").read_text().splitlines()[0]
    assert first.startswith("#") and "0.17.1" in first and "core_v0.17.1" in first
