"""One rank of the memory measurement of a GPT training step on one megatron tree: the GPU
check's memory runs and the bench's step-memory runs.

Run under torchrun (``harness.launch.torchrun_command``), the tree chosen by PYTHONPATH::

    MEGATRON_SHARED_GPU=1 torchrun --nproc-per-node 2 harness/gpu_check/memory_worker.py \
        --backend gloo --config param_dominated --steps 4 --out up.json     # 2 ranks, cuda:0
    torchrun --nproc-per-node 8 harness/gpu_check/memory_worker.py --backend nccl ...

The GPU check (``harness/gpu_check/plan.py``) runs it on CUDA ranks; ``scripts/bench_param_sync.py``
on CPU gloo ranks (CPU runtime layer, its step-memory runs), config ``bench``, overlap on and off.

Model: megatron's GPTModel (local layer spec), bf16 params, fp32 ``grad_data``
(``grad_reduce_in_fp32``), DDP with ``overlap_grad_reduce`` and, unless ``--overlap off``,
``overlap_param_gather``, and the layer-wise optimizer (``get_megatron_muon_optimizer(
layer_wise_distributed_optimizer=True)``), as ``--optimizer dist_muon --overlap-param-gather``
builds them. Each step runs what ``training.py:train_step`` runs: ``zero_grad_buffer``, forward
(with overlap, DDP's forward pre-hooks wait for and dispatch the per-bucket param all-gather),
backward, ``finish_grad_sync``, ``optimizer.step``.

Peak memory is read by a probe (``harness.memory_probe``): on CUDA ranks the caching allocator's
statistics (``max_memory_allocated`` over ``memory_allocated`` at the start, ``memory_reserved``);
on CPU ranks torch.profiler's memory events (every allocation on every thread; no reserved or
allocated figure: None). Measured on every rank, in bytes:

* ``phase_peak_bytes`` per step: the peak above the step's start within each phase (``PHASES``,
  ``PHASE_DESC``; None for a phase that did not run), ``step_peak_extra_bytes`` the peak over the
  whole step;
* ``forward``: the forward's peak (``peak_extra_bytes``), the bytes allocated before it and
  ``memory_reserved`` after it. The gather's receive buffers live here: the pristine tree's
  ``torch.empty`` slots and ``_layerwise_src_buffer``.
* ``sync`` (overlap on only): one param sync alone (``start_param_sync`` of the first bucket
  group in forward order, then ``finish_param_sync`` of every group), outside any forward: the
  temporaries of the gather and nothing else. On NCCL this is the proof of zero temporaries.
* ``sync_optimizer``: the same for ``optimizer.allgather_params()``, the gather that
  ``step()`` runs instead when --overlap-param-gather is off.
* ``gather_calls``: the param all-gather's c10d calls per form in the window, their NCCL
  calls and group launches, the bytes received from other ranks and the bytes NCCL would
  allocate for them
  (``harness.cpu_runtime.collectives.record_collectives``). On gloo the model allocates those
  temporaries itself, so they are inside the measured peaks.

Also per step the lm loss (``float.hex``, so that trees compare bit for bit) and the
grad norm, and a float64 checksum of the params before the first step
(``init_params_checksum``: both trees start from the same weights) and at the end. Rank 0 writes
``{"ranks": [one dict per rank], ...}`` to ``--out``. A rank that raises prints its
traceback and exits 1 at once (the others may wait in a collective; torchrun stops them),
and ``--out`` is not written.
"""

from __future__ import annotations

import argparse
import faulthandler
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

from harness import memory_probe  # noqa: E402
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
#: the same code at a size for CPU tests. ``bench``: the bench's param-dominated GPT for CPU ranks
#: (2 layers, hidden 1024, 27.3 M params, 52 MiB in bf16, against a few MiB of activations);
#: ``bench_small``: its layout at a quarter of the width (1.9 M params), a quick check.
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
    "bench": dict(num_layers=2, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096,
                  vocab=1024, seq=256, micro_batch=1, bucket_size=None, add_bias_linear=True,
                  position_embedding_type="learned_absolute"),
    "bench_small": dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
                        vocab=1024, seq=64, micro_batch=1, bucket_size=None, add_bias_linear=True,
                        position_embedding_type="learned_absolute"),
    "llama3_8b_layers": real_shapes.worker_config(),
    "llama_tiny": real_shapes.LLAMA_TINY,
}
PARAM_DTYPE = torch.bfloat16
PHASES = ("forward", "backward", "optimizer step", "optimizer gather")
PHASE_DESC = {
    "forward": "DDP forward + loss; with overlap, the pre-hooks' param all-gather",
    "backward": "loss.backward() + finish_grad_sync()",
    "optimizer step": "LayerWiseDistributedOptimizer.step(), its gather included",
    "optimizer gather": "allgather_params() at the end of step() (overlap off)",
}


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


class Setup:
    """GPTModel in megatron DDP with its layer-wise optimizer (see the module docstring).

    Args:
        cfg: one of ``CONFIGS``.
        overlap: ``overlap_param_gather``.
        seed: for megatron's weight init and the token batches.
    """

    def __init__(self, cfg: dict, overlap: bool = True, seed: int = 1234):
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        # Both generators: megatron seeds the CUDA one (weights built on the GPU), and the CPU one
        # draws the weights built on CPU whatever use_cpu_initialization says, e.g. the learned
        # position embedding (a torch.nn.Embedding, core/models/common/embeddings/
        # language_model_embedding.py:LanguageModelEmbedding). Unseeded, two processes (pristine
        # and series tree) would start from different weights. (megatron.training seeds both in
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
        # On CPU, muon_fp32_matmul_prec "highest": megatron's default, "medium", runs the
        # Newton-Schulz matmuls in emulated bf16 on a CPU without bf16 units (measured: 33 s instead
        # of 1 s for one 1024 x 1024 orthogonalization); the param sync does not depend on it.
        prec = {} if _on_gpu() else {"muon_fp32_matmul_prec": "highest"}
        self.ddp, self.opt = wrap(config, module, overlap, cfg["bucket_size"], lr=1e-3, weight_decay=0.01,
                                  clip_grad=1.0, **prec)  # fmt: skip
        self.cfg, self.overlap = cfg, overlap
        self._probe = None  # the probe of the step being measured
        gather = self.opt.allgather_params

        def labelled_gather():
            if self._probe is None:
                return gather()
            with self._probe.phase("optimizer gather"):
                return gather()

        # A phase mark only: the optimizer's own method runs unchanged inside it.
        self.opt.allgather_params = labelled_gather
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

    def step(self) -> dict:
        """One training step; returns its figures (see the module docstring)."""
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        dist.barrier()
        probe = self._probe = memory_probe.probe(_on_gpu())
        with probe.region():
            t0 = time.perf_counter()
            with probe.phase("forward"), collectives.record_collectives() as calls:
                loss = self.ddp(self.tokens, self.position_ids, self.attention_mask, labels=self.labels).float().mean()
            seconds = time.perf_counter() - t0
            with probe.phase("backward"):
                loss.backward()
                self.ddp.finish_grad_sync()
            with probe.phase("optimizer step"):
                _, grad_norm, _ = self.opt.step()
        self._probe = None
        value = loss.detach().float().item()
        forward = {"allocated_before_bytes": probe.base, "peak_extra_bytes": probe.phase_peaks["forward"],
                   "reserved_bytes": probe.reserved["forward"], "gather_calls": summarize_records(calls),
                   "seconds": seconds}
        return {"loss": value, "loss_hex": float(value).hex(),
                "grad_norm": None if grad_norm is None else float(grad_norm), "forward": forward,
                "step_peak_extra_bytes": probe.peak,
                "phase_peak_bytes": {p: probe.phase_peaks.get(p) for p in PHASES}}

    @staticmethod
    def _window(run) -> dict:
        """``run()`` alone, measured: bytes allocated before, peak above them, reserved after,
        the all-gather calls."""
        dist.barrier()
        probe = memory_probe.probe(_on_gpu())
        with probe.region(), collectives.record_collectives() as calls:
            run()
        return {"allocated_before_bytes": probe.base, "peak_extra_bytes": probe.peak,
                "reserved_bytes": probe.reserved_end, "gather_calls": summarize_records(calls)}

    def sync_alone(self) -> dict:
        """One param sync outside the forward, as the forward pre-hooks run it (overlap on)."""
        self.ddp.zero_grad_buffer()  # also clears param_gather_dispatched, as train_step does

        def run():
            order = list(reversed(self.ddp.bucket_groups))  # forward order
            order[0].start_param_sync()
            for group in order:
                group.finish_param_sync()

        return self._window(run)

    def optimizer_sync_alone(self) -> dict:
        """One ``LayerWiseDistributedOptimizer.allgather_params()``: the synchronous gather
        that ``step()`` ends with when --overlap-param-gather is off (the optimizer path)."""
        return self._window(self.opt.allgather_params)

    @torch.no_grad()
    def checksum(self) -> str:
        return float(sum(p.double().sum().item() for p in self.params)).hex()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="param_dominated")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--overlap", choices=("on", "off"), default="on", help="--overlap-param-gather")
    ap.add_argument("--watchdog-s", type=float, default=0,
                    help="after this many seconds, print every thread's stack to stderr and exit "
                    "(a hang becomes a failure that says where; 0: off)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.watchdog_s > 0:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    overlap = args.overlap == "on"

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if _on_gpu():
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    record: dict = {"rank": rank, "device": f"cuda:{torch.cuda.current_device()}" if _on_gpu() else "cpu"}
    try:
        from megatron.core import parallel_state

        record["megatron_core_dir"] = check_expected_tree()
        parallel_state.initialize_model_parallel()
        s = Setup(CONFIGS[args.config], overlap)
        record["init_params_checksum"] = s.checksum()
        from megatron.core.distributed import param_and_grad_buffer

        # Whether DDP's grad sync runs through shared_gpu's coalescing manager.
        record["grad_sync_coalescing_replaced"] = (
            param_and_grad_buffer._coalescing_manager is not dist.distributed_c10d._coalescing_manager)
        record["param_count"] = sum(p.numel() for p in s.params)
        record["param_bytes"] = sum(p.numel() * p.element_size() for p in s.params)
        record["grad_data_bytes"] = sum(b.grad_data.numel() * b.grad_data.element_size()
                                        for g in s.ddp.bucket_groups for b in g.buckets)  # fmt: skip
        record["buckets"] = s.bucket_shares()
        record["steps"] = [s.step() for _ in range(args.steps)]
        if overlap:  # without it, start_param_sync asserts: the pre-hooks' path does not exist
            record["sync"] = s.sync_alone()
        record["sync_optimizer"] = s.optimizer_sync_alone()
        record["params_checksum"] = s.checksum()
    except Exception:  # noqa: BLE001 - the traceback goes to the run's log
        print(f"memory_worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)  # the other ranks may be inside a collective: torchrun stops them
    ranks = [None] * world
    dist.all_gather_object(ranks, record)
    if rank == 0:
        doc = {"backend": args.backend, "world": world, "config_name": args.config,
               "config": CONFIGS[args.config], "steps": args.steps, "overlap": overlap,
               "phases": list(PHASES), "phase_desc": PHASE_DESC,
               "gpu": torch.cuda.get_device_name(0) if _on_gpu() else None,
               "torch": torch.__version__, "ranks": ranks}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
