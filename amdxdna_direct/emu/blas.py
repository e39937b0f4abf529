"""A BLAS thread budget for emulated kernel models (docs/emulator.md, "BLAS threads").

numpy's BLAS (OpenBLAS in the numpy wheels) starts one thread per core for every large matmul. A model running on
an engine thread while the host runs its own stages (the SAM3 pipeline's host math) would have both sides start a
full set of threads: twice the cores. While models run, ``limited()`` lowers the process's BLAS thread count to
``cores // (running models + 1)`` (at least 1: one share for each running model, one for the host) and puts the
original count back when the last one returns.

The library is the one numpy loaded: numpy's build configuration says which BLAS it was built with; the loaded copy
is found in the process's mappings and its thread calls by name (OpenBLAS's ``openblas_set_num_threads``, with the
``scipy_`` prefix and ``64_`` suffix of the scipy-openblas builds numpy wheels ship). threadpoolctl is not needed.
Where no such library is found (another BLAS, a non-Linux host) nothing is limited and ``status()`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_SYMBOL_FORMS = (("", ""), ("", "64_"), ("scipy_", "64_"), ("scipy_", ""))   # (prefix, suffix) of OpenBLAS's names


@dataclass(frozen=True)
class BlasStatus:
    """What the budget acts on: the library and its calls, or why there is none."""

    library: str | None             # the loaded shared object, or None
    symbol: str | None              # the set-threads function used
    threads: int | None             # the thread count found at load (restored when no model runs)
    reason: str                     # "limiting" or why nothing is limited


class _Budget:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self.enabled = True
        self._loaded = False
        self._set: Callable[[int], None] | None = None      # openblas_set_num_threads, once found
        self._get: Callable[[], int] | None = None          # openblas_get_num_threads, once found
        self._status = BlasStatus(None, None, None, "not looked up yet")

    def status(self) -> BlasStatus:
        with self._lock:
            self._load()
            return self._status

    def enter(self) -> bool:
        with self._lock:
            self._load()
            if self._set is None or not self.enabled:
                return False
            self._running += 1
            self._apply()
            return True

    def leave(self) -> None:
        with self._lock:
            self._running -= 1
            self._apply()

    def set_enabled(self, flag: bool) -> None:
        with self._lock:
            self.enabled = flag

    def current(self) -> int | None:
        with self._lock:
            self._load()
            return None if self._get is None else self._get()

    def _apply(self) -> None:
        if self._set is None:           # only a counted enter(), which found the setter, leads here
            raise RuntimeError("BLAS budget: no openblas_set_num_threads to apply a thread count with")
        full = self._status.threads or 1
        self._set(full if self._running == 0 else max(1, full // (self._running + 1)))

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        name = _numpy_blas_name()
        if "openblas" not in name:
            self._status = BlasStatus(None, None, None, f"numpy's BLAS is {name or 'unknown'}, not OpenBLAS")
            return
        path = _loaded_library("openblas")
        if path is None:
            self._status = BlasStatus(None, None, None, "no OpenBLAS library is mapped into the process")
            return
        library = ctypes.CDLL(path)
        for prefix, suffix in _SYMBOL_FORMS:
            setter = getattr(library, f"{prefix}openblas_set_num_threads{suffix}", None)
            getter = getattr(library, f"{prefix}openblas_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                self._set, self._get = setter, getter
                self._status = BlasStatus(path, setter.__name__, getter(), "limiting")
                return
        self._status = BlasStatus(path, None, None, f"{os.path.basename(path)} has no openblas_set_num_threads")


def _numpy_blas_name() -> str:
    """The BLAS numpy was built with ("scipy-openblas", "openblas", "mkl", ...), or "" when it does not say."""
    import numpy as np

    try:
        config = np.show_config(mode="dicts")
        return str(config["Build Dependencies"]["blas"]["name"]).lower()
    except (KeyError, TypeError, ValueError, AttributeError):
        return ""


def _loaded_library(word: str) -> str | None:
    """The path of a shared object mapped into this process whose file name contains `word`, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if path.startswith("/") and word in os.path.basename(path).lower() and ".so" in path:
                    return path
    except OSError:
        return None
    return None


_BUDGET = _Budget()


def status() -> BlasStatus:
    """The library the budget acts on (looked up on first use), or why it acts on none."""
    return _BUDGET.status()


def set_enabled(flag: bool) -> None:
    """Turn the budget on (the default) or off: off, models run with whatever thread count the process set (for a
    program that manages BLAS threads itself, and for bench/bench_emulator.py's comparison). Blocks already running
    keep their share until they return."""
    _BUDGET.set_enabled(bool(flag))


def threads() -> int | None:
    """The BLAS thread count in force now (None without OpenBLAS)."""
    return _BUDGET.current()


@contextlib.contextmanager
def limited() -> Iterator[None]:
    """Run the block as one more BLAS user: threads = cores // (users + 1) while it runs (no-op without OpenBLAS or
    with the budget off)."""
    counted = _BUDGET.enter()
    try:
        yield
    finally:
        if counted:
            _BUDGET.leave()
