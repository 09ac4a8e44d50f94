"""One rank of the GPU check's memory measurement: a GPT training step on one megatron tree.

Run under torchrun (``harness.launch.torchrun_command``), the tree chosen by PYTHONPATH::

    MEGATRON_SHARED_GPU=1 torchrun --nproc-per-node 2 harness/gpu_check/memory_worker.py \
        --backend gloo --config param_dominated --steps 4 --out up.json     # 2 ranks, cuda:0
    torchrun --nproc-per-node 8 harness/gpu_check/memory_worker.py --backend nccl ...

Model: megatron's GPTModel (local layer spec), bf16 params, fp32 ``grad_data``
(``grad_reduce_in_fp32``), DDP with ``overlap_grad_reduce`` and ``overlap_param_gather``,
and the layer-wise optimizer (``get_megatron_muon_optimizer(layer_wise_distributed_optimizer
=True)``), as ``--optimizer dist_muon --overlap-param-gather`` builds them. Each step runs
what ``training.py:train_step`` runs: ``zero_grad_buffer``, forward (DDP's forward pre-hooks
wait for and dispatch the per-bucket param all-gather), backward, ``finish_grad_sync``,
``optimizer.step``.

Measured on every rank, in bytes (``torch.cuda``; None on CPU ranks):

* ``forward``: ``max_memory_allocated`` during the forward minus ``memory_allocated`` just
  before it (``peak_extra_bytes``), and ``memory_reserved`` after it. The gather's receive
  buffers live here: upstream's ``torch.empty`` slots and ``_layerwise_src_buffer``.
* ``step_peak_extra_bytes``: the same peak over the whole step.
* ``sync``: one param sync alone (``start_param_sync`` of the first bucket group in forward
  order, then ``finish_param_sync`` of every group), outside any forward: the temporaries of
  the gather and nothing else. On NCCL this is the proof of zero temporaries.
* ``sync_optimizer``: the same for ``optimizer.allgather_params()``, the gather that
  ``step()`` runs instead when --overlap-param-gather is off.
* ``gather_calls``: the param all-gather's c10d calls per form in the window, their NCCL
  calls and group launches, the bytes received from other ranks and the bytes NCCL would
  allocate for them
  (``harness.cpu_runtime.collectives.record_collectives``). On gloo the model allocates those
  temporaries on the GPU, so they are inside the measured peaks.

Also per step the lm loss (``float.hex``, so that trees compare bit for bit) and the
grad norm, and a float64 checksum of the params before the first step
(``init_params_checksum``: both trees start from the same weights) and at the end. Rank 0 writes
``{"ranks": [one dict per rank], ...}`` to ``--out``. A rank that raises prints its
traceback and exits 1 at once (the others may wait in a collective; torchrun stops them),
and ``--out`` is not written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    # Run by path: sys.path[0] is this folder; `harness` must come from the repo root, which
    # PYTHONPATH lists after the tree under test.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]

from harness import cpu_runtime  # noqa: E402

cpu_runtime.install_if_requested()

from harness.cpu_runtime import collectives  # noqa: E402
from harness.gpu_check import shared_gpu  # noqa: E402

if not shared_gpu.install_if_requested():
    shared_gpu.install_collectives()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.gpu_check import real_shapes  # noqa: E402
from harness.model import gpt_model, wrap  # noqa: E402
from harness.trees import check_expected_tree  # noqa: E402

#: Model configurations. ``param_dominated``: 8 layers, hidden 2048 (about 0.54 B params,
#: 1.07 GB of bf16), micro-batch 1 of 256 tokens, so that the gather's bytes stand out against
#: activations. ``equal_shares``: no linear biases, rotary positions, untied embeddings and one
#: bucket, so that the layer-wise optimizer's size-sorted ping-pong assignment gives both of
#: 2 DP ranks the same share (checked and reported, not assumed). ``tiny``: for CPU tests.
#: ``llama3_8b_layers``: Llama-3-8B's shapes with as many layers as fit 2 ranks on an 80 GB GPU
#: (``harness.gpu_check.real_shapes``), built as the real-shape audit builds it (decoder block
#: spec, SwiGLU, RMSNorm, GQA), so that its buckets and shares are the audit's; ``llama_tiny``:
#: the same code at a size for CPU tests.
CONFIGS = {
    "param_dominated": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                            vocab=32768, seq=256, micro_batch=1, bucket_size=None, add_bias_linear=True,
                            position_embedding_type="learned_absolute"),
    "equal_shares": dict(num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096,
                         vocab=8192, seq=256, micro_batch=1, bucket_size=10**9, add_bias_linear=False,
                         position_embedding_type="rope"),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                 vocab=512, seq=32, micro_batch=2, bucket_size=None, add_bias_linear=True,
                 position_embedding_type="learned_absolute"),
    "llama3_8b_layers": real_shapes.worker_config(),
    "llama_tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=160, num_query_groups=2,
                       kv_channels=16, vocab=512, seq=32, micro_batch=2, bucket_size=None, add_bias_linear=False,
                       position_embedding_type="rope", swiglu=True, normalization="RMSNorm"),
}
PARAM_DTYPE = torch.bfloat16


def _on_gpu() -> bool:
    return torch.cuda.is_available() and not cpu_runtime.is_installed()


def summarize_records(records) -> dict:
    """Counts and bytes of a window's ``collectives.CollectiveRecord`` list: c10d calls per
    form, NCCL calls (and zero-size ones), NCCL group launches, bytes received from other
    ranks, and the bytes NCCL would allocate (``collectives.summarize``)."""
    forms = {"list_equal": collectives.FORM_LIST_EQUAL, "list_unequal": collectives.FORM_LIST_UNEQUAL,
             "into_tensor": collectives.FORM_INTO_TENSOR, "broadcast": collectives.FORM_BROADCAST}
    out = collectives.summarize(records)
    out.update({name: sum(r.form == form for r in records) for name, form in forms.items()})
    return out


class _Memory:
    """``torch.cuda`` memory figures, or None on CPU ranks (no allocator statistics)."""

    def __init__(self):
        self.gpu = _on_gpu()

    def sync(self):
        if self.gpu:
            torch.cuda.synchronize()

    def start(self) -> None:
        self.sync()
        self.base = torch.cuda.memory_allocated() if self.gpu else None
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        self._recording = collectives.record_collectives()
        self.records = self._recording.__enter__()

    def window(self) -> dict:
        self.sync()
        self._recording.__exit__(None, None, None)
        out = {"allocated_before_bytes": self.base, "peak_extra_bytes": None, "reserved_bytes": None,
               "gather_calls": summarize_records(self.records)}
        if self.gpu:
            out["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - self.base
            out["reserved_bytes"] = torch.cuda.memory_reserved()
        return out


class Setup:
    """GPTModel in megatron DDP with its layer-wise optimizer (see the module docstring).

    Args:
        cfg: one of ``CONFIGS``.
        seed: for megatron's weight init and the token batches.
    """

    def __init__(self, cfg: dict, seed: int = 1234):
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        # Both generators: megatron seeds the CUDA one (weights built on the GPU), and the CPU one
        # draws the weights built on CPU whatever use_cpu_initialization says, e.g. the learned
        # position embedding (a torch.nn.Embedding, core/models/common/embeddings/
        # language_model_embedding.py:LanguageModelEmbedding). Unseeded, two processes (upstream
        # and patched) would start from different weights. (megatron.training seeds both in
        # initialize.py:_set_random_seed.)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        # Llama-like configs as harness/audit/worker.py:build_module builds them.
        llama = dict(num_query_groups=cfg["num_query_groups"], kv_channels=cfg["kv_channels"],
                     normalization=cfg["normalization"], gated_linear_unit=True,
                     activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
                     ) if cfg.get("swiglu") else {}
        config = TransformerConfig(
            num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
            num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["ffn_hidden_size"],
            add_bias_linear=cfg["add_bias_linear"], params_dtype=PARAM_DTYPE, bf16=True,
            use_cpu_initialization=not _on_gpu(), hidden_dropout=0.0, attention_dropout=0.0, **llama,
        )
        module = gpt_model(config, cfg["vocab"], cfg["seq"], block_spec=bool(llama),
                           normalization=cfg.get("normalization"), share_embeddings_and_output_weights=False,
                           position_embedding_type=cfg["position_embedding_type"]).cuda()  # fmt: skip
        self.ddp, self.opt = wrap(config, module, True, cfg["bucket_size"], lr=1e-3, weight_decay=0.01,
                                  clip_grad=1.0)  # fmt: skip
        self.cfg = cfg
        self.params = list(self.ddp.module.parameters())
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        tokens = torch.randint(0, cfg["vocab"], (cfg["micro_batch"], cfg["seq"] + 1), generator=gen)
        self.tokens = tokens[:, :-1].contiguous().cuda()
        self.labels = tokens[:, 1:].contiguous().cuda()
        self.position_ids = torch.arange(cfg["seq"]).unsqueeze(0).expand_as(self.tokens).contiguous().cuda()
        # megatron's convention (training/utils.py:get_ltor_masks_and_position_ids): True = masked.
        self.attention_mask = (torch.tril(torch.ones(1, 1, cfg["seq"], cfg["seq"])) < 0.5).cuda()

    def bucket_shares(self) -> list:
        """Per DDP bucket: its numel and each DP rank's share of it (elements)."""
        owners = self.opt.dp_cp_params_list
        out = []
        for group in self.ddp.bucket_groups:
            for bucket in group.buckets:
                ids = {id(p) for p in bucket.params}
                shares = ([sum(p.numel() for p in plist if id(p) in ids) for plist in owners]
                          if owners is not None else [])
                out.append({"numel": sum(p.numel() for p in bucket.params), "shares": shares,
                            "shares_equal": len(set(shares)) <= 1})
        return out

    def step(self, mem: _Memory) -> dict:
        """One training step; returns its figures (see the module docstring)."""
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        dist.barrier()
        mem.start()
        t0 = time.perf_counter()
        out = self.ddp(self.tokens, self.position_ids, self.attention_mask, labels=self.labels)
        loss = out.float().mean()
        forward = mem.window()
        forward["seconds"] = time.perf_counter() - t0
        loss.backward()
        self.ddp.finish_grad_sync()
        _, grad_norm, _ = self.opt.step()
        mem.sync()
        step_peak = (torch.cuda.max_memory_allocated() - mem.base) if mem.gpu else None
        value = loss.detach().float().item()
        return {"loss": value, "loss_hex": float(value).hex(),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "forward": forward, "step_peak_extra_bytes": step_peak}

    def sync_alone(self, mem: _Memory) -> dict:
        """One param sync outside the forward, as the forward pre-hooks run it."""
        self.ddp.zero_grad_buffer()  # also clears param_gather_dispatched, as train_step does
        dist.barrier()
        mem.start()
        order = list(reversed(self.ddp.bucket_groups))  # forward order
        order[0].start_param_sync()
        for group in order:
            group.finish_param_sync()
        return mem.window()

    def optimizer_sync_alone(self, mem: _Memory) -> dict:
        """One ``LayerWiseDistributedOptimizer.allgather_params()``: the synchronous gather
        that ``step()`` ends with when --overlap-param-gather is off (the optimizer path)."""
        dist.barrier()
        mem.start()
        self.opt.allgather_params()
        return mem.window()

    @torch.no_grad()
    def checksum(self) -> str:
        return float(sum(p.double().sum().item() for p in self.params)).hex()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="param_dominated")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if _on_gpu():
        torch.cuda.set_device(local)
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    record: dict = {"rank": rank, "device": f"cuda:{torch.cuda.current_device()}" if _on_gpu() else "cpu"}
    try:
        from megatron.core import parallel_state

        record["megatron_core_dir"] = check_expected_tree()
        parallel_state.initialize_model_parallel()
        s = Setup(CONFIGS[args.config])
        record["init_params_checksum"] = s.checksum()
        from megatron.core.distributed import param_and_grad_buffer

        # Whether DDP's grad sync runs through shared_gpu's coalescing manager.
        record["grad_sync_coalescing_replaced"] = (
            param_and_grad_buffer._coalescing_manager is not dist.distributed_c10d._coalescing_manager)
        mem = _Memory()
        record["param_count"] = sum(p.numel() for p in s.params)
        record["param_bytes"] = sum(p.numel() * p.element_size() for p in s.params)
        record["buckets"] = s.bucket_shares()
        record["steps"] = [s.step(mem) for _ in range(args.steps)]
        record["sync"] = s.sync_alone(mem)
        record["sync_optimizer"] = s.optimizer_sync_alone(mem)
        record["params_checksum"] = s.checksum()
    except Exception:  # noqa: BLE001 - the traceback goes to the run's log
        print(f"memory_worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)  # the other ranks may be inside a collective: torchrun stops them
    ranks = [None] * world
    dist.all_gather_object(ranks, record)
    if rank == 0:
        doc = {"backend": args.backend, "world": world, "config_name": args.config,
               "config": CONFIGS[args.config], "steps": args.steps,
               "gpu": torch.cuda.get_device_name(0) if _on_gpu() else None,
               "torch": torch.__version__, "ranks": ranks}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
