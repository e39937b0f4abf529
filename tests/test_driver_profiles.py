"""The emulator's driver profiles: one per kernel (docs/emulator.md, Driver profiles).

Every expected value is a fact of the driver versions as docs/emulator.md states them (the VERSION each
reports, its ioctl slots, GET_ARRAY and its entry size, the heap rule, placement, TDR, the failed-payload fill)
and the scenario numbers S1-S24 name the cases there. Each test runs the raw ioctls of tests/emu_raw.py, whose
request numbers and layouts are pinned against the ABI facts elsewhere (tests/test_emu_rules.py).
"""

from __future__ import annotations

import argparse
import errno
import json
import struct
import time

import pytest
from emu_raw import (
    ASSIGN_DBG_BUF,
    BO_CMD,
    BO_DEV_HEAP,
    BO_SHMEM,
    ERT_START_CU,
    ERT_START_NPU,
    ERT_STATE_COMPLETED,
    ERT_STATE_ERROR,
    ERT_STATE_NEW,
    ERT_STATE_TIMEOUT,
    IOW,
    IOWR,
    PAGE,
    Npu,
    Raw,
    UserMem,
    call,
    chain_packet,
    emu_device,
    errno_of,
    ioc,
    pack,
    packet,
    read_addr,
    regmap,
    run_one,
    state_of,
    write_addr,
)

from amdxdna_direct import open_device
from amdxdna_direct.cli import info_cmd
from amdxdna_direct.emu import DEFAULT_DRIVER, DRIVERS, EmuDevice, resolve

KIB, MIB = 1 << 10, 1 << 20
QUERY_HW_CONTEXTS, HW_CONTEXT_ALL = 5, 0
MAINLINE = ("linux-6.14", "linux-6.18", "linux-7.0")
# (DRM_IOCTL_VERSION major, minor) of each driver version (docs/emulator.md, Driver profiles).
VERSIONS = {"linux-6.14": (0, 0), "linux-6.18": (0, 1), "linux-7.0": (0, 6), "xdna-oot": (1, 0)}
WAIT_CMD_IOW, WAIT_CMD_IOWR = 0x40106449, 0xC0106449       # slot 9, 16 bytes, as the two trees encode it
QUERY_HWCTX_SIZE = 64                                      # struct amdxdna_drm_query_hwctx
WAIT_AVAILABLE = 4                                         # DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE


def raw_fd(device: EmuDevice, heap: bool = True) -> Raw:
    raw = Raw(device.open())
    if heap:
        raw.heap()
    return raw


def get_array(raw: Raw, param: int, element_size: int, num_element: int) -> tuple[bytes, int, int]:
    mem = UserMem(element_size * num_element)
    values = call(raw.seam, "GET_ARRAY", param, element_size, num_element, 0, mem.addr)
    return mem.read(), values[1], values[2]


def version_of(raw: Raw) -> tuple[int, int]:
    return call(raw.seam, "VERSION", 0, 0, 0, 0, 0, 0, 0, 0, 0)[:2]


def hw_contexts(raw: Raw, size: int = 32 * QUERY_HWCTX_SIZE) -> list[tuple[int, int, int]]:
    """QUERY_HW_CONTEXTS: (context_id, start_col, num_col) of the entries the driver wrote."""
    data, _ = raw.get_info(QUERY_HW_CONTEXTS, size)
    entries = [struct.unpack_from("<III", data, off) for off in range(0, len(data), QUERY_HWCTX_SIZE)]
    return [e for e in entries if e[0]]


# ---------------------------------------------------------------------------------------------- naming

def test_default_is_the_newest_mainline_kernel_and_specs_combine():
    assert DEFAULT_DRIVER == "linux-7.0" and set(DRIVERS) == {*MAINLINE, "xdna-oot"}
    with EmuDevice() as dev:
        assert (dev.profile.name, dev.profile.driver) == ("npu4", "linux-7.0")
    profile = resolve("npu1:linux-6.18:coherent")
    assert (profile.name, profile.driver, profile.coherent, profile.drm_minor) == ("npu1", "linux-6.18", True, 1)
    assert (resolve("npu4:coherent").driver, resolve("npu4:coherent").coherent) == ("linux-7.0", True)
    for bad, message in (("npu1:linux-5.0", "unknown emulator driver 'linux-5.0'"),
                         ("npu9:linux-7.0", "unknown emulator profile 'npu9'"),
                         ("npu1:linux-6.18:xdna-oot", "expected <npu>")):
        with pytest.raises(KeyError, match=message):
            resolve(bad)
        with pytest.raises(ValueError, match=message):
            open_device(f"emu:{bad}")


def test_device_driver_and_info_say_which_profile_runs(capsys):
    with open_device("emu:npu1:linux-6.18:coherent") as dev:
        assert dev.driver == "amdxdna_accel_driver 0.1.0 (emulator npu1:linux-6.18)"
        assert dev.emulator is not None and dev.emulator.profile.coherent
    with open_device("emu") as dev:
        assert dev.driver == "amdxdna_accel_driver 0.6.0 (emulator npu4:linux-7.0)"
    assert info_cmd.run(argparse.Namespace(device="emu:npu4:xdna-oot", json=True)) == 0
    driver = json.loads(capsys.readouterr().out)["driver"]
    assert (driver["version"], driver["emulator_driver"]) == ("1.0.0", "xdna-oot")
    assert info_cmd.run(argparse.Namespace(device="emu:npu1:linux-6.14", json=False)) == 0
    assert "emulator driver profile linux-6.14" in capsys.readouterr().out


def test_time_scale_is_checked():
    for bad, kind in ((0, ValueError), (-1.0, ValueError), ("fast", TypeError), (True, TypeError)):
        with pytest.raises(kind, match="time_scale must be"):
            EmuDevice("npu1", time_scale=bad)


# ---------------------------------------------------------------------------------------------- uAPI

@pytest.mark.parametrize("driver", [*MAINLINE, "xdna-oot"])
def test_version_slots_and_get_array(driver):
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        assert version_of(raw) == VERSIONS[driver]
        ctx, _ = raw.create_hwctx()
        wait = pack("wait_cmd", ctx, 0, 0)
        assert ioc(IOW, 0x49, 16) == WAIT_CMD_IOW and ioc(IOWR, 0x49, 16) == WAIT_CMD_IOWR
        if driver == "xdna-oot":
            # WAIT_CMD is IOWR out of tree; seq 0 was never submitted -> EINVAL from the handler, not the table
            with pytest.raises(OSError, match="WAIT_CMD") as caught:
                raw.seam.ioctl(WAIT_CMD_IOWR, wait)
            assert caught.value.errno == errno.EINVAL
        else:
            # slot 9 is empty up to 7.0 (S13): DRM answers EINVAL for the request number itself
            assert errno_of(raw.seam.ioctl, WAIT_CMD_IOW, wait) == errno.EINVAL
        if driver == "linux-6.14":
            # no GET_ARRAY before 6.18: slot 10 is beyond the table
            assert errno_of(raw.seam.ioctl, ioc(IOWR, 0x4A, 24), pack("get_array", 0, 160, 1, 0, 0)) == errno.EINVAL
        else:
            _, size, count = get_array(raw, HW_CONTEXT_ALL, 160, 4)
            assert (size, count) == (160 if driver == "xdna-oot" else 144, 1)


@pytest.mark.parametrize("driver", [*MAINLINE, "xdna-oot"])
def test_qos_read_size(driver):
    """CREATE_HWCTX copies sizeof(qos): 24 bytes upstream, 32 with the out-of-tree header."""
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        # 24 readable bytes at the end of a mapped page, then the reservation's inaccessible page
        base = raw.seam.reserve(2 * PAGE, PAGE)
        page = raw.create_bo(PAGE, BO_SHMEM)
        raw.map_bo(page, PAGE, base)
        create = (0, 0, base + PAGE - 24, 0, 0, 0, 4, 0, 0, 0, 0)
        if driver == "xdna-oot":
            assert errno_of(call, raw.seam, "CREATE_HWCTX", *create) == errno.EFAULT
        else:
            call(raw.seam, "CREATE_HWCTX", *create)


@pytest.mark.parametrize("driver", [*MAINLINE, "xdna-oot"])
def test_heap_rule_S10(driver):
    """Up to 7.0 one heap per fd (a second: EBUSY); out of tree the heap grows by 64 MiB chunks at the next
    64 MiB of the device window."""
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        if driver == "xdna-oot":
            second = raw.create_bo(64 * MIB, BO_DEV_HEAP)
            assert raw.bo_info(second).xdna_addr == 0x8000000
        else:
            assert errno_of(raw.create_bo, 64 * MIB, BO_DEV_HEAP) == errno.EBUSY


@pytest.mark.parametrize(("driver", "placed"), [("linux-6.14", [(0, 1), (2, 2)]), ("linux-6.18", [(0, 1), (2, 2)]),
                                                ("linux-7.0", [(0, 8), (0, 8)]), ("xdna-oot", [(0, 8), (0, 8)])])
def test_placement_S14(driver, placed):
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        first, _ = raw.create_hwctx(4)
        second, _ = raw.create_hwctx(8)
        assert hw_contexts(raw) == [(first, *placed[0]), (second, *placed[1])]


def test_temporal_only_is_an_npu4_family_mode_and_admits_to_the_firmware_limit():
    with emu_device("npu1:linux-7.0") as npu1:
        raw = raw_fd(npu1)
        raw.create_hwctx(4)
        assert hw_contexts(raw)[0][1:] == (1, 1)            # NPU1 stays spatial (first usable column 1)
    with emu_device("npu6:linux-7.0") as npu6:
        raw = raw_fd(npu6)
        for _ in range(npu6.profile.hwctx_limit):           # 16 full-width contexts: no column runs out
            raw.create_hwctx(32)
        assert errno_of(raw.create_hwctx, 4) == errno.EINVAL      # the firmware's limit, not ENODEV


@pytest.mark.parametrize("driver", MAINLINE)
def test_query_hw_contexts_overflow_S4(driver):
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        first, _ = raw.create_hwctx()
        raw.create_hwctx()
        if driver == "linux-6.14":
            assert errno_of(raw.get_info, QUERY_HW_CONTEXTS, QUERY_HWCTX_SIZE) == errno.EINVAL
        else:
            data, left = raw.get_info(QUERY_HW_CONTEXTS, QUERY_HWCTX_SIZE)
            assert (struct.unpack_from("<I", data)[0], left) == (first, 0)


@pytest.mark.parametrize("driver", [*MAINLINE, "xdna-oot"])
def test_create_bo_vaddr_S5_and_cmd_size_S9(driver):
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev, heap=False)
        unmapped = 8 << 40                                  # no mapping there in this process
        assert errno_of(call, raw.seam, "CREATE_BO", 0, unmapped, PAGE, BO_SHMEM, 0) == errno.EINVAL
        readable = UserMem(64)
        answer = errno.EINVAL if driver == "linux-6.14" else errno.EOPNOTSUPP     # 6.18+: a user-pointer BO
        assert errno_of(call, raw.seam, "CREATE_BO", 0, readable.addr, PAGE, BO_SHMEM, 0) == answer
        if driver == "linux-6.14":
            assert errno_of(raw.create_bo, 64 * KIB, BO_CMD) == errno.EINVAL      # refused at creation
            assert errno_of(raw.create_bo, 0, BO_CMD) == errno.EINVAL
        else:
            handle = raw.create_bo(64 * KIB, BO_CMD)                             # refused only at EXEC_CMD
            raw.heap()
            ctx, _ = raw.create_hwctx()
            assert errno_of(raw.exec_cmd, ctx, handle, []) == errno.EINVAL


@pytest.mark.parametrize("driver", MAINLINE)
def test_debug_buffers_before_0_3_are_eopnotsupp_S7(driver):
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        ctx, _ = raw.create_hwctx()
        handle, _ = raw.dev_bo(PAGE)
        config = (ctx, ASSIGN_DBG_BUF, handle, 0, 0)
        if driver == "linux-7.0":
            call(raw.seam, "CONFIG_HWCTX", *config)
        else:
            assert errno_of(call, raw.seam, "CONFIG_HWCTX", *config) == errno.EOPNOTSUPP


@pytest.mark.parametrize("driver", ["linux-7.0", "xdna-oot"])
def test_sync_bo_range_S12(driver):
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev, heap=False)
        handle = raw.create_bo(4 * KIB, BO_SHMEM)
        if driver == "xdna-oot":
            assert errno_of(raw.sync, handle, PAGE, 8192) == errno.EINVAL
        else:
            raw.sync(handle, PAGE, 8192)                    # unchecked up to 7.0


# ---------------------------------------------------------------------------------------------- failures

@pytest.mark.parametrize("driver", [*MAINLINE, "xdna-oot"])
def test_failed_payload_fill_errors_S15_and_raw_priority_S19(driver):
    npu = Npu(f"npu4:{driver}")
    try:
        ctx, syncobj = npu.context()
        job = npu.passthrough(tag=3)
        npu.dev.faults.error(job["stream"])
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_ERROR
        payload = read_addr(job["cmd_addr"] + 4, 64)
        if driver == "xdna-oot":
            assert payload == b"\xff" * 64                  # amdxdna_cmd_set_error
        else:
            assert payload == struct.pack(f"<{16}I", 1, *job["words"])[:64]     # left as submitted
        assert run_one(npu, ctx, syncobj, npu.passthrough(tag=4)) == ERT_STATE_COMPLETED
        assert [e for e in hw_contexts_errors(npu.raw)] == [0]                 # `errors` never set (S15)
        if driver != "linux-6.14":
            data, size, _ = get_array(npu.raw, HW_CONTEXT_ALL, 160, 1)
            entry = struct.unpack_from("<IIIIqQQQQQQQ", data)
            hwctx_id, priority, heap_usage = entry[3], entry[10], entry[11]
            assert priority == 0                            # the QoS priority as given, not mapped (S19)
            if driver == "xdna-oot":
                assert hwctx_id != 0 and heap_usage > 0
            else:
                assert (hwctx_id, heap_usage) == (0, 0)     # mainline leaves them 0
    finally:
        npu.close()


def hw_contexts_errors(raw: Raw) -> list[int]:
    data, _ = raw.get_info(QUERY_HW_CONTEXTS, 4 * QUERY_HWCTX_SIZE)
    return [struct.unpack_from("<Q", data, off + 56)[0] for off in range(0, len(data), QUERY_HWCTX_SIZE)
            if struct.unpack_from("<I", data, off)[0]]


@pytest.mark.parametrize(("driver", "tdr"), [("linux-6.14", 60.0), ("linux-6.18", 60.0), ("linux-7.0", 60.0),
                                             ("xdna-oot", 2.0)])
def test_tdr_timeout_under_a_test_clock_S24(driver, tdr, caplog):
    """A hung command ends TIMEOUT at the driver's TDR (drm_sched's 60 s; 2 s out of tree), which the test clock
    scales: at time_scale 0.01 the 60 s reset comes after 0.6 s, and a shorter wait ends ETIME with the command
    still on the device, as the runtime's 10 s wait does against a 60 s reset."""
    scale = 0.01
    npu = Npu(f"npu4:{driver}", tdr=None, time_scale=scale)
    try:
        assert npu.dev.profile.tdr_timeout == tdr
        ctx, syncobj = npu.context()
        job = npu.passthrough(tag=5)
        npu.dev.faults.hang(job["stream"])
        started = time.monotonic()
        seq = npu.exec(ctx, job)
        if tdr > 10:
            assert errno_of(npu.raw.timeline_wait, syncobj, seq, timeout_s=10 * scale) == errno.ETIME
            assert state_of(job["cmd_addr"]) not in (ERT_STATE_TIMEOUT, ERT_STATE_ERROR)
        npu.raw.timeline_wait(syncobj, seq, timeout_s=30)
        elapsed = time.monotonic() - started
        assert state_of(job["cmd_addr"]) == ERT_STATE_TIMEOUT
        assert 0.9 * tdr * scale <= elapsed < tdr * scale + 3.0
        reason = npu.dev.command_reason(ctx, seq, npu.seam)
        assert reason is not None and f"made no progress for {tdr:.3g} s" in reason
    finally:
        npu.close()


# ---------------------------------------------------------------------------------------------- S1, S2, S3, S17

@pytest.mark.parametrize("driver", ["linux-7.0", "xdna-oot"])
def test_cu_pdi_reference_S1(driver):
    """Up to 7.0 CONFIG_CU keeps no reference to the PDI: closing it frees its heap range, which the next DEV BO
    of that size gets back; the out-of-tree driver keeps it until the context goes."""
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        ctx, _ = raw.create_hwctx()
        pdi, info = raw.dev_bo(PAGE)
        raw.config_cu(ctx, [(pdi, 0)])
        raw.gem_close(pdi)
        _, again = raw.dev_bo(PAGE)
        if driver == "xdna-oot":
            assert again.xdna_addr == info.xdna_addr + 32 * KIB      # the next 32 KiB slot: the PDI still holds its
        else:
            assert again.xdna_addr == info.xdna_addr
        raw.destroy_hwctx(ctx)


@pytest.mark.parametrize("driver", [*MAINLINE, "xdna-oot"])
def test_mmap_of_another_fds_offset_is_eacces_S2_and_wait_available_waits_S3(driver):
    with emu_device(f"npu4:{driver}") as dev:
        first, second = raw_fd(dev, heap=False), raw_fd(dev, heap=False)
        handle = first.create_bo(PAGE, BO_SHMEM)
        assert errno_of(second.seam.mmap, PAGE, first.bo_info(handle).map_offset) == errno.EACCES
        syncobj = call(first.seam, "SYNCOBJ_CREATE", 0, 0)[0]
        started = time.monotonic()
        assert errno_of(first.timeline_wait, syncobj, 5, timeout_s=0.2, flags=WAIT_AVAILABLE) == errno.ETIME
        assert time.monotonic() - started >= 0.15
        assert errno_of(first.timeline_wait, syncobj, 5, timeout_s=0.2, flags=0) == errno.EINVAL   # no flag


@pytest.mark.parametrize("driver", ["linux-7.0", "xdna-oot"])
def test_debug_buffer_attach_takes_a_seq_on_7_0_S17(driver):
    with emu_device(f"npu4:{driver}") as dev:
        raw = raw_fd(dev)
        ctx, syncobj = raw.create_hwctx()
        handle, _ = raw.dev_bo(PAGE)
        call(raw.seam, "CONFIG_HWCTX", ctx, ASSIGN_DBG_BUF, handle, 0, 0)
        cmd, _ = raw.shmem(PAGE, BO_CMD)
        seq = raw.exec_cmd(ctx, cmd, [])
        assert seq == (0 if driver == "xdna-oot" else 1)
        raw.timeline_wait(syncobj, seq)


# ---------------------------------------------------------------------------------------------- S6

def _start_npu(instr: int, nbytes: int, props: list[int], rmap: list[int]) -> list[int]:
    """An ERT_START_NPU payload: u64 instruction address, u32 size in bytes, u32 property count, properties,
    regmap."""
    return [instr & 0xFFFFFFFF, instr >> 32, nbytes, len(props), *props, *rmap]


@pytest.mark.parametrize("driver", [*MAINLINE, "xdna-oot"])
def test_single_command_message_limits_S6(driver):
    """Before 0.6 a lone START_CU travels in one EXECUTE_BUFFER_CF message of 19 payload words and a lone
    START_NPU in one EXEC_DPU message of 35 argument words; larger ones stay NEW. A chain always goes through the
    command list (NPU slot: 26 argument words), so a chain of one runs the 21-word packet everywhere."""
    single = driver in ("linux-6.14", "linux-6.18")
    npu = Npu(f"npu4:{driver}")
    try:
        ctx, syncobj = npu.context()
        job = npu.passthrough(tag=6)
        instr = job["words"][2] | job["words"][3] << 32
        for nslots, words in ((7, 19), (8, 21)):                  # 5 words + 2 per buffer slot
            slots = [job["words"][5] | job["words"][6] << 32, job["words"][7] | job["words"][8] << 32]
            rmap = regmap(instr, len(job["stream"]) // 4, slots, nslots)
            assert len(rmap) == words
            write_addr(job["cmd_addr"], packet(ERT_START_CU, rmap))
            expected = ERT_STATE_NEW if single and words > 19 else ERT_STATE_COMPLETED
            assert run_one(npu, ctx, syncobj, job) == expected
        # the 21-word packet as a chain of one: the command list on every version
        chain, chain_addr = npu.cmd(chain_packet([job["cmd"]]))
        seq = npu.raw.exec_cmd(ctx, chain, job["args"])
        npu.raw.timeline_wait(syncobj, seq)
        assert state_of(chain_addr) == ERT_STATE_COMPLETED
        # START_NPU with 12 properties + 15 regmap words = 27 argument words: over the command-list slot's 26,
        # within the single EXEC_DPU message's 35
        write_addr(job["cmd_addr"], packet(ERT_START_NPU, _start_npu(instr, len(job["stream"]), [0] * 12,
                                                                     job["words"])))
        assert run_one(npu, ctx, syncobj, job) == (ERT_STATE_COMPLETED if single else ERT_STATE_NEW)
        write_addr(job["cmd_addr"], packet(ERT_START_NPU, _start_npu(instr, len(job["stream"]), [0] * 21,
                                                                     job["words"])))
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_NEW     # 36 words: over both
        reason = npu.dev.command_reason(ctx, npu.raw.query(syncobj), npu.seam)
        assert reason is not None and ("EXEC_DPU" in reason) == single
    finally:
        npu.close()


@pytest.mark.parametrize(("profile", "runs"), [("npu1:linux-7.0", True), ("npu4:linux-7.0", False),
                                               ("npu1:xdna-oot", False)])
def test_npu1_on_7_0_uses_the_legacy_dpu_slot_S20(profile, runs):
    """7.0's NPU1 never gets the NPU command slot: START_NPU goes into the legacy DPU slot of 34 argument words,
    so 12 properties + 15 regmap words (27) run there; the NPU slot holds 26."""
    npu = Npu(profile)
    try:
        ctx, syncobj = npu.context()
        job = npu.passthrough(tag=7)
        instr = job["words"][2] | job["words"][3] << 32
        write_addr(job["cmd_addr"], packet(ERT_START_NPU, _start_npu(instr, len(job["stream"]), [0] * 12,
                                                                     job["words"])))
        assert run_one(npu, ctx, syncobj, job) == (ERT_STATE_COMPLETED if runs else ERT_STATE_NEW)
        write_addr(job["cmd_addr"], packet(ERT_START_NPU, _start_npu(instr, len(job["stream"]), [0] * 20,
                                                                     job["words"])))
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_NEW         # 35 words: over the legacy slot too
    finally:
        npu.close()


@pytest.mark.parametrize("driver", ["linux-6.14", "linux-6.18"])
def test_a_context_without_config_cu_completes_its_command_unrun_before_0_6_S8(driver):
    """Before 0.6 run_job returns without running a command while the context is not READY (no CONFIG_CU yet):
    the wait answers 0 and the state stays NEW. (7.0 hands it to the firmware, whose answer no source settles.)"""
    npu = Npu(f"npu4:{driver}")
    try:
        ctx, syncobj = npu.raw.create_hwctx()
        job = npu.passthrough(tag=8)
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_NEW
        assert npu.output(job) == bytes(job["nbytes"])              # nothing ran
    finally:
        npu.close()
