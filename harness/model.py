"""The model every param-sync worker builds: megatron's GPTModel in the tree's DDP with the
layer-wise Muon optimizer (``--optimizer dist_muon``, legacy path), and the syncs they run on it.

Used by the bench (``harness/bench/sync_worker.py``), the real-shape audit
(``harness/audit/worker.py``) and the memory worker of the GPU check and the bench's step
memory (``harness/gpu_check/memory_worker.py``), so that each builds DDP and the optimizer, and runs
a sync, the same way:

* ``gpt_model``: megatron's ``GPTModel`` with its local (no Transformer Engine) spec, bf16
  params;
* ``ddp_config``: megatron's ``DistributedDataParallelConfig`` as the legacy layer-wise path
  takes it (fp32 ``grad_data`` as with ``--accumulate-allreduce-grads-in-fp32``, overlapped
  grad reduce, no distributed optimizer);
* ``layerwise_optimizer``: the tree's ``LayerWiseDistributedOptimizer`` over DDP chunks
  (``harness.layerwise_optimizer``: on every base), bf16 params;
* ``wrap``: both, for one model;
* ``LayerwiseModel``: (ddp, opt) with the state a training step starts from (``reset``) and
  one sync of each path (``sync_fn``);
* ``fake_all_gather_object``: what megatron's optimizer setup needs on the fake backend.

Megatron is imported inside the functions: the workers install the CPU runtime layer first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.layerwise_optimizer import layerwise_muon_optimizer

PARAM_DTYPE = torch.bfloat16
PATHS = ("async", "forced", "optimizer")
#: The bench's negative control (``LayerwiseModel.reset_grad_buffers``).
CONTROL = "control"


def gpt_model(config, vocab_size: int, max_sequence_length: int, block_spec: bool = False,
              normalization=None, vp_stage=None, **gpt_kwargs):
    """megatron's ``GPTModel`` of ``config`` with the local spec (no Transformer Engine), params
    cast to bf16.

    Args:
        block_spec: the decoder block spec, ``get_gpt_decoder_block_spec(config,
            use_transformer_engine=False, normalization=normalization)`` (per-layer specs: MoE
            layers, RMSNorm); False: one layer spec for every layer, ``get_gpt_layer_local_spec()``.
        vp_stage: the model chunk (VPP), given to the block spec and the model.
        gpt_kwargs: other ``GPTModel`` arguments (pre_process, position_embedding_type, ...).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    vp = {} if vp_stage is None else dict(vp_stage=vp_stage)
    if block_spec:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization, **vp)
    else:
        spec = get_gpt_layer_local_spec()
    module = GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length, **gpt_kwargs, **vp)
    return module.to(dtype=PARAM_DTYPE)


def ddp_config(overlap: bool, bucket_size=None, grad_reduce_in_fp32: bool = True, **extra):
    """The tree's ``DistributedDataParallelConfig`` of the legacy layer-wise path.

    Args:
        overlap: ``overlap_param_gather`` (True: the forward's pre-hook gathers; False: the
            optimizer's gather at the end of ``step()``).
        bucket_size: elements per bucket; None: DDP's default, max(40M, 1M x DP).
        grad_reduce_in_fp32: fp32 ``grad_data`` (``--accumulate-allreduce-grads-in-fp32``).
        extra: other ``DistributedDataParallelConfig`` fields.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=True,
                                         overlap_param_gather=overlap, use_distributed_optimizer=False,
                                         bucket_size=bucket_size, **extra)  # fmt: skip


def layerwise_optimizer(chunks, overlap: bool, lr: float = 0.01, **config):
    """The tree's layer-wise Muon optimizer over the DDP ``chunks``, bf16 params.

    Args:
        overlap: ``overlap_param_gather``, as the chunks' DDP config says.
        lr, config: ``OptimizerConfig`` fields.
    """
    from megatron.core.optimizer import OptimizerConfig

    opt_config = OptimizerConfig(optimizer="muon", lr=lr, bf16=True, params_dtype=PARAM_DTYPE,
                                 use_distributed_optimizer=False, overlap_param_gather=overlap, **config)  # fmt: skip
    return layerwise_muon_optimizer(opt_config, list(chunks), use_gloo_process_groups=False)


def wrap(config, module, overlap: bool, bucket_size=None, lr: float = 0.01, **opt_config):
    """(ddp, opt): ``module`` in the tree's DDP (``ddp_config``) and its layer-wise optimizer
    (``layerwise_optimizer``; ``lr`` and ``opt_config`` go to its ``OptimizerConfig``)."""
    from megatron.core.distributed import DistributedDataParallel

    ddp = DistributedDataParallel(config, ddp_config(overlap, bucket_size), module)
    return ddp, layerwise_optimizer([ddp], overlap, lr=lr, **opt_config)


class LayerwiseModel:
    """DDP and its layer-wise optimizer, and one sync of each path.

    Subclasses build ``self.ddp`` (a DDP, or several chunks behaving as one) and ``self.opt``,
    then call ``_finish_init()``.

    Paths (``sync_fn``):
      - ``async``: the forward's pre-hook gathers, bucket group after bucket group in forward
        order (``--overlap-param-gather``);
      - ``forced``: ``DistributedDataParallel.start_param_sync(force_sync=True)`` (evaluation,
        checkpoint save);
      - ``optimizer``: the optimizer's ``allgather_params()`` (no ``--overlap-param-gather``);
      - ``control``: every grad buffer's ``reset()``, code no tree changes.
    """

    def _finish_init(self) -> None:
        self.params = list(self.ddp.module.parameters())
        self.groups = self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups
        self.buckets = [b for g in self.groups for b in g.buckets]

    @property
    def forward_order(self):
        """Bucket groups in the order the forward pre-hooks finish them: buckets are
        built in backward order, and next_param_gather_bucket_group points backwards."""
        return list(reversed(self.ddp.bucket_groups))

    def reset(self) -> None:
        """State at the start of a training step: train_step's zero_grad_buffer(), and no
        gather dispatched (finish_grad_sync clears param_gather_dispatched)."""
        self.ddp.zero_grad_buffer()
        for g in self.groups:
            g.param_gather_dispatched = False

    def sync_fn(self, path: str):
        """Zero-argument callable running one sync of `path` (class docstring).

        Raises:
            ValueError: unknown path.
        """
        if path == "async":

            def run():
                order = self.forward_order
                order[0].start_param_sync()
                for g in order:
                    g.finish_param_sync()

            return run
        if path == "forced":
            return lambda: self.ddp.start_param_sync(force_sync=True)
        if path == "optimizer":
            return self.opt.allgather_params
        if path == CONTROL:
            return self.reset_grad_buffers
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS + (CONTROL,)}")

    def reset_grad_buffers(self):
        """The negative control: every grad buffer's reset() (grad_data.zero_()), the
        memset at the heart of DDP.zero_grad_buffer(), whose source no tree changes."""
        for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            buffer.reset()


def fake_all_gather_object() -> None:
    """all_gather_object on the fake backend: every rank's object is this rank's, as the
    fake backend's own all_gather made it (megatron's optimizer setup gathers param-group
    keys with it). The collective model executes fake-backend gathers without moving data,
    so torch's all_gather_object would unpickle uninitialized sizes there. For the workers
    that run on the fake backend: the real-shape audit's (``harness.audit.worker``) and the GPU
    check's predictions (``harness/gpu_check/predict_worker.py``)."""
    real = dist.all_gather_object

    def all_gather_object(object_list, obj, group=None):
        if "fake" not in str(dist.get_backend(group)):
            return real(object_list, obj, group=group)
        object_list[:] = [obj] * dist.get_world_size(group)

    dist.all_gather_object = all_gather_object
