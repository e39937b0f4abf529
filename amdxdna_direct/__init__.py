"""amdxdna-direct: drive AMD XDNA NPUs through the Linux amdxdna ioctls, without XRT.

``open_device`` -> ``Device`` -> ``Bo`` / ``HwContext`` -> ``Kernel`` -> ``Run`` / ``RunList``;
errors live in ``amdxdna_direct.errors`` (``Error`` is the base of them all). ``open_device("emu")``
runs on the built-in emulator.

The names below are imported on first use (PEP 562), so that ``import amdxdna_direct`` and the command line's
``--help`` cost no numpy, cffi or parser import (docs/runtime.md, Start-up); ``amdxdna_direct.Device`` imports
the runtime then.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

# A library logs; the application decides where its records go (docs/cli.md, Logging). trace.py may have
# installed it already.
if not any(isinstance(h, logging.NullHandler) for h in logging.getLogger(__name__).handlers):
    logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from . import errors
    from .bo import Bo
    from .device import Device, open_device
    from .errors import ContextLostError, Error, XdnaError
    from .hwctx import HwContext
    from .kernel import DEFAULT_TIMEOUT, FOREVER, Kernel, Run, RunList
    from .xclbin import Xclbin

# public name -> the module of this package that defines it
_LAZY: dict[str, str] = {
    "open_device": "device", "Device": "device", "Bo": "bo", "HwContext": "hwctx", "Kernel": "kernel",
    "Run": "kernel", "RunList": "kernel", "DEFAULT_TIMEOUT": "kernel", "FOREVER": "kernel", "Xclbin": "xclbin",
    "Error": "errors", "XdnaError": "errors", "ContextLostError": "errors",
}
DISTRIBUTION = "amdxdna-direct"
#: Reported when the package runs from a source tree that was never installed (no distribution metadata).
UNINSTALLED_VERSION = "0+unknown"

__all__ = ["open_device", "Device", "Bo", "HwContext", "Kernel", "Run", "RunList", "Xclbin", "errors", "Error",
           "XdnaError", "ContextLostError", "DEFAULT_TIMEOUT", "FOREVER", "__version__"]


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNINSTALLED_VERSION


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif name == "errors":
        value = importlib.import_module(f"{__name__}.errors")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
