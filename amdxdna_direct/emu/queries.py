"""Query and state ioctls: VERSION, GET_CAP, GET_INFO, GET_ARRAY and SET_STATE (power mode, preemption)
(docs/uapi.md 4.8-4.10, 5, 10).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
from collections.abc import Callable

from . import layouts as L
from . import usermem
from .memory import AMDXDNA_BO_CMD, AMDXDNA_BO_DEV, AMDXDNA_BO_DEV_HEAP
from .objects import Client, HwCtx, fail
from .state import DeviceState

POWER_MODE_DEFAULT, POWER_MODE_LOW, POWER_MODE_MEDIUM, POWER_MODE_HIGH, POWER_MODE_TURBO = 0, 1, 2, 3, 4
AMDXDNA_HWCTX_STATE_ACTIVE = 1
DRM_CAP_PRIME, DRM_CAP_SYNCOBJ, DRM_CAP_SYNCOBJ_TIMELINE = 0x5, 0x13, 0x14
DRM_PRIME_CAP_IMPORT_EXPORT = 0x3
DRIVER_NAME = "amdxdna_accel_driver"
DRIVER_DESC = "AMD XDNA DRM implementation"
DRIVER_DATE = "0"                   # docs/uapi.md 5: the date string is "0" on >= 6.14
TELEMETRY_DATA_MAX = 4 << 20
TELEMETRY_TYPES = 4                 # emulator choice: telemetry types the firmware knows (docs/uapi.md 10 gives none)
ASYNC_ERROR_SIZE = L.async_error.size


class QueryIoctls(DeviceState):
    """VERSION, GET_CAP, GET_INFO, GET_ARRAY and SET_STATE (rules D4, D6, I1-I6).

    Mixed into ``EmuDevice`` (driver.py), whose ``lock``, ``cond``, ``profile``, ``firmware`` and reference
    counting (``unref_bo``) its methods use (declared by ``DeviceState``); ``driver._driver_table`` names the
    handlers.
    """

    def _ioctl_version(self, client: Client, a: dict[str, int]) -> None:
        # rule D6: major 0, the feature level as minor; strings cut, full length reported (docs/driver-rules.md)
        prof = self.profile
        minor = prof.drm_minor if prof.reported_minor is None else prof.reported_minor
        a.update(version_major=prof.version_major, version_minor=minor, version_patchlevel=0)
        for key, value in (("name", DRIVER_NAME), ("date", DRIVER_DATE), ("desc", DRIVER_DESC)):
            data = value.encode()
            length = min(len(data), a[key + "_len"])        # drm_copy_field: truncate, report full length
            if length and a[key]:
                usermem.write(a[key], data[:length], f"VERSION({key})")
            a[key + "_len"] = len(data)

    def _ioctl_get_cap(self, client: Client, a: dict[str, int]) -> None:
        values = {DRM_CAP_SYNCOBJ: 1, DRM_CAP_SYNCOBJ_TIMELINE: 1, DRM_CAP_PRIME: DRM_PRIME_CAP_IMPORT_EXPORT}
        if a["capability"] not in values:
            raise fail(errno.EINVAL, "GET_CAP", f"capability={a['capability']:#x} not modelled")
        a["value"] = values[a["capability"]]

    # --- GET_INFO (docs/uapi.md 4.8, 10) ---

    def _param_handler(self, table: dict[int, _ParamEntry], param: int, op: str) -> Callable[..., None]:
        """The handler of a GET_INFO / GET_ARRAY / SET_STATE param at this feature level (docs/uapi.md 10, 11).

        Raises:
            OSError: EOPNOTSUPP for a param the driver does not know (or not yet, at this DRM minor).
        """
        entry = table.get(param)
        # rule I1: an unknown param is EOPNOTSUPP (docs/driver-rules.md)
        if entry is None or self.profile.drm_minor < entry[1]:
            raise fail(errno.EOPNOTSUPP, op, f"Not supported request parameter (DRM minor {self.profile.drm_minor})")
        # The handlers' arguments differ by table (GET_ARRAY's take the client first).
        handler: Callable[..., None] = getattr(self, entry[0])
        return functools.partial(handler, *entry[2:])

    def _ioctl_get_info(self, client: Client, a: dict[str, int]) -> None:
        op = f"GET_INFO(param={a['param']})"
        handler = self._param_handler(_GET_INFO, a["param"], op)
        with self.lock:
            handler(a, op)

    def _copy_result(self, a: dict[str, int], data: bytes, op: str) -> None:
        # <= 7.0 copies fixed-size results whole, whatever buffer_size says (docs/uapi.md 4.8, rule I1).
        usermem.write(a["buffer"], data, op + " buffer")

    def _info_aie_status(self, a: dict[str, int], op: str) -> None:
        status = L.query_aie_status.unpack(usermem.read(a["buffer"], L.query_aie_status.size, op))
        prof = self.profile
        # rule I2: the status buffer against the columns (docs/driver-rules.md)
        if status["buffer_size"] > prof.columns * prof.col_size:
            raise fail(errno.EINVAL, op, f"status buffer_size={status['buffer_size']} > cols x col_size")
        cols = sorted({c for ctx in self.contexts for c in range(ctx.start_col, ctx.start_col + ctx.num_col)})
        if len(cols) * prof.col_size > status["buffer_size"]:
            raise fail(errno.EINVAL, op, f"{len(cols)} columns of status do not fit {status['buffer_size']} bytes")
        # The emulated array has no tile registers to dump: each live column's record is zeros.
        usermem.write(status["buffer"], bytes(len(cols) * prof.col_size), op + " status.buffer")
        status["cols_filled"] = sum(1 << c for c in cols)
        usermem.write(a["buffer"], L.query_aie_status.pack(status), op)

    def _info_aie_metadata(self, a: dict[str, int], op: str) -> None:
        # rule I3: answers from the profile (docs/driver-rules.md)
        prof = self.profile
        values = {"col_size": prof.col_size, "cols": prof.columns, "rows": prof.rows,
                  "version_major": prof.aie_arch[0], "version_minor": prof.aie_arch[1]}
        for kind in ("core", "mem", "shim"):
            values.update({f"{kind}_{k}": v for k, v in dataclasses.asdict(getattr(prof, kind)).items()})
        self._copy_result(a, L.query_aie_metadata.pack(values), op)

    def _info_aie_version(self, a: dict[str, int], op: str) -> None:
        major, minor = self.profile.aie_version
        self._copy_result(a, L.query_aie_version.pack({"major": major, "minor": minor}), op)

    def _info_clock_metadata(self, a: dict[str, int], op: str) -> None:
        mp_npu, h_clock = self.current_clocks()
        self._copy_result(a, L.query_clock_metadata.pack({
            "mp_npu_name": b"MP-NPU Clock", "mp_npu_freq_mhz": mp_npu, "h_name": b"H Clock", "h_freq_mhz": h_clock}),
            op)

    def _info_sensors(self, a: dict[str, int], op: str) -> None:
        # rule I3: no sensors on AIE2 (docs/driver-rules.md)
        raise fail(errno.EOPNOTSUPP, op, "no sensors on AIE2 (7.0; PMF unavailable)")

    def _info_hw_contexts(self, a: dict[str, int], op: str) -> None:
        # rule I4: every context of the fds on the device list; `errors` is never set by any driver version
        # (docs/emulator.md, Driver profiles S15)
        entries = b"".join(L.query_hwctx.pack({
            "context_id": ctx.handle, "start_col": ctx.start_col, "num_col": ctx.num_col, "pid": ctx.pid,
            "command_submissions": ctx.stats["submissions"], "command_completions": ctx.stats["completions"],
            "errors": 0}) for ctx in self.listed_contexts)
        if len(entries) > a["buffer_size"]:
            if self.profile.drm_minor < 1:
                raise fail(errno.EINVAL, op, f"{len(entries)} bytes of contexts do not fit {a['buffer_size']}")
            # From 0.1 the walk stops at the first entry that does not fit and answers 0 (S4).
            entries = entries[:a["buffer_size"] - a["buffer_size"] % L.query_hwctx.size]
        usermem.write(a["buffer"], entries, op + " buffer")
        # Since 6.18 the returned size is what is left of the input (docs/uapi.md 10 quirk); before, bytes written.
        a["buffer_size"] = a["buffer_size"] - len(entries) if self.profile.drm_minor >= 1 else len(entries)

    def _info_firmware_version(self, a: dict[str, int], op: str) -> None:
        major, minor, patch, build = self.profile.firmware_version
        self._copy_result(a, L.query_firmware_version.pack(
            {"major": major, "minor": minor, "patch": patch, "build": build}), op)

    def _info_power_mode(self, a: dict[str, int], op: str) -> None:
        self._copy_result(a, L.get_power_mode.pack({"power_mode": self.power_mode}), op)

    def _info_telemetry(self, a: dict[str, int], op: str) -> None:
        header_size = L.query_telemetry_header.size + 4 * self.profile.hwctx_limit
        if a["buffer_size"] <= header_size:
            raise fail(errno.EINVAL, op, f"buffer_size={a['buffer_size']} must exceed the {header_size}-byte header")
        header = L.query_telemetry_header.unpack(usermem.read(a["buffer"], L.query_telemetry_header.size, op))
        if header["type"] >= TELEMETRY_TYPES:
            raise fail(errno.EINVAL, op, f"telemetry type {header['type']} unknown to firmware")
        data_size = min(a["buffer_size"] - header_size, TELEMETRY_DATA_MAX)
        slots = [0] * self.profile.hwctx_limit
        for slot, ctx in enumerate(self.contexts[:len(slots)]):
            slots[slot] = ctx.handle
        header.update(major=1, minor=0, map_num_elements=len(slots))
        # The emulated firmware keeps no telemetry counters: the data part is zeros.
        payload = L.query_telemetry_header.pack(header) + b"".join(s.to_bytes(4, "little") for s in slots)
        usermem.write(a["buffer"], payload + bytes(data_size), op + " buffer")
        a["buffer_size"] = header_size + data_size

    def _info_preempt(self, key: str, a: dict[str, int], op: str) -> None:
        self._copy_result(a, L.attribute_state.pack({"state": self.preempt_state[key], "pad": b""}), op)

    def _info_resource(self, a: dict[str, int], op: str) -> None:
        prof = self.profile
        top = prof.dpm_clocks[-1][1]
        self._copy_result(a, L.get_resource_info.pack({
            "npu_clk_max": top, "npu_tops_max": prof.tops_max, "npu_task_max": self.hwctx_limit(),
            "npu_tops_curr": prof.tops_max * self.current_clocks()[1] // top, "npu_task_curr": len(self.contexts)}), op)

    # --- GET_ARRAY (docs/uapi.md 4.9, 10) ---

    def _ioctl_get_array(self, client: Client, a: dict[str, int]) -> None:
        op = f"GET_ARRAY(param={a['param']})"
        # rule I5: GET_ARRAY's argument checks (docs/driver-rules.md)
        if a["pad"] or a["num_element"] == 0 or a["element_size"] == 0:
            raise fail(errno.EINVAL, op, "pad must be 0, num_element and element_size non-zero")
        handler = self._param_handler(_GET_ARRAY, a["param"], op)
        with self.lock:
            handler(client, a, op)

    def _array_hwctx_all(self, client: Client, a: dict[str, int], op: str) -> None:
        # rule I5: HW_CONTEXT_ALL's bounds; rule 55: the entry size and count (docs/emulator.md)
        if a["element_size"] > 4096 or a["num_element"] > 1024:
            raise fail(errno.EINVAL, op, "element_size must be 1..4096 and num_element <= 1024")
        # The driver packs entries at min(element_size, its own sizeof) and fits as many as the caller's
        # num_element x element_size bytes hold; it hands back that element size and the count written (docs/uapi.md
        # 10).
        layout = L.hwctx_entry_oot if self.profile.hwctx_entry_size == L.hwctx_entry_oot.size else L.hwctx_entry
        size = min(a["element_size"], layout.size)
        capacity = a["num_element"] * a["element_size"] // size
        entries = [self._hwctx_entry(layout, ctx)[:size] for ctx in self.listed_contexts[:capacity]]
        usermem.write(a["buffer"], b"".join(entries), op + " buffer")
        a["element_size"], a["num_element"] = size, len(entries)

    def _hwctx_entry(self, layout: L.Layout, ctx: HwCtx) -> bytes:
        """One amdxdna_drm_hwctx_entry: the context, QoS as given (raw priority), counters; out of tree also the
        firmware context id, its fd's heap use and the firmware's last health record of it (docs/emulator.md,
        HW_CONTEXT_ALL; mainline leaves those 0, S19). `errors` is 0 on every version (S15)."""
        qos, staging = ctx.qos, self.profile.staging_reports
        heap_usage = sum(bo.size for bo in ctx.fd.memory.dev_bos.values()) if staging else 0
        return layout.pack({
            "context_id": ctx.handle, "start_col": ctx.start_col, "num_col": ctx.num_col,
            "hwctx_id": ctx.fw_id if staging else 0, "pid": ctx.pid, "command_submissions": ctx.stats["submissions"],
            "command_completions": ctx.stats["completions"], "errors": 0, "priority": qos["priority"],
            "heap_usage": heap_usage, "state": AMDXDNA_HWCTX_STATE_ACTIVE, "pasid": ctx.fd.pasid, "gops": qos["gops"],
            "fps": qos["fps"], "dma_bandwidth": qos["dma_bandwidth"], "latency": qos["latency"],
            "frame_exec_time": qos["frame_exec_time"], **(ctx.health if staging else {}), "name": ctx.fd.comm})

    def _array_async_err(self, client: Client, a: dict[str, int], op: str) -> None:
        usermem.write(a["buffer"], L.async_error.pack(self.last_async_error), op + " buffer")
        a["element_size"], a["num_element"] = ASYNC_ERROR_SIZE, 1

    def _array_bo_usage(self, client: Client, a: dict[str, int], op: str) -> None:
        if a["num_element"] != 1:
            raise fail(errno.EINVAL, op, "BO_USAGE takes exactly one element")
        size = min(a["element_size"], L.bo_usage.size)
        query = L.bo_usage.unpack(usermem.read(a["buffer"], size, op).ljust(L.bo_usage.size, b"\0"))
        if query["pid"] == 0:
            raise fail(errno.EINVAL, op, "pid must be non-zero")
        usage = {"pid": query["pid"], "total_usage": 0, "internal_usage": 0, "heap_usage": 0}
        for other in self.clients:
            if other.pid == query["pid"]:
                _add_usage(usage, other)
        usermem.write(a["buffer"], L.bo_usage.pack(usage)[:size], op + " buffer")
        a["element_size"] = size

    # --- SET_STATE (docs/uapi.md 4.10, 10) ---

    def _ioctl_set_state(self, client: Client, a: dict[str, int]) -> None:
        op = f"SET_STATE(param={a['param']})"
        handler = self._param_handler(_SET_STATE, a["param"], op)
        with self.lock:
            handler(a, op)

    def _set_power_mode(self, a: dict[str, int], op: str) -> None:
        request = L.set_power_mode.unpack(usermem.read(a["buffer"], L.set_power_mode.size, op + " buffer"))
        mode = request["power_mode"]
        # rule I6: pad, mode, LOW/MEDIUM, TURBO with contexts (docs/driver-rules.md)
        if any(request["pad"]):
            raise fail(errno.EINVAL, op, "pad must be 0")
        if mode > POWER_MODE_TURBO:
            raise fail(errno.EINVAL, op, f"power_mode={mode} > TURBO")
        if mode in (POWER_MODE_LOW, POWER_MODE_MEDIUM):
            raise fail(errno.EOPNOTSUPP, op, "LOW/MEDIUM power modes are not supported")
        if mode == POWER_MODE_TURBO and self.contexts and self.power_mode != POWER_MODE_TURBO:
            raise fail(errno.EINVAL, op, "TURBO while hardware contexts exist")
        self.power_mode = mode

    def _set_preempt(self, key: str, a: dict[str, int], op: str) -> None:
        request = L.attribute_state.unpack(usermem.read(a["buffer"], L.attribute_state.size, op + " buffer"))
        if request["state"] > 1:
            raise fail(errno.EINVAL, op, f"state={request['state']} > 1")
        if any(request["pad"]):
            raise fail(errno.EINVAL, op, "pad must be 0")
        self.preempt_state[key] = request["state"]


# Dispatch tables: param -> (method, minimum DRM minor, leading arguments) (docs/uapi.md 10, 11).
_ParamEntry = tuple[str, int] | tuple[str, int, str]
_GET_INFO: dict[int, _ParamEntry] = {
    0: ("_info_aie_status", 0), 1: ("_info_aie_metadata", 0), 2: ("_info_aie_version", 0),
    3: ("_info_clock_metadata", 0), 4: ("_info_sensors", 0), 5: ("_info_hw_contexts", 0),
    8: ("_info_firmware_version", 0), 9: ("_info_power_mode", 0), 10: ("_info_telemetry", 5),
    11: ("_info_preempt", 6, "force"), 12: ("_info_resource", 4), 13: ("_info_preempt", 6, "frame_boundary")}
_GET_ARRAY: dict[int, _ParamEntry] = {0: ("_array_hwctx_all", 1), 2: ("_array_async_err", 2), 6: ("_array_bo_usage", 8)}
_SET_STATE: dict[int, _ParamEntry] = {0: ("_set_power_mode", 0), 3: ("_set_preempt", 6, "force"),
                                      4: ("_set_preempt", 6, "frame_boundary")}


def _add_usage(usage: dict[str, int], client: Client) -> None:
    # Heap and CMD count as internal, SHMEM as external, DEV only in heap_usage (docs/uapi.md 10 BO_USAGE).
    for bo in client.bos.values():
        if bo.kind == AMDXDNA_BO_DEV:
            usage["heap_usage"] += bo.size
            continue
        usage["total_usage"] += bo.size
        if bo.kind in (AMDXDNA_BO_DEV_HEAP, AMDXDNA_BO_CMD):
            usage["internal_usage"] += bo.size

