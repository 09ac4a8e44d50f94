"""The param-sync audit: the layer-wise param sync of each megatron tree on real model
shapes at real DP (8 to 1024), storage-free, on a fake process group
(``scripts/audit_param_sync.py``; published in docs/bench/real_shapes.{md,json,png}).

| module | job |
|---|---|
| ``grid`` | the audit's models, trees and DP sizes (data only) |
| ``worker`` | one tree's param sync per model x DP on meta tensors over a fake process group |
| ``te_standin`` | Transformer Engine's parameters where TE is not installed (the flag path) |
| ``report`` | JSON, tables and plot from the workers' records |
| ``run`` | the driver: one worker per tree, checks, outputs (``scripts/audit_param_sync.py``) |

Hand-written text of the published page (findings, method, legends): docs/bench/real_shapes_findings.md.
"""
