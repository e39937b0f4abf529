"""tensors.txt and tensors.bin: the index, the read-only mapping and its zero-copy views (docs/sam3-bundle.md 6)."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .manifest import _MAX_DIMS, BLOB, INDEX, READ_ALIGN, BundleError, Params, _lines, parse_uint, split_fields

DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "u8": np.dtype("u1"),
    "i32": np.dtype("<i4"),
}
# The names errors use for dtypes (docs/sam3-bundle.md 6).
DTYPE_NAMES = {"f32": "F32", "bf16": "Bf16", "u8": "U8", "i32": "I32"}


@dataclass(frozen=True)
class TensorInfo:
    """One `tensors.txt` line: name, dtype, shape, byte offset and length in tensors.bin, line number."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    line: int

    @property
    def count(self) -> int:
        """The number of elements the bytes hold."""
        return self.nbytes // DTYPES[self.dtype].itemsize

    @property
    def shaped(self) -> bool:
        """Whether the recorded shape holds exactly `count` elements; if not, views are flat (docs/sam3-bundle.md 6)."""
        return math.prod(self.shape) == self.count

    def shape_warning(self) -> str | None:
        """The summary's warning for a recorded shape that is not the byte count's, or None."""
        if self.shaped:
            return None
        return (f"{INDEX}:{self.line}: tensor {self.name}: shape {','.join(map(str, self.shape))} of {self.dtype} is "
                f"{math.prod(self.shape)} elements, but {self.nbytes} bytes hold {self.count}: read as {self.count} "
                "flat elements")


def parse_index(text: str, blob_size: int) -> dict[str, TensorInfo]:
    """The tensors of a `tensors.txt` text for a blob of `blob_size` bytes (docs/sam3-bundle.md 6).

    A shape whose element count is not the byte count's is kept as written (`TensorInfo.shaped`).

    Raises:
        BundleError: `tensors.txt:<line>: <msg>, in: <line>` for a malformed line, a duplicate, or a tensor past
            the end of tensors.bin.
    """
    out: dict[str, TensorInfo] = {}
    for number, line in enumerate(_lines(text), 1):
        info = _index_line(number, line)
        if info.name in out:
            raise _index_error(number, line, "tensor defined twice")
        if info.offset + info.nbytes > blob_size:
            raise _index_error(number, line, f"tensor {info.name} runs past the end of {BLOB} "
                               f"({info.offset} + {info.nbytes} > {blob_size} bytes)")
        out[info.name] = info
    return out


def _index_error(number: int, line: str, msg: str) -> BundleError:
    return BundleError(f"{INDEX}:{number}: {msg}, in: {line}")


def _index_line(number: int, line: str) -> TensorInfo:
    f = split_fields(line)
    if len(f) != 5:
        raise _index_error(number, line, "expected <name> <dtype> <shape> <offset> <bytes>")
    name, dtype, shape_text, off_text, len_text = f
    if dtype not in DTYPES:
        raise _index_error(number, line, "unknown dtype")
    dims = [parse_uint(s) for s in shape_text.split(",")]
    if any(d is None for d in dims):
        raise _index_error(number, line, "bad shape")
    if len(dims) > _MAX_DIMS:
        raise _index_error(number, line, f"bad shape (more than {_MAX_DIMS} dimensions)")
    offset, nbytes = parse_uint(off_text), parse_uint(len_text)
    if offset is None:
        raise _index_error(number, line, "bad offset")
    if nbytes is None:
        raise _index_error(number, line, "bad byte count")
    if offset % READ_ALIGN:
        raise _index_error(number, line, "offset is not 8-byte aligned")
    size = DTYPES[dtype].itemsize
    if nbytes % size:
        raise _index_error(number, line, "byte count is not a whole number of elements")
    # A shape that is not the byte count's (a logical [K, N] on packed u8 bytes) is kept: the reference never
    # compares the two (docs/sam3-bundle.md 6).
    return TensorInfo(name, dtype, tuple(d for d in dims if d is not None), offset, nbytes, number)


class TensorStore:
    """Every tensor of a bundle over `tensors.bin` mapped read-only: views are zero-copy (docs/sam3-bundle.md 6)."""

    def __init__(self, index: Mapping[str, TensorInfo], data: mmap.mmap | bytes):
        self._index = dict(index)
        self._data: mmap.mmap | bytes | None = data

    @property
    def buffer(self) -> mmap.mmap | bytes:
        """The mapping of tensors.bin (bytes when the file is empty).

        Raises:
            BundleError: the bundle is closed.
        """
        if self._data is None:
            raise BundleError(f"{BLOB}: the bundle is closed")
        return self._data

    def names(self) -> list[str]:
        """Every tensor name, in index order."""
        return list(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self._index.values())

    def has(self, name: str) -> bool:
        """Whether the bundle has tensor `name`."""
        return name in self._index

    def info(self, name: str) -> TensorInfo:
        """The index entry of `name`.

        Raises:
            BundleError: "tensor N missing from the bundle".
        """
        info = self._index.get(name)
        if info is None:
            raise BundleError(f"tensor {name} missing from the bundle")
        return info

    def get(self, name: str, dtype: str | None = None) -> np.ndarray:
        """A read-only view of `name` with its dtype and shape, into the mapping (no copy); flat, of every element
        the bytes hold, when the recorded shape does not match them (docs/sam3-bundle.md 6).

        Raises:
            BundleError: missing, or "tensor N is <Dtype>, wanted <Dtype>" when `dtype` is given and differs.
        """
        info = self.info(name)
        if dtype is not None and info.dtype != dtype:
            raise BundleError(f"tensor {name} is {DTYPE_NAMES[info.dtype]}, wanted {_dtype_name(dtype)}")
        view = np.frombuffer(self.buffer, DTYPES[info.dtype], info.count, info.offset)
        return view.reshape(info.shape) if info.shaped else view

    def raw(self, name: str) -> np.ndarray:
        """The bytes of `name`, of any dtype, as a read-only uint8 view.

        Raises:
            BundleError: missing.
        """
        info = self.info(name)
        return np.frombuffer(self.buffer, np.uint8, info.nbytes, info.offset)

    def expect(self, name: str, dtype: str, count: int) -> np.ndarray:
        """The view of `name`, checked to hold `count` elements of `dtype`.

        Raises:
            BundleError: missing, or "tensor N is <elems> x <Dtype>, wanted <n> x <Dtype>".
        """
        info = self.info(name)
        if info.dtype != dtype or info.count != count:
            raise BundleError(f"tensor {name} is {info.count} x {DTYPE_NAMES[info.dtype]}, "
                              f"wanted {count} x {_dtype_name(dtype)}")
        return self.get(name)

    def close(self) -> None:
        """Drop the mapping; it is unmapped once no view of it is left."""
        self._data = None


def _dtype_name(dtype: str) -> str:
    if dtype not in DTYPE_NAMES:
        raise BundleError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return DTYPE_NAMES[dtype]


def upload_tensors(params: Params) -> Iterator[str]:
    """The tensors uploaded at load as NPU B operands, which must all be present (docs/sam3-bundle.md 5).

    A generator: a huge layer count stops at its first missing tensor instead of building a huge list.
    """
    yield from ("v.embed", "n.in", "n.up", "dec.kv")
    yield from (f"v.{i}.{w}" for i in range(params.vit_layers) for w in ("qkv", "o", "fc1", "fc2"))
    yield from (f"d.{i}.{w}" for i in range(params.d_layers) for w in ("qkv", "o", "fc1", "fc2"))
    yield from ("n.conv0", "n.conv1", "n.conv2", "m.conv0", "m.conv1")
    if params.vit_device:
        yield from ("v.rope_tab.win", "v.rope_tab.glob")
    if params.tracker:
        yield from ("tn.in", "tn.up", "tn.conv0", "tn.conv1", "tn.conv2")


def packed_tensors(params: Params) -> dict[str, str]:
    """Each packed B tensor and the GEMM whose packing it holds (docs/sam3-bundle.md 5), for the summary."""
    out = {"v.embed": "v_embed", "n.in": "n_in", "n.up": "n_up", "dec.kv": "dec_kv", "pack_test.packed": "d_s"}
    for i in range(params.vit_layers):
        out |= {f"v.{i}.qkv": "v_qkv", f"v.{i}.o": "v_o", f"v.{i}.fc1": "v_fc1", f"v.{i}.fc2": "v_fc2"}
    for i in range(params.d_layers):
        out |= {f"d.{i}.qkv": "d_qkv", f"d.{i}.o": "d_o", f"d.{i}.fc1": "d_fc1", f"d.{i}.fc2": "d_fc2"}
    out |= {name: "conv" for name in ("n.conv0", "n.conv1", "n.conv2", "m.conv0", "m.conv1")}
    if params.tracker:
        out |= {"tn.in": "n_in", "tn.up": "n_up"} | {f"tn.conv{i}": "conv" for i in range(3)}
    return out
