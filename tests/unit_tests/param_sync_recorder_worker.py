"""Multi-rank worker for test_param_sync_recorder.py: the recorder around real bucket syncs.

Run under torchrun on gloo ranks with the tree under test first on PYTHONPATH
(``harness.launch.torchrun_command``); no expert parallelism, so the expert params
(``allreduce=False``) form DDP's expert-parallel bucket groups on an expert-DP group of the
whole world (``torchrun_command(WORKER, ["--out", DIR], 2, tree="pristine-0.17.1")``).

``harness.param_sync_recorder.ParamSyncRecorder`` wraps megatron's classes in this process
as in a training rank; then, with ``recorder.training_step(N)`` standing in for
``train_step``:

1. step 1: every bucket group (dense and expert) of a model with about one param per bucket
   (uneven shares, empty slots) syncs as a forward pre-hook pair: ``start_param_sync``,
   ``finish_param_sync(skip_next_bucket_dispatch=True)``;
2. step 2: the same, chained as the pre-hooks chain them: ``finish_param_sync()`` of each
   dense group in chain order dispatches the next group's gather inside itself;
3. between steps 2 and 3: a forced sync of every group, as at eval;
4. step 3: the optimizer path, ``allgather_params()`` of a model without overlap;
5. step 4: a single bucket with equal shares (ProcessGroupNCCL's flat temporary);
6. step 5: no param sync, three known allocations (peak = the two largest alive at once).

Every rank writes ``DIR/rank<R>.json`` (the recorder's file) and ``DIR/expected<R>.json``:
per step and kind, megatron's temporaries of the pristine tree from the bucket layout
(``harness.bench.theory.theory_upstream_bytes``), what ProcessGroupNCCL allocates for the
pristine tree's list all-gathers (world x share x itemsize where the shares are equal),
the entry-point calls, and the step-5 peak.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import cpu_runtime

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.bench.theory import theory_upstream_bytes  # noqa: E402
from harness.param_sync_recorder import ParamSyncRecorder  # noqa: E402
from harness.ranks import exit_rank  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layerwise_worker as lw  # noqa: E402

#: Step 5's allocations (float32 elements): a and b alive together, then c after a is freed.
PEAK_ELEMS = (4096, 1024, 2048)


def _theory(bucket_groups, group) -> int:
    rank = dist.get_rank(group)
    return sum(
        theory_upstream_bytes(b.layerwise_params_list, rank, b.params_list[0].dtype.itemsize)
        for g in bucket_groups for b in g.buckets if b.layerwise_params_list is not None
    )  # fmt: skip


def _list_gather_nccl(share_lists, itemsize: int) -> int:
    """ProcessGroupNCCL's temporaries for upstream's list all_gather of each share list
    (elements per rank): a flat world x share output when the shares are equal, none for
    unequal ones (coalesced broadcasts) or when nobody owns anything (no call)."""
    return sum(
        len(sizes) * sizes[0] * itemsize
        for sizes in share_lists if max(sizes) > 0 and len(set(sizes)) == 1
    )  # fmt: skip


def _bucket_shares(bucket_groups):
    return [b.layerwise_param_flat_sizes for g in bucket_groups for b in g.buckets
            if b.layerwise_param_flat_sizes is not None]  # fmt: skip


def _reset(bucket_groups) -> None:
    for g in bucket_groups:
        g.param_gather_dispatched = False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for rank<R>.json, expected<R>.json")
    args = ap.parse_args(argv)
    dist.init_process_group(backend="gloo")
    tree = check_expected_tree()
    lw.parallel_state.initialize_model_parallel()
    recorder = ParamSyncRecorder()
    recorder.install()
    dp_group = lw.parallel_state.get_data_parallel_group()
    expt_group = lw.parallel_state.get_expert_data_parallel_group()
    expected = {"steps": {}, "between_steps": {}}

    s = lw.Setup(lw.parse_config("bf16-fp32grad-many"), overlap=True, expert=True)
    dense, expert = s.ddp.bucket_groups, s.ddp.expert_parallel_bucket_groups
    per_kind = {"dense": _theory(dense, dp_group), "expert": _theory(expert, expt_group)}
    nccl_kind = {"dense": _list_gather_nccl(_bucket_shares(dense), 2),
                 "expert": _list_gather_nccl(_bucket_shares(expert), 2)}  # fmt: skip
    s.simulate_step(step=8)
    with recorder.training_step(1):
        for g in dense + expert:
            g.start_param_sync()
            g.finish_param_sync(skip_next_bucket_dispatch=True)
    expected["steps"]["1"] = {"megatron_bytes": per_kind, "upstream_nccl_bytes": nccl_kind,
                              "entry_calls": {"dense": 2 * len(dense), "expert": 2 * len(expert)}}  # fmt: skip
    expected["params_synced_step_1"] = s.params_equal_targets(8)

    _reset(dense + expert)
    s.simulate_step(step=9)
    with recorder.training_step(2):
        # next_param_gather_bucket_group runs from the last group to the first.
        for g in reversed(dense):
            g.finish_param_sync()
    expected["steps"]["2"] = {"megatron_bytes": {"dense": per_kind["dense"]},
                              "upstream_nccl_bytes": {"dense": nccl_kind["dense"]},
                              "entry_calls": {"dense": len(dense)}}  # fmt: skip
    expected["params_synced_step_2"] = all(
        torch.equal(p.detach(), s.target(p, 9)) for g in dense for p in g.params
    )

    _reset(dense + expert)
    s.simulate_step(step=10)
    for g in dense + expert:
        g.start_param_sync(force_sync=True)
    expected["between_steps"]["2"] = {"megatron_bytes": per_kind, "upstream_nccl_bytes": nccl_kind,
                                      "entry_calls": {"dense": len(dense), "expert": len(expert)}}  # fmt: skip

    o = lw.Setup(lw.parse_config("bf16-fp32grad-many"), overlap=False, expert=True)
    o.simulate_step(step=11)
    owners = {"dense": (o.opt.dp_cp_params_list, dp_group), "expert": (o.opt.expt_dp_params_list, expt_group)}
    with recorder.training_step(3):
        o.opt.allgather_params()
    optimizer_bytes = sum(
        theory_upstream_bytes(lists, dist.get_rank(group), 2) for lists, group in owners.values() if lists
    )
    optimizer_shares = [[sum(p.numel() for p in ps) for ps in lists] for lists, _ in owners.values() if lists]
    expected["steps"]["3"] = {"megatron_bytes": {"optimizer": optimizer_bytes},
                              "upstream_nccl_bytes": {"optimizer": _list_gather_nccl(optimizer_shares, 2)},
                              "entry_calls": {"optimizer": 1}}  # fmt: skip

    e = lw.Setup(lw.parse_config("bf16-fp32grad-equal"), overlap=True)
    (bucket,) = [b for g in e.ddp.bucket_groups for b in g.buckets]
    shares = bucket.layerwise_param_flat_sizes
    assert len(set(shares)) == 1, f"equal shares expected, got {shares}"
    e.simulate_step(step=12)
    with recorder.training_step(4):
        for g in e.ddp.bucket_groups:
            g.start_param_sync()
            g.finish_param_sync(skip_next_bucket_dispatch=True)
    expected["steps"]["4"] = {
        "megatron_bytes": {"dense": _theory(e.ddp.bucket_groups, dp_group)},
        "upstream_nccl_bytes": {"dense": dist.get_world_size() * shares[0] * 2},
        "entry_calls": {"dense": 2},
    }

    with recorder.training_step(5):
        a = torch.empty(PEAK_ELEMS[0])
        b = torch.empty(PEAK_ELEMS[1])
        del a
        c = torch.empty(PEAK_ELEMS[2])
        del b, c
    expected["steps"]["5"] = {"step_peak_bytes": 4 * (PEAK_ELEMS[0] + PEAK_ELEMS[1]),
                              "step_alloc_bytes": 4 * sum(PEAK_ELEMS)}  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    recorder.write(args.out, tree)
    (args.out / f"expected{dist.get_rank()}.json").write_text(json.dumps(expected, indent=1))
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    sys.exit(main())
