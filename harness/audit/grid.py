"""The real-shape audit of the layer-wise param sync: models, trees and cells.

``scripts/audit_param_sync.py`` runs, for every cell (model x TP/PP/EP x DP x tree), the
tree's own megatron-core code on storage-free tensors (meta device) over PyTorch's fake
process group (``harness/audit/worker.py``) and reports what the param sync
issues and allocates (``harness/audit/report.py``). Nothing here plans a
gather: the buckets come from the tree's ``_ParamAndGradBuffer`` / DDP, the shards from its
``LayerWiseDistributedOptimizer`` (ping-pong ``shard_params`` or 0.18.2's
``compute_full_param_layout``), the collectives from running its bucket groups'
``start_param_sync()`` / ``finish_param_sync()`` and ``allgather_params()``.

This module is data: the model configs (``MODELS``, real published shapes), the
``pretrain_gpt.py`` flags that describe them (``MODEL_FLAGS``, for the audit's flag path), the
trees (``TREES``, ``SERIES_PAIRS``) and the DP sizes. A tree's label says what it is, as
``harness.trees`` does: ``pristine-<release>`` (as released; 0.19 = 0.19.2), ``series-<base>``
(with patches/<base>/), ``-layout`` for the release's default layer-wise param layout path (the
others run its legacy path). It imports neither torch nor megatron, so the driver can read it
under any Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Dict, Optional, Tuple

from harness import trees as _trees

#: DP sizes of the audit (dense DP; expert DP is derived by megatron's parallel_state).
DP_SIZES: Tuple[int, ...] = (8, 64, 512, 1024)
#: --quick: enough to exercise every code path on 2 cores in well under a minute per tree.
QUICK_DP_SIZES: Tuple[int, ...] = (8, 64)


@dataclass(frozen=True)
class ModelSpec:
    """One real model config and its parallel layout.

    Attributes:
        label: short name used in tables and JSON keys.
        title: what it models, for the report.
        config: ``TransformerConfig`` keyword arguments (JSON-ready; the worker adds dtype,
            init and activation flags).
        vocab_size: the tokenizer's vocabulary; megatron pads it
            (``megatron.core.tokenizers.utils.build_tokenizer.vocab_size_with_padding``,
            ``make_vocab_size_divisible_by`` 128 x TP).
        max_sequence_length: ``GPTModel`` argument (position embeddings when learned).
        position_embedding_type: ``"rope"`` or ``"learned_absolute"``.
        tied_embeddings: ``share_embeddings_and_output_weights``.
        swiglu: gated linear unit with SiLU (``--swiglu``); otherwise GeLU.
        tp, pp, ep: tensor, pipeline and expert model-parallel sizes.
        vpp: virtual pipeline chunks per stage (``--num-layers-per-virtual-pipeline-stage``
            gives ``num_layers / pp / vpp`` layers per chunk); each chunk is its own DDP, the
            ones after the first with ``disable_bucketing`` (``get_model``), under one
            layer-wise optimizer.
        pp_stage: the pipeline stage audited (its layers only; 0 when ``pp == 1``).
        bucket_size: DDP bucket size in elements; None: megatron's default
            (``default_bucket_size``). Only the small check models set it.
        notes: caveats for the report.

    As the worker's ``FlagsSpec`` (the flag path's model) has them, and the same for every
    built-in model: fp32 ``grad_data`` (``grad_reduce_in_fp32``), no more
    ``DistributedDataParallelConfig`` keywords (``ddp_extra``), megatron's default expert
    tensor-parallel size (``etp`` None: TP).
    """

    label: str
    title: str
    config: Dict
    vocab_size: int
    max_sequence_length: int
    position_embedding_type: str = "rope"
    tied_embeddings: bool = False
    swiglu: bool = True
    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1
    pp_stage: int = 0
    bucket_size: Optional[int] = None
    notes: str = ""
    grad_reduce_in_fp32 = True
    ddp_extra = MappingProxyType({})
    etp = None

    @property
    def model_parallel(self) -> int:
        """Ranks per DP replica: TP x PP (EP lives inside DP)."""
        return self.tp * self.pp

    def world_size(self, dp: int) -> int:
        """Global ranks at dense DP ``dp``."""
        return self.model_parallel * dp


_LLAMA3_8B = dict(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
    num_query_groups=8, kv_channels=128, normalization="RMSNorm", add_bias_linear=False,
)  # fmt: skip
_LLAMA3_70B = dict(
    num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
    num_query_groups=8, kv_channels=128, normalization="RMSNorm", add_bias_linear=False,
)  # fmt: skip
_GPT3_175B = dict(
    num_layers=96, hidden_size=12288, ffn_hidden_size=4 * 12288, num_attention_heads=96,
    normalization="LayerNorm", add_bias_linear=True,
)  # fmt: skip
_MIXTRAL = dict(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
    num_query_groups=8, kv_channels=128, normalization="RMSNorm", add_bias_linear=False,
    num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
)  # fmt: skip
# DeepSeek-V2-Lite (Moonlight-16B-A3B has the same block): 27 layers, the first dense
# (first_k_dense_replace=1, FFN 10944), then 64 routed experts of FFN 1408, top-6, and 2
# shared experts (one shared MLP of 2 x 1408). Its attention is MLA (kv_lora_rank 512, no
# q LoRA); megatron-core 0.17.1's local spec cannot build MLA (its DotProductAttention takes
# no k_channels), so attention here is plain MHA, 16 heads of 128: 16.8M params per layer
# instead of MLA's about 16M, in 2 matrices instead of 4 (0.4 B of 15.4 B params).
_DSV2_LITE = dict(
    num_layers=27, hidden_size=2048, ffn_hidden_size=10944, num_attention_heads=16,
    kv_channels=128, normalization="RMSNorm", add_bias_linear=False,
    num_moe_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
    moe_shared_expert_intermediate_size=2 * 1408, moe_layer_freq=[0] + [1] * 26,
)  # fmt: skip

MODELS: Dict[str, ModelSpec] = {
    m.label: m
    for m in (
        ModelSpec("llama3_8b_tp1", "Llama-3-8B, TP 1", _LLAMA3_8B, 128256, 8192, tp=1),
        ModelSpec("llama3_8b_tp2", "Llama-3-8B, TP 2", _LLAMA3_8B, 128256, 8192, tp=2),
        ModelSpec("llama3_70b_tp8", "Llama-3-70B, TP 8", _LLAMA3_70B, 128256, 8192, tp=8),
        ModelSpec(
            "llama3_70b_tp4_pp4_vpp5", "Llama-3-70B, TP 4, PP 4, VPP 5, stage 1 of 0..3 (5 chunks of 4 layers)",
            _LLAMA3_70B, 128256, 8192, tp=4, pp=4, vpp=5, pp_stage=1,
            notes="Interleaved pipeline: the stage holds 5 model chunks, each its own DDP (one bucket each: "
                  "stages after the first get one bucket per buffer), one layer-wise optimizer over "
                  "all 5. Legacy trees only: the layout path's per-chunk param layout is not audited.",
        ),  # fmt: skip
        ModelSpec(
            "gpt3_175b_tp8_pp8", "GPT-3 175B, TP 8, PP 8, stage 4 of 0..7 (layers 49-60)",
            _GPT3_175B, 50257, 2048, position_embedding_type="learned_absolute",
            tied_embeddings=True, swiglu=False, tp=8, pp=8, pp_stage=4,
            notes="A middle stage holds no embedding or output layer; megatron's DDP puts "
                  "every stage after the first in one bucket (pp_rank > 0).",
        ),  # fmt: skip
        ModelSpec(
            "mixtral_8x7b_ep8", "Mixtral-8x7B-like MoE, 8 experts top-2, EP 8", _MIXTRAL, 32000, 4096,
            ep=8,
            notes="One expert per rank and layer at EP 8 (SequentialMLP, as TE's grouped experts: one "
                  "weight per expert). At DP 8 the expert DP is 1: expert params are not gathered.",
        ),  # fmt: skip
        ModelSpec(
            "dsv2_lite_ep8", "DeepSeek-V2-Lite/Moonlight-like MoE, 64 experts top-6 + shared, EP 8",
            _DSV2_LITE, 102400, 4096, ep=8,
            notes="27 layers, the first dense (FFN 10944), then 64 routed experts (FFN 1408) and 2 "
                  "shared experts per layer. Attention is MHA (16 heads of 128) in place of the real "
                  "model's MLA: megatron-core 0.17.1's local spec cannot build MLA. Experts are "
                  "SequentialMLP (one fc1/fc2 pair per expert), as with Transformer Engine's grouped "
                  "experts (TEGroupedMLP: one weight per expert too); the legacy GroupedMLP "
                  "(--moe-grouped-gemm without TE) would hold one fused weight per layer, fewer and "
                  "larger params, so other buckets.",
        ),  # fmt: skip
    )
}
QUICK_MODELS: Tuple[str, ...] = ("llama3_8b_tp1", "dsv2_lite_ep8")

_LLAMA3_FLAGS = (
    "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128", "--normalization", "RMSNorm",
    "--disable-bias-linear", "--swiglu", "--untie-embeddings-and-output-weights", "--position-embedding-type",
    "rope", "--vocab-size", "128256",
)  # fmt: skip
_LLAMA3_8B_FLAGS = ("--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                    "--num-attention-heads", "32", *_LLAMA3_FLAGS, "--seq-length", "8192",
                    "--max-position-embeddings", "8192")  # fmt: skip
_LLAMA3_70B_FLAGS = ("--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672",
                     "--num-attention-heads", "64", *_LLAMA3_FLAGS, "--seq-length", "8192",
                     "--max-position-embeddings", "8192")  # fmt: skip
#: What every built-in model assumes of a run: bf16 params, fp32 grad_data, megatron's local
#: layer spec (the audit's built-in models use it), the layer-wise optimizer.
_RUN_FLAGS = ("--bf16", "--accumulate-allreduce-grads-in-fp32", "--transformer-impl", "local",
              "--optimizer", "dist_muon", "--micro-batch-size", "1")  # fmt: skip
#: pretrain_gpt.py flags that describe each built-in model (``scripts/audit_param_sync.py
#: --pp-stage STAGE --dp-sizes ... -- FLAGS`` reproduces its cells; STAGE = ``pp_stage``).
MODEL_FLAGS: Dict[str, Tuple[str, ...]] = {
    "llama3_8b_tp1": (*_LLAMA3_8B_FLAGS, "--tensor-model-parallel-size", "1", *_RUN_FLAGS),
    "llama3_8b_tp2": (*_LLAMA3_8B_FLAGS, "--tensor-model-parallel-size", "2", *_RUN_FLAGS),
    "llama3_70b_tp8": (*_LLAMA3_70B_FLAGS, "--tensor-model-parallel-size", "8", *_RUN_FLAGS),
    "llama3_70b_tp4_pp4_vpp5": (*_LLAMA3_70B_FLAGS, "--tensor-model-parallel-size", "4",
                                "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage",
                                "4", *_RUN_FLAGS),  # fmt: skip
    "gpt3_175b_tp8_pp8": (
        "--num-layers", "96", "--hidden-size", "12288", "--ffn-hidden-size", "49152", "--num-attention-heads", "96",
        "--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--vocab-size", "50257",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--tensor-model-parallel-size", "8",
        "--pipeline-model-parallel-size", "8", *_RUN_FLAGS,
    ),  # fmt: skip
    "mixtral_8x7b_ep8": (
        "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
        *_LLAMA3_FLAGS[:-1], "32000", "--seq-length", "4096", "--max-position-embeddings", "4096",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "14336",
        "--expert-model-parallel-size", "8", *_RUN_FLAGS,
    ),  # fmt: skip
    "dsv2_lite_ep8": (
        "--num-layers", "27", "--hidden-size", "2048", "--ffn-hidden-size", "10944", "--num-attention-heads", "16",
        "--kv-channels", "128", "--normalization", "RMSNorm", "--disable-bias-linear", "--swiglu",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--vocab-size", "102400",
        "--seq-length", "4096", "--max-position-embeddings", "4096", "--num-experts", "64", "--moe-router-topk", "6",
        "--moe-ffn-hidden-size", "1408", "--moe-shared-expert-intermediate-size", "2816",
        "--moe-layer-freq", "([0]+[1]*26)", "--expert-model-parallel-size", "8", *_RUN_FLAGS,
    ),  # fmt: skip
}

#: Small configs for the check against allocated megatron objects on real gloo ranks
#: (tests/unit_tests/test_audit.py): the same code paths (dense and expert-DP
#: buckets, several buckets, uneven shares) at a size that trains on CPU.
CHECK_MODELS: Dict[str, ModelSpec] = {
    m.label: m
    for m in (
        ModelSpec(
            "check_moe_ep2", "4-layer Llama-like MoE, 4 experts top-2, EP 2, 20k-element buckets",
            dict(num_layers=4, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                 num_query_groups=2, kv_channels=16, normalization="RMSNorm", add_bias_linear=False,
                 num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                 moe_layer_freq=[0, 1, 1, 1]),
            1000, 128, ep=2, bucket_size=20_000,
        ),  # fmt: skip
    )
}
ALL_MODELS: Dict[str, ModelSpec] = {**MODELS, **CHECK_MODELS}


@dataclass(frozen=True)
class TreeSpec:
    """One megatron tree of the audit.

    Attributes:
        label: table and JSON name.
        title: what it is.
        source: a tree label of ``harness.trees`` (what ``harness.trees.env_for_tree`` takes),
            or a path relative to the repo root holding megatron/.
        layout: True for 0.18.2's default layer-wise param layout path
            (``LayerWiseDistributedOptimizer.compute_full_param_layout`` passed to DDP as
            ``full_param_layout``, as ``megatron.training.training.wrap_model_chunks_with_ddp``
            wires it); False for the legacy path (ping-pong ``shard_params``).
    """

    label: str
    title: str
    source: str
    layout: bool = False


TREES: Dict[str, TreeSpec] = {
    t.label: t
    for t in (
        TreeSpec("pristine-0.17.1", "megatron-core 0.17.1, pristine", "pristine-0.17.1"),
        TreeSpec("series-0.17.1", "0.17.1 + the series (patches/0.17.1/)", "series-0.17.1"),
        TreeSpec("pristine-0.18.2", "megatron-core 0.18.2 with --no-use-layer-wise-param-layout "
                 "(its legacy layer-wise path, #3751 + #4609)", "build/megatron-lm/core_v0.18.2"),  # fmt: skip
        TreeSpec("pristine-0.18.2-layout", "megatron-core 0.18.2, its default layer-wise param layout",
                 "build/megatron-lm/core_v0.18.2", layout=True),  # fmt: skip
        TreeSpec("pristine-0.19", "megatron-core 0.19.2 with --no-use-layer-wise-param-layout "
                 "(its legacy layer-wise path)", "pristine-0.19"),  # fmt: skip
        TreeSpec("pristine-0.19-layout", "megatron-core 0.19.2, its default layer-wise param layout",
                 "pristine-0.19", layout=True),  # fmt: skip
        TreeSpec("series-0.19", "0.19.2 + its series (patches/0.19/), legacy path", "series-0.19"),
    )
}


#: The megatron-core release each tree's ``megatron.training`` comes from (its estimate of the
#: step's memory, ``theoretical_memory_usage``, differs between releases).
RELEASE_OF_TREE: Dict[str, str] = {
    "pristine-0.17.1": "0.17.1", "series-0.17.1": "0.17.1",
    "pristine-0.18.2": "0.18.2", "pristine-0.18.2-layout": "0.18.2",
    "pristine-0.19": "0.19.2", "pristine-0.19-layout": "0.19.2", "series-0.19": "0.19.2",
}  # fmt: skip

#: Each series tree and the pristine tree it patches (the claims compare them cell by cell).
SERIES_PAIRS: Dict[str, str] = {"series-0.17.1": "pristine-0.17.1", "series-0.19": "pristine-0.19"}


def tree_dir(spec: TreeSpec):
    """What ``harness.trees.env_for_tree`` takes for ``spec``: its tree label, or the directory
    of a path tree.

    Raises:
        FileNotFoundError: a path tree that is missing (run scripts/setup.sh).
    """
    if "/" not in spec.source:
        return spec.source
    path = _trees.REPO_ROOT / spec.source
    if not (path / "megatron" / "core" / "__init__.py").is_file():
        raise FileNotFoundError(f"tree {spec.label}: {path}/megatron is missing; run scripts/setup.sh")
    return Path(path)


def default_bucket_size(dp: int) -> int:
    """megatron's default DDP bucket size in elements at DP ``dp``: ``max(40M, 1M x dp)``.

    From ``megatron/training/training.py:get_model`` (0.17.1 and 0.18.2) and
    ``DistributedDataParallel.__init__`` (0.17.1). Pipeline stages after the first get one
    bucket (``bucket_size=None``) in both.
    """
    return max(40_000_000, 1_000_000 * dp)
