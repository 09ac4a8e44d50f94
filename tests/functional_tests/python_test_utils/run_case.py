"""Functional test runner: train a case on the pristine and the series tree, compare.

The main job of the harness (scripts/run_functional_test.sh calls this module). For each
test case folder ``tests/functional_tests/test_cases/<model>/<case>/``:

1. ``model_config.yaml`` (Megatron's layout: ENV_VARS, MODEL_ARGS, METRICS, TEST_TYPE;
   ours adds NPROC_PER_NODE and BASE) becomes a command line of Megatron-LM's own
   ``pretrain_gpt.py`` (from the checkout of the case's megatron-core base, ``BASES``:
   ``BASE: "0.19"`` trains 0.19.2 and 0.19.2 + patches/0.19 with core_v0.19.0's entry, no
   BASE 0.17.1 and its series with core_v0.17.1's; through
   ``harness/upstream_pretrain_gpt.py``, which only installs the CPU runtime layer and
   selects the megatron tree); ``${VAR}``
   in MODEL_ARGS expands to DATA_PATH, TENSORBOARD_PATH, CHECKPOINT_SAVE_PATH,
   CHECKPOINT_LOAD_PATH.
2. Both variants train through ``harness.launch``: CPU gloo ranks by default (``--device cpu``,
   forked by ``harness/fork_ranks.py``), NCCL on GPUs with ``--device cuda`` (torchrun). TEST_TYPE ``ckpt-resume`` trains N iterations saving
   at MODEL_ARGS --save-interval, then resumes from that checkpoint to N; the resumed
   steps must equal the straight run bit for bit.
3. The tensorboard event files become ``metrics.json`` / ``metrics_exact.json``
   (``tensorboard_reader``), compared exactly (series vs pristine) and per step against
   ``golden_values_<env>_<platform>.json`` (``checks``, ``verdicts``).
4. In the same runs the ranks record, per training step, the layer-wise param sync's
   megatron tensors, the NCCL temporaries the collective model gives for its calls and the
   step peak (``harness.param_sync_recorder``, ``param_sync/rank<R>.json``), reduced to
   ``memory.json`` (``memory_report``), printed next to the verdict (pristine vs series,
   MiB) and drawn in the plot's third panel. A case's EXPECT_PARAM_SYNC (kind -> group
   size) fails a run that recorded no such gather.

Outputs, per case: ``build/functional/<case>/{pristine,series}/`` (logs, tensorboard,
metrics, param-sync records, memory.json), ``comparison.json`` and ``loss_curves.png``. Exit code 0 only if every case is
"identical" (series == pristine exactly, both within golden tolerance).

``--update-golden`` rewrites the golden file from the runs, only if series == pristine
exactly, and prints the per-step diff of old and new values.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

from harness import launch, param_sync_recorder, trees
from harness.trees import REPO_ROOT

from . import checks, golden_schema, golden_update, memory_report, plot, tolerances, verdicts
from .checks import VARIANTS
from .formatting import format_table
from . import tensorboard_reader as tbr

CASES_DIR = REPO_ROOT / "tests" / "functional_tests" / "test_cases"
OUT_ROOT = REPO_ROOT / "build" / "functional"
DEFAULT_CASE = "gpt_dp2_bf16_fp32grad_overlap_layerwise"


@dataclass(frozen=True)
class Base:
    """A megatron-core base the cases train on (a case's ``BASE`` key).

    trees: variant ("pristine", "series") -> ``harness.trees`` label of its megatron tree
        ("pristine-<base>", "series-<base>").
    checkout: the Megatron-LM checkout whose ``pretrain_gpt.py`` runs (``scripts/setup.sh``
        builds it; the series does not touch ``pretrain_gpt.py``, so the pristine one serves
        both variants).
    default_case: the case the main job runs for this base when given no case.
    """

    name: str
    trees: Dict[str, str]
    checkout: Path
    default_case: str


BASES: Dict[str, Base] = {
    "0.19": Base("0.19", {v: f"{v}-0.19" for v in VARIANTS},
                 REPO_ROOT / "build" / "megatron-lm" / "core_v0.19.0",
                 "gpt019_dp2_bf16_fp32grad_overlap_legacy"),
    "0.17.1": Base("0.17.1", {v: f"{v}-0.17.1" for v in VARIANTS},
                   REPO_ROOT / "build" / "megatron-lm" / "core_v0.17.1", DEFAULT_CASE),
}
#: A case without a BASE key trains on this base.
DEFAULT_BASE = "0.17.1"
GOLDEN_NAME = {"cpu": "golden_values_cpu_gloo.json", "cuda": "golden_values_dgx_h200.json"}
# What the committed golden values were trained on (harness.data.provenance: source wheel,
# corpus, tokenizer, dataset sha256), written by --update-golden. A run on other data
# says so and why, instead of reporting a bare "outside golden tolerance".
GOLDEN_DATA = CASES_DIR / "golden_data.json"
# Exit code of main() when a case has no golden file for the device (nothing was trained).
EXIT_NO_GOLDEN = 3
TEST_TYPES = ("regular", "ckpt-resume")
#: How the main job's header says each TEST_TYPE (Megatron's names): a regular case trains once;
#: a ckpt-resume case trains, saves a checkpoint, and trains on from it in a second run.
TEST_TYPE_WORDS = {"regular": "one training run", "ckpt-resume": "trained, saved and resumed"}
# Per run, the folder the ranks write their param-sync records into (harness.param_sync_recorder).
RECORD_DIR = "param_sync"


class CaseConfigError(ValueError):
    """model_config.yaml is missing, unreadable or lacks a required key."""


@dataclass
class Case:
    """A parsed test case folder."""

    name: str
    folder: Path
    env_vars: Dict[str, str]
    nproc: int
    model_args: Dict[str, object]
    metrics: List[str]
    test_type: str
    # EXPECT_PARAM_SYNC: {kind: {"group_size": n}}: param-sync gathers each run must record
    # (memory_report.check_expected_syncs); empty: nothing required.
    expect_param_sync: Dict[str, Dict[str, int]] = field(default_factory=dict)
    base: str = DEFAULT_BASE

    @property
    def train_iters(self) -> int:
        return int(self.model_args["--train-iters"])

    def golden_path(self, device: str) -> Path:
        return self.folder / GOLDEN_NAME[device]


def find_case(name: str) -> Path:
    """Folder of test case `name` (searched under every model folder).

    Raises:
        CaseConfigError: no such case (lists the known ones).
    """
    hits = sorted(p.parent for p in CASES_DIR.glob(f"*/{name}/model_config.yaml"))
    if not hits:
        raise CaseConfigError(f"unknown test case {name!r}; known cases: {', '.join(all_cases())}")
    return hits[0]


def all_cases() -> List[str]:
    return sorted(p.parent.name for p in CASES_DIR.glob("*/*/model_config.yaml"))


def load_case(folder: Path) -> Case:
    """Parse ``folder/model_config.yaml``.

    Raises:
        CaseConfigError: file missing or invalid, a required key missing, unknown
            TEST_TYPE, or a ckpt-resume case without --save-interval.
    """
    path = folder / "model_config.yaml"
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CaseConfigError(f"{path}: {e}") from e
    missing = [k for k in ("MODEL_ARGS", "METRICS", "TEST_TYPE") if k not in (doc or {})]
    if missing:
        raise CaseConfigError(f"{path}: missing keys {missing}")
    if doc["TEST_TYPE"] not in TEST_TYPES:
        raise CaseConfigError(f"{path}: TEST_TYPE {doc['TEST_TYPE']!r} not in {TEST_TYPES}")
    if doc["TEST_TYPE"] == "ckpt-resume" and "--save-interval" not in doc["MODEL_ARGS"]:
        raise CaseConfigError(f"{path}: ckpt-resume needs --save-interval in MODEL_ARGS")
    expect = doc.get("EXPECT_PARAM_SYNC") or {}
    try:
        expect = {str(k): {"group_size": int(v["group_size"])} for k, v in expect.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CaseConfigError(f"{path}: EXPECT_PARAM_SYNC must map a kind to {{group_size: N}}: {e!r}") from e
    base = str(doc.get("BASE", DEFAULT_BASE))
    if base not in BASES:
        raise CaseConfigError(f"{path}: BASE {base!r} not in {sorted(BASES)}")
    unknown = sorted(set(expect) - set(param_sync_recorder.KINDS))
    if unknown:
        raise CaseConfigError(f"{path}: EXPECT_PARAM_SYNC kinds {unknown} not in {param_sync_recorder.KINDS}")
    return Case(
        name=folder.name,
        folder=folder,
        env_vars={k: str(v) for k, v in (doc.get("ENV_VARS") or {}).items()},
        nproc=int(doc.get("NPROC_PER_NODE", 2)),
        model_args=dict(doc["MODEL_ARGS"]),
        metrics=list(doc["METRICS"]),
        test_type=doc["TEST_TYPE"],
        expect_param_sync=expect,
        base=base,
    )


def expand_args(model_args: Dict[str, object], variables: Dict[str, str]) -> List[str]:
    """MODEL_ARGS dict -> argv list. True: bare flag; False/None: omitted; ${VAR} expanded.

    Raises:
        CaseConfigError: a ${VAR} with no value.
    """
    argv: List[str] = []
    for flag, value in model_args.items():
        if value is False or value is None:
            continue
        argv.append(flag)
        if value is True:
            continue
        text = str(value)

        def sub(m):
            if m.group(1) not in variables:
                raise CaseConfigError(f"{flag}: no value for ${{{m.group(1)}}}")
            return variables[m.group(1)]

        argv.append(re.sub(r"\$\{(\w+)\}", sub, text))
    return argv


class Progress:
    """Prints the newest "iteration N/M" line of a run's stdout every few seconds."""

    PATTERN = re.compile(rb"iteration\s+(\d+)/\s*(\d+)")

    def __init__(self, label: str, log: Path, interval_s: float = 5.0):
        self.label, self.log, self.interval_s = label, log, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._last = None

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                hits = self.PATTERN.findall(self.log.read_bytes()[-20000:])
            except OSError:
                continue
            if hits and hits[-1] != self._last:
                self._last = hits[-1]
                print(f"    {self.label}: iteration {int(hits[-1][0])}/{int(hits[-1][1])}", flush=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@dataclass
class VariantResult:
    metrics: Optional[golden_schema.Metrics] = None
    wall_s: float = 0.0
    failures: List[str] = field(default_factory=list)
    # memory.json of the run (memory_report), None when not recorded.
    memory: Optional[dict] = None


def last_iteration(stdout_log: Path) -> Optional[int]:
    """N of the last "iteration N/M" line in a run's stdout, or None."""
    try:
        hits = Progress.PATTERN.findall(stdout_log.read_bytes())
    except OSError:
        return None
    return int(hits[-1][0]) if hits else None


def failure_cause(stderr_log: Path) -> str:
    """The most telling line of a failed run's stderr: the last exception or abort line
    raised by a rank (torchrun's own ChildFailedError report is skipped)."""
    try:
        lines = stderr_log.read_text(errors="replace").splitlines()
    except OSError:
        return "no stderr log"
    pattern = re.compile(r"(Error|Exception|terminate called|Assertion|Signal \d+|Killed)")
    for line in reversed(lines):
        text = line.strip()
        if pattern.search(text) and not any(
            noise in text for noise in ("ChildFailedError", "elastic", "traceback :", "SIGTERM")
        ):
            return text[:300]
    return "no error line in stderr"


def run_variant(
    case: Case,
    variant,
    out_dir: Path,
    data_path: str,
    device: str,
    timeout_s: float,
    extra_env: Optional[Dict[str, str]] = None,
    record_memory: bool = True,
    runtime_flags: bool = True,
    label: Optional[str] = None,
) -> VariantResult:
    """Train one variant (tree name or mutant tree Path) and read its metrics.

    extra_env is merged over the case's ENV_VARS (measure_variation uses it).
    record_memory: the ranks record the param sync's memory per step
    (``harness.param_sync_recorder`` into ``out_dir/param_sync``), reduced to
    ``out_dir/memory.json``; a run that trained but left no records fails.

    A crashed rank, a timeout or unreadable event files become failure messages (the
    verdict is then "failed"), never an exception.
    """
    label = label or (variant if isinstance(variant, str) else f"mutant {Path(variant).name}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    res = VariantResult()
    variables = {
        "DATA_PATH": data_path,
        "TENSORBOARD_PATH": str(out_dir / "tensorboard"),
        "CHECKPOINT_SAVE_PATH": str(out_dir / "checkpoints"),
        "CHECKPOINT_LOAD_PATH": str(out_dir / "checkpoints"),
    }
    args = expand_args(case.model_args, variables)
    cpu = device == "cpu"
    record_dir = str(out_dir / RECORD_DIR) if record_memory else ""

    def read_metrics():
        return tbr.write_run_metrics(
            out_dir / "tensorboard", out_dir, tags=case.metrics, end_step=case.train_iters
        )

    try:
        print(f"  [{label}] training {case.train_iters} iterations on {case.nproc} ranks", flush=True)
        with Progress(label, out_dir / "stdout.log"):
            res.wall_s = launch.run_pretrain(
                variant, args, case.nproc, run_dir=out_dir, cpu=cpu, timeout_s=timeout_s,
                runtime_flags=runtime_flags, extra_env={**case.env_vars, param_sync_recorder.ENV_VAR: record_dir, **(extra_env or {})},
            )
        print(f"  [{label}] done in {res.wall_s:.1f} s", flush=True)
        res.metrics = read_metrics()
        if record_memory:
            try:
                res.memory = memory_report.write_run_memory(out_dir / RECORD_DIR, out_dir)
                res.failures += [f"{label}: {m}" for m in
                                 memory_report.check_expected_syncs(res.memory, case.expect_param_sync)]
            except memory_report.MemoryRecordError as e:
                res.failures.append(f"{label}: {e}")
        if case.test_type == "ckpt-resume":
            res.failures += resume_check(case, variant, label, out_dir, variables, cpu, timeout_s, res)
    except launch.LaunchError as e:
        # One line for the verdict; the command, log paths and stderr tail go to stdout.
        print(f"  [{label}] FAILED:\n{e}", flush=True)
        log_dir = out_dir / "resume" if (out_dir / "resume" / "stderr.log").exists() else out_dir
        done = last_iteration(log_dir / "stdout.log")  # tells a crash in training from one at exit
        res.failures.append(
            f"{label} run failed after iteration {done}: "
            f"{failure_cause(log_dir / 'stderr.log')} (logs in {log_dir})"
        )
        if log_dir == out_dir and done == case.train_iters:
            # Every training step was logged and the failure came after them (e.g. the
            # final evaluation's NaN check in upstream's loss function): compare those steps
            # too, so that a divergence during training is reported as such. The failure
            # stays: such a run is never "identical".
            try:
                res.metrics = read_metrics()
                if record_memory:
                    res.memory = memory_report.write_run_memory(out_dir / RECORD_DIR, out_dir)
            except (tbr.TensorboardReadError, memory_report.MemoryRecordError):
                pass
    except tbr.TensorboardReadError as e:
        res.failures.append(f"{label}: no metrics: {e}")
    return res


def resume_check(case, variant, label, out_dir, variables, cpu, timeout_s, straight) -> List[str]:
    """Resume from the checkpoint saved at --save-interval and train to N again.

    The straight run saved at save_interval (and at N); the resume run loads the
    checkpoint of iteration save_interval (--ckpt-step) and must reproduce the straight
    run's steps save_interval+1..N bit for bit on every metric of the exact check.
    """
    k = int(case.model_args["--save-interval"])
    resume_dir = out_dir / "resume"
    resume_vars = dict(variables, TENSORBOARD_PATH=str(resume_dir / "tensorboard"))
    # The resumed run must not overwrite the straight run's checkpoints.
    model_args = {**case.model_args, "--save": str(resume_dir / "checkpoints")}
    args = expand_args(model_args, resume_vars) + ["--ckpt-step", str(k)]
    print(f"  [{label}] resuming from iteration {k}", flush=True)
    with Progress(f"{label} (resume)", resume_dir / "stdout.log"):
        straight.wall_s += launch.run_pretrain(
            variant, args, case.nproc, run_dir=resume_dir, cpu=cpu, timeout_s=timeout_s,
            extra_env=case.env_vars,
        )
    resumed = tbr.read_run_metrics(
        resume_dir / "tensorboard", tags=case.metrics, start_step=k + 1, end_step=case.train_iters
    )
    failures = []
    for metric in checks.EXACT_REQUIRED:
        if metric not in resumed:
            failures.append(f"resume of {label}: {metric} not logged")
            continue
        for step, value in resumed[metric].values.items():
            want = straight.metrics[metric].values.get(step)
            if want is None or not checks.same_bits(value, want):
                failures.append(
                    f"resume of {label} differs from the straight run at step {step} "
                    f"({metric}: {want!r} straight, {value!r} resumed)"
                )
                break
    return failures


def run_case(
    name: str,
    device: str = "cpu",
    update_golden: bool = False,
    timeout_s: float = 900,
    series_tree=None,
    out_root: Path = OUT_ROOT,
    reuse_pristine: Optional[Path] = None,
    golden_path: Optional[Path] = None,
    model_args: Optional[Dict[str, object]] = None,
    extra_env: Optional[Dict[str, str]] = None,
    record_memory: bool = True,
    runtime_flags: bool = True,
    own=None,
) -> dict:
    """Run one case end to end; returns the comparison dict (also comparison.json).

    Args:
        name: test case folder name.
        device: "cpu" (gloo ranks, CPU runtime layer) or "cuda" (NCCL).
        update_golden: rewrite the golden file if series == pristine exactly.
        series_tree: None for the series tree, or a Path of a mutant tree (tests).
        reuse_pristine: a folder holding a pristine run's metrics_exact.json of this case to
            reuse instead of training the pristine tree again (mutant tests only).
        golden_path, model_args, extra_env: for the GPU check (harness/gpu_check): another
            golden file, MODEL_ARGS entries added or replaced, environment for the ranks.
        record_memory: record the param sync's memory per step in both runs
            (``memory.json``, the ``memory`` key of the comparison, the printed block and
            the plot's third panel); off for runs that only need a verdict (mutants).
        runtime_flags: prepend ``harness.launch.RUNTIME_FLAGS`` (local layers, no fused
            kernels); False trains with megatron's defaults (Transformer Engine, fused wgrad
            into ``main_grad``), for GPUs.
        own: a ``harness.own_tree.OwnTree`` (``--checkout PATH``): train its two scratch
            clones, PATH as it is and with the series, each with its own ``pretrain_gpt.py``;
            outputs under ``out_root/checkout-<name>-<commit>/``. Where PATH is not a release
            (``own.release`` False) the golden values are shown for information: the verdict is
            the bit-for-bit comparison alone (``golden_note`` in the comparison says how the
            runs stand against them).
    """
    from harness import data

    case = load_case(find_case(name))
    absent = missing_checkouts([name]) if own is None else []
    if absent:
        raise CaseConfigError(absent[0])
    if own is not None:
        if case.base != own.base:
            raise CaseConfigError(f"{name} is a case of megatron-core {case.base}; {own.label} takes "
                                  f"patches/{own.series.name}, whose cases have BASE {own.base!r}")
        if out_root == OUT_ROOT:  # a caller's own folder (the GPU check's) stays as given
            out_root = out_root / f"checkout-{own.source.name}-{own.head[:12]}"
    if model_args:
        case = replace(case, model_args={**case.model_args, **model_args})
    out = out_root / case.name
    out.mkdir(parents=True, exist_ok=True)
    artifacts = data.prepare(log=lambda m: None)
    data_path = str(artifacts.data_prefix)
    print(case_header(case, device, own), flush=True)
    data_note = None if update_golden else check_golden_data(artifacts)
    if data_note:
        print(f"  WARNING: {data_note}", flush=True)
    results: Dict[str, VariantResult] = {}
    for variant in VARIANTS:
        if variant == "pristine" and reuse_pristine is not None:
            results[variant] = VariantResult(
                metrics=tbr.load_run_metrics(reuse_pristine),
                memory=memory_report.load_run_memory(reuse_pristine) if record_memory else None,
            )
            continue
        base = BASES[case.base]
        tree = base.trees[variant] if variant == "pristine" or series_tree is None else Path(series_tree)
        checkout = base.checkout
        if own is not None:  # each clone is a whole checkout: its megatron and its pretrain_gpt.py
            tree = checkout = own.checkouts()[variant]
        results[variant] = run_variant(
            case, tree, out / variant, data_path, device, timeout_s,
            {"MEGATRON_LM_CHECKOUT": str(checkout), **(extra_env or {})}, record_memory,
            runtime_flags=runtime_flags, label=variant if own is not None else None,
        )
    failures = [f for r in results.values() for f in r.failures]
    rules = tolerances.rules_for(case.metrics)
    own_golden = golden_path is None  # a caller's own golden file has its own way to create it
    golden_path = golden_path or case.golden_path(device)
    have_metrics = all(r.metrics is not None for r in results.values())
    if update_golden:
        # Before the comparison, so that it is built once, against the new golden file.
        try:
            if not have_metrics:
                raise golden_update.GoldenUpdateRefused("a training run produced no metrics")
            diff = golden_update.update_golden(
                golden_path, results["pristine"].metrics, results["series"].metrics, rules
            )
            print(f"  golden values written to {golden_path}:\n{diff}")
            GOLDEN_DATA.write_text(json.dumps(data.provenance(artifacts), indent=1) + "\n")
        except golden_update.GoldenUpdateRefused as e:
            print(f"  REFUSED to update golden values: {e}", flush=True)
            failures.append(f"golden update refused: {e}")
    if have_metrics:
        comparison = verdicts.build_comparison(
            case.name, results["pristine"].metrics, results["series"].metrics, golden_path,
            rules, extra_failures=failures,
        )
    else:
        comparison = {
            "case": case.name, "verdict": "failed", "verdict_line": f"failed: {failures[0]}",
            "first_divergent_step": None, "first_divergence": None,
            "golden_file": str(golden_path), "metrics": {}, "failures": failures,
        }
    if comparison["verdict"] == "no_golden" and own_golden:
        comparison["verdict_line"] += f"; create it with: {update_golden_command(case.name, device)}"
    if own is not None and not own.release:
        comparison = golden_for_information(comparison)
    if data_note and comparison["verdict"] not in ("diverged", "no_golden"):
        comparison["failures"].append(data_note)
        comparison["verdict"] = "failed"
        comparison["verdict_line"] = f"failed: {data_note}"
    comparison["wall_s"] = {v: round(r.wall_s, 1) for v, r in results.items()}
    comparison["data"] = {"path": data_path, "provenance": data.provenance(artifacts)}
    memories = {v: r.memory for v, r in results.items()}
    comparison["memory"] = memories if record_memory else None
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
    curves = {
        "pristine": results["pristine"].metrics,
        "series": results["series"].metrics,
        "golden": golden_schema.load(golden_path) if golden_path.exists() else None,
    }
    base = BASES[case.base]
    version = trees.tree_version(base.trees["pristine"])  # MAJOR, MINOR, PATCH or None
    info = plot.RunInfo(
        case=case.name, base=case.base, version=".".join(map(str, version)) if version else "?",
        series=f"patches/{case.base}", ranks=case.nproc, device=device,
        verdict=comparison["verdict"], verdict_line=comparison["verdict_line"],
        trees={"pristine": base.trees["pristine"],
               "series": base.trees["series"] if series_tree is None else f"mutant tree {Path(series_tree).name}"},
    )  # fmt: skip
    if own is not None:
        info = replace(info, version=own.version, series=f"patches/{own.series.name}"
                       + ("" if own.release else " (three-way)"),
                       trees=own.tree_labels(),
                       released=own.release, golden_note=comparison.get("golden_note", ""))
    try:
        plot.plot_loss_curves(
            out / "loss_curves.png", curves, comparison["first_divergent_step"],
            memory=memories if record_memory else None, rules=rules, info=info,
        )
    except ValueError as e:
        print(f"  no plot: {e}")
    print(case_report(comparison), flush=True)
    return comparison


def case_header(case: Case, device: str, own=None) -> str:
    """The line the main job prints before training a case (with ``own``: which checkout)."""
    if own is not None:
        before = f" against {own.pre_series[:10]}, the commit before the series" if own.pre_series else ""
        return (f"== {case.name} ({own.label}{before}, megatron-core {own.version}, patches/{own.series.name}, "
                f"{TEST_TYPE_WORDS[case.test_type]}, {case.nproc} ranks, {device})")
    return (f"== {case.name} (megatron-core {case.base}, {TEST_TYPE_WORDS[case.test_type]}, "
            f"{case.nproc} ranks, {device})")


def golden_for_information(comparison: dict) -> dict:
    """The comparison of a tree that is not a release: the verdict is the bit-for-bit check alone.

    The golden values were made on a release; another tree may train other numbers and still
    be right. "outside_golden" and "no_golden" (series == pristine exactly, nothing else
    failed) become "identical"; ``golden_note`` keeps what the golden check found, and the
    golden failures leave ``failures`` for ``golden_findings``. Other verdicts stay.
    """
    out = dict(comparison)
    if comparison["verdict"] not in ("outside_golden", "no_golden", "identical"):
        return out
    golden = list(comparison.get("golden_failures", []))
    note = ("within the golden tolerance at every step" if comparison["verdict"] == "identical"
            else comparison["verdict_line"].split(" (series == pristine")[0])
    out.update(verdict="identical", verdict_line="identical",
               golden_note=f"golden values for information only (not a release): {note}",
               golden_findings=golden,
               failures=[f for f in comparison["failures"] if f not in golden])
    return out


def case_report(comparison: dict) -> str:
    """What the main job prints after a case's runs: the per-metric table, the memory block
    (when the runs recorded it, ``comparison["memory"]``) and the verdict line."""
    parts = [format_table(comparison)]
    if comparison.get("golden_note"):
        parts.append(comparison["golden_note"])
    if comparison.get("memory"):
        parts.append(memory_report.format_memory(comparison["memory"]))
    parts.append(f"VERDICT {comparison['case']}: {comparison['verdict_line']}")
    return "\n".join(parts)


def summary_report(verdict_lines: Dict[str, str], seconds: float) -> str:
    """The main job's closing summary: the wall time of all cases and each case's verdict."""
    return "\n".join([f"\n== summary ({seconds:.0f} s)"] + [f"  {n:55s} {v}" for n, v in verdict_lines.items()])


def check_golden_data(artifacts) -> Optional[str]:
    """None if the dataset is the one the golden values were made from, else why not and
    what to do (``harness.data.provenance_mismatch``). No golden_data.json: None."""
    from harness import data

    if not GOLDEN_DATA.exists():
        return None
    return data.provenance_mismatch(json.loads(GOLDEN_DATA.read_text()), data.provenance(artifacts))


def update_golden_command(case: str, device: str) -> str:
    """The command that creates (or rewrites) ``case``'s golden file for ``device``."""
    device_flag = "" if device == "cpu" else f" --device {device}"
    return f"scripts/run_functional_test.sh{device_flag} --update-golden {case}"


def missing_golden(names: Sequence[str], device: str) -> List[str]:
    """One message per case without a golden file for ``device``: the file and the
    command that creates it. Empty when every case has one."""
    messages = []
    for name in names:
        path = load_case(find_case(name)).golden_path(device)
        if not path.is_file():
            shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
            messages.append(
                f"{name}: no golden values for --device {device}: {shown} "
                f"does not exist. Create it on this machine with: {update_golden_command(name, device)} "
                f"(trains pristine and series, and writes the file only if they are equal bit for bit)"
            )
    return messages


def missing_checkouts(names: Sequence[str]) -> List[str]:
    """One message per base of ``names`` whose Megatron-LM checkout is missing: which, and
    how ``scripts/setup.sh`` gets it. Empty when every checkout is there."""
    messages = []
    for base_name in dict.fromkeys(load_case(find_case(n)).base for n in names):
        checkout = BASES[base_name].checkout
        if not (checkout / "pretrain_gpt.py").is_file():
            tag = checkout.name
            messages.append(
                f"megatron-core {base_name}: no Megatron-LM checkout at {checkout}; scripts/setup.sh "
                f"builds it from ../shared/upstream/Megatron-LM-{tag}.tar.gz, MEGATRON_LM"
                f"{'_019' if base_name == '0.19' else ''}_SRC or a git clone of {tag}"
            )
    return messages


def default_cases(bases: Sequence[str]) -> List[str]:
    """The main job's cases when none is named: each base's default case, in ``bases`` order."""
    return [BASES[b].default_case for b in bases]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="scripts/run_functional_test.sh",
        description="Train test cases on the pristine and the series megatron tree and "
        "compare them with each other (exactly) and with the golden values.",
        epilog="Exit: 0 every case identical; 1 diverged, outside golden tolerance or failed; "
        f"2 bad arguments; {EXIT_NO_GOLDEN} a case has no golden file for --device (nothing "
        "trained; the message names the file and the --update-golden command).",
    )
    ap.add_argument("cases", nargs="*", help="case names (default: each selected base's default case: "
                    + ", ".join(f"{b.default_case} on {b.name}" for b in BASES.values())
                    + "); 'all' for every case of the selected bases")
    ap.add_argument("--base", choices=(*BASES, "all"), default="all",
                    help="megatron-core base whose cases run (default: all, 0.19 first); "
                    "named cases must belong to it")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--update-golden", action="store_true",
                    help="rewrite golden values from this run (refused unless series == pristine)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per training run")
    ap.add_argument("--checkout", type=Path, metavar="PATH",
                    help="train your own Megatron-LM git checkout PATH as it is against PATH + the series "
                    "its version picks (scratch clones under build/checkouts/; PATH is never written); "
                    "default case: that series' base's; golden values for information unless PATH is a "
                    "release (docs/own_tree.md)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(all_cases()))
        return 0
    own = None
    if args.checkout is not None:
        from harness import own_tree

        if args.update_golden:
            print("error: --update-golden with --checkout: golden values come from the pinned releases only",
                  file=sys.stderr)
            return 2
        try:
            own = own_tree.prepare(args.checkout)
        except own_tree.OwnTreeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if own.why:
            print(f"  series: patches/{own.series.name} ({own.why})")
        if args.base not in ("all", own.base):
            print(f"error: --base {args.base}, but {own.label} takes patches/{own.series.name} (base {own.base})",
                  file=sys.stderr)
            return 2
        args.base = own.base
    bases = list(BASES) if args.base == "all" else [args.base]
    names = args.cases or default_cases(bases)
    try:
        if names == ["all"]:
            names = [n for b in bases for n in all_cases() if load_case(find_case(n)).base == b]
        wrong = [n for n in names if load_case(find_case(n)).base not in bases]
        if wrong:
            raise CaseConfigError(f"cases {wrong} are not cases of megatron-core {args.base}")
        absent = missing_checkouts(names) if own is None else []
        if absent:
            raise CaseConfigError("; ".join(absent))
    except CaseConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.update_golden:
        absent = missing_golden(names, args.device)
        if absent:
            # Not a numerics result: nothing was trained, there is nothing to compare with.
            print("error: missing golden values, nothing trained:", file=sys.stderr)
            for message in absent:
                print(f"  {message}", file=sys.stderr)
            return EXIT_NO_GOLDEN
    t0 = time.monotonic()
    verdicts = {n: run_case(n, args.device, args.update_golden, args.timeout, own=own)["verdict_line"] for n in names}
    print(summary_report(verdicts, time.monotonic() - t0))
    return 0 if all(v == "identical" for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
