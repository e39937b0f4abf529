"""Hardware-context ioctls: CREATE_HWCTX (admission, placement, QoS), DESTROY_HWCTX, CONFIG_HWCTX (docs/uapi.md
4.1-4.3)."""

from __future__ import annotations

import errno
import logging

from . import layouts as L
from . import usermem
from .memory import AMDXDNA_BO_DEV, AMDXDNA_INVALID_ADDR, DEV_HEAP_CHUNK, Bo
from .objects import MAX_HWCTX_ID, Client, Fence, HwCtx, Timeline, fail
from .state import DeviceState

log = logging.getLogger(__name__)

CTX_INTERNAL_BOS = 4                # command-list buffers taken from the heap per context (docs/uapi.md 4.1 step 4)
CTX_INTERNAL_BO_SIZE = 4096
MAX_CONFIG_CU_SIZE = 4096
MAX_CUS = 32
CONFIG_CU, ASSIGN_DBG_BUF, REMOVE_DBG_BUF = 0, 1, 2
QOS_PRIORITIES = (0x100, 0x180, 0x200, 0x280)      # REALTIME HIGH NORMAL LOW (docs/uapi.md 3)
QOS_PRIORITY_HIGH = 0x180
FW_MSG_CREATE_CONTEXT = 0x2         # firmware mailbox opcode named in the failure log (docs/uapi.md 4.1 step 8)


class ContextIoctls(DeviceState):
    """CREATE_HWCTX, DESTROY_HWCTX and CONFIG_HWCTX (rules H1-H14).

    Mixed into ``EmuDevice`` (driver.py), whose ``lock``, ``cond``, ``profile``, ``firmware`` and reference
    counting (``unref_bo``) its methods use (declared by ``DeviceState``); ``driver._driver_table`` names the
    handlers.
    """

    def _ioctl_create_hwctx(self, client: Client, a: dict[str, int]) -> None:
        op = f"CREATE_HWCTX(num_tiles={a['num_tiles']})"
        # rule H1 (docs/driver-rules.md)
        if a["ext"] or a["ext_flags"]:
            raise fail(errno.EINVAL, op, "ext/ext_flags must be 0")
        # rule H2: qos_p is read whole (24 bytes, 32 out of tree): EFAULT (docs/driver-rules.md)
        qos = L.qos_info.unpack(usermem.read(a["qos_p"], self.profile.qos_size, op + " qos_p"))
        with self.lock:
            heap = client.memory.heap
            # rule H3: no heap ENOENT, an unmapped one EINVAL (docs/driver-rules.md)
            if heap is None:
                raise fail(errno.ENOENT, op, "The client dev heap object not exist")
            if heap.vaddr == AMDXDNA_INVALID_ADDR:
                raise fail(errno.EINVAL, op, "Invalid dev heap userptr (heap never mapped)")
            self._check_heap_alignment(client, op)
            internal = self._alloc_ctx_bos(client, op)
            try:
                ctx = self._admit(client, a, qos, op)
            except OSError:
                for bo in internal:
                    self.unref_bo(bo)
                raise
            ctx.internal_bos = internal
            client.contexts[ctx.handle] = ctx
            a["handle"], a["syncobj_handle"] = ctx.handle, ctx.syncobj_handle
            if self.profile.drm_minor >= 10:
                a["umq_doorbell"] = 0xFFFFFFFF      # AMDXDNA_INVALID_DOORBELL_OFFSET on AIE2 (docs/uapi.md 2.1)

    def _check_heap_alignment(self, client: Client, op: str) -> None:
        """Rule 50 (inferred, docs/emulator.md): the firmware maps the heap's user VA onto its device window and
        refuses a host address not aligned to the heap size (a power of two here: the size rounded up), which
        the driver hands it at context creation; an expandable heap's chunks must each be 64 MiB aligned."""
        for index, chunk in enumerate(client.memory.heaps):
            if chunk.vaddr == AMDXDNA_INVALID_ADDR:
                continue
            align = DEV_HEAP_CHUNK if self.profile.expandable_heap else 1 << (chunk.size - 1).bit_length()
            if chunk.vaddr % align:
                raise fail(errno.EINVAL, op, f"heap chunk {index} mapped at {chunk.vaddr:#x}, not aligned to "
                                             f"{align:#x} (firmware host-buffer mapping; errno inferred)")

    def _alloc_ctx_bos(self, client: Client, op: str) -> list[Bo]:
        bos = []
        try:
            for _ in range(CTX_INTERNAL_BOS):
                bo = self._new_dev_bo(client, CTX_INTERNAL_BO_SIZE, op, internal=True)
                if bo is None:
                    # rule H4: four command-list buffers of the heap per context (docs/driver-rules.md)
                    raise fail(errno.ENOSPC, op, "no heap room for the context's 4 command-list buffers")
                bos.append(bo)
        except OSError:
            for done in bos:
                self.unref_bo(done)
            raise
        return bos

    def _admit(self, client: Client, a: dict[str, int], qos: dict[str, int], op: str) -> HwCtx:
        num_tiles = a["num_tiles"]
        # rule H5: num_tiles and the columns they make (docs/driver-rules.md)
        if num_tiles == 0:
            raise fail(errno.EINVAL, op, "Number of tiles is zero")
        num_col = num_tiles // self.profile.core_rows
        if num_col == 0 or num_col > self.profile.columns:
            raise fail(errno.EINVAL, op, f"Invalid num_col {num_col}")
        self._check_qos(qos, a["max_opc"], op)
        if self.profile.temporal_only:
            # 7.0+ NPU4/5/6 (TEMPORAL_ONLY): every context takes the whole array from column 0, time-shared with
            # the others, so only the firmware's context limit refuses one (docs/emulator.md, Driver profiles S14).
            start, num_col = 0, self.profile.columns
        else:
            start = self._place(num_col, op)
        injected = self.faults.next_create_hwctx_errno
        if injected is not None:
            self.faults.next_create_hwctx_errno = None
            raise fail(injected, op, "fault injected by faults.fail_next_create_hwctx")
        # rule H7: the firmware's context limit is EINVAL (docs/driver-rules.md)
        if len(self.contexts) >= self.hwctx_limit():
            log.error("%s: command opcode %#x failed, status %#x (firmware context limit %d reached)",
                      self.profile.name, FW_MSG_CREATE_CONTEXT, errno.EINVAL, self.hwctx_limit())
            log.error("%s: create context failed", self.profile.name)
            raise fail(errno.EINVAL, op, f"firmware refused CREATE_CONTEXT (limit {self.hwctx_limit()})")
        # rule H8: handles from 1, a new empty timeline syncobj (docs/driver-rules.md)
        handle = client.next_ctx_handle()
        if handle is None:
            raise fail(errno.EBUSY, op, f"all {MAX_HWCTX_ID} context handles of this fd are live")
        self.forget_failures(client, handle)     # a reused handle starts a new seq space
        syncobj_handle = Client.lowest_free(client.syncobjs)
        timeline = Timeline()
        client.syncobjs[syncobj_handle] = timeline
        self.next_fw_id += 1
        return HwCtx(handle=handle, syncobj=timeline, syncobj_handle=syncobj_handle, start_col=start, num_col=num_col,
                     fd=client, priority=map_priority(qos["priority"]), qos=qos, fw_id=self.next_fw_id,
                     pid=client.pid)

    def _check_qos(self, qos: dict[str, int], max_opc: int, op: str) -> None:
        # QoS solver (<= 7.0, docs/uapi.md 4.1 step 7): needed GOPS must fit max_opc at the top H-clock.
        if qos["gops"] == 0:
            return
        rate = max(qos["fps"], 1000 // qos["latency"] if qos["latency"] else 0)
        capacity = max_opc * self.profile.dpm_clocks[-1][1] // 1000
        if qos["gops"] * rate > capacity:
            raise fail(errno.EINVAL, op, f"invalid request: {qos['gops']} GOPS x {rate}/s > {capacity}")

    def _starts(self, num_col: int) -> list[int]:
        # rule H6: the legal start columns of each NPU (docs/driver-rules.md)
        prof = self.profile
        if prof.aligned_placement:
            return list(range(0, prof.columns - num_col + 1, num_col))
        if num_col == prof.columns:
            # only a full-width partition may use the reserved first column (docs/uapi.md 4.1 step 6)
            return [0]
        return list(range(prof.first_col, prof.columns - num_col + 1))

    def _place(self, num_col: int, op: str) -> int:
        used = {col for ctx in self.contexts for col in range(ctx.start_col, ctx.start_col + ctx.num_col)}
        starts = self._starts(num_col)
        if not starts:
            raise fail(errno.EINVAL, op, f"no legal start column for {num_col} columns")
        for start in starts:
            if used.isdisjoint(range(start, start + num_col)):
                return start
        for ctx in self.contexts:       # time-share a partition of identical start and width (docs/uapi.md 4.1 step 8)
            if ctx.num_col == num_col and ctx.start_col in starts:
                return ctx.start_col
        # rule H6: no free range and no partition to share (docs/driver-rules.md)
        raise fail(errno.ENODEV, op, f"no free range of {num_col} columns and no partition to share")

    def _ioctl_destroy_hwctx(self, client: Client, a: dict[str, int]) -> None:
        op = f"DESTROY_HWCTX(handle={a['handle']})"
        # rule H10: pad, unknown handle; the teardown waits, then aborts (docs/driver-rules.md)
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        with self.lock:
            ctx = client.contexts.get(a["handle"])
            if ctx is None:
                raise fail(errno.EINVAL, op, "HW context not exist")
        self.destroy_context(ctx)

    def destroy_context(self, ctx: HwCtx) -> None:
        """Tear a context down (DESTROY_HWCTX, fd close): firmware ends its jobs, then resources go."""
        client = ctx.fd
        with self.lock:
            if client.contexts.pop(ctx.handle, None) is None:
                return
            ctx.destroyed = True
            client.closing.append(ctx)
            self.cond.notify_all()
        self.firmware.destroy_context(ctx)      # waits for the last job, aborts the rest (docs/uapi.md 4.2)
        with self.lock:
            client.closing.remove(ctx)
            for bo in (*ctx.internal_bos, *(cu for cu, _ in ctx.cus if ctx.cu_refs), *ctx.dbg_bos):
                self.unref_bo(bo)
            for bo in ctx.dbg_bos:
                bo.dbg_ctx = None
            ctx.internal_bos, ctx.cus, ctx.dbg_bos = [], [], []
            self.cond.notify_all()

    def _ioctl_config_hwctx(self, client: Client, a: dict[str, int]) -> None:
        op = f"CONFIG_HWCTX(handle={a['handle']}, param_type={a['param_type']})"
        # rule H11: pad, param_type and context checks (docs/driver-rules.md)
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        param = a["param_type"]
        data = b""
        if param == CONFIG_CU:
            # rule H12: param_val_size above 4096 is E2BIG (docs/driver-rules.md)
            if a["param_val_size"] > MAX_CONFIG_CU_SIZE:
                raise fail(errno.E2BIG, op, f"param_val_size={a['param_val_size']} > {MAX_CONFIG_CU_SIZE}")
            data = usermem.read(a["param_val"], a["param_val_size"], op + " param_val")
        elif param not in (ASSIGN_DBG_BUF, REMOVE_DBG_BUF):
            raise fail(errno.EINVAL, op, "unknown param_type")
        elif self.profile.drm_minor < 3:
            # Before 0.3 the debug-buffer types reach the hardware layer, which has no case for them (S7).
            raise fail(errno.EOPNOTSUPP, op, f"debug buffers need feature level 0.3 (this driver: "
                                             f"0.{self.profile.drm_minor})")
        with self.lock:
            ctx = client.contexts.get(a["handle"])
            if ctx is None:
                raise fail(errno.EINVAL, op, "HW context not exist")
            if param == CONFIG_CU:
                self._config_cu(client, ctx, data, a["param_val_size"], op)
            elif param == ASSIGN_DBG_BUF:
                self._assign_dbg(client, ctx, a["param_val"], op)
            else:
                self._remove_dbg(client, ctx, a["param_val"], op)

    def _config_cu(self, client: Client, ctx: HwCtx, data: bytes, size: int, op: str) -> None:
        padded = data.ljust(L.config_cu_header.size, b"\0")
        header = L.config_cu_header.unpack(padded)
        num = header["num_cus"]
        # rule H12: the config's checks, in the driver's order (docs/driver-rules.md)
        if header["pad0"] or header["pad1"] or header["pad2"]:
            raise fail(errno.EINVAL, op, "config pad must be 0")
        if ctx.cus:
            raise fail(errno.EINVAL, op, "Not support re-config CU")
        if num == 0:
            raise fail(errno.EINVAL, op, "num_cus is 0")
        if L.config_cu_header.size + L.cu_config.size * num > size:
            raise fail(errno.EINVAL, op, f"num_cus={num} does not fit param_val_size={size}")
        if num > MAX_CUS:
            raise fail(errno.EINVAL, op, f"num_cus={num} > {MAX_CUS}")
        cus = [L.cu_config.unpack(data, L.config_cu_header.size + L.cu_config.size * i) for i in range(num)]
        for i, cu in enumerate(cus):
            if cu["pad0"] or cu["pad1"] or cu["pad2"]:
                raise fail(errno.EINVAL, op, f"cu {i} pad must be 0")
            bo = client.bos.get(cu["cu_bo"])
            if bo is None or bo.kind != AMDXDNA_BO_DEV:
                raise fail(errno.EINVAL, op, f"cu {i}: cu_bo={cu['cu_bo']} is not a DEV BO")
        # Up to 7.0 the driver looks each CU BO up, takes its address and drops the reference: closing the PDI
        # frees its heap range under the context (S1). The out-of-tree driver keeps a reference.
        ctx.cu_refs = self.profile.staging_reports
        for cu in cus:
            bo = client.bos[cu["cu_bo"]]
            if ctx.cu_refs:
                bo.refs += 1
            ctx.cus.append((bo, cu["cu_func"]))

    def _dbg_bo(self, client: Client, handle: int, op: str) -> Bo:
        bo = client.bos.get(handle)
        if bo is None or bo.kind != AMDXDNA_BO_DEV:
            raise fail(errno.EINVAL, op, f"debug BO handle={handle} is not a DEV BO")
        return bo

    def _assign_dbg(self, client: Client, ctx: HwCtx, handle: int, op: str) -> None:
        bo = self._dbg_bo(client, handle, op)
        # rule H13: a debug buffer is assigned once (docs/driver-rules.md)
        if bo.dbg_ctx is not None:
            raise fail(errno.EBUSY, op, f"BO {handle} is already a debug buffer")
        bo.dbg_ctx = ctx
        bo.refs += 1
        ctx.dbg_bos.append(bo)
        self._driver_job(ctx)

    def _remove_dbg(self, client: Client, ctx: HwCtx, handle: int, op: str) -> None:
        bo = self._dbg_bo(client, handle, op)
        # rule H13: only an assigned debug buffer is removed (docs/driver-rules.md)
        if bo.dbg_ctx is not ctx:
            raise fail(errno.EINVAL, op, f"BO {handle} is not a debug buffer of context {ctx.handle}")
        bo.dbg_ctx = None
        ctx.dbg_bos.remove(bo)
        self.unref_bo(bo)
        self._driver_job(ctx)

    def _driver_job(self, ctx: HwCtx) -> None:
        """7.0 attaches and detaches a debug buffer through its own command submission: it takes the next seq of
        the context's timeline, signalled once done (S17). The out-of-tree driver is left as it was."""
        if self.profile.staging_reports:
            return
        seq = ctx.next_seq
        ctx.next_seq += 1
        ctx.syncobj.add(seq, Fence(True))
        self.cond.notify_all()


def map_priority(priority: int) -> int:
    """QoS priority as the driver keeps it: one of the four defines, anything else HIGH (rule H9)."""
    return priority if priority in QOS_PRIORITIES else QOS_PRIORITY_HIGH

