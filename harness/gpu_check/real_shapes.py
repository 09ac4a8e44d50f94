"""The GPU check's real-shape memory run: Llama-3-8B's layers on the real CUDA allocator.

The memory worker's ``llama3_8b_layers`` config builds Llama-3-8B's shapes (hidden 4096, FFN
14336 with SwiGLU, 32 heads, 8 KV groups of 128, RMSNorm, no linear biases, RoPE, untied
embeddings, vocab 128256) with ``LAYERS`` layers: as many as fit two ranks (DP 2) on one
80 GB GPU (``layers_that_fit``). Beside each measured CUDA peak of the param sync (per tree,
per path, per DP rank) the report prints what the real-shape audit predicts for the same
configuration: ``harness/audit/worker.run_cell`` (the code behind
``scripts/audit_param_sync.py``) run on ``model_spec(LAYERS)`` at DP 2 by
``predict_worker.py``. The predictions are stored in ``PREDICTION_FILE`` (written by
``python -m harness.gpu_check.real_shapes --write``), so that a dry run shows them without
running the audit; a unit test runs the audit again and requires the same bytes.

How a measurement is compared with its prediction (``compare``):

* predicted peak = the audit's ``megatron_peak_bytes + nccl_peak_bytes`` (megatron's own
  temporaries and what ProcessGroupNCCL allocates, both through the caching allocator);
* measured peak = ``torch.cuda.max_memory_allocated()`` over the window minus
  ``memory_allocated()`` at its start (the memory worker's ``peak_extra_bytes``);
* allocator rounding: the CUDA caching allocator hands out blocks in multiples of 512 bytes
  (``kMinBlockSize``), and ``max_memory_allocated`` counts blocks, so each tensor may count up
  to 511 bytes more than its bytes; it reserves whole segments (2 MiB for small requests,
  ``kSmallBuffer``; larger ones rounded up to 2 MiB, ``kRoundLarge``), which
  ``memory_reserved`` sees and ``max_memory_allocated`` does not. The allowed difference is
  therefore ``ROUNDING_BYTES`` (512) per allocation the audit counted in that sync
  (``megatron_alloc_calls`` plus one per c10d call for NCCL's); where the audit predicts 0
  bytes (the series) the measurement must be exactly 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from harness.trees import REPO_ROOT

#: Llama-3-8B's shapes (as harness/audit/grid.py's ``_LLAMA3_8B``, layers aside).
HIDDEN, FFN, HEADS, KV_GROUPS, KV_CHANNELS, VOCAB = 4096, 14336, 32, 8, 128, 128256
#: Tokens per micro-batch of the run (micro-batch 1): activations stay small next to params.
SEQ = 256
#: The GPU the layer count is sized for, bytes: an 80 GB H100's 79.1 GiB that CUDA reports.
GPU_BYTES = int(79.1 * 2**30)
RANKS = 2
#: Per rank, bytes outside the model and optimizer: CUDA context, NCCL buffers and allocator
#: fragmentation (measured on H200 for the param_dominated run: about 1 GiB reserved over allocated).
FIXED_BYTES_PER_RANK = 3 * 2**30
#: Share of the GPU left for what ``rank_bytes`` does not count (its terms are estimates).
MARGIN = 0.05
#: CUDA caching allocator block size (bytes): see the module docstring.
ROUNDING_BYTES = 512
PREDICTION_FILE = Path(__file__).resolve().parent / "real_shape_prediction.json"
PREDICT_WORKER = Path(__file__).resolve().parent / "predict_worker.py"
#: The GPU check's two sides (its memory runs and the prediction; ``plan.TREES``) -> the tree
#: each runs on: a harness.trees label, which is also the tree's label in harness.audit.grid.TREES.
TREES = {"pristine": "pristine-0.17.1", "series": "series-0.17.1"}
#: Memory worker window -> audit path.
WINDOWS = {"sync": "async", "sync_optimizer": "optimizer"}


def layer_numel() -> int:
    """Params of one transformer layer (local spec): QKV (4096 x (4096 + 2 x 8 x 128)), output
    projection (4096 x 4096), SwiGLU fc1 (4096 x 2 x 14336), fc2 (14336 x 4096), two RMSNorm
    weights (4096 each)."""
    kv = KV_GROUPS * KV_CHANNELS
    return HIDDEN * (HIDDEN + 2 * kv) + HIDDEN * HIDDEN + HIDDEN * 2 * FFN + FFN * HIDDEN + 2 * HIDDEN


def model_numel(layers: int) -> int:
    """Params of the model: input embedding and output layer (128256 x 4096 each, untied),
    ``layers`` layers and the final RMSNorm."""
    return 2 * VOCAB * HIDDEN + layers * layer_numel() + HIDDEN


def rank_bytes(layers: int) -> Dict[str, int]:
    """Upper bound of one DP rank's CUDA bytes in the run (of 2 ranks), by part:

    * ``params``: bf16, whole model on every rank (2 B per param);
    * ``grad_data``: fp32 grad buffers (``grad_reduce_in_fp32``), whole model (4 B);
    * ``optimizer``: the layer-wise optimizer's state for the params this rank owns: Adam for
      the embedding and output layer (fp32 main param + 2 moments, 12 B; the two go to
      different ranks, sorted by size), Muon for the layer matrices (fp32 main param +
      momentum, 8 B) on half the layers' params plus one fc1 of imbalance;
    * ``transient``: the larger of a training step's (Muon's Newton-Schulz on the largest
      matrix, fc1, about 4 fp32 copies; the fp32 logits and their grad, 3 x seq x vocab x
      4 B; the pristine tree's forward-time gather temporaries, 2 bucket groups in flight of
      DDP's default 40 M elements, bf16, share and receive: 4 x 40 M x 2 B) and its
      optimizer-path gather (``allgather_params``: the local params flattened and a receive
      tensor per other rank, 2 B per param of the model: the audit predicts exactly that);
    * ``fixed``: ``FIXED_BYTES_PER_RANK``.
    """
    p = model_numel(layers)
    fc1 = HIDDEN * 2 * FFN
    embed = VOCAB * HIDDEN
    owned_matrices = layers * layer_numel() // 2 + fc1
    return {
        "params": 2 * p,
        "grad_data": 4 * p,
        "optimizer": 12 * embed + 8 * owned_matrices,
        "transient": max(4 * 4 * fc1 + 3 * SEQ * VOCAB * 4 + 4 * 40_000_000 * 2, 2 * p),
        "fixed": FIXED_BYTES_PER_RANK,
    }


def layers_that_fit(gpu_bytes: int = GPU_BYTES, ranks: int = RANKS, margin: float = MARGIN) -> int:
    """The most layers for which ``ranks`` x ``rank_bytes(layers)`` fits in ``(1 - margin)``
    x ``gpu_bytes``."""
    layers = 0
    while ranks * sum(rank_bytes(layers + 1).values()) <= (1 - margin) * gpu_bytes:
        layers += 1
    return layers


#: Layers of the run: 8 (2 x 37.1 GiB of 95 % of 79.1 GiB; 9 would need 2 x 39.5 GiB).
LAYERS = layers_that_fit()


def worker_config(layers: int = LAYERS) -> dict:
    """The memory worker's ``llama3_8b_layers`` config (harness/gpu_check/memory_worker.py)."""
    return dict(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                num_query_groups=KV_GROUPS, kv_channels=KV_CHANNELS, vocab=VOCAB, seq=SEQ, micro_batch=1,
                bucket_size=None, add_bias_linear=False, position_embedding_type="rope", swiglu=True,
                normalization="RMSNorm")


#: ``worker_config``'s code at a size for CPU tests (the memory and gather-timing workers' ``llama_tiny``).
LLAMA_TINY = dict(worker_config(2), hidden_size=64, num_attention_heads=4, ffn_hidden_size=160, num_query_groups=2,
                  kv_channels=16, vocab=512, seq=32, micro_batch=2)


def model_spec(layers: int = LAYERS, cfg: Optional[dict] = None):
    """The audit's ``ModelSpec`` of the memory worker's config ``cfg`` (default
    ``worker_config(layers)``): the same shapes, TP 1, one pipeline stage, DDP's default
    bucket size."""
    from harness.audit import grid as audit_shapes

    cfg = worker_config(layers) if cfg is None else cfg
    config = dict(num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["ffn_hidden_size"],
                  num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_query_groups"],
                  kv_channels=cfg["kv_channels"], normalization=cfg["normalization"],
                  add_bias_linear=cfg["add_bias_linear"])
    return audit_shapes.ModelSpec(f"gpu_check_{cfg['num_layers']}_layers", "the GPU check's real-shape model", config,
                                  cfg["vocab"], cfg["seq"], position_embedding_type=cfg["position_embedding_type"],
                                  swiglu=cfg["swiglu"], bucket_size=cfg["bucket_size"])


def predict(tree: str, layers: int = LAYERS, dp: int = RANKS, timeout_s: float = 600,
            cfg: Optional[dict] = None) -> dict:
    """Run ``predict_worker.py`` (the audit's cell) on ``tree`` (a side of ``TREES``: on its
    tree) for ``model_spec(layers, cfg)``; its JSON record.

    Raises:
        RuntimeError: the worker failed (its output tail).
    """
    from harness.audit import grid as audit_shapes
    from harness.trees import env_for_tree

    env = env_for_tree(audit_shapes.tree_dir(audit_shapes.TREES[TREES[tree]]))
    env.update(MEGATRON_CPU_RUNTIME="force", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        extra = ["--worker-config", json.dumps(cfg)] if cfg is not None else []
        proc = subprocess.run([sys.executable, str(PREDICT_WORKER), "--tree", TREES[tree], "--layers", str(layers),
                               "--dp", str(dp), "--out", str(out), *extra], env=env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"predict_worker on {tree} failed (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(out.read_text())


def prediction_doc(layers: int = LAYERS) -> dict:
    """``PREDICTION_FILE``'s content: per tree, per DP rank, per memory-worker window, the
    predicted peak bytes and the allowed rounding (``predicted``), with the audit's record."""
    trees = {}
    for tree in TREES:
        rec = predict(tree, layers)
        for r in rec["ranks"]:
            r["predicted"] = {w: predicted_window(r["paths"][p]) for w, p in WINDOWS.items()}
        rec.pop("tree_dir", None)
        trees[tree] = rec
    return {"model": worker_config(layers), "layers": layers, "dp": RANKS,
            "rank_bytes": rank_bytes(layers), "gpu_bytes": GPU_BYTES,
            "how": "harness/gpu_check/predict_worker.py: harness/audit/worker.run_cell on "
                   "harness.gpu_check.real_shapes.model_spec(layers) at DP 2, paths async and optimizer",
            "trees": trees}


def predicted_window(path_record: dict) -> dict:
    """One audit path's prediction: ``bytes`` (megatron's peak + NCCL's) and
    ``tolerance_bytes`` (``ROUNDING_BYTES`` per allocation counted: megatron's, plus one per
    c10d call for NCCL's where the audit saw NCCL bytes)."""
    nccl = path_record["nccl_peak_bytes"]
    allocations = path_record["megatron_alloc_calls"] + (path_record["calls"] if nccl else 0)
    return {"bytes": path_record["megatron_peak_bytes"] + nccl, "tolerance_bytes": ROUNDING_BYTES * allocations}


def load_json(path: Path) -> Optional[Any]:
    """The JSON document in ``path`` (e.g. ``PREDICTION_FILE``, a results folder's files), or
    None when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def compare(measured: Optional[int], predicted: dict) -> Optional[str]:
    """None when ``measured`` (bytes) is within ``predicted``'s tolerance of its bytes, else
    the problem in words."""
    if measured is None:
        return "no CUDA figure measured"
    diff = measured - predicted["bytes"]
    if abs(diff) <= predicted["tolerance_bytes"]:
        return None
    return (f"measured {measured} B, the audit predicts {predicted['bytes']} B: {diff:+d} B, beyond the "
            f"allocator rounding of {predicted['tolerance_bytes']} B")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.gpu_check.real_shapes",
                                 description="Run the real-shape audit on the GPU check's Llama-3-8B-shaped config.")
    ap.add_argument("--write", action="store_true", help=f"write {PREDICTION_FILE.relative_to(REPO_ROOT)}")
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args(argv)
    doc = prediction_doc(args.layers)
    text = json.dumps(doc, indent=1) + "\n"
    if args.write:
        PREDICTION_FILE.write_text(text)
        print(f"wrote {PREDICTION_FILE}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
