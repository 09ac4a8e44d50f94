"""The GPU check's memory worker, run as on a GPU as far as its random generators go.

    python memory_worker_rng_wrapper.py PRIOR_SEED -- MEMORY_WORKER_ARGS...

On CPU the CPU runtime layer backs the CUDA generator with the CPU one
(``harness/cpu_runtime/rng.py``), so megatron's ``model_parallel_cuda_manual_seed`` also
seeds the generator that draws the weights built on CPU, and a worker that forgets to seed
that one still starts from fixed weights. On a GPU the two are separate. This wrapper gives
the "CUDA" seeding calls (``torch.cuda.manual_seed``, megatron's ``_get/_set_cuda_rng_state``)
a generator of their own, puts the CPU generator in the state ``torch.manual_seed(PRIOR_SEED)``
leaves (a process that drew other numbers before), then runs the worker's ``main``.
"""

from __future__ import annotations

import sys

from harness.gpu_check import memory_worker  # installs the CPU runtime layer (MEGATRON_CPU_RUNTIME=1)

import megatron.core.tensor_parallel.random as mrandom  # noqa: E402
import torch  # noqa: E402

cuda_generator = torch.Generator()
torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda seed: cuda_generator.manual_seed(int(seed))
mrandom._get_cuda_rng_state = lambda *args, **kwargs: cuda_generator.get_state()
mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: cuda_generator.set_state(state)

if __name__ == "__main__":
    prior, rest = sys.argv[1], sys.argv[2:]
    torch.manual_seed(int(prior))
    sys.exit(memory_worker.main(rest[1:] if rest[:1] == ["--"] else rest))
