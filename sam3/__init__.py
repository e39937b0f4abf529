"""sam3: Segment Anything 3 with its heavy layers on an AMD XDNA NPU, reading the kernel bundles IRON writes.

    from sam3 import Sam3
    with Sam3("bundle/", device="emu") as sam:
        found = sam.segment("cats.jpg", "cat", threshold=0.5)
        found.scores, found.boxes, found.masks          # numpy, in query order

One module per stage: `preprocess`, `tokenizer`, `text`, `vit`, `neck`, `detr`, `decoder`, `mask`, `post`; the
bundle format (`bundle`), the bfp16ebs8 weights (`pack`), the NPU layer (`npu`: kernels on a device, the context
LRU), what each IRON kernel computes for the emulator (`kernels`), generated bundles (`build`), the exporter
from a transformers checkpoint (`export`), the pipeline (`pipeline.Sam3`), `check`, `demo` and the command
line (`cli`).
"""

from __future__ import annotations

import logging as _logging
from typing import Any

from amdxdna_direct import extensions as _extensions

# A library logs; the application decides where it goes (the `sam3` command prints warnings: docs/sam3-cli.md).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# `amdxdna validate --bundle` reads SAM3 bundles through this hook, never by importing sam3 (docs/cli.md).
_extensions.register_bundle_reader("sam3", "sam3.validate_hook:bundle_kernels")

__all__ = ["Sam3"]


def __getattr__(name: str) -> Any:
    # The pipeline imports Pillow and the stage modules: only when it is asked for.
    if name == "Sam3":
        from sam3.pipeline import Sam3

        return Sam3
    raise AttributeError(f"module 'sam3' has no attribute {name!r}")
