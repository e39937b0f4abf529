"""Hooks other packages register into, so that the runtime never imports them (docs/cli.md "Extensions").

One hook today: **bundle readers**, which ``amdxdna validate --bundle DIR`` asks for the kernels of a model
bundle. A reader is a callable ``reader(directory) -> list[BundleKernel]``; it raises
:class:`BundleUnavailable` with the reason when it cannot read that directory (its own package is missing a
part, or the bundle is refused). Readers come from two places, in this order:

- :func:`register_bundle_reader`, called by the package itself when it is imported (``sam3`` does);
- the ``amdxdna_direct.bundle_readers`` entry point group of the installed distributions (read with
  ``importlib.metadata``, loaded only when a bundle is asked for): each entry point names a reader.

A reader may be registered as ``"module:attribute"``: it is imported when first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

__all__ = ["BUNDLE_READER_GROUP", "BundleKernel", "BundleReader", "BundleUnavailable", "bundle_readers",
           "register_bundle_reader", "unregister_bundle_reader"]

BUNDLE_READER_GROUP = "amdxdna_direct.bundle_readers"


@dataclass(frozen=True)
class BundleKernel:
    """One kernel of a bundle: its key, its xclbin and instruction stream (paths or bytes), the xclbin kernel
    to run (None: the only one), and the emulator model of what it computes (None: none known)."""

    key: str
    xclbin: Any
    insts: Any
    kernel: str | None = None
    model: Any = None


class BundleUnavailable(Exception):
    """A reader cannot give the kernels of a directory; the message says why (one line)."""


BundleReader = Callable[[str], list[BundleKernel]]
_READERS: dict[str, BundleReader | str] = {}


def register_bundle_reader(name: str, reader: BundleReader | str) -> None:
    """Register ``reader`` (a callable, or ``"module:attribute"`` naming one) under ``name``, replacing any
    reader of that name.

    Raises:
        TypeError: ``reader`` is neither callable nor a ``"module:attribute"`` string.
    """
    if not callable(reader) and not (isinstance(reader, str) and ":" in reader):
        raise TypeError(f"register_bundle_reader({name!r}): expected a callable or 'module:attribute', "
                        f"got {reader!r}")
    _READERS[name] = reader


def unregister_bundle_reader(name: str) -> None:
    """Remove the reader registered under ``name`` (nothing happens when there is none)."""
    _READERS.pop(name, None)


def bundle_readers() -> dict[str, BundleReader | str]:
    """Every bundle reader: the registered ones, then the entry points of :data:`BUNDLE_READER_GROUP` whose
    name is not registered (as ``"module:attribute"``, loaded by :func:`load_reader`)."""
    from importlib import metadata

    found: dict[str, BundleReader | str] = dict(_READERS)
    for point in metadata.entry_points(group=BUNDLE_READER_GROUP):
        found.setdefault(point.name, point.value)
    return found


def load_reader(reader: BundleReader | str) -> BundleReader:
    """The callable of ``reader``, importing ``"module:attribute"``.

    Raises:
        BundleUnavailable: the module cannot be imported or has no such callable.
    """
    if callable(reader):
        return reader
    module_name, _, attribute = reader.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise BundleUnavailable(f"the bundle reader {reader} is not importable ({exc})") from exc
    if not callable(found):
        raise BundleUnavailable(f"the bundle reader {reader} is not callable")
    return cast(BundleReader, found)
