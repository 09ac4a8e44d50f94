"""pytest plugin: run Megatron-LM's own ``tests/unit_tests`` on CPU gloo ranks, unedited.

Loaded into a pytest that runs *inside a Megatron-LM checkout*, one process per rank, as
upstream's CI does (``torchrun --nproc-per-node N -m pytest ...``), but on CPU::

    cd build/megatron-lm/core_v0.17.1
    PYTHONPATH=<repo>/tests/upstream_tests:<repo> MEGATRON_CPU_RUNTIME=1 \\
        torchrun --standalone --nproc-per-node 2 -m pytest -p cpu_gloo_plugin \\
        -o addopts= tests/unit_tests/test_layer_wise_optimizer.py

``tests/upstream_tests/upstream_runner.py`` builds exactly this command. The plugin changes
Python objects after import, never a file of the checkout:

1. ``harness.cpu_runtime.install()`` before megatron is imported (device mapping, ``torch.cuda``
   stubs, CUDA RNG on the CPU generator, uneven ``all_gather`` on gloo; see that module).
2. ``tests.unit_tests.test_utilities.Utils.initialize_distributed`` (upstream: a TCP
   rendezvous on ``MASTER_ADDR:MASTER_PORT`` and ``backend='nccl'``) is replaced by the same
   steps with ``backend='gloo'`` on torchrun's ``env://`` rendezvous. Nothing else of ``Utils``
   changes (``set_world_size``, ``destroy_model_parallel``, ``initialize_model_parallel``).
3. ``tests/unit_tests/conftest.py`` imports ``download_and_extract_asset`` (needs ``click`` and
   ``requests``, and downloads to /opt/data) for a session fixture that only dataset tests
   use; a stub module that downloads nothing is put in its place.
4. It refuses to run when ``megatron.core`` is not imported from the checkout under test
   (``MEGATRON_LM_CHECKOUT``): the repository root, also on PYTHONPATH for ``harness``, holds
   the patched ``megatron/`` of the wheel tree.
5. Every rank writes ``$UPSTREAM_TESTS_RESULTS/rank<R>.json``: ``{nodeid: outcome}`` with
   outcome ``passed``, ``failed`` (setup, call or teardown), ``skipped`` (and the skip reason in
   ``skip_reasons``, a failure's crash message in ``fail_reasons``), after every test and at
   the end (``finished``: true). ``upstream_runner.merge_ranks`` combines the ranks.
6. Every process group a test creates (``torch.distributed.new_group``, which megatron's
   ``parallel_state.initialize_model_parallel`` calls for each of its groups) is destroyed
   after the test's teardown, then ``parallel_state.destroy_model_parallel()`` clears the
   references to them. Upstream never destroys them (``Utils.destroy_model_parallel`` only
   drops the globals, and returns early, see 7): on NCCL that is cheap, but each gloo group
   keeps its own ``pt_gloo_runloop`` threads, so a file of 80 tests ends with thousands of
   threads per rank and a machine load in the thousands.
7. At the end of the session the default process group is destroyed. Upstream's ``cleanup``
   fixture tries first, but its ``barrier(timeout=...)`` raises ``TypeError`` on torch 2.11
   (``barrier`` has no ``timeout``), so it returns early; a gloo group left alive at
   interpreter exit stalls each rank for about 30 s.
8. Every test is called right after ``torch.manual_seed(SEED)`` on every rank (after its
   fixtures). Upstream draws inputs from the unseeded default generator, and its layer-wise
   parameter-update tests fail by bf16 rounding at about 1 seed in 200, on both trees alike
   (``docs/upstream_tests.md``): seeded, both trees
   get the same inputs, so an outcome that differs between them is the series'.
9. A test that fails with ``GLOO_CONNECT_FAILURE`` (a new group's TCP mesh did not connect,
   seen under heavy load) leaves the ranks out of step: the others are inside the test's
   collectives, and the run hangs until its timeout. The rank writes its report with
   ``aborted`` (the message) and exits at once, so torchrun stops the others;
   ``upstream_runner.run`` runs the tests not finished on every rank again (``RETRIES``).
   ``$UPSTREAM_TESTS_DESELECT`` (a JSON list of node ids) deselects the tests already done.

Environment: ``MEGATRON_LM_CHECKOUT`` (the checkout root), ``UPSTREAM_TESTS_RESULTS`` (a
directory), torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``.
"""

from __future__ import annotations

import json
import os
import sys
import types
from datetime import timedelta
from pathlib import Path

from harness import cpu_runtime

cpu_runtime.install()

import pytest  # noqa: E402
import torch  # noqa: E402
from upstream_runner import GLOO_CONNECT_FAILURE  # noqa: E402  (item 9; stdlib only)

_RANK = int(os.environ.get("RANK", "0"))
SEED = 0  # item 8; not among the seed sweep's failing seeds (264, 452, 529 of 0-599 at 4 ranks)
# torchrun's rendezvous store and a counter of the default groups made on it.
_STORE = {"base": None, "generation": 0}
# Item 6: groups made by new_group since the last test teardown.
_CREATED_GROUPS: list = []
# Item 5: nodeid -> outcome, and nodeid -> skip reason.
_RESULTS: dict = {}
_SKIPS: dict = {}
_FAILS: dict = {}  # nodeid -> the failure's crash message
_DONE: list = []  # item 9: node ids whose teardown has been reported, in order


def _stub_download_module() -> None:
    """Item 3: a ``download_unit_tests_dataset`` module whose function downloads nothing."""
    name = "tests.test_utils.python_scripts.download_unit_tests_dataset"
    stub = types.ModuleType(name)

    def download_and_extract_asset(assets_dir: Path) -> bool:
        """Stub of upstream's downloader: no network here; dataset tests skip themselves."""
        print(f"[cpu_gloo_plugin] not downloading unit-test data to {assets_dir}")
        return False

    stub.download_and_extract_asset = download_and_extract_asset
    sys.modules[name] = stub


def _check_checkout() -> Path:
    """Item 4: ``megatron.core`` must come from ``$MEGATRON_LM_CHECKOUT``."""
    import megatron.core

    checkout = os.environ.get("MEGATRON_LM_CHECKOUT")
    got = Path(megatron.core.__file__).resolve().parent.parent.parent
    if checkout is None or got != Path(checkout).resolve():
        raise RuntimeError(
            f"cpu_gloo_plugin: megatron.core imported from {got}, but MEGATRON_LM_CHECKOUT="
            f"{checkout}; run pytest with the checkout as the working directory (python -m "
            "pytest puts it first on sys.path)"
        )
    return got


def _initialize_distributed_gloo() -> None:
    """Item 2: upstream ``Utils.initialize_distributed`` with gloo over torchrun's env://.

    Same observable state as upstream's: the default group over ``Utils.world_size`` ranks with
    rank ``Utils.rank``, ``torch.cuda.set_device`` called, a barrier, ``Utils.inited = True``.
    """
    from tests.unit_tests.test_utilities import Utils

    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(var, None)
    if not torch.distributed.is_initialized() and Utils.rank >= 0:
        torch.cuda.set_device(Utils.rank % torch.cuda.device_count())
        if _STORE["base"] is None:  # torchrun's store (env://), opened once per process
            _STORE["base"], _, _ = next(
                torch.distributed.rendezvous("env://", Utils.rank, Utils.world_size)
            )
            _STORE["base"].set_timeout(timedelta(minutes=2))
        # A fresh key prefix per group: tests destroy and re-create the default group.
        _STORE["generation"] += 1
        Utils.store = torch.distributed.PrefixStore(
            f"cpu_gloo_default_pg_{_STORE['generation']}", _STORE["base"]
        )
        torch.distributed.init_process_group(
            backend="gloo",
            world_size=Utils.world_size,
            rank=Utils.rank,
            store=Utils.store,
            timeout=timedelta(minutes=2),
        )
        torch.distributed.barrier()
    Utils.inited = True


_real_new_group = torch.distributed.new_group


def _recording_new_group(*args, **kwargs):
    """``torch.distributed.new_group`` that remembers the group for item 6."""
    group = _real_new_group(*args, **kwargs)
    _CREATED_GROUPS.append(group)
    return group


def _destroy_created_groups() -> None:
    """Item 6: destroy this test's groups (only the ones this rank is a member of)."""
    from megatron.core import parallel_state

    groups, _CREATED_GROUPS[:] = list(_CREATED_GROUPS), []
    for group in groups:
        if group is None or group == torch.distributed.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            torch.distributed.destroy_process_group(group)
        except (ValueError, RuntimeError):  # already destroyed, or not registered
            pass
    parallel_state.destroy_model_parallel()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After every fixture of the test is torn down, destroy its process groups (item 6)."""
    yield
    if torch.distributed.is_initialized():
        _destroy_created_groups()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Item 8: seed the default generator (and the CPU runtime's CUDA RNG) before the call."""
    torch.manual_seed(SEED)


def _install() -> None:
    """Items 2 to 4 and 6, at plugin import: before pytest imports upstream's conftest."""
    _stub_download_module()
    _check_checkout()
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_distributed = staticmethod(_initialize_distributed_gloo)
    torch.distributed.new_group = _recording_new_group
    torch.distributed.distributed_c10d.new_group = _recording_new_group


_install()


def pytest_collection_modifyitems(config, items) -> None:
    """Item 9: deselect the node ids listed in ``$UPSTREAM_TESTS_DESELECT`` (done already)."""
    path = os.environ.get("UPSTREAM_TESTS_DESELECT")
    if not path:
        return
    done = set(json.loads(Path(path).read_text()))
    keep = [item for item in items if item.nodeid not in done]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = keep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Item 5: one outcome per test; a failure in any phase wins over a pass. Item 9."""
    results, skips = _RESULTS, _SKIPS
    out = os.environ.get("UPSTREAM_TESTS_RESULTS")
    if report.failed:
        results[report.nodeid] = "failed"
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message if crash else report.longreprtext[-500:]
        _FAILS.setdefault(report.nodeid, why)
        if GLOO_CONNECT_FAILURE in report.longreprtext:
            if out:
                _write_results(Path(out), None, aborted=why)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
    elif report.skipped:
        if results.get(report.nodeid) != "failed":
            results[report.nodeid] = "skipped"
            longrepr = report.longrepr
            skips[report.nodeid] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    elif report.when == "call" and results.get(report.nodeid) is None:
        results[report.nodeid] = "passed"
    if report.when == "teardown":
        _DONE.append(report.nodeid)
        if out:
            _write_results(Path(out), None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write this rank's outcomes (item 5), then destroy the default group (item 7)."""
    out = os.environ.get("UPSTREAM_TESTS_RESULTS")
    if out:
        _write_results(Path(out), exitstatus, finished=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _write_results(out: Path, exitstatus, finished: bool = False, aborted: str = "") -> None:
    path = out / f"rank{_RANK}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "rank": _RANK,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "exitstatus": None if exitstatus is None else int(exitstatus),
        "finished": finished,
        "aborted": aborted,
        "results": _RESULTS,
        "skip_reasons": _SKIPS,
        "fail_reasons": _FAILS,
        "done": _DONE,
    }
    tmp = path.with_suffix(".json.tmp")  # a rank stopped mid-write leaves its last report
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
