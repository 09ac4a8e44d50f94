"""Per training step, what the layer-wise param sync allocates, recorded inside a training rank.

Installed by ``harness/upstream_pretrain_gpt.py`` when ``MEGATRON_PARAM_SYNC_RECORD`` names
a folder (the functional runner sets it to ``<run dir>/param_sync``); each rank then writes
``rank<R>.json`` there when ``pretrain()`` returns (or raises). It wraps, from outside the
megatron tree and identically for every tree, the public entry points of the layer-wise
param sync and megatron's ``train_step``:

* ``_ParamAndGradBucketGroup.start_param_sync`` / ``finish_param_sync``
  (``megatron/core/distributed/param_and_grad_buffer.py``): the async gather of the forward
  pre-hooks and ``param_sync_func``, and the forced sync of eval and checkpoint saves;
  a bucket group whose params have ``allreduce=False`` is an expert bucket group (DDP's
  ``expert_parallel_bucket_groups``, gathered on the expert-DP group);
* ``LayerWiseDistributedOptimizer.allgather_params``
  (``megatron/core/optimizer/layer_wise_optimizer.py``): the optimizer path (no
  ``--overlap-param-gather``);
* ``megatron.training.training.train_step``: the step boundaries and the step peak.

Per outermost entry-point call (a ``start_param_sync`` that a ``finish_param_sync`` issues
for the next bucket group counts inside that call):

* ``megatron_bytes``, ``megatron_alloc_calls``: fresh tensor storages created by ATen ops
  inside the call (``harness.alloc_counter.AllocationCounter``), less the stand-ins for
  NCCL's own temporaries that the collective model allocates through torch on gloo
  (``harness.bench.counters.model_standin_bytes``);
* ``calls``, ``ops``, ``zero_size_ops``, ``launches``, ``nccl_temporary_bytes``,
  ``wire_bytes``: ``harness.cpu_runtime.collectives.summarize`` of the calls' records
  (``record_collectives()``): what ProcessGroupNCCL would allocate and issue;
* ``group_size``: the size of the process group of the calls.

Per step, ``step_peak_bytes``: the most bytes alive at once among the tensor storages
allocated inside ``train_step`` (forward, backward, optimizer step, param sync, the
collective model's NCCL stand-ins), above the step's start; an ``AllocationCounter`` around
the whole step. CPU tensors have no caching allocator to ask, so this is the measurement on
CPU and the same one on GPU; it does not subtract frees of tensors allocated before the
step (as ``harness.memory_probe.CpuProbe``'s profiler measure). Calls outside any
``train_step`` (forced syncs of eval and checkpoint saves between steps) are kept per
preceding step under ``between_steps``.

Recording runs the same ATen ops in the same order (dispatch-mode observers only), so the
training numerics are unchanged; the functional cases check that bit for bit.
Units: bytes and counts, per rank.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional

#: Folder each rank writes ``rank<R>.json`` into; recording is off when unset or empty.
ENV_VAR = "MEGATRON_PARAM_SYNC_RECORD"
#: Version of the rank file's layout (``to_json``).
SCHEMA = 1
KINDS = ("dense", "expert", "optimizer")
KIND_DESC = {
    "dense": "DDP bucket groups, gathered on the DP group",
    "expert": "DDP expert_parallel_bucket_groups, gathered on the expert-DP group",
    "optimizer": "LayerWiseDistributedOptimizer.allgather_params() (no --overlap-param-gather)",
}
STEP_PEAK_DESC = (
    "most bytes alive at once among tensors allocated inside train_step, above the step's "
    "start (dispatch-level allocation counter, rank's own thread and autograd)"
)
SYNC_DESC = (
    "megatron_bytes: tensor storages allocated inside the layer-wise param sync entry points "
    "(allocation counter, collective-model stand-ins excluded); nccl_temporary_bytes, ops, "
    "launches, wire_bytes: the collective model (what ProcessGroupNCCL would do)"
)
_SUM_FIELDS = ("entry_calls", "megatron_bytes", "megatron_alloc_calls", "calls", "ops",
               "zero_size_ops", "launches", "nccl_temporary_bytes", "wire_bytes")


def rank_file(folder: Path, rank: int) -> Path:
    """``folder/rank<R>.json``."""
    return Path(folder) / f"rank{int(rank)}.json"


def empty_totals() -> Dict[str, int]:
    """Zero totals of one kind (the fields in the module docstring)."""
    return {**{k: 0 for k in _SUM_FIELDS}, "group_size": 0}


def add_totals(into: Dict[str, int], call: Dict[str, int]) -> None:
    """Add one call's (or another total's) fields into ``into``; group_size is kept as the max."""
    for k in _SUM_FIELDS:
        into[k] += int(call.get(k, 0))
    into["group_size"] = max(into["group_size"], int(call.get("group_size", 0)))


class ParamSyncRecorder:
    """The per-step records of one rank; ``install`` wraps the entry points (see module docstring).

    Attributes:
        steps: {step: {"param_sync": {kind: totals}, "step_peak_bytes": int,
            "step_alloc_bytes": int}}; step = megatron's iteration number of the step (1-based).
        between_steps: {step: {"param_sync": {kind: totals}}}: calls after that step's
            ``train_step`` returned and before the next began (0: before the first).
    """

    def __init__(self, backend: Optional[str] = None):
        # Of the default process group ("gloo", "nccl"); None: asked at the first call.
        self.backend = backend
        self.steps: Dict[int, Dict[str, Any]] = {}
        self.between_steps: Dict[int, Dict[str, Any]] = {}
        self._step: Optional[int] = None  # inside train_step of this step
        self._last_step = 0
        self._depth = 0  # nesting of entry-point calls on this rank
        self._kinds: Dict[int, str] = {}  # id(bucket group) -> kind

    # ---------------------------------------------------------- recording
    def _slot(self) -> Dict[str, Any]:
        if self._step is not None:
            return self.steps.setdefault(self._step, {"param_sync": {}})
        return self.between_steps.setdefault(self._last_step, {"param_sync": {}})

    def bucket_group_kind(self, bucket_group) -> str:
        """"expert" when the group's params are expert-parallel (``allreduce`` False), else "dense"."""
        key = id(bucket_group)
        if key not in self._kinds:
            expert = any(not getattr(p, "allreduce", True) for p in bucket_group.params)
            self._kinds[key] = "expert" if expert else "dense"
        return self._kinds[key]

    def record_call(self, kind: str, fn: Callable, *args, **kwargs):
        """Run ``fn`` and add its allocations and collectives to the current step's ``kind``.

        Nested entry-point calls run unrecorded inside the outermost one, which sees them.
        """
        if self._depth:
            return fn(*args, **kwargs)
        from harness.alloc_counter import AllocationCounter
        from harness.bench.counters import model_standin_bytes
        from harness.cpu_runtime import collectives

        self._depth += 1
        try:
            with collectives.record_collectives() as records, AllocationCounter() as counter:
                out = fn(*args, **kwargs)
        finally:
            self._depth -= 1
        if self.backend is None:
            import torch.distributed as dist

            self.backend = str(dist.get_backend())
        standin = model_standin_bytes(records, self.backend)
        # The model allocates one stand-in per call with an NCCL temporary.
        standin_calls = sum(1 for r in records if r.nccl_temporary_bytes) if standin else 0
        call = {
            "entry_calls": 1,
            "megatron_bytes": counter.temporary_bytes - standin,
            "megatron_alloc_calls": counter.alloc_calls - standin_calls,
            **collectives.summarize(records),
            "group_size": max((r.world for r in records), default=0),
        }
        totals = self._slot()["param_sync"].setdefault(kind, empty_totals())
        add_totals(totals, call)
        return out

    @contextlib.contextmanager
    def training_step(self, step: int):
        """The region of training step ``step``: its param syncs and its peak."""
        from harness.alloc_counter import AllocationCounter

        self._step = step
        slot = self._slot()
        try:
            with AllocationCounter() as counter:
                yield
        finally:
            slot["step_peak_bytes"] = counter.peak_extra_bytes
            slot["step_alloc_bytes"] = counter.temporary_bytes
            self._step, self._last_step = None, step

    # ---------------------------------------------------------- output
    def to_json(self, rank: int, world: int, tree: str) -> Dict[str, Any]:
        """The rank file's content (``SCHEMA``); steps as string keys, sorted."""

        def keyed(d):
            return {str(k): d[k] for k in sorted(d)}

        return {
            "schema": SCHEMA, "rank": rank, "world": world, "tree": tree, "backend": self.backend or "",
            "kinds": KIND_DESC, "step_peak": STEP_PEAK_DESC, "param_sync": SYNC_DESC,
            "steps": keyed(self.steps), "between_steps": keyed(self.between_steps),
        }  # fmt: skip

    def write(self, folder: Path, tree: str = "") -> Path:
        """Write ``folder/rank<R>.json`` (R: the default group's rank, 0 without one)."""
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        path = rank_file(folder, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(rank, world, tree), indent=1) + "\n")
        return path

    # ---------------------------------------------------------- install
    def install(self) -> None:
        """Wrap the entry points on megatron's classes and ``megatron.training.training.train_step``.

        Imports those megatron modules (after the CPU runtime layer, before training).
        """
        from megatron.core.distributed import param_and_grad_buffer as pgb
        from megatron.core.optimizer import layer_wise_optimizer as lwo
        from megatron.training import training

        recorder = self
        bucket_group_cls = pgb._ParamAndGradBucketGroup

        def wrap_bucket_group(name):
            real = getattr(bucket_group_cls, name)

            @functools.wraps(real)
            def wrapper(self, *args, **kwargs):
                return recorder.record_call(recorder.bucket_group_kind(self), real, self, *args, **kwargs)

            setattr(bucket_group_cls, name, wrapper)

        wrap_bucket_group("start_param_sync")
        wrap_bucket_group("finish_param_sync")
        real_allgather = lwo.LayerWiseDistributedOptimizer.allgather_params

        @functools.wraps(real_allgather)
        def allgather_params(self, *args, **kwargs):
            return recorder.record_call("optimizer", real_allgather, self, *args, **kwargs)

        lwo.LayerWiseDistributedOptimizer.allgather_params = allgather_params
        real_train_step = training.train_step

        @functools.wraps(real_train_step)
        def train_step(*args, **kwargs):
            iteration = kwargs.get("iteration")
            step = recorder._last_step + 1 if iteration is None else int(iteration) + 1
            with recorder.training_step(step):
                return real_train_step(*args, **kwargs)

        training.train_step = train_step


_installed: Optional[ParamSyncRecorder] = None


def install_if_requested() -> Optional[ParamSyncRecorder]:
    """Install a recorder when ``$MEGATRON_PARAM_SYNC_RECORD`` is set; returns it (or None)."""
    global _installed
    if not os.environ.get(ENV_VAR) or _installed is not None:
        return _installed
    recorder = ParamSyncRecorder()
    recorder.install()
    _installed = recorder
    return recorder


def write_if_installed(tree: str = "") -> Optional[Path]:
    """Write this rank's file if a recorder is installed; returns its path."""
    if _installed is None:
        return None
    return _installed.write(Path(os.environ[ENV_VAR]), tree)
