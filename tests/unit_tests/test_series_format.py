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

Every number a patch message states is asserted somewhere, so that a rewrite of the series
cannot leave one stale: MESSAGE_NUMBERS lists, per base and patch, each number of the
message and where it is asserted (a test's node id, or a row of the real-shape audit's
report); a message number missing from the table fails, and so does a table entry the
message no longer states.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.trees import BASES, REPO_ROOT, series_patches, tree_parent
from tests.upstream_tests.upstream_runner import CHECKOUTS, CHECKOUTS_OF_BASE

COVER = "0000-cover-letter.patch"

BLACK = [sys.executable, "-m", "black", "--check", "-q", "-l", "100", "-S", "-C"]
ISORT = [sys.executable, "-m", "isort", "--check-only", "-q", "--profile", "black", "-l", "100"]
# Names reserved for examples and placeholders (RFC 2606, RFC 6761): never a real mailbox.
PLACEHOLDER_MAIL = re.compile(
    r"[@.](invalid|example|test|localhost)$|@example\.(com|net|org)$", re.I
)


def touched_files(base="0.17.1", part="megatron/"):
    """The files the series of ``base`` touches under ``part`` (megatron/: the code; tests/: the
    patches' own tests, which only Megatron-LM checkouts get)."""
    files = set()
    for patch in series_patches(base=base):
        files.update(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M))
    return sorted(f for f in files if f.startswith(part))


@pytest.mark.parametrize("base", BASES)
def test_series_touches_python_files(base):
    files = touched_files(base, part="")
    code, tests = touched_files(base), touched_files(base, part="tests/")
    assert code and all(f.startswith("megatron/core/") and f.endswith(".py") for f in code)
    assert tests == ["tests/unit_tests/distributed/test_layer_wise_param_gather.py"]
    assert sorted(code + tests) == files


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("tool", ["black", "isort"])
def test_patch_tests_keep_upstream_format(base, tool, tmp_path):
    """The patches' own tests, as the patched checkout has them: black and isort with the
    settings above, megatron first-party as upstream's pyproject.toml says (run on copies, away
    from the checkout's pyproject.toml, whose black required_version pins another black)."""
    tree = CHECKOUTS[CHECKOUTS_OF_BASE[base][1]]
    if not (tree / ".git").is_dir():
        pytest.skip(f"{tree} missing (scripts/setup.sh)")
    copies = []
    for i, f in enumerate(touched_files(base, part="tests/")):
        copies.append(f"{i}_{Path(f).name}")
        (tmp_path / copies[-1]).write_bytes((tree / f).read_bytes())
    cmd = BLACK if tool == "black" else ISORT + ["-p", "megatron", "-p", "tests"]
    proc = subprocess.run(cmd + copies, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, f"{tool} rejects {tree}'s test files:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("side", [1, 0], ids=["series", "pristine"])
@pytest.mark.parametrize("tool", ["black", "isort"])
def test_touched_files_keep_upstream_format(base, side, tool):
    tree = BASES[base][side]
    cmd = (BLACK if tool == "black" else ISORT) + touched_files(base)
    proc = subprocess.run(cmd, cwd=tree_parent(tree), capture_output=True, text=True)
    assert proc.returncode == 0, f"{tool} rejects {tree} files:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize(
    "patch",
    [p for b in BASES for p in series_patches(base=b)],
    ids=lambda p: f"{p.parent.name}-{p.name[:4]}",
)
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


@pytest.mark.parametrize("base", BASES)
def test_cover_letter_is_format_patch_s_and_names_every_patch(base):
    """patches/<base>/0000-cover-letter.patch has git format-patch --cover-letter's form:
    a [PATCH 0/N] subject for the N patches of the series, a blurb that says why, and the
    shortlog of exactly the series' subjects, in order."""
    text = (REPO_ROOT / "patches" / base / COVER).read_text()
    patches = series_patches(base=base)
    assert re.search(rf"^Subject: \[PATCH 0/{len(patches)}\] \S", text, flags=re.M), text[:300]
    subjects = [
        re.sub(
            r"\n ",
            " ",
            re.search(r"^Subject: \[PATCH\] (.+(?:\n .+)*)", p.read_text(), re.M).group(1),
        )
        for p in patches
    ]
    shortlog = re.search(r"^\S.* \((\d+)\):\n((?:  .*\n)+)", text, flags=re.M)
    assert shortlog and int(shortlog.group(1)) == len(patches), text
    listed = re.sub(r"\n {4}", " ", shortlog.group(2)).splitlines()
    assert [ln.strip() for ln in listed if ln.strip()] == subjects
    assert len(text.split("\n\n", 1)[1].split()) >= 200, "the blurb must say what and why"


@pytest.mark.parametrize("base,tag", [("0.17.1", "core_v0.17.1"), ("0.19", "core_v0.19.0")])
def test_series_header_names_the_base(base, tag):
    first = (REPO_ROOT / "patches" / base / "series").read_text().splitlines()[0]
    assert first.startswith("#") and base in first and tag in first


# ------------------------------------------------------------ numbers in the patch messages
#: The real-shape audit's report (scripts/audit_param_sync.py --publish writes it; its
#: faithfulness to megatron and its series claims are tests/unit_tests/test_audit.py).
AUDIT_REPORT = REPO_ROOT / "docs" / "bench" / "real_shapes.md"
# A number is a run of digits, with at most one decimal point, that touches no letter, digit,
# '_', '-', '.', '#' or '/' outside itself, and has two characters or more: so versions
# (0.19.2, core_v0.19.0), pull requests (#3751), dates (2026-12-05), model names
# (Llama-3-8B), dtypes (fp32) and single-digit setups (2 ranks, TP 1, DP 8) are not numbers.
# Neither are megatron-core minor versions written alone (0.17 to 0.20) or patch names (0004).
NUMBER = re.compile(r"(?<![\w.#/\-])\d+(?:\.\d+)?(?![\w\-]|\.\d)")
NOT_NUMBERS = re.compile(r"0\.(1[7-9]|20)|000\d")
TRAILERS = re.compile(r"(Origin|Forwarded|Last-Update|Signed-off-by):")


def audit(section: str, dp: int, tree: str) -> tuple:
    """A number's source: the row of AUDIT_REPORT under `## {section}` whose first two
    cells are `dp` (a DP size, expert DP in parentheses ignored) and `tree` (a tree label of
    the report)."""
    return ("audit", section, dp, tree)


_8B = "Llama-3-8B, TP 1"
_DSV2 = "DeepSeek-V2-Lite/Moonlight-like MoE, 64 experts top-6 + shared, EP 8"
#: Base -> patch number -> each number its message states -> where it is asserted: a node id
#: ("tests/...py::test_name[params]") or audit(). Single-digit setups are not listed (NUMBER).
MESSAGE_NUMBERS = {
    "0.19": {
        # pristine 0.19.2: grad norm 0.0 after a forced sync before the step
        "0004": {
            "0.0": "tests/unit_tests/test_grad_data_guards.py::test_019_pristine_forced_sync_before_step_zeroes_every_grad"
        },
        "0005": {
            "4160": audit(_8B, 64, "pristine-0.19"),  # NCCL operations of the pre-hook path
            "3970": audit(_8B, 64, "pristine-0.19"),  # of them zero-size
            "190": audit(_8B, 64, "series-0.19"),
            "64": audit(_DSV2, 64, "pristine-0.19"),  # 64 experts, DP 64
            "0.13": audit(_DSV2, 64, "pristine-0.19"),  # GiB NCCL allocates for equal shares
        },
        "0006": {
            "14.96": audit(_8B, 8, "pristine-0.19"),  # optimizer-path temporaries, GiB
            "16.43": audit("Llama-3-70B, TP 8", 8, "pristine-0.19"),
            "195": audit(_8B, 8, "series-0.19"),  # NCCL operations: one per param
            "1024": audit(_8B, 1024, "pristine-0.19"),  # one per DP rank
        },
    },
    "0.17.1": {
        "0004": {  # GiB of temporaries of the forward path, at DP 64
            "1.31": audit(_8B, 64, "pristine-0.17.1"),
            "64": audit(_8B, 64, "pristine-0.17.1"),
        },
        "0005": {
            "4160": audit(_8B, 64, "pristine-0.17.1"),  # NCCL operations of the pre-hook path
            "3970": audit(_8B, 64, "pristine-0.17.1"),  # of them zero-size
            "190": audit(_8B, 64, "series-0.17.1"),
            "64": audit(_DSV2, 64, "pristine-0.17.1"),  # 64 experts, DP 64
            "0.13": audit(_DSV2, 64, "pristine-0.17.1"),  # GiB NCCL allocates for the equal shares
        },
        "0006": {
            "14.96": audit(_8B, 8, "pristine-0.17.1"),  # optimizer-path temporaries, GiB
            "16.43": audit("Llama-3-70B, TP 8", 8, "pristine-0.17.1"),
            "195": audit(_8B, 8, "series-0.17.1"),  # NCCL operations: one per param
            "1024": audit(_8B, 1024, "pristine-0.17.1"),  # one per DP rank
        },
    },
}


def largest_bucket(model: str, dp: int) -> tuple:
    """A number's source: the largest layer-wise bucket of the audit's JSON cell (model key
    of harness/audit/grid.py, DP size; pristine tree), its params in bf16, GiB to 2
    decimals: what a forced sync receives into a temporary at once (one bucket group at a
    time)."""
    return ("bucket", model, dp)


def added_lines(base: str, rev: str = "") -> tuple:
    """A number's source: the lines the series' patches add under megatron/core, at `rev`
    of this repository (a commit; "" = the working tree)."""
    return ("lines", base, rev)


#: The v5 and v6 series, for the cover letters' comparisons.
V5 = "c1ca879"
V6 = "9a0fad1"
#: Base -> each number its cover letter's blurb states -> its source.
COVER_NUMBERS = {
    "0.17.1": {
        "64": audit(_8B, 64, "pristine-0.17.1"),
        "1.31": audit(_8B, 64, "pristine-0.17.1"),  # GiB of temporaries, forward path
        "4160": audit(_8B, 64, "pristine-0.17.1"),
        "3970": audit(_8B, 64, "pristine-0.17.1"),
        "190": audit(_8B, 64, "series-0.17.1"),
        "65": audit(_8B, 64, "series-0.17.1"),  # launches
        "14.96": audit(_8B, 64, "series-0.17.1"),  # GiB zeroed per step; optimizer temporaries
        "195": audit(_8B, 8, "series-0.17.1"),
        "300": added_lines("0.17.1", V5),
        "162": added_lines("0.17.1", V6),
        "141": added_lines("0.17.1"),
        "0.98": largest_bucket("llama3_8b_tp1", 8),
        "2.68": largest_bucket("llama3_8b_tp1", 1024),
        "1024": largest_bucket("llama3_8b_tp1", 1024),
        "0.28": largest_bucket("llama3_70b_tp8", 8),
        "5.06": largest_bucket("gpt3_175b_tp8_pp8", 8),
    },
    "0.19": {
        "0.0": "tests/unit_tests/test_grad_data_guards.py::test_019_pristine_forced_sync_before_step_zeroes_every_grad",
        "0.11": audit(_8B, 8, "pristine-0.19"),
        "784": audit(_8B, 8, "pristine-0.19"),
        "629": audit(_8B, 8, "pristine-0.19"),
        "155": audit(_8B, 8, "series-0.19"),
        "98": audit(_8B, 8, "series-0.19"),
        "29.92": audit(_8B, 8, "pristine-0.19"),  # GiB zeroed per step
        "14.96": audit(_8B, 8, "series-0.19"),
        "195": audit(_8B, 8, "series-0.19"),
        "287": added_lines("0.19", V5),
        "169": added_lines("0.19", V6),
        "140": added_lines("0.19"),
        "0.98": largest_bucket("llama3_8b_tp1", 8),
        "2.68": largest_bucket("llama3_8b_tp1", 1024),
        "1024": largest_bucket("llama3_8b_tp1", 1024),
        "0.28": largest_bucket("llama3_70b_tp8", 8),
        "5.06": largest_bucket("gpt3_175b_tp8_pp8", 8),
    },
}


def message_numbers(text: str) -> set:
    """The numbers (NUMBER) of a patch file's message: its subject and body, without the
    provenance and Signed-off-by trailers."""
    head, rest = text.split("\n\n", 1)
    subject = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.+(?:\n .+)*)", head, flags=re.M)
    body = rest.split("\n---\n", 1)[0]
    lines = [subject.group(1) if subject else ""] + [
        ln for ln in body.splitlines() if not TRAILERS.match(ln)
    ]
    return {
        n for n in NUMBER.findall("\n".join(lines)) if len(n) > 1 and not NOT_NUMBERS.fullmatch(n)
    }


def audit_row(section: str, dp: int, tree: str) -> str:
    """The report row audit(section, dp, tree) names, or AssertionError saying what is missing."""
    text = AUDIT_REPORT.read_text()
    start = text.find(f"\n## {section}\n")
    assert start >= 0, f"no section {section!r} in {AUDIT_REPORT}"
    end = text.find("\n## ", start + 1)
    for row in text[start : end if end > 0 else None].splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0].split(" ")[0] == str(dp) and cells[1] == tree:
            return row
    raise AssertionError(f"no row DP {dp}, tree {tree} under {section!r} in {AUDIT_REPORT}")


def test_message_numbers_rule():
    """What counts as a number of a message, and what does not."""
    text = (
        "From: A <a@b.org>\nSubject: [PATCH] ddp: save 2.5 GiB\n\n"
        "megatron-core 0.19.2 (core_v0.19.0, in 0.19 and #3751, patch 0004) on 2 ranks at TP 1,\n"
        "Llama-3-8B, fp32 grads, 16-byte slots: 784 calls (629 zero-size) at DP 512; grad\n"
        "norm 0.0 instead of 4.291256; 14.96 GiB.\n\n"
        "Origin: #4609, 2026\nLast-Update: 2026-12-05\n\nSigned-off-by: A <a@b.org>\n---\n 42 +\n"
    )
    assert message_numbers(text) == {"2.5", "784", "629", "512", "0.0", "4.291256", "14.96"}


@pytest.mark.parametrize("base", BASES)
def test_every_message_number_is_in_the_table(base):
    """Per patch of the base's series: the numbers its message states == the table's."""
    table = MESSAGE_NUMBERS[base]
    patches = {p.name[:4]: p for p in series_patches(base=base)}
    bad = []
    for key, patch in patches.items():
        stated, listed = message_numbers(patch.read_text()), set(table.get(key, {}))
        if stated - listed:
            bad.append(f"{base} {key}: stated, not in MESSAGE_NUMBERS: {sorted(stated - listed)}")
        if listed - stated:
            bad.append(
                f"{base} {key}: in MESSAGE_NUMBERS, no longer stated: {sorted(listed - stated)}"
            )
    bad += [f"{base} {key}: no such patch" for key in set(table) - set(patches)]
    assert not bad, "\n".join(bad)


def source_holds(number: str, source) -> str:
    """'' if `source` holds `number`, else what is wrong."""
    if source[0] == "audit":
        row = audit_row(*source[1:])
        return (
            "" if number in re.split(r"[\s|/()]+", row) else f"{number} not in the audit row {row}"
        )
    if source[0] == "bucket":
        import json

        cells = json.loads(AUDIT_REPORT.with_suffix(".json").read_text())["cells"]
        cell = next(
            c for c in cells if (c["tree"], c["model"], c["dp"]) == ("pristine-0.17.1", *source[1:])
        )
        numel = max(b["param_numel"] for b in cell["buckets"] if b["layerwise"])
        got = {f"{numel * 2 / 2**30:.2f}", str(source[2])}
        return (
            ""
            if number in got
            else f"{number} not in {sorted(got)} (largest bucket of {source[1:]})"
        )
    _, base, rev = source
    if rev:
        names = subprocess.run(
            ["git", "show", f"{rev}:patches/{base}/series"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        ).stdout.split()
        texts = [
            subprocess.run(
                ["git", "show", f"{rev}:patches/{base}/{n}"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
            ).stdout
            for n in names
            if not n.startswith("#")
        ]
    else:
        texts = [p.read_text() for p in series_patches(base=base)]
    added = added_lines_of(
        base, [t for t in texts if re.search(r"^diff --git a/megatron/", t, re.M)]
    )
    return (
        ""
        if number == str(added)
        else f"{number} != {added} lines added under megatron/core at {rev or 'HEAD'}"
    )


def added_lines_of(base: str, patch_texts: list) -> int:
    """Lines added under megatron/core by the patches (texts) on the base's pristine tree, as
    `git diff --stat` counts them: the whole series against pristine."""
    import tempfile
    from pathlib import Path

    from harness.trees import _tree_with_patches

    pristine = tree_parent(BASES[base][0])
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, text in enumerate(patch_texts):
            paths.append(Path(tmp) / f"{i:04d}.patch")
            paths[-1].write_text(text)
        tree = _tree_with_patches(pristine, paths, Path(tmp) / "tree")
        touched = set(re.findall(r"^\+\+\+ b/(megatron/core/\S+)", "\n".join(patch_texts), re.M))
        added = 0
        for rel in touched:
            numstat = subprocess.run(
                ["git", "diff", "--no-index", "--numstat", str(pristine / rel), str(tree / rel)],
                capture_output=True,
                text=True,
            ).stdout
            added += int(numstat.split()[0])
        return added


def cover_numbers(base: str) -> set:
    """The numbers of the cover letter's subject and blurb (the shortlog and diffstat below
    are generated)."""
    text = (REPO_ROOT / "patches" / base / COVER).read_text()
    blurb = re.split(r"^\S.* \(\d+\):$", text, maxsplit=1, flags=re.M)[0]
    return message_numbers(blurb + "\n---\n")


@pytest.mark.parametrize("base", BASES)
def test_every_cover_letter_number_is_listed_and_true(base):
    """The cover letter's numbers == COVER_NUMBERS[base], and each source holds its number."""
    stated, listed = cover_numbers(base), set(COVER_NUMBERS[base])
    assert stated == listed, (sorted(stated - listed), sorted(listed - stated))
    bad = []
    for number, source in COVER_NUMBERS[base].items():
        if isinstance(source, tuple):
            bad.append(source_holds(number, source))
        elif not re.search(
            rf"^def {re.escape(source.partition('::')[2])}\(",
            (REPO_ROOT / source.partition("::")[0]).read_text(),
            re.M,
        ):
            bad.append(f"{number}: no test {source}")
    assert not [b for b in bad if b], [b for b in bad if b]


@pytest.mark.parametrize("base", BASES)
def test_every_listed_number_has_its_source(base):
    """An audit source's report row holds the number (as a cell value); a node id names a
    test function that exists."""
    bad = []
    for key, numbers in MESSAGE_NUMBERS[base].items():
        for number, source in numbers.items():
            if isinstance(source, tuple):
                why = source_holds(number, source)
                if why:
                    bad.append(f"{base} {key}: {why}")
                continue
            path, _, name = source.partition("::")
            func = name.split("[")[0]
            src = REPO_ROOT / path
            if not (
                src.is_file() and re.search(rf"^def {re.escape(func)}\(", src.read_text(), re.M)
            ):
                bad.append(f"{base} {key}: {number}: no test {source}")
    assert not bad, "\n".join(bad)
