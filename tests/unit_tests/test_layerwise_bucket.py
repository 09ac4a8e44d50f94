"""Single-process tests of the bucket-level layer-wise gather of the series.

They exercise _ParamAndGradBucket's plan (set_layerwise_params_list), copy-in
(start_layerwise_gather) and copy-out (finish_layerwise_gather) directly: the receive
layout inside grad_data, the collective form each share pattern gets, the zeroing of
exactly the written region, the offload fallback and the assertion on a too-narrow
grad_data. The collective itself is replaced by a recorder that returns at once (one
process); what a real gloo group does with it is tested in test_layerwise_collectives.py.
Patched tree only: these methods do not exist upstream.
"""

import logging

import pytest
import torch

from megatron.core.distributed import param_and_grad_buffer as pgb
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucket

LOGGER = "megatron.core.distributed.param_and_grad_buffer"


def make_bucket(
    param_dtype, grad_dtype, shapes=((3, 2), (5,), (4,)), owners=(0, 1, 1), pad=3, fill=0.0
):
    """A bucket over params of `shapes`, rank owners[i] owning param i; grad_data has
    `pad` extra elements (DDP may pad) and holds `fill` (grads a step consumed)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(param_dtype)) for s in shapes]
    numel = sum(p.numel() for p in params)
    grad_data = torch.full((numel + pad,), fill, dtype=grad_dtype)
    index, offset = {}, 0
    for p in params:
        index[p] = (offset, offset + p.numel(), 0)
        offset += p.numel()
    bucket = _ParamAndGradBucket(params, None, grad_data, 0, numel, 1.0, 0, index, [])
    per_rank = [[p for p, o in zip(params, owners) if o == r] for r in range(max(owners) + 1)]
    bucket.set_layerwise_params_list(per_rank)
    return bucket, params, grad_data


@pytest.fixture
def collectives(monkeypatch):
    """Records (name, output, input) of every all-gather call; the call returns None."""
    calls = []

    def recorder(name):
        def fn(output, inp, group=None, async_op=False):
            calls.append((name, output, inp))

        return fn

    monkeypatch.setattr(torch.distributed, "all_gather", recorder("all_gather"))
    monkeypatch.setattr(
        torch.distributed, "all_gather_into_tensor", recorder("all_gather_into_tensor")
    )
    return calls


def in_storage(t, storage_owner):
    base = storage_owner.untyped_storage().data_ptr()
    return base <= t.data_ptr() < base + storage_owner.untyped_storage().nbytes()


@pytest.mark.parametrize(
    "shares,capacity,itemsize,form",
    [
        ([8, 8, 8, 8], 32, 2, "into_tensor"),
        ([6, 9], 30, 2, "padded"),  # 2 x 9 = 18 fits, 3 elements of padding
        ([6, 9], 17, 2, "list"),  # 18 does not fit
        ([0, 9], 18, 2, "padded"),  # a rank that owns nothing: its slot is padding
        # 2 MiB of padding at DP 2 is more than one launch is worth (1 MiB).
        ([0, 1 << 20], 1 << 22, 2, "list"),
        # The same padding at DP 4 saves 3 launches: padded.
        ([0, 0, 0, 1 << 18], 1 << 22, 2, "padded"),
    ],
)
def test_collective_form_rule(shares, capacity, itemsize, form):
    assert pgb._choose_layerwise_gather_form(shares, capacity, itemsize) == form


def test_list_form_slots_are_exact_contiguous_views_of_grad_data(collectives):
    # bf16 grads, no DDP padding: grad_data.view(bf16) has 15 elements, padding needs 2 x 9.
    bucket, params, grad = make_bucket(torch.bfloat16, torch.bfloat16, pad=0)
    plan = bucket.layerwise_gather_plan
    assert (plan.form, plan.offsets, plan.written_numel) == ("list", [0, 6], 15)
    bucket.start_layerwise_gather(None, local_rank=0, async_op=False)
    ((name, out, inp),) = collectives
    assert name == "all_gather" and [s.numel() for s in out] == [6, 9]
    assert out[0].data_ptr() == grad.data_ptr() and out[1].data_ptr() == grad[6:].data_ptr()
    assert inp is out[0]
    # The local share was copied straight into its slot.
    assert torch.equal(out[0], params[0].detach().reshape(-1))


def test_padded_form_input_and_output_alias_grad_data(collectives):
    bucket, params, grad = make_bucket(torch.bfloat16, torch.float32)
    plan = bucket.layerwise_gather_plan
    assert (plan.form, plan.offsets, plan.written_numel) == ("padded", [0, 9], 18)
    bucket.start_layerwise_gather(None, local_rank=1, async_op=False)
    ((name, out, inp),) = collectives
    view = grad.view(torch.bfloat16)
    assert name == "all_gather_into_tensor"
    assert out.data_ptr() == view.data_ptr() and out.numel() == 18
    assert inp.data_ptr() == view[9:].data_ptr() and inp.numel() == 9
    assert torch.equal(inp, torch.cat([params[1].detach(), params[2].detach()]))


def test_copy_out_fills_params_and_zeroes_only_the_written_region(collectives):
    # grad_data (19 fp32 elements) holds consumed grads (0.5).
    bucket, params, grad = make_bucket(torch.bfloat16, torch.float32, pad=4, fill=0.5)
    assert bucket.layerwise_gather_plan.form == "padded"  # 18 bf16 = 9 fp32 written
    bucket.start_layerwise_gather(None, local_rank=0, async_op=False)
    out = collectives[0][1]
    incoming = torch.arange(9, dtype=torch.bfloat16)
    out[9:18].copy_(incoming)  # what the all-gather delivers from rank 1
    bucket.finish_layerwise_gather(local_rank=0)
    assert torch.equal(params[1].detach(), incoming[:5])
    assert torch.equal(params[2].detach(), incoming[5:])
    assert torch.count_nonzero(grad[:9]) == 0, "the written region must be zero"
    assert torch.equal(grad[9:], torch.full((10,), 0.5)), "grad_data beyond it is untouched"
    assert bucket.layerwise_gather is None


def test_copy_out_can_leave_zeroing_to_zero_grad_buffer(collectives):
    bucket, _, grad = make_bucket(torch.float32, torch.float32)
    bucket.start_layerwise_gather(None, local_rank=0, async_op=False)
    bucket.finish_layerwise_gather(local_rank=0, zero_grad_data=False)
    assert torch.count_nonzero(grad) > 0  # the local share is still there


def test_equal_shares_gather_into_tensor(collectives):
    bucket, params, grad = make_bucket(
        torch.float32, torch.float32, shapes=((2, 2), (4,), (3,), (3,)), owners=(0, 1, 0, 1)
    )
    plan = bucket.layerwise_gather_plan
    assert (plan.form, plan.offsets, plan.written_numel) == ("into_tensor", [0, 7], 14)
    bucket.start_layerwise_gather(None, local_rank=1, async_op=False)
    ((name, out, inp),) = collectives
    assert name == "all_gather_into_tensor" and out.data_ptr() == grad.data_ptr()
    assert inp.data_ptr() == grad[7:].data_ptr() and inp.numel() == 7


def test_views_are_computed_once(collectives):
    bucket, _, _ = make_bucket(torch.bfloat16, torch.float32)
    for _ in range(2):
        bucket.start_layerwise_gather(None, local_rank=0, async_op=False)
        bucket.finish_layerwise_gather(local_rank=0)
    assert collectives[0][1] is collectives[1][1] and collectives[0][2] is collectives[1][2]


def test_offloaded_grad_data_falls_back_to_a_temporary(collectives, caplog):
    bucket, params, grad = make_bucket(torch.bfloat16, torch.float32)
    grad.untyped_storage().resize_(0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            bucket.start_layerwise_gather(None, local_rank=1, async_op=False)
            name, out, _ = collectives[-1]
            # Same collective as with grad_data, so that every rank calls the same one.
            assert name == "all_gather_into_tensor"
            assert not in_storage(out, grad) and out.numel() == 18
            out[:6].copy_(torch.full((6,), 3.0))
            bucket.finish_layerwise_gather(local_rank=1)
    warnings = [r for r in caplog.records if "cannot serve as the receive buffer" in r.message]
    assert len(warnings) == 1, "warn once per bucket"
    assert f"bucket {bucket.bucket_id}" in warnings[0].message
    assert torch.equal(params[0].detach(), torch.full((3, 2), 3.0, dtype=params[0].dtype))
    assert grad.untyped_storage().nbytes() == 0, "freed storage was written"


def test_grad_data_narrower_than_params_asserts_with_sizes():
    with pytest.raises(AssertionError) as err:
        make_bucket(torch.float32, torch.bfloat16)
    msg = str(err.value)
    assert "bucket 0" in msg and "torch.bfloat16" in msg and "torch.float32" in msg
    assert "15" in msg and "18" in msg  # gathered numel, grad_data numel


def test_unsharded_bucket_has_nothing_to_gather():
    bucket, _, _ = make_bucket(torch.float32, torch.float32)
    bucket.set_layerwise_params_list(None)
    assert bucket.layerwise_recv_numel == 0 and bucket.layerwise_param_flat_sizes is None
    assert bucket.layerwise_gather_plan is None
