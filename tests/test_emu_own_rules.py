"""The emulator's own numbered rules (docs/emulator.md, rule table from 50 on): one test_rule_<N> each.

These rules are not in the spec's checklist: some are inferred from the driver's code paths or from what the
hardware is known to take (marked "inferred" in the table), the others model DRM core behaviour (PRIME) and the
driver's query layouts. Raw ioctls throughout (tests/emu_raw.py).
"""

from __future__ import annotations

import errno
import os
import struct

import pytest
from emu_raw import (
    BO_DEV_HEAP,
    BO_SHMEM,
    ERT_START_CU,
    ERT_START_NPU,
    ERT_STATE_COMPLETED,
    ERT_STATE_ERROR,
    PAGE,
    Gate,
    Npu,
    Raw,
    UserMem,
    call,
    emu_device,
    errno_of,
    packet,
    read_addr,
    regmap,
    run_one,
    txn_stream,
    write_addr,
)

from amdxdna_direct.emu import EmuDevice

MIB = 1 << 20
HW_CONTEXT_ALL = 0


@pytest.fixture
def npu():
    made = Npu("npu4")
    yield made
    made.close()


def mapped_heap(raw: Raw, size: int, offset: int, reserve: int = 256 * MIB) -> tuple[int, int]:
    """A DEV_HEAP of `size` bytes mapped `offset` bytes past a 128 MiB-aligned reservation: (handle, address)."""
    handle = raw.create_bo(size, BO_DEV_HEAP)
    base = raw.seam.reserve(reserve, 128 * MIB)
    return handle, raw.map_bo(handle, size, base + offset)


@pytest.mark.parametrize("size, offset, aligned", [
    (64 * MIB, 0, True), (64 * MIB, PAGE, False), (64 * MIB, 32 * MIB, False),
    (32 * MIB, 32 * MIB, True), (32 * MIB, 16 * MIB, False),
    (48 * MIB, 64 * MIB, True), (48 * MIB, 16 * MIB, False),      # 48 MiB needs the next power of two, 64 MiB
])
def test_rule_50(size, offset, aligned):
    """A heap mapping not aligned to the heap size is refused at CREATE_HWCTX with EINVAL (inferred)."""
    with emu_device("npu4") as dev:
        raw = Raw(dev.open())
        mapped_heap(raw, size, offset)
        if aligned:
            assert raw.create_hwctx()[0] == 1
            return
        with pytest.raises(OSError) as caught:
            raw.create_hwctx()
        assert caught.value.errno == errno.EINVAL
        assert "not aligned to" in str(caught.value) and "CREATE_HWCTX" in str(caught.value)
        assert dev.counters.live()["hwctx"] == 0


def test_rule_50_expandable_heap_chunks_are_64_mib_aligned():
    with emu_device("npu4", expandable_heap=True) as dev:
        raw = Raw(dev.open())
        mapped_heap(raw, 64 * MIB, 64 * MIB + PAGE)
        assert errno_of(raw.create_hwctx) == errno.EINVAL
    with emu_device("npu4", expandable_heap=True) as dev:
        raw = Raw(dev.open())
        mapped_heap(raw, 128 * MIB, 64 * MIB)                    # 64 MiB aligned, not 128: the chunk rule
        assert raw.create_hwctx()[0] == 1


def test_rule_51(npu):
    """An EXEC_CMD listing one argument BO twice is refused with EALREADY (inferred), with nothing booked."""
    ctx, syncobj = npu.context()
    job = npu.passthrough()
    ins, a, b = job["args"]
    live = npu.dev.counters.live()
    for args in ([ins, a, a], [ins, a, b, ins]):
        with pytest.raises(OSError) as caught:
            npu.raw.exec_cmd(ctx, job["cmd"], args)
        assert caught.value.errno == errno.EALREADY
        assert f"handle {args[-1]}" in str(caught.value) and "EXEC_CMD" in str(caught.value)
    assert npu.dev.counters.live() == live                       # no reference kept
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
    assert npu.raw.query(syncobj) == 0                           # the refused calls took no seq


def u64(words: list[int], index: int) -> int:
    return words[index] | words[index + 1] << 32


def rewrite(job: dict, instr: int | None = None, ninstr: int | None = None) -> None:
    """Rewrite a passthrough job's ERT_START_CU packet with another instruction address or ninstr."""
    words = job["words"]
    instr = u64(words, 2) if instr is None else instr
    ninstr = words[4] if ninstr is None else ninstr
    write_addr(job["cmd_addr"], packet(ERT_START_CU, regmap(instr, ninstr, [u64(words, 5), u64(words, 7)], nslots=5)))


def ninstr_job(npu: Npu, ninstr_of) -> dict:
    """A passthrough job whose regmap ninstr is `ninstr_of(stream bytes)`."""
    job = npu.passthrough()
    rewrite(job, ninstr=ninstr_of(len(job["stream"])))
    return job


@pytest.mark.parametrize("unit", ["words", "bytes"])
def test_rule_52(npu, unit):
    """ninstr counts words (mlir-aie's C++ harnesses) or bytes (IRON, taconite): the firmware reads the stream's
    length from the TXN header (inferred: both run on hardware)."""
    ctx, syncobj = npu.context()
    job = ninstr_job(npu, (lambda n: n // 4) if unit == "words" else (lambda n: n))
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
    assert npu.output(job) == job["src"]


def test_rule_52_shorter_than_the_header_is_an_error(npu, caplog):
    ctx, syncobj = npu.context()
    job = ninstr_job(npu, lambda n: n // 4 - 1)
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_ERROR
    size = len(job["stream"])
    assert f"regmap ninstr {size // 4 - 1} (words or bytes) is shorter than the TXN header's size of {size} " \
           "bytes" in caplog.text
    # ERT_START_NPU gives the size in bytes: one word short is an error too.
    npu_job = npu.passthrough(tag=1)
    instr = u64(npu_job["words"], 2)
    preamble = [instr & 0xFFFFFFFF, instr >> 32, len(npu_job["stream"]) - 4, 0]
    write_addr(npu_job["cmd_addr"], packet(ERT_START_NPU, preamble + npu_job["words"]))
    assert run_one(npu, ctx, syncobj, npu_job) == ERT_STATE_ERROR
    assert "ERT_START_NPU instruction size" in caplog.text


def test_rule_53(npu):
    """TXN ops the firmware does not model are skipped by their length; tests/test_emu_txn.py has each one."""
    ctx, syncobj = npu.context()
    stream = txn_stream(4, [(0, 64), (1, 64)], extra=[[0x04, 0, 0x1D200, 0, 1, 1, 28], [0x83, 12, 5]])
    job = npu.passthrough()
    model = Gate()
    model.release.set()
    npu.dev.models.bind(stream, model)
    ins, iaddr = npu.instr(stream)
    job["args"][0] = ins
    rewrite(job, instr=iaddr, ninstr=len(stream) // 4)
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED and model.entered.is_set()
    assert npu.output(job) == job["src"]


def prime(raw: Raw, handle: int) -> int:
    return call(raw.seam, "PRIME_HANDLE_TO_FD", handle, os.O_CLOEXEC | os.O_RDWR, -1)[2]


def import_fd(raw: Raw, fd: int) -> int:
    return call(raw.seam, "PRIME_FD_TO_HANDLE", 0, 0, fd)[0]


def test_rule_54():
    """PRIME: an export is a real fd; importing it back on the same fd gives the same handle; another fd of the
    device gets the same object; another device gets its own BO over the same pages."""
    with emu_device("npu4") as first, emu_device("npu1") as second:
        raw = Raw(first.open())
        handle, addr = raw.shmem(2 * PAGE)
        write_addr(addr, b"exported bytes")
        fd = prime(raw, handle)
        try:
            assert os.fstat(fd).st_size == 2 * PAGE and not os.get_inheritable(fd)
            assert import_fd(raw, fd) == handle                     # same fd: the exporter's own handle
            sibling = Raw(first.open())
            shared = import_fd(sibling, fd)
            assert sibling.seam.client.bos[shared] is raw.seam.client.bos[handle]
            foreign = Raw(second.open())
            bos_before = second.counters.live()["bos"]
            theirs = import_fd(foreign, fd)
            assert import_fd(foreign, fd) == theirs                  # a second import: the same handle
            assert second.counters.live()["bos"] == bos_before + 1
            theirs_addr = foreign.map_bo(theirs, 2 * PAGE)
            assert read_addr(theirs_addr, 14) == b"exported bytes"
            write_addr(theirs_addr + PAGE, b"written by the importer")
            assert read_addr(addr + PAGE, 23) == b"written by the importer"
            info = call(foreign.seam, "GET_BO_INFO", 0, 0, theirs, 0, 0, 0, 0)
            assert info[4] != 0 and info[6] == (1 << 64) - 1         # its own map offset; SVA address
            raw.gem_close(handle)                                     # the importer keeps the pages
            raw.seam.munmap(addr, 2 * PAGE)
            assert read_addr(theirs_addr, 14) == b"exported bytes"
            foreign.seam.munmap(theirs_addr, 2 * PAGE)
        finally:
            os.close(fd)


def test_rule_54_errors():
    with emu_device("npu4") as dev, open(__file__, "rb") as regular:
        raw = Raw(dev.open())
        assert errno_of(prime, raw, 77) == errno.ENOENT               # no such handle (a sub-buffer has none)
        assert errno_of(call, raw.seam, "PRIME_HANDLE_TO_FD", raw.create_bo(PAGE, BO_SHMEM), 0x4, -1) == errno.EINVAL
        assert errno_of(import_fd, raw, regular.fileno()) == errno.EINVAL   # not a dma-buf
        read_fd, write_fd = os.pipe()
        os.close(read_fd), os.close(write_fd)
        assert errno_of(import_fd, raw, read_fd) == errno.EBADF
        raw.heap(64 * MIB)
        dev_bo = raw.create_bo(PAGE, 3)
        assert errno_of(prime, raw, dev_bo) == errno.EOPNOTSUPP      # DEV BOs live inside the heap


def hwctx_all(raw: Raw, element_size: int, num_element: int) -> tuple[bytes, int, int]:
    mem = UserMem(element_size * num_element)
    values = call(raw.seam, "GET_ARRAY", HW_CONTEXT_ALL, element_size, num_element, 0, mem.addr)
    return mem.read(), values[1], values[2]


ENTRY = "<IIIIqQQQQQQQQIIIIIIIIIIIIII"      # amdxdna_drm_hwctx_entry, 144 bytes (offsets of docs/uapi.md 2.5)


@pytest.mark.parametrize(("profile", "entry_size"), [("npu4:linux-7.0", 144), ("npu4:xdna-oot", 160)])
def test_rule_55(profile, entry_size):
    """GET_ARRAY HW_CONTEXT_ALL hands back the profile's element size (mainline 144, staging/OOT 160 with the
    process name), packs as many entries as num_element x element_size bytes hold; the out-of-tree driver fills
    the firmware id, heap usage and health record, 7.0 leaves them 0 (S19); `errors` is 0 on both (S15)."""
    npu = Npu(profile, tdr=0.2)
    oot = entry_size == 160
    try:
        dev = npu.dev
        qos = struct.pack("<6I", 2, 30, 400, 5, 6, 0x100)
        ctx, syncobj = npu.raw.create_hwctx(qos=qos, max_opc=2048)
        pdi = npu.raw.dev_bo(256)[0]
        npu.raw.config_cu(ctx, [(pdi, 0)])
        second, _ = npu.raw.create_hwctx()
        job = npu.passthrough()
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
        hung = npu.passthrough(tag=9)
        dev.faults.hang(hung["stream"])
        run_one(npu, ctx, syncobj, hung)                              # TIMEOUT: the firmware's health report
        data, size, count = hwctx_all(npu.raw, 160, 2)
        assert (size, count) == (entry_size, 2)                      # 2 x 160 bytes hold 2 entries of either size
        values = struct.unpack_from(ENTRY, data)
        heap_use = sum(bo.size for bo in npu.seam.client.memory.dev_bos.values())
        # id, start col, columns (temporal: the whole array), firmware id, pid
        assert values[:5] == (ctx, 0, 8, 1 if oot else 0, os.getpid())
        assert values[5:10] == (2, 2, 0, 0, 0)                       # submissions, completions, -, -, errors
        assert values[10:14] == (0x100, heap_use if oot else 0, 0, 1)   # priority, heap usage, -, state ACTIVE
        assert values[14:20] == (npu.seam.client.pasid, 2, 30, 400, 5, 6)   # PASID, the QoS as given
        last_sync = 1 + 3 * 2           # the sync op after the tag WRITE32 and 3 ops per buffer (tests/emu_raw.py)
        assert values[20:26] == (last_sync if oot else 0, 0, 0, 0, 0, 0)     # txn_op_idx of the TDR, no fatal error
        second_entry = struct.unpack_from("<I", data, entry_size)[0]
        assert second_entry == second
        if entry_size == 160:
            with open("/proc/self/comm", "rb") as comm:
                assert data[144:160].rstrip(b"\0") == comm.read().strip()[:15]
        data, size, count = hwctx_all(npu.raw, 200, 1)               # 200 bytes hold one entry
        assert (size, count) == (entry_size, 1)
    finally:
        npu.close()


def test_rule_55_profile_option_is_checked():
    with pytest.raises(ValueError, match="hwctx_entry_size must be 144 .* or 160"):
        EmuDevice("npu4", hwctx_entry_size=152)
