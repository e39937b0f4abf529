"""Raw-ioctl helpers for the emulator tests.

Structs are packed by hand with ``struct`` from `docs/uapi.md A.1-A.2` and `docs/uapi.md A.3`
(little-endian x86_64 layouts), request numbers are built from the `_IOC` bit layout of
`docs/uapi.md` section 1, and user memory is plain ctypes memory whose address goes into the
structs as a user pointer. Nothing here goes through `amdxdna_direct.abi`: the tests must check the
emulator against the ABI facts, not against the binding.

Also shared by the emulator tests: `call` and `errno_of` check every driver error's message (it names the
ioctl and the errno), `emu_device` closes a device and checks nothing it handed out is left, `Gate`
is a model that holds a job open, and the builders of TXN streams, regmaps and ERT packets.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from amdxdna_direct.emu import EmuDevice, Passthrough

# _IOC layout (asm-generic/ioctl.h): nr bits 7:0, type 15:8, size 29:16, dir 31:30.
IOC_NRSHIFT = 0
IOC_TYPESHIFT = 8
IOC_SIZESHIFT = 16
IOC_DIRSHIFT = 30
IOC_WRITE = 1
IOC_READ = 2
DRM_IOCTL_BASE = ord("d")
DRM_COMMAND_BASE = 0x40

# Struct formats (offsets from the ABI facts; "x" pads where the C struct has padding).
FMT = {
    "qos_info": "<6I",                      # gops fps dma_bandwidth latency frame_exec_time priority
    "create_hwctx": "<QQQ8I",               # ext ext_flags qos_p umq_bo log_buf_bo max_opc num_tiles
                                            # mem_size umq_doorbell handle syncobj_handle
    "destroy_hwctx": "<II",                 # handle pad
    "config_hwctx": "<IIQII",               # handle param_type param_val param_val_size pad
    "create_bo": "<QQQII",                  # flags vaddr size type handle
    "get_bo_info": "<QQIIQQQ",              # ext ext_flags handle pad map_offset vaddr xdna_addr
    "sync_bo": "<IIQQ",                     # handle direction offset size
    "exec_cmd": "<QQIIQQIIQ",               # ext ext_flags hwctx type cmd_handles args cmd_count arg_count seq
    "wait_cmd": "<IIQ",                     # hwctx timeout seq
    "get_info": "<IIQ",                     # param buffer_size buffer
    "get_array": "<IIIIQ",                  # param element_size num_element pad buffer
    "set_state": "<IIQ",                    # param buffer_size buffer
    "drm_version": "<iii4xQQQQQQ",          # major minor patchlevel name_len name date_len date desc_len desc
    "gem_close": "<II",                     # handle pad
    "get_cap": "<QQ",                       # capability value
    "syncobj_create": "<II",                # handle flags
    "syncobj_destroy": "<II",               # handle pad
    "syncobj_wait": "<QqIII4x",             # handles timeout_nsec count_handles flags first_signaled
    "syncobj_timeline_wait": "<QQqIII4x",   # handles points timeout_nsec count_handles flags first_signaled
    "syncobj_timeline_array": "<QQII",      # handles points count_handles flags
    "syncobj_array": "<QII",                # handles count_handles pad
    "prime_handle": "<IIi",                 # handle flags fd
}

IOWR = IOC_READ | IOC_WRITE
IOW = IOC_WRITE

# name -> (direction, nr, struct key)
REQUESTS = {
    "CREATE_HWCTX": (IOWR, DRM_COMMAND_BASE + 0, "create_hwctx"),
    "DESTROY_HWCTX": (IOWR, DRM_COMMAND_BASE + 1, "destroy_hwctx"),
    "CONFIG_HWCTX": (IOWR, DRM_COMMAND_BASE + 2, "config_hwctx"),
    "CREATE_BO": (IOWR, DRM_COMMAND_BASE + 3, "create_bo"),
    "GET_BO_INFO": (IOWR, DRM_COMMAND_BASE + 4, "get_bo_info"),
    "SYNC_BO": (IOWR, DRM_COMMAND_BASE + 5, "sync_bo"),
    "EXEC_CMD": (IOWR, DRM_COMMAND_BASE + 6, "exec_cmd"),
    "GET_INFO": (IOWR, DRM_COMMAND_BASE + 7, "get_info"),
    "SET_STATE": (IOWR, DRM_COMMAND_BASE + 8, "set_state"),
    "WAIT_CMD": (IOW, DRM_COMMAND_BASE + 9, "wait_cmd"),
    "GET_ARRAY": (IOWR, DRM_COMMAND_BASE + 10, "get_array"),
    "VERSION": (IOWR, 0x00, "drm_version"),
    "GEM_CLOSE": (IOW, 0x09, "gem_close"),
    "GET_CAP": (IOWR, 0x0C, "get_cap"),
    "PRIME_HANDLE_TO_FD": (IOWR, 0x2D, "prime_handle"),
    "PRIME_FD_TO_HANDLE": (IOWR, 0x2E, "prime_handle"),
    "SYNCOBJ_CREATE": (IOWR, 0xBF, "syncobj_create"),
    "SYNCOBJ_DESTROY": (IOWR, 0xC0, "syncobj_destroy"),
    "SYNCOBJ_WAIT": (IOWR, 0xC3, "syncobj_wait"),
    "SYNCOBJ_RESET": (IOWR, 0xC4, "syncobj_array"),
    "SYNCOBJ_SIGNAL": (IOWR, 0xC5, "syncobj_array"),
    "SYNCOBJ_TIMELINE_WAIT": (IOWR, 0xCA, "syncobj_timeline_wait"),
    "SYNCOBJ_QUERY": (IOWR, 0xCB, "syncobj_timeline_array"),
    "SYNCOBJ_TIMELINE_SIGNAL": (IOWR, 0xCD, "syncobj_timeline_array"),
}

# Enum values (docs/uapi.md section 3).
BO_SHMEM, BO_DEV_HEAP, BO_DEV, BO_CMD = 1, 2, 3, 4
CONFIG_CU, ASSIGN_DBG_BUF, REMOVE_DBG_BUF = 0, 1, 2
INVALID_ADDR = (1 << 64) - 1
HEAP_BASE = 0x4000000
PAGE = 4096
WAIT_ALL, WAIT_FOR_SUBMIT = 1, 2
# ERT command header (docs/uapi.md section 6.1) and states.
ERT_START_CU, ERT_CMD_CHAIN, ERT_START_NPU = 0, 19, 20
ERT_STATE_NEW, ERT_STATE_COMPLETED, ERT_STATE_ERROR, ERT_STATE_ABORT, ERT_STATE_TIMEOUT = 1, 4, 5, 6, 8
ZERO_LIVE = {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def check_released(device: EmuDevice) -> None:
    """Nothing a closed device handed out is left: no BO, context, syncobj, mapping or mapped byte.

    Raises:
        AssertionError: something leaked (on whatever path the test took).
    """
    live, mapped = device.counters.live(), device.counters.bytes_mapped
    if live != ZERO_LIVE or mapped:
        raise AssertionError(f"after close: live {live}, {mapped} bytes mapped")


class Gate:
    """A model that holds its job open until released (at most 10 s), then copies like Passthrough."""

    name = "gate"

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, args) -> None:
        self.entered.set()
        self.release.wait(10)
        Passthrough()(args)


@contextlib.contextmanager
def emu_device(profile: str = "npu4", **options) -> Iterator[EmuDevice]:
    """An EmuDevice closed on exit, then (when the body passed) checked with `check_released`."""
    with EmuDevice(profile, **options) as device:
        yield device
    check_released(device)


def ioc(direction: int, nr: int, size: int, type_byte: int = DRM_IOCTL_BASE) -> int:
    """Build an ioctl request number from its fields."""
    return (direction << IOC_DIRSHIFT) | (size << IOC_SIZESHIFT) | (type_byte << IOC_TYPESHIFT) | (nr << IOC_NRSHIFT)


def request(name: str) -> int:
    """Request number of a named ioctl (size from the struct format)."""
    direction, nr, key = REQUESTS[name]
    return ioc(direction, nr, struct.calcsize(FMT[key]))


def pack(key: str, *values) -> bytearray:
    """Pack a struct into a fresh writable buffer."""
    return bytearray(struct.pack(FMT[key], *values))


def unpack(key: str, buf) -> tuple:
    """Unpack a struct from a buffer (extra tail bytes ignored)."""
    return struct.unpack_from(FMT[key], buf)


def check_message(exc: OSError, op: str | None = None) -> None:
    """House style for driver errors: the message names the errno symbolically and, given `op`, the ioctl.

    Raises:
        AssertionError: the message lacks either.
    """
    name = errno.errorcode.get(exc.errno, "no errno")
    text = str(exc)
    if name not in text or (op is not None and op not in text):
        raise AssertionError(f"error message {text!r} does not name {name}" + (f" and {op}" if op else ""))


def call(seam, name: str, *values) -> tuple:
    """Pack `values`, run the ioctl and return the unpacked result.

    Raises:
        OSError: the driver's answer, after checking that its message names `name` and the errno.
    """
    buf = pack(REQUESTS[name][2], *values)
    try:
        seam.ioctl(request(name), buf)
    except OSError as exc:
        check_message(exc, name)
        raise
    return unpack(REQUESTS[name][2], buf)


def errno_of(fn, *args, **kwargs) -> int:
    """The errno of the OSError `fn(*args, **kwargs)` raises (its message must name that errno)."""
    with pytest.raises(OSError) as caught:
        fn(*args, **kwargs)
    check_message(caught.value)
    return caught.value.errno


class UserMem:
    """A block of process memory whose address is passed to the driver as a user pointer."""

    def __init__(self, data: bytes | int):
        size = data if isinstance(data, int) else len(data)
        self._buf = ctypes.create_string_buffer(max(size, 1))
        self.size = size
        if not isinstance(data, int):
            ctypes.memmove(self._buf, data, size)

    @property
    def addr(self) -> int:
        return ctypes.addressof(self._buf)

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        length = self.size - offset if length is None else length
        return ctypes.string_at(self.addr + offset, length)

    def write(self, data: bytes, offset: int = 0) -> None:
        ctypes.memmove(self.addr + offset, data, len(data))


def read_addr(addr: int, length: int) -> bytes:
    """Read `length` bytes at a process address (for example a BO mapping)."""
    return ctypes.string_at(addr, length)


def write_addr(addr: int, data: bytes) -> None:
    """Write bytes at a process address (for example a BO mapping)."""
    ctypes.memmove(addr, data, len(data))


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC now, the clock of DRM syncobj absolute timeouts."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass
class BoInfo:
    map_offset: int
    vaddr: int
    xdna_addr: int


class Raw:
    """Thin wrappers over one seam for the common sequences (each is one ioctl unless said)."""

    def __init__(self, seam):
        self.seam = seam
        self.keep: list[UserMem] = []   # user memory that must outlive the call that passed it

    def create_bo(self, size: int, bo_type: int, flags: int = 0) -> int:
        return call(self.seam, "CREATE_BO", flags, 0, size, bo_type, 0)[4]

    def bo_info(self, handle: int) -> BoInfo:
        values = call(self.seam, "GET_BO_INFO", 0, 0, handle, 0, 0, 0, 0)
        return BoInfo(values[4], values[5], values[6])

    def map_bo(self, handle: int, length: int, addr: int = 0) -> int:
        """GET_BO_INFO + mmap at its map_offset; returns the address."""
        return self.seam.mmap(length, self.bo_info(handle).map_offset, addr)

    def shmem(self, size: int, bo_type: int = BO_SHMEM) -> tuple[int, int]:
        """A mapped SHMEM (or CMD) BO: (handle, address)."""
        handle = self.create_bo(size, bo_type)
        return handle, self.map_bo(handle, size)

    def heap(self, size: int = 64 << 20) -> tuple[int, int]:
        """DEV_HEAP created and mapped at a 64 MiB-aligned reservation, as XRT does: (handle, address)."""
        handle = self.create_bo(size, BO_DEV_HEAP)
        base = self.seam.reserve(size, 64 << 20)
        return handle, self.map_bo(handle, size, base)

    def dev_bo(self, size: int) -> tuple[int, BoInfo]:
        handle = self.create_bo(size, BO_DEV)
        return handle, self.bo_info(handle)

    def create_hwctx(self, num_tiles: int = 4, priority: int = 0, max_opc: int = 0,
                     qos: bytes | None = None) -> tuple[int, int]:
        """CREATE_HWCTX with a zero QoS (or `qos` bytes); returns (handle, syncobj_handle)."""
        mem = UserMem(qos if qos is not None else struct.pack(FMT["qos_info"], 0, 0, 0, 0, 0, priority))
        values = call(self.seam, "CREATE_HWCTX", 0, 0, mem.addr, 0, 0, max_opc, num_tiles, 0, 0, 0, 0)
        return values[9], values[10]

    def destroy_hwctx(self, handle: int) -> None:
        call(self.seam, "DESTROY_HWCTX", handle, 0)

    def config_cu(self, ctx: int, cus: list[tuple[int, int]]) -> None:
        payload = struct.pack("<H6x", len(cus)) + b"".join(struct.pack("<IB3x", bo, func) for bo, func in cus)
        mem = UserMem(payload)
        call(self.seam, "CONFIG_HWCTX", ctx, CONFIG_CU, mem.addr, len(payload), 0)

    def exec_cmd(self, ctx: int, cmd_handle: int, args: list[int]) -> int:
        """EXEC_CMD of one command BO; returns seq."""
        mem = UserMem(struct.pack(f"<{len(args)}I", *args))
        self.keep.append(mem)
        return call(self.seam, "EXEC_CMD", 0, 0, ctx, 0, cmd_handle, mem.addr if args else 0, 1, len(args), 0)[8]

    def timeline_wait(self, syncobj: int, point: int, timeout_s: float = 5.0, flags: int = WAIT_FOR_SUBMIT) -> None:
        """SYNCOBJ_TIMELINE_WAIT on one point with an absolute deadline `timeout_s` from now."""
        handles = UserMem(struct.pack("<I", syncobj))
        points = UserMem(struct.pack("<Q", point))
        deadline = monotonic_ns() + int(timeout_s * 1e9)
        call(self.seam, "SYNCOBJ_TIMELINE_WAIT", handles.addr, points.addr, deadline, 1, flags, 0)

    def query(self, syncobj: int, flags: int = 0) -> int:
        """SYNCOBJ_QUERY of one syncobj: its last signalled (or submitted, flags=1) point."""
        handles = UserMem(struct.pack("<I", syncobj))
        points = UserMem(8)
        call(self.seam, "SYNCOBJ_QUERY", handles.addr, points.addr, 1, flags)
        return struct.unpack("<Q", points.read())[0]

    def syncobj_destroy(self, handle: int) -> None:
        call(self.seam, "SYNCOBJ_DESTROY", handle, 0)

    def gem_close(self, handle: int) -> None:
        call(self.seam, "GEM_CLOSE", handle, 0)

    def timeline_signal(self, syncobj: int, point: int) -> None:
        """SYNCOBJ_TIMELINE_SIGNAL of one point."""
        handles, points = UserMem(struct.pack("<I", syncobj)), UserMem(struct.pack("<Q", point))
        call(self.seam, "SYNCOBJ_TIMELINE_SIGNAL", handles.addr, points.addr, 1, 0)

    def sync(self, handle: int, size: int, offset: int = 0) -> None:
        """SYNC_BO of [offset, offset+size), direction TO_DEVICE (the runtime's choice for both ways)."""
        call(self.seam, "SYNC_BO", handle, 0, offset, size)

    def get_info(self, param: int, size: int, prefill: bytes = b"") -> tuple[bytes, int]:
        """GET_INFO into a `size`-byte buffer (optionally pre-filled); returns (buffer bytes, buffer_size out)."""
        mem = UserMem(size)
        mem.write(prefill)
        values = call(self.seam, "GET_INFO", param, size, mem.addr)
        return mem.read(), values[1]


def ert_header(opcode: int, count: int, extra_cu_masks: int = 0, state: int = ERT_STATE_NEW) -> int:
    """ERT command header word (docs/uapi.md section 6.1)."""
    return state | (extra_cu_masks << 10) | (count << 12) | (opcode << 23)


def packet(opcode: int, words: list[int], masks: tuple[int, ...] = (1,), count: int | None = None,
           type_bits: int = 0) -> bytes:
    """A kernel-start ERT packet: header (count defaults to masks + words), the CU masks, then `words`."""
    body = [*masks, *words]
    head = ert_header(opcode, len(body) if count is None else count, extra_cu_masks=max(0, len(masks) - 1))
    return struct.pack(f"<{len(body) + 1}I", head | type_bits << 28, *body)


def chain_packet(handles: list[int], opcode: int = ERT_CMD_CHAIN) -> bytes:
    """An ERT_CMD_CHAIN packet: command_count, submit/error index, reserved, then one u64 handle per sub-command."""
    words = [len(handles), 0, 0, 0, 0, 0]
    for handle in handles:
        words += [handle & 0xFFFFFFFF, handle >> 32]
    return struct.pack(f"<{len(words) + 1}I", ert_header(opcode, len(words)), *words)


def regmap(instr: int, ninstr: int, slots: list[int], nslots: int = 0) -> list[int]:
    """The mlir-aie regmap (docs/xrt-sequence.md 1.7): u64 opcode 3 @0, u64 instr @8, u32 ninstr @0x10, then u64
    buffer slots @0x14 + 8k, zero-padded to `nslots`."""
    words = [3, 0, instr & 0xFFFFFFFF, instr >> 32, ninstr]
    for addr in slots + [0] * (nslots - len(slots)):
        words += [addr & 0xFFFFFFFF, (addr >> 32) & 0xFFFFFFFF]
    return words


def txn_stream(dev_gen: int, buffers: list[tuple[int, int]], tag: int = 0, arg_plus: int = 0,
               extra: list[list[int]] = ()) -> bytes:
    """A TXN stream (docs/xrt-sequence.md 2.3): per (arg_idx, nbytes) a shim BD, its DDR_PATCH from arg_idx and
    a queue push; then a sync. `extra` ops (lists of words) go right after the first WRITE32."""
    ops: list[list[int]] = [[0x00, 0, 0x1D200, 0, tag & 0xFFFFFFFF, 24], *extra]
    for bd, (arg_idx, nbytes) in enumerate(buffers):
        base = 0x1D000 + 0x20 * bd
        ops.append([0x01, 0, base, 48, nbytes // 4, 0, 0, 0, 0x80000000, 0x02000000, 0, 0x02000000])
        ops.append([0x81, 48, 0, 0, 0, 0, base + 4, 0, arg_idx, 0, arg_plus, 0])
        ops.append([0x00, 0, 0x1D214, 0, 0x80000000 | bd, 24])
    ops.append([0x80, 16, 0, 0x00010100])
    body = [w for op in ops for w in op]
    words = [0x06000100 | (dev_gen << 16), 0x101, len(ops), 4 * (4 + len(body)), *body]
    return struct.pack(f"<{len(words)}I", *words)


def state_of(addr: int) -> int:
    """The state nibble of the ERT header at a process address (a mapped command BO)."""
    return struct.unpack("<I", read_addr(addr, 4))[0] & 0xF


class Npu:
    """One emulated device, one fd with its heap, and helpers for the XRT-shaped sequence."""

    def __init__(self, profile: str = "npu4", tdr: float | None = 2.0, **options):
        if tdr is not None:
            options["tdr_timeout"] = tdr
        self.dev = EmuDevice(profile, **options)
        self.seam = self.dev.open()
        self.raw = Raw(self.seam)
        self.heap, self.heap_va = self.raw.heap()
        self.gen = 3 if profile.split(":")[0] == "npu1" else 4

    def context(self, cus: int = 1, pdi: bytes = b"\xdd" * 256, num_tiles: int = 4) -> tuple[int, int]:
        ctx, syncobj = self.raw.create_hwctx(num_tiles=num_tiles)
        handles = []
        for _ in range(cus):
            handle, info = self.raw.dev_bo(len(pdi))
            write_addr(info.vaddr, pdi)
            self.raw.sync(handle, len(pdi))
            handles.append(handle)
        self.raw.config_cu(ctx, [(h, 0) for h in handles])
        return ctx, syncobj

    def instr(self, stream: bytes) -> tuple[int, int]:
        """Instruction stream in a DEV BO: (handle, device address)."""
        handle, info = self.raw.dev_bo(len(stream))
        write_addr(info.vaddr, stream)
        self.raw.sync(handle, len(stream))
        return handle, info.xdna_addr

    def data(self, nbytes: int, content: bytes = b"") -> tuple[int, int]:
        """A mapped SHMEM BO: (handle, address = the device address under SVA)."""
        size = max(4096, (nbytes + 4095) // 4096 * 4096)
        handle, addr = self.raw.shmem(size)
        write_addr(addr, content)
        self.raw.sync(handle, size)
        return handle, addr

    def cmd(self, content: bytes, size: int = 4096) -> tuple[int, int]:
        handle, addr = self.raw.shmem(size, BO_CMD)
        write_addr(addr, content)
        return handle, addr

    def passthrough(self, nbytes: int = 64, tag: int = 0, model=None) -> dict:
        """A bound passthrough stream with input/output buffers and a ready ERT_START_CU packet."""
        stream = txn_stream(self.gen, [(0, nbytes), (1, nbytes)], tag=tag)
        self.dev.models.bind(stream, model or Passthrough())
        ins, iaddr = self.instr(stream)
        src = bytes((tag + i) % 251 + 1 for i in range(nbytes))
        a, a_addr = self.data(nbytes, src)
        b, b_addr = self.data(nbytes)
        words = regmap(iaddr, len(stream) // 4, [a_addr, b_addr], nslots=5)
        cmd, cmd_addr = self.cmd(packet(ERT_START_CU, words))
        return dict(stream=stream, src=src, out=b_addr, out_bo=b, cmd=cmd, cmd_addr=cmd_addr, args=[ins, a, b],
                    words=words, nbytes=nbytes)

    def output(self, job: dict, length: int | None = None) -> bytes:
        """The passthrough job's output as the CPU reads it after syncing the output BO."""
        length = job["nbytes"] if length is None else length
        self.raw.sync(job["out_bo"], length)
        return read_addr(job["out"], length)

    def exec(self, ctx: int, job: dict) -> int:
        return self.raw.exec_cmd(ctx, job["cmd"], job["args"])

    def close(self) -> None:
        self.seam.close()
        check_released(self.dev)
        self.dev.close()


def run_one(npu: Npu, ctx: int, syncobj: int, job: dict) -> int:
    seq = npu.exec(ctx, job)
    npu.raw.timeline_wait(syncobj, seq)
    return state_of(job["cmd_addr"])
