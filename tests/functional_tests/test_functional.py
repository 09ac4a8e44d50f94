"""Functional tests: every test case, pristine vs series tree in one run, against golden values.

Each case trains the pristine tree (pristine-<base>) and the series tree (series-<base>) on
CPU gloo ranks (tests/functional_tests/python_test_utils/run_case.py) and must come out
"identical": the series equal to pristine bit for bit on lm loss, grad-norm, num-zeros (and
params-norm, learning-rate), and both within the golden tolerance at every step.

The same runs' param-sync records (``param_sync/rank<R>.json``) check what the main job makes
of them: memory.json, the memory block next to the verdict and the plot's memory panels
(memory_report, plot), with the expected numbers computed here from the rank files.

Teeth: the mutants in tests/mutants (deliberate bugs on top of the
series) must make the default case diverge or fail, and those in MORE_MUTANT_CASES the
cases named there too (the MoE case: its expert buckets are gathered on the expert-DP
group). Mutants that cannot show in training numerics at all are in INVISIBLE_TO_TRAINING;
the unit tests catch them (tests/unit_tests/test_layerwise_param_sync.py::test_mutants_are_caught).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from harness import param_sync_trace
from harness.trees import REPO_ROOT, make_mutant_tree
from tests.functional_tests.python_test_utils import memory_report, plot, tensorboard_reader
from tests.functional_tests.python_test_utils import run_case as rc
from tests.tiers import tiered

MUTANTS_DIR = REPO_ROOT / "tests" / "mutants" / "0.17.1"
# Mutants that cannot change the default case's numerics in megatron.training, whose
# train_step calls zero_grad_buffer() (which completes pending gathers and zeroes every
# grad_data, setting it idle) before each step's first forward, so that every pre-hook
# gather runs over idle grad_data and no forced sync or sync over unreset grads happens:
# zeroing_only_in_pre_hooks and zeroes_all_of_grad_data differ only after a sync that no
# pre-hook completes or that received into a temporary (forced sync at eval/checkpoint,
# free_overlap_buffers); gather_over_grads and forced_sync_into_grad_data need a
# sync over grads that no zero_grad_buffer() reset, or a forced one, which the default
# case never runs; zero_grad_buffer_under_pending_gather needs a gather pending at
# zero_grad_buffer(), which the training loop never leaves; optimizer_broadcast_from_wrong_owner
# mutates the optimizer path, which the default case (--overlap-param-gather) does not take
# (MORE_MUTANT_CASES trains it on the sync case); slots_out_of_rank_order is wrong only for
# equal shares (all_gather_into_tensor's chunks come in rank order; broadcasts from reversed
# slots are read back from the same slots), which the default case's buckets do not have
# (measured: it trains identically). The unit tests
# (tests/unit_tests/test_layerwise_param_sync.py, test_grad_data_guards.py) check each directly.
INVISIBLE_TO_TRAINING = {
    "zeroing_only_in_pre_hooks",
    "zeroes_all_of_grad_data",
    "gather_over_grads",
    "forced_sync_into_grad_data",
    "zero_grad_buffer_under_pending_gather",
    "optimizer_broadcast_from_wrong_owner",
    "slots_out_of_rank_order",
}
MUTANTS = sorted(p.stem for p in MUTANTS_DIR.glob("*.patch"))
VPP_CASES = ("gpt_pp2_vpp2_dp2_bf16_fp32grad_overlap_layerwise", "gpt019_pp2_vpp2_dp2_bf16_fp32grad_overlap_legacy")
# The 0.19 case on the layer-wise param layout path (model-provider API), and the 0.19 default
# case (core_v0.19.0's pretrain_gpt.py, --no-use-layer-wise-param-layout).
LAYOUT_CASE_019 = "gpt019_dp2_bf16_fp32grad_overlap_layout"
DEFAULT_CASE_019 = rc.BASES["0.19"].default_case
MOE_CASE = "gpt_moe_ep2_dp4_bf16_fp32grad_overlap_layerwise"
SYNC_CASE = "gpt_dp2_bf16_fp32grad_sync_layerwise"
# Cases other than the default one that mutants must break, by mutant name (one training
# run each): without the zeroing the expert buckets' grad_data keeps gathered params too;
# the sync case (no --overlap-param-gather) takes the optimizer path's in-place broadcasts.
MORE_MUTANT_CASES = {MOE_CASE: ("no_zeroing",), SYNC_CASE: ("optimizer_broadcast_from_wrong_owner",)}
MUTANT_RUNS = [(rc.DEFAULT_CASE, m) for m in MUTANTS if m not in INVISIBLE_TO_TRAINING] + [
    (case, m) for case, names in MORE_MUTANT_CASES.items() for m in names
]
# A mutant run stops after this many steps (``--exit-interval``: the case's learning-rate
# schedule is kept, so the steps it runs are those of the full run). Every mutant above
# diverges by step 3 (default case) or 2 (MoE case); a run that stops early is compared
# step by step over the steps it has, and a divergence there is the verdict.
MUTANT_STEPS = 8

#: The cases the default run trains (CI): each base's default case and the evaluation case
#: (the forced syncs); the rest, and every test that reads them, are `extended`
#: (scripts/test.sh --all). Of the mutants, the default run keeps no_zeroing on the default
#: case (#3751's bug); the others run in the extended tier.
DEFAULT_RUN_CASES = {rc.DEFAULT_CASE, DEFAULT_CASE_019, "gpt_dp2_bf16_fp32grad_overlap_layerwise_eval"}
DEFAULT_RUN_MUTANTS = {(rc.DEFAULT_CASE, "no_zeroing")}
#: The cases whose param-sync records the memory checks read, each kind of param sync with the
#: group it gathers on: DP 2; the MoE case, expert-DP 2 and dense DP 4 (expert buckets).
MEMORY_CASES = {rc.DEFAULT_CASE: {"dense": 2}, MOE_CASE: {"expert": 2, "dense": 4}}
MIB = 1024 * 1024


pytestmark = [pytest.mark.slow, pytest.mark.gloo]


def records_memory(name: str) -> bool:
    """Whether the suite records a case's param-sync memory: where a check reads it, the
    default case (the main job's memory block) and cases with EXPECT_PARAM_SYNC (the MoE
    case's expert gathers). Counting every op of a training step costs about a third more
    CPU per run; scripts/run_functional_test.sh records every case."""
    defaults = {b.default_case for b in rc.BASES.values()}
    return name in defaults or name == LAYOUT_CASE_019 or bool(rc.load_case(rc.find_case(name)).expect_param_sync)


@pytest.fixture(scope="session")
def case_results():
    """Run each case at most once per session; {case: comparison dict}. A case whose base's
    Megatron-LM checkout scripts/setup.sh did not build (the 0.19 one is optional there, like
    its upstream tests) is skipped."""
    cache = {}

    def get(name):
        absent = rc.missing_checkouts([name])
        if absent:
            pytest.skip(absent[0])
        if name not in cache:
            cache[name] = rc.run_case(name, device="cpu", record_memory=records_memory(name))
        return cache[name]

    return get


@pytest.mark.parametrize("case", tiered(rc.all_cases(), DEFAULT_RUN_CASES.__contains__))
def test_case_identical_and_within_golden(case_results, case):
    comparison = case_results(case)
    out = rc.OUT_ROOT / case
    assert (out / "comparison.json").is_file() and (out / "loss_curves.png").is_file()
    for variant in rc.VARIANTS:
        assert (out / variant / "metrics.json").is_file()
    assert comparison["verdict"] == "identical", (
        comparison["verdict_line"] + "\n" + "\n".join(comparison["failures"][:20])
    )


@pytest.mark.smoke
def test_default_case_learns(case_results):
    """Smoke test (passes on pristine 0.17.1 too; not a check of the series): the tiny GPT
    must actually train on the real text: lm loss falls by > 10 %."""
    case_results(rc.DEFAULT_CASE)
    metrics = json.loads((rc.OUT_ROOT / rc.DEFAULT_CASE / "series" / "metrics.json").read_text())
    loss = metrics["lm loss"]["values"]
    first, last = loss["1"], loss[str(metrics["lm loss"]["end_step"])]
    assert last < 0.9 * first, (first, last)


@pytest.mark.parametrize(
    "case", tiered([c for c in rc.all_cases() if records_memory(c) and c != LAYOUT_CASE_019], DEFAULT_RUN_CASES.__contains__)
)
def test_series_param_sync_allocates_nothing(case_results, case):
    """The memory block printed next to the verdict, asserted: in every training step, on
    every rank, the series' layer-wise param sync allocates 0 bytes of megatron tensors and
    0 bytes of NCCL temporaries (collective model), while it really gathers; the forced
    syncs between steps allocate no NCCL temporary and, by design (grad_data may hold grads
    there), megatron temporaries (0.17.1 allocates some in the steps too)."""
    memory = case_results(case)["memory"]
    series, pristine = memory["series"], memory["pristine"]
    got = memory_report.step_maxima(series)
    keys = ("megatron_bytes", "nccl_temporary_bytes", "between_nccl_temporary_bytes")
    assert {k: got[k] for k in keys} == dict.fromkeys(keys, 0), memory_report.format_memory(memory)
    assert series["kinds"] and all(k["calls"] > 0 and k["wire_bytes"] > 0 for k in series["kinds"].values()), series["kinds"]
    assert memory_report.step_maxima(pristine)["megatron_bytes"] > 0, memory_report.format_memory(memory)


def rank_files_reduced(case: str, variant: str) -> dict:
    """What a run's memory.json must hold, computed from its ranks' ``param_sync/rank<R>.json``
    (harness.param_sync_recorder) without memory_report: {"ranks": number of files, "steps" and
    "between_steps": {step: per field the max over ranks}, of the kinds' summed megatron_bytes and
    nccl_temporary_bytes (and the step_peak_bytes of a training step), "kinds": {kind: every
    count summed over ranks and slots, group_size the largest}}. Bytes."""
    files = sorted((rc.OUT_ROOT / case / variant / rc.RECORD_DIR).glob("rank*.json"))
    records = [json.loads(p.read_text()) for p in files]
    out = {"ranks": len(records), "steps": {}, "between_steps": {}, "kinds": {}}
    for r in records:
        for section in ("steps", "between_steps"):
            for step, slot in r[section].items():
                syncs = slot["param_sync"].values()
                row = {f: sum(k[f] for k in syncs) for f in ("megatron_bytes", "nccl_temporary_bytes")}
                if section == "steps":
                    row["step_peak_bytes"] = slot["step_peak_bytes"]
                into = out[section].setdefault(step, dict.fromkeys(row, 0))
                into.update({f: max(into[f], v) for f, v in row.items()})
                for kind, counts in slot["param_sync"].items():
                    total = out["kinds"].setdefault(kind, dict.fromkeys(counts, 0))
                    for f, v in counts.items():
                        total[f] = max(total[f], v) if f == "group_size" else total[f] + v
    return out


def _largest(reduced: dict, section: str, field: str) -> float:
    """The largest ``field`` over ``reduced[section]``'s steps, in MiB."""
    return max(row[field] for row in reduced[section].values()) / MIB


@pytest.mark.parametrize("case", tiered(MEMORY_CASES, DEFAULT_RUN_CASES.__contains__))
def test_memory_json_is_the_rank_files_reduced(case_results, case, tmp_path):
    """Each run's memory.json (memory_report.write_run_memory), as comparison.json holds it, is
    its rank files reduced (``rank_files_reduced``): one record per rank, each kind of param
    sync on its group (``MEMORY_CASES``) with bytes on the wire, and the forced sync of the end
    of training (megatron's train() disables the pre-hooks) recorded between steps."""
    comparison = case_results(case)
    nproc = rc.load_case(rc.find_case(case)).nproc
    for variant in rc.VARIANTS:
        got, want = comparison["memory"][variant], rank_files_reduced(case, variant)
        assert got["ranks"] == want["ranks"] == nproc, variant
        for section in ("steps", "between_steps", "kinds"):
            assert got[section] == want[section], (variant, section)
        assert {k: t["group_size"] for k, t in got["kinds"].items()} == MEMORY_CASES[case], variant
        assert all(t["wire_bytes"] > 0 for t in got["kinds"].values()), (variant, got["kinds"])
        assert want["between_steps"], f"{variant}: no forced sync recorded between steps"
        assert memory_report.load_run_memory(rc.OUT_ROOT / case / variant) == got
    assert memory_report.load_run_memory(tmp_path) is None


@pytest.mark.parametrize("case", tiered(MEMORY_CASES, DEFAULT_RUN_CASES.__contains__))
def test_memory_block_prints_both_runs_in_mib(case_results, case):
    """The memory block next to the verdict (memory_report.format_memory): per run, in MiB, the
    largest per-step param-sync bytes, step peak and forced-sync bytes of the rank files; per
    kind of param sync its group and each run's counts; the terms it uses."""
    memory = case_results(case)["memory"]
    text = memory_report.format_memory(memory)
    lines = [line.strip() for line in text.splitlines()]
    want = {v: rank_files_reduced(case, v) for v in rc.VARIANTS}
    for label, section, field in (
        ("param sync, megatron tensors", "steps", "megatron_bytes"),
        ("param sync, NCCL temporaries", "steps", "nccl_temporary_bytes"),
        ("step peak", "steps", "step_peak_bytes"),
        ("forced syncs between steps, megatron", "between_steps", "megatron_bytes"),
        ("forced syncs between steps, NCCL", "between_steps", "nccl_temporary_bytes"),
    ):
        row = [line for line in lines if line.startswith(label)]
        assert len(row) == 1, (label, text)
        assert row[0].split()[-2:] == [f"{_largest(want[v], section, field):.3f}" for v in rc.VARIANTS], row
    for kind, group in MEMORY_CASES[case].items():
        assert f"{kind} param sync on a group of {group} ranks, totals over the run and all ranks:" in lines, text
        for v in rc.VARIANTS:
            k = want[v]["kinds"][kind]
            zero = f" ({k['zero_size_ops']} zero-size)" if k["zero_size_ops"] else ""
            counts = (f"{k['calls']} c10d calls, {k['ops']} NCCL operations{zero} in {k['launches']} group "
                      f"launches, {k['wire_bytes'] / MIB:.2f} MiB received")
            assert [v, counts] in [[s.strip() for s in line.split(":", 1)] for line in lines], (kind, v, text)
    assert "c10d call: one torch.distributed function call" in lines
    assert memory_report.format_memory({"pristine": None, "series": None}) == "memory: no param-sync records"


@pytest.mark.parametrize("case", tiered(MEMORY_CASES, DEFAULT_RUN_CASES.__contains__))
def test_plot_memory_panels_draw_both_runs(case_results, case, tmp_path):
    """loss_curves.png's memory panels (plot): per run, each per-step param-sync series of the
    rank files in MiB, the forced syncs between steps and the step peak, each legend entry
    with the maximum the memory block prints; the PNG is written."""
    memory = case_results(case)["memory"]
    want = {v: rank_files_reduced(case, v) for v in rc.VARIANTS}
    fields = {"megatron_bytes": "megatron tensors", "nccl_temporary_bytes": "NCCL temporaries"}
    lines = plot.memory_lines(memory)
    assert [(v, f) for v, f, _, _ in lines] == [(v, f) for v in rc.VARIANTS for f in fields]
    for v, f, xs, ys in lines:
        steps = sorted(want[v]["steps"], key=int)
        assert xs == [int(s) for s in steps], v
        assert ys == [want[v]["steps"][s][f] / MIB for s in steps], (v, f)
    curves = {v: tensorboard_reader.load_run_metrics(rc.OUT_ROOT / case / v) for v in rc.VARIANTS}
    fig = plot.build_figure(curves, memory=memory)
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    for v in rc.VARIANTS:
        for f, text in fields.items():
            assert f"{v}: {text}, per step (max {_largest(want[v], 'steps', f):.3f})" in labels, labels
            assert f"{v}: {text}, forced sync after the step (max {_largest(want[v], 'between_steps', f):.3f})" in labels
        assert f"{v} (max {_largest(want[v], 'steps', 'step_peak_bytes'):.3f})" in labels, labels
    path = plot.plot_loss_curves(tmp_path / "p.png", curves, memory=memory)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.memory_lines({"pristine": None}) == []


@pytest.mark.parametrize("case", tiered(MEMORY_CASES, DEFAULT_RUN_CASES.__contains__))
def test_expected_param_syncs_are_checked_against_the_memory_record(case_results, case):
    """memory_report.check_expected_syncs (a case's EXPECT_PARAM_SYNC) on a real run's
    memory.json: the kinds and groups it gathered on pass; another group, a kind it never
    gathered (optimizer: the overlap path has none) and a kind without bytes on the wire
    each fail, saying which."""
    summary = case_results(case)["memory"]["series"]
    groups = MEMORY_CASES[case]
    assert memory_report.check_expected_syncs(summary, {k: {"group_size": g} for k, g in groups.items()}) == []
    kind, group = next(iter(groups.items()))
    (wrong_group,) = memory_report.check_expected_syncs(summary, {kind: {"group_size": 2 * group}})
    assert f"{kind} param sync ran on a group of {group} ranks, expected {2 * group}" == wrong_group
    (absent,) = memory_report.check_expected_syncs(summary, {"optimizer": {"group_size": group}})
    assert absent.startswith("no optimizer param-sync gather was recorded"), absent
    no_wire = json.loads(json.dumps(summary))
    no_wire["kinds"][kind]["wire_bytes"] = 0
    (silent,) = memory_report.check_expected_syncs(no_wire, {kind: {"group_size": group}})
    assert silent.startswith(f"no {kind} param-sync gather was recorded"), silent


def readme_example() -> dict:
    """The README's example output of the main job, by section: {case: [lines]} and
    "summary": [lines]; a line that is only "..." marks lines left out."""
    text = (REPO_ROOT / "README.md").read_text()
    block = text.split("## The main job's output", 1)[1].split("```", 2)[1]
    sections, current = {}, None
    for line in block.splitlines()[1:]:
        if line.startswith("== summary"):
            current = "summary"
        elif line.startswith("== "):
            current = line.split()[1]
        if current is not None:
            sections.setdefault(current, []).append(line)
    return sections


def _in_order(shown: list, printed: list) -> list:
    """The lines of ``shown`` ("..." and blank lines aside) that are not lines of ``printed``
    in that order."""
    missing, at = [], 0
    for line in shown:
        if line.strip() in ("", "..."):
            continue
        try:
            at = printed.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def test_readme_example_is_the_main_jobs_output(case_results):
    """README.md's example of the main job's output is what the main job prints for the runs
    this session made of the same cases (the default case of each base): every line shown,
    in order, with its counts and memory figures; only the summary's wall time may differ."""
    import re

    sections = readme_example()
    defaults = rc.default_cases(list(rc.BASES))
    assert [c for c in sections if c != "summary"] == defaults, sections.keys()
    verdicts = {}
    for case in defaults:
        comparison = case_results(case)
        printed = [rc.case_header(rc.load_case(rc.find_case(case)), "cpu")] + rc.case_report(comparison).splitlines()
        assert _in_order(sections[case], printed) == [], "\n".join(printed)
        verdicts[case] = comparison["verdict_line"]
    no_time = lambda lines: [re.sub(r"\(\d+ s\)", "(N s)", line) for line in lines]  # noqa: E731
    summary = no_time(rc.summary_report(verdicts, 0).splitlines())
    assert _in_order(no_time(sections["summary"]), summary) == [], "\n".join(summary)


@pytest.mark.extended
def test_019_layout_case_trains_the_layout_path(case_results):
    """The 0.19 layout case really gathers the layer-wise param layout's way, on both trees:
    one all_gather_into_tensor per call, in place (no zero-size op, no megatron tensor), where
    the legacy default case makes a list all_gather (a broadcast per rank, some zero-size,
    fresh receive tensors on 0.19.2)."""
    layout = case_results(LAYOUT_CASE_019)["memory"]
    legacy = case_results(DEFAULT_CASE_019)["memory"]
    for variant in rc.VARIANTS:
        dense = layout[variant]["kinds"]["dense"]
        assert dense["calls"] > 0 and dense["ops"] == dense["calls"] and dense["zero_size_ops"] == 0, (variant, dense)
        assert memory_report.step_maxima(layout[variant])["megatron_bytes"] == 0, variant
    assert legacy["pristine"]["kinds"]["dense"]["ops"] > legacy["pristine"]["kinds"]["dense"]["calls"]
    assert legacy["pristine"]["kinds"]["dense"]["zero_size_ops"] > 0


@pytest.mark.extended
def test_019_pretrain_gpt_trains_the_legacy_path_whatever_the_layout_flag(case_results, tmp_path):
    """core_v0.19.0's pretrain_gpt.py builds the model from a model config
    (``builder.build_distributed_models``, ``megatron/training/models/dist_utils.py``), which
    computes no layer-wise param layout: without ``--no-use-layer-wise-param-layout`` (the
    layout path requested, 0.19's default) it trains exactly as with it, the legacy path the
    series changes. Compared with the default 0.19 case's pristine run: every metric of every
    step bit for bit, and the same list all_gather per step."""
    from harness import data

    with_flag = case_results(DEFAULT_CASE_019)
    case = rc.load_case(rc.find_case(DEFAULT_CASE_019))
    case = replace(case, model_args={**case.model_args, "--no-use-layer-wise-param-layout": False})
    base = rc.BASES[case.base]
    res = rc.run_variant(case, base.trees["pristine"], tmp_path / "no_flag", str(data.prepare(log=lambda m: None).data_prefix),
                         "cpu", 900, {"MEGATRON_LM_CHECKOUT": str(base.checkout)})
    assert not res.failures, res.failures
    flagged = tensorboard_reader.load_run_metrics(rc.OUT_ROOT / DEFAULT_CASE_019 / "pristine")
    for metric in ("lm loss", "grad-norm", "params-norm"):
        assert res.metrics[metric].values == flagged[metric].values, metric
    assert res.memory["kinds"] == with_flag["memory"]["pristine"]["kinds"]


@pytest.mark.extended
@pytest.mark.parametrize("vpp_case", VPP_CASES)
def test_vpp_case_gathers_every_chunk_through_the_schedule(case_results, vpp_case):
    """The interleaved case really chains the param gathers across model chunks.

    Every rank of both trees prints its gathers (``harness/param_sync_trace.py``,
    ``MEGATRON_PARAM_SYNC_TRACE=1`` in the case). Expected from megatron's code: training
    step 1 runs with the pre-hooks and ``config.param_sync_func`` removed
    (``training.py:train``), so each bucket group of each chunk is dispatched once per
    step 2..N by the interleaved schedule's ``param_sync_func[chunk]`` and waited once by a
    forward pre-hook; ``disable_forward_pre_hook`` forces a sync before each eval (every
    --eval-interval) and once at the end of training. Both chunks' gathers are pending at
    the same time, and chunk 0 of the first stage has several bucket groups.
    """
    case_results(vpp_case)
    case = rc.load_case(rc.find_case(vpp_case))
    steps = case.train_iters - 1
    forced = case.train_iters // int(case.model_args["--eval-interval"]) + 1
    for variant in rc.VARIANTS:
        log = (rc.OUT_ROOT / vpp_case / variant / "stdout.log").read_text()
        ranks = param_sync_trace.parse_log(log)
        assert [r["rank"] for r in ranks] == list(range(case.nproc)), f"{variant}: no trace from some rank"
        for r in ranks:
            where = f"{variant} rank {r['rank']}"
            assert r["chunks"] == 2, where
            groups = Counter(g["chunk"] for g in r["bucket_groups"])
            for chunk in (0, 1):
                n = groups[chunk]
                assert n >= 1, where
                assert r["dispatch"][str(chunk)] == {"forced": n * forced, "schedule_param_sync_func": n * steps}, (
                    where, chunk, r["dispatch"])
                assert r["waited_in_pre_hooks"][str(chunk)] == n * steps, (where, chunk)
            assert r["max_chunks_in_flight"] == 2, where
        assert max(Counter(g["chunk"] for g in r["bucket_groups"])[0] for r in ranks) >= 2, variant


def test_every_mutant_is_classified():
    assert INVISIBLE_TO_TRAINING <= set(MUTANTS), "stale INVISIBLE_TO_TRAINING entry"
    more = {m for names in MORE_MUTANT_CASES.values() for m in names}
    assert more <= set(MUTANTS), f"stale MORE_MUTANT_CASES entries: {more - set(MUTANTS)}"
    assert set(MORE_MUTANT_CASES) <= set(rc.all_cases())
    assert len(MUTANTS) >= 4


@pytest.mark.parametrize("case,mutant", tiered(MUTANT_RUNS, DEFAULT_RUN_MUTANTS.__contains__))
def test_mutant_is_caught(case_results, tmp_path, case, mutant):
    """The case with a mutant as the series side must not be "identical".

    The pristine side is reused from the session's run of the case (same machine, same
    session), so each mutant costs one training run, of MUTANT_STEPS steps.
    """
    case_results(case)
    tree = make_mutant_tree(MUTANTS_DIR / f"{mutant}.patch", tmp_path / "tree")
    comparison = rc.run_case(
        case,
        series_tree=tree,
        out_root=tmp_path / "functional",
        reuse_pristine=rc.OUT_ROOT / case / "pristine",
        record_memory=False,  # only the verdict matters here
        model_args={"--exit-interval": MUTANT_STEPS},
    )
    assert comparison["verdict"] == "diverged", comparison["verdict_line"]
    assert comparison["first_divergent_step"] is not None
    assert comparison["first_divergent_step"] <= MUTANT_STEPS
