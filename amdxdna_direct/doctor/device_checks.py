"""The checks through the runtime, the same on a real NPU and on the emulator (docs/doctor.md 5)."""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import abi
from .. import insts as insts_mod
from ..device import Device
from ..errors import ContextUnavailableError, DeviceLostError, XdnaError, errno_text
from ..hwctx import create_hwctx, release_context
from ..xclbin import Xclbin, build_mlir_aie
from .pci import reset_ladder
from .results import FAIL, FIX_UPDATE_DRIVER, PASS, SKIP, WARN, CheckResult

if TYPE_CHECKING:
    from ..emu import EmuDevice, Model

# --- device checks (through the runtime, the same on a real NPU and on the emulator) -------------------------

# Firmware context limits per generation (docs/doctor.md 5), used when QUERY_RESOURCE_INFO is missing.
CONTEXT_LIMITS = {"npu1": 6, "npu4": 16, "npu5": 16, "npu6": 16}


def check_feature_level(dev: Device) -> CheckResult:
    """The ioctls this runtime relies on answer as expected: VERSION, GET_INFO, timeline syncobjs; GET_ARRAY.

    The DRM minor is the uAPI feature level; 0.0 (Linux 6.14-6.17) lacks GET_ARRAY, which only the context
    table needs; a pre-December-2024 out-of-tree driver numbers GET_INFO differently (docs/doctor.md 5).
    """
    version = dev.version
    level = f"{version.name} {version.major}.{version.minor}"
    try:
        dev.aie_metadata()
    except DeviceLostError:
        raise
    except XdnaError as exc:
        return CheckResult("feature-level", FAIL, f"{level}: GET_INFO(QUERY_AIE_METADATA) failed: {exc}",
                           "the driver predates the December 2024 ioctl numbering or its firmware is not "
                           "running: " + FIX_UPDATE_DRIVER)
    if not _get_cap(dev, "DRM_CAP_SYNCOBJ_TIMELINE"):
        return CheckResult("feature-level", FAIL, f"{level}: DRM_CAP_SYNCOBJ_TIMELINE is 0 (commands are "
                           "awaited on the context's timeline syncobj)", FIX_UPDATE_DRIVER)
    array_error = _get_array_error(dev)
    if array_error is not None:
        return CheckResult("feature-level", WARN, f"{level}: GET_ARRAY unavailable ({array_error}); kernels, "
                           "buffers and contexts work, per-context details and async error reports do not",
                           FIX_UPDATE_DRIVER)
    return CheckResult("feature-level", PASS, f"{level}: VERSION, GET_INFO, GET_ARRAY and timeline syncobjs answer")


def _get_cap(dev: Device, name: str) -> int:
    req = abi.new("struct drm_get_cap", capability=getattr(abi, name))
    dev.file.ioctl(abi.DRM_IOCTL_GET_CAP, req, {"capability": name})
    return int(req.value)


def _get_array_error(dev: Device) -> str | None:
    """None when GET_ARRAY(HW_CONTEXT_ALL) answers, else the errno name it failed with."""
    ffi = abi.ffi
    entries = ffi.new("struct amdxdna_drm_hwctx_entry[]", 16)
    req = abi.new("struct amdxdna_drm_get_array", param=abi.DRM_AMDXDNA_HW_CONTEXT_ALL,
                  element_size=ffi.sizeof("struct amdxdna_drm_hwctx_entry"), num_element=16,
                  buffer=abi.address_of(entries))
    try:
        dev.file.ioctl(abi.DRM_IOCTL_AMDXDNA_GET_ARRAY, req, {"param": "HW_CONTEXT_ALL"})
    except XdnaError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY):
            return errno.errorcode[exc.errno]
        raise
    return None


def check_firmware(dev: Device, sysfs_version: str | None = None, slot: str | None = None) -> CheckResult:
    """GET_INFO QUERY_FIRMWARE_VERSION answers (and agrees with sysfs ``fw_version`` when that is known)."""
    try:
        version = str(dev.firmware_version())
    except DeviceLostError as exc:
        return CheckResult("firmware", FAIL, f"firmware version unreadable: {exc}: the device is lost",
                           reset_ladder(slot))
    except XdnaError as exc:
        return CheckResult("firmware", FAIL, f"firmware version unreadable: {exc}",
                           "the NPU firmware is not running: check `sudo dmesg | grep amdxdna` and install a "
                           "current linux-firmware (amdnpu/<devid>_<rev>/npu.sbin)")
    if sysfs_version is not None and sysfs_version != version:
        return CheckResult("firmware", WARN, f"firmware {version}, but sysfs fw_version says {sysfs_version}",
                           "reload the driver (`sudo modprobe -r amdxdna && sudo modprobe amdxdna`)")
    return CheckResult("firmware", PASS, f"firmware {version}")


def check_contexts(dev: Device, slot: str | None = None) -> CheckResult:
    """Contexts still available: the live count against the firmware limit, then a real CREATE_HWCTX probe.

    The probe asks for one column (num_tiles = core rows), then destroys its syncobj and the context
    (docs/doctor.md 5). It needs this fd's device heap, which it creates if missing. A refusal while no
    context is live means the firmware is wedged: the fix is the reset ladder (``slot`` names the PCI function).
    """
    live, limit, note = _context_load(dev)
    limit_text = "?" if limit is None else limit
    try:
        _probe_context(dev)
    except ContextUnavailableError as exc:
        pids = sorted({c.pid for c in live})
        holders = f"; held by pid(s) {', '.join(map(str, pids))}" if pids else ""
        detail = f"no context available: {exc}; {len(live)} live{holders}{note}"
        if not live and not note:
            return CheckResult("contexts", FAIL, f"{detail}: the firmware refuses contexts although none is live "
                               f"(it allows {limit_text}), so it is wedged", reset_ladder(slot))
        return CheckResult("contexts", FAIL, detail,
                           "close the programs holding NPU contexts (`amdxdna info` lists them) or wait for them "
                           f"to finish; the firmware allows {limit_text} context(s)")
    except DeviceLostError as exc:
        return CheckResult("contexts", FAIL, f"context probe failed: {exc}: the device is lost", reset_ladder(slot))
    except XdnaError as exc:
        return CheckResult("contexts", FAIL, f"context probe failed: {exc}",
                           "see the feature-level and kernel-log checks")
    return CheckResult("contexts", PASS, f"{len(live)} context(s) live of {limit_text}; a 1-column context was "
                       f"created and destroyed{note}")


def _context_load(dev: Device) -> tuple[list[Any], int | None, str]:
    try:
        live = dev.hw_contexts()
    except XdnaError as exc:
        return [], None, f" (context list unavailable: {exc})"
    try:
        return live, dev.resource_info().npu_task_max, ""
    except XdnaError:
        return live, CONTEXT_LIMITS.get(dev.generation or ""), ""


def _probe_context(dev: Device) -> None:
    """CREATE_HWCTX of one column with the runtime's QoS and max_opc 0 (docs/doctor.md 5), then its release.

    Raises:
        ContextUnavailableError: the firmware or the columns have no room (ENODEV / EINVAL / EBUSY).
        XdnaError: another failure of the heap, the query or an ioctl.
    """
    dev.ensure_heap()  # CREATE_HWCTX needs a mapped heap on this fd (docs/doctor.md 5)
    handle, syncobj = create_hwctx(dev, dev.aie_metadata().core.row_count, 0)
    release_context(dev.file, handle, syncobj)


SELF_TEST_BYTES = 4096
# A passthrough takes microseconds; reporting a hang after 10 s beats the driver's 60 s TDR (docs/doctor.md 5).
SELF_TEST_TIMEOUT = 10.0


def check_self_test(dev: Device, xclbin: str | os.PathLike[str] | bytes | None = None,
                    insts: str | os.PathLike[str] | bytes | None = None) -> CheckResult:
    """Run a passthrough kernel and compare the output with the input.

    With ``xclbin`` and ``insts`` (a passthrough design: the stream's lowest patched buffer is copied into its
    highest) that design runs, on any device. Without them only the emulator has a self-test: a one-column
    mlir-aie xclbin and a DMA stream built here, with the emulator's Passthrough model bound to the stream.
    """
    if (xclbin is None) != (insts is None):
        return CheckResult("self-test", SKIP, "give both --xclbin and --insts for a self-test design")
    if xclbin is None and dev.emulator is None:
        return CheckResult("self-test", SKIP, "no self-test design is bundled for a real NPU",
                           "pass a passthrough design (e.g. mlir-aie passthrough_dmas) with --xclbin and --insts")
    try:
        design, stream = _load_design(xclbin, insts) if xclbin is not None else _emulator_design(dev)
        extents = _passthrough_extents(stream)
    except ValueError as exc:
        return CheckResult("self-test", FAIL, f"self-test design unusable: {exc}",
                           "give a passthrough design: `amdxdna xclbin X` and `amdxdna insts I` show what is wrong")
    try:
        return _run_passthrough(dev, design, stream, extents)
    except (XdnaError, ValueError) as exc:
        return CheckResult("self-test", FAIL, f"passthrough kernel failed: {exc}",
                           "see the contexts and kernel-log checks; on a real NPU check that the design matches "
                           "the NPU generation")


def _load_design(xclbin: Any, insts: Any) -> tuple[Xclbin, insts_mod.Stream]:
    """Raises: ValueError: a file cannot be read or is malformed (the message names it)."""
    return _load("xclbin", Xclbin.load, xclbin), _load("instruction stream", insts_mod.load, insts)


def _load(what: str, loader: Any, source: Any) -> Any:
    name = source if isinstance(source, (str, os.PathLike)) else f"<{len(source)} bytes>"
    try:
        return loader(source)
    except OSError as exc:
        raise ValueError(f"{what} {name}: {errno_text(exc.errno) if exc.errno is not None else exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{what} {name}: {exc}") from exc


def _emulator_design(dev: Device) -> tuple[Xclbin, insts_mod.Stream]:
    if dev.emulator is None:        # check_self_test asks for it on the emulator only
        raise ValueError(f"{dev.name}: only the emulator has a bundled self-test design")
    dev_gen = dev.emulator.profile.txn_dev_gen
    stream = insts_mod.dma_stream(dev_gen, [(0, SELF_TEST_BYTES, "in"), (1, SELF_TEST_BYTES, "out")])
    # The emulator does not interpret the PDI; a recognisable filler keeps the design self-describing.
    return build_mlir_aie(b"amdxdna doctor self-test PDI\0\0\0\0", column_width=1, n_buffers=2), stream


def stream_extents(stream: insts_mod.Stream) -> dict[int, int]:
    """Deprecated: :func:`amdxdna_direct.insts.buffer_reach` (the one buffer-reach computation, docs/runtime.md
    1.4), with the self-test's check that at least two buffers are patched.

    Raises:
        ValueError: fewer than two buffers are patched (no passthrough).
    """
    warnings.warn("amdxdna_direct.doctor.stream_extents is deprecated: use amdxdna_direct.insts.buffer_reach",
                  DeprecationWarning, stacklevel=2)
    return _passthrough_extents(stream)


def _passthrough_extents(stream: insts_mod.Stream) -> dict[int, int]:
    """Bytes each patched buffer must hold (docs/doctor.md 5). Raises: ValueError: fewer than two are patched."""
    extents = insts_mod.buffer_reach(stream)
    if len(extents) < 2:
        raise ValueError(f"self-test stream patches buffer slots {sorted(extents)}; a passthrough needs two")
    return extents


def bind_model(emulator: EmuDevice | None, stream: insts_mod.Stream, model: Model) -> str:
    """Bind ``model`` to the instruction stream on ``emulator``, replacing a model bound to it before.

    Returns the stream digest. Raises:
        ValueError, TypeError: from the emulator's registry (malformed stream or model).
        TypeError: ``emulator`` is None (a real device: models exist on the emulator only).
    """
    if emulator is None:
        raise TypeError("bind_model: models bind on the emulator only; this device has no emulator (a real NPU)")
    data = insts_mod.encode(stream)
    if data in emulator.models:
        emulator.models.unbind(data)
    return emulator.models.bind(data, model)


def _run_passthrough(dev: Device, xclbin: Xclbin, stream: insts_mod.Stream, extents: dict[int, int]) -> CheckResult:
    """Copy a pattern through the design (the lowest patched slot in, the highest out) and compare.

    Raises:
        XdnaError: the context, a buffer or the run failed.
        ValueError: the runtime refused the xclbin (no AIE partition, no runnable kernel).
    """
    from ..emu.models import Passthrough

    src, dst = min(extents), max(extents)
    if dev.emulator is not None:
        bind_model(dev.emulator, stream, Passthrough())
    # Neither zeros nor a byte ramp: an untouched or index-filled output buffer cannot pass.
    pattern = (np.arange(extents[src], dtype=np.uint32) * 2654435761 & 0xFF).astype(np.uint8)
    count = min(extents[src], extents[dst])
    with contextlib.ExitStack() as owned, dev.hw_context(xclbin) as ctx:
        bos = {slot: owned.enter_context(dev.bo(max(size, SELF_TEST_BYTES))) for slot, size in extents.items()}
        bos[src].write(pattern)
        for bo in bos.values():
            bo.sync()
        run = ctx.kernel().prepare_npu(stream, [bos.get(i) for i in range(dst + 1)])
        run.start()
        run.wait(SELF_TEST_TIMEOUT)
        bos[dst].sync()
        same = bos[dst].read(count) == pattern[:count].tobytes()
    if not same:
        return CheckResult("self-test", FAIL, f"passthrough of {count} bytes completed but the output differs",
                           "the design is not a passthrough of its lowest into its highest buffer, or the NPU "
                           "corrupted data: rerun with AMDXDNA_TRACE=1 and check the kernel log")
    return CheckResult("self-test", PASS, f"passthrough of {count} bytes (bo{src} -> bo{dst}) returned the input")



def is_emulated(device: Any) -> bool:
    """Whether ``device`` (what ``open_device`` takes) names the emulator: ``emu``, ``emu:<profile>``, an EmuDevice."""
    if isinstance(device, str):
        return device == "emu" or device.startswith("emu:")
    return device is not None and hasattr(device, "models") and hasattr(device, "open")
