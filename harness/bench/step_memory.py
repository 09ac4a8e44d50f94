"""Peak memory per phase of one real training step, for the tree PYTHONPATH selects.

scripts/bench_param_sync.py starts it once per tree and DP size (``--step-memory``), with
the environment ``harness.launch.torchrun_command`` gives a tree (its parent first on
PYTHONPATH, the CPU runtime layer on; a bare torchrun of this file on a CPU-only machine
stops at "Found no NVIDIA driver"). The step-memory runs alone, upstream and the series at
DP 2 (35 s on 2 cores):

    .venv/bin/python scripts/bench_param_sync.py --real-dp "" --step-memory 2 \
        --out-dir build/bench-step-memory

A GPTModel in megatron DDP with the layer-wise Muon optimizer (bf16 params, fp32
grad_data) takes training steps on random tokens, with --overlap-param-gather on and off.
After warm-up steps (optimizer state exists), one step runs under torch.profiler with
profile_memory=True, its phases marked with record_function:

* forward: DDP forward and the loss; with overlap on, the forward pre-hooks run the
  layer-wise param all-gather here (the async path);
* backward: loss.backward() and DDP.finish_grad_sync() (grad all-reduce);
* optimizer step: LayerWiseDistributedOptimizer.step(), its gather included;
* optimizer gather: the allgather_params() inside it (overlap off only: the optimizer path).

For each phase the record gives the peak of bytes alive above the step's start (every
allocation made during the step on every thread of rank 0; the profiler does not report
frees of blocks allocated before it started; bytes), and the step peak and the phase it
sits in (the innermost phase when spans nest).
Memory does not depend on load, so the trees run one after the other.
"""

from __future__ import annotations

import argparse
import bisect
import faulthandler
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from harness import cpu_runtime  # noqa: E402

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.bench.counters import ProfiledAllocations  # noqa: E402
from harness.model import gpt_model, wrap  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402

PHASES = ("forward", "backward", "optimizer step", "optimizer gather")
PHASE_DESC = {
    "forward": "DDP forward + loss; with overlap, the pre-hooks' param all-gather",
    "backward": "loss.backward() + finish_grad_sync()",
    "optimizer step": "LayerWiseDistributedOptimizer.step(), its gather included",
    "optimizer gather": "allgather_params() at the end of step() (overlap off)",
}
#: Param-dominated: 2 layers, hidden 1024, FFN 4096, 8 heads, vocab 1024, seq 256,
#: micro-batch 1: 27.3 M params (52 MiB in bf16) against a few MiB of activations.
SHAPE = dict(num_layers=2, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096)
VOCAB, SEQ, MICRO_BATCH = 1024, 256, 1
MODEL_DESC = "GPT, 2 layers, hidden 1024, FFN 4096, 8 heads, vocab 1024, seq 256, micro-batch 1, untied output layer"
#: --small: the same layout at a quarter of the width (1.9 M params), for a quick check that
#: the run works (tests); the bench's figures use the shape above.
SMALL_SHAPE = dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024)
SMALL_SEQ = 64
SMALL_MODEL_DESC = "GPT, 2 layers, hidden 256, FFN 1024, 4 heads, vocab 1024, seq 64, micro-batch 1, untied output layer"
_PREFIX = "bench_phase:"


def _build(overlap: bool):
    """(ddp, opt): the GPT of SHAPE in DDP with its layer-wise optimizer (``harness.model.wrap``)."""
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**SHAPE, params_dtype=torch.bfloat16, bf16=True,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0)  # fmt: skip
    module = gpt_model(config, VOCAB, SEQ)
    # muon_fp32_matmul_prec "highest": megatron's default, "medium", runs the Newton-Schulz
    # matmuls in emulated bf16 on a CPU without bf16 units (measured: 33 s instead of 1 s
    # for one 1024 x 1024 orthogonalization); the param sync it measures does not depend on it.
    return wrap(config, module, overlap, lr=1e-3, muon_fp32_matmul_prec="highest")


class _Step:
    """One training step of (ddp, opt) with record_function phase marks."""

    def __init__(self, ddp, opt, overlap: bool):
        self.ddp, self.opt, self.overlap = ddp, opt, overlap
        g = torch.Generator().manual_seed(1234 + dist.get_rank())
        self.tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        self.labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        self.position_ids = torch.arange(SEQ).unsqueeze(0)
        self.mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
        gather = opt.allgather_params

        def labelled_gather():
            with torch.profiler.record_function(_PREFIX + "optimizer gather"):
                return gather()

        # A label only: the optimizer's own method runs unchanged inside it.
        opt.allgather_params = labelled_gather

    def __call__(self):
        rf = torch.profiler.record_function
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        with rf(_PREFIX + "forward"):
            loss = self.ddp(self.tokens, self.position_ids, self.mask, labels=self.labels).float().mean()
        with rf(_PREFIX + "backward"):
            loss.backward()
            self.ddp.finish_grad_sync()
        with rf(_PREFIX + "optimizer step"):
            self.opt.step()
        return float(loss)


def phase_peaks(prof: ProfiledAllocations, spans: dict) -> dict:
    """Peak bytes alive above the region's start within each phase's [start, end] (ns).

    Args:
        prof: a finished ProfiledAllocations (its timeline of (t_ns, delta bytes)).
        spans: {phase: (start_ns, end_ns)} on the profiler's clock; spans may nest
            (the optimizer gather runs inside the optimizer step).

    Returns:
        {phase: peak bytes}; the level alive when a phase starts is its floor.
    """
    times = [t for t, _ in prof.timeline]
    levels, live = [], 0
    for _, delta in prof.timeline:
        live += delta
        levels.append(live)
    peaks = {}
    for phase, (start, end) in spans.items():
        i = bisect.bisect_left(times, start)
        j = bisect.bisect_right(times, end)
        floor = levels[i - 1] if i > 0 else 0
        peaks[phase] = max([floor] + levels[i:j])
    return peaks


def _spans(prof: ProfiledAllocations) -> dict:
    """{phase: (start_ns, end_ns)} of the record_function marks in the profile."""
    out = {}
    stack = list(prof._prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.name.startswith(_PREFIX):
            out[node.name[len(_PREFIX):]] = (node.start_time_ns, node.end_time_ns)
    return out


def measure(overlap: bool, warmup: int) -> dict:
    """Warm-up steps, then one profiled step; the record for rank 0 (see module docstring)."""
    ddp, opt = _build(overlap)
    step = _Step(ddp, opt, overlap)
    for _ in range(warmup):
        step()
    dist.barrier()
    with ProfiledAllocations() as prof:
        loss = step()
    spans = _spans(prof)
    peaks = phase_peaks(prof, spans)
    phases = [p for p in PHASES if p in peaks]
    step_peak = max(peaks.values())
    return dict(
        overlap=overlap,
        phases=list(PHASES),
        phase_peak_bytes={p: peaks.get(p) for p in PHASES},
        step_peak_bytes=step_peak,
        # Ties go to the later (inner) phase: the gather nests in the step.
        peak_phase=max(reversed(phases), key=lambda p: peaks[p]),
        step_alloc_bytes=prof.alloc_bytes,
        param_bytes=sum(p.numel() * p.element_size() for p in ddp.module.parameters()),
        grad_data_bytes=sum(b.grad_data.numel() * b.grad_data.element_size()
                            for g in ddp.bucket_groups for b in g.buckets),  # fmt: skip
        loss=loss,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON list of records (rank 0 writes)")
    ap.add_argument("--tree", default="", help="label stored in each record")
    ap.add_argument("--device", choices=("cpu",), default="cpu",
                    help="cpu only: the phases' peaks come from the CPU allocator's events")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before the profiled one")
    ap.add_argument("--small", action="store_true",
                    help="SMALL_SHAPE and SMALL_SEQ instead of the bench's model (a quick check)")  # fmt: skip
    ap.add_argument("--watchdog-s", type=float, default=0,
                    help="after this many seconds, print every thread's stack to stderr and exit "
                    "(a hang becomes a failure that says where; 0: off)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.small:
        global SHAPE, SEQ, MODEL_DESC
        SHAPE, SEQ, MODEL_DESC = SMALL_SHAPE, SMALL_SEQ, SMALL_MODEL_DESC
    if args.watchdog_s > 0:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    tree_dir = check_expected_tree()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend="gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    records = []
    for overlap in (True, False):
        rec = measure(overlap, args.warmup)
        rec.update(tree=args.tree, tree_dir=tree_dir, dp_size=dist.get_world_size(),
                   model_desc=MODEL_DESC, phase_desc=PHASE_DESC, steps=1)  # fmt: skip
        records.append(rec)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(records, indent=1))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
