"""Theoretical temporaries of the layer-wise param all-gather (bytes), per design.

Two designs of the receive side of the layer-wise param sync (--optimizer dist_muon):

* **pristine megatron-core 0.17.1**: `_ParamAndGradBucketGroup.start_param_sync` (layer-wise branch,
  `megatron/core/distributed/param_and_grad_buffer.py`) and
  `LayerWiseDistributedOptimizer.allgather_params` (`optimizer/layer_wise_optimizer.py`)
  allocate, per gather, a `torch.empty` receive tensor for every other rank plus the
  local flatten (`torch._utils._flatten_dense_tensors`), all in the param dtype.
* **this series**: the local params are copied straight into their slot of
  `grad_data.view(param_dtype)` while it is idle (the forward's gathers), and the
  optimizer's gather broadcasts each param in place: zero bytes on those paths.

`_flatten_dense_tensors` of exactly ONE tensor returns a view of it (no copy, 0 bytes;
`torch._C._nn.flatten_dense_tensors` special-cases a single tensor), and for no tensor
pristine 0.17.1 allocates `torch.empty(0)` (0 bytes). A rank owning two or more params gets a
fresh `torch.cat` of them.

The functions take plain per-rank param lists (anything with `.numel()`), or duck-typed
megatron buckets/bucket groups, so they need no megatron import. Used by
tests/unit_tests/layerwise_worker.py and the bench (harness/bench/sync_worker.py). What
ProcessGroupNCCL allocates and launches per call is the collective model's
(``harness.cpu_runtime.collectives.model_call``).
"""

from __future__ import annotations

from typing import List, Sequence


def shares(params_by_rank: Sequence[Sequence]) -> List[int]:
    """Elements each DP rank owns (its share): [sum(p.numel() for p in ps) for ps in params_by_rank]."""
    return [sum(p.numel() for p in ps) for ps in params_by_rank]


def theory_upstream_bytes(params_by_rank, rank, itemsize):
    """Bytes pristine 0.17.1 allocates for one gather of one bucket (or of the whole
    model, for the optimizer's path), from start_param_sync / allgather_params:

    - a torch.empty receive tensor for every other rank: sum of their sizes;
    - the local flatten (_flatten_dense_tensors): a new tensor when this rank owns two
      or more params; for exactly one param it returns a view of it, for none an empty
      tensor (0 bytes).
    Nothing when no rank owns anything or the group has one rank.

    Args:
        params_by_rank: per DP rank, the params that rank owns in this bucket (shapes
            only matter); `len(params_by_rank)` is the DP size.
        rank: this rank's index in the DP group.
        itemsize: bytes per element of the param dtype (2 for bf16).

    Returns:
        Bytes (int).
    """
    sizes = shares(params_by_rank)
    if len(sizes) < 2 or max(sizes) == 0:
        return 0
    local = sizes[rank] if len(params_by_rank[rank]) > 1 else 0
    return (sum(sizes) - sizes[rank] + local) * itemsize


def bucket_bytes(bucket, rank: int) -> int:
    """Theoretical bytes of one DDP bucket's layer-wise gather on pristine 0.17.1.

    Args:
        bucket: a megatron `_ParamAndGradBucket` (uses `layerwise_params_list`, set by the
            layer-wise optimizer, None when it does not shard the bucket, and
            `params_list[0].dtype` as the param dtype, as pristine 0.17.1 does).
        rank: this rank's index in the bucket group's DP group.
    """
    if bucket.layerwise_params_list is None:
        return 0
    return theory_upstream_bytes(bucket.layerwise_params_list, rank, bucket.params_list[0].dtype.itemsize)


def group_bytes(bucket_group, rank: int) -> int:
    """Sum of bucket_bytes() over a `_ParamAndGradBucketGroup`'s buckets: what one
    start_param_sync() of the group holds at once on pristine 0.17.1 (bytes)."""
    return sum(bucket_bytes(b, rank) for b in bucket_group.buckets)


def async_chain_peak_bytes(group_bytes_in_forward_order: Sequence[int]) -> int:
    """Peak live temporaries (bytes) of the forward pre-hook chain over bucket groups.

    `finish_param_sync()` of group i waits, dispatches group i+1 (allocating its
    temporaries), copies group i back and only then drops group i's temporaries. So two
    consecutive groups are alive at once: peak = max_i (T[i] + T[i+1]), T[n] = 0.

    Args:
        group_bytes_in_forward_order: group_bytes() of each bucket group in the order
            the forward pass finishes them (reversed(ddp.bucket_groups)).
    """
    t = list(group_bytes_in_forward_order) + [0]
    return max((a + b for a, b in zip(t, t[1:])), default=0)
