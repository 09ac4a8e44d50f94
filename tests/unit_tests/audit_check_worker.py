"""Rank worker of test_audit.py: buckets and shards of ALLOCATED megatron objects.

Run under torchrun on gloo ranks with the tree under test first on PYTHONPATH and the
CPU runtime layer on (harness.launch.torchrun_command):

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        tests/unit_tests/audit_check_worker.py --model check_moe_ep2 --out R.json

It builds the model of ``harness.audit.grid.ALL_MODELS[--model]`` on CPU with real
storage, through ``harness.audit.worker.build_module`` (megatron's GPTModel and
local spec) but outside its meta-device mode, on a real process group of WORLD_SIZE ranks
(``parallel_state.initialize_model_parallel`` with the model's TP, PP, EP), wraps it in
megatron's DistributedDataParallel (fp32 grad_data, overlapped grad reduce and param
gather, the model's bucket size) and gives it the layer-wise Muon optimizer
(``harness.model.wrap``: the DDP config and optimizer of the audit's ``LegacySetup``), as
megatron.training does for ``--optimizer dist_muon``. Rank 0 writes, per bucket (dense
bucket groups first, then expert-parallel ones), its numel, param names, and per DP (or
expert-DP) rank the names and elements of the params that rank owns in it, read from the
bucket's own ``layerwise_params_list`` (set by the optimizer's
``set_bucket_layerwise_params_list``). Every rank computes the same lists; rank 0 checks
that they agree and exits 1 if not.
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

from harness.audit import grid  # noqa: E402
from harness import model  # noqa: E402
from harness.audit.worker import _mc, build_module  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402


def bucket_view(ddp) -> list:
    """Per bucket: numel, sorted param names, per-rank owned names and elements."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    out = []
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for b in group.buckets:
            lists = getattr(b, "layerwise_params_list", None)
            out.append(dict(
                numel=b.grad_data.numel(),
                param_names=sorted(names[p] for p in b.params),
                share_names=None if lists is None else [sorted(names[p] for p in own) for own in lists],
                shares=None if lists is None else [sum(p.numel() for p in own) for own in lists],
            ))  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(grid.ALL_MODELS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    check_expected_tree()
    spec = grid.ALL_MODELS[args.model]
    dist.init_process_group("gloo")
    mc = _mc()
    mc.ps.initialize_model_parallel(spec.tp, spec.pp, expert_model_parallel_size=spec.ep,
                                    create_gloo_process_groups=False)  # fmt: skip
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    config, module, _ = build_module(mc, spec)
    ddp, _ = model.wrap(config, module, True, spec.bucket_size)  # the audit's DDP and optimizer
    mine = dict(buckets=bucket_view(ddp), dp=mc.ps.get_data_parallel_world_size(),
                expert_dp=mc.ps.get_expert_data_parallel_world_size(),
                storage_bytes=sum(p.untyped_storage().nbytes() for p in ddp.module.parameters()))  # fmt: skip
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rc = 0
    if dist.get_rank() == 0:
        agree = all(e["buckets"] == mine["buckets"] for e in everyone)
        Path(args.out).write_text(json.dumps(dict(mine, ranks_agree=agree), indent=1))
        rc = 0 if agree else 1
    dist.barrier()
    mc.ps.destroy_model_parallel()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
