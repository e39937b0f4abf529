"""sam3: Segment Anything 3 with its heavy layers on an AMD XDNA NPU, reading the kernel bundles IRON writes.

One module per stage: `bundle` (the bundle format), `pack` (bfp16ebs8 weights), `npu` (kernels on a device,
the context LRU), `kernels` (what each IRON kernel computes, for the emulator), `vit`, `neck`, `detr`
(stages), `build` (generated bundles), `demo` and `cli` (the `sam3` command).
"""

import logging as _logging

# A library logs; the application decides where it goes (docs/cli.md: the `sam3` command prints warnings).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())
