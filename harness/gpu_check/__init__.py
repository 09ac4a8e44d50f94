"""GPU check: the series' CUDA code on one or more GPUs, pristine vs series trees, in one run.

``scripts/gpu_check.sh OUT`` (``python -m harness.gpu_check``) plans and runs, on both bases
(megatron-core 0.17.1 and 0.19; ``plan`` lists every run):

* DP=2 on one GPU with gloo: two ranks on ``cuda:0`` (gloo stages CUDA tensors through host
  memory). The default functional case trains on both trees and is compared bit for bit and
  with golden values for the GPU type; a memory run measures the CUDA bytes.
* NCCL: the functional cases (default, Transformer Engine, sync, eval; 0.19's legacy, sync,
  MoE, VPP and layout cases) and the memory runs (``param_dominated``, ``equal_shares`` and
  Llama-3-8B's shapes checked against the real-shape audit's prediction). Ranks get a GPU
  each where there are enough; otherwise they share GPUs through NCCL's socket transport
  (a ``NCCL_HOSTID`` per rank), so one GPU runs the whole plan: NCCL's code paths and its
  real CUDA memory, not its time.
* The optimizer's gather timed (``timing_nccl_optimizer_gather``): the pristine list all_gather
  against the series' in-place broadcasts, interleaved on one model, alone on the GPUs where
  each rank has one (docs/bench/optimizer_gather_on_nccl.md).
* CUDA memory: ``torch.cuda.max_memory_allocated`` and ``memory_reserved`` during the forward
  of a training step and around one param sync, pristine vs series, with the all-gather
  call forms and what ProcessGroupNCCL allocates.

Modules: ``plan`` (what runs, with which command and timeout), ``__main__`` (the command
line and the runner), ``functional`` (one functional case through the functional-test
runner), ``memory_worker`` (one rank of the memory measurement), ``gather_timing_worker`` (one rank of
the optimizer-gather timing), ``shared_gpu`` (rank-side
set-up for ranks sharing a GPU, gloo or NCCL, and the record of all-gather call forms), ``report``
(summary JSON and text report from a results folder), ``real_shapes`` and
``predict_worker`` (the real-shape run's model, layer count and the audit's prediction).
"""
