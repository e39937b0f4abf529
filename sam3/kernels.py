"""Emulator models of the IRON kernels a SAM3 bundle runs, and the instruction streams generated bundles carry.

The emulated firmware cannot know what a TXN stream computes: a model is bound to the sha256 of the
stream and called with uint8 views of the buffers the stream's DDR_PATCH ops resolve (docs/design.md 2).
This module provides both halves for the bundle format of docs/sam3-bundle.md:

- the streams a generated bundle carries (`gemm_stream`, `mha_stream`, `op_stream`): valid TXN streams
  whose buffer descriptors give each argument its extent, with the GEMM's per-core run-time parameters in
  the word layout the epilogue patch reads (docs/sam3-kernels.md 2);
- numpy models of what each kernel computes (`FlmGemm`, `IronMha`, `Rope`, `AddLn`; docs/sam3-kernels.md 3-6);
- `bind_bundle` / `bind_stream`, which bind every kernel key of a bundle to its model.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import ml_dtypes
import numpy as np

from amdxdna_direct import insts
from amdxdna_direct.emu.memory import DeviceFault
from amdxdna_direct.emu.models import gelu_tanh, stream_digest
from amdxdna_direct.errors import Error

from . import pack

if TYPE_CHECKING:
    from amdxdna_direct.emu.models import ModelRegistry

    from .bundle import Bundle

__all__ = [
    "B_CACHE_BYTES", "CORES", "EPILOGUE_GELU_TANH", "EPILOGUE_MODES", "EPILOGUE_NONE", "EPILOGUE_RELU", "AddLn",
    "BCache", "FlmGemm", "GemmGeometry", "IronMha", "Rope", "StreamError", "apply_epilogue", "bind_bundle",
    "bind_stream", "epilogue_mode", "gemm_stream", "mha_stream", "model_for", "op_stream", "rope_table",
    "split_rope_table", "stream_extents",
]

BF16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)  # ml_dtypes' scalar types carry no static type
_BF16_BYTES = 2
_F32_BYTES = 4

# Epilogue modes of the GEMM's run-time parameters (docs/sam3-kernels.md 3.2). 5 is the known tanh GELU;
# the ReLU number is this project's choice: the real value is not known.
EPILOGUE_NONE = 0
EPILOGUE_RELU = 1
EPILOGUE_GELU_TANH = 5
EPILOGUE_MODES = {EPILOGUE_NONE: "none", EPILOGUE_RELU: "relu", EPILOGUE_GELU_TANH: "gelu_tanh"}

# Per-core run-time parameter blocks (docs/sam3-kernels.md 2.2): 32 cores (8 columns x 4 core rows), each
# written by four 6-word WRITE32 ops [n_work, n_drain, mode, ready] at RTP offsets 0x400, +4, +8, +0xC.
CORES = 32
CORE_ROWS = 4
HEADER_WORDS = 4
CORE_BLOCK_WORDS = 24
RTP_OFFSET = 0x400
_MODE_ADDR_WORD = 18            # word index of the mode op's address, + 24 per core
_MODE_VALUE_WORD = 20           # the mode value
_MODE_SIZE_WORD = 21            # the mode op's size field (24 bytes = 0x18)
_MODE_ADDR_LOW = RTP_OFFSET + 8
_LOW12 = 0xFFF
_WRITE32_BYTES = 24
# The key tag: a BLOCKWRITE to core tile (0, 2) data memory at this offset, past the RTP words
# (docs/sam3-kernels.md 2.3).
TAG_OFFSET = 0x600
_TAG_MAX_BYTES = 256

# Score matrix budget of IronMha, in float32 elements per query block (64 MiB).
_SCORE_ELEMS = 1 << 24
# Decoded-B cache budget shared by every FlmGemm (docs/sam3-kernels.md 3.3).
B_CACHE_BYTES = 2 << 30


class StreamError(Error, ValueError):
    """An instruction stream without the words a reader needs (names the word index and values)."""


# ---------------------------------------------------------------------------------------------------- streams


class GemmGeometry(Protocol):
    """What gemm_stream reads of a GEMM (the bundle's GemmSpec and the builder's shapes have these)."""

    @property
    def m(self) -> int: ...
    @property
    def k(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def lda(self) -> int: ...
    @property
    def b_bytes(self) -> int: ...


def gemm_stream(dev_gen: int, spec: GemmGeometry, mode: int, cores: int = CORES, *, key: str) -> bytes:
    """The TXN stream of a GEMM key: per-core RTP blocks, the key tag, then the DMA of A, B and C.

    Arguments 0 = A (((m-1)*lda + k) bf16), 1 = B (`spec.b_bytes`), 2 = C (m*n bf16); the RTP words of core i
    are [n_work, n_drain, mode] at the word positions of docs/sam3-kernels.md 2.2.

    Args:
        dev_gen: TXN device generation (3 = NPU1, 4 = NPU4/5/6).
        spec: the GEMM's m, k, n, lda (A row stride in elements) and b_bytes (packed B length).
        mode: epilogue mode (EPILOGUE_MODES).
        cores: number of per-core blocks, 1..32.
        key: the kernel key, written as the tag that keeps equal-shaped kernels' streams distinct.

    Raises:
        ValueError: a non-positive size, an extent that is not a whole number of 32-bit words, an unknown
            mode, cores out of range, a bad key or dev_gen.
    """
    m, k, n, lda, b_bytes = spec.m, spec.k, spec.n, spec.lda, spec.b_bytes
    _positive(m=m, k=k, n=n, lda=lda, b_bytes=b_bytes)
    if mode not in EPILOGUE_MODES:
        raise ValueError(f"gemm_stream {key!r}: epilogue mode {mode!r} unknown ({_mode_list()})")
    if isinstance(cores, bool) or not isinstance(cores, int) or not 1 <= cores <= CORES:
        raise ValueError(f"gemm_stream {key!r}: cores {cores!r} out of range 1..{CORES}")
    extents = [((m - 1) * lda + k) * _BF16_BYTES, b_bytes, m * n * _BF16_BYTES]
    ops = [op for core in range(cores) for op in _core_block(core, cores, m, n, mode)]
    return _stream(dev_gen, key, ["A", "B", "C"], extents, ["in", "in", "out"], ops, -(-cores // CORE_ROWS))


def mha_stream(dev_gen: int, elems: int, extents: Sequence[int] | None = None, *, key: str) -> bytes:
    """The TXN stream of an MHA key: the key tag, then the DMA of q, k, v (in) and o (out).

    Each argument's extent is `elems` bf16, or the byte counts of `extents` (the strided device form reads
    larger buffers: rope_out, rope_out, v_qkv's C, v_o's A; docs/sam3-kernels.md 4.3).

    Raises:
        ValueError: a non-positive elems, not four extents, an extent that is not a positive multiple of 4
            bytes, a bad key or dev_gen.
    """
    _positive(elems=elems)
    sizes = [elems * _BF16_BYTES] * 4 if extents is None else list(extents)
    if len(sizes) != 4:
        raise ValueError(f"mha_stream {key!r}: needs 4 extents (q, k, v, o), got {len(sizes)}")
    return _stream(dev_gen, key, ["q", "k", "v", "o"], sizes, ["in", "in", "in", "out"], [], 1)


def op_stream(dev_gen: int, extents: Sequence[int], *, key: str) -> bytes:
    """The TXN stream of an op key: the key tag, then the DMA of its arguments, in order.

    rope has 3 arguments (the last is written), addln 4 (the last two are written); any other count writes
    the last argument only (docs/sam3-kernels.md 2.4).

    Raises:
        ValueError: no extents or more than 16, an extent that is not a positive multiple of 4 bytes, a bad
            key or dev_gen.
    """
    sizes = list(extents)
    if not 1 <= len(sizes) <= insts.SHIM_BD_COUNT:
        raise ValueError(f"op_stream {key!r}: {len(sizes)} extents, need 1..{insts.SHIM_BD_COUNT}")
    outputs = 2 if len(sizes) == 4 else 1
    directions = ["in"] * (len(sizes) - outputs) + ["out"] * outputs
    return _stream(dev_gen, key, [f"arg {i}" for i in range(len(sizes))], sizes, directions, [], 1)


def _core_block(core: int, cores: int, m: int, n: int, mode: int) -> list[insts.Op]:
    """Core `core`'s four RTP writes: its share of the M rows, the N columns each row drains, mode, ready."""
    base, extra = divmod(m, cores)
    tile = (core // CORE_ROWS) << insts.COL_SHIFT | (insts.CORE_ROW + core % CORE_ROWS) << insts.ROW_SHIFT
    values = (base + (core < extra), n, mode, 1)
    return [insts.Write32(addr=tile | (RTP_OFFSET + 4 * i), value=v) for i, v in enumerate(values)]


def _tag_op(key: str) -> insts.BlockWrite:
    if not isinstance(key, str) or not key:
        raise ValueError(f"stream key must be a non-empty str, got {key!r}")
    raw = key.encode()
    if len(raw) > _TAG_MAX_BYTES:
        raise ValueError(f"stream key {key!r} is longer than {_TAG_MAX_BYTES} bytes")
    padded = raw + b"\0" * (-len(raw) % 4)
    words = (len(raw),) + struct.unpack(f"<{len(padded) // 4}I", padded)
    return insts.BlockWrite(addr=insts.CORE_ROW << insts.ROW_SHIFT | TAG_OFFSET, words=words)


def _stream(dev_gen: int, key: str, names: list[str], extents: list[int], directions: list[str],
            head: list[insts.Op], cols: int) -> bytes:
    """Encode `head` ops, the key tag and the DMA of the arguments (docs/sam3-kernels.md 2.1)."""
    tag = _tag_op(key)
    for name, nbytes in zip(names, extents, strict=True):
        if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % 4:
            raise ValueError(f"stream {key!r}: {name} extent of {nbytes!r} bytes is not a positive multiple of 4 "
                             "(the shim DMA moves 32-bit words)")
    buffers = [(i, nbytes, d) for i, (nbytes, d) in enumerate(zip(extents, directions, strict=True))]
    dma = insts.dma_stream(dev_gen, buffers)
    stream = insts.Stream(major=dma.major, minor=dma.minor, dev_gen=dma.dev_gen, rows=dma.rows,
                          cols=max(cols, dma.cols), mem_tile_rows=dma.mem_tile_rows, ops=(*head, tag, *dma.ops))
    return insts.encode(stream)


def _words(stream: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(stream, np.ndarray):
        if stream.dtype != np.uint32:
            raise TypeError(f"stream array must be uint32 words, got {stream.dtype}")
        return stream.reshape(-1)
    raw = bytes(stream)
    if len(raw) % 4:
        raise StreamError(f"stream of {len(raw)} bytes is not a whole number of 32-bit words")
    return np.frombuffer(raw, dtype="<u4")


def epilogue_mode(stream: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The GEMM epilogue mode written in a stream's per-core RTP blocks (docs/sam3-kernels.md 2.2).

    Core i's block matches when word 18 + 24i has low 12 bits 0x408 and word 21 + 24i is 0x18; the mode is
    word 20 + 24i. The leading matching blocks are the cores; all must carry the same mode.

    Raises:
        StreamError: no matching block, or cores that disagree (names each core's mode).
        TypeError: an array that is not uint32.
    """
    words = _words(stream)
    modes: list[int] = []
    while (at := CORE_BLOCK_WORDS * len(modes)) + _MODE_SIZE_WORD < len(words):
        if (words[at + _MODE_ADDR_WORD] & _LOW12) != _MODE_ADDR_LOW or words[at + _MODE_SIZE_WORD] != _WRITE32_BYTES:
            break
        modes.append(int(words[at + _MODE_VALUE_WORD]))
    if not modes:
        raise StreamError(f"no per-core RTP block: word {_MODE_ADDR_WORD} is "
                          f"{_word_text(words, _MODE_ADDR_WORD)} and word {_MODE_SIZE_WORD} is "
                          f"{_word_text(words, _MODE_SIZE_WORD)} (need low bits 0x408 and 0x18)")
    if len(set(modes)) != 1:
        raise StreamError(f"the {len(modes)} cores disagree on the epilogue mode: {modes}")
    return modes[0]


def _word_text(words: np.ndarray, index: int) -> str:
    return f"0x{int(words[index]):08x}" if index < len(words) else "past the end"


def stream_extents(stream: bytes | bytearray | memoryview) -> dict[int, int]:
    """arg_idx -> bytes each argument's buffer must hold for the stream's DMA: ``amdxdna_direct.insts.buffer_reach``
    (from every word of the shim BDs the DDR_PATCH ops point at; docs/runtime.md 1.4).

    Raises:
        amdxdna_direct.insts.InstsError: a malformed stream.
    """
    return insts.buffer_reach(stream)


# ---------------------------------------------------------------------------------------------------- helpers


def _positive(**values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _mode_list() -> str:
    return ", ".join(f"{k} {v}" for k, v in EPILOGUE_MODES.items())


def _arg(args: dict[int, np.ndarray], idx: int, nbytes: int, what: str, model: str) -> np.ndarray:
    """The first `nbytes` of argument `idx`, or DeviceFault naming the argument, its need and what it got."""
    view = args.get(idx)
    if view is None:
        raise DeviceFault(f"{model}: {what} (arg {idx}) is not patched into the stream (args {sorted(args)})")
    if view.nbytes < nbytes:
        raise DeviceFault(f"{model}: {what} (arg {idx}) needs {nbytes} bytes, got {view.nbytes}")
    return view[:nbytes]


def _bf16(view: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return view.view(BF16).reshape(shape)


def _relu(x: np.ndarray) -> np.ndarray:
    np.maximum(x, np.float32(0.0), out=x)
    return x


_ACTIVATIONS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    EPILOGUE_NONE: lambda x: x, EPILOGUE_RELU: _relu, EPILOGUE_GELU_TANH: gelu_tanh,
}


def apply_epilogue(x: np.ndarray, mode: int) -> np.ndarray:
    """The GEMM epilogue activation of `mode` over `x`, as a new float32 array (docs/sam3-kernels.md 3.2).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in EPILOGUE_MODES:
        raise ValueError(f"epilogue mode {mode!r} unknown ({_mode_list()})")
    return _ACTIVATIONS[mode](np.array(x, dtype=np.float32))


# ---------------------------------------------------------------------------------------------------- GEMM


_ModelCall = TypeVar("_ModelCall", bound=Callable[..., None])


def _silent_arithmetic(call: _ModelCall) -> _ModelCall:
    """A model computes like the device: values that overflow to inf or NaN are its result, not a warning (the
    buffers a caller hands over may hold any bits: `amdxdna validate` runs a pattern through every kernel)."""
    @functools.wraps(call)
    def quiet(self: Any, args: dict[int, np.ndarray]) -> None:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            call(self, args)
    return cast(_ModelCall, quiet)


class BCache:
    """Decoded B operands by buffer identity and content, least recently used first out, within a byte budget.

    Keyed on (address, length, crc32 of the bytes, geometry): a rewritten buffer has a new checksum and is
    decoded again (docs/sam3-kernels.md 3.3). Thread-safe: emulated contexts run models concurrently.
    """

    def __init__(self, budget: int = B_CACHE_BYTES):
        """A cache of at most `budget` bytes of decoded operands.

        Raises:
            ValueError: a negative budget.
        """
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(f"BCache budget must be a non-negative int, got {budget!r}")
        self.budget = budget
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[Any, ...], tuple[np.ndarray, np.ndarray | None]] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[Any, ...], decode: Callable[[], tuple[np.ndarray, np.ndarray | None]]
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """The entry of `key`, decoding (outside the lock) and inserting it when absent."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        value = decode()
        size = value[0].nbytes + (0 if value[1] is None else value[1].nbytes)
        with self._lock:
            if key not in self._entries and size <= self.budget:
                while self._bytes + size > self.budget:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old[0].nbytes + (0 if old[1] is None else old[1].nbytes)
                self._entries[key] = value
                self._bytes += size
        return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        with self._lock:
            return self._bytes


_B_CACHE = BCache()


class FlmGemm:
    """IRON's flm.GEMM: C[m, n] = bf16(act(A x B + bias)); args 0 = A, 1 = packed B, 2 = C.

    A is bf16 with rows `lda` elements apart (lda < k: the overlapping rows of the 3x3 convolution), B the
    bfp16ebs8 bytes of docs/sam3-packing.md with the bias chunk when `bias`, f32 accumulation, the epilogue
    activation of `mode`, C rounded to bf16 to nearest even (docs/sam3-kernels.md 3).
    """

    def __init__(self, m: int, k: int, n: int, lda: int, tile_k: int, tile_n: int, ct_k: int, bias: bool,
                 mode: int, *, cache: BCache | None = None):
        """A GEMM of the compiled geometry; `cache` defaults to the module's shared decoded-B cache.

        Raises:
            ValueError: a non-positive size or an unknown mode.
            sam3.pack.PackError: tiles that break the packing preconditions (docs/sam3-packing.md 3.1).
        """
        _positive(m=m, k=k, n=n, lda=lda, tile_k=tile_k, tile_n=tile_n, ct_k=ct_k)
        pack.check_tiles(k, n, tile_k, tile_n, ct_k)
        if mode not in EPILOGUE_MODES:
            raise ValueError(f"FlmGemm: epilogue mode {mode!r} unknown ({_mode_list()})")
        self.m, self.k, self.n, self.lda = m, k, n, lda
        self.tile_k, self.tile_n, self.ct_k, self.bias, self.mode = tile_k, tile_n, ct_k, bool(bias), mode
        self.cache = _B_CACHE if cache is None else cache
        self.decodes = 0
        self._lock = threading.Lock()
        self.name = f"flm.GEMM {m}x{k}x{n} lda={lda} {EPILOGUE_MODES[mode]}"
        self.compute_only = True        # small dispatches may run on the firmware worker (docs/emulator.md)

    @property
    def a_bytes(self) -> int:
        """Bytes of A read: ((m-1)*lda + k) bf16."""
        return ((self.m - 1) * self.lda + self.k) * _BF16_BYTES

    @property
    def b_bytes(self) -> int:
        """Bytes of packed B read: 9*n*(k + ct_k*bias)/8."""
        return pack.packed_size(self.k, self.n, self.ct_k, self.bias)

    @property
    def c_bytes(self) -> int:
        """Bytes of C written: m*n bf16."""
        return self.m * self.n * _BF16_BYTES

    @_silent_arithmetic
    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Compute C in place.

        Raises:
            DeviceFault: A, B or C not patched or shorter than the kernel reads or writes, or a B whose bias
                chunk padding is not zero (another tiling's bytes).
        """
        a_raw = _arg(args, 0, self.a_bytes, "A", self.name).view(BF16)
        b_raw = _arg(args, 1, self.b_bytes, "B", self.name)
        c = _bf16(_arg(args, 2, self.c_bytes, "C", self.name), (self.m, self.n))
        a = np.lib.stride_tricks.as_strided(a_raw, shape=(self.m, self.k), strides=(self.lda * _BF16_BYTES,
                                            _BF16_BYTES), writeable=False)
        b, bias = self.weights(b_raw)
        acc = a.astype(np.float32) @ b
        if bias is not None:
            acc += bias
        c[...] = _ACTIVATIONS[self.mode](acc)

    def weights(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(B f32 [k, n], bias f32 [n] or None) of a packed buffer view, decoded once per buffer content."""
        key = (packed.ctypes.data, packed.nbytes, zlib.crc32(packed.data), self.k, self.n, self.tile_k, self.tile_n,
               self.ct_k, self.bias)
        return self.cache.get(key, lambda: self._decode(packed))

    def _decode(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        with self._lock:
            self.decodes += 1
        try:
            b, bias = pack.unpack_b(packed, self.k, self.n, self.tile_k, self.tile_n, self.ct_k, self.bias)
        except pack.PackError as exc:
            raise DeviceFault(f"{self.name}: B (arg 1) does not decode: {exc}") from exc
        return np.ascontiguousarray(b, dtype=np.float32), None if bias is None else bias.astype(np.float32)

    def __repr__(self) -> str:
        return (f"FlmGemm(m={self.m}, k={self.k}, n={self.n}, lda={self.lda}, tile_k={self.tile_k}, "
                f"tile_n={self.tile_n}, ct_k={self.ct_k}, bias={self.bias}, mode={self.mode})")


# ---------------------------------------------------------------------------------------------------- MHA

MHA_FORMS = ("packed", "strided")


class IronMha:
    """Non-causal attention o = softmax(q k^T / sqrt(d)) v, f32 math, bf16 in and out; args 0..3 = q, k, v, o.

    Form "packed": each buffer is [heads, seq, d], or [seq, heads*d] when `token_major` (the windowed host
    form [windows*heads, window^2, d] is the first with heads = windows*heads). Form "strided" is the device
    ViT launch [rope_out, rope_out, v_qkv C, v_o A] over T = heads*seq/(dim/d) tokens of width `dim`: q at
    column 0 and k at column dim of rope_out (row stride 2*dim), v at column 2*dim of the qkv output (row
    stride 3*dim), o token-major (row stride dim); tokens in window order, each window seq tokens
    (docs/sam3-kernels.md 4).
    """

    def __init__(self, heads: int, seq: int, d: int, token_major: bool = False, form: str = "packed",
                 dim: int | None = None):
        """Attention over `heads` groups of `seq` positions of width `d`; "strided" needs the model width `dim`.

        Raises:
            ValueError: a non-positive size, an unknown form, or a `dim` that is not a multiple of d whose
                head count divides heads.
        """
        _positive(heads=heads, seq=seq, d=d)
        if form not in MHA_FORMS:
            raise ValueError(f"IronMha: form {form!r} unknown ({', '.join(MHA_FORMS)})")
        if form == "strided":
            if dim is None:
                raise ValueError("IronMha strided: dim (the model width) must be a positive int, got None")
            _positive(dim=dim)
            if dim % d or heads % (dim // d):
                raise ValueError(f"IronMha strided: dim={dim} must be a multiple of d={d} whose head count "
                                 f"{dim // d if dim % d == 0 else '?'} divides heads={heads}")
        elif dim is not None:
            raise ValueError(f"IronMha: dim is for the strided form only, got dim={dim} with form {form!r}")
        self.heads, self.seq, self.d, self.token_major, self.form, self.dim = heads, seq, d, bool(token_major), \
            form, dim
        layout = "strided" if form == "strided" else "token-major" if token_major else "[heads, seq, d]"
        self.name = f"mha heads={heads} seq={seq} d={d} {layout}"
        self.compute_only = True        # small dispatches may run on the firmware worker (docs/emulator.md)

    @property
    def tokens(self) -> int:
        """Tokens of the strided form: windows * seq."""
        return self.heads * self.seq // (self._width() // self.d) if self.form == "strided" else self.seq

    def _width(self) -> int:
        """`dim`, which the strided form needs (checked at construction; refused if set to None since)."""
        if self.dim is None:
            raise ValueError(f"{self.name}: the strided form needs dim, the model width, and it is None")
        return self.dim

    def needs(self) -> list[int]:
        """Bytes each of q, k, v, o must hold."""
        if self.form == "packed":
            return [self.heads * self.seq * self.d * _BF16_BYTES] * 4
        t, dim = self.tokens, self._width()
        return [t * 2 * dim * _BF16_BYTES] * 2 + [t * 3 * dim * _BF16_BYTES, t * dim * _BF16_BYTES]

    @_silent_arithmetic
    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Compute o in place.

        Raises:
            DeviceFault: a buffer not patched or shorter than the layout needs.
        """
        needs = zip(self.needs(), "qkvo", strict=True)
        views = [_arg(args, i, size, what, self.name) for i, (size, what) in enumerate(needs)]
        q, k, v = (self._groups(view, which) for which, view in zip("qkv", views[:3], strict=True))
        self._scatter(views[3], _attention(q, k, v))

    def _groups(self, view: np.ndarray, which: str) -> np.ndarray:
        """[groups, seq, d] f32 of an input view."""
        h, s, d = self.heads, self.seq, self.d
        if self.form == "packed":
            if self.token_major:
                return _bf16(view, (s, h, d)).transpose(1, 0, 2).astype(np.float32)
            return _bf16(view, (h, s, d)).astype(np.float32)
        dim, t = self._width(), self.tokens
        if which == "v":
            cols = _bf16(view, (t, 3 * dim))[:, 2 * dim:]
        else:
            cols = _bf16(view, (t, 2 * dim))[:, (which == "k") * dim:][:, :dim]
        hh = dim // d
        return cols.reshape(t // s, s, hh, d).transpose(0, 2, 1, 3).reshape(h, s, d).astype(np.float32)

    def _scatter(self, view: np.ndarray, o: np.ndarray) -> None:
        h, s, d = self.heads, self.seq, self.d
        if self.form == "packed":
            if self.token_major:
                _bf16(view, (s, h, d))[...] = o.transpose(1, 0, 2)
            else:
                _bf16(view, (h, s, d))[...] = o
            return
        hh = self._width() // d
        out = _bf16(view, (self.tokens // s, s, hh, d))
        out[...] = o.reshape(self.tokens // s, hh, s, d).transpose(0, 2, 1, 3)

    def __repr__(self) -> str:
        return (f"IronMha(heads={self.heads}, seq={self.seq}, d={self.d}, token_major={self.token_major}, "
                f"form={self.form!r}, dim={self.dim})")


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v over [groups, seq, d], in query blocks that bound the score matrix."""
    groups, seq, d = q.shape
    scale = np.float32(1.0 / math.sqrt(d))
    kt = k.transpose(0, 2, 1)
    out = np.empty_like(q)
    block = max(1, min(seq, _SCORE_ELEMS // (groups * seq)))
    for start in range(0, seq, block):
        scores = q[:, start:start + block] @ kt
        scores *= scale
        scores -= scores.max(axis=2, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=2, keepdims=True)
        np.matmul(scores, v, out=out[:, start:start + block])
    return out


# ---------------------------------------------------------------------------------------------------- ops


def rope_table(cos: np.ndarray, sin: np.ndarray) -> bytes:
    """The rope op's table bytes: little-endian f32 cos [T, half], then sin [T, half] (docs/sam3-kernels.md 5).

    Raises:
        ValueError: cos and sin of different sizes, or empty.
    """
    c, s = np.asarray(cos, dtype="<f4"), np.asarray(sin, dtype="<f4")
    if c.size != s.size or c.size == 0:
        raise ValueError(f"rope_table: cos has {c.size} values and sin {s.size}; need equal, non-zero sizes")
    return c.tobytes() + s.tobytes()


def split_rope_table(table: bytes | np.ndarray, tokens: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of rope_table: (cos f32 [tokens, half], sin f32 [tokens, half]) viewing `table`.

    Raises:
        ValueError: a table whose size is not tokens*half*8 bytes, or non-positive sizes.
    """
    _positive(tokens=tokens, half=half)
    raw = np.frombuffer(table, dtype=np.uint8) if not isinstance(table, np.ndarray) else table.view(np.uint8)
    need = 2 * tokens * half * _F32_BYTES
    if raw.nbytes != need:
        raise ValueError(f"rope table of {raw.nbytes} bytes, {tokens} tokens x half {half} need {need}")
    values = raw.reshape(-1).view("<f4").reshape(2, tokens, half)
    return values[0], values[1]


class Rope:
    """The device ViT's rope op: args [v_qkv C (rows x 3*dim bf16), table, rope_out (tokens x 2*dim bf16)].

    Rotates q (columns 0..dim) and k (dim..2*dim) of each of the first `tokens` rows per head of width
    d = dim/heads, half = d/2: out_j = x1 cos - x2 sin, out_{j+half} = x2 cos + x1 sin with x1 = dim j and
    x2 = dim j+half of the head, cos and sin per token from the table (docs/sam3-kernels.md 5).
    """

    def __init__(self, tokens: int, dim: int, heads: int):
        """The op over `tokens` rows of a `dim`-wide model with `heads` heads.

        Raises:
            ValueError: non-positive sizes, or a head width dim/heads that is not a positive even integer.
        """
        _positive(tokens=tokens, dim=dim, heads=heads)
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"Rope: dim={dim} / heads={heads} must be an even integer head width")
        self.tokens, self.dim, self.heads = tokens, dim, heads
        self.half = dim // heads // 2
        self.name = f"rope tokens={tokens} dim={dim} heads={heads}"
        self.compute_only = True        # small dispatches may run on the firmware worker (docs/emulator.md)

    @_silent_arithmetic
    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Write rope_out.

        Raises:
            DeviceFault: an argument not patched or shorter than the op reads or writes.
        """
        t, dim, half = self.tokens, self.dim, self.half
        qkv = _bf16(_arg(args, 0, t * 3 * dim * _BF16_BYTES, "v_qkv C", self.name), (t, 3 * dim))
        cos, sin = split_rope_table(_arg(args, 1, 2 * t * half * _F32_BYTES, "table", self.name), t, half)
        out = _bf16(_arg(args, 2, t * 2 * dim * _BF16_BYTES, "rope_out", self.name), (t, 2 * self.heads, 2, half))
        x = qkv[:, :2 * dim].astype(np.float32).reshape(t, 2 * self.heads, 2, half)
        x1, x2 = x[:, :, 0], x[:, :, 1]
        c, s = cos[:, None, :], sin[:, None, :]
        out[:, :, 0] = x1 * c - x2 * s
        out[:, :, 1] = x2 * c + x1 * s

    def __repr__(self) -> str:
        return f"Rope(tokens={self.tokens}, dim={self.dim}, heads={self.heads})"


class AddLn:
    """The device ViT's addln op: args [residual in, C (rows x dim bf16), residual out, LN out (bf16)].

    residual_out = residual_in + C over the first `tokens` rows, kept f32 when `residual_f32` else rounded
    to bf16; LN_out = (r - mean) / sqrt(biased variance + eps) of the stored residual, no affine, bf16
    (docs/sam3-kernels.md 6).
    """

    def __init__(self, tokens: int, dim: int, eps: float, residual_f32: bool):
        """The op over `tokens` rows of width `dim`.

        Raises:
            ValueError: non-positive sizes or a negative or non-finite eps.
        """
        _positive(tokens=tokens, dim=dim)
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"AddLn: eps must be finite and >= 0, got {eps!r}")
        self.tokens, self.dim, self.eps, self.residual_f32 = tokens, dim, float(eps), bool(residual_f32)
        self.name = f"addln tokens={tokens} dim={dim} {'f32' if residual_f32 else 'bf16'} residual"
        self.compute_only = True        # small dispatches may run on the firmware worker (docs/emulator.md)

    @_silent_arithmetic
    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Write the residual out and LN out.

        Raises:
            DeviceFault: an argument not patched or shorter than the op reads or writes.
        """
        shape, elems = (self.tokens, self.dim), self.tokens * self.dim
        dtype = np.dtype("<f4") if self.residual_f32 else BF16
        res_in = _arg(args, 0, elems * dtype.itemsize, "residual in", self.name).view(dtype).reshape(shape)
        c = _bf16(_arg(args, 1, elems * _BF16_BYTES, "C", self.name), shape)
        res_out = _arg(args, 2, elems * dtype.itemsize, "residual out", self.name).view(dtype).reshape(shape)
        ln = _bf16(_arg(args, 3, elems * _BF16_BYTES, "LN out", self.name), shape)
        r = res_in.astype(np.float32)
        r += c
        res_out[...] = r
        x = res_out.astype(np.float32) if not self.residual_f32 else r
        x -= x.mean(axis=1, keepdims=True)
        var = np.square(x).mean(axis=1, keepdims=True)
        x /= np.sqrt(var + np.float32(self.eps))
        ln[...] = x

    def __repr__(self) -> str:
        return f"AddLn(tokens={self.tokens}, dim={self.dim}, eps={self.eps!r}, residual_f32={self.residual_f32})"


# ---------------------------------------------------------------------------------------------------- binding

_DEVICE_MHAS = ("mha_win", "mha_glob")


def model_for(bundle: Bundle, key: str, stream: bytes) -> FlmGemm | IronMha | Rope | AddLn:
    """The model of kernel `key` of `bundle`, read from its manifest record, params and (GEMMs) `stream`.

    Raises:
        ValueError: a key that is no gemm, mha or op of the bundle, an op with no model, a GEMM stream
            without RTP words (StreamError), or manifest values a model refuses; each names the key.
    """
    try:
        return _model_for(bundle, key, stream)
    except StreamError as exc:
        raise StreamError(f"kernel {key}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"kernel {key}: {exc}") from exc


def device_mha_shape(p: Any, key: str) -> tuple[int, int, int]:
    """(heads, seq, d) the device ViT's strided attention `key` computes, from the ViT's params: the window
    form's heads are windows * vit_heads over window^2 tokens, the global form's vit_heads over grid^2; d is the
    head width. The compiled kernel is fixed by these sizes, and the reference reads nothing else of the device
    MHA records but `elems` (docs/sam3-kernels.md 4.3), so neither does the model."""
    tokens, head_dim = p.grid * p.grid, p.vit_dim // p.vit_heads
    if key == "mha_win":
        return tokens // (p.window * p.window) * p.vit_heads, p.window * p.window, head_dim
    return p.vit_heads, tokens, head_dim


def _model_for(bundle: Bundle, key: str, stream: bytes) -> FlmGemm | IronMha | Rope | AddLn:
    p = bundle.params
    if key in bundle.gemms:
        g = bundle.gemms[key]
        return FlmGemm(g.m, g.k, g.n, g.lda, g.tile_k, g.tile_n, g.ct_k, g.bias, epilogue_mode(stream))
    if key in bundle.mhas:
        h = bundle.mhas[key]
        if p.vit_device and key in _DEVICE_MHAS:
            return IronMha(*device_mha_shape(p, key), False, "strided", dim=p.vit_dim)
        return IronMha(h.heads, h.seq, h.d, h.token_major)
    if key in bundle.ops:
        if key == "rope":
            return Rope(p.grid * p.grid, p.vit_dim, p.vit_heads)
        if key == "addln":
            return AddLn(p.grid * p.grid, p.vit_dim, p.vit_eps, p.vit_res_f32)
        raise ValueError("no emulator model for this op (models exist for rope and addln)")
    raise ValueError("not a gemm, mha or op key of the bundle")


def bind_stream(registry: ModelRegistry, key: str, stream: bytes, bundle: Bundle) -> str:
    """Bind `stream` (kernel `key`'s stream, e.g. after its words were patched) to the key's model.

    Rebinding a stream to an equal model is a no-op. Returns the stream's digest.

    Raises:
        ValueError: as model_for, or the stream already bound to a different model.
    """
    model = model_for(bundle, key, stream)
    digest = stream_digest(stream)
    bound = registry.lookup(digest)
    if bound is not None and type(bound) is type(model) and repr(bound) == repr(model):
        return digest
    return registry.bind(digest, model)


def bind_bundle(bundle: Bundle, registry: ModelRegistry) -> dict[str, str]:
    """Bind every gemm, mha and op key of `bundle` to its model; returns key -> stream digest.

    Raises:
        ValueError: as bind_stream, naming the key.
        sam3.bundle.BundleError: a stream file cannot be read.
    """
    keys = sorted({*bundle.gemms, *bundle.mhas, *bundle.ops})
    return {key: bind_stream(registry, key, bundle.insts_bytes(key), bundle) for key in keys}
