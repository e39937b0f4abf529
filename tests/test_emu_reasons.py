"""Why a command failed: EmuDevice.command_reason / EmuSeam.command_reason (docs/emulator.md, "Why a command failed").

Oracles: the messages the firmware states for each failure (no model, injected error, a model's own exception, a
malformed packet, TDR, the aborts that follow it), the ERT states of docs/uapi.md 6 and the per-fd scope of
context handles (docs/uapi.md 4.1).
"""

from __future__ import annotations

import hashlib

import pytest
from emu_raw import (
    ERT_START_CU,
    ERT_STATE_ABORT,
    ERT_STATE_COMPLETED,
    ERT_STATE_ERROR,
    ERT_STATE_NEW,
    ERT_STATE_TIMEOUT,
    Gate,
    Npu,
    packet,
    run_one,
    state_of,
    write_addr,
)

from amdxdna_direct.emu import driver


@pytest.fixture
def npu():
    made = Npu(tdr=0.3)
    yield made
    made.close()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Raises:
    """A model that raises its own error (the reason must carry the model's message)."""

    name = "raiser"

    def __call__(self, args) -> None:
        raise ZeroDivisionError("the model's own words")


def test_each_failure_keeps_its_reason(npu):
    ctx, syncobj = npu.context()
    ok = npu.passthrough(tag=1)
    seq_ok = npu.exec(ctx, ok)
    npu.raw.timeline_wait(syncobj, seq_ok)
    assert state_of(ok["cmd_addr"]) == ERT_STATE_COMPLETED
    assert npu.seam.command_reason(ctx, seq_ok) is None                        # a completed command has none

    unbound = npu.passthrough(tag=2)
    npu.dev.models.unbind(unbound["stream"])
    digest = hashlib.sha256(unbound["stream"]).hexdigest()
    injected = npu.passthrough(tag=3)
    npu.dev.faults.error(injected["stream"])
    raiser = npu.passthrough(tag=4, model=Raises())
    malformed = npu.passthrough(tag=5)
    write_addr(malformed["cmd_addr"], packet(ERT_START_CU, list(malformed["words"]), masks=(0,)))   # no CU bit
    expected = [
        (unbound, ERT_STATE_ERROR, f"no model bound to instruction stream sha256 {digest}"),
        (injected, ERT_STATE_ERROR, f"injected firmware error for stream {sha256(injected['stream'])}"),
        (raiser, ERT_STATE_ERROR, "model raiser raised ZeroDivisionError: the model's own words"),
        (malformed, ERT_STATE_NEW, "malformed command (the driver left it NEW): no CU bit set in the CU masks"),
    ]
    for job, state, reason in expected:
        seq = npu.exec(ctx, job)
        npu.raw.timeline_wait(syncobj, seq)
        assert state_of(job["cmd_addr"]) == state
        assert npu.seam.command_reason(ctx, seq) == reason
        assert npu.dev.command_reason(ctx, seq) == reason                     # the device-wide lookup agrees
        assert npu.dev.command_reason(ctx, seq, npu.seam) == reason


def test_tdr_and_the_aborts_it_causes(npu):
    ctx, syncobj = npu.context()
    hung, queued = npu.passthrough(tag=1), npu.passthrough(tag=2)
    npu.dev.faults.hang(hung["stream"])
    seq_hung = npu.exec(ctx, hung)
    seq_queued = npu.exec(ctx, queued)
    npu.raw.timeline_wait(syncobj, seq_queued)
    assert (state_of(hung["cmd_addr"]), state_of(queued["cmd_addr"])) == (ERT_STATE_TIMEOUT, ERT_STATE_ABORT)
    digest = hashlib.sha256(hung["stream"]).hexdigest()
    assert npu.seam.command_reason(ctx, seq_hung) == f"TDR: stream {digest} made no progress for 0.3 s"
    assert npu.seam.command_reason(ctx, seq_queued) == f"aborted: the TDR reset the context after seq {seq_hung} " \
                                                       f"timed out"


def test_device_loss_reason_is_there_when_the_wait_wakes(npu):
    ctx, syncobj = npu.context()
    gate = Gate()
    running = npu.passthrough(tag=1, model=gate)
    queued = npu.passthrough(tag=2)
    seq_running, seq_queued = npu.exec(ctx, running), npu.exec(ctx, queued)
    assert gate.entered.wait(2)
    npu.dev.faults.lose_device()
    assert npu.seam.command_reason(ctx, seq_queued) == "aborted before it ran: the device was lost"
    with npu.dev.cond:
        job = npu.seam.client.contexts[ctx].jobs[seq_running]
        gate.release.set()
        assert npu.dev.cond.wait_for(lambda: job.done, 5)          # the model returned; its job ended ABORT
    assert npu.seam.command_reason(ctx, seq_running) == "aborted while its model ran: the device was lost"

def test_records_are_per_fd_bounded_and_forgotten():
    a, b = Npu(tdr=0.3), Npu(tdr=0.3)
    try:
        second = a.dev.open()
        ctx, syncobj = a.context()
        job = a.passthrough(tag=1)
        a.dev.models.unbind(job["stream"])
        seq = a.exec(ctx, job)
        a.raw.timeline_wait(syncobj, seq)
        assert a.seam.command_reason(ctx, seq).startswith("no model bound")
        assert second.command_reason(ctx, seq) is None                          # another fd's context 1 is not it
        assert b.seam.command_reason(ctx, seq) is None                          # nor another device's
        with pytest.raises(TypeError, match="command_reason: seq must be an int, got str"):
            a.seam.command_reason(ctx, "0")
        with pytest.raises(TypeError, match="seam must be an EmuSeam of this device"):
            a.dev.command_reason(ctx, seq, b.seam)
        # Only the newest FAILURES_KEPT failures are kept.
        for _ in range(driver.FAILURES_KEPT):
            write_addr(job["cmd_addr"], packet(ERT_START_CU, list(job["words"])))    # the failure 0xFF-filled it
            assert run_one(a, ctx, syncobj, job) == ERT_STATE_ERROR
        assert a.seam.command_reason(ctx, seq) is None
        assert a.seam.command_reason(ctx, seq + 1).startswith("no model bound")
        # A new context that reuses the handle starts a new seq space: the old records go.
        a.raw.destroy_hwctx(ctx)
        a.seam.client.last_ctx_handle = ctx - 1          # the cyclic allocator comes round to the same handle
        assert a.context()[0] == ctx
        assert a.seam.command_reason(ctx, seq + 1) is None
        # The records of an fd go when it is released.
        ctx_b, syncobj_b = b.context()
        job_b = b.passthrough(tag=2)
        b.dev.models.unbind(job_b["stream"])
        seq_b = b.exec(ctx_b, job_b)
        b.raw.timeline_wait(syncobj_b, seq_b)
        other = b.dev.open()
        assert b.dev.command_reason(ctx_b, seq_b).startswith("no model bound")
        b.seam.close()
        assert b.dev.command_reason(ctx_b, seq_b) is None
        other.close()
        b.seam = b.dev.open()
        second.close()
    finally:
        a.close()
        b.close()
