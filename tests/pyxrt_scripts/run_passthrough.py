# Host code written the way mlir-aie's test/npu-xrt/*/run.py scripts are: it imports pyxrt and nothing else of
# this project. Arguments: XCLBIN INSTS [RUNLIST_COUNT].
import sys

import numpy as np
import pyxrt as xrt

xclbin_path, insts_path = sys.argv[1], sys.argv[2]
count = int(sys.argv[3]) if len(sys.argv) > 3 else 0
device = xrt.device(0)
xclbin = xrt.xclbin(xclbin_path)
kernels = xclbin.get_kernels()
xkernel = [k for k in kernels if k.get_name() == "MLIR_AIE"][0]
device.register_xclbin(xclbin)
context = xrt.hw_context(device, xclbin.get_uuid())
kernel = xrt.kernel(context, xkernel.get_name())
instr = np.fromfile(insts_path, dtype=np.uint32)
bo_instr = xrt.bo(device, len(instr) * 4, xrt.bo.cacheable, kernel.group_id(1))
bo_a = xrt.bo(device, 68, xrt.bo.host_only, kernel.group_id(3))
bo_b = xrt.bo(device, 64, xrt.bo.host_only, kernel.group_id(4))
bo_c = xrt.bo(device, 64, xrt.bo.host_only, kernel.group_id(5))
bo_instr.write(instr, 0)
bo_instr.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
data = np.arange(17, dtype=np.int32) * 3
bo_a.write(data, 0)
bo_a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
if count:
    runs = xrt.runlist(context)
    for _ in range(count):
        r = xrt.run(kernel)
        for i, arg in enumerate((3, bo_instr, len(instr), bo_a, bo_b, bo_c)):
            r.set_arg(i, arg)
        runs.add(r)
    runs.execute()
    runs.wait()
    state = r.state()
else:
    h = kernel(3, bo_instr, len(instr), bo_a, bo_b, bo_c)
    state = h.wait()
print(state)
bo_c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
out = bo_c.read(64, 0).view(np.int32)
print("PASS!" if np.array_equal(out, data[:16]) else f"FAIL: {out}")
