"""Count a training rank's param all-gathers per model chunk and per dispatch path.

With ``--overlap-param-gather`` megatron dispatches a bucket group's param all-gather
(``core/distributed/param_and_grad_buffer.py:_ParamAndGradBucketGroup.start_param_sync``)
from one of these places, each a path of its own:

==============================  ===========================================================
path                            caller
==============================  ===========================================================
``schedule_param_sync_func``    ``config.param_sync_func[chunk]`` (= that chunk's
                                ``DistributedDataParallel.start_param_sync``) in
                                ``core/pipeline_parallel/schedules.py``: the interleaved
                                schedule with ``align_param_gather`` (megatron's default)
``chained_next_bucket_group``   ``finish_param_sync`` of the previous bucket group
                                (``next_param_gather_bucket_group``, within one chunk)
``pre_hook_self``               ``finish_param_sync`` of the same bucket group, not yet
                                dispatched (a forward pre-hook)
``forced``                      ``DistributedDataParallel.start_param_sync(force_sync=True)``
                                (``disable_forward_pre_hook`` before eval, checkpoint save)
==============================  ===========================================================

Model chunks are numbered in the order their ``DistributedDataParallel`` wrappers are
built (``training.py:get_model``: virtual pipeline stage 0, 1, ...). ``max_chunks_in_flight``
is the largest number of chunks that had an async gather pending (handle not yet waited)
at the same time: 2 means a second chunk's gather was dispatched into its ``grad_data``
while the first chunk's was still receiving.

Enabled in a rank by env ``MEGATRON_PARAM_SYNC_TRACE=1`` (``harness/upstream_pretrain_gpt.py``
installs it after the CPU runtime layer); ``report()`` prints one line per rank,
``[param_sync_trace] {json}``, at the end of training. Only Python wrappers that count:
the calls, their arguments and results are the real ones, so numerics are unchanged.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Dict, List

ENV_VAR = "MEGATRON_PARAM_SYNC_TRACE"
#: Prefix of the line ``report`` prints (``parse_log`` looks for it).
MARKER = "[param_sync_trace] "
_SCHEDULES_FILE = os.path.join("pipeline_parallel", "schedules.py")

_installed = False
# Bucket groups in registration order; their info by id() (the groups stay referenced here).
_groups: List[object] = []
_info: Dict[int, Dict[str, object]] = {}
_chunks = 0
_dispatch: Dict[int, Dict[str, int]] = {}
_waited: Dict[int, int] = {}
_max_chunks_in_flight = 0
_max_groups_in_flight = 0


def _register(ddp) -> None:
    """Number the chunk ``ddp`` wraps and remember its dense and expert bucket groups."""
    global _chunks
    chunk = _chunks
    _chunks += 1
    _dispatch[chunk], _waited[chunk] = {}, 0
    for expert, groups in ((False, ddp.bucket_groups), (True, ddp.expert_parallel_bucket_groups)):
        for index, group in enumerate(groups):
            _groups.append(group)
            _info[id(group)] = {
                "chunk": chunk, "index": index, "expert": expert, "buckets": len(group.buckets),
                "numel": sum(int(b.grad_data.numel()) for b in group.buckets),
            }


def _path(group, force_sync: bool, ddp_class) -> str:
    """Which caller dispatched ``group``'s gather (see the module docstring)."""
    caller = sys._getframe(2)  # 0: _path, 1: the wrapper, 2: its caller
    if caller.f_code.co_name == "_start_bucket_group_param_sync" and isinstance(caller.f_locals.get("self"), ddp_class):
        # 0.19: DistributedDataParallel.start_param_sync dispatches each group through this helper.
        caller = caller.f_back
    name = caller.f_code.co_name
    if name == "finish_param_sync":
        return "pre_hook_self" if caller.f_locals.get("self") is group else "chained_next_bucket_group"
    if name == "start_param_sync" and isinstance(caller.f_locals.get("self"), ddp_class):
        if force_sync:
            return "forced"
        outer = caller.f_back
        if outer is not None and outer.f_code.co_filename.endswith(_SCHEDULES_FILE):
            return "schedule_param_sync_func"
        return f"ddp_start_param_sync_from_{outer.f_code.co_name if outer else 'unknown'}"
    return f"other_{name}"


def _in_flight() -> None:
    global _max_chunks_in_flight, _max_groups_in_flight
    pending = [g for g in _groups if getattr(g, "param_gather_handle", None) is not None]
    _max_groups_in_flight = max(_max_groups_in_flight, len(pending))
    _max_chunks_in_flight = max(_max_chunks_in_flight, len({_info[id(g)]["chunk"] for g in pending}))


def install() -> None:
    """Wrap DDP construction and the bucket groups' param-sync methods (idempotent).

    Raises:
        ImportError: megatron.core is not importable.
    """
    global _installed
    if _installed:
        return
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    ddp_init = DistributedDataParallel.__init__
    start = pgb._ParamAndGradBucketGroup.start_param_sync
    finish = pgb._ParamAndGradBucketGroup.finish_param_sync

    @functools.wraps(ddp_init)
    def __init__(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        _register(self)

    @functools.wraps(start)
    def start_param_sync(self, *args, **kwargs):
        info = _info.get(id(self))
        if info is not None:
            force_sync = bool(kwargs.get("force_sync", args[0] if args else False))
            counts = _dispatch[info["chunk"]]
            path = _path(self, force_sync, DistributedDataParallel)
            counts[path] = counts.get(path, 0) + 1
        result = start(self, *args, **kwargs)
        if info is not None:
            _in_flight()
        return result

    @functools.wraps(finish)
    def finish_param_sync(self, *args, **kwargs):
        info = _info.get(id(self))
        if info is not None and getattr(self, "param_gather_handle", None) is not None:
            _waited[info["chunk"]] += 1
        return finish(self, *args, **kwargs)

    DistributedDataParallel.__init__ = __init__
    pgb._ParamAndGradBucketGroup.start_param_sync = start_param_sync
    pgb._ParamAndGradBucketGroup.finish_param_sync = finish_param_sync
    _installed = True


def install_if_requested() -> bool:
    """``install()`` when env ``MEGATRON_PARAM_SYNC_TRACE`` is ``1``; return whether it did."""
    if os.environ.get(ENV_VAR, "").strip() == "1":
        install()
        return True
    return False


def summary() -> Dict[str, object]:
    """This rank's counts: ``bucket_groups`` (chunk, index, expert, buckets, numel),
    ``dispatch`` {chunk: {path: count}}, ``waited_in_pre_hooks`` {chunk: count},
    ``max_chunks_in_flight``, ``max_bucket_groups_in_flight``."""
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "chunks": _chunks,
        "bucket_groups": [_info[id(g)] for g in _groups],
        "dispatch": {str(c): dict(sorted(d.items())) for c, d in _dispatch.items()},
        "waited_in_pre_hooks": {str(c): n for c, n in _waited.items()},
        "max_chunks_in_flight": _max_chunks_in_flight,
        "max_bucket_groups_in_flight": _max_groups_in_flight,
    }


def report() -> None:
    """Print ``MARKER + json(summary())`` when installed (one line, flushed)."""
    if _installed:
        # One write of the whole line: the ranks share stdout, and print() writes the text
        # and its newline separately, so another rank's output could land in between.
        sys.stdout.write(MARKER + json.dumps(summary(), sort_keys=True) + "\n")
        sys.stdout.flush()


def parse_log(text: str) -> List[Dict[str, object]]:
    """Every rank's summary from a run's stdout, sorted by rank (empty when none)."""
    decoder = json.JSONDecoder()
    # raw_decode: the JSON object ends the record even if other output follows on the line.
    found = [decoder.raw_decode(line.split(MARKER, 1)[1])[0] for line in text.splitlines() if MARKER in line]
    return sorted(found, key=lambda s: s["rank"])
