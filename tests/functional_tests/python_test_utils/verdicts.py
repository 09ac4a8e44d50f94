"""One verdict per test case from the two checks, and the ``comparison.json`` dict.

Every metric and both variants are checked before the verdict is made. Precedence:

- ``"diverged"``: series differs from pristine (the main finding, even if more failed);
- ``"failed"``: a required metric is missing, step grids differ, a required value is NaN,
  the golden file is invalid, or the caller reports e.g. a crashed rank;
- ``"no_golden"``: the golden file does not exist. Not a numerics result: there is
  nothing to compare the curves with (the caller says how to create the file);
- ``"outside_golden"``: both variants agree but at least one step is out of tolerance;
- ``"identical"``: none of the above.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from . import golden_schema
from .checks import VARIANTS, GoldenComparison, compare_to_golden, compare_variants
from .golden_schema import Metrics
from .tolerances import MetricRule

#: What each verdict means, in words a reader of the plot or the printed summary needs.
VERDICT_MEANING = {
    "identical": "series equals pristine bit for bit in every logged metric at every step, "
    "and both lie within the golden tolerance",
    "diverged": "series differs from pristine (red line: the first step that differs)",
    "failed": "a run crashed, or a metric, a step or the golden file is missing or invalid "
    "(comparison.json lists why)",
    "no_golden": "no golden values for this device: series was compared with pristine only",
    "outside_golden": "series equals pristine bit for bit, but a step lies outside the golden tolerance",
}


def _json_float(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def build_comparison(
    case: str,
    pristine: Metrics,
    series: Metrics,
    golden_path: str | Path | None,
    rules: Mapping[str, MetricRule],
    extra_failures: Sequence[str] = (),
) -> dict:
    """Everything ``comparison.json`` holds, from the two runs' *exact* metrics.

    Args:
        case: test case name.
        pristine, series: exact metrics (``metrics_exact.json``); rounded here with the
            same function the reader uses for ``metrics.json``.
        golden_path: the golden file; None or a missing file gives "no_golden" (unless
            something outranks it), never a skip.
        rules: the case's metrics and their golden rules (``tolerances.rules_for``).
        extra_failures: the caller's own findings (crashed rank, timeout), verdict "failed".

    Returns:
        JSON-ready dict: case, verdict, verdict_line, first_divergent_step,
        first_divergence, golden_file, metrics (per metric: exact_check, identical,
        max_abs_diff_variants, golden_check, max_abs_diff_golden {pristine, series},
        golden_failing_steps {pristine, series}), failures (every message).
        Non-finite numbers are written as null.
    """
    variants = compare_variants(pristine, series)
    failures: list[str] = list(extra_failures) + list(variants.failures)
    golden: Metrics | None = None
    no_golden = None
    if golden_path is None:
        no_golden = "no golden values: no golden file given"
    else:
        try:
            golden = golden_schema.load(golden_path)
        except golden_schema.GoldenFileMissingError:
            no_golden = f"no golden values: {golden_path} does not exist"
        except golden_schema.GoldenSchemaError as e:
            failures.append(f"golden file invalid: {e}")
    per_variant: dict[str, GoldenComparison] = {}
    golden_failures: list[str] = []
    if golden is not None:
        for name, run in zip(VARIANTS, (pristine, series)):
            result = compare_to_golden(golden_schema.round_all(run), golden, rules, name)
            per_variant[name] = result
            failures.extend(result.structural)
            golden_failures.extend(result.failures)

    if variants.first is not None:
        verdict, line = "diverged", variants.first.describe()
    elif failures:
        verdict = "failed"
        line = f"failed: {failures[0]}" + (
            f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        )
    elif no_golden is not None:
        verdict, line = "no_golden", f"{no_golden} (series == pristine exactly)"
    elif golden_failures:
        verdict, line = "outside_golden", "outside golden tolerance"
    else:
        verdict, line = "identical", "identical"

    metrics: dict[str, dict] = {}
    for metric in dict.fromkeys([*rules, *variants.compared, *variants.max_abs_diff]):
        metrics[metric] = {
            "exact_check": metric in variants.compared,
            "identical": (
                (metric not in variants.per_metric) if metric in variants.compared else None
            ),
            "max_abs_diff_variants": _json_float(variants.max_abs_diff.get(metric)),
            "golden_check": rules[metric].tolerance.describe() if metric in rules else None,
            "max_abs_diff_golden": {
                v: (
                    _json_float(per_variant[v].max_abs_diff.get(metric))
                    if v in per_variant
                    else None
                )
                for v in VARIANTS
            },
            "golden_failing_steps": {
                v: per_variant[v].failing_steps.get(metric) if v in per_variant else None
                for v in VARIANTS
            },
        }
    first = variants.first
    return {
        "case": case,
        "verdict": verdict,
        "verdict_line": line,
        "first_divergent_step": first.step if first else None,
        "first_divergence": (
            {
                "step": first.step,
                "metric": first.metric,
                "pristine": _json_float(first.pristine),
                "series": _json_float(first.series),
            }
            if first
            else None
        ),
        "golden_file": str(golden_path) if golden_path is not None else None,
        "metrics": metrics,
        "failures": failures + ([no_golden] if no_golden else []) + golden_failures,
        # the golden check's own findings (also in failures), for a caller that shows them only
        "golden_failures": ([no_golden] if no_golden else []) + golden_failures,
    }
