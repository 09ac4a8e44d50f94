"""tests/functional_tests/python_test_utils: reader, schema, comparisons, golden update, plot.

Event files are written with torch's SummaryWriter, the writer Megatron's training_log
uses, so the reader is tested against the real on-disk format. Expected values are
computed independently (numpy float32 widening, Python's round) rather than taken from
the code under test.
"""

import json
import math
import shutil
from pathlib import Path

import numpy
import pytest
import yaml

from tests.functional_tests.python_test_utils import (
    checks,
    formatting,
    golden_schema,
    golden_update,
    plot,
    tolerances,
    verdicts,
)
from tests.functional_tests.python_test_utils import run_case as rc
from tests.functional_tests.python_test_utils import tensorboard_reader as tbr
from tests.functional_tests.python_test_utils.golden_schema import MetricSeries

STEPS = 10


def f32(x: float) -> float:
    """What a tensorboard simple_value holds for x, widened back to a Python float."""
    return float(numpy.float32(x))


def next_f32(x: float) -> float:
    """The float32 one ulp above x."""
    return float(numpy.nextafter(numpy.float32(x), numpy.float32(math.inf)))


def curve(metric: str, step: int) -> float:
    base = {"lm loss": 10.0, "grad-norm": 3.0, "num-zeros": 100.0, "learning-rate": 1e-4}[metric]
    return base / (1 + 0.1 * step) + 0.001 * math.sin(step)


def write_events(folder: Path, scalars: dict, **kwargs) -> Path:
    """scalars: tag -> {step: value}; kwargs go to add_scalar (e.g. new_style=True)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    steps = sorted({s for values in scalars.values() for s in values})
    for step in steps:  # interleaved per step, as training_log writes them
        for tag, values in scalars.items():
            if step in values:
                writer.add_scalar(tag, values[step], step, **kwargs)
    writer.close()
    return folder


def run_scalars(overrides: dict | None = None) -> dict:
    """Synthetic run: every metric on steps 1..STEPS, iteration-time missing at step 1."""
    scalars = {
        m: {t: curve(m, t) for t in range(1, STEPS + 1)}
        for m in ("lm loss", "grad-norm", "num-zeros", "learning-rate")
    }
    scalars["iteration-time"] = {t: 0.1 + 0.01 * t for t in range(2, STEPS + 1)}
    scalars["batch-size"] = {t: 8.0 for t in range(1, STEPS + 1)}  # not a requested tag
    for (tag, step), value in (overrides or {}).items():
        scalars[tag][step] = value
    return scalars


def series(values: list[float], start: int = 1) -> MetricSeries:
    return MetricSeries(start, start + len(values) - 1, 1, dict(enumerate(values, start)))


def three(lm=None, gn=None, nz=None, n=STEPS) -> dict:
    return {
        "lm loss": series(lm or [curve("lm loss", t) for t in range(1, n + 1)]),
        "grad-norm": series(gn or [curve("grad-norm", t) for t in range(1, n + 1)]),
        "num-zeros": series(nz or [float(t) for t in range(1, n + 1)]),
    }


RULES = {
    "lm loss": tolerances.MetricRule(tolerances.Approximate(rtol=1e-3)),
    "grad-norm": tolerances.MetricRule(tolerances.Approximate(rtol=1e-2)),
    "num-zeros": tolerances.MetricRule(tolerances.Exact()),
}


# --------------------------------------------------------------------------- reader


def test_reader_round_trip(tmp_path):
    scalars = run_scalars()
    write_events(tmp_path / "tb", scalars)
    exact = tbr.write_run_metrics(tmp_path / "tb", tmp_path / "out", end_step=STEPS)

    assert list(exact) == ["lm loss", "grad-norm", "num-zeros", "learning-rate", "iteration-time"]
    for tag, series_ in exact.items():
        assert (series_.start_step, series_.end_step, series_.step_interval) == (1, STEPS, 1)
        for step in range(1, STEPS + 1):
            want = f32(scalars[tag][step]) if step in scalars[tag] else math.nan
            got = series_.values[step]
            assert (math.isnan(want) and math.isnan(got)) or got == want, (tag, step)
    assert math.isnan(exact["iteration-time"].values[1])

    rounded = json.loads((tmp_path / "out" / tbr.ROUNDED_FILE).read_text())
    assert set(rounded["lm loss"]) == {"start_step", "end_step", "step_interval", "values"}
    assert rounded["lm loss"]["values"]["3"] == round(f32(scalars["lm loss"][3]), 5)
    assert rounded["iteration-time"]["values"]["1"] == "nan"
    exact_json = json.loads((tmp_path / "out" / tbr.EXACT_FILE).read_text())
    assert exact_json["grad-norm"]["values"]["7"] == f32(scalars["grad-norm"][7])

    again = tbr.load_run_metrics(tmp_path / "out")
    assert all(
        checks.same_bits(again[m].values[t], exact[m].values[t])
        for m in exact
        for t in exact[m].steps
    )


def test_reader_reads_double_precision_tensor_scalars(tmp_path):
    value = 1 / 3  # not representable in float32
    write_events(
        tmp_path / "tb", {"lm loss": {1: value, 2: value}}, new_style=True, double_precision=True
    )
    assert tbr.read_run_metrics(tmp_path / "tb")["lm loss"].values[1] == value
    assert f32(value) != value


def test_reader_pads_missing_trailing_steps_and_rejects_extra(tmp_path):
    write_events(tmp_path / "tb", {"lm loss": {t: 1.0 for t in range(1, 6)}})
    padded = tbr.read_run_metrics(tmp_path / "tb", end_step=8)["lm loss"]
    assert padded.end_step == 8 and all(math.isnan(padded.values[t]) for t in (6, 7, 8))
    with pytest.raises(tbr.TensorboardReadError, match="outside 1..4"):
        tbr.read_run_metrics(tmp_path / "tb", end_step=4)


@pytest.mark.parametrize("setup", ["no_dir", "empty_dir", "no_requested_tag"])
def test_reader_errors_instead_of_empty_success(tmp_path, setup):
    folder = tmp_path / "tb"
    if setup != "no_dir":
        folder.mkdir()
    if setup == "no_requested_tag":
        write_events(folder, {"batch-size": {1: 8.0}})
    with pytest.raises(tbr.TensorboardReadError):
        tbr.write_run_metrics(folder, tmp_path / "out")
    assert not (tmp_path / "out" / tbr.ROUNDED_FILE).exists()


def test_reader_rejects_step_logged_twice_with_different_values(tmp_path):
    write_events(tmp_path / "tb", {"lm loss": {1: 5.0, 2: 4.0}})
    write_events(tmp_path / "tb", {"lm loss": {2: 4.0, 3: 3.0}})  # same value again: fine
    assert tbr.read_run_metrics(tmp_path / "tb")["lm loss"].values == {1: 5.0, 2: 4.0, 3: 3.0}
    write_events(tmp_path / "tb", {"lm loss": {3: 3.5}})
    with pytest.raises(tbr.TensorboardReadError, match="step 3 logged twice"):
        tbr.read_run_metrics(tmp_path / "tb")


def test_rounded_and_exact_files_cannot_drift(tmp_path):
    write_events(tmp_path / "tb", run_scalars())
    tbr.write_run_metrics(tmp_path / "tb", tmp_path / "out")
    path = tmp_path / "out" / tbr.ROUNDED_FILE
    doc = json.loads(path.read_text())
    doc["lm loss"]["values"]["2"] += 0.5
    path.write_text(json.dumps(doc))
    with pytest.raises(golden_schema.GoldenSchemaError, match="not the rounding"):
        tbr.load_run_metrics(tmp_path / "out")


# --------------------------------------------------------------------------- schema


def test_schema_round_trips_floats_bit_for_bit(tmp_path):
    rng = numpy.random.default_rng(0)
    values = [float(x) for x in rng.standard_normal(50)]
    values += [math.nextafter(1.0, 2.0), 5e-324, -0.0, math.nan, math.inf, -math.inf]
    metrics = {"m": series(values)}
    golden_schema.save(tmp_path / "m.json", metrics)
    back = golden_schema.load(tmp_path / "m.json")["m"]
    assert all(checks.same_bits(a, b) for a, b in zip(values, back.values.values()))
    assert math.copysign(1, back.values[53]) == -1  # -0.0 kept


def one_metric(values: str, end: int = 2, interval: str = ', "step_interval": 1') -> str:
    """A golden file of metric "m" on steps 1..end: ``interval`` and ``values`` as JSON text."""
    return f'{{"m": {{"start_step": 1, "end_step": {end}{interval}, "values": {{{values}}}}}}}'


@pytest.mark.parametrize(
    "text, match",
    [
        (one_metric('"1": 1, "3": 2', end=3), "missing \\[2\\]"),
        (one_metric('"1": 1, "2": NaN'), "bare NaN"),
        (one_metric('"1": 1, "2": true'), "step 2: boolean"),
        (one_metric('"1": 1, "2": "n/a"'), "step 2: value 'n/a'"),
        (one_metric('"1": 1, "1": 2', end=1), "duplicate key '1'"),
        (one_metric('"1": 1', end=1, interval=""), "keys must be"),
        (one_metric('"1": 1, "3": 1', end=4, interval=', "step_interval": 2'), "bad step grid"),
        ("{}", "non-empty"),
    ],
)
def test_schema_rejects_malformed_files(text, match):
    with pytest.raises(golden_schema.GoldenSchemaError, match=match):
        golden_schema.loads(text, "golden.json")


def test_schema_missing_file_is_a_distinct_error(tmp_path):
    with pytest.raises(golden_schema.GoldenFileMissingError, match="file not found"):
        golden_schema.load(tmp_path / "absent.json")


def test_schema_accepts_upstream_style_file():
    text = json.dumps(
        {
            "lm loss": {
                "start_step": 1,
                "end_step": 10,
                "step_interval": 5,
                "values": {"1": 10.9, "5": "nan", "10": 10.1},
            }
        }
    )
    with pytest.raises(golden_schema.GoldenSchemaError):
        golden_schema.loads(text)  # 1, 5, 10 is not a regular grid
    text = text.replace('"start_step": 1', '"start_step": 0').replace('"1": 10.9', '"0": 10.9')
    loaded = golden_schema.loads(text)["lm loss"]
    assert list(loaded.steps) == [0, 5, 10] and math.isnan(loaded.values[5])


# --------------------------------------------------------------------------- exact check


def test_single_one_ulp_difference_is_found_at_its_step(tmp_path):
    base = run_scalars()
    loss7 = base["lm loss"][7]
    write_events(tmp_path / "up", base)
    write_events(tmp_path / "pa", run_scalars({("lm loss", 7): next_f32(loss7)}))
    up = tbr.read_run_metrics(tmp_path / "up")
    pa = tbr.read_run_metrics(tmp_path / "pa")
    result = checks.compare_variants(up, pa)
    assert result.first == checks.Divergence(7, "lm loss", f32(loss7), next_f32(loss7))
    assert result.max_abs_diff["lm loss"] == next_f32(loss7) - f32(loss7) > 0
    assert result.max_abs_diff["grad-norm"] == 0.0
    line = result.first.describe()
    assert (
        line
        == f"diverged at step 7 (lm loss, {str(numpy.float32(loss7))}, {str(numpy.float32(next_f32(loss7)))})"
    )
    assert str(numpy.float32(loss7)) != str(numpy.float32(next_f32(loss7)))


def test_float64_one_ulp_difference_is_a_divergence():
    up = three()
    values = list(up["grad-norm"].values.values())
    values[2] = math.nextafter(values[2], math.inf)
    pa = {**up, "grad-norm": series(values)}
    first = checks.compare_variants(up, pa).first
    assert (first.step, first.metric) == (3, "grad-norm")


def test_first_divergence_is_earliest_step_then_metric_order():
    up = three()
    lm = list(up["lm loss"].values.values())
    gn = list(up["grad-norm"].values.values())
    nz = list(up["num-zeros"].values.values())
    lm[4] += 1.0
    gn[2] += 1.0
    first = checks.compare_variants(up, three(lm=lm, gn=gn)).first
    assert (first.step, first.metric) == (3, "grad-norm")
    lm[2] += 1.0
    nz[2] += 1.0
    first = checks.compare_variants(up, three(lm=lm, gn=gn, nz=nz)).first
    assert (first.step, first.metric) == (3, "lm loss")


def test_identical_runs_and_missing_required_metric():
    assert checks.compare_variants(three(), three()).identical
    up = three()
    pa = {k: v for k, v in three().items() if k != "num-zeros"}
    result = checks.compare_variants(up, pa)
    assert result.first is None and result.failures == ["num-zeros: not logged by series"]


def test_variant_grid_mismatch_and_shared_nan_are_failures():
    short = three(n=STEPS - 2)
    result = checks.compare_variants(three(), short)
    assert any("step grids differ" in f for f in result.failures)
    lm = [curve("lm loss", t) for t in range(1, STEPS + 1)]
    lm[5] = math.nan
    result = checks.compare_variants(three(lm=lm), three(lm=lm))
    assert result.first is None and any("steps [6]" in f for f in result.failures)


# --------------------------------------------------------------------------- tolerances


def test_tolerance_boundaries():
    assert tolerances.Approximate(rtol=0.25).allows(5.0, 4.0)  # |1.0| <= 0.25 * 4
    assert tolerances.Approximate(rtol=0.25).allows(3.0, 4.0)
    assert not tolerances.Approximate(rtol=0.25).allows(math.nextafter(5.0, 6.0), 4.0)
    assert tolerances.Approximate(rtol=0.0, atol=0.5).allows(0.5, 0.0)
    assert not tolerances.Approximate(rtol=0.0, atol=0.5).allows(0.5000001, 0.0)
    assert tolerances.Approximate(rtol=0.5, atol=0.5).allows(6.5, 4.0)  # 2.5 <= 0.5 + 0.5 * 4
    assert not tolerances.Approximate(rtol=0.5, atol=0.5).allows(6.5001, 4.0)
    assert not tolerances.Approximate(rtol=1.0).allows(math.inf, 4.0)
    assert tolerances.Approximate(rtol=1.0).allows(math.inf, math.inf)
    assert tolerances.Exact().allows(2.5, 2.5)
    assert not tolerances.Exact().allows(math.nextafter(2.5, 3), 2.5)
    with pytest.raises(ValueError):
        tolerances.Approximate(rtol=-1e-3)


def test_golden_check_applies_tolerance_per_step_on_rounded_values():
    golden = three()
    lm = list(golden["lm loss"].values.values())
    # Inside: 0.9e-3 relative at every step (no averaging can hide a failing step...)
    inside = [v * (1 + 0.9e-3) for v in lm]
    result = checks.compare_to_golden(three(lm=inside), golden, RULES, "series")
    assert result.failures == [] and result.failing_steps["lm loss"] == 0
    # ...and one step outside by 1.1e-3 fails alone, naming that step.
    inside[6] = lm[6] * (1 + 1.1e-3)
    result = checks.compare_to_golden(three(lm=inside), golden, RULES, "series")
    assert result.failing_steps["lm loss"] == 1
    assert result.failures[0].startswith("series: lm loss: step 7: ")


def test_golden_exact_rule_compares_at_five_decimals(tmp_path):
    exact_up = three(nz=[1.000004] * STEPS)
    golden_schema.save(tmp_path / "g.json", {"num-zeros": series([1.0] * STEPS)})
    rules = {"num-zeros": RULES["num-zeros"]}
    ok = verdicts.build_comparison("c", exact_up, exact_up, tmp_path / "g.json", rules)
    assert ok["verdict"] == "identical"
    bad = three(nz=[1.000006] * STEPS)  # rounds to 1.00001
    out = verdicts.build_comparison("c", bad, bad, tmp_path / "g.json", rules)
    assert out["verdict"] == "outside_golden"
    assert out["metrics"]["num-zeros"]["golden_failing_steps"] == {
        "pristine": STEPS,
        "series": STEPS,
    }


@pytest.mark.parametrize(
    "kind, expect",
    [
        ("missing_step", "step 4: missing or NaN in the run"),
        ("nan", "step 4: missing or NaN in the run"),
        ("golden_nan", "step 4: golden has no value but the run has"),
        ("short_run", "step-count mismatch: run 1..8 every 1 (8 steps), golden 1..10"),
    ],
)
def test_golden_check_failures(kind, expect, tmp_path):
    golden = three()
    lm = [curve("lm loss", t) for t in range(1, STEPS + 1)]
    if kind in ("missing_step", "nan"):
        scalars = run_scalars()
        if kind == "missing_step":
            del scalars["lm loss"][4]
        else:
            scalars["lm loss"][4] = math.nan
        write_events(tmp_path / "tb", scalars)
        run = tbr.read_run_metrics(tmp_path / "tb", end_step=STEPS)
        golden = golden_schema.round_all(run)
        golden["lm loss"] = series([round(f32(v), 5) for v in lm])
    elif kind == "golden_nan":
        run = three()
        lm[3] = math.nan
        golden = three(lm=lm)
    else:
        run = three(n=STEPS - 2)
    result = checks.compare_to_golden(golden_schema.round_all(run), golden, RULES, "pristine")
    messages = result.failures + result.structural
    assert any(expect in m for m in messages), messages


def test_missing_step_allowed_only_where_rule_says_so():
    golden = {"iteration-time": series([math.nan, 0.1, 0.1])}
    run = {"iteration-time": series([math.nan, 0.2, 0.1])}
    rule = {"iteration-time": tolerances.MetricRule(tolerances.Approximate(rtol=0.0), allow_missing=True)}
    assert checks.compare_to_golden(run, golden, rule).failing_steps["iteration-time"] == 1
    strict = {
        "iteration-time": tolerances.MetricRule(tolerances.Approximate(rtol=1.0), allow_missing=False)
    }
    result = checks.compare_to_golden(run, golden, strict)
    assert result.failures == [
        "actual: iteration-time: step 1: no value in the run nor in the golden file"
    ]


# --------------------------------------------------------------------------- verdicts


def test_build_comparison_verdicts(tmp_path):
    golden_path = tmp_path / "golden.json"
    up = three()
    golden_schema.save(golden_path, golden_schema.round_all(up))

    same = verdicts.build_comparison("case", up, three(), golden_path, RULES)
    assert same["verdict"] == "identical" and same["verdict_line"] == "identical"
    assert same["first_divergent_step"] is None and same["failures"] == []
    assert same["metrics"]["lm loss"]["max_abs_diff_variants"] == 0.0
    json.dumps(same, allow_nan=False)

    lm = list(up["lm loss"].values.values())
    lm[5] += 0.5
    div = verdicts.build_comparison("case", up, three(lm=lm), golden_path, RULES)
    assert div["verdict"] == "diverged" and div["first_divergent_step"] == 6
    assert (
        div["verdict_line"]
        == f"diverged at step 6 (lm loss, {up['lm loss'].values[6]!r}, {lm[5]!r})"
    )
    assert div["metrics"]["lm loss"]["max_abs_diff_variants"] == pytest.approx(0.5)
    assert div["metrics"]["lm loss"]["identical"] is False
    assert any(m.startswith("series: lm loss: step 6") for m in div["failures"])

    missing = verdicts.build_comparison("case", up, three(), tmp_path / "none.json", RULES)
    assert missing["verdict"] == "no_golden"
    assert missing["verdict_line"] == f"no golden values: {tmp_path / 'none.json'} does not exist (series == pristine exactly)"
    assert not any("tolerance" in f or "diverged" in f for f in missing["failures"])
    # What outranks a missing golden file: a divergence, a crash.
    assert verdicts.build_comparison("case", up, three(lm=lm), tmp_path / "none.json", RULES)["verdict"] == "diverged"
    assert verdicts.build_comparison(
        "case", up, three(), tmp_path / "none.json", RULES, ["rank 1 exited with 1"]
    )["verdict"] == "failed"

    crashed = verdicts.build_comparison(
        "case", up, three(), golden_path, RULES, ["rank 1 exited with 1"]
    )
    assert crashed["verdict"] == "failed"
    assert crashed["verdict_line"] == "failed: rank 1 exited with 1"

    # A failure outranks golden deviations: both variants off golden AND one metric absent.
    off = three(lm=[v * 1.5 for v in lm])
    del off["num-zeros"]
    both = verdicts.build_comparison("case", off, dict(off), golden_path, RULES)
    assert both["verdict"] == "failed"
    assert any("num-zeros: not logged by pristine and series" == f for f in both["failures"])
    assert any(f.startswith("pristine: lm loss: step 1:") for f in both["failures"])


def test_all_metrics_failures_collected_before_verdict(tmp_path):
    golden_path = tmp_path / "golden.json"
    golden_schema.save(golden_path, golden_schema.round_all(three()))
    off = three(
        lm=[v * 1.01 for v in three()["lm loss"].values.values()],
        gn=[v * 1.5 for v in three()["grad-norm"].values.values()],
    )
    out = verdicts.build_comparison("case", off, off, golden_path, RULES)
    assert out["verdict"] == "outside_golden" and out["verdict_line"] == "outside golden tolerance"
    failing = out["metrics"]
    assert failing["lm loss"]["golden_failing_steps"] == {"pristine": STEPS, "series": STEPS}
    assert failing["grad-norm"]["golden_failing_steps"] == {"pristine": STEPS, "series": STEPS}
    assert failing["num-zeros"]["golden_failing_steps"] == {"pristine": 0, "series": 0}
    assert len(out["failures"]) == 4 * STEPS
    table = formatting.format_table(out)
    assert "grad-norm" in table and table.endswith("verdict: outside golden tolerance")


def test_rules_for_unknown_metric_is_an_error():
    assert list(tolerances.rules_for(["lm loss", "iteration-time"])) == ["lm loss", "iteration-time"]
    with pytest.raises(KeyError, match="no golden rule"):
        tolerances.rules_for(["lm loss", "throughput"])


# --------------------------------------------------------------------------- golden update


def test_update_golden_refuses_when_variants_differ(tmp_path):
    path = tmp_path / "golden.json"
    golden_schema.save(path, golden_schema.round_all(three()))
    before = path.read_bytes()
    lm = list(three()["lm loss"].values.values())
    lm[8] = math.nextafter(lm[8], 0)
    with pytest.raises(golden_update.GoldenUpdateRefused, match="diverged at step 9"):
        golden_update.update_golden(path, three(), three(lm=lm), RULES)
    assert path.read_bytes() == before
    with pytest.raises(golden_update.GoldenUpdateRefused, match="num-zeros: not logged"):
        golden_update.update_golden(
            path, three(), {k: v for k, v in three().items() if k != "num-zeros"}, RULES
        )
    nan_lm = list(three()["lm loss"].values.values())
    nan_lm[0] = math.nan
    with pytest.raises(golden_update.GoldenUpdateRefused, match="no value"):
        golden_update.update_golden(path, three(lm=nan_lm), three(lm=nan_lm), RULES)
    assert path.read_bytes() == before


def test_update_golden_writes_and_shows_per_step_diff(tmp_path):
    path = tmp_path / "golden.json"
    text = golden_update.update_golden(path, three(), three(), RULES)
    assert "created" in text
    assert golden_schema.load(path) == golden_schema.round_all(three())

    lm = list(three()["lm loss"].values.values())
    lm[1] += 0.25
    diff = golden_update.update_golden(path, three(lm=lm), three(lm=lm), RULES)
    old2, new2 = round(three()["lm loss"].values[2], 5), round(lm[1], 5)
    assert f"lm loss step 2: {old2!r} -> {new2!r}" in diff
    assert "= grad-norm: unchanged" in diff
    assert sum("step" in line for line in diff.splitlines()) == 1
    assert golden_schema.load(path)["lm loss"].values[2] == new2


# --------------------------------------------------------------------------- plot


MIB = 1024 * 1024


def memory_summary(sync_mib: float, peaks_mib: list[float], between_mib: float | None = None) -> dict:
    """A memory.json dict (memory_report's layout): the param sync allocates ``sync_mib`` of
    megatron tensors and none in NCCL at every step; step peaks as given."""
    steps = {str(t): {"megatron_bytes": int(sync_mib * MIB), "nccl_temporary_bytes": 0,
                      "step_peak_bytes": int(p * MIB)} for t, p in enumerate(peaks_mib, 1)}  # fmt: skip
    between = {} if between_mib is None else {"5": {"megatron_bytes": int(between_mib * MIB), "nccl_temporary_bytes": 0}}
    return {"schema": 1, "ranks": 2, "steps": steps, "between_steps": between, "kinds": {}}


def run_info(verdict: str, line: str, base: str = "0.19") -> plot.RunInfo:
    version = {"0.19": "0.19.2", "0.17.1": "0.17.1"}[base]
    return plot.RunInfo(case="gpt_case", base=base, version=version, series=f"patches/{base}", ranks=2,
                        device="cpu", verdict=verdict, verdict_line=line,
                        trees={"pristine": f"pristine-{base}", "series": f"series-{base}"})  # fmt: skip


def render(tmp_path, info, series_lm=None, divergent_step=None):
    """Both the PNG (through plot_loss_curves) and the figure object of one comparison."""
    up = three()
    curves = {"pristine": up, "series": three(lm=series_lm), "golden": golden_schema.round_all(up)}
    peaks = [4.0, 4.1, 4.246] + [4.0] * (STEPS - 3)
    memory = {"pristine": memory_summary(0.119, peaks, between_mib=0.119), "series": memory_summary(0.0, peaks, between_mib=0.0)}
    rules = tolerances.rules_for(["lm loss", "grad-norm", "num-zeros"])
    path = plot.plot_loss_curves(tmp_path / "sub" / "loss_curves.png", curves, divergent_step, memory=memory,
                                 rules=rules, info=info)  # fmt: skip
    return path, plot.build_figure(curves, divergent_step, memory=memory, rules=rules, info=info), up


def _axes(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def _line(ax, label):
    return next(line for line in ax.get_lines() if line.get_label() == label)


def _red_lines(ax) -> list:
    return [line.get_xdata()[0] for line in ax.get_lines() if line.get_color() == "red"]


def test_plot_of_an_identical_run_explains_itself(tmp_path):
    """Title: case, base version, ranks, device, both trees, the verdict and "bit for bit";
    the golden band; the memory panels' zeros visible as markers; the step peak's maximum as
    the memory table prints it."""
    path, fig, up = render(tmp_path, run_info("identical", "identical"))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (1500, 1000)
    title = fig._suptitle.get_text()
    for words in ("gpt_case", "megatron-core 0.19.2", "2 ranks", "CPU, gloo", "pristine = pristine-0.19",
                  "series = series-0.19 (0.19.2 + patches/0.19)", "verdict: identical", "bit for bit",
                  "within the golden tolerance"):  # fmt: skip
        assert words in title, (words, title)
    axes = _axes(fig)
    lm = axes["lm loss"]
    band = next(c for c in lm.collections if c.get_label().startswith("golden ± tolerance"))
    ys = band.get_paths()[0].vertices[:, 1]
    g1 = round(up["lm loss"].values[1], 5)
    assert min(ys) == pytest.approx(min(g * (1 - 1e-3) for g in golden_schema.round_all(up)["lm loss"].values.values()))
    assert g1 * (1 + 1e-3) == pytest.approx(max(ys))
    assert "rtol=0.001" in band.get_label()
    assert [line.get_label() for line in lm.get_lines()] == ["golden", "pristine-0.19", "series-0.19"]
    sync = next(ax for title, ax in axes.items() if title.startswith("layer-wise param sync"))
    zeros = _line(sync, "series-0.19: megatron tensors, per step (max 0.000)")
    assert list(zeros.get_ydata()) == [0.0] * STEPS and zeros.get_marker() not in ("None", "", None)
    assert zeros.get_linestyle() == "None" and sync.get_ylim()[0] < 0 < sync.get_ylim()[1]
    pristine = _line(sync, "pristine-0.19: megatron tensors, per step (max 0.119)")
    assert list(pristine.get_ydata()) == [pytest.approx(0.119, abs=1e-6)] * STEPS
    forced = _line(sync, "pristine-0.19: megatron tensors, forced sync after the step (max 0.119)")
    assert list(forced.get_xdata()) == [5.5]
    peak = next(ax for title, ax in axes.items() if title.startswith("step peak"))
    assert _line(peak, "pristine-0.19 (max 4.246)").get_ydata()[2] == pytest.approx(4.246, abs=1e-6)
    assert any(list(line.get_ydata()) == [pytest.approx(4.246, abs=1e-6)] * 2 for line in peak.get_lines())
    assert all(_red_lines(ax) == [] for ax in fig.axes)
    assert all(ax.get_legend() is not None and ax.get_legend().get_texts()[0].get_fontsize() >= 8
               for ax in fig.axes)  # fmt: skip


def test_plot_of_a_divergent_run_marks_the_step_and_says_what_it_means(tmp_path):
    up_lm = [curve("lm loss", t) for t in range(1, STEPS + 1)]
    lm = list(up_lm)
    lm[5] += 1.0
    info = run_info("diverged", "diverged at step 6 (lm loss, 6.25, 7.25)", base="0.17.1")
    _, fig, _ = render(tmp_path, info, series_lm=lm, divergent_step=6)
    title = fig._suptitle.get_text()
    assert "megatron-core 0.17.1" in title and "pristine = pristine-0.17.1 (" in title
    assert "series = series-0.17.1 (0.17.1 + patches/0.17.1)" in title
    assert "verdict: diverged at step 6 (lm loss" in title and "series differs from pristine" in title
    assert "bit for bit" not in title
    axes = _axes(fig)
    assert list(_line(axes["lm loss"], "series-0.17.1").get_ydata()) == lm
    assert all(_red_lines(ax) == [6] for ax in fig.axes)
    # The two bases draw their trees in different colours.
    _, fig019, _ = render(tmp_path, run_info("identical", "identical"))
    assert _line(axes["lm loss"], "pristine-0.17.1").get_color() != _line(_axes(fig019)["lm loss"], "pristine-0.19").get_color()


def test_plot_refuses_curves_without_either_metric(tmp_path):
    with pytest.raises(ValueError, match="no curve"):
        plot.plot_loss_curves(tmp_path / "x.png", {"pristine": {"num-zeros": three()["num-zeros"]}, "golden": None})


# --------------------------------------------------------------------------- runner decisions


@pytest.fixture
def no_training(monkeypatch):
    """run_case.main with training refused: the arguments must be turned down before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("trained although the arguments were refused")

    monkeypatch.setattr(rc, "run_case", refuse)


def test_missing_platform_golden_file_names_file_and_command(no_training, tmp_path, monkeypatch, capsys):
    """A copy of the default case (config and CPU golden file only) as the whole case set."""
    src = rc.find_case(rc.DEFAULT_CASE)
    dst = tmp_path / "cases" / "gpt" / rc.DEFAULT_CASE
    dst.mkdir(parents=True)
    shutil.copy(src / "model_config.yaml", dst)
    shutil.copy(src / rc.GOLDEN_NAME["cpu"], dst)
    monkeypatch.setattr(rc, "CASES_DIR", tmp_path / "cases")
    case = rc.DEFAULT_CASE
    assert rc.missing_golden([case], "cpu") == []
    assert rc.main(["--device", "cuda", case]) == rc.EXIT_NO_GOLDEN != 1
    err = capsys.readouterr().err
    assert f"gpt/{case}/golden_values_dgx_h200.json does not exist" in err
    assert f"scripts/run_functional_test.sh --device cuda --update-golden {case}" in err
    for numerics_word in ("diverged", "outside golden", "tolerance", "VERDICT"):
        assert numerics_word not in err
    assert rc.main(["--device", "cuda", "all"]) == rc.EXIT_NO_GOLDEN


def test_update_golden_command_round_trips_through_the_parser():
    words = rc.update_golden_command(rc.DEFAULT_CASE, "cuda").split()
    assert words[0] == "scripts/run_functional_test.sh"
    assert words[1:] == ["--device", "cuda", "--update-golden", rc.DEFAULT_CASE]
    assert rc.update_golden_command(rc.DEFAULT_CASE, "cpu").split()[1:] == ["--update-golden", rc.DEFAULT_CASE]


def test_committed_golden_data_records_source_tokenizer_and_dataset():
    from harness import data

    recorded = json.loads(rc.GOLDEN_DATA.read_text())
    assert recorded["source"]["file"] == data.read_lock()["MCORE_WHEEL"]
    assert recorded["source"]["sha256"] == data.read_lock()["MCORE_WHEEL_SHA256"]
    assert recorded["tokenizer"]["library"].startswith("tokenizers ")
    assert all(len(recorded["dataset"][k]) == 64 for k in (".bin", ".idx"))
    assert len(recorded["corpus"]["sha256"]) == 64


def test_every_split_of_every_case_gets_documents():
    """megatron's GPTDataset loops forever building the indices of a split that has no
    document but is asked for samples (eval/test iterations > 0), so the corpus must be
    large enough for each case's --split, by megatron's own split rounding."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    documents = json.loads(rc.GOLDEN_DATA.read_text())["corpus"]["documents"]
    for name in rc.all_cases():
        split = rc.load_case(rc.find_case(name)).model_args["--split"]
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for lo_hi in matrix:
            if lo_hi is not None and lo_hi[1] > lo_hi[0]:
                # blended_megatron_dataset_builder._build_megatron_dataset_splits
                count = int(round(lo_hi[1] * documents)) - int(round(lo_hi[0] * documents))
                assert count >= 1, (name, split, lo_hi, documents)


# --------------------------------------------------------------------------- bases


def test_main_job_runs_each_base_default_case_0_19_first():
    assert rc.default_cases(list(rc.BASES)) == ["gpt019_dp2_bf16_fp32grad_overlap_legacy", rc.DEFAULT_CASE]
    for name in rc.default_cases(list(rc.BASES)):
        case = rc.load_case(rc.find_case(name))
        assert rc.BASES[case.base].default_case == name
    assert rc.load_case(rc.find_case(rc.DEFAULT_CASE)).base == "0.17.1"


def test_a_case_of_another_base_is_refused_before_training(no_training, capsys):
    assert rc.main(["--base", "0.17.1", rc.BASES["0.19"].default_case]) == 2
    assert "are not cases of megatron-core 0.17.1" in capsys.readouterr().err


def test_a_missing_checkout_is_named_before_training(no_training, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(rc.BASES, "0.19", rc.replace(rc.BASES["0.19"], checkout=tmp_path / "core_v0.19.0"))
    assert rc.main(["--base", "0.19"]) == 2
    err = capsys.readouterr().err
    assert f"no Megatron-LM checkout at {tmp_path / 'core_v0.19.0'}" in err and "MEGATRON_LM_019_SRC" in err


@pytest.mark.parametrize(
    "key, bad, match",
    [
        ("BASE", "0.18.2", r"BASE '0.18.2' not in \['0.17.1', '0.19'\]"),
        ("EXPECT_PARAM_SYNC", ["expert"], "must map a kind"),
        ("EXPECT_PARAM_SYNC", {"experts": {"group_size": 2}}, "not in"),
    ],
)
def test_bad_case_config_is_a_config_error(tmp_path, key, bad, match):
    doc = yaml.safe_load((rc.find_case(rc.DEFAULT_CASE) / "model_config.yaml").read_text())
    (tmp_path / "model_config.yaml").write_text(yaml.safe_dump({**doc, key: bad}))
    with pytest.raises(rc.CaseConfigError, match=match):
        rc.load_case(tmp_path)
