"""The part of XRT's ``pyxrt`` module that NPU host code uses, on this runtime (docs/pyxrt.md).

Names, signatures and defaults follow pyxrt; what is not supported raises a one-line ``NotImplementedError``
naming the call. ``import amdxdna_direct.pyxrt as xrt``, or run a script unchanged with
``python -m amdxdna_direct.pyxrt SCRIPT [ARGS...]``.
"""

from __future__ import annotations

import enum
import glob
import os
import warnings
from typing import Any

import numpy as np

from .. import kernel as kernel_mod
from .. import xclbin as xclbin_mod
from ..bo import FROM_DEVICE, TO_DEVICE
from ..device import Device, open_device
from ..errors import CommandError, CommandTimeout

__all__ = ["xclBOSyncDirection", "ert_cmd_state", "xrt_info_device", "uuid", "xclbin", "device", "hw_context",
           "kernel", "bo", "run", "runlist", "enumerate_devices", "PyxrtError"]

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
    bdf = "bdf"
    name = "name"
    kdma = "kdma"
    max_clock_frequency_mhz = "max_clock_frequency_mhz"


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
        XclbinError (a ValueError): the file is not a usable xclbin.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._x = xclbin_mod.parse(path)

    def get_kernels(self) -> list[_xclbin_kernel]:
        return [_xclbin_kernel(k) for k in self._x.kernels]

    def get_uuid(self) -> uuid:
        return uuid(self._x.uuid)

    def get_xsa_name(self) -> str:
        return str(getattr(self._x, "xsa_name", "") or "")


def _amdxdna_nodes() -> list[str]:
    return sorted(glob.glob("/dev/accel/accel*"), key=lambda p: int(p.rsplit("accel", 1)[1] or 0))


def enumerate_devices() -> int:
    """How many devices ``device(index)`` can open: 1 when ``$AMDXDNA_DEVICE`` names one, else the accel nodes."""
    return 1 if os.environ.get("AMDXDNA_DEVICE") else len(_amdxdna_nodes())


class device:  # noqa: N801
    """``xrt.device(index)`` / ``xrt.device(path)``: index 0 is ``$AMDXDNA_DEVICE`` or the first amdxdna node.

    Raises:
        NoDeviceError, PermissionDeniedError (OSError): from ``open_device``.
        NotImplementedError: a PCI BDF string (open the node's path instead).
    """

    def __init__(self, index: int | str = 0) -> None:
        if isinstance(index, str):
            if ":" in index and not index.startswith(("emu", "/")):
                raise _unsupported("device(bdf)")
            spec: str | None = index
        elif index == 0:
            spec = None
        else:
            nodes = _amdxdna_nodes()
            if not 0 <= index < len(nodes):
                raise PyxrtError(f"pyxrt.device({index}): no such device ({len(nodes)} accel nodes)")
            spec = nodes[index]
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

    def get_info(self, key: Any) -> str:
        name = getattr(key, "name", key)
        if name == "name":
            return "emu" if self._dev.emulator is not None else str(self._dev.generation)
        raise _unsupported(f"device.get_info({name})")

    def close(self) -> None:
        self._dev.close()


class hw_context:  # noqa: N801
    """``xrt.hw_context(device, uuid | xclbin | path[, mode])``.

    Raises:
        PyxrtError: a uuid that was never registered on this device.
        ContextUnavailableError, XdnaError: from the runtime's ``HwContext``.
    """

    def __init__(self, dev: device, xb: uuid | xclbin | str | os.PathLike[str], mode: Any = None) -> None:
        if isinstance(xb, uuid):
            if xb not in dev._xclbins:
                raise PyxrtError(f"pyxrt.hw_context: xclbin {xb.to_string()} is not registered on this device")
            parsed = dev._xclbins[xb]
        elif isinstance(xb, xclbin):
            parsed = xb._x
        else:
            parsed = xclbin_mod.parse(xb)
        self.device = dev
        self._ctx = dev._dev.hw_context(parsed)


class bo:  # noqa: N801
    """``xrt.bo(device, size, flags, group)``: a buffer object (SHMEM; the group id is checked, not used)."""

    normal = 0
    cacheable = 1 << 24
    device_only = 1 << 28
    host_only = 1 << 29

    class flags(enum.IntEnum):  # noqa: N801
        normal = 0
        cacheable = 1 << 24
        device_only = 1 << 28
        host_only = 1 << 29

    def __init__(self, dev: device, size: int, flags: int = 0, group: int = 0) -> None:
        if int(flags) not in (0, bo.cacheable, bo.device_only, bo.host_only):
            raise _unsupported(f"bo(flags={int(flags):#x})")
        self.device = dev
        self.flags_value = int(flags)
        self._bo = dev._dev.bo(size)

    def write(self, data: Any, offset: int = 0) -> None:
        self._bo.write(np.ascontiguousarray(data).view(np.uint8).reshape(-1), offset)

    def read(self, size: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self._bo.read(size, offset), dtype=np.int8).copy()

    def map(self) -> memoryview:
        return self._bo.view()

    def sync(self, direction: xclBOSyncDirection | int, size: int | None = None, offset: int = 0) -> None:
        to_dev = int(direction) in (0, 2)
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
        self._key: tuple[Any, ...] | None = None
        self._state = ert_cmd_state.ERT_CMD_STATE_NEW

    def set_arg(self, index: int, value: Any) -> None:
        self._args[int(index)] = value

    def prepared(self) -> kernel_mod.Run:
        """The runtime's Run for the current arguments (prepared again only when they changed)."""
        values = [self._args[i] for i in sorted(self._args)]
        key = tuple(id(v) if isinstance(v, bo) else v for v in values)
        if self._run is not None and key == self._key and not _npu(values):
            return self._run
        if _npu(values):
            stream = bytes(values[1]._bo.read(int(values[2]) * 4, 0))
            bind_emulator_model(self.kernel.context.device._dev, stream)
            self._run = self.kernel._kernel.prepare_npu(stream, [v._bo for v in values[3:]])
        else:
            self._run = self.kernel._kernel.prepare(*[v._bo if isinstance(v, bo) else v for v in values])
        self._key = key
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
            self._state = ert_cmd_state.__members__.get(f"ERT_CMD_STATE_{exc.state}", ert_cmd_state.ERT_CMD_STATE_ERROR)
        return self._state

    def state(self) -> ert_cmd_state:
        return self._state


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
            self._list = kernel_mod.RunList(self.context._ctx, [r.prepared() for r in self._runs])
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
