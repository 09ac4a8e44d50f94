"""Worker of scripts/audit_param_sync.py: ONE megatron tree's param sync on real shapes.

The driver (scripts/audit_param_sync.py) starts this file once per tree, with that
tree first on PYTHONPATH (harness.trees.env_for_tree) and the CPU runtime layer on:

    python harness/audit/worker.py --tree series-0.17.1 --cells llama3_8b_tp1:64,... --out F.json

Per cell (model x DP) it runs, in this one process, what megatron runs on one rank of a
job of TP x PP x DP ranks:

* PyTorch's fake process group of that world size, this process being global rank
  ``tp 0, pp stage, DP rank r``; megatron's own ``parallel_state.initialize_model_parallel``
  derives every group (TP, PP, DP, EP, expert DP) from it.
* Every tensor megatron creates lives on the meta device (``MetaDeviceMode``): shapes,
  dtypes, strides and views are real, storage is none, so 8B to 175B params cost nothing.
* The model is megatron's ``GPTModel`` with ``get_gpt_decoder_block_spec(config,
  use_transformer_engine=False)`` (local spec), this stage's layers only, bf16 params,
  wrapped in the tree's ``DistributedDataParallel`` (fp32 ``grad_data``, overlapped grad
  reduce, default bucket size) and given the tree's layer-wise Muon optimizer:
  ``get_megatron_muon_optimizer(..., layer_wise_distributed_optimizer=True)`` on the legacy
  trees; on the layout tree, as ``megatron.training.training.wrap_model_chunks_with_ddp``
  and ``get_model`` wire it (``compute_full_param_layout`` -> DDP ``full_param_layout``,
  ``use_distributed_optimizer=True``) and ``get_megatron_optimizer``.
* Paths, each run once to warm up and once counted, after the state a training step
  starts from (``harness.model.LayerwiseModel.reset``):
  - ``async`` (``--overlap-param-gather``): DDP's own forward pre-hook over every module in
    registration (forward) order, as the first forward of a step runs it: each bucket
    group's ``finish_param_sync()`` dispatches its gather if needed, waits, dispatches the
    next group's, and copies back, so up to 2 bucket groups per chain are in flight;
  - ``forced``: ``DistributedDataParallel.start_param_sync(force_sync=True)`` (eval,
    checkpoint save);
  - ``optimizer`` (overlap of the param gather off): ``LayerWiseDistributedOptimizer.
    allgather_params()`` on the legacy trees; on the layout tree, what its optimizers'
    ``step_with_ready_grads`` issue then: ``start_param_sync_for_bucket_group_subset()``
    of the layer-wise optimizer and of the sibling DistributedOptimizer.

Counted per path (one sync, this rank): the collective model's records
(``harness.cpu_runtime.collectives``: form, NCCL ops, zero-size ops, group launches, NCCL
temporaries, wire bytes; ``summarize``); megatron's tensor storages (``SyncCounter``, an
``AllocationCounter`` that keeps the collective model's own stand-ins for NCCL's
temporaries apart, with both peaks); and the bytes that ``zero_``, ``fill_(0)`` and
``_foreach_zero_`` write into
``grad_data`` (and into other buffers) during the sync. Per cell: the buckets (numel,
params, per-rank shares from the optimizer's ``dp_cp_params_list`` / ``expt_dp_params_list``,
non-empty shares) and the persistent padding of DDP's buffers.

A cell or path that raises records ``{"error": "Type: message"}``: a tree's crash is data.

Per cell, too, megatron's own estimate of the step's peak memory per rank,
``theoretical_memory`` (``theoretical_memory``: the tree's ``megatron.training.
theoretical_memory_usage.report_theoretical_memory`` on the model's flags at that DP;
``grid.MODEL_FLAGS`` for the built-in models). ``--theory-only`` computes only that.

``--flags JOB`` audits the model that ``pretrain_gpt.py`` flags describe instead of
``--cells`` (``run_flags``, ``FlagsSpec``): the tree's own argument parser, ``validate_args``,
``core_transformer_config_from_args`` and its checkout's ``gpt_builder`` make the config and
the model; a cell whose flags megatron refuses records ``{"flags_error": message}`` (bad
input, not data).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):
    # Run as a file: sys.path[0] is harness/audit; the repo root goes LAST so that the
    # tree chosen by PYTHONPATH keeps its rank (check_expected_tree()).
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from harness import cpu_runtime  # noqa: E402

cpu_runtime.install_if_requested()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._device import _device_constructors  # noqa: E402

from harness.alloc_counter import AllocationCounter, storage_key  # noqa: E402
from harness.audit import grid  # noqa: E402
from harness import model  # noqa: E402
from harness.model import PARAM_DTYPE, PATHS  # noqa: E402
from harness.cpu_runtime import collectives  # noqa: E402
from harness.cpu_runtime import device as cpu_device  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402

META = torch.device("meta")
FAKE_BACKEND = "cpu:fake,cuda:fake,meta:fake"
_FACTORIES = _device_constructors()
_COLLECTIVES_FILE = os.path.realpath(collectives.__file__)
#: Tensor.type as torch-function modes see it: the CPU runtime layer's replacement, or torch's.
_TYPE_FUNCS = (cpu_device.tensor_type, cpu_device._real_tensor_type)


# ---------------------------------------------------------------- storage-free tensors
def _is_device_arg(a) -> bool:
    return isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cuda", "cpu")) or (
        isinstance(a, int) and not isinstance(a, bool)
    )


class MetaDeviceMode(TorchFunctionMode):
    """Every tensor created inside lives on the meta device (no storage).

    Factory functions (``torch.empty``, ``zeros``, ``tensor``, ...) get ``device=meta``
    whatever device megatron asked for; ``Tensor.to(device)``, ``.cuda()``, ``.cpu()`` and
    ``.pin_memory()`` keep a tensor where it is; ``record_stream`` is a no-op;
    ``Tensor.type()`` names a meta tensor as the CUDA tensor it stands for
    (``Float16OptimizerWithFloat16Params`` checks ``'torch.cuda.BFloat16Tensor'``).
    While it is active the CPU runtime layer's own device mapping is popped
    (``device_mapping_suspended``): this mode maps every device itself, and each torch call
    then pays for one mode instead of two.
    """

    def __enter__(self):
        self._suspended = cpu_runtime.device_mapping_suspended()
        self._suspended.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._suspended.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func in _FACTORIES:
            kwargs["device"] = META
            kwargs.pop("pin_memory", None)
        elif func is torch.Tensor.to:
            args = (args[0],) + tuple(META if _is_device_arg(a) else a for a in args[1:])
            if "device" in kwargs:
                kwargs["device"] = META
        elif func in (torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory):
            return args[0]
        elif func is torch.Tensor.record_stream:
            return None
        elif func in _TYPE_FUNCS and len(args) == 1 and not kwargs and args[0].is_meta:
            name = cpu_device._real_tensor_type(args[0])  # 'torch.meta.BFloat16Tensor'
            return "torch.cuda." + name.rsplit(".", 1)[-1]
        return func(*args, **kwargs)


@dataclass
class SyncCounter(AllocationCounter):
    """``AllocationCounter`` of one sync that also tells NCCL's share and the zeroing apart.

    Storages allocated from inside the collective model (``collectives.py``: the stand-ins
    for what ProcessGroupNCCL allocates, e.g. the flat output of an equal-size list
    ``all_gather``) go to ``nccl_*`` instead of ``events``, so ``temporary_bytes`` and
    ``peak_extra_bytes`` are megatron's own tensors and ``nccl_peak_bytes`` is NCCL's peak.
    ``zero_``, ``fill_(0)`` and their ``_foreach_`` forms add the bytes of each tensor they
    write to ``zeroed_grad_bytes`` when its storage is one of ``grad_storages``, else to
    ``zeroed_other_bytes`` (a ``fill_`` with a tensor value counts as zeroing: a meta
    tensor has no value to check).

    Attributes (after the block): the parent's, and nccl_events, nccl_peak_bytes,
    zeroed_grad_bytes, zeroed_other_bytes, zero_calls (all bytes / counts).
    """

    grad_storages: set = field(default_factory=set)
    nccl_events: list = field(default_factory=list)
    nccl_live_bytes: int = 0
    nccl_peak_bytes: int = 0
    zeroed_grad_bytes: int = 0
    zeroed_other_bytes: int = 0
    zero_calls: int = 0

    _ZERO_OPS = ("aten.zero_.default", "aten._foreach_zero_.default")
    _FILL_OPS = ("aten.fill_.Scalar", "aten.fill_.Tensor", "aten._foreach_fill_.Scalar")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        zeroing = name in self._ZERO_OPS or (
            name in self._FILL_OPS and (isinstance(args[1], torch.Tensor) or args[1] == 0))
        if zeroing:
            self.zero_calls += 1
            for t in args[0] if isinstance(args[0], (list, tuple)) else [args[0]]:
                nbytes = t.numel() * t.element_size()
                if storage_key(t) in self.grad_storages:
                    self.zeroed_grad_bytes += nbytes
                else:
                    self.zeroed_other_bytes += nbytes
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _nccl_freed(self, nbytes: int) -> None:
        self.nccl_live_bytes -= nbytes

    def _account(self, func, storage, nbytes: int) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if os.path.realpath(frame.f_code.co_filename) == _COLLECTIVES_FILE:
                self.nccl_events.append((str(func), nbytes))
                self.nccl_live_bytes += nbytes
                self.nccl_peak_bytes = max(self.nccl_peak_bytes, self.nccl_live_bytes)
                weakref.finalize(storage, self._nccl_freed, nbytes)
                return
            frame = frame.f_back
        super()._account(func, storage, nbytes)


# ---------------------------------------------------------------- megatron objects
def _mc():
    """megatron-core names used here, imported from the tree on PYTHONPATH (before any
    MetaDeviceMode: the model's modules too, which ``harness.model.gpt_model`` builds)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.core.transformer import TransformerConfig

    return SimpleNamespace(
        ps=parallel_state, DDP=DistributedDataParallel, DDPConfig=DistributedDataParallelConfig,
        block_spec=get_gpt_decoder_block_spec, GPTModel=GPTModel, OptimizerConfig=OptimizerConfig,
        vocab_size_with_padding=vocab_size_with_padding, TransformerConfig=TransformerConfig,
    )  # fmt: skip


def build_module(mc, spec: grid.ModelSpec, vp_stage=None):
    """This stage's GPTModel of ``spec`` (meta tensors when called under MetaDeviceMode);
    with VPP, its model chunk ``vp_stage`` (``megatron.training.training.get_model``).

    Returns:
        (config, module, padded_vocab_size).

    Raises:
        FlagsError: ``spec`` is a ``FlagsSpec`` whose model megatron refuses to build.
    """
    if isinstance(spec, FlagsSpec):
        return spec.build_module(mc, vp_stage)
    cfg = dict(spec.config)
    if spec.swiglu:
        cfg.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    config = mc.TransformerConfig(
        **cfg,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
        expert_model_parallel_size=spec.ep,
        # Sequence parallelism changes no param shape; the local spec's torch norms refuse it.
        sequence_parallel=False,
        pipeline_dtype=PARAM_DTYPE if spec.pp > 1 else None,
        params_dtype=PARAM_DTYPE,
        bf16=True,
        use_cpu_initialization=True,
        perform_initialization=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    vocab = mc.vocab_size_with_padding(
        spec.vocab_size,
        SimpleNamespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=spec.tp, rank=1),
    )
    module = model.gpt_model(
        config, vocab, spec.max_sequence_length, block_spec=True, normalization=cfg.get("normalization"),
        vp_stage=vp_stage, pre_process=mc.ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=mc.ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type=spec.position_embedding_type,
    )  # fmt: skip
    return config, module, vocab


class ModelChunks:
    """The DDP-wrapped model chunks of one pipeline stage with VPP, as one DDP for the
    audit's paths: the buffers and bucket groups of every chunk (chunk order), and
    zero_grad_buffer() / start_param_sync() on each, as megatron.training's train_step
    and its forced syncs call them per chunk."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.module = torch.nn.ModuleList([c.module for c in chunks])
        for name in ("buffers", "expert_parallel_buffers", "bucket_groups", "expert_parallel_bucket_groups"):
            setattr(self, name, [x for c in chunks for x in getattr(c, name)])

    def zero_grad_buffer(self):
        for c in self.chunks:
            c.zero_grad_buffer()

    def start_param_sync(self, *args, **kwargs):
        for c in self.chunks:
            c.start_param_sync(*args, **kwargs)


class LegacySetup(model.LayerwiseModel):
    """The legacy layer-wise path (0.17.1, the series, 0.18.2 and 0.19.2 without the
    layout): DDP with ``use_distributed_optimizer=False`` and the layer-wise Muon
    optimizer (``harness.model.layerwise_optimizer``), as megatron.training builds them for
    ``--optimizer dist_muon``. Reset and paths: ``harness.model.LayerwiseModel``'s."""

    def __init__(self, mc, spec, overlap: bool):
        # bucket_size None: DDP's own default, max(40M, 1M x DP), one bucket after PP stage 0.
        ddp_config = model.ddp_config(overlap, spec.bucket_size, spec.grad_reduce_in_fp32, **spec.ddp_extra)
        chunks = []
        for vp_stage in range(spec.vpp) if spec.vpp > 1 else [None]:
            self.config, module, self.vocab = build_module(mc, spec, vp_stage)
            chunks.append(mc.DDP(self.config, ddp_config, module, disable_bucketing=bool(vp_stage)))
        self.chunks = chunks
        self.ddp = chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
        self.opt = model.layerwise_optimizer(chunks, overlap, lr=0.01)
        self.layerwise = self.opt
        self._finish_init()

    def sync_fn(self, path: str):
        """Zero-argument callable running one sync of ``path`` (module docstring)."""
        if path == "async":  # each chunk's pre-hooks over its modules, chunks in order
            hooks = [(c._make_forward_pre_hook(), list(c.module.modules())) for c in self.chunks]

            def run():
                for hook, modules in hooks:
                    for m in modules:
                        hook(m)

            return run
        return super().sync_fn(path)

    def owners(self, expert: bool):
        """Per DP rank (dense) or expert-DP rank, the params the layer-wise optimizer gave
        it (``shard_params``); None where that group is not sharded (size 1)."""
        return self.layerwise.expt_dp_params_list if expert else self.layerwise.dp_cp_params_list


class LayoutSetup(LegacySetup):
    """0.18.2's default layer-wise param layout, wired as megatron.training does:
    ``tag_params_for_buffer_routing``, ``LayerWiseDistributedOptimizer.
    compute_full_param_layout`` with training's bucket size (``get_model``: default, None
    after the first pipeline stage), DDP with ``use_distributed_optimizer=True`` and
    ``full_param_layout``, then ``get_megatron_optimizer`` (LayerWise for Muon matrices,
    chained with a DistributedOptimizer for the rest)."""

    def __init__(self, mc, spec, overlap: bool):
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer.layer_wise_optimizer import (
            LayerWiseDistributedOptimizer,
            tag_params_for_buffer_routing,
        )

        if spec.vpp > 1:
            raise NotImplementedError("VPP on the layout path is not audited (one param layout per chunk)")
        ps = mc.ps
        self.config, module, self.vocab = build_module(mc, spec)
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        ddp_bucket = spec.bucket_size or grid.default_bucket_size(dp)
        bucket_size = None if ps.get_pipeline_model_parallel_rank() > 0 else ddp_bucket
        ddp_config = mc.DDPConfig(grad_reduce_in_fp32=spec.grad_reduce_in_fp32, overlap_grad_reduce=True,
                                  overlap_param_gather=overlap, use_distributed_optimizer=True,
                                  bucket_size=ddp_bucket, **spec.ddp_extra)  # fmt: skip
        tag_params_for_buffer_routing([module])
        layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
            [p for p in module.parameters() if p.requires_grad], bucket_size, dp, ddp_config,
            expert_data_parallel_world_size=ps.get_expert_data_parallel_world_size(),
        )  # fmt: skip
        self.ddp = mc.DDP(self.config, ddp_config, module, full_param_layout=layout)
        self.chunks = [self.ddp]
        opt_config = mc.OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True, lr=0.01,
                                        bf16=True, params_dtype=PARAM_DTYPE, use_distributed_optimizer=True,
                                        overlap_param_gather=overlap)  # fmt: skip
        self.opt = get_megatron_optimizer(opt_config, [self.ddp], use_gloo_process_groups=False)
        chain = [self.opt] + list(getattr(self.opt, "chained_optimizers", []))
        self.layerwise = next(o for o in chain if isinstance(o, LayerWiseDistributedOptimizer))
        self._subset_syncs = [o for o in dict.fromkeys(chain) if hasattr(o, "start_param_sync_for_bucket_group_subset")]
        self._finish_init()

    def sync_fn(self, path: str):
        if path == "optimizer":

            def run():
                for o in self._subset_syncs:
                    o.start_param_sync_for_bucket_group_subset()

            return run
        return super().sync_fn(path)


# ---------------------------------------------------------------- the flag path
class FlagsError(Exception):
    """The pretrain_gpt.py flags describe no model this tree builds: megatron's own message
    (its argument parser, ``validate_args``, ``TransformerConfig`` or the model's layers), or
    one of the audit's limits (``FlagsSpec``)."""


#: Kernel fusions whose config checks need CUDA or Transformer Engine and that change no
#: parameter: the flag path turns them off before ``core_transformer_config_from_args``.
NO_KERNEL_FUSIONS = ("apply_rope_fusion", "bias_swiglu_fusion", "bias_gelu_fusion", "masked_softmax_fusion",
                     "gradient_accumulation_fusion", "bias_dropout_fusion", "persist_layer_norm",
                     "cross_entropy_loss_fusion")  # fmt: skip
#: The same on the config (``build_module`` sets them so for the built-in models).
CONFIG_KERNEL_FUSIONS = ("persist_layer_norm", "bias_dropout_fusion", "bias_activation_fusion", "apply_rope_fusion",
                         "masked_softmax_fusion", "gradient_accumulation_fusion")  # fmt: skip
#: Megatron-LM checkout whose gpt_builders.py builds the model, per megatron-core (MAJOR, MINOR)
#: of the tree (scripts/setup.sh builds them; the series touches neither file).
CHECKOUTS = {(0, 17): "core_v0.17.1", (0, 18): "core_v0.18.2", (0, 19): "core_v0.19.0"}


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _megatron_message(exc: BaseException) -> str:
    """``exc``'s message; for a bare ``assert`` (no message), the failing line of megatron's
    source, e.g. "assert not args.bf16 (megatron/training/arguments.py:984)"."""
    text = str(exc).strip()
    if text:
        return text
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/" in f.filename]
    if not frames:
        return type(exc).__name__
    f = frames[-1]
    where = f.filename[f.filename.rindex("/megatron/") + 1 :]
    return f"{(f.line or '').strip()} ({where}:{f.lineno})"


#: The GPU architecture (major compute capability) validate_args is told, through megatron's
#: ``get_device_arch_version`` and ``torch.cuda.get_device_capability``. It asks only to decide
#: whether TP or CP > 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment (before 10),
#: which streams get high priority, and whether --moe-grouped-gemm has its kernels (8 and
#: later): nothing that changes a parameter or a collective.
DEVICE_ARCH = 10


def parse_flags(flags, world_size=None, dp=None, validate: bool = True):
    """megatron's ``parse_args`` and ``validate_args`` (``megatron.training.arguments``) on
    ``flags`` as ``pretrain_gpt.py`` gets them, at ``world_size`` ranks, or at the world that
    gives data-parallel size ``dp`` (TP x PP x CP x ``dp``, as ``validate_args`` derives DP
    from the world size); ``validate=False``: ``parse_args`` only. Megatron's printout is
    swallowed; its GPU architecture queries answer ``DEVICE_ARCH``.

    Returns:
        the validated ``argparse.Namespace`` (``data_parallel_size`` set by megatron).

    Raises:
        FlagsError: argparse's error line (unknown flag, bad value) or the message of what
            ``validate_args`` raised (contradictory flags, a world not divisible by TP x PP x CP).
    """
    import contextlib
    import io

    from megatron.training import arguments

    def parse():
        argv, sys.argv = sys.argv, ["pretrain_gpt.py", *flags]
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                return arguments.parse_args()
        except SystemExit:
            raise FlagsError(_last_line(err.getvalue()) or "megatron's argument parser refused the flags") from None
        finally:
            sys.argv = argv

    args = parse()
    if not validate:
        return args
    if dp is not None:
        world_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size * dp
    args.world_size, args.rank = world_size, 0
    arch, arguments.get_device_arch_version = arguments.get_device_arch_version, lambda: DEVICE_ARCH
    capability, torch.cuda.get_device_capability = torch.cuda.get_device_capability, lambda *a: (DEVICE_ARCH, 0)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args)
    except (AssertionError, ValueError, TypeError, RuntimeError, KeyError) as exc:
        raise FlagsError(f"megatron's validate_args: {_megatron_message(exc)}") from None
    finally:
        arguments.get_device_arch_version = arch
        torch.cuda.get_device_capability = capability
    return args


class FlagsSpec:
    """A model described by ``pretrain_gpt.py`` flags, in the shape of ``grid.ModelSpec``
    (``tp``, ``pp``, ``ep``, ``etp``, ``vpp``, ``pp_stage``, ``bucket_size``,
    ``grad_reduce_in_fp32``, ``ddp_extra``, ``world_size(dp)``), built by megatron's own code:

    * the config: ``megatron.training.arguments.core_transformer_config_from_args`` of the
      tree, after ``parse_flags``; then only what the audit's meta tensors need and changes no
      parameter (``use_cpu_initialization``, no init, the kernel fusions ``NO_KERNEL_FUSIONS``
      off, ``sequence_parallel`` off: it changes no shape, and the local spec's norms refuse it);
    * the model: ``gpt_builder`` of the tree's Megatron-LM checkout (``CHECKOUTS``), what
      ``pretrain_gpt.py``'s model provider calls: the layer spec the flags choose
      (``--transformer-impl``, ``--num-experts``, ``--moe-grouped-gemm``, ``--spec``, ...),
      ``--untie-embeddings-and-output-weights``, ``--position-embedding-type``, MTP layers;
      ``--transformer-impl transformer_engine`` without Transformer Engine installed runs on
      ``harness.audit.te_standin`` (TE's parameters, megatron's TE wrappers and spec;
      ``layer_spec_for``);
    * the vocabulary: ``--vocab-size`` padded by megatron (``vocab_size_with_padding``:
      ``--make-vocab-size-divisible-by`` x TP); ``--tokenizer-type NullTokenizer`` through
      megatron's tokenizer (it adds the EOD token);
    * DDP: ``--accumulate-allreduce-grads-in-fp32``, ``--ddp-bucket-size`` and
      ``--ddp-pad-buckets-for-high-nccl-busbw`` as ``megatron.training.training.get_model``
      passes them; ``--overlap-grad-reduce`` is on in every cell (``--overlap-param-gather``
      needs it; the optimizer path runs with it too). ``--optimizer`` is not read: every cell
      runs the tree's layer-wise Muon optimizer.

    Raises (``__init__``, ``build_module``):
        FlagsError: as ``parse_flags``; no ``--bf16`` (the audit counts bf16 params); CP > 1 or
            ``--ddp-num-buckets`` (not modelled); no ``--vocab-size`` for a tokenizer read from
            files; megatron refuses the model (e.g. a size not divisible by TP).
    """

    def __init__(self, label: str, flags, dp: int = None, world_size: int = None, pp_stage: int = 0):
        from megatron.training import arguments

        self.label, self.flags, self.pp_stage = label, list(flags), pp_stage
        self.args = args = parse_flags(self.flags, world_size=world_size, dp=dp)
        self.dp = args.data_parallel_size
        if args.context_parallel_size != 1:
            raise FlagsError("--context-parallel-size > 1: the audit models CP 1 only")
        if not args.bf16:
            raise FlagsError("the audit counts bf16 params: add --bf16")
        self.tp, self.pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        self.ep = args.expert_model_parallel_size
        self.etp = args.expert_tensor_parallel_size
        self.vpp = args.virtual_pipeline_model_parallel_size or 1
        if not 0 <= pp_stage < self.pp:
            raise FlagsError(f"--pp-stage {pp_stage}: the flags give pipeline stages 0..{self.pp - 1}")
        self.grad_reduce_in_fp32 = bool(args.accumulate_allreduce_grads_in_fp32)
        if getattr(args, "ddp_num_buckets", None) is not None:
            raise FlagsError("--ddp-num-buckets is not modelled: give --ddp-bucket-size (elements) instead")
        self.bucket_size = args.ddp_bucket_size
        self.ddp_extra = dict(pad_buckets_for_high_nccl_busbw=bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
        for name in NO_KERNEL_FUSIONS:
            if hasattr(args, name):
                setattr(args, name, False)
        try:
            self.config = arguments.core_transformer_config_from_args(args)
        except (AssertionError, ValueError, TypeError, RuntimeError) as exc:
            raise FlagsError(f"megatron's TransformerConfig: {_megatron_message(exc)}") from None
        self.config.use_cpu_initialization = True
        self.config.perform_initialization = False
        self.config.sequence_parallel = False
        for name in CONFIG_KERNEL_FUSIONS:
            if hasattr(self.config, name):
                setattr(self.config, name, False)
        self.padded_vocab = self._padded_vocab()
        self.transformer_impl = getattr(args, "transformer_impl", "local")
        self.layer_spec = "local" if self.transformer_impl == "local" else self.transformer_impl

    def world_size(self, dp: int) -> int:
        return self.tp * self.pp * dp

    def _padded_vocab(self) -> int:
        args = self.args
        if getattr(args, "tokenizer_type", None) == "NullTokenizer":
            from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

            build_tokenizer(args)  # sets args.padded_vocab_size: --vocab-size + 1 (EOD), padded
            return args.padded_vocab_size
        if args.vocab_size is None:
            raise FlagsError("the audit reads no tokenizer files: add --vocab-size N, your tokenizer's "
                             "vocabulary before padding (Llama-3: 128256)")  # fmt: skip
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

        args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args)
        return args.padded_vocab_size

    def builder(self):
        """``gpt_builders.gpt_builder`` of the tree's checkout (imported once per process).

        Raises:
            FlagsError: no checkout for this megatron-core release (run scripts/setup.sh)."""
        from megatron.core import package_info

        key = (int(package_info.MAJOR), int(package_info.MINOR))
        checkout = Path(__file__).resolve().parents[2] / "build" / "megatron-lm" / CHECKOUTS.get(key, "?")
        if not (checkout / "gpt_builders.py").is_file():
            raise FlagsError(f"no Megatron-LM checkout for megatron-core {key[0]}.{key[1]} at {checkout}: run scripts/setup.sh")
        if str(checkout) not in sys.path:
            sys.path.append(str(checkout))  # after the tree: megatron itself still comes from it
        import gpt_builders

        return gpt_builders.gpt_builder

    def build_module(self, mc, vp_stage=None):
        """This stage's GPTModel (chunk ``vp_stage`` with VPP) from ``gpt_builder``;
        (config, module in bf16, padded vocab)."""
        args = self.args
        builder = self.builder()
        pre = mc.ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = mc.ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        try:
            module = builder(args, pre, post, vp_stage=vp_stage, config=self.config)
        except (AssertionError, ValueError, TypeError, RuntimeError, ZeroDivisionError, ImportError) as exc:
            raise FlagsError(f"megatron cannot build the model: {type(exc).__name__}: {_megatron_message(exc)}") from None
        return self.config, module.to(dtype=PARAM_DTYPE), self.padded_vocab

    def describe(self) -> dict:
        """What a record says about the flags' model (the report's per-model line)."""
        a = self.args
        return dict(flags=self.flags, layer_spec=self.layer_spec, num_layers=a.num_layers,
                    hidden_size=a.hidden_size, num_experts=a.num_experts, etp=self.etp,
                    grad_reduce_in_fp32=self.grad_reduce_in_fp32, optimizer=a.optimizer,
                    overlap_param_gather=bool(a.overlap_param_gather),
                    layer_wise_param_layout=getattr(a, "use_layer_wise_param_layout", None))  # fmt: skip


#: What auditing the local spec in place of TE's changes (the report prints it with the fallback).
LOCAL_FOR_TE = ("the local spec registers a separate input_layernorm / pre_mlp_layernorm before each "
                "linear instead of TE's fused layer_norm_weight inside linear_qkv / linear_fc1, so DDP's "
                "bucket order and the optimizer's ping-pong deal differ from a TE run (Llama-3-8B TP 1 at "
                "DP 8: 629 zero-size operations on pristine 0.17.1 against 630, 2.94 GiB zeroed by the "
                "series against 2.61 GiB); parameter count and bytes are the same")  # fmt: skip


def layer_spec_for(flags) -> tuple:
    """Prepare the layer spec the flags choose: with ``--transformer-impl transformer_engine``
    (megatron's default) and Transformer Engine not installed, install
    ``harness.audit.te_standin`` (TE's parameters under megatron's own TE wrappers and spec).

    Returns:
        (the spec as reports name it, flags to append): ("local", ()), ("transformer_engine",
        ()) with TE installed, ("transformer_engine (stand-in: ...)", ()), or, where the
        stand-in cannot serve this megatron release, ("local in place of transformer_engine
        (...why, and what that changes)", ("--transformer-impl", "local")).
    Raises:
        FlagsError: as ``parse_flags``.
    """
    from harness.audit import te_standin

    impl = parse_flags(flags, validate=False).transformer_impl
    if impl != "transformer_engine":
        return impl, ()
    if te_standin.te_installed():
        return "transformer_engine", ()
    try:
        te_standin.install()
    except (ImportError, AttributeError, TypeError, RuntimeError) as exc:
        why = f"Transformer Engine is not installed and its stand-in failed ({type(exc).__name__}: {exc})"
        return f"local in place of transformer_engine: {why}; {LOCAL_FOR_TE}", ("--transformer-impl", "local")
    return f"transformer_engine (stand-in: TE {te_standin.TE_VERSION}'s parameters; TE not installed)", ()


# ---------------------------------------------------------------- what one cell reports
def buckets_of(s, detail: bool = False) -> list:
    """Per bucket (every bucket group, dense first): numel, params, kind and the per-rank
    shares (elements of the bucket's params each rank owns) from the optimizer; with
    ``detail``, also the param names of the bucket and of each rank's share in it."""
    names = {p: n for n, p in s.ddp.module.named_parameters()}
    out = []
    expert_ids = {id(g) for g in s.ddp.expert_parallel_bucket_groups}
    for g in s.groups:
        expert = id(g) in expert_ids
        owners = s.owners(expert)
        for b in g.buckets:
            in_bucket = set(b.params)
            managed = getattr(b.params_list[0], "is_managed_by_layer_wise_optimizer", True) if b.params_list else True
            if owners is None:
                shares = None
            elif managed:
                shares = [sum(p.numel() for p in own if p in in_bucket) for own in owners]
            else:  # a DistributedOptimizer bucket of the layout path: DP equal byte ranges
                world = g.intra_distributed_optimizer_instance_size
                shares = [b.grad_data.numel() // world] * world
            numel_params = sum(p.numel() for p in b.params)
            out.append(dict(
                expert=expert,
                layerwise=bool(managed),
                numel=b.grad_data.numel(),
                param_numel=numel_params,
                params=len(b.params),
                max_param_numel=max((p.numel() for p in b.params), default=0),
                shares=shares,
            ))  # fmt: skip
            if detail:
                out[-1]["param_names"] = sorted(names[p] for p in b.params)
                out[-1]["share_names"] = None if owners is None or not managed else [
                    sorted(names[p] for p in own if p in in_bucket) for own in owners]  # fmt: skip
    return out


def padding_of(s) -> dict:
    """Persistent padding of DDP's buffers on this rank: elements of grad_data (and
    param_data, which the layout path allocates) that hold no param, and their bytes."""
    elems = grad_bytes = param_bytes = total_bytes = 0
    for buf in s.ddp.buffers + s.ddp.expert_parallel_buffers:
        pad = buf.grad_data.numel() - sum(p.numel() for p in buf.params)
        elems += pad
        grad_bytes += pad * buf.grad_data.element_size()
        total_bytes += buf.grad_data.numel() * buf.grad_data.element_size()
        if getattr(buf, "param_data", None) is not None:
            param_bytes += pad * buf.param_data.element_size()
            total_bytes += buf.param_data.numel() * buf.param_data.element_size()
    return dict(padding_elements=elems, padding_bytes=grad_bytes + param_bytes,
                padding_grad_bytes=grad_bytes, padding_param_bytes=param_bytes,
                buffer_bytes=total_bytes)  # fmt: skip


def grad_storage_keys(s) -> set:
    return {storage_key(b.grad_data) for b in s.ddp.buffers + s.ddp.expert_parallel_buffers}


def count_path(s, path: str) -> dict:
    """One counted sync of ``path`` after a warm-up (lazily built slot views and caches
    are no per-sync cost); the state a step starts from before each."""
    run = s.sync_fn(path)
    s.reset()
    run()
    s.reset()
    with collectives.record_collectives() as calls, SyncCounter(grad_storages=grad_storage_keys(s)) as c:
        run()
    s.reset()
    rec = dict(collectives.summarize(calls))
    rec.update(
        forms=dict(collections.Counter(r.form for r in calls)),
        megatron_temporary_bytes=c.temporary_bytes,
        megatron_peak_bytes=c.peak_extra_bytes,
        megatron_alloc_calls=c.alloc_calls,
        megatron_alloc_ops=sorted({name for name, _ in c.events}),
        nccl_peak_bytes=c.nccl_peak_bytes,
        zeroed_grad_bytes=c.zeroed_grad_bytes,
        zeroed_other_bytes=c.zeroed_other_bytes,
        zero_calls=c.zero_calls,
        calls_by_group_size=dict(collections.Counter(str(r.world) for r in calls)),
    )
    return rec


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}


def global_rank(spec, dp: int, dp_rank: int) -> int:
    """Global rank of (TP rank 0, the audited PP stage, DP rank ``dp_rank``) in megatron's
    default order tp-cp-ep-dp-pp (``parallel_state.initialize_model_parallel``, order
    argument); checked against parallel_state after initialisation."""
    return spec.tp * (dp_rank + dp * spec.pp_stage)


class LayoutLog(logging.Handler):
    """Collects megatron's "Layerwise param layout: ... total_padding=N ... overhead=X%"
    lines (``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``, logged on
    global rank 0 only) as ``{"total_padding": N, "overhead_percent": X, "line": ...}``."""

    LOGGER = "megatron.core.optimizer.layer_wise_optimizer"
    PATTERN = re.compile(r"total_padding=(\d+).*overhead=([0-9.]+)%")

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        m = self.PATTERN.search(msg)
        if "Layerwise param layout" in msg and m:
            self.lines.append(dict(total_padding=int(m.group(1)), overhead_percent=float(m.group(2)), line=msg))

    def __enter__(self):
        log = logging.getLogger(self.LOGGER)
        self._level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *exc):
        log = logging.getLogger(self.LOGGER)
        log.removeHandler(self)
        log.setLevel(self._level)
        return False


def run_cell(mc, tree: grid.TreeSpec, spec, dp: int, dp_rank: int, paths, detail: bool = False) -> dict:
    """Every path of one cell on one DP rank; see the module docstring."""
    t0 = time.perf_counter()
    world = spec.world_size(dp)
    rec = dict(tree=tree.label, model=spec.label, dp=dp, dp_rank=dp_rank, world=world,
               tp=spec.tp, pp=spec.pp, ep=spec.ep, vpp=spec.vpp, pp_stage=spec.pp_stage)  # fmt: skip
    dist.init_process_group(FAKE_BACKEND, store=_fake_store(), rank=global_rank(spec, dp, dp_rank),
                            world_size=world)  # fmt: skip
    try:
        mc.ps.initialize_model_parallel(spec.tp, spec.pp, spec.vpp if spec.vpp > 1 else None,
                                        expert_model_parallel_size=spec.ep,
                                        expert_tensor_parallel_size=spec.etp,
                                        create_gloo_process_groups=False)  # fmt: skip
        got = (mc.ps.get_tensor_model_parallel_rank(), mc.ps.get_pipeline_model_parallel_rank(),
               mc.ps.get_data_parallel_rank(), mc.ps.get_data_parallel_world_size())  # fmt: skip
        if got != (0, spec.pp_stage, dp_rank, dp):
            raise RuntimeError(f"rank placement: (tp, pp, dp rank, dp) = {got}, wanted {(0, spec.pp_stage, dp_rank, dp)}")
        rec.update(expert_dp=mc.ps.get_expert_data_parallel_world_size(),
                   expert_dp_rank=mc.ps.get_expert_data_parallel_rank(),
                   init_s=round(time.perf_counter() - t0, 3))  # fmt: skip
        cls = LayoutSetup if tree.layout else LegacySetup
        rec["paths"] = {}
        for overlap in (True, False):
            mine = [p for p in paths if (p != "optimizer") == overlap]
            if not mine:
                continue
            try:
                with MetaDeviceMode(), LayoutLog() as layout_log:
                    s = cls(mc, spec, overlap)
            except FlagsError as exc:  # the flags' model: bad input, not the tree's crash
                rec["flags_error"] = str(exc)
                rec.pop("paths")
                break
            except Exception as exc:  # noqa: BLE001 - a tree's crash is data
                for p in mine:
                    rec["paths"][p] = _error(exc)
                continue
            if "buckets" not in rec:
                rec.update(buckets=buckets_of(s, detail), padded_vocab_size=s.vocab,
                           megatron_layout_log=layout_log.lines,
                           num_bucket_groups=len(s.groups),
                           param_numel=sum(p.numel() for p in s.params),
                           param_bytes=sum(p.numel() * p.element_size() for p in s.params),
                           **padding_of(s))  # fmt: skip
            with MetaDeviceMode():
                for p in mine:
                    try:
                        rec["paths"][p] = count_path(s, p)
                    except Exception as exc:  # noqa: BLE001
                        rec["paths"][p] = _error(exc)
            del s
    except Exception as exc:  # noqa: BLE001
        rec.update(_error(exc))
    finally:
        try:
            mc.ps.destroy_model_parallel()
        finally:
            dist.destroy_process_group()
    rec["wall_s"] = round(time.perf_counter() - t0, 3)
    return rec


def _fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _member_groups_only() -> None:
    """``torch.distributed.new_group`` returns NON_GROUP_MEMBER at once for a group that
    does not hold this rank, as it would after its bookkeeping: in a fake world no other
    rank exists to agree with, and megatron's ``initialize_model_parallel`` creates every
    group of the world (at TP 8 x PP 8 x DP 1024 that halves its 10 to 25 s)."""
    real = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        if ranks is not None and dist.get_rank() not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        return real(ranks, *args, **kwargs)

    dist.new_group = new_group


def parse_cells(text: str) -> list:
    """``model:dp,...`` -> [(ModelSpec, dp)].

    Raises:
        ValueError: an unknown model.
    """
    cells = []
    for item in filter(None, text.split(",")):
        name, dp = item.split(":")
        if name not in grid.ALL_MODELS:
            raise ValueError(f"unknown model {name!r}; known: {sorted(grid.ALL_MODELS)}")
        cells.append((grid.ALL_MODELS[name], int(dp)))
    return cells


def theoretical_memory(args) -> dict:
    """megatron's own estimate of a training step's peak memory per rank for the parsed flags
    ``args`` (``parse_flags``): the tree's ``megatron.training.theoretical_memory_usage.
    report_theoretical_memory``, called as ``megatron.training.training.training_log`` calls it
    after the first iteration, with ``num_microbatches`` = global batch / (micro batch x DP),
    what megatron's microbatch calculator gives without batch-size ramp-up. It runs on a shallow
    copy of ``args`` (it sets ``num_query_groups``); its printout is swallowed. MB = 2^20 bytes,
    per rank, the most loaded pipeline stage.

    Returns:
        {"weight_and_optimizer_mb", "activation_mb", "total_mb", "num_microbatches"}, or
        {"error": message} where megatron's function raises or declines (hybrid models).
    """
    import contextlib
    import copy
    import io

    try:
        from megatron.training.theoretical_memory_usage import report_theoretical_memory

        a = copy.copy(args)
        micro = a.global_batch_size // (a.micro_batch_size * a.data_parallel_size)
        with contextlib.redirect_stdout(io.StringIO()) as said:
            got = report_theoretical_memory(a, num_microbatches=micro, verbose=False)
    except Exception as exc:  # noqa: BLE001 - an estimate megatron cannot make is reported, not fatal
        return {"error": f"{type(exc).__name__}: {_megatron_message(exc)}"}
    if got is None:
        return {"error": _last_line(said.getvalue()) or "report_theoretical_memory returned nothing"}
    weights, activations, total = (round(float(x), 2) for x in got)
    return dict(weight_and_optimizer_mb=weights, activation_mb=activations, total_mb=total, num_microbatches=micro)


def builtin_theoretical_memory(spec, dp: int) -> dict:
    """``theoretical_memory`` of a built-in model (``grid.MODEL_FLAGS``, the flags that
    describe it) at DP ``dp``, parsed and validated by the tree's own ``megatron.training``
    (``FlagsSpec``: it also pads the vocabulary, as megatron's tokenizer set-up does);
    {"error": ...} for a model with no flags or flags the tree refuses."""
    flags = grid.MODEL_FLAGS.get(spec.label)
    if flags is None:
        return {"error": f"{spec.label}: no pretrain_gpt.py flags (grid.MODEL_FLAGS)"}
    try:
        args = FlagsSpec(spec.label, flags, dp=dp, pp_stage=spec.pp_stage).args  # sets padded_vocab_size
    except FlagsError as exc:
        return {"error": str(exc)}
    return theoretical_memory(args)


def run_flags(mc, tree: grid.TreeSpec, job: dict, paths) -> list:
    """The cells of the flags' model (``job``: see ``--flags``) on ``tree``, DP rank 0 each:
    per DP size (or world size) a ``run_cell`` record with ``size`` (["dp" | "world", n], as
    requested), ``flags`` (``FlagsSpec.describe``) and ``layer_spec``, or ``{"tree", "model",
    "size", "flags_error": message}`` where megatron refuses the flags."""
    label, flags = job["label"], job["flags"]
    sizes = [("dp", n) for n in job.get("dp_sizes") or []] + [("world", n) for n in job.get("world_sizes") or []]
    base = dict(tree=tree.label, model=label)
    try:
        layer_spec, more = layer_spec_for(flags)
    except FlagsError as exc:
        return [dict(base, size=[kind, n], flags_error=str(exc)) for kind, n in sizes]
    if more:
        print(f"[audit worker] {tree.label}: layer spec {layer_spec}", flush=True)
    flags = [*flags, *more]
    records = []
    for kind, n in sizes:
        t0 = time.perf_counter()
        try:
            spec = FlagsSpec(label, flags, pp_stage=job.get("pp_stage", 0), **{("dp" if kind == "dp" else "world_size"): n})
        except FlagsError as exc:
            records.append(dict(base, size=[kind, n], flags_error=str(exc)))
            continue
        theory = theoretical_memory(spec.args)
        rec = run_cell(mc, tree, spec, spec.dp, 0, paths)
        rec.update(size=[kind, n], flags=spec.describe(), layer_spec=layer_spec, theoretical_memory=theory)
        records.append(rec)
        print(f"[audit worker] {tree.label} {label} dp={spec.dp} {time.perf_counter() - t0:.1f} s"
              + (f" FLAGS {rec['flags_error'][:200]}" if "flags_error" in rec else "")
              + (f" ERROR {rec['error'][:200]}" if "error" in rec else ""), flush=True)  # fmt: skip
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", required=True, choices=sorted(grid.TREES))
    ap.add_argument("--cells", default="", help="model:dp,... (harness/audit/grid.py MODELS; DP rank 0)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", required=True, help="JSON list of cell records")
    ap.add_argument("--bucket-detail", action="store_true",
                    help="also the param names of every bucket and per-rank share (small models)")
    ap.add_argument("--flags", help='JSON file {"label", "flags": [pretrain_gpt.py flags], "dp_sizes" or '
                    '"world_sizes", "pp_stage"}: audit that model (FlagsSpec) instead of --cells')
    ap.add_argument("--theory-only", action="store_true",
                    help="with --cells: only megatron's theoretical step memory per cell (theoretical_memory), "
                    "no sync run")
    args = ap.parse_args(argv)
    tree_dir = check_expected_tree()
    tree = grid.TREES[args.tree]
    torch.set_num_threads(1)
    model.fake_all_gather_object()
    _member_groups_only()
    mc = _mc()
    if args.flags:
        records = run_flags(mc, tree, json.loads(Path(args.flags).read_text()), args.paths.split(","))
    else:
        records = []
        for spec, dp in parse_cells(args.cells):
            if args.theory_only:  # no sync run
                rec = dict(tree=tree.label, model=spec.label, dp=dp, dp_rank=0)
            else:
                rec = run_cell(mc, tree, spec, dp, 0, args.paths.split(","), args.bucket_detail)
            rec["theoretical_memory"] = builtin_theoretical_memory(spec, dp)
            records.append(rec)
            if "wall_s" in rec:
                print(f"[audit worker] {tree.label} {spec.label} dp={dp} {rec['wall_s']:.1f} s"
                      + (f" ERROR {rec['error'][:200]}" if "error" in rec else ""), flush=True)  # fmt: skip
    for rec in records:
        rec["tree_dir"] = tree_dir
    Path(args.out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
