"""Start the ranks of one CPU run as forks of a process that imported torch (and megatron) once.

``python harness/fork_ranks.py --nproc-per-node N [--preload MOD,...] SCRIPT [ARGS...]`` runs
``SCRIPT ARGS`` in N rank processes on this node, as ``torchrun --standalone --nproc-per-node
N SCRIPT ARGS`` does, with what a rank sees unchanged: each rank is its own OS process with
torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``ROLE_*``, ``MASTER_ADDR``/``MASTER_PORT`` of a c10d store hosted here as
torchrun's agent hosts it, ``TORCHELASTIC_*``), ``sys.argv = [SCRIPT, *ARGS]``,
``sys.path[0]`` = the script's folder, and the script runs as ``__main__``.

Why: a CPU rank spends about 5 s of CPU importing torch and megatron before its first
collective (measured on 2 cores: ``import torch`` 2.4 s; megatron.core + megatron.training
another 2.4 s; torchrun's own start 2.5 s). Here the imports happen once per run, before the
fork, and the ranks share them copy-on-write.

``--preload`` (comma-separated modules): imported before the fork, after
``harness.cpu_runtime.install_if_requested()`` (the scripts that train install the runtime
before they import megatron, which binds ``torch.compile`` and the CUDA RNG helpers at import
time; installing is idempotent, so their own call is then a no-op). Without ``--preload``
only torch is imported: a script that installs the runtime itself, or tests it, sees a
process as fresh as under torchrun.

Failures, as torchrun's local agent handles them: the first rank that exits non-zero (or is
killed) ends the run: the others get SIGTERM, and SIGKILL after ``--term-timeout`` seconds;
one line on stderr names the rank, its exit code or signal; the exit code is 1. SIGTERM or
SIGINT to this process is passed to the ranks.

CPU only (``harness.launch`` uses torchrun for GPUs): a process that forks must not have
initialised CUDA, and NCCL ranks are started by torchrun on every cluster. Refuses, with
exit code 2, a missing script, ``--nproc-per-node`` < 1, or a preload module that does not
import.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence

#: Where ranks reach the store, as ``torchrun --standalone`` (one node).
MASTER_ADDR = "127.0.0.1"


def rank_env(rank: int, nproc: int, port: int, run_id: str) -> Dict[str, str]:
    """The variables torchrun's ``LocalElasticAgent._start_workers`` gives rank ``rank`` of a
    one-node job of ``nproc`` ranks whose agent hosts the c10d store at ``MASTER_ADDR:port``
    (torch/distributed/elastic/agent/server/local_elastic_agent.py)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_rank(rank: int, nproc: int, read_fd: int, script: Path, script_args: Sequence[str]) -> None:
    """In the forked child: wait for the store's port, become rank ``rank``, run the script."""
    with os.fdopen(read_fd, "rb") as pipe:
        port, run_id = pipe.read().decode().split()
    os.environ.update(rank_env(rank, nproc, int(port), run_id))
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # reported as the interpreter reports an uncaught exception
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next  # our frames and runpy's: the traceback starts in the script
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # normal interpreter exit: atexit handlers run, as in a fresh process


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _end(pids: Dict[int, int], term_timeout_s: float) -> None:
    """SIGTERM every rank still running, SIGKILL those left after ``term_timeout_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + term_timeout_s
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.pop(pid, None)
        else:
            time.sleep(0.05)
    for pid in list(pids):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        pids.pop(pid, None)


def main(argv: Optional[List[str]] = None) -> int:
    """Parse, preload, fork the ranks, host the store, wait. Returns the exit code (0, 1, 2)."""
    parser = argparse.ArgumentParser(prog="fork_ranks.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--preload", default="", help="comma-separated modules to import before the fork")
    parser.add_argument("--term-timeout", type=float, default=30.0,
                        help="seconds between SIGTERM and SIGKILL for the other ranks after a failure")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    script = Path(ns.script).resolve()
    if ns.nproc_per_node < 1 or not script.is_file():
        print(f"fork_ranks: need --nproc-per-node >= 1 (got {ns.nproc_per_node}) and a script file "
              f"(got {ns.script})", file=sys.stderr)
        return 2
    # Our own folder (harness/) is sys.path[0] when run by path: its modules (data, trees, ...)
    # must not shadow what the ranks import. Each rank puts its script's folder there instead.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    import torch  # noqa: F401  (the import every rank pays; torch.distributed with it)
    import torch.distributed  # noqa: F401

    modules = [m for m in ns.preload.split(",") if m]
    try:
        if modules:
            from harness import cpu_runtime

            cpu_runtime.install_if_requested()
        for name in modules:
            __import__(name)
    except Exception:
        traceback.print_exc()
        print(f"fork_ranks: --preload {ns.preload} failed to import (see above)", file=sys.stderr)
        return 2

    sys.stdout.flush()
    sys.stderr.flush()
    pids: Dict[int, int] = {}  # pid -> rank
    pipes: List[int] = []
    for rank in range(ns.nproc_per_node):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in pipes:
                os.close(fd)
            os.close(write_fd)
            _run_rank(rank, ns.nproc_per_node, read_fd, script, ns.script_args)
        os.close(read_fd)
        pipes.append(write_fd)
        pids[pid] = rank

    # The store after the fork: its server thread stays in this process, and no rank is a
    # fork of a threaded process.
    from torch.distributed import TCPStore

    store = TCPStore(MASTER_ADDR, 0, is_master=True, wait_for_workers=False)
    run_id = f"fork_ranks-{os.getpid()}"
    for fd in pipes:
        os.write(fd, f"{store.port} {run_id}".encode())
        os.close(fd)

    def forward(signum, _frame):
        _end(pids, ns.term_timeout)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while pids:
        pid, status = os.waitpid(-1, 0)
        rank = pids.pop(pid)
        if status != 0:
            print(f"fork_ranks: rank {rank} (pid {pid}) failed: {_describe(status)}; ending the "
                  f"other {len(pids)} rank(s)", file=sys.stderr, flush=True)
            _end(pids, ns.term_timeout)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
