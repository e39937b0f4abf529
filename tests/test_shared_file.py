"""The shared open file: on 6.14-6.19 every close of a copy of the device fd destroys its contexts (S23).

docs/emulator.md, "The shared open file": the driver's flush runs on each close() of a descriptor of the file
(a closed dup, a child process's copy closing at exit, exec or close_fds), unlinks the file from the device's
client list and destroys all its hardware contexts; later EXEC_CMD / DESTROY_HWCTX on the old handles answer
EINVAL. 7.0 and the out-of-tree driver destroy contexts only at the file's release.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
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
