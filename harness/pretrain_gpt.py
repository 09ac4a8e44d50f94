"""GPT pretraining entry point: megatron.training.pretrain with our providers.

Plays the role of Megatron-LM's ``pretrain_gpt.py`` (written here, not copied), so that the
harness trains through the code path users run: ``megatron.training.pretrain`` ->
``train`` -> ``train_step`` (``zero_grad_buffer``, forward pre-hooks, ``finish_param_sync``,
``finish_grad_sync``, ``optimizer.step``, forced syncs at eval and checkpoint).

Run (all Megatron flags pass through unchanged) through the one torchrun builder::

    python -m harness.launch --tree patched --nproc 2 pretrain --tiny-gpt 50      # gloo on CPU
    python -m harness.launch --device cuda --nproc 8 pretrain -- <megatron flags>  # NCCL
    python -m harness.launch --dry-run ... pretrain ...                           # print it

``harness/launch.py`` (``pretrain_command``) builds these command lines for the pristine or
patched tree: the script runs by path, not with ``-m``, which would put the repo root (the
patched megatron/) ahead of the tree PYTHONPATH selects.

Environment:
    MEGATRON_CPU_RUNTIME: ``1`` installs ``harness.cpu_runtime`` before megatron is imported
        (CPU ranks with gloo); ``force`` also on a GPU machine. Unset: plain CUDA.
    MEGATRON_SHARED_GPU: ``1`` lets several gloo ranks share one GPU
        (``harness.gpu_check.shared_gpu``: ``LOCAL_RANK`` modulo the GPU count, uneven gloo
        ``all_gather``).
    MEGATRON_EXPECT_TREE: a directory; start-up fails (RuntimeError) unless ``megatron.core``
        was imported from under it. Every rank logs the tree it imported.

Providers (contracts from megatron 0.17.1):
    ``model_provider``: called by ``training.py:get_model`` with ``pre_process``,
        ``post_process``, ``vp_stage``, ``config``, ``pg_collection``; returns a ``GPTModel``.
        Layer spec: Transformer Engine's when ``--transformer-impl transformer_engine``, TE
        imports and the CPU runtime is off; else the local (megatron-core only) spec.
    ``forward_step(data_iterator, model)``: returns ``(output_tensor, loss_func)``; the
        schedule (``pipeline_parallel/schedules.py:forward_step_calc_loss``) calls
        ``loss_func(output_tensor)``, which returns ``(loss_sum, num_tokens, {'lm loss':
        [loss_sum, num_tokens]})``. The schedule divides ``loss_sum`` by ``num_tokens`` (and
        the number of micro-batches) for backward, and ``training.py:train_step`` all-reduces
        the two-element report over DP and logs ``sum / tokens``: a masked token mean.
    ``train_valid_test_datasets_provider(num_samples)``: ``BlendedMegatronDatasetBuilder``
        with ``GPTDataset`` (``--data-path``/per-split paths: ``.bin``/``.idx`` and index
        caching) or ``MockGPTDataset`` (``--mock-data``); distributed-aware
        (``is_distributed = True``), built on TP rank 0 of first/last pipeline stages.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# The CPU runtime must patch torch before megatron is imported (megatron binds
# torch.compile, torch.cuda RNG helpers, ... at import time), hence the import order here.
from harness import cpu_runtime

cpu_runtime.install_if_requested()

from harness.gpu_check import shared_gpu  # noqa: E402
from harness.ranks import end_training_rank  # noqa: E402

shared_gpu.install_if_requested()  # MEGATRON_SHARED_GPU=1: gloo ranks sharing one GPU

import torch  # noqa: E402

_RANK = int(os.environ.get("RANK", "0"))


def check_megatron_tree() -> Path:
    """Import ``megatron.core``, log where from, and enforce ``$MEGATRON_EXPECT_TREE``.

    Returns:
        The resolved directory of the imported ``megatron/core`` package.

    Raises:
        RuntimeError: ``MEGATRON_EXPECT_TREE`` is set and ``megatron.core`` is not under it
            (e.g. PYTHONPATH picked the patched tree for an upstream run).
    """
    import megatron.core

    core_dir = Path(megatron.core.__file__).resolve().parent
    expect = os.environ.get("MEGATRON_EXPECT_TREE")
    print(
        f"[pretrain_gpt] rank {_RANK}: megatron.core from {core_dir}"
        f" (expected under: {expect or 'unchecked'}; cpu runtime: "
        f"{'on' if cpu_runtime.is_installed() else 'off'})",
        flush=True,
    )
    if expect:
        want = Path(expect).resolve()
        if want != core_dir and want not in core_dir.parents:
            raise RuntimeError(
                f"rank {_RANK}: imported megatron.core from {core_dir}, but MEGATRON_EXPECT_TREE="
                f"{want}. PYTHONPATH selects the tree (harness/launch.py builds it); refusing to "
                "train on the wrong one."
            )
    return core_dir


check_megatron_tree()

from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model  # noqa: E402
from megatron.training.utils import (  # noqa: E402
    get_batch_on_this_tp_rank,
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)


# ----------------------------------------------------------------------------- model
def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(args: Any) -> ModuleSpec:
    """The transformer layer spec for ``args``.

    Transformer Engine's spec when ``args.transformer_impl == 'transformer_engine'``, TE imports
    and the CPU runtime is off; otherwise the local spec (``--transformer-impl local``, or TE
    requested but unusable: logged on rank 0). Both from
    ``megatron/core/models/gpt/gpt_layer_specs.py``.
    """
    wants_te = args.transformer_impl == "transformer_engine"
    if wants_te and _transformer_engine_importable() and not cpu_runtime.is_installed():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts,
            moe_grouped_gemm=args.moe_grouped_gemm,
            qk_layernorm=args.qk_layernorm,
            multi_latent_attention=args.multi_latent_attention,
            qk_l2_norm=args.qk_l2_norm,
        )
    if wants_te:
        print_rank_0(
            "[pretrain_gpt] WARNING: --transformer-impl transformer_engine but TE is not usable "
            f"(importable: {_transformer_engine_importable()}, cpu runtime: "
            f"{cpu_runtime.is_installed()}); using the local layer spec"
        )
    return get_gpt_layer_local_spec(
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        normalization=args.normalization,
        qk_l2_norm=args.qk_l2_norm,
    )


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config: Any = None,
    pg_collection: Any = None,
) -> GPTModel:
    """Build the GPT model of this pipeline stage (called by ``training.py:get_model``).

    Args:
        pre_process: this stage holds the embedding (first pipeline stage).
        post_process: this stage holds the output layer and loss (last stage).
        vp_stage: virtual pipeline stage index, or None.
        config: a ``TransformerConfig``; None derives it from the parsed args.
        pg_collection: process groups; None lets megatron use the global ones.

    Returns:
        An unwrapped ``GPTModel`` (fp32, on CPU with ``--use-cpu-initialization``); megatron
        wraps it in ``Float16Module`` and DDP.
    """
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    print_rank_0(f"[pretrain_gpt] building GPTModel ({args.transformer_impl} layer spec)")
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


# ----------------------------------------------------------------------------- step and loss
def get_batch(data_iterator: Any, vp_stage: Optional[int] = None) -> Dict[str, Optional[torch.Tensor]]:
    """One micro-batch for this rank: ``training/utils.py:get_batch_on_this_tp_rank`` (TP rank
    0 reads, broadcasts to its TP group), then the context-parallel slice.

    Returns:
        Dict with ``tokens``/``labels``/``position_ids`` (int64 ``[micro_batch, seq]``),
        ``loss_mask`` (float32 ``[micro_batch, seq]``, 1 = counted), ``attention_mask`` (bool
        ``[micro_batch, 1, seq, seq]`` or None). Middle pipeline stages get all None.
    """
    if not is_first_or_last_pipeline_stage(vp_stage):
        return dict.fromkeys(("tokens", "labels", "loss_mask", "attention_mask", "position_ids"))
    batch = get_batch_on_this_tp_rank(data_iterator)
    return get_batch_on_this_cp_rank(batch)


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Masked LM loss in the 3-tuple form of megatron 0.17.1's schedules.

    Args:
        loss_mask: ``[micro_batch, seq]``, 1.0 where the token counts.
        output_tensor: per-token cross entropy from ``GPTModel.forward(labels=...)``,
            ``[micro_batch, seq]`` (fp32 or the model dtype).

    Returns:
        ``(loss_sum, num_tokens, {'lm loss': report})``: ``loss_sum`` fp32 scalar (sum of
        masked per-token losses, differentiable); ``num_tokens`` int scalar (mask sum);
        ``report`` = fp32 ``[loss_sum, num_tokens]`` (detached), which ``train_step``
        all-reduces over DP and divides: the logged 'lm loss' is a token mean.
    """
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Any, model: GPTModel) -> Tuple[torch.Tensor, Any]:
    """Forward one micro-batch; returns ``(per-token losses, partial(loss_func, loss_mask))``.

    Times batch loading as ``batch-generator`` (training.py's timers expect it).
    """
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    # The model chunk arrives wrapped (DDP, Float16Module); vp_stage lives on the GPTModel.
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    batch = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output_tensor, partial(loss_func, batch["loss_mask"])


# ----------------------------------------------------------------------------- data
def is_dataset_built_on_rank(vp_stage: Optional[int] = None) -> bool:
    """Datasets are built where batches are read: TP rank 0 of the first/last stage."""
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def gpt_dataset_config(args: Any) -> GPTDatasetConfig:
    """``GPTDatasetConfig`` from the parsed args (blend from ``--data-path`` and friends;
    none of them -> mock, which ``--mock-data`` asks for)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        data_parallel_size=args.data_parallel_size,
        context_parallel_size=args.context_parallel_size,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples: List[int], vp_stage: Optional[int] = None):
    """Build the train/valid/test datasets (called by ``training.py:build_train_valid_test_datasets``).

    Args:
        train_val_test_num_samples: samples needed per split, from the iteration counts.
        vp_stage: virtual pipeline stage (datasets are built on first/last stages only).

    Returns:
        ``[train, valid, test]``: ``GPTDataset``/``MockGPTDataset`` (or blended) objects, None
        on ranks that do not build them or for empty splits.
    """
    args = get_args()
    config = gpt_dataset_config(args)
    dataset_cls = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"[pretrain_gpt] building {dataset_cls.__name__} splits {train_val_test_num_samples}")
    return BlendedMegatronDatasetBuilder(
        dataset_cls, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage), config
    ).build()


# The builder is distributed-aware: training.py calls the provider on every rank.
train_valid_test_datasets_provider.is_distributed = True


def main() -> None:
    """Train with ``sys.argv`` Megatron flags (see module docstring), then end the rank.

    ``megatron.training.pretrain()`` returns without destroying the default process group,
    and with gloo the interpreter's own teardown can abort a rank after training finished
    ("terminate called without an active exception", SIGABRT), which torchrun reports as a
    failed job. ``harness.ranks.end_training_rank`` closes the metric writers, meets the
    other ranks at a barrier, destroys the group and ends the process with ``os._exit(0)``.
    So ``main()`` never returns: call it only as the entry point of a rank process.
    """
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
    end_training_rank()


if __name__ == "__main__":
    main()
