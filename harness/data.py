"""Training data: text of the pinned megatron-core wheel -> byte-level BPE -> Megatron indexed dataset.

The source is a file every machine gets byte for byte from the lock: the megatron-core
wheel named in ``requirements/megatron-core.lock`` (``MCORE_WHEEL``), checked against its
``MCORE_WHEEL_SHA256`` before anything is read (``scripts/setup.sh`` downloads it into
``build/wheels/``). The text is read straight from the zip, so it does not depend on the
interpreter that runs this module:

    megatron_core-0.17.1-*.whl                  (sha256 pinned in the lock)
        | members under megatron/, sorted by name; one document each:
        |   *.py  every triple-quoted string literal without b/f prefix (docstrings,
        |         mostly), found by a scanner of our own (no ast/tokenize), dedented
        |   *.md  the whole file
        v
    corpus.jsonl                 {"text": ...}, one line per document (about 4,800: enough
        |                        that megatron's 949,50,1 split leaves documents in every split)
        | tokenizers.ByteLevelBPETokenizer, trained single-threaded
        v
    tokenizer/vocab.json         GPT-2 format {token: id}; "<|endoftext|>" is the LAST id,
    tokenizer/merges.txt         as in GPT-2 ("#version: 0.2" header, one merge a line)
    tokenizer/tokenizer.json     the same tokenizer in HF `tokenizers` single-file form
    tokenizer/tokenizer_config.json   lets transformers.AutoTokenizer load the folder
        | encode each document, append EOD, IndexedDatasetBuilder (megatron-core)
        v
    mcore_docs_text_document.bin / .idx   uint16 tokens (DType.optimal_dtype(vocab))
    manifest.json                fingerprint of inputs + recipe, sha256 of every output

Invariants:
- The corpus step uses only the standard library and ASCII-only text rules (no Unicode
  database lookups, whose tables change between Python releases), so any Python >= 3.10
  writes the same ``corpus.jsonl`` bytes (``--corpus-only``; a unit test runs it under a
  second interpreter). Token ids then depend only on the pinned ``tokenizers`` (an abi3
  wheel: one binary for every Python version) and the recipe.
- The same inputs give the same folder byte for byte: ``manifest.json`` holds no
  timestamps or absolute paths. A second call re-fingerprints the inputs (wheel sha256,
  recipe, this file, library versions) and re-hashes the outputs; if all match it does
  nothing. Otherwise it rebuilds into a temporary sibling folder and swaps it in, so a
  crash never leaves a half-written dataset that looks valid.
- :func:`provenance` is what ``golden_data.json`` records; :func:`provenance_mismatch`
  says whether the data differs from a recorded one, at which step and what to do.

Tokenizer flags. megatron-core 0.17.1 cannot load GPT-2 vocab/merges files offline:
``--tokenizer-type GPT2BPETokenizer`` goes through ``MegatronHFTokenizer``, which calls
``transformers.AutoTokenizer.from_pretrained("gpt2", ...)``. Training only needs the
vocabulary size and the EOD id (the tokens are already in the ``.bin``), and because EOD is
the last id, megatron's ``NullTokenizer`` reproduces both: ``--tokenizer-type NullTokenizer
--vocab-size <eod_id>`` gives ``eod == eod_id`` and ``vocab_size == eod_id + 1``
(:meth:`DataArtifacts.megatron_args`). Where ``transformers`` is installed,
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <tokenizer dir>`` loads the real
BPE offline (:meth:`DataArtifacts.hf_tokenizer_args`).

CLI: ``scripts/prepare_data.sh [--out DIR] [--vocab-size N] [--max-documents N] [--force]``
or ``python -m harness.data --corpus-only FILE`` (standard library only).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator, Sequence

# Tokenizer training must be reproducible byte for byte. A single thread removes any
# question of merge order between threads and costs < 0.5 s. These must be set before
# `tokenizers` starts its rayon pool.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "build" / "data"
LOCK_FILE = REPO_ROOT / "requirements" / "megatron-core.lock"
WHEEL_DIR = REPO_ROOT / "build" / "wheels"
EOD_TOKEN = "<|endoftext|>"
DATASET_PREFIX = "mcore_docs_text_document"
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 2
CORPUS_FILE = "corpus.jsonl"
# What the corpus is, in words: recorded in golden_data.json next to the hashes.
CORPUS_RULE = (
    "members under megatron/ sorted by name; one document per triple-quoted string literal "
    "without b/f prefix of each *.py (dedented, at least one space), one per *.md file"
)
# ASCII whitespace only: str.strip() with no argument consults the Unicode database.
_WS = " \t\n\r\f\v"
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_IDENT = _LETTERS | frozenset("0123456789_")
_SCAN = re.compile("[#'\"]")  # where a comment or a string literal can start

# Output files, relative to the output folder. Every one is hashed into the manifest.
OUTPUT_FILES = (
    CORPUS_FILE,
    "tokenizer/vocab.json",
    "tokenizer/merges.txt",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    f"{DATASET_PREFIX}.bin",
    f"{DATASET_PREFIX}.idx",
)


class DataError(RuntimeError):
    """The data could not be built, its source is missing or wrong, or a built folder is
    inconsistent. The message says what to do."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Parameters that determine the output bytes. All of them go into the fingerprint.

    Args:
        vocab_size: tokenizer vocabulary size *including* the EOD token (an upper bound:
            on a small corpus BPE may run out of pairs earlier).
        min_frequency: minimum pair count for a BPE merge.
        max_documents: keep only the first N documents (sorted member order); None keeps
            all. For fast tests.
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    max_documents: int | None = None


@dataclasses.dataclass(frozen=True)
class SourceWheel:
    """The pinned source artifact: ``path`` has the lock's ``sha256`` (checked)."""

    path: Path
    sha256: str
    lock_file: Path


@dataclasses.dataclass(frozen=True)
class DataArtifacts:
    """Paths and facts of a built data folder (what training needs to know).

    Attributes:
        out_dir: the folder.
        data_prefix: ``--data-path`` value (``.bin``/``.idx`` without suffix).
        vocab_file, merge_file: GPT-2 format tokenizer files.
        tokenizer_dir: folder with ``tokenizer.json`` + ``tokenizer_config.json``.
        vocab_size: number of token ids, EOD included (= ``eod_id + 1``).
        eod_id: id of ``<|endoftext|>``, appended after every document.
        stats: documents, corpus_bytes (UTF-8 of all texts), tokens (EOD included), ...
        manifest: the folder's ``manifest.json``.
    """

    out_dir: Path
    data_prefix: Path
    vocab_file: Path
    merge_file: Path
    tokenizer_dir: Path
    vocab_size: int
    eod_id: int
    stats: dict
    manifest: dict

    def megatron_args(self) -> list[str]:
        """Flags for ``megatron.training`` that work offline with the pinned packages.

        ``NullTokenizer`` with ``--vocab-size eod_id`` has exactly our vocab size and EOD
        id; see the module docstring for why ``GPT2BPETokenizer`` cannot be used.
        """
        return [
            "--data-path",
            str(self.data_prefix),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(self.eod_id),
        ]

    def hf_tokenizer_args(self) -> list[str]:
        """Flags loading the real BPE through megatron; needs ``transformers`` installed."""
        return [
            "--data-path",
            str(self.data_prefix),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(self.tokenizer_dir),
        ]


# --------------------------------------------------------------------------- source


def read_lock(lock_file: Path = LOCK_FILE) -> dict[str, str]:
    """``KEY=VALUE`` lines of the (shell-sourced) lock file; comments and blanks skipped.

    Raises:
        DataError: the file is missing or lacks MCORE_WHEEL / MCORE_WHEEL_SHA256.
    """
    try:
        text = lock_file.read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read {lock_file}: {e}") from e
    values = {}
    for line in text.split("\n"):
        line = line.strip(_WS)
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key.strip(_WS)] = value.strip(_WS).strip("\"'")
    missing = [k for k in ("MCORE_WHEEL", "MCORE_WHEEL_SHA256") if not values.get(k)]
    if missing:
        raise DataError(f"{lock_file} lacks {', '.join(missing)}")
    return values


def source_wheel(wheel: Path | None = None, lock_file: Path = LOCK_FILE) -> SourceWheel:
    """The pinned wheel, after checking its sha256 against the lock.

    Args:
        wheel: the file to use; None means ``build/wheels/<MCORE_WHEEL>``.

    Raises:
        DataError: the wheel is missing (run scripts/setup.sh) or its sha256 is not the
            lock's (delete it and rerun scripts/setup.sh).
    """
    lock = read_lock(lock_file)
    path = Path(wheel) if wheel is not None else WHEEL_DIR / lock["MCORE_WHEEL"]
    if not path.is_file():
        raise DataError(
            f"source wheel {path} not found; run scripts/setup.sh (it downloads "
            f"{lock['MCORE_WHEEL']} and checks its sha256 from {lock_file.name})"
        )
    sha = sha256_file(path)
    if sha != lock["MCORE_WHEEL_SHA256"]:
        raise DataError(
            f"sha256 of {path} is {sha}, but {lock_file} pins {lock['MCORE_WHEEL_SHA256']}; "
            f"delete the file and run scripts/setup.sh to download it again"
        )
    return SourceWheel(path=path, sha256=sha, lock_file=lock_file)


# --------------------------------------------------------------------------- corpus


def triple_quoted_strings(source: str) -> Iterator[tuple[str, str]]:
    """``(prefix, body)`` of every triple-quoted string literal in Python source, in order.

    A small scanner: skips comments and single-quoted strings (honouring backslash
    escapes, which also hold inside raw strings), so that quotes inside them are not
    taken as delimiters. ``prefix`` is the literal's prefix as written ("", "r", "f",
    "rb", ...). Escapes in ``body`` are left as written (source text, not values).
    Unterminated literals run to the end of the source.
    """
    n = len(source)
    i = 0
    while True:
        hit = _SCAN.search(source, i)
        if hit is None:
            return
        i = hit.start()
        c = source[i]
        if c == "#":
            nl = source.find("\n", i)
            i = n if nl < 0 else nl + 1
            continue
        k = i
        while k > 0 and i - k < 2 and source[k - 1] in _LETTERS:
            k -= 1
        prefix = source[k:i]
        if prefix.lower() not in ("", "r", "u", "b", "f", "br", "rb", "fr", "rf") or (
            k > 0 and source[k - 1] in _IDENT
        ):
            prefix = ""
        if not source.startswith(c * 3, i):
            # Single-quoted: ends at the quote or, unterminated, at the line end.
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            i = j + 1
            continue
        start = pos = i + 3
        while True:
            end = source.find(c * 3, pos)
            if end < 0:
                end = n
                break
            if not _escaped(source, start, end):
                break
            pos = end + 1
        yield prefix, source[start:end]
        i = end + 3


def _escaped(source: str, start: int, at: int) -> bool:
    """Is ``source[at]`` preceded by an odd number of backslashes (after ``start``)?"""
    b = at
    while b > start and source[b - 1] == "\\":
        b -= 1
    return (at - b) % 2 == 1


def clean_text(body: str) -> str:
    """Dedent a docstring-like text: first line stripped, common indent of the others
    removed, trailing whitespace and leading/trailing blank lines dropped; ``\\r\\n`` and
    tabs (to 8 columns) normalized. ASCII whitespace only."""
    lines = body.replace("\r\n", "\n").replace("\r", "\n").expandtabs(8).split("\n")
    lines = [line.rstrip(_WS) for line in lines]
    indents = [len(line) - len(line.lstrip(" ")) for line in lines[1:] if line]
    margin = min(indents) if indents else 0
    lines = [lines[0].strip(_WS)] + [line[margin:] for line in lines[1:]]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def member_texts(name: str, raw: bytes) -> list[str]:
    """The corpus documents of one wheel member (see CORPUS_RULE), in source order."""
    text = raw.decode("utf-8", "replace")
    if name.endswith(".md"):
        text = clean_text(text)
        return [text] if text else []
    docs = []
    for prefix, body in triple_quoted_strings(text):
        if "b" in prefix.lower() or "f" in prefix.lower():
            continue
        cleaned = clean_text(body)
        if " " in cleaned:  # skip empty strings and bare words
            docs.append(cleaned)
    return docs


def collect_corpus(wheel: SourceWheel, recipe: Recipe) -> list[str]:
    """The documents of the corpus, in sorted member order (see CORPUS_RULE).

    Raises:
        DataError: the wheel is not a readable zip or holds no text.
    """
    try:
        with zipfile.ZipFile(wheel.path) as zf:
            names = sorted(
                n
                for n in zf.namelist()
                if n.startswith("megatron/") and (n.endswith(".py") or n.endswith(".md"))
            )
            docs = []
            for name in names:
                docs += member_texts(name, zf.read(name))
                if recipe.max_documents is not None and len(docs) >= recipe.max_documents:
                    docs = docs[: recipe.max_documents]
                    break
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"cannot read {wheel.path} as a wheel: {e}") from e
    if not docs:
        raise DataError(f"no text found in {wheel.path}")
    return docs


def write_corpus(docs: Sequence[str], path: Path) -> None:
    """``{"text": ...}`` per line, UTF-8, ``\\n`` line ends, non-ASCII kept as is."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def _fingerprint(recipe: Recipe, wheel: SourceWheel) -> dict:
    import numpy
    import tokenizers

    return {
        "recipe": dataclasses.asdict(recipe),
        "source_wheel": wheel.path.name,
        "source_sha256": wheel.sha256,
        "builder_sha256": sha256_file(Path(__file__)),
        "tokenizers": tokenizers.__version__,
        "numpy": numpy.__version__,
        "megatron_core": _megatron_core_version(),
    }


def _megatron_core_version() -> str:
    """Version of the megatron tree on sys.path, read without importing megatron.core."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("megatron is not importable: put the repo root on PYTHONPATH")
    info = Path(list(spec.submodule_search_locations)[0]) / "core" / "package_info.py"
    scope: dict = {}
    exec(compile(info.read_text(), str(info), "exec"), scope)  # constants only
    return scope["__version__"]


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: Sequence[str], recipe: Recipe, tok_dir: Path) -> int:
    """Train byte-level BPE on ``docs`` and write the GPT-2 style files into ``tok_dir``.

    The BPE is trained with ``vocab_size - 1`` tokens and no special tokens; EOD is then
    appended as the last id, like GPT-2's 50256. Because no merge produces it, plain BPE
    encoding never emits EOD: only the dataset builder appends it.

    Returns:
        eod_id (int): id of ``<|endoftext|>`` (= number of BPE tokens).
    """
    from tokenizers import ByteLevelBPETokenizer

    tok_dir.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        docs,
        vocab_size=recipe.vocab_size - 1,
        min_frequency=recipe.min_frequency,
        special_tokens=[],
        show_progress=False,
    )
    with tempfile.TemporaryDirectory() as raw:
        bpe.save_model(raw)
        vocab = json.loads(Path(raw, "vocab.json").read_text(encoding="utf-8"))
        merges = Path(raw, "merges.txt").read_bytes()
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise DataError("trained vocab ids are not contiguous from 0")
    if EOD_TOKEN in vocab:
        raise DataError(f"{EOD_TOKEN!r} was learned as a regular token")
    eod_id = len(vocab)
    vocab[EOD_TOKEN] = eod_id
    ordered = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    (tok_dir / "vocab.json").write_text(json.dumps(ordered, ensure_ascii=False), encoding="utf-8")
    (tok_dir / "merges.txt").write_bytes(merges)

    full = load_bpe(tok_dir / "vocab.json", tok_dir / "merges.txt", with_eod=True)
    if full.token_to_id(EOD_TOKEN) != eod_id:
        raise DataError(f"reloaded tokenizer maps {EOD_TOKEN!r} to {full.token_to_id(EOD_TOKEN)}")
    full.save(str(tok_dir / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOD_TOKEN,
        "eos_token": EOD_TOKEN,
        "unk_token": EOD_TOKEN,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return eod_id


def load_bpe(vocab_file: Path, merge_file: Path, with_eod: bool):
    """Load the GPT-2 style files with HF ``tokenizers`` (the same pre-tokenizer as GPT-2).

    Args:
        with_eod: register ``<|endoftext|>`` as a special token, so that the literal
            string in text encodes to EOD and decoding can skip it. The dataset builder
            uses ``with_eod=False`` so that document text can never produce EOD.
    """
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(str(vocab_file), str(merge_file))
    if with_eod:
        tok.add_special_tokens([EOD_TOKEN])
    return tok


# --------------------------------------------------------------------------- dataset


def write_indexed_dataset(docs: Sequence[str], tok_dir: Path, eod_id: int, prefix: Path) -> int:
    """Encode ``docs`` and write ``prefix.bin``/``prefix.idx`` with megatron-core's builder.

    One document = one sequence = its tokens followed by EOD (what upstream's
    ``tools/preprocess_data.py --append-eod`` writes). Token dtype is
    ``DType.optimal_dtype(vocab_size)``: uint16 for our 4096 ids.

    Returns:
        number of tokens written, EOD included.
    """
    import numpy

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    plain = load_bpe(tok_dir / "vocab.json", tok_dir / "merges.txt", with_eod=False)
    dtype = DType.optimal_dtype(eod_id + 1)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    total = 0
    for enc in plain.encode_batch(list(docs)):
        ids = numpy.asarray(enc.ids + [eod_id], dtype=dtype)
        if (ids[:-1] == eod_id).any():
            raise DataError("document text encoded to EOD")
        builder.add_document(ids, [ids.size])
        total += ids.size
    builder.finalize(str(prefix) + ".idx")
    return total


# --------------------------------------------------------------------------- build + cache


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _build_into(folder: Path, recipe: Recipe, wheel: SourceWheel) -> dict:
    """Build every output into ``folder`` (empty) and return the manifest dict."""
    docs = collect_corpus(wheel, recipe)
    write_corpus(docs, folder / CORPUS_FILE)
    eod_id = train_tokenizer(docs, recipe, folder / "tokenizer")
    tokens = write_indexed_dataset(docs, folder / "tokenizer", eod_id, folder / DATASET_PREFIX)
    return {
        "schema": MANIFEST_SCHEMA,
        "fingerprint": _fingerprint(recipe, wheel),
        "stats": {
            "documents": len(docs),
            "corpus_bytes": sum(len(t.encode("utf-8")) for t in docs),
            "tokens": tokens,
            "vocab_size": eod_id + 1,
            "eod_id": eod_id,
        },
        "outputs": {rel: sha256_file(folder / rel) for rel in OUTPUT_FILES},
    }


def _write_manifest(folder: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (folder / MANIFEST).write_text(text, encoding="utf-8")


def check_built(out_dir: Path, recipe: Recipe, wheel: SourceWheel | None = None) -> tuple[bool, str]:
    """Is ``out_dir`` a complete build of ``recipe`` from the current inputs?

    Returns:
        (valid, reason): reason names the first mismatch when not valid.
    """
    path = out_dir / MANIFEST
    if not path.is_file():
        return False, f"no {MANIFEST}"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return False, f"unreadable {MANIFEST}: {e}"
    if manifest.get("schema") != MANIFEST_SCHEMA:
        return False, "manifest schema changed"
    want = _fingerprint(recipe, wheel or source_wheel())
    have = manifest.get("fingerprint", {})
    for key, value in want.items():
        if have.get(key) != value:
            return False, f"input changed: {key}"
    if set(manifest.get("outputs", {})) != set(OUTPUT_FILES):
        return False, "output list changed"
    for rel, sha in manifest["outputs"].items():
        file = out_dir / rel
        if not file.is_file() or sha256_file(file) != sha:
            return False, f"output missing or modified: {rel}"
    return True, "up to date"


def artifacts_of(out_dir: Path) -> DataArtifacts:
    """Read a built folder's manifest into :class:`DataArtifacts` (no validation)."""
    out_dir = Path(out_dir).resolve()
    manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    stats = manifest["stats"]
    return DataArtifacts(
        out_dir=out_dir,
        data_prefix=out_dir / DATASET_PREFIX,
        vocab_file=out_dir / "tokenizer" / "vocab.json",
        merge_file=out_dir / "tokenizer" / "merges.txt",
        tokenizer_dir=out_dir / "tokenizer",
        vocab_size=stats["vocab_size"],
        eod_id=stats["eod_id"],
        stats=stats,
        manifest=manifest,
    )


def prepare(
    out_dir: Path | str = DEFAULT_OUT,
    recipe: Recipe = Recipe(),
    force: bool = False,
    log=print,
    wheel: Path | None = None,
) -> DataArtifacts:
    """Build the data into ``out_dir`` unless an identical valid build is already there.

    Concurrent callers serialize on ``<out_dir>.lock``. The build happens in a temporary
    sibling folder that replaces ``out_dir`` only when complete.

    Args:
        wheel: source wheel to read (None: the lock's, in build/wheels); its sha256 must
            be the lock's either way.

    Raises:
        DataError: the source is missing or not the pinned one, or an internal
            consistency check failed.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    source = source_wheel(wheel)
    with open(str(out_dir) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.perf_counter()
        valid, reason = check_built(out_dir, recipe, source)
        if valid and not force:
            log(f"[data] {out_dir}: up to date ({time.perf_counter() - t0:.2f} s)")
            return artifacts_of(out_dir)
        log(f"[data] building {out_dir} ({'forced' if force else reason})")
        tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
        os.chmod(tmp, 0o755)
        try:
            manifest = _build_into(tmp, recipe, source)
            _write_manifest(tmp, manifest)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        s = manifest["stats"]
        log(
            f"[data] built in {time.perf_counter() - t0:.1f} s: {s['documents']} documents, "
            f"{s['corpus_bytes']} bytes of text, {s['tokens']} tokens, vocab {s['vocab_size']}"
        )
        return artifacts_of(out_dir)


# --------------------------------------------------------------------------- provenance


def provenance(artifacts: DataArtifacts) -> dict:
    """What the golden values' data is, as ``golden_data.json`` records it.

    Keys: ``source`` (wheel file, sha256, lock file, CORPUS_RULE), ``corpus`` (sha256,
    documents, bytes), ``tokenizer`` (library and version, model, recipe, sha256 of the
    vocab and merges), ``dataset`` (prefix, sha256 of .bin and .idx, tokens).
    """
    m = artifacts.manifest
    fp, out, stats = m["fingerprint"], m["outputs"], m["stats"]
    return {
        "source": {
            "file": fp["source_wheel"],
            "sha256": fp["source_sha256"],
            "pinned_in": "requirements/megatron-core.lock",
            "text": CORPUS_RULE,
        },
        "corpus": {
            "file": CORPUS_FILE,
            "sha256": out[CORPUS_FILE],
            "documents": stats["documents"],
            "bytes": stats["corpus_bytes"],
        },
        "tokenizer": {
            "library": f"tokenizers {fp['tokenizers']}",
            "model": "byte-level BPE (GPT-2 pre-tokenizer), EOD appended as the last id",
            "vocab_size": stats["vocab_size"],
            "recipe": fp["recipe"],
            "vocab.json": out["tokenizer/vocab.json"],
            "merges.txt": out["tokenizer/merges.txt"],
        },
        "dataset": {
            "prefix": DATASET_PREFIX,
            "writer": f"megatron-core {fp['megatron_core']} IndexedDatasetBuilder, numpy {fp['numpy']}",
            ".bin": out[f"{DATASET_PREFIX}.bin"],
            ".idx": out[f"{DATASET_PREFIX}.idx"],
            "tokens": stats["tokens"],
        },
    }


def provenance_mismatch(recorded: dict, actual: dict) -> str | None:
    """None when the datasets are the same bytes, else why they differ and what to do.

    Only the dataset hashes decide; the other fields locate the first step that differs
    (source wheel, corpus text, tokenizer, dataset writer).
    """
    want, have = recorded.get("dataset", {}), actual["dataset"]
    if "dataset" in recorded and (want.get(".bin"), want.get(".idx")) == (have[".bin"], have[".idx"]):
        return None
    head = "the training data differs from the data the golden values were made from"
    regen = (
        "if that change is intended, regenerate every golden file on purpose "
        "(scripts/run_functional_test.sh --update-golden all) and say why in the commit"
    )
    if "dataset" not in recorded:
        return f"{head}: golden_data.json is in an older format without dataset hashes; {regen}"
    rs, hs = recorded.get("source", {}), actual["source"]
    if rs.get("sha256") != hs["sha256"]:
        return (
            f"{head}: the source wheel is {hs['file']} (sha256 {hs['sha256'][:12]}), the golden "
            f"values used {rs.get('file')} (sha256 {str(rs.get('sha256'))[:12]}): "
            f"requirements/megatron-core.lock changed; {regen}"
        )
    if recorded.get("corpus", {}).get("sha256") != actual["corpus"]["sha256"]:
        return (
            f"{head}: the same source wheel gives another corpus text, so the corpus rule in "
            f"harness/data.py changed; {regen}"
        )
    rt, ht = recorded.get("tokenizer", {}), actual["tokenizer"]
    if (rt.get("vocab.json"), rt.get("merges.txt")) != (ht["vocab.json"], ht["merges.txt"]):
        if rt.get("library") != ht["library"]:
            return (
                f"{head}: the corpus is the same but the BPE differs: {ht['library']} is "
                f"installed, the golden values were made with {rt.get('library')}; install "
                f"the pinned packages (scripts/setup.sh, requirements/lock.txt)"
            )
        return (
            f"{head}: the corpus is the same but the BPE differs (recipe {ht['recipe']}, "
            f"golden {rt.get('recipe')}); {regen}"
        )
    return (
        f"{head}: corpus and tokenizer are the same but the .bin/.idx differ (writer "
        f"{have['writer']}, golden {want.get('writer')}); install the pinned packages "
        f"(scripts/setup.sh), or {regen}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.data", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--vocab-size", type=int, default=Recipe.vocab_size)
    parser.add_argument("--max-documents", type=int, default=None, help="small subset (tests)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--corpus-only",
        type=Path,
        metavar="FILE",
        help="write only the corpus (JSON lines) to FILE; needs only the standard library",
    )
    args = parser.parse_args(argv)
    recipe = Recipe(vocab_size=args.vocab_size, max_documents=args.max_documents)
    try:
        if args.corpus_only is not None:
            source = source_wheel()
            docs = collect_corpus(source, recipe)
            write_corpus(docs, args.corpus_only)
            print(f"[data] {args.corpus_only}: {len(docs)} documents from {source.path.name}")
            print(f"[data] sha256 {sha256_file(args.corpus_only)}")
            return 0
        art = prepare(args.out, recipe, force=args.force)
    except DataError as e:
        print(f"[data] ERROR: {e}", file=sys.stderr)
        return 1
    d = provenance(art)["dataset"]
    print(f"[data] dataset sha256: .bin {d['.bin']}  .idx {d['.idx']}")
    print("[data] megatron flags (offline, pinned packages):")
    print("  " + " ".join(art.megatron_args()))
    print("[data] GPT-2 format tokenizer files (HF tokenizers; megatron GPT2BPETokenizer")
    print("       cannot load them offline in 0.17.1, see harness/data.py):")
    print(f"  --vocab-file {art.vocab_file} --merge-file {art.merge_file}")
    print("[data] real BPE through megatron, where `transformers` is installed:")
    print("  " + " ".join(art.hf_tokenizer_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
