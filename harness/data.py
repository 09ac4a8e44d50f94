"""Offline training data: stdlib docstrings -> byte-level BPE -> Megatron indexed dataset.

The functional tests must train on real text on any fresh machine, without network. The
pinned interpreter's standard library carries about 1.7 MB of English in its docstrings;
this module turns it into the three artifacts Megatron's GPT pretraining path reads:

    <stdlib of sys.base_prefix>/**/*.py        (tests, site-packages excluded)
        | ast.parse, ast.get_docstring (module, class, function; cleandoc'ed)
        v
    corpus.jsonl                 {"text": ...}, one line per module (its docstrings
        |                        joined by a blank line), modules in sorted-path order
        | tokenizers.ByteLevelBPETokenizer, trained single-threaded
        v
    tokenizer/vocab.json         GPT-2 format {token: id}; "<|endoftext|>" is the LAST id,
    tokenizer/merges.txt         as in GPT-2 ("#version: 0.2" header, one merge a line)
    tokenizer/tokenizer.json     the same tokenizer in HF `tokenizers` single-file form
    tokenizer/tokenizer_config.json   lets transformers.AutoTokenizer load the folder
        | encode each document, append EOD, IndexedDatasetBuilder (megatron-core)
        v
    stdlib_docs_text_document.bin / .idx   uint16 tokens (DType.optimal_dtype(vocab))
    manifest.json                fingerprint of inputs + recipe, sha256 of every output

Everything lands in ``build/data/`` (``--out``). A second call finds ``manifest.json``,
re-fingerprints the inputs (sha256 of every source file, the recipe parameters, this
file, and the library versions) and re-hashes the outputs; if all match it does nothing
(about 0.3 s). Otherwise it rebuilds into a temporary sibling folder and swaps it in, so
a crash never leaves a half-written dataset that looks valid. ``manifest.json`` holds no
timestamps or absolute output paths: the same inputs give the same folder, byte for byte
(``tests/unit_tests/test_data.py`` builds twice and compares).

Tokenizer flags. megatron-core 0.17.1 cannot load GPT-2 vocab/merges files offline:
``--tokenizer-type GPT2BPETokenizer`` goes through ``MegatronHFTokenizer``, which calls
``transformers.AutoTokenizer.from_pretrained("gpt2", ...)`` (needs the ``transformers``
package and the Hugging Face hub), passes the vocab path where the merges path belongs
(``_get_merges_file(tokenizer_name, vocab_file)``) and spells the keyword ``merge_files``,
so the merges would be ignored anyway. Training only needs the vocabulary size and the EOD
id from the tokenizer (the tokens are already in the ``.bin``), and because EOD is the last
id, megatron's own ``NullTokenizer`` reproduces both exactly: ``--tokenizer-type
NullTokenizer --vocab-size <eod_id>`` gives ``eod == eod_id`` and ``vocab_size == eod_id + 1``.
That is what :meth:`DataArtifacts.megatron_args` returns. Where ``transformers`` is
installed, ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <tokenizer dir>``
loads the real BPE offline as well (see :meth:`DataArtifacts.hf_tokenizer_args`).

CLI: ``scripts/prepare_data.sh [--out DIR] [--vocab-size N] [--max-modules N] [--force]``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

# Tokenizer training must be reproducible byte for byte. It measured identical with 1 and
# 2 threads on tokenizers 0.23.3, but a single thread removes the question altogether and
# costs < 0.5 s. These must be set before `tokenizers` starts its rayon pool.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "build" / "data"
EOD_TOKEN = "<|endoftext|>"
DATASET_PREFIX = "stdlib_docs_text_document"
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
# Directory names skipped while walking the stdlib. Test suites are mostly code and
# assertion strings, not prose; site-packages is not the standard library.
EXCLUDED_DIRS = ("__pycache__", "site-packages", "test", "tests", "idle_test")

# Output files, relative to the output folder. Every one is hashed into the manifest.
OUTPUT_FILES = (
    "corpus.jsonl",
    "tokenizer/vocab.json",
    "tokenizer/merges.txt",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    f"{DATASET_PREFIX}.bin",
    f"{DATASET_PREFIX}.idx",
)


class DataError(RuntimeError):
    """The data could not be built or a built folder is inconsistent."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Parameters that determine the output bytes. All of them go into the fingerprint.

    Args:
        vocab_size: tokenizer vocabulary size *including* the EOD token (an upper bound:
            on a small corpus BPE may run out of pairs earlier).
        min_frequency: minimum pair count for a BPE merge.
        max_modules: keep only the first N modules (sorted path order) that have
            docstrings; None keeps all. For fast tests.
        stdlib_root: folder to walk; None means the stdlib of the interpreter this venv
            was made from (``sys.base_prefix``).
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    max_modules: int | None = None
    stdlib_root: str | None = None

    def resolved_root(self) -> Path:
        if self.stdlib_root is not None:
            return Path(self.stdlib_root)
        base = {"installed_base": sys.base_prefix, "base": sys.base_prefix}
        return Path(sysconfig.get_paths(vars=base)["stdlib"])


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
    """

    out_dir: Path
    data_prefix: Path
    vocab_file: Path
    merge_file: Path
    tokenizer_dir: Path
    vocab_size: int
    eod_id: int
    stats: dict

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


# --------------------------------------------------------------------------- corpus


def iter_source_files(root: Path) -> Iterator[Path]:
    """Yield ``*.py`` files under ``root`` in sorted relative-path order (deterministic)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def module_docstrings(source: bytes, filename: str) -> list[str]:
    """Docstrings of a module, its classes and functions, in source order.

    Raises:
        SyntaxError: the file is not valid for this interpreter (a few stdlib files are
            deliberately broken, e.g. lib2to3 fixtures); callers skip and record those.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        tree = ast.parse(source, filename=filename)
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                found.append(doc)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def collect_corpus(recipe: Recipe) -> tuple[list[str], dict]:
    """Walk the stdlib and return (documents, source facts).

    One document per module: its docstrings joined by a blank line. Lone surrogates
    (possible in string literals) are replaced so every text is valid UTF-8.

    Returns:
        documents: list of str, sorted-path order.
        facts: ``inputs_sha256`` (sha256 over relative path + sha256 of every file read),
            ``files`` (count), ``skipped`` (relative paths that did not parse).
    """
    root = recipe.resolved_root()
    if not root.is_dir():
        raise DataError(f"stdlib folder not found: {root}")
    docs: list[str] = []
    skipped: list[str] = []
    inputs = hashlib.sha256()
    n_files = 0
    for path in iter_source_files(root):
        rel = path.relative_to(root).as_posix()
        source = path.read_bytes()
        inputs.update(f"{rel}\0{hashlib.sha256(source).hexdigest()}\n".encode())
        n_files += 1
        try:
            parts = module_docstrings(source, rel)
        except (SyntaxError, ValueError):
            skipped.append(rel)
            continue
        if not parts:
            continue
        text = "\n\n".join(parts).encode("utf-8", "replace").decode("utf-8")
        docs.append(text)
        if recipe.max_modules is not None and len(docs) >= recipe.max_modules:
            break
    if not docs:
        raise DataError(f"no docstrings found under {root}")
    return docs, {"inputs_sha256": inputs.hexdigest(), "files": n_files, "skipped": skipped}


def fingerprint_inputs(recipe: Recipe) -> dict:
    """Everything the outputs depend on, cheap to recompute (full build: hashing only).

    A full build reads every source file, so hashing them all matches what the build
    recorded. A ``max_modules`` build reads only a prefix; that prefix is found by
    collecting the (small) corpus again.
    """
    if recipe.max_modules is not None:
        return _fingerprint(recipe, collect_corpus(recipe)[1]["inputs_sha256"])
    root = recipe.resolved_root()
    inputs = hashlib.sha256()
    for path in iter_source_files(root):
        rel = path.relative_to(root).as_posix()
        inputs.update(f"{rel}\0{_sha256_file(path)}\n".encode())
    return _fingerprint(recipe, inputs.hexdigest())


def _fingerprint(recipe: Recipe, inputs_sha256: str) -> dict:
    import numpy
    import tokenizers

    return {
        "recipe": dataclasses.asdict(recipe),
        "python": sys.version.split()[0],
        "stdlib_root": str(recipe.resolved_root()),
        "inputs_sha256": inputs_sha256,
        "builder_sha256": _sha256_file(Path(__file__)),
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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _build_into(folder: Path, recipe: Recipe) -> dict:
    """Build every output into ``folder`` (empty) and return the manifest dict."""
    docs, facts = collect_corpus(recipe)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    eod_id = train_tokenizer(docs, recipe, folder / "tokenizer")
    tokens = write_indexed_dataset(docs, folder / "tokenizer", eod_id, folder / DATASET_PREFIX)
    fingerprint = _fingerprint(recipe, facts["inputs_sha256"])
    return {
        "schema": MANIFEST_SCHEMA,
        "fingerprint": fingerprint,
        "stats": {
            "documents": len(docs),
            "corpus_bytes": sum(len(t.encode("utf-8")) for t in docs),
            "tokens": tokens,
            "vocab_size": eod_id + 1,
            "eod_id": eod_id,
            "source_files": facts["files"],
            "skipped_unparsable": facts["skipped"],
        },
        "outputs": {rel: _sha256_file(folder / rel) for rel in OUTPUT_FILES},
    }


def _write_manifest(folder: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (folder / MANIFEST).write_text(text, encoding="utf-8")


def check_built(out_dir: Path, recipe: Recipe) -> tuple[bool, str]:
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
    want = fingerprint_inputs(recipe)
    have = manifest.get("fingerprint", {})
    for key, value in want.items():
        if have.get(key) != value:
            return False, f"input changed: {key}"
    for rel, sha in manifest.get("outputs", {}).items():
        file = out_dir / rel
        if not file.is_file() or _sha256_file(file) != sha:
            return False, f"output missing or modified: {rel}"
    if set(manifest.get("outputs", {})) != set(OUTPUT_FILES):
        return False, "output list changed"
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
    )


def prepare(
    out_dir: Path | str = DEFAULT_OUT, recipe: Recipe = Recipe(), force: bool = False, log=print
) -> DataArtifacts:
    """Build the data into ``out_dir`` unless an identical valid build is already there.

    Concurrent callers serialize on ``<out_dir>.lock``. The build happens in a temporary
    sibling folder that replaces ``out_dir`` only when complete.

    Raises:
        DataError: inputs missing or an internal consistency check failed.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out_dir) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.perf_counter()
        valid, reason = check_built(out_dir, recipe)
        if valid and not force:
            log(f"[data] {out_dir}: up to date ({time.perf_counter() - t0:.2f} s)")
            return artifacts_of(out_dir)
        log(f"[data] building {out_dir} ({'forced' if force else reason})")
        tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
        os.chmod(tmp, 0o755)
        try:
            manifest = _build_into(tmp, recipe)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.data", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--vocab-size", type=int, default=Recipe.vocab_size)
    parser.add_argument("--min-frequency", type=int, default=Recipe.min_frequency)
    parser.add_argument("--max-modules", type=int, default=None, help="small subset (tests)")
    parser.add_argument("--stdlib-root", default=None, help="walk this folder instead")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    recipe = Recipe(args.vocab_size, args.min_frequency, args.max_modules, args.stdlib_root)
    try:
        art = prepare(args.out, recipe, force=args.force)
    except DataError as e:
        print(f"[data] ERROR: {e}", file=sys.stderr)
        return 1
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
