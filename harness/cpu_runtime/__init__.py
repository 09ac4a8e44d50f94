"""CPU runtime layer: run megatron-core (0.17.1 and 0.19) and megatron.training unchanged on CPU ranks.

Megatron assumes a CUDA device everywhere: it allocates with ``device='cuda'``, asks
``torch.cuda`` for streams, events and RNG states, compares ``Tensor.type()`` strings with
``'torch.cuda.*Tensor'``, and relies on NCCL's all-gather semantics. This package patches
torch (and a few megatron module attributes) in-process so that the real training loop runs
on CPU with the gloo backend. It never edits a file of either megatron tree; it changes
Python objects after import, and only when asked to.

==================  ===========================================================
module              job
==================  ===========================================================
``installer``       ``install``/``uninstall``, the GPU guard, the order of items
``patching``        the record of replaced attributes, so uninstall is exact
``device``          ``device='cuda'`` -> CPU (a TorchFunctionMode); CUDA type names
``cuda_stubs``      ``torch.cuda`` streams, events, device and memory queries;
                    ``torch.accelerator`` off; MoE split sizes to the host
``rng``             CUDA RNG on the CPU generator; megatron's RNG helpers;
                    DataLoaders that keep the generator state
``compilation``     ``torch.compile`` and megatron's ``compile_helpers`` off
``collectives``     the all-gather and broadcast model: ProcessGroupNCCL's
                    temporaries, ops and group launches, executed on gloo;
                    ``record_collectives``, ``summarize``
``p2p``             a pipeline send keeps its storage until it completes, as
                    the CUDA caching allocator guarantees under NCCL
==================  ===========================================================

Usage::

    import harness.cpu_runtime as cpu_runtime
    cpu_runtime.install()          # before building megatron objects; ideally before import
    with cpu_runtime.record_collectives() as calls:
        ...                        # calls: one CollectiveRecord per all-gather

``install_if_requested()`` installs only when env ``MEGATRON_CPU_RUNTIME`` is ``1``
(``force`` installs even when a GPU is present).
"""

from harness.cpu_runtime.collectives import (
    FORM_BROADCAST,
    FORM_INTO_TENSOR,
    FORM_LIST_EQUAL,
    FORM_LIST_UNEQUAL,
    CollectiveRecord,
    model_call,
    record_collectives,
    summarize,
)
from harness.cpu_runtime.device import device_mapping_suspended
from harness.cpu_runtime.installer import (
    ENV_VAR,
    install,
    install_if_requested,
    installed_items,
    is_installed,
    uninstall,
)

__all__ = [
    "ENV_VAR",
    "install",
    "install_if_requested",
    "is_installed",
    "installed_items",
    "uninstall",
    "device_mapping_suspended",
    "record_collectives",
    "CollectiveRecord",
    "model_call",
    "summarize",
    "FORM_BROADCAST",
    "FORM_LIST_EQUAL",
    "FORM_LIST_UNEQUAL",
    "FORM_INTO_TENSOR",
]
