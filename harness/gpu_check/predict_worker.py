"""What the real-shape audit predicts for the GPU check's real-shape memory run, on one tree.

Run by ``harness.gpu_check.real_shapes.predict`` with the tree first on PYTHONPATH and the
CPU runtime layer forced on, as ``scripts/audit_param_sync.py`` runs its workers::

    MEGATRON_CPU_RUNTIME=force python harness/gpu_check/predict_worker.py \
        --tree pristine-0.17.1 --layers 11 --dp 2 --out up.json

It runs the audit's own cell (``harness/audit/worker.run_cell``: the tree's DDP,
layer-wise Muon optimizer and param sync on meta tensors over a fake process group of DP
ranks) on the model ``harness.gpu_check.real_shapes.model_spec(layers)`` for every DP rank,
paths ``async`` (DDP's forward pre-hooks: what the memory worker's "param sync alone" runs)
and ``optimizer`` (``allgather_params()``), and writes one record per DP rank: per path the
peak bytes of megatron's temporaries and of NCCL's (``megatron_peak_bytes``,
``nccl_peak_bytes``), the allocations behind them, and the buckets with each rank's share.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file: the repo root goes LAST, so that the tree chosen by PYTHONPATH keeps its rank.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from harness.audit import grid as audit_shapes  # noqa: E402
from harness.audit import worker as audit  # noqa: E402
from harness.gpu_check import real_shapes  # noqa: E402

#: The audit's paths the memory worker measures (its "sync" and "sync_optimizer" windows).
PATHS = ("async", "optimizer")
KEEP = ("megatron_peak_bytes", "nccl_peak_bytes", "megatron_alloc_calls", "calls", "ops", "launches", "forms",
        "wire_bytes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", required=True, choices=sorted(audit_shapes.TREES))
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--worker-config", help="JSON of a memory-worker config to audit instead (tests)")
    args = ap.parse_args(argv)
    tree_dir = audit.check_expected_tree()
    audit.torch.set_num_threads(1)
    audit.model.fake_all_gather_object()
    audit._member_groups_only()
    mc = audit._mc()
    spec = real_shapes.model_spec(args.layers, json.loads(args.worker_config) if args.worker_config else None)
    ranks = []
    for rank in range(args.dp):
        rec = audit.run_cell(mc, audit_shapes.TREES[args.tree], spec, args.dp, rank, PATHS)
        if "error" in rec:
            raise RuntimeError(f"audit cell failed on DP rank {rank}: {rec['error']}")
        paths = {}
        for path in PATHS:
            r = rec["paths"][path]
            if "error" in r:
                raise RuntimeError(f"audit path {path} failed on DP rank {rank}: {r['error']}")
            paths[path] = {k: r[k] for k in KEEP}
        ranks.append({"dp_rank": rank, "param_numel": rec["param_numel"], "param_bytes": rec["param_bytes"],
                      "buckets": [{"numel": b["param_numel"], "shares": b["shares"]} for b in rec["buckets"]],
                      "paths": paths})
    args.out.write_text(json.dumps({"tree": args.tree, "tree_dir": tree_dir, "layers": args.layers,
                                    "dp": args.dp, "ranks": ranks}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
