"""README.md and the Markdown under docs/: links that resolve, and the README's shape.

A link is checked the way GitHub renders it: a relative target must be a file or folder of
the repository, and an anchor (``#...``) must be the slug of a heading of the target file
(lowercase, punctuation other than ``-`` and ``_`` dropped, spaces as ``-``, a repeated slug
suffixed ``-1``, ``-2``, ...). Absolute URLs are not fetched. The README's example output of
the main job is compared with a real run in tests/functional_tests/test_functional.py
(``test_readme_example_is_the_main_jobs_output``), where the suite trains those cases anyway.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.trees import REPO_ROOT

README = REPO_ROOT / "README.md"
#: Markdown files whose links are checked: the README and every page it links under docs/,
#: patches/ and tests/.
PAGES = [README, *sorted((REPO_ROOT / "docs").rglob("*.md")), REPO_ROOT / "patches" / "README.md",
         REPO_ROOT / "tests" / "README.md"]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slugs(markdown: str) -> set:
    """GitHub's anchors of a Markdown text's headings (outside fenced code blocks)."""
    seen, out, fenced = {}, set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(markdown: str) -> list:
    """Targets of the inline links and images of a Markdown text, outside code blocks and
    inline code."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [a or b for a, b in LINK.findall(text)]


def broken_links(page: Path) -> list:
    """'target: why' for each link of ``page`` that does not resolve."""
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not fetched
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif anchor and (dest.is_dir() or anchor not in slugs(dest.read_text())):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest}")
    return broken


def test_slugs_and_links_follow_githubs_rules():
    text = "# Title\n## The main job (`scripts/run.sh`)\n## Memory: the path's padding\n## Title\n```\n# not a heading\n```\n"
    assert slugs(text) == {"title", "the-main-job-scriptsrunsh", "memory-the-paths-padding", "title-1"}
    md = "[a](x.md#y) ![img](p.png) `[no](code.md)` [web](https://example.com)\n```\n[no](block.md)\n```"
    assert links(md) == ["x.md#y", "p.png", "https://example.com"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_link_resolves(page):
    assert broken_links(page) == []


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#other) [file](missing.md) [anchor](other.md#nope) [self](#nope)\n# Page\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "other.md#nope", "#nope"]


def test_readme_is_short_and_starts_with_the_two_commands():
    """Under 200 lines; the main job and the test command within the first 40."""
    lines = README.read_text().splitlines()
    assert len(lines) < 200, len(lines)
    head = "\n".join(lines[:40])
    assert re.search(r"^scripts/run_functional_test\.sh\b", head, re.M), head
    assert re.search(r"^scripts/test\.sh\b", head, re.M), head


def test_real_shapes_md_is_what_the_report_writes_from_the_published_json(tmp_path):
    """docs/bench/real_shapes.md is generated (tables from real_shapes.json, the reading of
    them from docs/bench/real_shapes_findings.md): a hand edit of the page, or a findings
    file not published, shows here."""
    from harness.audit import report as audit_report

    docs = REPO_ROOT / "docs" / "bench"
    audit_report.write_markdown(json.loads((docs / "real_shapes.json").read_text()), tmp_path / "r.md")
    assert (tmp_path / "r.md").read_text() == (docs / "real_shapes.md").read_text()
