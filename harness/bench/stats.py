"""Interleaved timing statistics: ABBA schedule, paired ratios, bootstrap CIs.

A shared machine drifts (other jobs start and stop), so trees are never timed one after
the other. Each *round* times one block of syncs per tree, in the order of the trees in
even rounds and reversed in odd rounds (A B C, C B A, ...: ABBA for two trees), and a
ratio is formed only between blocks of the same round. The reported ratio is the median
of the per-round ratios; its confidence interval is the percentile bootstrap of that
median over rounds. Units: seconds in, dimensionless ratios out.
"""

from __future__ import annotations

import random
import statistics
from typing import Dict, List, Optional, Sequence, Tuple


def abba_order(labels: Sequence[str], round_index: int) -> List[str]:
    """Order of the trees in round `round_index`: as given when even, reversed when odd."""
    labels = list(labels)
    return labels if round_index % 2 == 0 else labels[::-1]


def paired_ratios(blocks: Dict[str, List[float]], num: str, den: str) -> List[float]:
    """Per-round ratios blocks[num][i] / blocks[den][i] (seconds per sync, one per round).

    Raises:
        ValueError: the two trees have a different number of rounds, or a zero time.
    """
    a, b = blocks[num], blocks[den]
    if len(a) != len(b):
        raise ValueError(f"{num} has {len(a)} rounds, {den} has {len(b)}")
    if any(x <= 0 for x in b):
        raise ValueError(f"{den}: a block time is <= 0 s")
    return [x / y for x, y in zip(a, b)]


def bootstrap_median_ci(
    values: Sequence[float], confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> Tuple[float, float]:
    """Percentile bootstrap CI of the median of `values` (resampled with replacement).

    Deterministic for a given seed. With fewer than 2 values the CI is the value itself.

    Raises:
        ValueError: no values, or confidence outside (0, 1).
    """
    if not values:
        raise ValueError("bootstrap_median_ci: no values")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    values = list(values)
    if len(values) < 2:
        return values[0], values[0]
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo_i = int((1 - confidence) / 2 * resamples)
    hi_i = min(resamples - 1, int((1 + confidence) / 2 * resamples))
    return meds[lo_i], meds[hi_i]


def ratio_summary(blocks: Dict[str, List[float]], num: str, den: str) -> Optional[dict]:
    """{"ratio", "ci_lo", "ci_hi", "rounds"} of paired_ratios(num/den); None if a tree is missing."""
    if num not in blocks or den not in blocks or not blocks[num]:
        return None
    ratios = paired_ratios(blocks, num, den)
    lo, hi = bootstrap_median_ci(ratios)
    return dict(ratio=statistics.median(ratios), ci_lo=lo, ci_hi=hi, rounds=len(ratios))
