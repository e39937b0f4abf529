"""The SAM3 kernel bundle IRON's exporter writes: reader, writer and summary (docs/sam3-bundle.md).

A bundle is a directory: `manifest.txt` (one record a line), `tensors.txt` + `tensors.bin` (an index and
one blob holding every tensor), `kernels/` (xclbins and instruction streams), `vocab.json`, `merges.txt`
and test images. `Bundle.open` parses and checks all of it (docs/sam3-bundle.md 7) and maps `tensors.bin`
read-only, so a tensor is a zero-copy numpy view; `BundleWriter` writes the same format; `summarize` turns
an open bundle into a JSON-ready description plus a list of problems found.

The modules: `manifest` (the text grammar, records, params), `tensors` (the index and the mapping),
`reader` (`Bundle`), `writer` (`BundleWriter`), `summary` (`summarize`, `format_summary`), `hub` (a bundle
named `owner/name[@revision]` in the Hugging Face cache, and its download). Every public name of the first
five is importable from `sam3.bundle` itself; `hub` is used as a module (`from sam3.bundle import hub`).

Every file is opened relative to the bundle directory's file descriptor, its directories without following
symbolic links; a link in a file's last component is followed to a regular file wherever it points (a hub
snapshot's files link into the cache's blobs), and a file replaced after the bundle was opened is refused
(docs/sam3-bundle.md 8). Every error is a `BundleError` naming the file, line and record.
"""

from .manifest import (
    BLOB,
    DEFAULT_KERNEL_NAME,
    F32_PARAMS,
    FILE_LIMIT,
    FLAG_PARAMS,
    GEMM_KEYS,
    INDEX,
    LIST_PARAMS,
    MANIFEST,
    MERGES,
    MHA_KEYS,
    OP_KEYS,
    READ_ALIGN,
    TEXT_LIMIT,
    TRACKER_F32_PARAMS,
    TRACKER_LIST_PARAMS,
    TRACKER_USIZE_PARAMS,
    USIZE_PARAMS,
    VERSION,
    VERSIONS,
    VOCAB,
    WRITE_ALIGN,
    BundleError,
    Case,
    GemmSpec,
    KernelSource,
    MhaSpec,
    OpSpec,
    Params,
    Record,
    TokTest,
    XclbinRecord,
    escape,
    parse_f32,
    parse_uint,
    split_fields,
    unescape,
)
from .reader import Bundle, parse_merges, parse_vocab
from .summary import format_summary, summarize
from .tensors import DTYPE_NAMES, DTYPES, TensorInfo, TensorStore, packed_tensors, parse_index, upload_tensors
from .writer import BundleWriter

__all__ = [
    "BLOB", "Bundle", "BundleError", "BundleWriter", "Case", "DEFAULT_KERNEL_NAME", "DTYPES", "DTYPE_NAMES",
    "F32_PARAMS", "FILE_LIMIT", "FLAG_PARAMS", "GEMM_KEYS", "GemmSpec", "INDEX", "KernelSource", "LIST_PARAMS",
    "MANIFEST", "MERGES", "MHA_KEYS", "MhaSpec", "OP_KEYS", "OpSpec", "Params", "READ_ALIGN", "Record", "TEXT_LIMIT",
    "TRACKER_F32_PARAMS", "TRACKER_LIST_PARAMS", "TRACKER_USIZE_PARAMS", "TensorInfo", "TensorStore", "TokTest",
    "USIZE_PARAMS", "VERSION", "VERSIONS", "VOCAB", "WRITE_ALIGN", "XclbinRecord", "escape", "format_summary",
    "packed_tensors", "parse_f32", "parse_index", "parse_merges", "parse_uint", "parse_vocab", "split_fields",
    "summarize", "unescape", "upload_tensors",
]
