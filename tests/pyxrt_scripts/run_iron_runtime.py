# Host code in the shape of IRON's XRT host runtime: the NPU family picked from get_info(name), contexts kept
# per xclbin, a new instruction bo per run sized insts.nbytes and passed as ninstr in BYTES, tensors as mapped
# bos read through numpy views of map(), and sub-buffer handles into one allocation.
# Arguments: XCLBIN INSTS_BIN BYTES... (the kernel's buffers in order; the first is the input, the last the output).
import sys

import numpy as np
import pyxrt

xclbin_path, insts_path, sizes = sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]]
device = pyxrt.device(0)
name = device.get_info(pyxrt.xrt_info_device.name)
if any(k in name for k in ("NPU Strix", "NPU Strix Halo", "NPU Krackan", "RyzenAI-npu4", "RyzenAI-npu6")):
    family = "npu2"
elif any(k in name for k in ("NPU", "NPU Phoenix", "RyzenAI-npu1")):
    family = "npu1"
else:
    family = "unknown"
print(name, family)

xclbin = pyxrt.xclbin(xclbin_path)
device.register_xclbin(xclbin)
context = pyxrt.hw_context(device, xclbin.get_uuid())
kernel = pyxrt.kernel(context, xclbin.get_kernels()[0].get_name())
insts = np.fromfile(insts_path, dtype=np.uint32)

# one allocation holding every tensor, bound through sub-buffer handles
whole = pyxrt.bo(device, sum(sizes), pyxrt.bo.host_only, 0)
host = np.frombuffer(whole.map(), dtype=np.uint8)
starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
handles = [pyxrt.bo(whole, n, int(s)) for n, s in zip(sizes, starts, strict=True)]
x_bo, y_bo = handles[0], handles[-1]
x = host[: sizes[0]].view(np.uint32)
y = host[starts[-1]:].view(np.uint32)
ok = True
for r in range(2):
    x[:] = np.arange(x.size, dtype=np.uint32) * (r + 2)
    y[:] = 0
    x_bo.sync(pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    insts_bo = pyxrt.bo(device, insts.nbytes, pyxrt.bo.cacheable, kernel.group_id(1))
    insts_bo.write(insts.view(np.uint8), 0)
    insts_bo.sync(pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    h = kernel(3, insts_bo, insts.nbytes, *handles)
    state = h.wait()
    if state != pyxrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED:
        raise RuntimeError(f"Kernel returned {str(state)}")
    del insts_bo
    y_bo.sync(pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
    n = min(x.size, y.size)      # the passthrough copies what fits
    ok = ok and np.array_equal(y[:n], x[:n])
print("PASS!" if ok else f"FAIL: {y}")
