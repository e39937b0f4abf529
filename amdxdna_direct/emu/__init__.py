"""An emulated amdxdna device: the driver's ioctl layer and the NPU firmware, behind the syscall seam.

``EmuDevice(profile)`` is one emulated PCI NPU; ``dev.open()`` returns an ``EmuSeam`` (one fd) that
takes raw ioctl request numbers and struct bytes like ``fcntl.ioctl`` on ``/dev/accel/accel0``.
See docs/emulator.md for the rule table, profiles, faults and model binding.
"""

from .driver import EmuDevice, EmuSeam
from .memory import DeviceFault
from .models import Elementwise, Gemm, Mha, Model, ModelRegistry, Passthrough
from .profiles import DEFAULT_DRIVER, DRIVERS, NPUS, PROFILES, Profile, resolve

__all__ = ["DEFAULT_DRIVER", "DRIVERS", "NPUS", "PROFILES", "DeviceFault", "Elementwise", "EmuDevice", "EmuSeam",
           "Gemm", "Mha", "Model", "ModelRegistry", "Passthrough", "Profile", "resolve"]
