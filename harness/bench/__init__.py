"""Benchmark of the layer-wise param sync: pristine 0.17.1 and the series, measured in one
run on gloo ranks (``scripts/bench_param_sync.py``). The real-shape audit of the same sync is
``harness.audit``; the peak memory per phase of a training step comes from the GPU check's
memory worker (``harness/gpu_check/memory_worker.py``) on CPU ranks.

| module | job |
|---|---|
| ``theory`` | bytes each design should allocate, from the shares alone (NCCL calls: ``harness.cpu_runtime.collectives.model_call``) |
| ``counters`` | the collective model's NCCL stand-ins (split off the dispatch-level count), torch.profiler allocator events |
| ``stats`` | interleaved (ABBA) schedule, median ratio and its bootstrap CI |
| ``sync_worker`` | one tree's DDP + layer-wise optimizer on gloo ranks; counts, timing server |
| ``report`` | param_sync.md and param_sync.png from the records |
"""
