"""Per-iteration scalars from Megatron's tensorboard event files, in the golden schema.

Megatron's ``training_log`` (``megatron/training/training.py``) writes, on the last rank,
``writer.add_scalar(tag, value, iteration)`` for 'lm loss', 'grad-norm', 'num-zeros' (with
``--log-num-zeros-in-grad``), 'params-norm' (``--log-params-norm``), 'learning-rate',
'iteration-time' (``--log-timers-to-tensorboard``, never at the first iteration of a
process) and the 'mem-*-bytes' tags (``--log-memory-to-tensorboard``); MoE models add the
router's 'load_balancing_loss' (``track_moe_metrics`` in ``megatron/core/transformer/moe/
moe_utils.py``, with ``--moe-router-load-balancing-type aux_loss``). We read those event
files with tensorboard's own ``EventAccumulator`` and never parse stdout: the stdout
'lm loss' of the 2nd iteration after a (re)start is an average over two iterations.

This one reader produces every side of every comparison (pristine run, series run, and
the golden file through ``golden_update.update_golden``), so a change in what gets logged shows
up as a failing comparison, not as a silently skipped metric. Upstream's equivalent is
``read_tb_logs_as_list`` in Megatron-LM ``tests/functional_tests/python_test_utils/common.py``;
differences: a missing event dir or no matching scalar is an exception (upstream logs an
error and returns None), each event file is read on its own without tensorboard's
"orphaned data" purge, and a step logged twice must have the same bits (upstream keeps the
first value silently).

Two outputs, one source:

``metrics_exact.json``
    The values exactly as the event file holds them. ``SummaryWriter.add_scalar`` (what
    Megatron calls, default ``new_style=False``) stores a protobuf ``simple_value``, a
    **float32**; tensorboard widens it to a Python float without loss, and JSON ``repr``
    round-trips it bit for bit. A tensor-style scalar (``new_style=True``, optionally
    ``double_precision=True``) is read at its own dtype (float32 or float64). The exact
    pristine-vs-series check compares these bits. Limit: a quantity Megatron computes in
    float64 (grad-norm is ``total_norm.item() ** 0.5`` in Python) is only seen to float32
    precision, so a difference below half a float32 ulp of it is invisible here; the next
    step's 'lm loss' (a float32 quantity, stored exactly) still exposes any real change.
``metrics.json``
    The same series rounded to 5 decimals: upstream's golden schema and precision, what
    the golden files hold and what the approximate check compares.

Shapes: every series covers ``start_step..end_step`` every ``step_interval`` steps; a step
with no logged value is ``nan`` ("nan" in JSON).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

from . import golden_schema
from .checks import same_bits
from .golden_schema import Metrics, MetricSeries

DEFAULT_TAGS = (
    "lm loss",
    "grad-norm",
    "num-zeros",
    "params-norm",
    "learning-rate",
    "iteration-time",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
    "load_balancing_loss",
)
ROUNDED_FILE = "metrics.json"
EXACT_FILE = "metrics_exact.json"
EVENT_GLOB = "events.out.tfevents.*"


class TensorboardReadError(RuntimeError):
    """No usable scalars: missing dir, no event file, no requested tag, inconsistent steps."""


def _scalar_events(file: Path, tags: Iterable[str]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) pairs per requested tag found in one event file."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    acc = ea.EventAccumulator(
        str(file),
        size_guidance={ea.SCALARS: 0, ea.TENSORS: 0},  # 0 = keep every event
        purge_orphaned_data=False,  # duplicates are checked below, never dropped silently
    )
    acc.Reload()
    available = acc.Tags()
    found: dict[str, list[tuple[int, float]]] = {}
    for tag in tags:
        if tag in available["scalars"]:
            found[tag] = [(e.step, float(e.value)) for e in acc.Scalars(tag)]
        elif tag in available["tensors"]:
            if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
                continue
            pairs = []
            for e in acc.Tensors(tag):
                array = tensor_util.make_ndarray(e.tensor_proto)
                if array.size != 1:
                    raise TensorboardReadError(f"{file}: tag {tag!r} step {e.step} is not a scalar")
                pairs.append((e.step, float(array.reshape(()).item())))
            found[tag] = pairs
    return found


def read_scalars(
    event_dir: str | Path, tags: Sequence[str] = DEFAULT_TAGS
) -> dict[str, dict[int, float]]:
    """Raw per-step values of the requested tags that are present, across the event files
    directly in ``event_dir`` (in name order: names start with a timestamp).

    Returns:
        tag -> {step: value}, steps sorted; tags in ``tags`` order; absent tags omitted.

    Raises:
        TensorboardReadError: no such folder, no event files, none of ``tags`` present, or
            one step logged twice with different values (e.g. two runs writing into one folder).
    """
    if not Path(event_dir).is_dir():
        raise TensorboardReadError(f"tensorboard dir not found: {event_dir}")
    files = sorted(Path(event_dir).glob(EVENT_GLOB))
    if not files:
        raise TensorboardReadError(f"no {EVENT_GLOB} files in {event_dir}")
    merged: dict[str, dict[int, float]] = {}
    for file in files:
        for tag, pairs in _scalar_events(file, tags).items():
            series = merged.setdefault(tag, {})
            for step, value in pairs:
                if step in series and not same_bits(series[step], value):
                    raise TensorboardReadError(
                        f"{event_dir}: {tag!r} step {step} logged twice with different "
                        f"values ({series[step]!r}, then {value!r} in {file.name})"
                    )
                series[step] = value
    if not merged:
        raise TensorboardReadError(
            f"{event_dir}: none of the tags {list(tags)} in {len(files)} event file(s)"
        )
    return {tag: dict(sorted(merged[tag].items())) for tag in tags if tag in merged}


def read_run_metrics(
    event_dir: str | Path,
    tags: Sequence[str] = DEFAULT_TAGS,
    *,
    start_step: int = 1,
    end_step: int | None = None,
) -> Metrics:
    """Unrounded series on the grid ``start_step..end_step``, every step.

    Args:
        end_step: the last step the run should have logged (``--train-iters``). Missing
            trailing steps become nan, so a run that stopped early cannot pass as a
            shorter complete run. None: the largest step logged by any requested tag.

    Raises:
        TensorboardReadError: see :func:`read_scalars`; also a step beyond ``end_step`` or
            before ``start_step``.
    """
    raw = read_scalars(event_dir, tags)
    last = max(max(values) for values in raw.values()) if end_step is None else end_step
    grid = range(start_step, last + 1)
    metrics: Metrics = {}
    for tag, values in raw.items():
        outside = [t for t in values if t < start_step or t > last]
        if outside:
            raise TensorboardReadError(
                f"{event_dir}: {tag!r} has steps {outside[:5]} outside {start_step}..{last}"
            )
        metrics[tag] = MetricSeries(start_step, last, 1, {t: values.get(t, math.nan) for t in grid})
    return metrics


def write_run_metrics(event_dir: str | Path, out_dir: str | Path, **kwargs) -> Metrics:
    """Read ``event_dir`` and write ``metrics.json`` and ``metrics_exact.json`` to ``out_dir``.

    Keyword arguments go to :func:`read_run_metrics`. Returns the exact metrics.
    """
    exact = read_run_metrics(event_dir, **kwargs)
    out_dir = Path(out_dir)
    golden_schema.save(out_dir / EXACT_FILE, exact)
    golden_schema.save(out_dir / ROUNDED_FILE, golden_schema.round_all(exact))
    return exact


def load_run_metrics(out_dir: str | Path) -> Metrics:
    """The exact metrics of a run folder written by :func:`write_run_metrics`.

    Also checks that ``metrics.json`` is the rounding of ``metrics_exact.json``, so the
    two files of a run cannot drift apart (e.g. one edited by hand).

    Raises:
        GoldenFileMissingError, GoldenSchemaError: a file is missing or invalid.
    """
    out_dir = Path(out_dir)
    exact = golden_schema.load(out_dir / EXACT_FILE)
    rounded = golden_schema.load(out_dir / ROUNDED_FILE)
    if golden_schema.dumps(rounded) != golden_schema.dumps(golden_schema.round_all(exact)):
        raise golden_schema.GoldenSchemaError(
            f"{out_dir}: {ROUNDED_FILE} is not the rounding of {EXACT_FILE}"
        )
    return exact

