"""Two gloo ranks for tests/unit_tests/test_cpu_runtime_p2p.py (not collected by pytest).

Run under torchrun (``harness.launch.torchrun_command``, 2 ranks) as
``cpu_runtime_p2p_worker.py OUT_DIR ROUNDS``. It replays what megatron's interleaved
schedule does with a pipeline send in steady state (``core/pipeline_parallel/schedules.py:
forward_backward_pipelining_with_interleaving``, p2p overlap): megatron's own
``P2PCommunicator.send_forward_recv_forward(..., overlap_p2p_comm=True)`` posts the send,
megatron's own ``deallocate_output_tensor`` pseudo-frees the output, the next microbatch
allocates activations of the same size, and only then does the next stage post its receive
and the sender wait. Rank 1 compares what it received with what rank 0 sent, bit for bit.

Two phases of ROUNDS rounds each: ``layer``, harness.cpu_runtime installed as training
installs it; then ``without_p2p``, the same with ``ProcessGroup.send`` put back to torch's
own, i.e. the layer without ``harness.cpu_runtime.p2p`` (the control: the hazard this
scenario must show on gloo).

Writes ``OUT_DIR/rank<R>.json``: per phase and round whether the received tensor equals the
sent one (rank 1), and the sends still held after the waits (rank 0).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

import harness.cpu_runtime as cpu_runtime
from harness.cpu_runtime import p2p
from harness.ranks import exit_rank

# One activation of the tiny GPT the functional cases train: [seq, micro-batch, hidden], bf16.
SHAPE = (64, 2, 64)


def payload(round_: int) -> torch.Tensor:
    """Distinct, exactly representable bf16 values per round (no NaN)."""
    n = SHAPE[0] * SHAPE[1] * SHAPE[2]
    return ((torch.arange(n, dtype=torch.float32) % 251) + 1000 * (round_ + 1)).to(torch.bfloat16).view(SHAPE).clone()


def main(out_dir: str, rounds: int) -> None:
    pg_class = torch._C._distributed_c10d.ProcessGroup
    torch_send = pg_class.__dict__["send"]
    cpu_runtime.install(force=True)  # the layer is under test, also on a GPU machine
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = dist.new_group(backend="gloo")  # orders the two ranks without touching the p2p pairs
    # What megatron.training builds for an interleaved run (training/arguments.py:
    # core_transformer_config_from_args): p2p overlap on, so no batched p2p.
    config = ModelParallelConfig(
        pipeline_dtype=torch.bfloat16, overlap_p2p_comm=True, batch_p2p_comm=False,
        deallocate_pipeline_outputs=True,
    )
    comm = P2PCommunicator(pp_group=dist.group.WORLD, config=config)
    facts = {"rank": rank}
    for phase in ("layer", "without_p2p"):
        if phase == "without_p2p":
            setattr(pg_class, "send", torch_send)
        equal, held = [], []
        for r in range(rounds):
            if rank == 0:
                out = payload(r)
                _, handles = comm.send_forward_recv_forward(out, recv_prev=False, tensor_shape=SHAPE,
                                                            overlap_p2p_comm=True)
                deallocate_output_tensor(out, config.deallocate_pipeline_outputs)
                nxt = [torch.full(SHAPE, float("nan"), dtype=torch.bfloat16) for _ in range(4)]
                dist.barrier(group=side)  # the next stage posts its receive only now
                handles.pop("send_next").wait()
                del nxt, handles
                gc.collect()
                held.append(p2p.in_flight_sends())
            else:
                dist.barrier(group=side)
                received, handles = comm.send_forward_recv_forward(None, recv_prev=True, tensor_shape=SHAPE,
                                                                   overlap_p2p_comm=True)
                handles.pop("recv_prev").wait()
                equal.append(bool(torch.equal(received, payload(r))))
        facts[phase] = {"equal": equal, "held_after_wait": held}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
