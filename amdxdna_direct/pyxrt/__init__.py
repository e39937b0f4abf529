"""The part of XRT's ``pyxrt`` module that NPU host code uses, on this runtime (docs/pyxrt.md).

Names, signatures and defaults follow pyxrt; what is not supported raises a one-line ``NotImplementedError``
naming the call. ``import amdxdna_direct.pyxrt as xrt``, or run a script unchanged with
``python -m amdxdna_direct.pyxrt SCRIPT [ARGS...]``.
"""

from __future__ import annotations

import contextlib
import enum
import glob
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import kernel as kernel_mod
from .. import xclbin as xclbin_mod
from ..bo import FROM_DEVICE, TO_DEVICE, Bo
from ..device import PCI_GENERATIONS, SYSFS_ACCEL, Device, open_device
from ..errors import CommandError, CommandTimeout

__all__ = ["xclBOSyncDirection", "ert_cmd_state", "xrt_info_device", "uuid", "xclbin", "device", "hw_context",
           "kernel", "bo", "run", "runlist", "enumerate_devices", "elf", "ext", "PyxrtError", "XRT_DEVICE_NAMES"]

#: The opcode mlir-aie's host code passes first: a TXN instruction stream (docs/xrt-sequence.md 2.2).
_NPU_OPCODE = 3


class PyxrtError(RuntimeError):
    """A call XRT would answer with an exception (callers catch ``RuntimeError``); the message is the runtime's."""


class xclBOSyncDirection(enum.IntEnum):  # noqa: N801 (pyxrt's spelling)
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1
    XCL_BO_SYNC_BO_GMIO_TO_AIE = 2
    XCL_BO_SYNC_BO_AIE_TO_GMIO = 3


class ert_cmd_state(enum.IntEnum):  # noqa: N801
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_RUNNING = 3
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_ABORT = 6
    ERT_CMD_STATE_SUBMITTED = 7
    ERT_CMD_STATE_TIMEOUT = 8
    ERT_CMD_STATE_NORESPONSE = 9
    ERT_CMD_STATE_SKERROR = 10
    ERT_CMD_STATE_SKCRASHED = 11

    __str__ = enum.Enum.__str__     # pybind11 prints "ert_cmd_state.ERT_CMD_STATE_COMPLETED"


class xrt_info_device(enum.Enum):  # noqa: N801
    """The keys of ``device.get_info``; ``name`` and ``bdf`` are answered, the others NotImplementedError."""

    bdf = "bdf"
    interface_uuid = "interface_uuid"
    kdma = "kdma"
    max_clock_frequency_mhz = "max_clock_frequency_mhz"
    m2m = "m2m"
    name = "name"
    nodma = "nodma"
    offline = "offline"
    electrical = "electrical"
    thermal = "thermal"
    mechanical = "mechanical"
    memory = "memory"
    platform = "platform"
    pcie_info = "pcie_info"
    host = "host"
    aie = "aie"
    aie_shim = "aie_shim"
    dynamic_regions = "dynamic_regions"
    vmr = "vmr"


@contextlib.contextmanager
def _xrt_errors(call: str) -> Iterator[None]:
    """Raise the runtime's OSError (an ioctl, the device node, a file) as XRT's exception type, a RuntimeError,
    with the runtime's message; the OSError is chained (docs/pyxrt.md, Errors)."""
    try:
        yield
    except OSError as exc:
        raise PyxrtError(f"pyxrt.{call}: {exc}") from exc


def _unsupported(call: str) -> NotImplementedError:
    return NotImplementedError(f"pyxrt.{call} is not supported by amdxdna_direct.pyxrt (docs/pyxrt.md)")


class uuid:  # noqa: N801
    """An xclbin's 16-byte uuid."""

    def __init__(self, raw: bytes) -> None:
        self._raw = bytes(raw)

    def to_string(self) -> str:
        h = self._raw.hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, uuid) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)


class _xclbin_arg:  # noqa: N801
    def __init__(self, arg: Any) -> None:
        self._arg = arg

    def get_name(self) -> str:
        return str(self._arg.name)

    def get_index(self) -> int:
        return int(self._arg.index)

    def get_offset(self) -> int:
        return int(self._arg.offset)

    def get_size(self) -> int:
        return int(self._arg.size)

    def get_host_type(self) -> str:
        return str(self._arg.type)


class _xclbin_kernel:  # noqa: N801
    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel

    def get_name(self) -> str:
        return str(self._kernel.name)

    def get_args(self) -> list[_xclbin_arg]:
        return [_xclbin_arg(a) for a in self._kernel.args]

    def get_num_args(self) -> int:
        return len(self._kernel.args)


class xclbin:  # noqa: N801
    """``xrt.xclbin(path)``: a parsed xclbin.

    Raises:
        PyxrtError: the file cannot be read or is not a usable xclbin (the parser's message, chained).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with _xrt_errors("xclbin"):
            try:
                self._x = xclbin_mod.parse(path)
            except ValueError as exc:
                raise PyxrtError(f"pyxrt.xclbin: {exc}") from exc

    def get_kernels(self) -> list[_xclbin_kernel]:
        return [_xclbin_kernel(k) for k in self._x.kernels]

    def get_uuid(self) -> uuid:
        return uuid(self._x.uuid)

    def get_xsa_name(self) -> str:
        """The platform the xclbin was built for: its axlf header's ``m_platformVBNV`` (empty when it names none)."""
        return str(self._x.header.platform_vbnv)


def _amdxdna_nodes() -> list[str]:
    return sorted(glob.glob("/dev/accel/accel*"), key=lambda p: int(p.rsplit("accel", 1)[1] or 0))


def _node_bdf(node: str) -> str | None:
    """The PCI address of an accel node: the name its sysfs ``device`` link resolves to, or None."""
    link = os.path.join(SYSFS_ACCEL, os.path.basename(node), "device")
    return os.path.basename(os.path.realpath(link)) if os.path.exists(link) else None


def _full_bdf(bdf: str) -> str:
    """``c5:00.1`` -> ``0000:c5:00.1`` (XRT and sysfs name the PCI domain; users often leave it out)."""
    return bdf.lower() if bdf.count(":") == 2 else f"0000:{bdf.lower()}"


def _node_at(bdf: str) -> str:
    want = _full_bdf(bdf)
    nodes = _amdxdna_nodes()
    for node in nodes:
        if _node_bdf(node) == want:
            return node
    found = ", ".join(f"{n} at {_node_bdf(n)}" for n in nodes) or "no /dev/accel/accel* node"
    raise PyxrtError(f"pyxrt.device({bdf!r}): no amdxdna device at PCI address {want} ({found})")


#: The driver's default ``vbnv`` per NPU generation: what XRT's ``get_info(name)`` returns when the node's sysfs
#: ``vbnv`` cannot be read (docs/pyxrt.md, get_info); host code such as IRON's picks NPU1 or NPU2 kernels by it.
XRT_DEVICE_NAMES = {gen: f"RyzenAI-{gen}" for gen in PCI_GENERATIONS.values()}


def _sysfs_vbnv(node: str) -> str | None:
    try:
        with open(os.path.join(SYSFS_ACCEL, os.path.basename(node), "device", "vbnv")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def enumerate_devices() -> int:
    """How many devices ``device(index)`` can open: 1 when ``$AMDXDNA_DEVICE`` names one, else the accel nodes."""
    return 1 if os.environ.get("AMDXDNA_DEVICE") else len(_amdxdna_nodes())


class device:  # noqa: N801
    """``xrt.device(index)`` / ``xrt.device(bdf)``: index 0 is ``$AMDXDNA_DEVICE`` or the first amdxdna node; a
    PCI address (``0000:c5:00.1`` or ``c5:00.1``) is the node whose sysfs device it is. A node path or an
    ``emu:`` spec string is opened as given.

    Raises:
        PyxrtError: ``open_device`` failed (NoDeviceError, PermissionDeniedError chained).
        PyxrtError: no device at that index or PCI address.
    """

    def __init__(self, index: int | str = 0) -> None:
        if isinstance(index, str):
            spec: str | None = index if index.startswith(("emu", "/")) else _node_at(index)
        elif int(index) == 0:
            spec = None
        else:
            nodes = _amdxdna_nodes()
            if not 0 <= index < len(nodes):
                raise PyxrtError(f"pyxrt.device({index}): no such device ({len(nodes)} accel nodes)")
            spec = nodes[index]
        with _xrt_errors("device"):
            self._dev: Device = open_device(spec)
        self._xclbins: dict[uuid, Any] = {}

    def register_xclbin(self, xb: xclbin) -> uuid:
        """Remember ``xb`` for ``hw_context(device, uuid)``; returns its uuid."""
        key = xb.get_uuid()
        self._xclbins[key] = xb._x
        return key

    def load_xclbin(self, xb: xclbin | str) -> uuid:
        """Deprecated in XRT (warns); registers the xclbin, as ``register_xclbin``."""
        warnings.warn("load_xclbin is deprecated, use register_xclbin and hw_context", DeprecationWarning,
                      stacklevel=2)
        return self.register_xclbin(xb if isinstance(xb, xclbin) else xclbin(xb))

    def get_info(self, key: xrt_info_device) -> str:
        """``name``: XRT's name of the device, the driver's ``vbnv`` (``RyzenAI-npu1``, ``RyzenAI-npu4``, ...; the
        emulator's profile's); ``bdf``: the node's PCI address (the ``emu:`` spec on the emulator).

        Raises:
            PyxrtError: the generation or the PCI address cannot be read from sysfs.
            NotImplementedError: any other key.
        """
        name = getattr(key, "name", key)
        if name == "name":
            if self._dev.emulator is not None:
                return str(self._dev.emulator.profile.vbnv)
            vbnv = _sysfs_vbnv(self._dev.name)
            if vbnv is not None:
                return vbnv
            gen = self._dev.generation
            if gen is None:
                raise PyxrtError(f"pyxrt.device.get_info(name): {self._dev.name}: the NPU generation is unknown "
                                 f"(its PCI id and revision under {SYSFS_ACCEL} are unreadable or not amdxdna's)")
            return XRT_DEVICE_NAMES[gen]
        if name == "bdf":
            if self._dev.emulator is not None:
                return self._dev.name
            bdf = _node_bdf(self._dev.name)
            if bdf is None:
                raise PyxrtError(f"pyxrt.device.get_info(bdf): {self._dev.name} has no {SYSFS_ACCEL} device link")
            return bdf
        raise _unsupported(f"device.get_info({name})")

    def close(self) -> None:
        self._dev.close()


_Device = device


class hw_context:  # noqa: N801
    """``xrt.hw_context(device, uuid | xclbin | path[, mode])``.

    Raises:
        PyxrtError: a uuid that was never registered on this device.
        PyxrtError: CREATE_HWCTX or its set-up failed (ContextUnavailableError, XdnaError chained).
    """

    def __init__(self, dev: device, xb: uuid | xclbin | str | os.PathLike[str], mode: Any = None) -> None:
        if isinstance(xb, uuid):
            if xb not in dev._xclbins:
                raise PyxrtError(f"pyxrt.hw_context: xclbin {xb.to_string()} is not registered on this device")
            parsed = dev._xclbins[xb]
        elif isinstance(xb, xclbin):
            parsed = xb._x
        else:
            parsed = xclbin(xb)._x
        self.device = dev
        with _xrt_errors("hw_context"):
            self._ctx = dev._dev.hw_context(parsed)


class bo:  # noqa: N801
    """``xrt.bo(device, size, flags=normal, group=0)``: a buffer object (SHMEM; the group id is checked, not used);
    ``xrt.bo(parent, size, offset)``: a sub-buffer sharing the parent's memory (``Bo.sub``).

    Raises:
        NotImplementedError: flags other than the four constants.
        ValueError: a size that is not positive; a sub-buffer outside its parent or not 4-byte aligned.
        PyxrtError: the allocation failed (XdnaError chained).
    """

    normal = 0
    cacheable = 1 << 24
    device_only = 1 << 28
    host_only = 1 << 29

    class flags(enum.IntEnum):  # noqa: N801
        normal = 0
        cacheable = 1 << 24
        device_only = 1 << 28
        host_only = 1 << 29

    device: _Device
    flags_value: int
    _bo: Bo

    def __init__(self, dev: _Device | bo, size: int, flags: int = 0, group: int = 0) -> None:
        if isinstance(dev, bo):
            self.device, self.flags_value = dev.device, dev.flags_value
            self._bo = dev._bo.sub(int(flags), int(size))
            return
        if int(flags) not in (0, bo.cacheable, bo.device_only, bo.host_only):
            raise _unsupported(f"bo(flags={int(flags):#x})")
        if int(size) <= 0:
            raise ValueError(f"pyxrt.bo: size must be positive, got {int(size)}")
        self.device = dev
        self.flags_value = int(flags)
        with _xrt_errors("bo"):
            self._bo = dev._dev.bo(int(size))

    def write(self, data: Any, offset: int = 0) -> None:
        self._bo.write(np.ascontiguousarray(data).view(np.uint8).reshape(-1), offset)

    def read(self, size: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self._bo.read(size, offset), dtype=np.int8).copy()

    def map(self) -> memoryview:
        view: memoryview = self._bo.view()
        return view

    def sync(self, direction: xclBOSyncDirection | int, size: int | None = None, offset: int = 0) -> None:
        to_dev = int(direction) in (0, 2)
        with _xrt_errors("bo.sync"):
            self._bo.sync(offset, size or None, TO_DEVICE if to_dev else FROM_DEVICE)

    def size(self) -> int:
        return int(self._bo.size)

    def address(self) -> int:
        return int(self._bo.address)


def bind_emulator_model(dev: Device, stream: bytes) -> None:
    """Bind ``$AMDXDNA_EMU_MODEL`` (as ``amdxdna run --model`` names it) to ``stream`` on an emulated device.

    The one place this layer binds models (docs/pyxrt.md, The emulator).
    """
    spec = os.environ.get("AMDXDNA_EMU_MODEL")
    if not spec or dev.emulator is None:
        return
    from ..cli.run_cmd import parse_model
    from ..doctor import bind_model
    from ..insts import decode

    bind_model(dev.emulator, decode(stream), parse_model(spec))


class kernel:  # noqa: N801
    """``xrt.kernel(hw_context, name)``; calling it with arguments starts a run."""

    def __init__(self, ctx: hw_context, name: str) -> None:
        self.context = ctx
        self._kernel = ctx._ctx.kernel(name)
        #: The Run of the last call and its key, reused by the next call with the same arguments and stream.
        self._last: tuple[kernel_mod.Run | None, Any] = (None, None)

    def group_id(self, index: int) -> int:
        """The memory group of global argument ``index`` (its index: SHMEM buffers serve every group).

        Raises:
            PyxrtError: no such argument, or a scalar one.
        """
        args = self._kernel.args
        for arg in args:
            if arg.index == index:
                if arg.kind != "global":
                    raise PyxrtError(f"pyxrt.kernel.group_id({index}): argument {arg.name!r} is a scalar")
                return index
        raise PyxrtError(f"pyxrt.kernel.group_id({index}): {self._kernel.name} has {len(args)} arguments")

    def __call__(self, *args: Any) -> run:
        r = run(self)
        for i, value in enumerate(args):
            r.set_arg(i, value)
        r.start()
        return r


class run:  # noqa: N801
    """``xrt.run(kernel)``: ``set_arg``, ``start``, ``wait([timeout_ms])``, ``state``."""

    def __init__(self, k: kernel) -> None:
        self.kernel = k
        self._args: dict[int, Any] = {}
        self._run: kernel_mod.Run | None = None
        self._key: Any = None
        self._state = ert_cmd_state.ERT_CMD_STATE_NEW
        self._error = ""

    def set_arg(self, index: int, value: Any) -> None:
        self._args[int(index)] = value

    def prepared(self, share: bool = True, fresh: bool = False) -> kernel_mod.Run:
        """The runtime's Run for the current arguments and instruction stream.

        A Run is prepared (a command buffer allocated) only when they changed since this run's (with ``share``,
        or its kernel's last call's) Run was prepared, or when that one is still in flight (docs/pyxrt.md, How a
        run maps onto the runtime): a loop calling ``kernel(...)`` with the same buffers costs EXEC_CMD and the
        wait only. A run list prepares without ``share``, and ``fresh`` for a run whose Run another of its runs
        already holds: each of its runs needs a packet of its own.
        """
        values = [self._args[i] for i in sorted(self._args)]
        npu = _npu(values)
        stream = _instruction_stream(values[1], int(values[2])) if npu else b""
        buffers = values[3:] if npu else values
        key = (stream, tuple(id(v._bo) if isinstance(v, bo) else v for v in buffers))
        candidates = ((self._run, self._key), self.kernel._last) if share else ((self._run, self._key),)
        for cached, cached_key in () if fresh else candidates:
            if cached is not None and cached_key == key and not cached.closed and not cached.in_flight:
                self._run, self._key = cached, key
                return cached
        if npu:
            bind_emulator_model(self.kernel.context.device._dev, stream)
            self._run = self.kernel._kernel.prepare_npu(stream, [v._bo for v in buffers])
        else:
            self._run = self.kernel._kernel.prepare(*[v._bo if isinstance(v, bo) else v for v in values])
        self._key = key
        self.kernel._last = (self._run, key)
        return self._run

    def start(self) -> None:
        try:
            self.prepared().start()
        except (ValueError, OSError) as exc:
            raise PyxrtError(str(exc)) from exc
        self._state = ert_cmd_state.ERT_CMD_STATE_RUNNING

    def wait(self, timeout_ms: int = 0) -> ert_cmd_state:
        """The run's final state; ``ERT_CMD_STATE_TIMEOUT`` when ``timeout_ms`` (0: the runtime's 10 s) passed."""
        if self._run is None:
            raise PyxrtError("pyxrt.run.wait: the run was never started")
        try:
            self._run.wait(timeout_ms / 1000 if timeout_ms else kernel_mod.DEFAULT_TIMEOUT)
            self._state = ert_cmd_state.ERT_CMD_STATE_COMPLETED
        except CommandTimeout:
            return ert_cmd_state.ERT_CMD_STATE_TIMEOUT
        except CommandError as exc:
            self._error = str(exc)
            self._state = ert_cmd_state.__members__.get(f"ERT_CMD_STATE_{exc.state}", ert_cmd_state.ERT_CMD_STATE_ERROR)
        return self._state

    def wait2(self, timeout_ms: int = 0) -> None:
        """As ``wait``, but a run that did not complete raises (XRT's ``wait2``).

        Raises:
            PyxrtError: the final state is not COMPLETED (the message names it and the firmware's reason).
        """
        state = self.wait(timeout_ms)
        if state != ert_cmd_state.ERT_CMD_STATE_COMPLETED:
            reason = f": {self._error}" if self._error else ""
            raise PyxrtError(f"pyxrt.run.wait2: {self.kernel._kernel.name} ended in {state.name}{reason}")

    def state(self) -> ert_cmd_state:
        return self._state


def _instruction_stream(instr: bo, ninstr: int) -> bytes:
    """The TXN stream in ``instr``: as long as its header's ``size_bytes`` (word 3) says, as the firmware reads it.

    ``ninstr`` is not trusted for the length: mlir-aie's helpers pass the word count, IRON's runtime the byte
    count, and both run on the NPU (docs/pyxrt.md, How a run maps onto the runtime).
    """
    capacity = instr.size()
    head = bytes(instr._bo.read(min(16, capacity), 0))
    size_bytes = int.from_bytes(head[12:16], "little") if len(head) == 16 else 0
    if not 16 <= size_bytes <= capacity or size_bytes % 4:
        raise PyxrtError(f"pyxrt.kernel: the instruction bo ({capacity} bytes, ninstr={ninstr}) holds no TXN "
                         f"stream: its header's size_bytes (word 3) is {size_bytes}")
    return bytes(instr._bo.read(size_bytes, 0))


def _npu(values: list[Any]) -> bool:
    return len(values) >= 3 and values[0] == _NPU_OPCODE and isinstance(values[1], bo)


class runlist:  # noqa: N801
    """``xrt.runlist(hw_context)``: ``add(run)``, ``execute()``, ``wait([timeout_ms])`` (one ERT chain)."""

    def __init__(self, ctx: hw_context) -> None:
        self.context = ctx
        self._runs: list[run] = []
        self._list: kernel_mod.RunList | None = None

    def add(self, r: run) -> None:
        self._runs.append(r)
        self._list = None

    def execute(self) -> None:
        if not self._runs:
            return
        if self._list is None:
            prepared: list[kernel_mod.Run] = []
            for r in self._runs:
                one = r.prepared(share=False)
                prepared.append(r.prepared(share=False, fresh=True) if any(one is p for p in prepared) else one)
            self._list = kernel_mod.RunList(self.context._ctx, prepared)
        self._list.start()

    def wait(self, timeout_ms: int = 0) -> None:
        """Raises PyxrtError naming the failing run when one did not complete."""
        if self._list is None:
            return
        try:
            self._list.wait(timeout_ms / 1000 if timeout_ms else kernel_mod.DEFAULT_TIMEOUT)
        except CommandError as exc:
            raise PyxrtError(str(exc)) from exc
        for r in self._runs:
            r._state = ert_cmd_state.ERT_CMD_STATE_COMPLETED

    def reset(self) -> None:
        self._runs, self._list = [], None


def elf(path: str | os.PathLike[str]) -> None:
    """``xrt.elf`` (the full-ELF flow of NPU4+ with ``xrt.ext.kernel``) is not supported here.

    Raises:
        NotImplementedError: always (docs/pyxrt.md, What differs from XRT).
    """
    raise _unsupported("elf")


class ext:  # noqa: N801
    """``xrt.ext``: the ELF-flow kernel and buffer classes, not supported here (docs/pyxrt.md)."""

    @staticmethod
    def kernel(*args: Any, **kwargs: Any) -> None:
        raise _unsupported("ext.kernel")

    @staticmethod
    def bo(*args: Any, **kwargs: Any) -> None:
        raise _unsupported("ext.bo")
