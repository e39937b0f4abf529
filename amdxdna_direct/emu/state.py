"""The device's state as the ioctl families see it: ``DeviceState`` (what ``EmuDevice`` holds), its counters and
its fault injection.

The layer between the driver's objects (``objects.py``) and firmware (``firmware.py``) below and the ioctl families
(``buffers``, ``contexts``, ``submit``, ``queries``) above; ``driver.py`` on top assembles ``EmuDevice`` from them
(docs/emulator.md, Modules).
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
from typing import TYPE_CHECKING

from .firmware import Firmware
from .memory import Bo
from .objects import Client, HwCtx, Job
from .profiles import Profile

log = logging.getLogger(__name__)


class DeviceState:
    """What the ioctl mixins of ``EmuDevice`` (``BoIoctls``, ``ContextIoctls``, ``SubmitIoctls``,
    ``QueryIoctls``) use of the device and of each other, declared once for the type checker.

    Annotations only: ``EmuDevice.__init__`` (driver.py) assigns the attributes, and the methods are those of
    ``EmuDevice`` and ``BoIoctls``, which come before this class in ``EmuDevice``'s MRO.
    """

    profile: Profile
    lock: threading.RLock
    cond: threading.Condition
    clients: list[Client]
    lost: bool
    closing: bool
    live_bos: int
    power_mode: int
    preempt_state: dict[str, int]
    last_async_error: dict[str, int]
    next_map_offset: int
    next_fw_id: int
    exports: dict[tuple[int, int], Bo]
    pasids: dict[int, int]
    faults: Faults
    firmware: Firmware

    if TYPE_CHECKING:
        @property
        def contexts(self) -> list[HwCtx]: ...

        @property
        def listed_contexts(self) -> list[HwCtx]: ...

        def current_clocks(self) -> tuple[int, int]: ...

        def hwctx_limit(self) -> int: ...

        def unref_bo(self, bo: Bo) -> None: ...

        def forget_failures(self, client: Client, hwctx: int | None = None) -> None: ...

        def record_failure(self, job: Job, state: int, reason: str) -> None: ...

        def _new_dev_bo(self, client: Client, size: int, op: str, internal: bool = False) -> Bo | None: ...


class Counters:
    """Ioctl counts by name and live-object counts of one device."""

    def __init__(self, device: DeviceState):
        self._device = device
        self.ioctls: collections.Counter[str] = collections.Counter()

    def live(self) -> dict[str, int]:
        """Live BOs (backing not yet released), contexts, syncobjs and user mappings."""
        dev = self._device
        with dev.lock:
            return {"bos": dev.live_bos, "hwctx": len(dev.contexts),
                    "syncobjs": sum(len(c.syncobjs) for c in dev.clients),
                    "mappings": sum(len(c.memory.mappings) for c in dev.clients)}

    @property
    def bytes_mapped(self) -> int:
        """Bytes currently mapped by users through the seam's mmap."""
        with self._device.lock:
            return sum(size for c in self._device.clients for size, _, _ in c.memory.mappings.values())


class Faults:
    """Fault injection (an explicit API; docs/design.md section 2)."""

    def __init__(self, device: DeviceState):
        self._device = device
        self.next_create_hwctx_errno: int | None = None
        self.context_cap: int | None = None

    def fail_next_create_hwctx(self, err: int) -> None:
        """The next CREATE_HWCTX that passes argument checks fails with `err` (at the firmware step).

        Raises:
            ValueError: `err` is not an errno number.
        """
        if isinstance(err, bool) or err not in errno.errorcode:
            raise ValueError(f"fail_next_create_hwctx: {err!r} is not an errno number")
        self.next_create_hwctx_errno = err

    def cap_contexts(self, n: int) -> None:
        """Lower the firmware context limit to `n` (docs/uapi.md 4.1 step 8: the refusal is EINVAL).

        Raises:
            ValueError: `n` is not an int >= 0.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cap_contexts: the context limit must be an int >= 0, got {n!r}")
        self.context_cap = n

    def hang(self, stream: bytes | str, count: int = 1) -> None:
        """The next `count` runs of the stream (its bytes or sha256 hex) hang: the TDR ends them TIMEOUT.

        Raises:
            ValueError: count < 1 or a malformed digest.
        """
        self._device.firmware.inject("hang", stream, count)

    def error(self, stream: bytes | str, count: int = 1) -> None:
        """The next `count` runs of the stream (its bytes or sha256 hex) end with a firmware ERROR.

        Raises:
            ValueError: count < 1 or a malformed digest.
        """
        self._device.firmware.inject("error", stream, count)

    def lose_device(self) -> None:
        """Every later ioctl and mmap answers ENODEV (the device was unplugged, rule D5).

        Calls blocked in the driver (syncobj waits, WAIT_CMD, a fifth EXEC_CMD) wake at once with ENODEV;
        the firmware stops: queued jobs end ABORT, a running one ABORT when its model returns (or at the TDR).
        """
        dev = self._device
        with dev.lock:
            dev.lost = True
            # Under the lock (the order EXEC_CMD's submit takes too): no waiter sees `lost` before every lane has
            # stopped taking jobs, so a munmap it ends cannot pull a buffer from under a queued job.
            dev.firmware.abort_all()
            dev.cond.notify_all()
        log.warning("%s: device lost (fault injected)", dev.profile.name)
