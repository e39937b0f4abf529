"""``python -m amdxdna_direct.pyxrt SCRIPT [ARGS...]``: run SCRIPT with ``import pyxrt`` resolving to this layer."""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> int:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv``; 2 and a usage line without a script."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m amdxdna_direct.pyxrt SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    from amdxdna_direct import pyxrt

    sys.modules["pyxrt"] = pyxrt
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
