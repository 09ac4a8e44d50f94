"""Megatron's golden-values schema as a typed model, shared by the golden and actual sides.

Provenance: upstream Megatron-LM ``tests/functional_tests/python_test_utils/common.py``
(``GoldenValueMetric`` / ``GoldenValues``, pydantic models; ``read_tb_logs_as_list`` fills
them from tensorboard with ``round(value, 5)`` and ``"nan"`` for a missing step). The file
shape is unchanged, so upstream's loader reads our files::

    {
      "lm loss": {
        "start_step": 1, "end_step": 50, "step_interval": 1,
        "values": {"1": 10.83521, "2": 10.79911, ..., "50": 6.12345}
      },
      "iteration-time": {..., "values": {"1": "nan", "2": 0.10321, ...}}
    }

What we add is strictness (upstream accepts any keys and any value types):

- ``values`` must hold exactly the steps ``start_step, start_step + step_interval, ...,
  end_step``; a hole is an error, a missing measurement is the string ``"nan"``.
- a value is a JSON number or one of the strings ``"nan"``, ``"inf"``, ``"-inf"``; bare
  ``NaN``/``Infinity`` tokens (not JSON), booleans, other strings and duplicate keys are
  errors that name the file, metric and step.

In memory a series is :class:`MetricSeries` with ``values: dict[int, float]`` (step ->
value, ``math.nan`` for "no value at this step"). The same class serves two files:

- ``metrics.json`` / golden files: values rounded to 5 decimals (:meth:`MetricSeries.rounded`);
- ``metrics_exact.json``: unrounded values. JSON numbers are written with Python's
  shortest round-trip ``repr``, so a float survives save/load bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Mapping

ROUND_DECIMALS = 5
_STR_TO_FLOAT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_SERIES_KEYS = ("start_step", "end_step", "step_interval", "values")


class GoldenSchemaError(ValueError):
    """A metrics/golden file or object does not follow the schema. The message says where."""


class GoldenFileMissingError(GoldenSchemaError, FileNotFoundError):
    """The golden (or metrics) file does not exist."""


@dataclasses.dataclass(frozen=True)
class MetricSeries:
    """One metric over a regular grid of training steps.

    Attributes:
        start_step: first step (Megatron iterations count from 1).
        end_step: last step, inclusive; ``(end_step - start_step) % step_interval == 0``.
        step_interval: distance between recorded steps (>= 1).
        values: step -> float for every step of the grid, in step order; ``nan`` marks a
            step without a value (not logged, or logged as NaN). Units are the metric's
            own (loss in nats, iteration-time in seconds, memory in bytes).

    Raises:
        GoldenSchemaError: the grid and the keys of ``values`` disagree.
    """

    start_step: int
    end_step: int
    step_interval: int
    values: Mapping[int, float]

    def __post_init__(self) -> None:
        for name in ("start_step", "end_step", "step_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise GoldenSchemaError(f"{name} must be an int, got {value!r}")
        s, e, k = self.start_step, self.end_step, self.step_interval
        if k < 1 or e < s or (e - s) % k:
            raise GoldenSchemaError(f"bad step grid: {s=} {e=} interval={k}")
        keys = list(self.values)
        if keys != list(range(s, e + 1, k)):
            missing = sorted(set(range(s, e + 1, k)) - set(keys))
            extra = sorted(set(keys) - set(range(s, e + 1, k)))
            raise GoldenSchemaError(
                f"values must hold steps {s}..{e} every {k} in order; "
                f"missing {missing[:10]}, unexpected {extra[:10]}"
            )
        object.__setattr__(self, "values", {int(t): float(v) for t, v in self.values.items()})

    @property
    def steps(self) -> range:
        return range(self.start_step, self.end_step + 1, self.step_interval)

    def rounded(self) -> "MetricSeries":
        """Upstream's golden precision: ``round(value, 5)``; nan/inf stay as they are."""
        values = {t: (round(v, ROUND_DECIMALS) if math.isfinite(v) else v) for t, v in self.values.items()}
        return dataclasses.replace(self, values=values)

    def to_json_obj(self) -> dict:
        """Schema dict; non-finite values become "nan"/"inf"/"-inf" (strict JSON)."""
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "step_interval": self.step_interval,
            "values": {str(t): _encode_value(v) for t, v in self.values.items()},
        }

    @classmethod
    def from_json_obj(cls, obj: object, where: str = "metric") -> "MetricSeries":
        """Validate and convert one schema dict.

        Raises:
            GoldenSchemaError: naming ``where`` (e.g. "file.json: lm loss") and the step.
        """
        if not isinstance(obj, dict):
            raise GoldenSchemaError(f"{where}: expected an object, got {type(obj).__name__}")
        if set(obj) != set(_SERIES_KEYS):
            raise GoldenSchemaError(
                f"{where}: keys must be {list(_SERIES_KEYS)}, got {sorted(obj)}"
            )
        raw_values = obj["values"]
        if not isinstance(raw_values, dict):
            raise GoldenSchemaError(f"{where}: 'values' must be an object")
        values: dict[int, float] = {}
        for key, raw in raw_values.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise GoldenSchemaError(f"{where}: step key {key!r} is not a decimal integer")
            values[int(key)] = _decode_value(raw, f"{where}: step {key}")
        try:
            return cls(obj["start_step"], obj["end_step"], obj["step_interval"], values)
        except GoldenSchemaError as e:
            raise GoldenSchemaError(f"{where}: {e}") from None


Metrics = dict[str, MetricSeries]


def _encode_value(v: float) -> float | str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _decode_value(raw: object, where: str) -> float:
    if isinstance(raw, bool):
        raise GoldenSchemaError(f"{where}: boolean {raw!r} is not a metric value")
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str) and raw.lower() in _STR_TO_FLOAT:
        return _STR_TO_FLOAT[raw.lower()]
    raise GoldenSchemaError(f"{where}: value {raw!r} is neither a number nor 'nan'/'inf'/'-inf'")


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise GoldenSchemaError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _reject_constant(token: str):
    raise GoldenSchemaError(f'bare {token} is not JSON; write the string "nan" or "inf"')


def loads(text: str, where: str = "<string>") -> Metrics:
    """Parse a metrics/golden JSON document.

    Raises:
        GoldenSchemaError: invalid JSON or schema, naming ``where``, the metric and step.
    """
    try:
        obj = json.loads(
            text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
    except GoldenSchemaError as e:
        raise GoldenSchemaError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise GoldenSchemaError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(obj, dict) or not obj:
        raise GoldenSchemaError(f"{where}: expected a non-empty object of metrics")
    return {
        name: MetricSeries.from_json_obj(series, f"{where}: {name!r}")
        for name, series in obj.items()
    }


def dumps(metrics: Mapping[str, MetricSeries]) -> str:
    """Serialize in the caller's metric order and step order; ends with a newline."""
    if not metrics:
        raise GoldenSchemaError("refusing to write an empty metrics file")
    obj = {name: series.to_json_obj() for name, series in metrics.items()}
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def load(path: str | os.PathLike) -> Metrics:
    """Read and validate a file.

    Raises:
        GoldenFileMissingError: ``path`` does not exist.
        GoldenSchemaError: the content is invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise GoldenFileMissingError(f"{path}: file not found")
    return loads(path.read_text(encoding="utf-8"), str(path))


def save(path: str | os.PathLike, metrics: Mapping[str, MetricSeries]) -> Path:
    """Write atomically (temp file in the same folder, then rename). Returns the path."""
    path = Path(path)
    text = dumps(metrics)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def round_all(metrics: Mapping[str, MetricSeries]) -> Metrics:
    """Every series rounded to the golden precision."""
    return {name: series.rounded() for name, series in metrics.items()}
