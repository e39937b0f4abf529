"""amdxdna-direct: drive AMD XDNA NPUs through the Linux amdxdna ioctls, without XRT.

``open_device`` -> ``Device`` -> ``Bo`` / ``HwContext`` -> ``Kernel`` -> ``Run`` / ``RunList``;
errors live in ``amdxdna_direct.errors``. ``open_device("emu")`` runs on the built-in emulator.
"""

from . import errors
from .bo import Bo
from .device import Device, open_device
from .hwctx import HwContext
from .kernel import DEFAULT_TIMEOUT, FOREVER, Kernel, Run, RunList
from .xclbin import Xclbin

__all__ = ["open_device", "Device", "Bo", "HwContext", "Kernel", "Run", "RunList", "Xclbin", "errors",
           "DEFAULT_TIMEOUT", "FOREVER"]
