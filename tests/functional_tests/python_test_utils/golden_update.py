"""Writing golden files: only from runs whose variants are equal bit for bit.

Invariant: a golden file changes only through :func:`update_golden`, which refuses
(:class:`GoldenUpdateRefused`, file untouched) unless the exact check passes and every
checked metric has a value at every step, and which returns the per-step diff of old and
new values. Values are rounded to 5 decimals (the golden schema's precision).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

from . import golden_schema
from .checks import compare_variants, same_bits
from .formatting import format_grid
from .golden_schema import Metrics
from .tolerances import MetricRule


class GoldenUpdateRefused(RuntimeError):
    """update_golden would write values that the exact check does not vouch for."""


def update_golden(
    golden_path: str | Path,
    pristine: Metrics,
    series: Metrics,
    rules: Mapping[str, MetricRule],
) -> str:
    """Write the golden file from the runs, only if series equals pristine exactly.

    The new file holds the metrics of ``rules`` (the case's METRICS, in that order),
    rounded to 5 decimals, taken from the series run. Metrics outside the exact check
    (iteration-time, memory) therefore come from the series run, the code that ships.

    Returns:
        a per-step diff of the old and new values ("golden file created" when new).

    Raises:
        GoldenUpdateRefused: the variants differ or are incomplete, a metric of ``rules``
            is missing, or a metric that may not have missing steps has a nan.
    """
    variants = compare_variants(pristine, series)
    problems = list(variants.failures)
    if variants.first is not None:
        problems.insert(0, variants.first.describe())
    for metric, rule in rules.items():
        if metric not in series:
            problems.append(f"{metric}: not logged by the run")
        elif not rule.allow_missing:
            nan_steps = [t for t, v in series[metric].values.items() if math.isnan(v)]
            if nan_steps:
                problems.append(f"{metric}: no value at steps {nan_steps[:10]}")
    if problems:
        raise GoldenUpdateRefused(f"refusing to write {golden_path}: " + "; ".join(problems))
    new = {m: series[m].rounded() for m in rules}
    golden_path = Path(golden_path)
    old: Metrics | None = None
    if golden_path.exists():
        try:
            old = golden_schema.load(golden_path)
        except golden_schema.GoldenSchemaError:
            old = None  # an unreadable file is replaced; the diff says "created"
    diff = golden_diff(old, new, golden_path)
    golden_schema.save(golden_path, new)
    return diff


def golden_diff(old: Metrics | None, new: Metrics, label: str | Path = "golden") -> str:
    """Per-step differences between two golden value sets, one line per changed step."""
    if old is None:
        return f"{label}: golden file created ({', '.join(new)}; {len(next(iter(new.values())).steps)} steps)"
    lines = [f"{label}:"]
    for metric in dict.fromkeys([*old, *new]):
        if metric not in new:
            lines.append(f"  - {metric}: removed")
            continue
        if metric not in old:
            lines.append(f"  + {metric}: added ({format_grid(new[metric])})")
            continue
        o, n = old[metric], new[metric]
        if o.steps != n.steps:
            lines.append(f"  ~ {metric}: steps {format_grid(o)} -> {format_grid(n)}")
        changed = [
            t
            for t in dict.fromkeys([*o.steps, *n.steps])
            if not same_bits(o.values.get(t, math.nan), n.values.get(t, math.nan))
        ]
        for t in changed:
            a, b = o.values.get(t, math.nan), n.values.get(t, math.nan)
            delta = f" ({b - a:+.5g})" if math.isfinite(a) and math.isfinite(b) else ""
            lines.append(f"  {metric} step {t}: {a!r} -> {b!r}{delta}")
        if not changed and o.steps == n.steps:
            lines.append(f"  = {metric}: unchanged")
    return "\n".join(lines)
