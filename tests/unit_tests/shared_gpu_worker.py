"""Two-rank worker for test_gpu_check.py: harness.gpu_check.shared_gpu's collectives on gloo.

Run under torchrun with 2 CPU ranks (no CPU runtime layer needed: plain torch)::

    torchrun --nproc-per-node 2 tests/unit_tests/shared_gpu_worker.py --out R.json

Checks, on every rank, and rank 0 writes {check: bool} to --out:
  coalesced_sum: three async all_reduce calls inside a gloo ``_coalescing_manager`` block,
      then ``cm.wait()``: the block is shared_gpu's, and each tensor holds the sum over ranks
      (what DDP's grad sync does).
  sync_block: the same block with ``async_ops=False`` has reduced on exit.
  uneven_gather: a list all_gather with slots of 3 and 5 elements (gloo alone rejects it)
      fills every slot with its owner's values, async, and is recorded as the unequal form.
  gather_in_block: an all_gather_into_tensor and an all_reduce in one gloo coalescing block
      are both done after ``cm.wait()``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]

from harness.cpu_runtime import collectives  # noqa: E402
from harness.gpu_check import shared_gpu  # noqa: E402

shared_gpu.install_collectives()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = {}

    tensors = [torch.full((n,), float(rank + 1) * (i + 1)) for i, n in enumerate((4, 1, 7))]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t, async_op=True)
    cm.wait()
    total = sum(r + 1 for r in range(world))
    checks["coalesced_sum"] = isinstance(cm, shared_gpu.CollectedWork) and all(
        bool((t == total * (i + 1)).all()) for i, t in enumerate(tensors))

    t = torch.full((3,), float(rank))
    with dist._coalescing_manager(async_ops=False):
        dist.all_reduce(t)
    checks["sync_block"] = bool((t == sum(range(world))).all())

    sizes = [3, 5]
    slots = [torch.zeros(n) for n in sizes]
    mine = torch.arange(sizes[rank], dtype=torch.float32) + 100 * rank
    with collectives.record_collectives() as records:
        dist.all_gather(slots, mine, async_op=True).wait()
    checks["uneven_gather"] = all(
        slots[r].tolist() == (torch.arange(sizes[r], dtype=torch.float32) + 100 * r).tolist() for r in range(world)
    ) and [r.form for r in records] == [collectives.FORM_LIST_UNEQUAL]

    # A gather inside a gloo coalescing block (the distributed optimizer's path) is done when
    # the block ends, next to the captured all-reduce.
    out = torch.zeros(2 * world)
    t = torch.ones(2)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), async_op=True)
        dist.all_reduce(t, async_op=True)
    cm.wait()
    checks["gather_in_block"] = out.tolist() == [float(r) for r in range(world) for _ in range(2)] and \
        t.tolist() == [float(world)] * 2

    flags = torch.tensor([int(v) for v in checks.values()])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        args.out.write_text(json.dumps(dict(zip(checks, map(bool, flags.tolist())))))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
