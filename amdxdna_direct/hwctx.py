"""Hardware contexts: CREATE_HWCTX, one PDI DEV BO per CU, one CONFIG_CU, the context syncobj.

Sequence and values as XRT (spec xrt-npu-sequence.md 0 steps 4-5 and 1.3): num_tiles = partition
column_width x core rows (QUERY_AIE_METADATA), max_opc = the partition's operations_per_cycle, a
zeroed 32-byte QoS buffer, PDIs chosen by dpu_kernel_id, CU index = position in the CONFIG_CU array.
Teardown: SYNCOBJ_DESTROY before DESTROY_HWCTX (spec 1.10), then the PDI buffers.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import abi
from . import insts as insts_mod
from .device import DeviceFile, release_quietly, release_steps
from .errors import ContextUnavailableError, DeviceLostError, ioctl_error

if TYPE_CHECKING:
    from .bo import Bo
    from .device import Device
    from .kernel import Kernel, Run, RunList

__all__ = ["HwContext", "ComputeUnit", "PRIORITIES", "QOS_BUFFER_SIZE", "as_xclbin", "create_hwctx",
           "release_context"]

# Out-of-tree drivers copy a 32-byte qos_info (adds user_start_col, reserved), upstream 24 bytes:
# a 32-byte buffer works with both (spec amdxdna-uapi.md 12). user_start_col 0xFF = "not requested".
QOS_BUFFER_SIZE = 32
_QOS_PRIORITY_OFFSET = 20
_QOS_USER_START_COL_OFFSET = 24
_USER_START_COL_NONE = 0xFF
MAX_NUM_CUS = 32  # driver limit for CONFIG_CU (spec 1.3)


# qos.priority values (spec amdxdna-uapi.md 3; the driver maps any other value, 0 included, to HIGH).
_PRIORITY_VALUES = {"realtime": abi.AMDXDNA_QOS_REALTIME_PRIORITY, "high": abi.AMDXDNA_QOS_HIGH_PRIORITY,
                    "normal": abi.AMDXDNA_QOS_NORMAL_PRIORITY, "low": abi.AMDXDNA_QOS_LOW_PRIORITY}
PRIORITIES = tuple(_PRIORITY_VALUES)


@dataclass(frozen=True)
class ComputeUnit:
    """One configured CU: its xclbin kernel, the index used in cu_mask, and its PDI buffer."""

    index: int
    kernel: Any
    pdi: Bo
    cu_func: int


def as_xclbin(xclbin: Any) -> Any:
    """An ``Xclbin`` from an Xclbin, bytes or a path.

    Raises:
        XclbinError: the file is not a valid xclbin.
        OSError: the file cannot be read.
    """
    from .xclbin import Xclbin

    if isinstance(xclbin, Xclbin):
        return xclbin
    return Xclbin.load(xclbin)


def create_hwctx(device: Device, num_tiles: int, max_opc: int, priority: int = 0) -> tuple[int, int]:
    """CREATE_HWCTX with the 32-byte QoS buffer (priority at its offset, user_start_col "not requested");
    returns (context handle, timeline syncobj handle). The driver copies the QoS during the call.

    Raises:
        ContextUnavailableError: the device has no room (ENODEV / EINVAL / EBUSY).
        DeviceLostError: the device is gone (an ENODEV that a VERSION ioctl confirms).
        XdnaError: another failure (the heap is grown and the call retried on EAGAIN).
    """
    ffi = abi.ffi
    qos_buf = ffi.new("uint8_t[]", QOS_BUFFER_SIZE)
    qos = np.frombuffer(ffi.buffer(qos_buf), np.uint32)
    qos[_QOS_PRIORITY_OFFSET // 4] = priority
    qos[_QOS_USER_START_COL_OFFSET // 4] = _USER_START_COL_NONE
    req = abi.new("struct amdxdna_drm_create_hwctx", qos_p=abi.address_of(qos_buf), max_opc=max_opc,
                  num_tiles=num_tiles)
    fields = {"num_tiles": num_tiles, "max_opc": max_opc}
    if priority:
        fields["priority"] = priority
    # A context takes 4 x 32 KiB of heap for its command lists (spec 4.1): short heap, grow it.
    try:
        device.growing_heap(lambda: device.file.ioctl(abi.DRM_IOCTL_AMDXDNA_CREATE_HWCTX, req, fields))
    except ContextUnavailableError as exc:
        if exc.errno == errno.ENODEV:
            _check_not_lost(device, exc)
        raise
    return req.handle, req.syncobj_handle


def _check_not_lost(device: Device, refusal: ContextUnavailableError) -> None:
    """CREATE_HWCTX answers ENODEV both for "no free columns" and for a removed device (spec
    amdxdna-uapi.md 4.0, 4.1 step 8): a VERSION ioctl, which needs nothing but a live device, tells them
    apart, so that a lost device is reported (and latched) as one and not as a full device to retry."""
    req = abi.ffi.new("struct drm_version *")
    try:
        device.file.ioctl(abi.DRM_IOCTL_VERSION, req)
    except DeviceLostError as lost:
        raise lost from refusal


def _select_kernels(xclbin: Any, kernel: str | None) -> list[tuple[Any, bytes]]:
    """(kernel, PDI image) per CU: the named kernel, or every ``dpu`` kernel with a PDI, in xclbin order.

    XRT skips a CU whose dpu_kernel_id matches no PDI and fails only when none is left (spec 1.3).
    """
    from .xclbin import XclbinError

    if xclbin.partition is None:
        raise ValueError("hw_context: the xclbin has no AIE_PARTITION section (nothing to load on an NPU)")
    if kernel is not None:
        return [(xclbin.kernel(kernel), xclbin.pdi_for(kernel).image)]
    chosen = []
    for k in xclbin.kernels:
        if k.type != "dpu":
            continue
        try:
            chosen.append((k, xclbin.pdi_for(k.name).image))
        except XclbinError:
            continue
    if not chosen:
        names = ", ".join(k.name for k in xclbin.kernels) or "none"
        raise ValueError(f"hw_context: no valid DPU kernel found (kernels: {names}; none has a dpu_kernel_id "
                         f"matching a PDI in AIE_PARTITION)")
    if len(chosen) > MAX_NUM_CUS:
        raise ValueError(f"hw_context: {len(chosen)} CUs, the driver accepts at most {MAX_NUM_CUS}")
    return chosen


def _priority_value(priority: int | str | None) -> int:
    if priority is None:
        return 0
    if isinstance(priority, str):
        if priority.lower() not in _PRIORITY_VALUES:
            raise ValueError(f"priority must be one of {PRIORITIES} or an int, got {priority!r}")
        return _PRIORITY_VALUES[priority.lower()]
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 0xFFFFFFFF:
        raise ValueError(f"priority must be one of {PRIORITIES} or a u32, got {priority!r}")
    return priority


class HwContext:
    """A hardware context on a device, configured with the PDIs of an xclbin.

    Create with ``device.hw_context(xclbin, kernel=None, priority=None)``. ``handle`` and
    ``syncobj`` are the driver's; ``cus`` the configured compute units; ``num_tiles`` and
    ``max_opc`` what CREATE_HWCTX was given.
    """

    def __init__(self, device: Device, xclbin: Any, kernel: str | None = None,
                 priority: int | str | None = None) -> None:
        """CREATE_HWCTX, PDI buffers, CONFIG_CU.

        Raises:
            ValueError: the xclbin has no usable kernel, or a bad priority.
            XclbinError: the named kernel or its PDI is not in the xclbin.
            ContextUnavailableError: CREATE_HWCTX answered ENODEV / EINVAL / EBUSY (device full).
            XdnaError: another step failed; everything created so far is released.
        """
        self.device = device
        self.xclbin = as_xclbin(xclbin)
        chosen = _select_kernels(self.xclbin, kernel)
        self.priority = _priority_value(priority)
        device.ensure_heap()  # XRT creates the heap first; the driver needs it mapped before CREATE_HWCTX (1.2)
        metadata = device.aie_metadata()
        self.column_width = int(self.xclbin.partition.column_width)
        self.num_tiles = self.column_width * metadata.core.row_count
        self.max_opc = int(self.xclbin.partition.ops_per_cycle)
        self._lock = threading.Lock()
        self._insts: dict[str, tuple[Bo, int]] = {}
        self._kernels: dict[str, Kernel] = {}
        self._runs: weakref.WeakSet[Run | RunList] = weakref.WeakSet()
        self._closed = False
        self._release = None
        self.cus: list[ComputeUnit] = []
        self.handle, self.syncobj = create_hwctx(device, self.num_tiles, self.max_opc, self.priority)
        try:
            self._configure(chosen)
        except BaseException:
            release_context(device.file, self.handle, self.syncobj, [cu.pdi for cu in self.cus])
            raise
        # Registered after the PDI buffers so that device close (newest first) destroys the context
        # before its PDIs.
        self._release = device.file.register(release_context, device.file, self.handle, self.syncobj,
                                             [cu.pdi for cu in self.cus])
        self._finalizer = weakref.finalize(self, release_quietly, self._release, "hardware context")

    # -- bring-up ------------------------------------------------------------------------------

    def _configure(self, chosen: Sequence[tuple[Any, bytes]]) -> None:
        for index, (kernel, pdi) in enumerate(chosen):
            bo = self.device.bo(len(pdi), "dev")
            self.cus.append(ComputeUnit(index, kernel, bo, kernel.functional or 0))
            bo.write(pdi)
            bo.sync()
        ffi = abi.ffi
        n = len(self.cus)
        raw = ffi.new("uint8_t[]", ffi.sizeof("struct amdxdna_hwctx_param_config_cu")
                      + n * ffi.sizeof("struct amdxdna_cu_config"))
        cfg = ffi.cast("struct amdxdna_hwctx_param_config_cu *", raw)
        cfg.num_cus = n
        for i, cu in enumerate(self.cus):
            cfg.cu_configs[i].cu_bo = cu.pdi.handle
            cfg.cu_configs[i].cu_func = cu.cu_func
        req = ffi.new("struct amdxdna_drm_config_hwctx *")
        req.handle = self.handle
        req.param_type = abi.DRM_AMDXDNA_HWCTX_CONFIG_CU
        req.param_val = abi.address_of(raw)
        req.param_val_size = len(raw)
        self.device.file.ioctl(abi.DRM_IOCTL_AMDXDNA_CONFIG_HWCTX, req,
                               {"handle": self.handle, "param_type": "CONFIG_CU", "num_cus": n})

    # -- use -----------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (f"<HwContext handle={self.handle} syncobj={self.syncobj} num_tiles={self.num_tiles} "
                f"cus={[cu.kernel.name for cu in self.cus]}{' closed' if self.closed else ''}>")

    @property
    def closed(self) -> bool:
        """True once closed (or its device closed, or closing)."""
        return self._closed or self.device.file.closed or (self._release is not None and not self._release.alive)

    def check_open(self, what: str) -> None:
        """Raise if the context is closed.

        Raises:
            XdnaError: EBADF naming ``what`` and the context handle.
        """
        if self.closed:
            raise ioctl_error(what, {"hwctx": self.handle}, errno.EBADF, "context is closed")

    def cu(self, name: str | None = None) -> ComputeUnit:
        """The CU of kernel ``name`` (default: the first).

        Raises:
            ValueError: no such kernel in this context.
        """
        for cu in self.cus:
            if name is None or cu.kernel.name == name:
                return cu
        raise ValueError(f"kernel {name!r} is not configured in this context "
                         f"(have: {', '.join(cu.kernel.name for cu in self.cus)})")

    def kernel(self, name: str | None = None) -> Kernel:
        """The ``Kernel`` of CU ``name`` (default: the first CU).

        Raises:
            ValueError: no such kernel in this context.
            XdnaError: the context is closed.
        """
        from .kernel import Kernel

        self.check_open("kernel")
        cu = self.cu(name)
        with self._lock:
            if cu.kernel.name not in self._kernels:
                self._kernels[cu.kernel.name] = Kernel(self, cu)
            return self._kernels[cu.kernel.name]

    def instructions(self, stream: Any) -> tuple[Bo, int]:
        """Upload an instruction stream once per context; returns (DEV buffer, word count).

        ``stream``: ``insts.Stream``, bytes (binary or text), a path, or a sequence of u32 words.
        Streams are cached by sha256 of their encoded bytes.

        Raises:
            InstsError: the stream is malformed.
            XdnaError: allocation or sync failed, or the context is closed.
        """
        self.check_open("instructions")
        data = encode_instructions(stream)
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            cached = self._insts.get(digest)
            if cached is not None and not cached[0].closed:
                return cached
            bo = self.device.bo(len(data), "dev")
            try:
                bo.write(data)
                bo.sync()
            except BaseException:
                bo.close()
                raise
            self._insts[digest] = (bo, len(data) // 4)
            return self._insts[digest]

    def track(self, unit: Run | RunList) -> None:
        """Remember a run or run list so that ``close`` releases its packet buffers first."""
        self._runs.add(unit)

    # -- teardown ------------------------------------------------------------------------------

    def __enter__(self) -> HwContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release runs and instruction buffers, then SYNCOBJ_DESTROY, DESTROY_HWCTX, PDI buffers.

        Idempotent. Raises:
            XdnaError: a release ioctl failed (the rest still ran).
        """
        if self._closed:
            return
        self._closed = True
        steps = [run.close for run in list(self._runs)]
        steps += [bo.close for bo, _ in self._insts.values()]
        self._finalizer.detach()
        release_steps(*steps, self._release)


def encode_instructions(stream: Any) -> bytes:
    """Canonical bytes of an instruction stream given as Stream, bytes, path or u32 words.

    Raises:
        InstsError: malformed stream.
        TypeError: unsupported input type.
    """
    if isinstance(stream, insts_mod.Stream):
        return insts_mod.encode(stream)
    if isinstance(stream, (bytes, bytearray, memoryview, str, os.PathLike)):
        return insts_mod.encode(insts_mod.load(stream))
    if isinstance(stream, (np.ndarray, Sequence)):
        words = np.asarray(stream)
        if words.ndim != 1 or not (words.size == 0 or np.issubdtype(words.dtype, np.integer)) \
                or (words.size and (int(words.min()) < 0 or int(words.max()) > 0xFFFFFFFF)):
            raise insts_mod.InstsError(f"instruction words must be a flat sequence of u32 values (0..0xFFFFFFFF), "
                                       f"got {words.dtype} of shape {words.shape}")
        return insts_mod.encode(insts_mod.decode(words.astype(np.uint32).tobytes()))
    raise TypeError(f"instruction stream must be an insts.Stream, bytes, a path or u32 words, "
                    f"got {type(stream).__name__}")


def _destroy_syncobj(file: DeviceFile, syncobj: int) -> None:
    if syncobj:
        req = abi.ffi.new("struct drm_syncobj_destroy *")
        req.handle = syncobj
        file.ioctl(abi.DRM_IOCTL_SYNCOBJ_DESTROY, req, {"handle": syncobj})


def _destroy_hwctx(file: DeviceFile, handle: int) -> None:
    req = abi.ffi.new("struct amdxdna_drm_destroy_hwctx *")
    req.handle = handle
    file.ioctl(abi.DRM_IOCTL_AMDXDNA_DESTROY_HWCTX, req, {"handle": handle})


def release_context(file: DeviceFile, handle: int, syncobj: int, pdis: Sequence[Bo] = ()) -> None:
    """SYNCOBJ_DESTROY, DESTROY_HWCTX, then close the PDI buffers; every step runs.

    Raises:
        XdnaError: the first step that failed (the rest still ran).
    """
    # XRT order (spec 1.10): the syncobj belongs to userspace and goes first; DESTROY_HWCTX waits
    # for the context to idle; the PDIs the firmware context used are freed last.
    release_steps(lambda: _destroy_syncobj(file, syncobj), lambda: _destroy_hwctx(file, handle),
                  *(pdi.close for pdi in pdis))
