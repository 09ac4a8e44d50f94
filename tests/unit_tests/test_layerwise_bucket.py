"""Single-process tests of the bucket-level copy-in / copy-out of the series.

They exercise _ParamAndGradBucket.start_layerwise_gather / finish_layerwise_gather (added
by patches/0004) directly, without collectives: the receive layout inside grad_data, the
zeroing, and the fallback when grad_data cannot serve (offloaded storage; grad element
size smaller than the param's). Patched tree only: these methods do not exist upstream.
"""

import logging

import pytest
import torch

from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucket

LOGGER = "megatron.core.distributed.param_and_grad_buffer"


def make_bucket(param_dtype, grad_dtype, shapes=((3, 2), (5,), (4,)), owners=(0, 1, 1)):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(param_dtype)) for s in shapes]
    numel = sum(p.numel() for p in params)
    grad_data = torch.zeros(numel + 3, dtype=grad_dtype)  # + padding, as DDP may add
    index, offset = {}, 0
    for p in params:
        index[p] = (offset, offset + p.numel(), 0)
        offset += p.numel()
    bucket = _ParamAndGradBucket(params, None, grad_data, 0, numel, 1.0, 0, index, [])
    per_rank = [[p for p, o in zip(params, owners) if o == r] for r in range(max(owners) + 1)]
    bucket.set_layerwise_params_list(per_rank)
    return bucket, params, grad_data


def test_slots_are_contiguous_views_of_grad_data_in_rank_order():
    bucket, params, grad = make_bucket(torch.bfloat16, torch.float32)
    slots = bucket.start_layerwise_gather(local_rank=0)
    assert [s.numel() for s in slots] == [6, 9]
    view = grad.view(torch.bfloat16)
    assert slots[0].data_ptr() == view.data_ptr()
    assert slots[1].data_ptr() == view[6:].data_ptr()
    # The local share was copied straight into its slot.
    assert torch.equal(slots[0], params[0].detach().reshape(-1))
    assert bucket.layerwise_gather.in_grad_data


def test_copy_out_fills_params_and_zeroes_grad_data():
    bucket, params, grad = make_bucket(torch.bfloat16, torch.float32)
    slots = bucket.start_layerwise_gather(local_rank=0)
    incoming = torch.arange(9, dtype=torch.bfloat16)
    slots[1].copy_(incoming)  # what all_gather would deliver from rank 1
    assert torch.count_nonzero(grad) > 0
    bucket.finish_layerwise_gather(local_rank=0)
    assert torch.equal(params[1].detach(), incoming[:5])
    assert torch.equal(params[2].detach(), incoming[5:])
    assert torch.count_nonzero(grad) == 0, "grad_data must be zero after the copy-back"
    assert bucket.layerwise_gather is None


@pytest.mark.parametrize("case", ["offloaded", "grad_smaller_than_param"])
def test_fallback_when_grad_data_cannot_serve(case, caplog):
    if case == "offloaded":
        bucket, params, grad = make_bucket(torch.bfloat16, torch.float32)
        grad.untyped_storage().resize_(0)
    else:
        bucket, params, grad = make_bucket(torch.float32, torch.bfloat16)
    before = grad.clone() if grad.untyped_storage().nbytes() else None
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            slots = bucket.start_layerwise_gather(local_rank=1)
            assert not bucket.layerwise_gather.in_grad_data
            slots[0].copy_(torch.full((6,), 3.0))
            bucket.finish_layerwise_gather(local_rank=1)
    warnings = [r for r in caplog.records if "cannot serve as the receive buffer" in r.message]
    assert len(warnings) == 1, "warn once per bucket"
    assert f"bucket {bucket.bucket_id}" in warnings[0].message
    assert torch.equal(params[0].detach(), torch.full((3, 2), 3.0, dtype=params[0].dtype))
    if before is None:
        assert grad.untyped_storage().nbytes() == 0, "freed storage was written"
    else:
        assert torch.equal(grad, before), "grad_data was written although it cannot serve"


def test_unsharded_bucket_has_nothing_to_gather():
    bucket, _, _ = make_bucket(torch.float32, torch.float32)
    bucket.set_layerwise_params_list(None)
    assert bucket.layerwise_recv_numel == 0 and bucket.layerwise_param_flat_sizes is None
