# A helper module in the shape of mlir-aie's aie.utils.xrt (an application object holding the device, the
# context, the kernel and buffers registered by group id; setup, execute and trace helpers), written for these
# tests from the calls that module makes. It imports pyxrt and numpy only, and is imported by a sibling script,
# as mlir-aie's test scripts import their helpers.
import numpy as np
import pyxrt as xrt


def read_insts_text(path):
    with open(path) as f:
        return np.array([int(line, 16) for line in f.read().split() if line], dtype=np.uint32)


class Buffer:
    def __init__(self, app, group_id, shape, dtype, flags=xrt.bo.host_only):
        self.shape, self.dtype = shape, dtype
        self.len_bytes = np.prod(shape) * np.dtype(dtype).itemsize     # a numpy integer, as there
        self.bo = xrt.bo(app.device, self.len_bytes, flags, app.kernel.group_id(group_id))

    def write(self, values, offset=0):
        self.bo.write(values.view(np.uint8), offset)
        self.bo.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)

    def read(self):
        self.bo.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
        return self.bo.read(self.len_bytes, 0).view(self.dtype).reshape(self.shape)


class Application:
    def __init__(self, xclbin_path, insts_path, kernel_name):
        self.buffers = [None] * 8
        self.device = xrt.device(0)
        self.xclbin = xrt.xclbin(xclbin_path)
        names = [k.get_name() for k in self.xclbin.get_kernels() if k.get_name() == kernel_name]
        self.device.register_xclbin(self.xclbin)
        self.context = xrt.hw_context(self.device, self.xclbin.get_uuid())
        self.kernel = xrt.kernel(self.context, names[0])
        insts = read_insts_text(insts_path)
        self.n_insts = len(insts)
        self.insts = Buffer(self, 1, insts.shape, insts.dtype, xrt.bo.cacheable)
        self.insts.write(insts)

    def register_buffer(self, group_id, shape, dtype):
        self.buffers[group_id] = Buffer(self, group_id, shape, dtype)

    def run(self):
        self.insts.bo.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        h = self.kernel(3, self.insts.bo, self.n_insts, *[b.bo for b in self.buffers if b is not None])
        state = h.wait()
        if state != xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED:
            raise RuntimeError(f"Kernel returned {state}")


def setup(xclbin_path, insts_path, in0, in1, out, trace_size=0, kernel_name="MLIR_AIE"):
    """in0, in1, out: (shape, dtype); in1 may be None. A trace makes the output buffer raw bytes plus the trace."""
    app = Application(xclbin_path, insts_path, kernel_name)
    app.register_buffer(3, *in0)
    if in1 is not None:
        app.register_buffer(4, *in1)
    if trace_size:
        nbytes = np.prod(out[0]) * np.dtype(out[1]).itemsize
        out = ((nbytes + trace_size,), np.uint8)
    app.register_buffer(5, *out)
    return app


def extract_trace(raw, shape, dtype, trace_size):
    words = raw.reshape(-1).view(np.uint32)
    n = trace_size // 4
    return words[:-n].view(dtype).reshape(shape), words[-n:]


def write_out_trace(trace, path):
    with open(path, "w") as f:
        f.write("\n".join(f"{w:08x}" for w in trace if w != 0))


def execute(app, in0, in1=None):
    app.buffers[3].write(in0)
    if in1 is not None:
        app.buffers[4].write(in1)
    app.run()
    return app.buffers[5].read()
