"""A rank that reports what its launcher gave it: tests/unit_tests/test_fork_ranks.py.

``fork_ranks_worker.py OUT_DIR [MODE]`` writes ``OUT_DIR/rank<R>.json``: the torchrun
variables of ``harness.fork_ranks.rank_env`` (except the store's address and the run id,
which differ per run), ``sys.argv``, ``sys.path[0]``, ``__name__``, and the sum of every
rank's number over a gloo ``all_reduce`` after ``init_process_group`` from the environment
(what megatron's ``initialize_megatron`` does). MODE ``fail``: rank 1 exits 3 after the
all-reduce while the others sleep 600 s (the launcher must end them).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

#: Compared between launchers; MASTER_ADDR/MASTER_PORT/TORCHELASTIC_RUN_ID differ per run.
COMPARED = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
            "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")

if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "env": {k: os.environ.get(k) for k in COMPARED}, "argv": sys.argv, "path0": sys.path[0],
        "name": __name__, "all_reduce": total.item(),
    }))
    if mode == "fail":
        if rank == 1:
            os._exit(3)
        time.sleep(600)
    dist.destroy_process_group()
