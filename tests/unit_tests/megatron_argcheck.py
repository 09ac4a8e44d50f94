"""Check megatron command lines with megatron.training's own parser, on CPU.

`megatron.training.arguments.parse_args` + `validate_args` are what upstream's pretrain_gpt.py
runs first, and `validate_args` holds the cross-flag rules that
matter here: `--overlap-param-gather` needs `--overlap-grad-reduce` and a layer-wise or
distributed optimizer, Muon forbids `--use-distributed-optimizer`, and so on. Neither needs a
GPU. All cases run in one long-lived subprocess per tree (importing megatron.training takes
seconds), against the patched tree unless told otherwise.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "ARGCHECK_JSON:"

# The child imports megatron.training once, then answers one JSON line (a list of cases) with
# one JSON line (their results), so every test module in a pytest run shares the import cost.
_CHILD = r"""
import contextlib, io, json, os, sys
from megatron.training.arguments import parse_args, validate_args

def check(case):
    os.environ["WORLD_SIZE"] = str(case["world_size"])
    for key, value in case.get("env", {}).items():
        os.environ[key] = value
    if case.get("device_arch") is not None:  # the GPU architecture validate_args asks for
        import megatron.training.arguments as _arguments
        _arguments.get_device_arch_version = lambda: case["device_arch"]
    os.environ["RANK"] = "0"
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            args = parse_args()
            validate_args(args)
    except BaseException as e:  # argparse reports with SystemExit
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "output": sink.getvalue()[-2000:]}
    plain = (bool, int, float, str, type(None), list)
    attrs = {k: getattr(args, k, None) for k in case.get("attrs", [])}
    return {"ok": True, "attrs": {k: v if isinstance(v, plain) else repr(v) for k, v in attrs.items()}}

out = sys.stdout
sys.stdout = sys.stderr  # megatron prints; keep the answer channel clean
for line in sys.stdin:
    out.write(%r + json.dumps([check(c) for c in json.loads(line)]) + "\n")
    out.flush()
""" % MARK

_servers: dict[str, subprocess.Popen] = {}


def _server(tree_parent: Path) -> subprocess.Popen:
    key = str(tree_parent)
    proc = _servers.get(key)
    if proc is None or proc.poll() is not None:
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(tree_parent), str(ROOT)]))}
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD], env=env, cwd=str(tree_parent), text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        _servers[key] = proc
        atexit.register(proc.kill)
    return proc


def validate_megatron_args(cases: list[dict], tree_parent: Path = ROOT) -> list[dict]:
    """Run parse_args + validate_args on each case; return one result per case.

    Args:
        cases: dicts with "argv" (the arguments after the script name), "world_size" (what
            torchrun would export as WORLD_SIZE) and optionally "attrs" (names of parsed
            arguments to return), "env" (variables set before parsing, e.g. what the launcher
            exports) and "device_arch" (the compute capability major that validate_args gets
            from ``get_device_arch_version``, e.g. 9 for Hopper; it asks the GPU at tp > 1).
        tree_parent: directory holding the megatron/ tree to import (repo root: patched).

    Returns:
        [{"ok": True, "attrs": {...}} or {"ok": False, "error": "...", "output": "..."}].
    """
    proc = _server(tree_parent)
    proc.stdin.write(json.dumps(cases) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line.startswith(MARK), (
        f"megatron argument check crashed (exit {proc.poll()}); rerun with stderr: "
        f"PYTHONPATH={tree_parent} python -c 'import megatron.training.arguments'"
    )
    return json.loads(line[len(MARK):])
