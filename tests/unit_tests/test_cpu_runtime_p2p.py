"""Tests of harness/cpu_runtime/p2p.py: a pipeline send keeps its bytes until it completes.

Without it, megatron's interleaved schedule trains on freed memory on gloo: the next stage
receives the following microbatch's activations (NaN grads from step 1 of the PP 2 x VPP 2
functional case). The gloo test replays that send with megatron's own P2PCommunicator and
deallocate_output_tensor on two ranks (``cpu_runtime_p2p_worker.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import harness.cpu_runtime as cpu_runtime
from harness.cpu_runtime import p2p
from harness.launch import LaunchError, run_command, torchrun_command

WORKER = Path(__file__).with_name("cpu_runtime_p2p_worker.py")
ROUNDS = 5


class FakeWork:
    """Stands in for a gloo send's Work: completed only once ``wait()`` ran."""

    def __init__(self):
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.done = True
        return True


def test_send_holds_the_storage_until_the_work_completes():
    p2p.clear()
    work = FakeWork()
    send = p2p.send_keeping_storage(lambda pg, tensors, dst, tag: work)
    out = torch.arange(1024, dtype=torch.float32)
    sent_ptr = out.untyped_storage().data_ptr()
    assert send(None, [out], 1, 0) is work
    out.data = torch.empty((1,))  # megatron's deallocate_output_tensor
    assert p2p.in_flight_sends() == 1
    held = p2p._held[work]
    assert [s.data_ptr() for s in held] == [sent_ptr]
    assert torch.equal(torch.empty(0).set_(held[0]), torch.arange(1024, dtype=torch.float32))  # bytes intact
    work.wait()
    assert p2p.in_flight_sends() == 0


def test_installed_and_uninstalled_exactly():
    pg = torch._C._distributed_c10d.ProcessGroup
    was_installed = cpu_runtime.is_installed()
    cpu_runtime.uninstall()
    torch_send = pg.__dict__["send"]
    try:
        cpu_runtime.install(force=True)
        assert pg.__dict__["send"] is not torch_send
        assert any(item.startswith("p2p sends") for item in cpu_runtime.installed_items())
        cpu_runtime.uninstall()
        assert pg.__dict__["send"] is torch_send
    finally:
        cpu_runtime.uninstall()
        if was_installed:
            cpu_runtime.install(force=True)


@pytest.mark.gloo
def test_pipeline_send_then_pseudo_free_delivers_the_sent_bytes(tmp_path):
    argv, env = torchrun_command(WORKER, [str(tmp_path), str(ROUNDS)], 2, tree="series-0.17.1",
                                 extra_env={"PYTHONWARNINGS": "ignore"})
    try:
        run_command(argv, env, run_dir=tmp_path / "logs", timeout_s=240, what="p2p worker x2")
    except LaunchError as exc:
        raise AssertionError(str(exc)) from None
    sender, receiver = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # With the layer: every round arrives bit for bit, and nothing stays held after wait().
    assert receiver["layer"]["equal"] == [True] * ROUNDS, receiver["layer"]
    assert sender["layer"]["held_after_wait"] == [0] * ROUNDS, sender["layer"]
    # Control, torch's own ProcessGroup.send: the freed block is reused by the next
    # allocations and the receiver gets those bytes. If this ever passes, the scenario no
    # longer shows the hazard on this machine and the check above proves nothing.
    assert not any(receiver["without_p2p"]["equal"]), receiver["without_p2p"]
