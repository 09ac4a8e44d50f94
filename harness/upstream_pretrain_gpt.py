"""Run Megatron-LM's own ``pretrain_gpt.py`` (from a checkout) with the CPU runtime layer.

The harness's one training entry (``harness.launch.PRETRAIN_SCRIPT``: functional cases, the
GPU check): everything that trains is upstream's code, the
entry point users launch included (``pretrain_gpt.py``, its ``model_provider.py`` and
``gpt_builders.py``, ``megatron.training.pretrain``). This file only does what that entry
cannot do on CPU, before it runs:

1. ``harness.cpu_runtime.install_if_requested()`` (``MEGATRON_CPU_RUNTIME=1``), before megatron
   is imported: megatron binds ``torch.compile``, the CUDA RNG helpers and device defaults
   at import time. ``MEGATRON_SHARED_GPU=1`` (the GPU check on one GPU) installs
   ``harness.gpu_check.shared_gpu``: several gloo ranks on one GPU.
   ``MEGATRON_PARAM_SYNC_TRACE=1`` installs ``harness.param_sync_trace`` (param all-gathers
   counted per model chunk and dispatch path; one summary line per rank at the end).
2. Import path: the megatron tree selected by ``PYTHONPATH`` (``harness.trees.env_for_tree``:
   pristine, patched or a mutant tree) stays first; the checkout root is appended after it,
   so that ``pretrain_gpt.py`` finds ``model_provider``/``gpt_builders`` there while
   ``megatron`` still comes from the selected tree (the checkout's own ``megatron/`` is
   byte-identical to the pristine wheel tree's Python files). ``MEGATRON_EXPECT_TREE`` is
   checked (``harness.trees.check_expected_tree``): a run never trains on the wrong tree.
3. ``MEGATRON_PARAM_SYNC_RECORD=DIR``: ``harness.param_sync_recorder`` wraps the layer-wise
   param sync's entry points and ``train_step`` (per step: megatron's and NCCL's bytes of the
   param sync, the step peak) and each rank writes ``DIR/rank<R>.json`` when ``pretrain``
   returns or raises.
4. After ``pretrain`` returns, ``harness.ranks.end_training_rank()``: writers closed, a
   barrier, ``os._exit(0)``; a gloo group torn down at interpreter exit can abort the process.
   On an exception the process group is destroyed and the exception re-raised.

Then ``pretrain_gpt.py`` runs as ``__main__`` with the command line unchanged (upstream's
flag names). Usage, as ``harness.launch.pretrain_command`` builds it::

    MEGATRON_CPU_RUNTIME=1 PYTHONPATH=<tree>:<repo> python harness/fork_ranks.py --nproc-per-node 2 \\
        --preload <PRETRAIN_PRELOAD> harness/upstream_pretrain_gpt.py --distributed-backend gloo ...

(``torchrun --nproc-per-node 2`` in place of ``fork_ranks.py`` runs the same ranks.)

Environment: ``MEGATRON_LM_CHECKOUT`` (the checkout whose ``pretrain_gpt.py`` runs; default
``build/megatron-lm/core_v0.17.1``, built by ``scripts/setup.sh``, else ``$MEGATRON_LM``, the
user's checkout that ``scripts/launch_pretrain_gpt.sh`` and the Docker image use; the series
does not touch ``pretrain_gpt.py``, so a patched checkout serves as well),
``MEGATRON_CPU_RUNTIME``, ``MEGATRON_SHARED_GPU``, ``MEGATRON_PARAM_SYNC_TRACE``,
``MEGATRON_PARAM_SYNC_RECORD``, ``MEGATRON_EXPECT_TREE``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKOUT = REPO_ROOT / "build" / "megatron-lm" / "core_v0.17.1"


def checkout_entry() -> Path:
    """``pretrain_gpt.py`` of ``$MEGATRON_LM_CHECKOUT``, the default checkout or ``$MEGATRON_LM``.

    Raises:
        FileNotFoundError: none of them holds pretrain_gpt.py (run scripts/setup.sh).
    """
    if os.environ.get("MEGATRON_LM_CHECKOUT"):
        candidates = [Path(os.environ["MEGATRON_LM_CHECKOUT"])]
    else:
        candidates = [DEFAULT_CHECKOUT] + (
            [Path(os.environ["MEGATRON_LM"])] if os.environ.get("MEGATRON_LM") else []
        )
    for checkout in candidates:
        entry = checkout.resolve() / "pretrain_gpt.py"
        if entry.is_file():
            return entry
    raise FileNotFoundError(
        f"no pretrain_gpt.py in {', '.join(map(str, candidates))}: scripts/setup.sh builds the "
        "Megatron-LM checkout (or set MEGATRON_LM_CHECKOUT to one at core_v0.17.1)"
    )


#: ``1``: train through ``pretrain()``'s model-provider API instead of the model config that
#: core_v0.19.0's ``pretrain_gpt.py`` passes (``use_model_provider_api``).
MODEL_PROVIDER_ENV = "MEGATRON_MODEL_PROVIDER_API"


def use_model_provider_api() -> None:
    """Make ``pretrain_gpt.py``'s ``pretrain(cfg, ...)`` call build the model from a provider.

    core_v0.19.0's ``pretrain_gpt.py`` passes a config container with a model config, so
    ``setup_model_and_optimizer`` builds the model with ``builder.build_distributed_models``
    (``megatron/training/models/dist_utils.py``), which never computes the layer-wise param
    layout: ``--[no-]use-layer-wise-param-layout`` is ignored and the legacy path trains.
    ``pretrain()`` still takes ``model_provider`` with ``cfg.model`` None, as core_v0.18.2's
    ``pretrain_gpt.py`` passes it; then ``get_model`` -> ``wrap_model_chunks_with_ddp``
    (``megatron/training/training.py``) honours the flag, and its default is the layout path.
    This wraps ``megatron.training.pretrain`` (before ``pretrain_gpt.py`` imports it) to make
    that call, with the checkout's own ``model_provider`` and ``gpt_builder``.

    Raises:
        TypeError: a ``pretrain`` call that already passes a model provider.
    """
    import dataclasses
    from functools import partial

    import megatron.training

    real = megatron.training.pretrain

    def pretrain(cfg_container, *args, **kwargs):
        from gpt_builders import gpt_builder
        from model_provider import model_provider

        if len(args) > 3 or kwargs.get("model_provider") is not None:
            raise TypeError(f"{MODEL_PROVIDER_ENV}=1: pretrain() already got a model provider")
        kwargs["model_provider"] = partial(model_provider, gpt_builder)
        return real(dataclasses.replace(cfg_container, model=None), *args, **kwargs)

    megatron.training.pretrain = pretrain


def main() -> None:
    """Install the CPU runtime, fix the import path, run upstream's entry as __main__."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    from harness import cpu_runtime

    cpu_runtime.install_if_requested()
    from harness.gpu_check import shared_gpu

    shared_gpu.install_if_requested()
    from harness import param_sync_recorder, param_sync_trace

    # The recorder first: the trace reads its wrapper's caller frame, which must be megatron's.
    param_sync_recorder.install_if_requested()
    param_sync_trace.install_if_requested()
    entry = checkout_entry()
    sys.path.append(str(entry.parent))
    from harness.trees import check_expected_tree

    tree = check_expected_tree()
    if os.environ.get(MODEL_PROVIDER_ENV) == "1":
        use_model_provider_api()
    rank = os.environ.get("RANK", "0")
    print(
        f"[upstream_pretrain_gpt] rank {rank}: {entry} with megatron from {tree} "
        f"(cpu runtime: {'on' if cpu_runtime.is_installed() else 'off'})",
        flush=True,
    )
    sys.argv[0] = str(entry)
    try:
        runpy.run_path(str(entry), run_name="__main__")
    except BaseException:
        import torch

        param_sync_recorder.write_if_installed(tree)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
    param_sync_trace.report()
    param_sync_recorder.write_if_installed(tree)
    from harness.ranks import end_training_rank

    end_training_rank()  # writers closed, barrier, os._exit(0): no gloo teardown at exit


if __name__ == "__main__":
    main()
