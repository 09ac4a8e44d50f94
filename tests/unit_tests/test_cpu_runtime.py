"""Tests of harness/cpu_runtime/, the CPU runtime layer and its all-gather collective model.

Single-process tests install the layer in this process and uninstall it afterwards (unless
it was installed before). Multi-rank tests start real gloo ranks as subprocesses
(``cpu_runtime_gloo_worker.py``), once per world size, and assert on the facts each rank
wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import harness.cpu_runtime as cpu_runtime
from harness.cpu_runtime import collectives
from harness.cpu_runtime import installer
from harness.launch import LaunchError, run_command, torchrun_command

WORKER = Path(__file__).with_name("cpu_runtime_gloo_worker.py")
EQUAL_NUMEL = 6  # the worker's equal slot size


@pytest.fixture
def runtime():
    """The layer installed for one test (force: the layer itself is under test)."""
    was_installed = cpu_runtime.is_installed()
    cpu_runtime.install(force=True)
    yield cpu_runtime
    if not was_installed:
        cpu_runtime.uninstall()


@pytest.fixture
def clean_runtime():
    """No layer during the test; the previous state is restored afterwards."""
    was_installed = cpu_runtime.is_installed()
    cpu_runtime.uninstall()
    yield cpu_runtime
    cpu_runtime.uninstall()
    if was_installed:
        cpu_runtime.install(force=True)


# ----------------------------------------------------------------------------- single process
def test_device_mapping(runtime):
    cpu = torch.device("cpu")
    assert torch.empty(3, device="cuda").device == cpu
    assert torch.tensor([1, 2], device="cuda:0").device == cpu
    assert torch.zeros(2, device=torch.device("cuda", 0)).device == cpu
    assert torch.ones(2, device=torch.cuda.current_device()).device == cpu
    assert torch.ones(2, pin_memory=True).device == cpu
    t = torch.arange(4.0)
    assert t.cuda() is t, ".cuda() of a tensor already 'on the device' returns it"
    assert t.to("cuda") is t and t.to(torch.device("cuda:0")) is t and t.to(0) is t
    assert t.to("cuda", torch.bfloat16).dtype == torch.bfloat16, "dtype in .to() still applies"
    assert t.new_empty(5, device="cuda").device == cpu
    assert t.pin_memory() is t


def test_tensor_type_strings(runtime):
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    assert torch.zeros(1, dtype=torch.long).type() == "torch.cuda.LongTensor"
    assert torch.nn.Parameter(torch.zeros(2)).type() == "torch.cuda.FloatTensor"
    converted = torch.zeros(2).type("torch.cuda.HalfTensor")
    assert converted.dtype == torch.float16 and converted.device.type == "cpu"


def test_tensor_type_unpatched_after_uninstall(clean_runtime):
    assert torch.zeros(1).type() == "torch.FloatTensor"
    cpu_runtime.install(force=True)
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"


def test_cuda_stubs(runtime):
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    torch.cuda.set_device(0)
    assert torch.cuda.current_device() == 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert torch.cuda.current_stream() is stream
    assert torch.cuda.current_stream() is not stream
    ctx = torch.cuda.stream(stream)  # one context entered twice, as start_grad_sync does
    for _ in range(2):
        with ctx:
            assert torch.cuda.current_stream() is stream
    assert torch.cuda.current_stream() is not stream
    end.record()
    torch.cuda.synchronize()
    assert end.elapsed_time(start) <= 0.0 <= start.elapsed_time(end)
    assert not torch.cuda.is_current_stream_capturing()
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0 and stats["allocated_bytes.all.peak"] == 0
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.device_memory_used() == 0
    assert not torch.accelerator.is_available()


def test_compile_and_helpers_off(runtime):
    def f(x):
        return x * 2

    assert torch.compile(f) is f
    assert torch.compile(mode="max-autotune")(f) is f
    import megatron.core.datasets.utils as ds_utils

    assert ds_utils.compile_helpers() is None  # a no-op: upstream would run `make`


def test_moe_split_sizes_reach_the_host_as_from_cuda(runtime):
    """The alltoall token dispatcher's split sizes: a host numpy copy, as megatron's CUDA
    branch of maybe_move_tensor_to_cpu gives (all_to_all_single rejects a torch tensor);
    the dispatcher's own name for it is rebound too."""
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    splits = torch.tensor([133, 143])
    host = moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True, record_stream=True)
    assert isinstance(host, np.ndarray) and host.tolist() == [133, 143]
    splits[0] = 0
    assert host.tolist() == [133, 143]  # a copy, as a device-to-host transfer is
    kept = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]))
    assert torch.is_tensor(kept) and kept.tolist() == [1, 2]
    assert moe_utils.maybe_move_tensor_to_cpu(host) is host and moe_utils.maybe_move_tensor_to_cpu(None) is None
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu


def _dropout_mask(n: int = 64) -> torch.Tensor:
    return torch.nn.functional.dropout(torch.ones(n), p=0.5)


def test_cuda_rng_state_roundtrip(runtime):
    torch.cuda.manual_seed(1234)
    saved = torch.cuda.get_rng_state()
    first = _dropout_mask()
    torch.cuda.set_rng_state(saved)
    again = _dropout_mask()
    assert torch.equal(first, again), "restored CUDA RNG state must replay dropout exactly"
    assert not torch.equal(first, _dropout_mask()), "the generator must advance"
    # megatron's own helpers (upstream defers the set through torch.cuda._lazy_call: never runs)
    from megatron.core.tensor_parallel import random as mrandom

    assert torch.equal(mrandom._get_cuda_rng_state(), torch.get_rng_state())
    mrandom._set_cuda_rng_state(saved)
    assert torch.equal(first, _dropout_mask()), "megatron's _set_cuda_rng_state must apply at once"


def test_megatron_tracker_fork_roundtrip(runtime):
    """CudaRNGStatesTracker: fork switches dropout to the tracker state, restores the default,
    and saved tracker states replay exactly (what checkpoint save/load relies on)."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(2718)
    expected_in_fork = _dropout_mask()  # what a generator seeded 2718 draws first
    torch.manual_seed(99)
    default_before = torch.get_rng_state()
    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 2718)
    assert torch.equal(default_before, torch.get_rng_state()), "add() must restore the default state"
    saved_states = {k: v.clone() for k, v in tracker.get_states().items()}
    with tracker.fork("model-parallel-rng"):
        in_fork = _dropout_mask()
    assert torch.equal(in_fork, expected_in_fork), "fork must draw from the tracker's state"
    assert torch.equal(default_before, torch.get_rng_state()), "fork must restore the default state"
    with tracker.fork("model-parallel-rng"):
        in_fork_next = _dropout_mask()
    assert not torch.equal(in_fork, in_fork_next), "the tracker state must advance inside fork"
    tracker.set_states(saved_states)
    with tracker.fork("model-parallel-rng"):
        replay = _dropout_mask()
    assert torch.equal(in_fork, replay), "restored tracker states must replay exactly"


def test_dataloader_iter_keeps_cpu_rng(runtime):
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    before = torch.get_rng_state()
    batches = list(iter(loader))
    assert len(batches) == 4
    assert torch.equal(before, torch.get_rng_state())


def test_dataloader_iter_consumes_rng_without_layer(clean_runtime):
    """The control of the test above: plain torch does draw, so that test can fail."""
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    before = torch.get_rng_state()
    iter(loader)
    assert not torch.equal(before, torch.get_rng_state())


def test_refuses_on_real_gpu_before_patching(clean_runtime, monkeypatch):
    monkeypatch.setattr(installer, "real_gpu_present", lambda: True)
    real_is_available, real_type = torch.cuda.is_available, torch.Tensor.type
    with pytest.raises(RuntimeError, match="real CUDA GPU is present"):
        cpu_runtime.install()
    assert not cpu_runtime.is_installed()
    assert torch.cuda.is_available is real_is_available and torch.Tensor.type is real_type
    monkeypatch.setenv(cpu_runtime.ENV_VAR, "1")
    with pytest.raises(RuntimeError, match="refuses to install"):
        cpu_runtime.install_if_requested()
    assert not cpu_runtime.is_installed()
    cpu_runtime.install(force=True)
    assert cpu_runtime.is_installed() and torch.cuda.is_available is not real_is_available


def test_install_if_requested_env(clean_runtime, monkeypatch):
    monkeypatch.setattr(installer, "real_gpu_present", lambda: True)
    monkeypatch.delenv(cpu_runtime.ENV_VAR, raising=False)
    assert cpu_runtime.install_if_requested() is False and not cpu_runtime.is_installed()
    monkeypatch.setenv(cpu_runtime.ENV_VAR, "force")
    assert cpu_runtime.install_if_requested() is True and cpu_runtime.is_installed()
    cpu_runtime.install(force=True)  # idempotent
    assert cpu_runtime.installed_items().count("cuda->cpu TorchFunctionMode") == 1


# ----------------------------------------------------------------------------- gloo ranks
def _run_gloo_workers(world: int, out_dir: Path, timeout_s: int = 240) -> List[Dict]:
    """Start ``world`` gloo ranks of the worker script; return each rank's facts."""
    argv, env = torchrun_command(WORKER, [str(out_dir)], world, tree="series-0.17.1", extra_env={"PYTHONWARNINGS": "ignore"})
    try:
        run_command(argv, env, run_dir=out_dir / "logs", timeout_s=timeout_s, what=f"gloo worker x{world}")
    except LaunchError as exc:
        raise AssertionError(str(exc)) from None
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


# World 4 (about 30 s of gloo ranks) in the extended tier (scripts/test.sh --all).
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.extended)], ids=lambda w: f"world{w}")
def gloo_facts(request, tmp_path_factory) -> List[Dict]:
    return _run_gloo_workers(request.param, tmp_path_factory.mktemp(f"gloo{request.param}"))


def _only_record(case: Dict) -> Dict:
    assert len(case["records"]) == 1, case["records"]
    return case["records"][0]


@pytest.mark.gloo
def test_list_gather_equals_reference(gloo_facts):
    for facts in gloo_facts:
        assert 0 in facts["sizes"], "the case must include an empty slot"
        cases = {k: v for k, v in facts.items() if k.startswith("list_")}
        assert len(cases) == 8
        for key, case in cases.items():
            assert case["equal"] and case["work_is_none"], f"rank {facts['rank']} {key}: {case}"


@pytest.mark.gloo
def test_equal_list_gather_allocates_the_nccl_flat_temporary(gloo_facts):
    """ProcessGroupNCCL::allgather with equal shapes: world x numel bytes, through torch."""
    for facts in gloo_facts:
        world = facts["world"]
        for dtype, itemsize in (("torch.bfloat16", 2), ("torch.float32", 4)):
            for own in ("alias", "sep"):
                case = facts[f"list_equal_{dtype}_{own}"]
                rec = _only_record(case)
                expected = world * EQUAL_NUMEL * itemsize
                assert rec["form"] == cpu_runtime.FORM_LIST_EQUAL and rec["ops"] == 1, rec
                assert rec["nccl_temporary_bytes"] == expected, rec
                assert case["alloc_bytes"] == expected, f"the allocation counter must see it: {case}"
                assert rec["wire_bytes"] == (world - 1) * EQUAL_NUMEL * itemsize, rec


@pytest.mark.gloo
def test_unequal_list_gather_is_one_broadcast_per_rank(gloo_facts):
    for facts in gloo_facts:
        world, rank, sizes = facts["world"], facts["rank"], facts["sizes"]
        case = facts["list_unequal_torch.bfloat16_sep"]
        rec = _only_record(case)
        assert rec["form"] == cpu_runtime.FORM_LIST_UNEQUAL and rec["ops"] == world, rec
        assert rec["nccl_temporary_bytes"] == 0 and case["alloc_bytes"] == 0, case
        assert rec["slot_numels"] == sizes
        assert rec["wire_bytes"] == 2 * (sum(sizes) - sizes[rank]), rec
        # Allocator level (every C++ allocation of this thread): nothing either.
        assert facts["profiler_unequal_sync"] == 0 and facts["profiler_unequal_async"] == 0, facts
        # The same instrument sees the flat temporary of the equal-size form (1000 fp32 per rank).
        assert facts["profiler_equal_sync"] >= world * 1000 * 4, facts


@pytest.mark.gloo
def test_all_gather_into_tensor_allocates_nothing(gloo_facts):
    for facts in gloo_facts:
        world = facts["world"]
        for key in ("into_tensor_sep", "into_tensor_inplace"):
            case = facts[key]
            rec = _only_record(case)
            assert case["equal"], f"rank {facts['rank']} {key}"
            assert rec["form"] == cpu_runtime.FORM_INTO_TENSOR and rec["ops"] == 1, rec
            assert rec["nccl_temporary_bytes"] == 0 and case["alloc_bytes"] == 0, case
            assert rec["wire_bytes"] == (world - 1) * EQUAL_NUMEL * 2, rec


@pytest.mark.gloo
def test_async_work_handles(gloo_facts):
    for facts in gloo_facts:
        for key in ("async_unequal", "async_equal", "async_into_tensor"):
            assert facts[key] == {"wait_returned": [True, True], "completed": True, "equal_a": True,
                                  "equal_b": True}, f"rank {facts['rank']} {key}: {facts[key]}"
        temp = facts["async_equal_temporary"]
        assert temp["live_before_wait"] == facts["world"] * EQUAL_NUMEL * 4, temp
        assert temp["live_after_wait"] == 0, temp


@pytest.mark.gloo
def test_deferred_completion_moves_data_only_in_wait(gloo_facts):
    """defer_async_completion(): every async form (list unequal/equal, into tensor, a
    coalesced broadcast group) leaves its output untouched until its own work's wait(),
    whatever else was waited on first."""
    for facts in gloo_facts:
        for key in ("unequal", "equal", "into_tensor", "broadcast_group"):
            case = facts[f"deferred_{key}"]
            assert case == {"before_wait": [False, False, False], "after_b": [False, True],
                            "after_both": [True, True]}, f"rank {facts['rank']} {key}: {case}"


@pytest.mark.gloo
def test_coalescing_manager(gloo_facts):
    for facts in gloo_facts:
        case = facts["coalesced"]
        assert case["equal"], facts["rank"]
        assert [(r["form"], r["coalesced"], r["nccl_temporary_bytes"]) for r in case["records"]] == [
            (cpu_runtime.FORM_INTO_TENSOR, True, 0)] * 2, case


@pytest.mark.gloo
def test_coalesced_broadcasts_from_owners_are_one_launch(gloo_facts):
    """Broadcasts grouped by _coalescing_manager(group, device): one NCCL launch, one op per
    broadcast, nothing of the zero-size slot; sync and async; every slot right."""
    for facts in gloo_facts:
        rank, world, sizes = facts["rank"], facts["world"], facts["sizes"]
        owners = [r for r, n in enumerate(sizes) if n]
        for key in ("broadcast_group_sync", "broadcast_group_async"):
            case = facts[key]
            assert case["equal"], f"rank {rank} {key}"
            assert [(r["form"], r["src"], r["coalesced"]) for r in case["records"]] == [
                (cpu_runtime.FORM_BROADCAST, o, True) for o in owners], case
            assert case["summary"] == {
                "calls": len(owners), "ops": len(owners), "zero_size_ops": 0, "launches": 1,
                "nccl_temporary_bytes": 0,
                "wire_bytes": 4 * sum(n for r, n in enumerate(sizes) if r != rank)}, case
        alone = facts["broadcast_alone"]
        assert alone["equal"], rank
        assert alone["summary"] == {"calls": 2, "ops": 2, "zero_size_ops": 1, "launches": 2,
                                    "nccl_temporary_bytes": 0, "wire_bytes": 0 if rank == 0 else 16}, alone


@pytest.mark.gloo
def test_model_execution_no_rss_growth(gloo_facts):
    """Process-wide (gloo threads included): all_gather_into_tensor grows nothing of slot
    size, while gloo's own allgather shows its ``world * slot`` flat buffer."""
    for facts in gloo_facts:
        rss = facts["rss"]
        if rss["into_tensor"] is None:
            pytest.skip("/proc/self/clear_refs not available")
        rank, slot, world = facts["rank"], rss["slot_bytes"], facts["world"]
        assert rss["into_tensor"] < 64 * 1024 and rss["into_tensor_async"] < 64 * 1024, f"{rank=} {rss=}"
        assert rss["control_gloo_allgather"] >= 0.9 * world * slot, f"{rank=} control {rss=}"


@pytest.mark.gloo
def test_errors_name_the_rank(gloo_facts):
    for facts in gloo_facts:
        assert f"rank={facts['rank']}" in facts["bad_count_error"]
        assert f"rank={facts['rank']}" in facts["bad_size_error"]


# ----------------------------------------------------------------------------- the model alone
@pytest.mark.parametrize("world", [2, 4, 8])
def test_model_counts_world_times_numel_for_equal_list_and_nothing_for_into_tensor(world):
    """The model's numbers per form, from shapes: a model that counted 0 everywhere fails."""
    n = 1000
    equal = cpu_runtime.model_call(cpu_runtime.FORM_LIST_EQUAL, [n] * world, 0, torch.bfloat16)
    into = cpu_runtime.model_call(cpu_runtime.FORM_INTO_TENSOR, [n] * world, 0, torch.bfloat16)
    unequal = cpu_runtime.model_call(cpu_runtime.FORM_LIST_UNEQUAL, [n, 0] + [n + 1] * (world - 2), 1,
                                     torch.float32)
    assert equal.nccl_temporary_bytes == world * n * 2 and equal.ops == 1
    assert into.nccl_temporary_bytes == 0 and into.ops == 1
    assert equal.wire_bytes == into.wire_bytes == (world - 1) * n * 2
    assert unequal.nccl_temporary_bytes == 0 and unequal.ops == world
    assert unequal.wire_bytes == (n + (world - 2) * (n + 1)) * 4
    with pytest.raises(ValueError, match="rank=4 outside a group of 4"):
        cpu_runtime.model_call(cpu_runtime.FORM_INTO_TENSOR, [1] * 4, 4, torch.float32)


def test_summary_counts_zero_size_broadcasts_and_group_launches():
    """The unequal list all_gather is one launch of `world` broadcasts, zero-size ones
    included (ProcessGroupNCCL issues them); calls sharing a launch id are one launch."""
    unequal = cpu_runtime.model_call(cpu_runtime.FORM_LIST_UNEQUAL, [3, 0, 0, 5], 1, torch.bfloat16)
    b0 = cpu_runtime.model_call(cpu_runtime.FORM_BROADCAST, [3], 1, torch.bfloat16, world=4, src=0,
                                launch_id=7)
    b3 = cpu_runtime.model_call(cpu_runtime.FORM_BROADCAST, [5], 1, torch.bfloat16, world=4, src=3,
                                launch_id=7)
    assert (unequal.ops, unequal.zero_size_ops) == (4, 2)
    assert collectives.summarize([unequal]) == {"calls": 1, "ops": 4, "zero_size_ops": 2, "launches": 1,
                                                "nccl_temporary_bytes": 0, "wire_bytes": 16}
    assert collectives.summarize([b0, b3]) == {"calls": 2, "ops": 2, "zero_size_ops": 0, "launches": 1,
                                               "nccl_temporary_bytes": 0, "wire_bytes": 16}
    own = cpu_runtime.model_call(cpu_runtime.FORM_BROADCAST, [5], 3, torch.bfloat16, world=4, src=3)
    assert own.wire_bytes == 0 and own.launch_id not in (7, unequal.launch_id)
    with pytest.raises(ValueError, match="src=4"):
        cpu_runtime.model_call(cpu_runtime.FORM_BROADCAST, [1], 0, torch.bfloat16, world=4, src=4)
