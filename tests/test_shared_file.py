"""The shared open file: on 6.14-6.19 every close of a copy of the device fd destroys its contexts (S23).

docs/emulator.md, "The shared open file": the driver's flush runs on each close() of a descriptor of the file
(a closed dup, a child process's copy closing at exit, exec or close_fds), unlinks the file from the device's
client list and destroys all its hardware contexts; later EXEC_CMD / DESTROY_HWCTX on the old handles answer
EINVAL. 7.0 and the out-of-tree driver destroy contexts only at the file's release. The runtime side
(docs/runtime.md 4.4): a run on a context the driver destroyed raises ``ContextLostError`` naming the context
and the likely cause, and ``HwContext.recreate`` brings it back in place.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import subprocess

import pytest
from emu_raw import (
    BO_CMD,
    BO_SHMEM,
    ERT_STATE_COMPLETED,
    PAGE,
    Npu,
    Raw,
    emu_device,
    errno_of,
    run_one,
)

import amdxdna_direct
from amdxdna_direct import ContextLostError, XdnaError, insts, open_device
from amdxdna_direct.emu import Passthrough
from amdxdna_direct.errors import error_class
from amdxdna_direct.xclbin import build_mlir_aie

FLUSHING = ("linux-6.14", "linux-6.18")
KEEPING = ("linux-7.0", "xdna-oot")
QUERY_HW_CONTEXTS = 5


def listed(raw: Raw) -> list[int]:
    """Context ids QUERY_HW_CONTEXTS reports (the driver walks the files on its client list)."""
    data, _ = raw.get_info(QUERY_HW_CONTEXTS, 16 * 64)
    ids = [int.from_bytes(data[off:off + 4], "little") for off in range(0, len(data), 64)]
    return [i for i in ids if i]


def fork_child_that_exits() -> None:
    """os.fork; the child leaves at once with os._exit (it runs nothing of the parent's state)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _nothing() -> None:
    return None


def multiprocessing_fork_child() -> None:
    child = multiprocessing.get_context("fork").Process(target=_nothing)
    child.start()
    child.join(30)
    assert child.exitcode == 0


CHILDREN = {"os.fork": fork_child_that_exits, "subprocess.run": lambda: subprocess.run(["true"], check=True),
            "multiprocessing fork": multiprocessing_fork_child}


@pytest.mark.parametrize("driver", [*FLUSHING, *KEEPING])
def test_closing_a_dup_flushes_on_6_14_to_6_19(driver):
    npu = Npu(f"npu4:{driver}")
    try:
        ctx, syncobj = npu.context()
        job = npu.passthrough(tag=1)
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
        dup = npu.seam.dup()
        dup.close()
        dup.close()                                             # idempotent: one close of that descriptor
        assert errno_of(Raw(dup).create_bo, PAGE, BO_SHMEM) == errno.EBADF
        if driver in FLUSHING:
            assert npu.dev.counters.live()["hwctx"] == 0
            assert errno_of(npu.exec, ctx, job) == errno.EINVAL
            assert errno_of(npu.raw.destroy_hwctx, ctx) == errno.EINVAL
            assert listed(npu.raw) == []
            # The file itself lives on: its BOs still work, and a new context runs but is no longer listed.
            again, sync2 = npu.context()
            assert run_one(npu, again, sync2, npu.passthrough(tag=2)) == ERT_STATE_COMPLETED
            assert listed(npu.raw) == [] and npu.dev.counters.live()["hwctx"] == 1
        else:
            assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
            assert listed(npu.raw) == [ctx]
    finally:
        npu.close()


def test_the_last_close_releases_the_file_whichever_descriptor_it_is():
    with emu_device("npu4:linux-7.0") as dev:
        seam = dev.open()
        raw = Raw(seam)
        raw.heap()
        raw.create_hwctx()
        dup = seam.dup()
        seam.close()
        assert dev.counters.live()["hwctx"] == 1                 # the dup keeps the file open
        Raw(dup).create_bo(PAGE, BO_CMD)
        dup.close()
        assert dev.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}
        assert errno_of(dup.dup) == errno.EBADF


@pytest.mark.parametrize("child", list(CHILDREN))
@pytest.mark.parametrize("driver", [*FLUSHING, *KEEPING])
def test_a_child_process_flushes_every_file_on_6_14_to_6_19(driver, child):
    with emu_device(f"npu4:{driver}") as dev, emu_device("npu4:linux-7.0") as other:
        first, second = Raw(dev.open()), Raw(dev.open())
        kept = Raw(other.open())
        for raw in (first, second, kept):
            raw.heap()
        a, _ = first.create_hwctx()
        b, _ = second.create_hwctx()
        k, _ = kept.create_hwctx()
        CHILDREN[child]()
        assert listed(kept) == [k]                               # another device without a flush: untouched
        if driver in FLUSHING:
            assert dev.counters.live()["hwctx"] == 0             # every file of the process was copied
            assert errno_of(first.destroy_hwctx, a) == errno.EINVAL
            assert errno_of(second.destroy_hwctx, b) == errno.EINVAL
        else:
            assert listed(first) == [a, b]
            first.destroy_hwctx(a)
            second.destroy_hwctx(b)


# ---------------------------------------------------------------------------------------------- the runtime

def passthrough_run(dev) -> tuple:
    """A context with one run copying 256 bytes from one buffer to another; returns (ctx, run, check)."""
    stream = insts.dma_stream(dev.txn_dev_gen, [(0, 256, "in"), (1, 256, "out")])
    dev.emulator.models.bind(insts.encode(stream), Passthrough())
    ctx = dev.hw_context(build_mlir_aie(b"pdi", n_buffers=2))
    src, dst = dev.bo(4096), dev.bo(4096)
    run = ctx.kernel().prepare_npu(stream, [src, dst])

    def check(tag: int) -> None:
        data = bytes((tag + i) % 256 for i in range(256))
        src.write(data)
        src.sync()
        run.start().wait(10)
        dst.sync(direction="from_device")
        assert dst.read(256) == data

    return ctx, run, check


def test_context_lost_error_is_an_xdna_error():
    assert issubclass(ContextLostError, XdnaError) and amdxdna_direct.ContextLostError is ContextLostError
    assert error_class("EXEC_CMD", errno.EINVAL) is XdnaError       # a bare EINVAL stays an XdnaError
    exc = ContextLostError(errno.EINVAL, "EXEC_CMD(hwctx=1): EINVAL", hwctx=1, cause="a child process")
    again = pickle.loads(pickle.dumps(exc))
    assert (type(again), again.errno, str(again), again.hwctx, again.cause) == (
        ContextLostError, errno.EINVAL, "EXEC_CMD(hwctx=1): EINVAL", 1, "a child process")


@pytest.mark.parametrize("child", list(CHILDREN))
@pytest.mark.parametrize("driver", [*FLUSHING, *KEEPING])
def test_runtime_run_after_a_child_process(driver, child):
    with open_device(f"emu:npu1:{driver}") as dev:
        ctx, run, check = passthrough_run(dev)
        check(1)
        CHILDREN[child]()
        if driver in KEEPING:
            check(2)
            return
        handle = ctx.handle
        with pytest.raises(ContextLostError) as caught:
            run.start()
        exc = caught.value
        assert (exc.errno, exc.hwctx) == (errno.EINVAL, handle) and "child process" in exc.cause
        text = str(exc)
        assert text.startswith(f"EXEC_CMD(hwctx={handle}, ") and "EINVAL" in text
        assert "destroyed by the driver" in text and "Linux 7.0 keeps them" in text and "recreate()" in text
        assert dev.stats["EXEC_CMD"] == 1                        # found before the submission, not from EINVAL
        ctx.recreate()                                           # same xclbin and CUs, the same run object
        assert ctx.handle != handle and not ctx.closed
        check(3)
        check(4)


def test_runtime_names_a_closed_dup_as_a_likely_cause():
    with open_device("emu:npu1:linux-6.18") as dev:
        ctx, run, check = passthrough_run(dev)
        check(1)
        dev.file.seam.dup().close()                              # a duplicate of the fd closed elsewhere
        with pytest.raises(ContextLostError, match="a child process or a closed duplicate") as caught:
            run.start()
        assert isinstance(caught.value.__cause__, XdnaError) and caught.value.__cause__.errno == errno.EINVAL
        assert dev.stats["EXEC_CMD"] == 2                        # this one reached the driver, which said EINVAL
        ctx.recreate()
        check(2)
        ctx.close()
        with pytest.raises(XdnaError, match="recreate.*EBADF"):
            ctx.recreate()


def test_recreate_refuses_while_a_run_is_in_flight():
    with open_device("emu:npu1:linux-7.0") as dev:
        ctx, run, check = passthrough_run(dev)
        dev.emulator.faults.hang(insts.encode(insts.dma_stream(dev.txn_dev_gen, [(0, 256, "in"), (1, 256, "out")])))
        run.start()
        with pytest.raises(RuntimeError, match="still in flight"):
            ctx.recreate()
        ctx.close()
