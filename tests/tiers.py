"""The two tiers of the suite (pytest.ini's ``extended`` marker).

The default run (``scripts/test.sh``, CI) runs every check once on the whole series of each
base; the ``extended`` tier (``scripts/test.sh --all``) adds the sweeps: every prefix of each
series, every mutant, every functional case, the 4-rank upstream run, the audit's grid.
"""

from __future__ import annotations

from typing import Callable, Iterable, List

import pytest


def tiered(values: Iterable, in_default_run: Callable[[object], bool]) -> List:
    """``values`` (parametrize values: one argument each, or tuples of several) as given where
    ``in_default_run(value)`` holds, else as ``pytest.param`` marked ``extended``."""
    out = []
    for v in values:
        if in_default_run(v):
            out.append(v)
        else:
            out.append(pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.extended))
    return out
