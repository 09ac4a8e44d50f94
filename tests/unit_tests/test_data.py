"""harness/data.py: pinned source wheel -> corpus -> BPE -> Megatron indexed dataset.

Builds a small subset (first 25 documents of the wheel, vocab 512) twice: once in-process
and once through scripts/prepare_data.sh in a subprocess, and checks the two folders are
byte-identical. The corpus is checked against an independent reading of the wheel (ast
docstrings), and under a second Python interpreter when one is installed. The rest reads
the artifacts back through independent paths (HF tokenizers from the GPT-2 files,
megatron's tokenizer builder, IndexedDataset and GPTDataset).
"""

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import numpy
import pytest

from harness import data

ROOT = Path(__file__).resolve().parents[2]
SUBSET = data.Recipe(vocab_size=512, max_documents=25)
SUBSET_CLI = ["--vocab-size", "512", "--max-documents", "25"]


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> data.DataArtifacts:
    out = tmp_path_factory.mktemp("data") / "a"
    return data.prepare(out, SUBSET, log=lambda *_: None)


@pytest.fixture(scope="module")
def documents(built) -> list[str]:
    lines = (built.out_dir / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines]


def test_build_is_byte_reproducible_across_processes(built, tmp_path):
    out_b = tmp_path / "b"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [str(ROOT / "scripts" / "prepare_data.sh"), "--out", str(out_b), *SUBSET_CLI],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--data-path" in proc.stdout
    digest_a, digest_b = _tree_digest(built.out_dir), _tree_digest(out_b)
    assert set(digest_a) == {*data.OUTPUT_FILES, data.MANIFEST}
    assert digest_a == digest_b


def test_second_prepare_is_a_noop_and_tampering_triggers_rebuild(built, tmp_path):
    out = tmp_path / "c"
    logs: list[str] = []
    data.prepare(out, SUBSET, log=logs.append)
    bin_file = out / f"{data.DATASET_PREFIX}.bin"
    mtime = bin_file.stat().st_mtime_ns
    data.prepare(out, SUBSET, log=logs.append)
    assert "up to date" in logs[-1] and bin_file.stat().st_mtime_ns == mtime

    bin_file.write_bytes(bin_file.read_bytes()[:-2])  # truncated dataset must not pass
    valid, reason = data.check_built(out, SUBSET)
    assert not valid and data.DATASET_PREFIX in reason
    data.prepare(out, SUBSET, log=logs.append)
    assert _tree_digest(out) == _tree_digest(built.out_dir)

    # A different recipe is a different build, not a cache hit.
    assert not data.check_built(out, data.Recipe(vocab_size=500, max_documents=25))[0]


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n"))


def test_corpus_holds_the_wheels_docstrings_in_member_order(documents):
    """The docstrings that ast finds in the wheel's members, in member order, are the
    documents (up to trailing whitespace, which the corpus drops); the corpus may hold
    other triple-quoted strings between them, but never reorders or drops a docstring."""
    wheel = data.source_wheel()
    expected = []
    with zipfile.ZipFile(wheel.path) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith("megatron/") and n.endswith((".py", ".md")))
        for name in names:
            raw = zf.read(name)
            if name.endswith(".md"):
                expected.append(raw.decode().strip())
                continue
            docstrings = [
                ast.get_docstring(node, clean=True)
                for node in ast.walk(ast.parse(raw))
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            ]
            # ast.walk is breadth-first; the corpus is in source order.
            with_pos = sorted(
                (raw.decode().find(d.split("\n")[0]), _normalized(d)) for d in docstrings if d and " " in d
            )
            expected += [d for _, d in with_pos]
            if len(expected) > 2 * len(documents):
                break
    assert len(documents) == 25
    assert documents[0] == expected[0] and documents[0].startswith("<div")  # megatron/core/README.md
    matched = 0
    for doc in documents:
        if matched < len(expected) and doc == expected[matched]:
            matched += 1
    extra = len(documents) - matched
    assert matched >= 20, (matched, extra)
    assert expected[:matched] == [d for d in documents if d in expected[:matched]]


def test_scanner_finds_triple_quoted_strings_only():
    source = (
        '"""Module doc."""\n'
        "# a comment with \"\"\" quotes\n"
        "x = 'it\\'s \"\"\" not a docstring'\n"
        'y = "say \\"hi\\""\n'
        "def f():\n"
        '    r"""Raw \\d doc with \\""" inside."""\n'
        "    return f\"\"\"{x} templated\"\"\", b\'\'\'bytes\'\'\', rb\"\"\"raw bytes\"\"\"\n"
        "class C:\n"
        "    \'\'\'\n"
        "    Indented\n"
        "        more\n"
        "    \'\'\'\n"
    )
    found = list(data.triple_quoted_strings(source))
    assert [p for p, _ in found] == ["", "r", "f", "b", "rb", ""]
    assert found[1][1] == 'Raw \\d doc with \\""" inside.'
    texts = data.member_texts("m.py", source.encode())
    assert texts == ["Module doc.", 'Raw \\d doc with \\""" inside.', "Indented\n    more"]


def _other_interpreters() -> list[str]:
    """Installed Pythons >= 3.10 of another minor version than this one."""
    found = {}
    names = [f"python3.{m}" for m in range(10, 16)]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    paths = [shutil.which(n) for n in names] + sorted(str(p) for p in pyenv.glob("3.*/bin/python"))
    for path in filter(None, paths):
        try:
            out = subprocess.run(
                [path, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
                capture_output=True, text=True, timeout=30,
            ).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if len(out) == 2 and (3, 10) <= (int(out[0]), int(out[1])) != sys.version_info[:2]:
            found.setdefault(tuple(out), path)
    return [found[k] for k in sorted(found)]


OTHER_PYTHONS = _other_interpreters()


@pytest.mark.skipif(not OTHER_PYTHONS, reason="no second Python >= 3.10 installed (python3.1x on PATH or pyenv)")
@pytest.mark.parametrize("python", OTHER_PYTHONS)
def test_corpus_is_the_same_bytes_under_another_interpreter(python, tmp_path):
    """The corpus of the whole wheel, built by another Python with the standard library
    only (-I -S: no site-packages), equals this interpreter's byte for byte."""
    here = tmp_path / "here.jsonl"
    assert data.main(["--corpus-only", str(here)]) == 0
    there = tmp_path / "there.jsonl"
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from harness import data; " \
        f"sys.exit(data.main(['--corpus-only', {str(there)!r}]))"
    proc = subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert there.read_bytes() == here.read_bytes()
    assert here.stat().st_size > 500_000


def test_source_wheel_must_have_the_locked_sha256(tmp_path):
    with pytest.raises(data.DataError, match="run scripts/setup.sh"):
        data.source_wheel(tmp_path / "absent.whl")
    real = data.source_wheel()
    tampered = tmp_path / real.path.name
    raw = bytearray(real.path.read_bytes())
    raw[-1] ^= 1
    tampered.write_bytes(bytes(raw))
    with pytest.raises(data.DataError, match="delete the file and run scripts/setup.sh"):
        data.source_wheel(tampered)
    with pytest.raises(data.DataError, match="delete the file"):
        data.prepare(tmp_path / "out", SUBSET, wheel=tampered, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_provenance_mismatch_only_when_the_dataset_differs(built):
    recorded = data.provenance(built)
    assert recorded["source"]["sha256"] == data.read_lock()["MCORE_WHEEL_SHA256"]
    assert recorded["dataset"][".bin"] == hashlib.sha256(
        built.data_prefix.with_suffix(".bin").read_bytes()).hexdigest()
    same_data = json.loads(json.dumps(recorded))
    same_data["tokenizer"]["library"] = "tokenizers 0.0.1"  # recorded elsewhere, same bytes
    assert data.provenance_mismatch(same_data, recorded) is None

    def changed(**stages):
        other = json.loads(json.dumps(recorded))
        other["dataset"][".bin"] = "0" * 64
        for stage, fields in stages.items():
            other[stage].update(fields)
        return data.provenance_mismatch(other, recorded)

    assert "requirements/megatron-core.lock changed" in changed(source={"sha256": "1" * 64})
    assert "corpus rule in harness/data.py changed" in changed(corpus={"sha256": "2" * 64})
    message = changed(tokenizer={"vocab.json": "3" * 64, "library": "tokenizers 0.0.1"})
    assert "made with tokenizers 0.0.1" in message and "scripts/setup.sh" in message
    assert "recipe" in changed(tokenizer={"merges.txt": "4" * 64})
    assert ".bin/.idx differ" in changed()
    for msg in (changed(), changed(source={"sha256": "1" * 64})):
        assert msg.startswith("the training data differs") and "--update-golden all" in msg
    assert "older format" in data.provenance_mismatch({"python": "3.12.1"}, recorded)


def test_gpt2_files_round_trip_and_eod_is_last_id(built, documents):
    vocab = json.loads(built.vocab_file.read_text(encoding="utf-8"))
    assert vocab[data.EOD_TOKEN] == max(vocab.values()) == len(vocab) - 1 == built.eod_id
    assert built.merge_file.read_text(encoding="utf-8").startswith("#version: 0.2\n")
    tok = data.load_bpe(built.vocab_file, built.merge_file, with_eod=True)
    for text in documents:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("a" + data.EOD_TOKEN).ids[-1] == built.eod_id

    from tokenizers import Tokenizer

    single = Tokenizer.from_file(str(built.tokenizer_dir / "tokenizer.json"))
    sample = documents[3][:500] + " ünïcödé \t\n"
    assert single.encode(sample).ids == tok.encode(sample).ids
    assert single.decode(single.encode(sample).ids) == sample


def _megatron_tokenizer_args(**overrides):
    args = dict(
        tokenizer_type=None,
        vocab_file=None,
        merge_file=None,
        tokenizer_model=None,
        tokenizer_metadata=None,
        tokenizer_special_tokens=None,
        vocab_size=None,
        tokenizer_hf_no_use_fast=False,
        tokenizer_hf_no_include_special_tokens=False,
        trust_remote_code=False,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        rank=0,
    )
    args.update(overrides)
    return types.SimpleNamespace(**args)


def _megatron_flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_megatron_builds_matching_tokenizer_from_printed_flags(built):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    flags = built.megatron_args()
    tok = build_tokenizer(
        _megatron_tokenizer_args(
            tokenizer_type=_megatron_flag(flags, "--tokenizer-type"),
            vocab_size=int(_megatron_flag(flags, "--vocab-size")),
        )
    )
    vocab = json.loads(built.vocab_file.read_text(encoding="utf-8"))
    assert tok.vocab_size == len(vocab)
    assert tok.eod == vocab[data.EOD_TOKEN]


def test_megatron_hf_tokenizer_loads_real_bpe_offline(built, documents, monkeypatch):
    pytest.importorskip("transformers", reason="transformers is not in requirements/lock.txt")
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags = built.hf_tokenizer_args()
    tok = build_tokenizer(
        _megatron_tokenizer_args(
            tokenizer_type=_megatron_flag(flags, "--tokenizer-type"),
            tokenizer_model=_megatron_flag(flags, "--tokenizer-model"),
        )
    )
    assert tok.eod == built.eod_id and tok.vocab_size == built.vocab_size
    text = documents[0]
    assert tok.detokenize(tok.tokenize(text)) == text


def test_indexed_dataset_reads_back_documents(built, documents):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(built.data_prefix))
    assert len(ds) == len(documents)
    assert list(ds.document_indices) == list(range(len(documents) + 1))
    tok = data.load_bpe(built.vocab_file, built.merge_file, with_eod=False)
    total = 0
    for i, text in enumerate(documents):
        ids = ds[i]
        assert ids.dtype == numpy.uint16
        assert ids[-1] == built.eod_id and built.eod_id not in ids[:-1]
        assert tok.decode(ids[:-1].tolist()) == text
        total += ids.size
    assert total == built.stats["tokens"]


def test_gpt_dataset_samples_come_from_the_bin(built, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    flags = built.megatron_args()
    tok = build_tokenizer(
        _megatron_tokenizer_args(
            tokenizer_type="NullTokenizer", vocab_size=int(_megatron_flag(flags, "--vocab-size"))
        )
    )
    seq = 32
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq,
        blend=([_megatron_flag(flags, "--data-path")], None),
        split="100,0,0",
        path_to_cache=str(tmp_path),
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [8, None, None], lambda: True, config
    ).build()
    # No `for d in ds`: IndexedDataset has no __iter__ and its __getitem__ does not
    # bounds-check, so the implicit iteration reads past the mmap and segfaults.
    ds = IndexedDataset(str(built.data_prefix))
    stream = numpy.concatenate([ds[i] for i in range(len(ds))]).astype(numpy.int64)
    assert len(train) >= 8  # GPTDataset rounds up to whole epochs
    for i in [*range(8), len(train) - 1]:
        sample = train[i]
        window = numpy.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])
        # A sample concatenates slices of (shuffled) documents; each slice ends at an EOD
        # or at the window's end and must occur verbatim in the .bin token stream.
        cuts = numpy.flatnonzero(window == built.eod_id) + 1
        for piece in numpy.split(window, cuts):
            if piece.size:
                assert _occurs_in(stream, piece), f"sample {i}: {piece.tolist()} not in the .bin"


def _occurs_in(stream: numpy.ndarray, piece: numpy.ndarray) -> bool:
    starts = numpy.flatnonzero(stream[: stream.size - piece.size + 1] == piece[0])
    return any((stream[s : s + piece.size] == piece).all() for s in starts)
