"""sam3: Segment Anything 3's heavy layers (GEMMs, 3x3 convolutions, attention) on an AMD XDNA NPU.

`sam3.bundle` loads a kernel bundle, `sam3.npu.Npu` runs it on a device (real or emulated),
`sam3.build` writes bundles, `sam3.demo` is the `sam3-npu` command.
"""
