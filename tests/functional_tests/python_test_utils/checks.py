"""The two checks: series vs pristine exactly, and each run vs the golden values.

1. **Exact** (:func:`compare_variants`): same machine, same run of the harness, so any
   difference is the series' doing. Bitwise float64 equality of the unrounded values
   (``metrics_exact.json``) of :data:`EXACT_REQUIRED` and, when both runs logged them,
   :data:`EXACT_OPTIONAL`. The first divergence is the earliest step at which any of them
   differs, ties broken by that order.
2. **Golden** (:func:`compare_to_golden`): values rounded to 5 decimals, per step, with
   each metric's :class:`~.tolerances.MetricRule`. Every failing step is a failure: no
   averaging, no allowance of N failing steps, and a missing step never "matches".

Both return every finding; the verdict is made elsewhere (``verdicts``).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Mapping

from .formatting import format_exact, format_grid
from .golden_schema import Metrics, MetricSeries
from .tolerances import Informational, MetricRule

#: The two runs of a case, in this order everywhere (``comparison.json`` keys, the run folders
#: ``build/functional/<case>/<variant>/``): the pristine tree (megatron-core as released) and
#: the series tree (it with patches/<base>/).
VARIANTS = ("pristine", "series")
EXACT_REQUIRED = ("lm loss", "grad-norm", "num-zeros")
EXACT_OPTIONAL = ("params-norm", "learning-rate", "load_balancing_loss")


def same_bits(a: float, b: float) -> bool:
    """Bitwise float64 equality; any nan equals any nan (nan means "no value")."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)


def max_abs_diff(a: MetricSeries, b: MetricSeries) -> float | None:
    """max |a - b| over the steps of ``a`` that ``b`` has; inf where exactly one is nan;
    None when no step has a value on both sides."""
    diffs = []
    for step in a.steps:
        if step not in b.values:
            continue
        x, y = a.values[step], b.values[step]
        if math.isnan(x) and math.isnan(y):
            continue
        if math.isnan(x) or math.isnan(y):
            diffs.append(math.inf)
        elif x == y:
            diffs.append(0.0)
        else:
            diffs.append(abs(x - y))
    return max(diffs) if diffs else None


# --------------------------------------------------------------------------- exact check


@dataclasses.dataclass(frozen=True)
class Divergence:
    """First step at which one metric differs between the variants (values unrounded)."""

    step: int
    metric: str
    pristine: float
    series: float

    def describe(self) -> str:
        return (
            f"diverged at step {self.step} "
            f"({self.metric}, {format_exact(self.pristine)}, {format_exact(self.series)})"
        )


@dataclasses.dataclass
class VariantComparison:
    """Result of :func:`compare_variants`.

    Attributes:
        first: earliest divergence over all compared metrics, or None.
        per_metric: first divergence of each metric that diverged.
        max_abs_diff: per metric present in both, :func:`max_abs_diff` of the variants.
        failures: structural problems (missing metric, different step grids, nan).
        compared: the metrics the exact check compared.
    """

    first: Divergence | None = None
    per_metric: dict[str, Divergence] = dataclasses.field(default_factory=dict)
    max_abs_diff: dict[str, float | None] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    compared: list[str] = dataclasses.field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.first is None and not self.failures


def compare_variants(pristine: Metrics, series: Metrics) -> VariantComparison:
    """Exact comparison of two runs' unrounded metrics; see the module docstring.

    A required metric missing from either run, an optional one logged by only one run,
    different step grids, and a required metric without value in both runs at a step
    are failures.
    """
    result = VariantComparison()
    required, compared = EXACT_REQUIRED, (*EXACT_REQUIRED, *EXACT_OPTIONAL)
    for metric in sorted(set(pristine) & set(series), key=lambda m: (m not in required, m)):
        result.max_abs_diff[metric] = max_abs_diff(pristine[metric], series[metric])
    for metric in compared:
        absent = [v for v, m in zip(VARIANTS, (pristine, series)) if metric not in m]
        if absent:
            if metric in required or len(absent) == 1:
                result.failures.append(f"{metric}: not logged by {' and '.join(absent)}")
            continue
        result.compared.append(metric)
        pr, se = pristine[metric], series[metric]
        if pr.steps != se.steps:
            result.failures.append(
                f"{metric}: step grids differ: pristine {format_grid(pr)}, series {format_grid(se)}"
            )
        for step in pr.steps:
            if step not in se.values:
                continue
            p, s = pr.values[step], se.values[step]
            if not same_bits(p, s):
                result.per_metric[metric] = Divergence(step, metric, p, s)
                break
        if metric in required:
            both_nan = [
                t
                for t in pr.steps
                if t in se.values and math.isnan(pr.values[t]) and math.isnan(se.values[t])
            ]
            if both_nan:
                result.failures.append(f"{metric}: no value in either run at steps {both_nan[:10]}")
    if result.per_metric:
        result.first = min(result.per_metric.values(), key=lambda d: (d.step, compared.index(d.metric)))
    return result


# --------------------------------------------------------------------------- golden check


@dataclasses.dataclass
class GoldenComparison:
    """Result of :func:`compare_to_golden` for one variant.

    Attributes:
        failures: one message per failing step, every metric.
        max_abs_diff: per metric, max |actual - golden| over steps with both values.
        failing_steps: per metric, how many steps failed the tolerance or had no value.
        structural: metric missing on one side, or a step-count mismatch.
    """

    failures: list[str] = dataclasses.field(default_factory=list)
    max_abs_diff: dict[str, float | None] = dataclasses.field(default_factory=dict)
    failing_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    structural: list[str] = dataclasses.field(default_factory=list)


def compare_to_golden(
    actual: Metrics, golden: Metrics, rules: Mapping[str, MetricRule], label: str = "actual"
) -> GoldenComparison:
    """Check rounded ``actual`` against ``golden`` with ``rules``, per step, every metric.

    Args:
        actual: the run's metrics, rounded to the golden precision (``metrics.json``).
        golden: the golden file's metrics.
        rules: metric -> rule; only these metrics are checked (the case's METRICS).
        label: names the run in messages ("pristine"/"series").
    """
    out = GoldenComparison()
    for metric, rule in rules.items():
        where = f"{label}: {metric}"
        if metric not in golden:
            out.structural.append(f"{where}: not in the golden file")
            continue
        if metric not in actual:
            out.structural.append(f"{where}: not logged by the run")
            continue
        act, gold = actual[metric], golden[metric]
        out.max_abs_diff[metric] = max_abs_diff(act, gold)
        if act.steps != gold.steps:
            out.structural.append(
                f"{where}: step-count mismatch: run {format_grid(act)}, golden {format_grid(gold)}"
            )
        if isinstance(rule.tolerance, Informational):
            continue
        failing = 0
        for step in gold.steps:
            g = gold.values[step]
            a = act.values.get(step, math.nan)
            message = None
            if math.isnan(a) and math.isnan(g):
                if not rule.allow_missing:
                    message = "no value in the run nor in the golden file"
            elif math.isnan(a):
                message = f"missing or NaN in the run (golden {g!r})"
            elif math.isnan(g):
                message = f"golden has no value but the run has {a!r}"
            elif not rule.tolerance.allows(a, g):
                message = (
                    f"{a!r} vs golden {g!r}: |diff| {abs(a - g):.6g} outside "
                    f"{rule.tolerance.describe()}"
                )
            if message:
                failing += 1
                out.failures.append(f"{where}: step {step}: {message}")
        out.failing_steps[metric] = failing
    return out
