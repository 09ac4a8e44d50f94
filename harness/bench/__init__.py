"""Benchmark of the layer-wise param sync: upstream 0.17.1 and the series, measured in one
run on gloo ranks (``scripts/bench_param_sync.py``); and the real-shape audit of the same
sync (``scripts/audit_param_sync.py``: real model configs at DP 8 to 1024, storage-free, on
a fake process group).

| module | job |
|---|---|
| ``trees`` | the audit's comparison trees, built from ``trees/*.diff`` |
| ``theory`` | bytes, launches and wire bytes each design should show, from the shares alone |
| ``counters`` | per-sync counters: collectives at the dispatch level, allocator events |
| ``stats`` | interleaved (ABBA) schedule, median ratio and its bootstrap CI |
| ``sync_worker`` | one tree's DDP + layer-wise optimizer on gloo ranks; counts, timing server |
| ``step_memory`` | peak memory per phase of one real training step |
| ``report`` | param_sync.md and param_sync.png from the records |
| ``real_shapes`` | the audit's models, trees and DP sizes (data only) |
| ``real_shapes_worker`` | one tree's param sync per model x DP on meta tensors over a fake process group |
| ``real_shapes_report`` | real_shapes.json, .md and .png from the audit's records |
"""
