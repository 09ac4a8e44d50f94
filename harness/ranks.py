"""Rank-process lifecycle under a launcher (torchrun, harness/fork_ranks.py): agree on failures, bound waits, exit cleanly.

Three problems of multi-rank workers, solved once here:

* **A failure on some ranks only.** The other ranks wait inside a collective for a peer
  that left it, until the process-group timeout (30 min on gloo by default). ``Outcomes``
  makes every rank publish the outcome of each step in the c10d store (not a collective,
  so it cannot pair with a collective of a stuck peer) and wait for the others' outcomes.
  All ranks failed alike: the failure is data (e.g. the pristine tree crashing where the
  series fixes it) and the run goes on. Some failed: the first failing rank's traceback is
  printed and the rank process exits 1, so the launcher stops the job at once.
* **Waits sized by measurement.** ``Outcomes`` times each step; the wait for the others'
  outcomes and the process group's own timeout are ``factor`` times the slowest step so
  far, with a floor for the first step (start-up and model building are in it).
* **Exit.** ``exit_rank`` flushes stdout/stderr, destroys the process group and ends the
  process with ``os._exit``: gloo's threads can abort the interpreter's own teardown
  ("terminate called without an active exception"), which the launcher reports as a failure
  of a job that finished. ``end_training_rank`` does it for a ``pretrain()`` rank, after
  closing the metric writers that ``os._exit`` would not flush.

Units: seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Dict, List, Optional

import torch.distributed as dist

#: Marker of the block ``Outcomes`` prints for a partial failure (tests look for it).
FIRST_FAILURE = "=== first failing rank"


def _end_child_processes(timeout_s: float = 10.0) -> None:
    """Terminate and join this process's multiprocessing children, as multiprocessing's
    atexit hook would; ``os._exit`` skips that hook. Without it the persistent worker that
    megatron's torch_dist checkpoint saving starts outlives the rank as an orphan (about
    400 MiB each, one per rank and checkpointing run)."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout_s)
        if child.is_alive():
            child.kill()


def exit_rank(code: int = 0) -> None:
    """End this rank process now: flush, end child processes, destroy the process group,
    ``os._exit(code)``.

    Call it last, after every rank passed its final collective (e.g. a barrier), so that
    no peer still waits on this one. Never returns.
    """
    try:
        _end_child_processes()
        sys.stdout.flush()
        sys.stderr.flush()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def end_training_rank() -> None:
    """The last call of a ``megatron.training.pretrain`` rank: close the writers, meet, exit 0.

    ``pretrain()`` flushes TensorBoard at the end of ``train()`` but may log validation
    after that, and ``os._exit`` skips the writers' atexit flush: so the TensorBoard
    writer is closed (flushes every pending event) and wandb finished first. Then every
    rank meets at a barrier and ``exit_rank(0)`` ends the process. Never returns.
    """
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    writer = get_tensorboard_writer()
    if writer is not None:
        writer.close()
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.finish()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    exit_rank(0)


class Outcomes:
    """Per-step outcome agreement across the ranks of the default process group.

    Usage (every rank runs the same steps in the same order)::

        outcomes = Outcomes()
        for key in steps:
            with outcomes.step(key) as step:
                step.result = run(key)          # may raise
            results[key] = step.result          # {"error": ...} when every rank raised

    Args:
        floor_s: wait bound for the first step, and the least bound for any step.
        factor: bound = ``factor`` x the slowest step measured so far (at least ``floor_s``).
        prefix: store key prefix (one ``Outcomes`` per prefix and run).
    """

    def __init__(self, floor_s: float = 30.0, factor: float = 4.0, prefix: str = "outcomes"):
        self.floor_s = floor_s
        self.factor = factor
        self.prefix = prefix
        self.slowest_s = 0.0
        self._index = 0
        self._store = dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._set_pg_timeout()

    @property
    def bound_s(self) -> float:
        """How long a rank waits for the others' outcome of a step (seconds)."""
        return max(self.floor_s, self.factor * self.slowest_s)

    def _set_pg_timeout(self) -> None:
        """Collectives of a peer that never comes fail after ``2 x bound_s``, not 30 min."""
        try:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=2 * self.bound_s))
        except (AttributeError, RuntimeError):  # an older torch: keep the group's own timeout
            pass

    def step(self, key: str) -> "_Step":
        self._index += 1
        return _Step(self, key, f"{self.prefix}/{self._index}")

    # Called by _Step when the block ends.
    def _agree(self, step: "_Step", elapsed_s: float) -> None:
        mine = {"rank": self.rank, "key": step.key, "t": time.time(), "error": step.error,
                "traceback": step.traceback}
        self._store.set(f"{step.store_key}/{self.rank}", json.dumps(mine))
        keys = [f"{step.store_key}/{r}" for r in range(self.world)]
        try:
            self._store.wait(keys, timedelta(seconds=self.bound_s))
        except Exception:  # noqa: BLE001 - the store's timeout error type varies by version
            self._fail(step, self._published(keys),
                       f"not every rank finished {step.key!r} within {self.bound_s:.0f} s "
                       f"({self.factor:g} x the slowest step so far, at least {self.floor_s:g} s)")
        outcomes = self._published(keys)
        failed = [o for o in outcomes if o["error"] is not None]
        if failed and len(failed) < self.world:
            self._fail(step, outcomes, f"{len(failed)} of {self.world} ranks raised in {step.key!r}")
        if failed:
            step.result = {"error": step.error}
            dist.barrier()  # every rank raised: re-align before the next step
        self.slowest_s = max(self.slowest_s, elapsed_s)
        self._set_pg_timeout()

    def _published(self, keys: List[str]) -> List[Dict]:
        out = []
        for key in keys:
            if self._store.check([key]):
                out.append(json.loads(self._store.get(key)))
        return out

    def _fail(self, step: "_Step", outcomes: List[Dict], why: str) -> None:
        """Print the first failing rank's traceback and end this rank with exit code 1."""
        failed = sorted((o for o in outcomes if o["error"] is not None), key=lambda o: o["t"])
        first = failed[0] if failed else None
        missing = sorted(set(range(self.world)) - {o["rank"] for o in outcomes})
        lines = [f"{FIRST_FAILURE}: {first['rank'] if first else 'none'} ({why}; seen by rank "
                 f"{self.rank}; ranks without an outcome: {missing or 'none'}) ==="]
        if first is not None:
            lines += [f"step {first['key']!r} on rank {first['rank']} at t={first['t']:.3f}:",
                      first["traceback"].rstrip()]
        lines.append("=== end ===")
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # peers may be inside a collective: no teardown that could wait on them


class _Step:
    """Context of one step: catches its exception, then agrees with the other ranks."""

    def __init__(self, outcomes: Outcomes, key: str, store_key: str):
        self.outcomes = outcomes
        self.key = key
        self.store_key = store_key
        self.result: Optional[Dict] = None
        self.error: Optional[str] = None
        self.traceback: Optional[str] = None

    def __enter__(self) -> "_Step":
        self._t0 = time.monotonic()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            if not isinstance(exc, Exception):
                return False  # KeyboardInterrupt, SystemExit: not a step outcome
            self.error = f"{exc_type.__name__}: {exc}"
            self.traceback = "".join(traceback.format_exception(exc_type, exc, tb))
        self.outcomes._agree(self, time.monotonic() - self._t0)
        return True
