"""The bundle reader sam3 registers for ``amdxdna validate --bundle DIR`` (``amdxdna_direct.extensions``).

``sam3`` registers it when imported, and the distribution declares it in the ``amdxdna_direct.bundle_readers``
entry point group, so the runtime reaches a SAM3 bundle without importing sam3 by name (docs/cli.md
"Extensions").
"""

from __future__ import annotations

from typing import Any

from amdxdna_direct.extensions import BundleKernel, BundleUnavailable

__all__ = ["bundle_kernels"]


def bundle_kernels(directory: str) -> list[BundleKernel]:
    """Every kernel of the SAM3 bundle in ``directory``, in ``kernel_keys()`` order, each with the emulator
    model of what its manifest record says it computes (``sam3.kernels.model_for``).

    Raises:
        BundleUnavailable: the bundle modules are not importable, or the bundle cannot be opened.
    """
    try:
        from sam3 import kernels
        from sam3.bundle import Bundle
    except ImportError as exc:
        raise BundleUnavailable(f"the sam3 package is not importable ({exc})") from exc
    try:
        with Bundle.open(directory) as bundle:
            return [_kernel(bundle, key, kernels.model_for) for key in bundle.kernel_keys()]
    except (OSError, ValueError, KeyError) as exc:
        raise BundleUnavailable(f"the bundle cannot be opened: {exc}") from exc


def _kernel(bundle: Any, key: str, model_for: Any) -> BundleKernel:
    k = bundle.kernel(key)
    return BundleKernel(key, k.xclbin, k.insts, k.name, model_for(bundle, key, bundle.insts_bytes(key)))
