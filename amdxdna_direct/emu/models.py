"""What an instruction stream computes: kernel models and the registry that binds them to streams.

Firmware cannot know what a TXN stream computes, so the emulator is told: a model is bound to the
sha256 of the stream's bytes (as many as its TXN header's size, read from the instruction BO) and is called with
writable uint8 views of the buffers the stream's DDR_PATCH ops resolved, keyed by `arg_idx`
(docs/design.md section 2). The built-in models' semantics are in docs/emulator.md (built-in models): bf16 in
and out, fp32 accumulation, round to nearest even on the way back to bf16.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections.abc import Callable
from typing import Protocol

import ml_dtypes
import numpy as np

from .memory import DeviceFault

BF16 = np.dtype(ml_dtypes.bfloat16)
_BF16_BYTES = 2
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Query rows per attention block: bounds the fp32 score matrix to block x seq (docs/emulator.md, built-in models).
_MHA_QUERY_BLOCK = 512


class Model(Protocol):
    """A kernel model: reads and writes the command's buffers in place."""

    name: str

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Run on `args` (arg_idx -> writable uint8 view of the BD extent); raise DeviceFault on a fault."""


# A model class may set ``compute_only = True``: it only computes on its buffers (it never waits for anything),
# so the firmware may run a small dispatch of it on the context's worker instead of handing it to the engine
# (docs/emulator.md, "Hand-off"). Every built-in model does; a model without the attribute always runs on the engine.


def stream_digest(stream: bytes | bytearray | memoryview | str) -> str:
    """The registry key of an instruction stream: sha256 hex of its bytes, or a sha256 hex string as given.

    Raises:
        ValueError: a string that is not 64 hexadecimal digits.
        TypeError: neither bytes-like nor str.
    """
    if isinstance(stream, str):
        digest = stream.lower()
        if not _SHA256_HEX.fullmatch(digest):
            raise ValueError(f"stream digest must be 64 hex digits (sha256), got {stream!r}")
        return digest
    if isinstance(stream, (bytes, bytearray, memoryview)):
        return hashlib.sha256(stream).hexdigest()
    raise TypeError(f"stream must be bytes or a sha256 hex string, got {type(stream).__name__}")


class ModelRegistry:
    """Stream digest -> model bindings of one emulated device (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, Model] = {}

    def bind(self, stream: bytes | str, model: Model) -> str:
        """Bind `model` to the stream (its bytes or sha256 hex).

        Rebinding the same model, or an equal built-in one (same type and parameters), is a no-op.

        Returns the digest.

        Raises:
            ValueError: the digest is already bound to a different model, or a malformed digest.
            TypeError: `model` is not callable.
        """
        if not callable(model):
            raise TypeError(f"model must be callable, got {type(model).__name__}")
        digest = stream_digest(stream)
        with self._lock:
            bound = self._models.get(digest)
            if bound is not None and not _same_model(bound, model):
                raise ValueError(f"stream {digest} is already bound to model {model_name(bound)!r}")
            self._models.setdefault(digest, model)
        return digest

    def unbind(self, stream: bytes | str) -> None:
        """Remove the binding of a stream.

        Raises:
            KeyError: nothing is bound to that stream.
        """
        digest = stream_digest(stream)
        with self._lock:
            if self._models.pop(digest, None) is None:
                raise KeyError(f"no model bound to stream {digest}")

    def lookup(self, digest: str) -> Model | None:
        """The model bound to a sha256 hex digest, or None."""
        with self._lock:
            return self._models.get(digest)

    def __contains__(self, stream: bytes | str) -> bool:
        return self.lookup(stream_digest(stream)) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)


def _same_model(a: object, b: object) -> bool:
    # Built-in models have parameter reprs; other callables only match themselves.
    return a is b or (type(a) is type(b) and type(a) in _BUILTIN_MODELS and repr(a) == repr(b))


def model_name(model: object) -> str:
    """A model's `name`, or its type name for a plain callable (log lines and binding errors)."""
    return getattr(model, "name", type(model).__name__)


def _need(args: dict[int, np.ndarray], idx: int, nbytes: int, what: str, model: str) -> np.ndarray:
    """The first `nbytes` of argument `idx`, or DeviceFault naming what is missing or short."""
    view = args.get(idx)
    if view is None:
        raise DeviceFault(f"{model}: {what} (arg {idx}) is not patched into the stream")
    if view.nbytes < nbytes:
        raise DeviceFault(f"{model}: {what} (arg {idx}) has {view.nbytes} bytes, needs {nbytes}")
    return view[:nbytes]


def _bf16(view: np.ndarray) -> np.ndarray:
    """A bf16 view of a uint8 view (no copy)."""
    return view.view(BF16)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class Passthrough:
    """Copies the buffer of the lowest arg_idx into the highest (the mlir-aie passthrough designs)."""

    name = "passthrough"
    compute_only = True

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Copy min(len(src), len(dst)) bytes.

        Raises:
            DeviceFault: fewer than two buffers are patched.
        """
        if len(args) < 2:
            raise DeviceFault(f"passthrough needs two patched buffers, the stream patches {sorted(args)}")
        src, dst = args[min(args)], args[max(args)]
        count = min(src.nbytes, dst.nbytes)
        dst[:count] = src[:count]

    def __repr__(self) -> str:
        return "Passthrough()"


class Gemm:
    """C[m x n] = A[m x k] @ B[k x n] in bf16 with fp32 accumulation; args 0 = A, 1 = B, 2 = C.

    Row i of A starts i*lda elements into the A buffer (lda < k: overlapping rows); B is row-major
    [k][n] bf16 (docs/emulator.md, built-in models). IRON's packed-weight GEMM is sam3's `FlmGemm`.
    """

    def __init__(self, m: int, k: int, n: int, lda: int):
        """A GEMM of A (m x k, rows lda elements apart) by B (k x n, row-major).

        Raises:
            ValueError: non-positive sizes.
        """
        _positive(m=m, k=k, n=n, lda=lda)
        self.m, self.k, self.n, self.lda = m, k, n, lda
        self.name = f"gemm {m}x{k}x{n} lda={lda}"
        self.compute_only = True

    @property
    def a_bytes(self) -> int:
        """Bytes of A the kernel reads: (m-1)*lda + k elements."""
        return ((self.m - 1) * self.lda + self.k) * _BF16_BYTES

    @property
    def b_bytes(self) -> int:
        """Bytes of B (k*n bf16 elements)."""
        return self.k * self.n * _BF16_BYTES

    @property
    def c_bytes(self) -> int:
        """Bytes of C written (m*n elements)."""
        return self.m * self.n * _BF16_BYTES

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Compute C in place.

        Raises:
            DeviceFault: A, B or C missing or shorter than the kernel reads/writes.
        """
        a_raw = _bf16(_need(args, 0, self.a_bytes, "A", self.name))
        b_raw = _bf16(_need(args, 1, self.b_bytes, "B", self.name))
        c_raw = _bf16(_need(args, 2, self.c_bytes, "C", self.name))
        a = np.lib.stride_tricks.as_strided(a_raw, shape=(self.m, self.k), strides=(self.lda * a_raw.itemsize,
                                            a_raw.itemsize), writeable=False)
        product = a.astype(np.float32) @ b_raw.reshape(self.k, self.n).astype(np.float32)
        c_raw.reshape(self.m, self.n)[...] = product          # cast to bf16 (round to nearest even) in place

    def __repr__(self) -> str:
        return f"Gemm({self.m}, {self.k}, {self.n}, {self.lda})"


class Mha:
    """o[h] = softmax(q[h] @ k[h]^T / sqrt(d)) @ v[h], each [heads][seq][d] bf16; args 0..3 = q, k, v, o."""

    def __init__(self, heads: int, seq: int, d: int):
        """Attention over `heads` heads of `seq` tokens of width `d`.

        Raises:
            ValueError: non-positive sizes.
        """
        _positive(heads=heads, seq=seq, d=d)
        self.heads, self.seq, self.d = heads, seq, d
        self.name = f"mha heads={heads} seq={seq} d={d}"
        self.compute_only = True

    @property
    def nbytes(self) -> int:
        """Bytes of each of q, k, v and o."""
        return self.heads * self.seq * self.d * _BF16_BYTES

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Compute o in place (softmax in fp32, docs/emulator.md, built-in models).

        Raises:
            DeviceFault: a buffer missing or short.
        """
        shape = (self.heads, self.seq, self.d)
        q, k, v = (_bf16(_need(args, i, self.nbytes, name, self.name)).reshape(shape) for i, name in
                   enumerate(("q", "k", "v")))
        out = _bf16(_need(args, 3, self.nbytes, "o", self.name)).reshape(shape)
        scale = np.float32(1.0 / math.sqrt(self.d))
        for h in range(self.heads):
            kt = k[h].astype(np.float32).T
            vh = v[h].astype(np.float32)
            for start in range(0, self.seq, _MHA_QUERY_BLOCK):
                rows = slice(start, start + _MHA_QUERY_BLOCK)
                scores = q[h, rows].astype(np.float32) @ kt
                scores *= scale
                scores -= scores.max(axis=1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=1, keepdims=True)
                out[h, rows] = scores @ vh

    def __repr__(self) -> str:
        return f"Mha({self.heads}, {self.seq}, {self.d})"


# The unary functions take the model's own fp32 copy and may overwrite it: one temporary at most, as the
# SAM3-sized demo runs them over tens of millions of elements.

def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """The tanh-form GELU of float32 `x` (a new array; `x` is left as it is)."""
    # The tanh approximation (docs/emulator.md, built-in models): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    t: np.ndarray = x * x
    t *= x
    t *= np.float32(0.044715)
    t += x
    t *= np.float32(math.sqrt(2.0 / math.pi))
    np.tanh(t, out=t)
    t += np.float32(1.0)
    t *= x
    t *= np.float32(0.5)
    return t


def _silu(x: np.ndarray) -> np.ndarray:
    # x / (1 + exp(-x))
    t: np.ndarray = np.negative(x)
    np.exp(t, out=t)
    t += np.float32(1.0)
    np.divide(x, t, out=t)
    return t


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {"gelu": gelu_tanh, "silu": _silu, "copy": lambda x: x}
ELEMENTWISE_FNS = ("gelu", "silu", "add", "copy", "layernorm")


class Elementwise:
    """An element-wise op over bf16 buffers of `elems` elements; args in order, the last is the output.

    gelu (tanh form), silu and copy read arg 0 (in place with one arg); add reads args 0 and 1
    (in place into arg 1 with two args); layernorm normalises each group of the last `n` elements
    of arg 0 with `eps` (no affine), writing the last arg (docs/emulator.md, built-in models).
    """

    def __init__(self, fn: str, elems: int, eps: float = 1e-6, n: int | None = None):
        """`fn` over `elems` bf16 values (layernorm: groups of `n` with `eps`).

        Raises:
            ValueError: unknown fn, non-positive elems, or layernorm without an `n` dividing elems.
        """
        if fn not in ELEMENTWISE_FNS:
            raise ValueError(f"unknown element-wise fn {fn!r} (one of {', '.join(ELEMENTWISE_FNS)})")
        _positive(elems=elems)
        if fn == "layernorm":
            if n is None or n <= 0 or elems % n:
                raise ValueError(f"layernorm needs n > 0 dividing elems={elems}, got n={n!r}")
        self.fn, self.elems, self.eps, self.n = fn, elems, eps, n
        self.name = f"{fn} elems={elems}"
        self.compute_only = True

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        """Compute the output in place.

        Raises:
            DeviceFault: too few buffers, or one shorter than `elems` bf16 values.
        """
        order = sorted(args)
        inputs = 2 if self.fn == "add" else 1
        if len(order) < inputs:
            raise DeviceFault(f"{self.name}: needs {inputs} patched buffers, the stream patches {order}")
        nbytes = self.elems * _BF16_BYTES
        xs = [_bf16(_need(args, i, nbytes, f"input {j}", self.name)).astype(np.float32)
              for j, i in enumerate(order[:inputs])]
        out = _bf16(_need(args, order[-1], nbytes, "output", self.name))
        out[...] = self._compute(xs)

    def _compute(self, xs: list[np.ndarray]) -> np.ndarray:
        if self.fn == "add":
            xs[0] += xs[1]
            return xs[0]
        if self.fn == "layernorm" and self.n is not None:       # __init__ requires n for layernorm
            centred = xs[0].reshape(-1, self.n)
            centred -= centred.mean(axis=1, keepdims=True)
            var = np.square(centred).mean(axis=1, keepdims=True)
            centred /= np.sqrt(var + np.float32(self.eps))
            return centred.reshape(-1)
        return _UNARY[self.fn](xs[0])

    def __repr__(self) -> str:
        return f"Elementwise({self.fn!r}, {self.elems}, eps={self.eps}, n={self.n})"


_BUILTIN_MODELS = (Passthrough, Gemm, Mha, Elementwise)
