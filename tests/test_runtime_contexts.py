"""The device's context table: GET_ARRAY(HW_CONTEXT_ALL) entries indexed by the driver's element size.

Oracles: the entry layout of docs/uapi.md 2.5 (offsets typed in below by hand, not taken from
abi.py): 144-byte mainline entries, 160-byte staging / out-of-tree entries that add ``name[16]`` at 144;
GET_ARRAY returns min(asked, its own size) as element_size (docs/uapi.md 10); QUERY_HW_CONTEXTS on feature
level 0.0 drivers (docs/uapi.md 11); and the contexts and runs each test creates itself.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

import pytest

from amdxdna_direct import errors, insts, open_device
from amdxdna_direct.device import HWCTX_ENTRY_SIZE, HwContextEntry, decode_hwctx_entries
from amdxdna_direct.emu import EmuDevice, Passthrough
from amdxdna_direct.xclbin import build_mlir_aie

GET_ARRAY = 0xC018644A                      # docs/uapi.md 1a
GET_ARRAY_STRUCT = struct.Struct("<IIIIQ")  # param, element_size, num_element, pad, buffer (docs/uapi.md 2.4)
HW_CONTEXT_ALL = 0
# (field, offset, format) of amdxdna_drm_hwctx_entry, docs/uapi.md 2.5.
SPEC_FIELDS = [
    ("context_id", 0, "I"), ("start_col", 4, "I"), ("num_col", 8, "I"), ("hwctx_id", 12, "I"), ("pid", 16, "q"),
    ("command_submissions", 24, "Q"), ("command_completions", 32, "Q"), ("migrations", 40, "Q"),
    ("preemptions", 48, "Q"), ("errors", 56, "Q"), ("priority", 64, "Q"), ("heap_usage", 72, "Q"),
    ("suspensions", 80, "Q"), ("state", 88, "I"), ("pasid", 92, "I"), ("gops", 96, "I"), ("fps", 100, "I"),
    ("dma_bandwidth", 104, "I"), ("latency", 108, "I"), ("frame_exec_time", 112, "I"), ("txn_op_idx", 116, "I"),
    ("ctx_pc", 120, "I"), ("fatal_error_type", 124, "I"), ("fatal_error_exception_type", 128, "I"),
    ("fatal_error_exception_pc", 132, "I"), ("fatal_error_app_module", 136, "I"),
]
MAINLINE, OOT = 144, 160


def spec_entry(seed: int, size: int, name: bytes = b"") -> tuple[bytes, dict]:
    """An entry of ``size`` bytes with a distinct value in every field, and those values."""
    raw = bytearray(size)
    values = {}
    for k, (field, offset, fmt) in enumerate(SPEC_FIELDS):
        if offset + struct.calcsize(fmt) > size:
            break
        value = seed * 1000 + k + 1
        struct.pack_into("<" + fmt, raw, offset, value)
        values[field] = value
    if size >= 160:
        raw[144:160] = name.ljust(16, b"\0")
    return bytes(raw), values


def test_decode_both_layouts_reads_every_field_at_its_stride():
    for size, names in ((MAINLINE, [None, None]), (OOT, ["python3", "sam3-demo-proces"])):
        built = [spec_entry(seed, size, (n or "").encode()) for seed, n in zip((1, 2), names, strict=True)]
        entries = decode_hwctx_entries(b"".join(raw for raw, _ in built), size, 2)
        for entry, (_, values), name in zip(entries, built, names, strict=True):
            assert {f: getattr(entry, f) for f, _, _ in SPEC_FIELDS} == values
            assert (entry.name, entry.element_size, entry.source) == (name, size, "GET_ARRAY")


def test_decode_reads_only_what_the_element_size_covers():
    raw, values = spec_entry(3, 96)          # ends after pasid (92..96)
    entry = decode_hwctx_entries(raw, 96, 1)[0]
    assert (entry.state, entry.pasid) == (values["state"], values["pasid"])
    assert entry.gops is None and entry.fatal_error_app_module is None and entry.name is None
    raw, _ = spec_entry(4, 150)              # a name cut short is not read
    assert decode_hwctx_entries(raw, 150, 1)[0].name is None


def test_decode_refuses_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="entries of 40 bytes: an entry holds at least 64"):
        decode_hwctx_entries(bytes(40), 40, 1)
    with pytest.raises(ValueError, match="2 hwctx entries of 144 bytes need 288 bytes, got 200"):
        decode_hwctx_entries(bytes(200), 144, 2)


def test_state_names():
    assert HwContextEntry(*range(9), state=1).state_name == "ACTIVE"
    assert HwContextEntry(*range(9), state=0).state_name == "IDLE"
    assert HwContextEntry(*range(9), state=7).state_name == "STATE_7"
    assert HwContextEntry(*range(9)).state_name is None


def _run_three_times(dev, emu, column_width: int = 1, priority: str | None = None):
    stream = insts.dma_stream(4 if emu.profile.name != "npu1" else 3, [(0, 256, "in"), (1, 256, "out")])
    emu.models.bind(insts.encode(stream), Passthrough())
    ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=column_width, n_buffers=2), priority=priority)
    run = ctx.kernel().prepare_npu(stream, [dev.bo(4096), dev.bo(4096)])
    for _ in range(3):
        run.start().wait(5)
    return ctx


def test_hw_contexts_from_get_array_mainline_entries():
    with EmuDevice("npu4:linux-6.18") as emu, open_device(emu) as dev:      # spatial placement: 2 columns
        assert dev.hw_contexts() == []
        ctx = _run_three_times(dev, emu, column_width=2, priority="normal")
        (entry,) = dev.hw_contexts()
    assert (entry.source, entry.element_size) == ("GET_ARRAY", MAINLINE)     # the emulator answers 144 (mainline)
    assert (entry.context_id, entry.num_col, entry.pid) == (ctx.handle, 2, os.getpid())
    assert entry.command_submissions == entry.command_completions == 3 and entry.errors == 0
    assert entry.priority == 0x200                                            # AMDXDNA_QOS_NORMAL_PRIORITY
    assert entry.state_name == "ACTIVE" and entry.name is None
    assert dev.stats["GET_ARRAY"] == 2 and dev.stats["GET_INFO"] == 1        # metadata only: no QUERY_HW_CONTEXTS


def test_hw_contexts_from_an_emulated_out_of_tree_driver():
    # The emulator's out-of-tree driver answers 160-byte entries with the process name; its NPU4 places every
    # context over the whole array (temporal-only, 8 columns).
    with open("/proc/self/comm", encoding="ascii", errors="replace") as f:
        comm = f.read().strip()[:15]                 # the kernel's task name: 15 bytes and a NUL
    with EmuDevice("npu4:xdna-oot") as emu, open_device(emu) as dev:
        first = _run_three_times(dev, emu)
        second = dev.hw_context(build_mlir_aie(b"pdi", column_width=2, n_buffers=2))
        entries = dev.hw_contexts()
    assert [(e.context_id, e.num_col, e.element_size, e.name) for e in entries] == \
        [(first.handle, 8, OOT, comm), (second.handle, 8, OOT, comm)]
    assert [e.command_submissions for e in entries] == [3, 0]


class _OotDriver:
    """An EmuDevice whose GET_ARRAY(HW_CONTEXT_ALL) answers 160-byte out-of-tree entries (name at 144)."""

    def __init__(self, emu: EmuDevice, names: list[bytes]) -> None:
        self.emu, self.names = emu, names

    def __getattr__(self, name: str):
        return getattr(self.emu, name)

    def open(self):
        return _OotSeam(self.emu.open(), self.names)


class _OotSeam:
    def __init__(self, inner, names: list[bytes]) -> None:
        self.inner, self.names = inner, names

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def ioctl(self, request: int, buf) -> int:
        result = self.inner.ioctl(request, buf)
        param, size, count, _, addr = GET_ARRAY_STRUCT.unpack_from(buf)
        if request == GET_ARRAY and param == HW_CONTEXT_ALL:
            assert size == MAINLINE                    # what the emulator wrote, 144-byte stride
            wide = b"".join(ctypes.string_at(addr + i * size, size) + self.names[i].ljust(16, b"\0")
                            for i in range(count))
            ctypes.memmove(addr, wide, len(wide))
            GET_ARRAY_STRUCT.pack_into(buf, 0, param, OOT, count, 0, addr)
        return result


def test_hw_contexts_index_160_byte_entries_by_the_returned_size():
    with EmuDevice("npu4") as emu, open_device(emu) as other:
        first = _run_three_times(other, emu)
        second = other.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        with open_device(_OotDriver(emu, [b"python3", b"worker"])) as dev:
            entries = dev.hw_contexts()
    assert [(e.context_id, e.name, e.element_size) for e in entries] == \
        [(first.handle, "python3", OOT), (second.handle, "worker", OOT)]
    assert [e.command_submissions for e in entries] == [3, 0]                 # the stride is right
    assert all(e.state_name == "ACTIVE" and e.pid == os.getpid() for e in entries)


def test_hw_contexts_on_a_driver_without_get_array():
    # Feature level 0.0 (Linux 6.14-6.17): no GET_ARRAY; QUERY_HW_CONTEXTS answers (docs/uapi.md 11).
    with EmuDevice("npu1", drm_minor=0) as emu, open_device(emu) as dev:
        ctx = _run_three_times(dev, emu)
        (entry,) = dev.hw_contexts()
    assert (entry.source, entry.element_size) == ("QUERY_HW_CONTEXTS", 64)
    assert (entry.context_id, entry.num_col, entry.command_submissions) == (ctx.handle, 1, 3)
    assert entry.state is None and entry.priority is None and entry.name is None


class _BadSizeSeam(_OotSeam):
    def ioctl(self, request: int, buf) -> int:
        result = self.inner.ioctl(request, buf)
        if request == GET_ARRAY:
            param, _, count, _, addr = GET_ARRAY_STRUCT.unpack_from(buf)
            GET_ARRAY_STRUCT.pack_into(buf, 0, param, HWCTX_ENTRY_SIZE + 8, count, 0, addr)
        return result


def test_an_element_size_larger_than_asked_is_a_protocol_error():
    with EmuDevice("npu4") as emu, open_device(emu) as other:
        held = other.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))  # noqa: F841 - kept alive

        class Driver(_OotDriver):
            def open(self):
                return _BadSizeSeam(self.emu.open(), [])

        with open_device(Driver(emu, [])) as dev, pytest.raises(errors.XdnaError) as info:
            dev.hw_contexts()
    assert info.value.errno == errno.EPROTO
    assert "GET_ARRAY(param=HW_CONTEXT_ALL, element_size=160, num_element=64)" in str(info.value)
    assert "element_size=168, num_element=1" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, 1025, True, 2.0])
def test_max_entries_is_checked(bad):
    with open_device("emu:npu1") as dev, pytest.raises(ValueError, match="max_entries must be an int in 1..1024"):
        dev.hw_contexts(bad)
