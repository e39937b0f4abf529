#!/usr/bin/env python3
"""Write a SAM3 kernel bundle: `tools/build_bundle.py OUT [--preset tiny|sam3] [--target npu4] [--seed N]
[--weights W.npz]` (a thin wrapper over `sam3.build.main`)."""

import sys
from pathlib import Path

# Runnable from a checkout without installing: the repository root holds the sam3 package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sam3.build import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
