"""``python -m amdxdna_direct.pyxrt SCRIPT [ARGS...]``: run SCRIPT with ``import pyxrt`` resolving to this layer."""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> int:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv`` and the script's directory first on ``sys.path``
    (as ``python SCRIPT`` does, so that it imports its sibling modules); 2 and one line without a readable script."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m amdxdna_direct.pyxrt SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    if not os.path.isfile(argv[0]):
        print(f"python -m amdxdna_direct.pyxrt: {argv[0]}: no such script", file=sys.stderr)
        return 2
    from amdxdna_direct import pyxrt

    sys.modules["pyxrt"] = pyxrt
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
