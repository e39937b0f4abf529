"""amdxdna-direct: drive AMD XDNA NPUs through the Linux amdxdna ioctls, without XRT.

``open_device`` -> ``Device`` -> ``Bo`` / ``HwContext`` -> ``Kernel`` -> ``Run`` / ``RunList``;
errors live in ``amdxdna_direct.errors`` (``Error`` is the base of them all). ``open_device("emu")``
runs on the built-in emulator. ``Xclbin`` (the container parser) is imported on first use, so that
``import amdxdna_direct`` stays fast.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import errors
from .bo import Bo
from .device import Device, open_device
from .errors import Error
from .hwctx import HwContext
from .kernel import DEFAULT_TIMEOUT, FOREVER, Kernel, Run, RunList

# A library logs; the application decides where its records go (docs/cli.md, Logging). trace.py, imported above
# through the runtime, may have installed it already.
if not any(isinstance(h, logging.NullHandler) for h in logging.getLogger(__name__).handlers):
    logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from .xclbin import Xclbin

__all__ = ["open_device", "Device", "Bo", "HwContext", "Kernel", "Run", "RunList", "Xclbin", "errors", "Error",
           "DEFAULT_TIMEOUT", "FOREVER"]


def __getattr__(name: str) -> Any:
    if name == "Xclbin":
        from .xclbin import Xclbin

        return Xclbin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
