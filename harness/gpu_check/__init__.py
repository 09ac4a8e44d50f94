"""GPU check: the series' CUDA code on one or more GPUs, upstream vs patched, in one run.

``scripts/gpu_check.sh OUT`` (``python -m harness.gpu_check``) plans and runs:

* DP=2 on one GPU: two ranks on ``cuda:0`` with the gloo backend (NCCL refuses two ranks on
  one device; gloo stages CUDA tensors through host memory). The default functional case
  trains on both trees and is compared bit for bit and with golden values for the GPU type.
* CUDA memory: ``torch.cuda.max_memory_allocated`` and ``memory_reserved`` during the forward
  of a training step and around one param sync, upstream vs patched, on a GPT whose param
  bytes dominate, with the all-gather call forms and what ProcessGroupNCCL would allocate.
* With 2 or more GPUs: the same on NCCL, one rank per GPU, including a model whose bucket
  shares are equal (where a list ``all_gather`` makes NCCL allocate a flat temporary).

Modules: ``plan`` (what runs, with which command and timeout), ``__main__`` (the command
line and the runner), ``functional`` (one functional case through the functional-test
runner), ``memory_worker`` (one rank of the memory measurement), ``shared_gpu`` (rank-side
set-up for gloo ranks sharing a GPU, and the record of all-gather call forms), ``report``
(summary JSON and text report from a results folder).
"""
