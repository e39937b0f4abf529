"""The emulator's own view of every ioctl struct: ``struct`` formats written from docs/uapi.md.

Deliberately independent of ``headers/`` and ``amdxdna_direct.abi``: the emulator plays the kernel,
so it must not share the binding's mistakes. Offsets and sizes are those of docs/uapi.md sections 2 and 5
(x86_64, little-endian, natural alignment); ``x`` codes stand for compiler padding.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    """One C struct: its kernel name, field names and a ``struct`` format (``<`` little-endian)."""

    name: str
    fields: tuple[str, ...]
    fmt: str

    @property
    def size(self) -> int:
        """sizeof(struct) in bytes."""
        return struct.calcsize(self.fmt)

    def unpack(self, buf: bytes | bytearray | memoryview, offset: int = 0) -> dict[str, Any]:
        """Decode the struct at `offset` of `buf` into a field -> value dict.

        A value is an ``int``, or ``bytes`` for an ``s`` code: which one depends on the format (as for ``struct``).
        """
        return dict(zip(self.fields, struct.unpack_from(self.fmt, buf, offset), strict=True))

    def pack(self, values: Mapping[str, int | bytes]) -> bytes:
        """Encode `values` (missing fields are 0)."""
        return struct.pack(self.fmt, *(values.get(field, 0) for field in self.fields))

    def pack_into(self, buf: bytearray | memoryview, offset: int, values: Mapping[str, int | bytes]) -> None:
        """Encode `values` into `buf` at `offset`."""
        struct.pack_into(self.fmt, buf, offset, *(values.get(field, 0) for field in self.fields))


def _layout(name: str, spec: str) -> Layout:
    """Build a Layout from "code:field code:field ..." (a bare code is padding)."""
    fields, codes = [], ["<"]
    for item in spec.split():
        code, _, field = item.partition(":")
        codes.append(code)
        if field:
            fields.append(field)
    return Layout(name, tuple(fields), "".join(codes))


# --- amdxdna ioctl carriers (docs/uapi.md 2.1-2.4) ---
create_hwctx = _layout("amdxdna_drm_create_hwctx",
                       "Q:ext Q:ext_flags Q:qos_p I:umq_bo I:log_buf_bo I:max_opc I:num_tiles I:mem_size "
                       "I:umq_doorbell I:handle I:syncobj_handle")
qos_info = _layout("amdxdna_qos_info", "I:gops I:fps I:dma_bandwidth I:latency I:frame_exec_time I:priority")
destroy_hwctx = _layout("amdxdna_drm_destroy_hwctx", "I:handle I:pad")
config_hwctx = _layout("amdxdna_drm_config_hwctx", "I:handle I:param_type Q:param_val I:param_val_size I:pad")
config_cu_header = _layout("amdxdna_hwctx_param_config_cu", "H:num_cus H:pad0 H:pad1 H:pad2")
cu_config = _layout("amdxdna_cu_config", "I:cu_bo B:cu_func B:pad0 B:pad1 B:pad2")
create_bo = _layout("amdxdna_drm_create_bo", "Q:flags Q:vaddr Q:size I:type I:handle")
get_bo_info = _layout("amdxdna_drm_get_bo_info",
                      "Q:ext Q:ext_flags I:handle I:pad Q:map_offset Q:vaddr Q:xdna_addr")
sync_bo = _layout("amdxdna_drm_sync_bo", "I:handle I:direction Q:offset Q:size")
exec_cmd = _layout("amdxdna_drm_exec_cmd",
                   "Q:ext Q:ext_flags I:hwctx I:type Q:cmd_handles Q:args I:cmd_count I:arg_count Q:seq")
wait_cmd = _layout("amdxdna_drm_wait_cmd", "I:hwctx I:timeout Q:seq")
get_info = _layout("amdxdna_drm_get_info", "I:param I:buffer_size Q:buffer")
get_array = _layout("amdxdna_drm_get_array", "I:param I:element_size I:num_element I:pad Q:buffer")
set_state = _layout("amdxdna_drm_set_state", "I:param I:buffer_size Q:buffer")

# --- GET_INFO / GET_ARRAY / SET_STATE payloads (docs/uapi.md 2.5) ---
query_aie_status = _layout("amdxdna_drm_query_aie_status", "Q:buffer I:buffer_size I:cols_filled")
query_aie_version = _layout("amdxdna_drm_query_aie_version", "I:major I:minor")
query_aie_tile_metadata = _layout("amdxdna_drm_query_aie_tile_metadata",
                                  "H:row_count H:row_start H:dma_channel_count H:lock_count H:event_reg_count 6x")
query_aie_metadata = _layout(
    "amdxdna_drm_query_aie_metadata",
    "I:col_size H:cols H:rows I:version_major I:version_minor "
    + " ".join(f"H:{tile}_row_count H:{tile}_row_start H:{tile}_dma_channel_count H:{tile}_lock_count "
               f"H:{tile}_event_reg_count 6x" for tile in ("core", "mem", "shim")))
query_clock = _layout("amdxdna_drm_query_clock", "16s:name I:freq_mhz I:pad")
query_clock_metadata = _layout("amdxdna_drm_query_clock_metadata",
                               "16s:mp_npu_name I:mp_npu_freq_mhz I:mp_npu_pad 16s:h_name I:h_freq_mhz I:h_pad")
query_hwctx = _layout("amdxdna_drm_query_hwctx",
                      "I:context_id I:start_col I:num_col I:pad q:pid Q:command_submissions "
                      "Q:command_completions Q:migrations Q:preemptions Q:errors")
get_power_mode = _layout("amdxdna_drm_get_power_mode", "B:power_mode 7x")
set_power_mode = _layout("amdxdna_drm_set_power_mode", "B:power_mode 7s:pad")
query_firmware_version = _layout("amdxdna_drm_query_firmware_version", "I:major I:minor I:patch I:build")
get_resource_info = _layout("amdxdna_drm_get_resource_info",
                            "Q:npu_clk_max Q:npu_tops_max Q:npu_task_max Q:npu_tops_curr Q:npu_task_curr")
attribute_state = _layout("amdxdna_drm_attribute_state", "B:state 7s:pad")
query_telemetry_header = _layout("amdxdna_drm_query_telemetry_header", "I:major I:minor I:type I:map_num_elements")
# The 7.0 entry is 144 bytes (docs/uapi.md 2.5); staging/OOT append char name[16] (160).
hwctx_entry = _layout("amdxdna_drm_hwctx_entry",
                      "I:context_id I:start_col I:num_col I:hwctx_id q:pid Q:command_submissions "
                      "Q:command_completions Q:migrations Q:preemptions Q:errors Q:priority Q:heap_usage "
                      "Q:suspensions I:state I:pasid I:gops I:fps I:dma_bandwidth I:latency I:frame_exec_time "
                      "I:txn_op_idx I:ctx_pc I:fatal_error_type I:fatal_error_exception_type "
                      "I:fatal_error_exception_pc I:fatal_error_app_module I:pad")
# The staging / out-of-tree entry: the same fields, then the process name (TASK_COMM_LEN bytes).
hwctx_entry_oot = Layout(hwctx_entry.name, (*hwctx_entry.fields, "name"), hwctx_entry.fmt + "16s")
async_error = _layout("amdxdna_async_error", "Q:err_code Q:ts_us Q:ex_err_code")
bo_usage = _layout("amdxdna_drm_bo_usage", "q:pid Q:total_usage Q:internal_usage Q:heap_usage")

# --- DRM core (docs/uapi.md 5, docs/uapi.md A.3) ---
drm_version = _layout("drm_version",
                      "i:version_major i:version_minor i:version_patchlevel 4x Q:name_len Q:name Q:date_len "
                      "Q:date Q:desc_len Q:desc")
gem_close = _layout("drm_gem_close", "I:handle I:pad")
get_cap = _layout("drm_get_cap", "Q:capability Q:value")
prime_handle = _layout("drm_prime_handle", "I:handle I:flags i:fd")
syncobj_create = _layout("drm_syncobj_create", "I:handle I:flags")
syncobj_destroy = _layout("drm_syncobj_destroy", "I:handle I:pad")
# Newer kernels append u64 deadline_nsec; DRM zero-fills the older, shorter struct (docs/uapi.md 5).
syncobj_wait = _layout("drm_syncobj_wait",
                       "Q:handles q:timeout_nsec I:count_handles I:flags I:first_signaled I:pad Q:deadline_nsec")
syncobj_timeline_wait = _layout("drm_syncobj_timeline_wait",
                                "Q:handles Q:points q:timeout_nsec I:count_handles I:flags I:first_signaled "
                                "I:pad Q:deadline_nsec")
syncobj_array = _layout("drm_syncobj_array", "Q:handles I:count_handles I:pad")
syncobj_timeline_array = _layout("drm_syncobj_timeline_array", "Q:handles Q:points I:count_handles I:flags")
