#!/usr/bin/env python3
"""Write a synthetic SAM3 bundle (seeded weights, placeholder kernels for the emulator):
`tools/build_bundle.py OUT [--preset tiny|sam3] [--variant host|device|device-f32] [--seed N]
[--target npu1|npu4|npu5|npu6] [--format 1|2]`, a thin wrapper over `sam3.build.main`.

Exit status 0 on success (the bundle directory on stdout, progress on stderr), 1 when the build fails, 2 on bad
usage."""

import sys
from pathlib import Path

# Runnable from a checkout without installing: the repository root holds the sam3 package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sam3.build import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
