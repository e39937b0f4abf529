# A test script in the shape of mlir-aie's test/npu-xrt scripts that use aie.utils.xrt's setup_aie/execute (here
# the sibling module aie_app). Arguments: XCLBIN INSTS_TXT IN_WORDS OUT_WORDS TWO_INPUTS(0|1) [TRACE_FILE].
import sys

import numpy as np
from aie_app import execute, extract_trace, setup, write_out_trace

xclbin, insts, in_words, out_words, two = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
trace_file = sys.argv[6] if len(sys.argv) > 6 else None
trace_size = 4096 if trace_file else 0
data = (np.arange(in_words, dtype=np.int32) * 7 - 3).astype(np.int32)
second = ((out_words,), np.int32) if two == "1" else None
app = setup(xclbin, insts, ((in_words,), np.int32), second, ((out_words,), np.int32), trace_size=trace_size)
out = execute(app, data, np.zeros(out_words, dtype=np.int32) if second else None)
if trace_file:
    out, trace = extract_trace(out, (out_words,), np.int32, trace_size)
    write_out_trace(trace, trace_file)
n = min(in_words, out_words)        # the passthrough copies what fits
print("PASS!" if np.array_equal(out[:n], data[:n]) else f"FAIL: {out}")
