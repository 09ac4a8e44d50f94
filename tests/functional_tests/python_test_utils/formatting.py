"""Text for people: exact float values, step grids, and the comparison table.

Invariant: distinct values print differently (:func:`format_exact`), so a 1-ulp divergence
is visible in a verdict line. Nothing here decides anything.
"""

from __future__ import annotations

import math
from typing import Mapping

from .golden_schema import MetricSeries


def format_exact(x: float) -> str:
    """Shortest text that identifies ``x`` exactly.

    A value read from a float32 tensorboard scalar prints as its shortest float32 form
    ("1.35", not "1.350000023841858"); distinct float32 values still print differently.
    Other values print with Python's round-trip repr.
    """
    import numpy

    if math.isfinite(x) and float(numpy.float32(x)) == x:
        return str(numpy.float32(x))
    return repr(x)


def format_grid(series: MetricSeries) -> str:
    """``"1..50 every 1 (50 steps)"``: a series' step grid."""
    return (
        f"{series.start_step}..{series.end_step} every {series.step_interval} "
        f"({len(series.steps)} steps)"
    )


def format_table(comparison: Mapping, max_failures: int = 20) -> str:
    """Human-readable table of a ``comparison.json`` dict, its failures and the verdict line."""

    def num(x) -> str:
        return "-" if x is None else f"{x:.3g}"

    def count(x) -> str:
        return "-" if x is None else str(x)

    head = (
        "metric",
        "variants",
        "max|pri-ser|",
        "golden rule",
        "max|pri-gold|",
        "max|ser-gold|",
        "failing pri/ser",
    )
    rows = [head]
    for metric, e in comparison["metrics"].items():
        same = "-" if e["identical"] is None else ("identical" if e["identical"] else "DIFFER")
        fs = e["golden_failing_steps"]
        rows.append(
            (
                metric,
                same,
                num(e["max_abs_diff_variants"]),
                (e["golden_check"] or "-").split(" (")[0],
                num(e["max_abs_diff_golden"]["pristine"]),
                num(e["max_abs_diff_golden"]["series"]),
                f"{count(fs['pristine'])}/{count(fs['series'])}",
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = [f"case {comparison['case']}"]
    for i, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    failures = comparison["failures"]
    if failures:
        lines.append(f"{len(failures)} failure(s):")
        lines.extend(f"  {m}" for m in failures[:max_failures])
        if len(failures) > max_failures:
            lines.append(f"  ... {len(failures) - max_failures} more in comparison.json")
    lines.append(f"verdict: {comparison['verdict_line']}")
    return "\n".join(lines)
