"""`BundleWriter`: writes the format the reader reads, manifest last (docs/sam3-bundle.md 10)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import numpy as np

from .manifest import _WS_ONE, BLOB, INDEX, MANIFEST, VERSION, VERSIONS, WRITE_ALIGN, BundleError, _rel_parts
from .tensors import DTYPES, TensorInfo

_SHARED_TAGS = ("version", "param", "xclbin")
_RESERVED = (MANIFEST, INDEX, BLOB)


def _token(value: object, what: str) -> str:
    """`value` as one manifest token: non-empty, without whitespace."""
    text = _scalar(value, what)
    if not text or _WS_ONE.search(text):
        raise BundleError(f"{what} {text!r}: a manifest token must be non-empty and have no whitespace")
    return text


def _scalar(value: object, what: str) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        return repr(float(value))
    if isinstance(value, str | os.PathLike):
        return os.fspath(value) if isinstance(value, os.PathLike) else value
    raise TypeError(f"{what}: {type(value).__name__} is not a manifest value (int, float, str, bool)")


def _one_line(text: str, what: str) -> str:
    if "\n" in text or "\r" in text:
        raise BundleError(f"{what} {text!r}: a manifest line cannot hold a line break")
    return text


class BundleWriter:
    """Writes a bundle: tensors stream into tensors.bin as they come, 64-byte aligned (docs/sam3-bundle.md 10).

    manifest.txt is written last, at close(), so a write that fails leaves a directory that does not open.
    Use as a context manager: on an exception, close() is skipped and no manifest is written.
    """

    def __init__(self, directory: str | os.PathLike[str], version: int = VERSION):
        """Start a bundle in `directory`, which must not exist or be empty.

        Raises:
            BundleError: the directory is not empty, not a directory, or `version` is not one this reader reads.
        """
        if version not in VERSIONS:
            raise BundleError(f"version {version}: this runtime reads versions {', '.join(map(str, VERSIONS))}")
        self.root = Path(directory)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise BundleError(f"{self.root}: the bundle directory must not exist or be empty")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lines = [f"version {version}"]
        self._index: list[str] = []
        self._tensors: set[str] = set()
        self._params: set[str] = set()
        self._xclbins: set[str] = set()
        self._files: set[tuple[str, ...]] = set()
        self._offset = 0
        self._blob = open(self.root / BLOB, "xb")
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise BundleError(f"{self.root}: the writer is closed")

    def param(self, name: str, value: object) -> None:
        """`param <name> <value>`: int, float, str, bool (1/0) or a list/tuple (comma-joined).

        Raises:
            BundleError: duplicate name, a name with whitespace, a value with a line break.
            TypeError: a value of another type.
        """
        self._check_open()
        name = _token(name, "param name")
        if name in self._params:
            raise BundleError(f"param {name} defined twice")
        if isinstance(value, list | tuple | np.ndarray):
            text = ",".join(_token(v, f"param {name} item") for v in value)
        else:
            text = _one_line(_scalar(value, f"param {name}"), f"param {name}")
        self._params.add(name)
        self._lines.append(f"param {name} {text}")

    def xclbin(self, key: str, rel_path: str, kernel_name: str) -> None:
        """`xclbin <key> <rel_path> <kernel_name>`.

        Raises:
            BundleError: duplicate key, or a field that is not one token.
        """
        self._check_open()
        fields = (_token(key, "xclbin key"), _token(rel_path, "xclbin path"), _token(kernel_name, "kernel name"))
        line = "xclbin " + " ".join(fields)
        if key in self._xclbins:
            raise BundleError(f"xclbin {key} defined twice")
        self._xclbins.add(key)
        self._lines.append(line)

    def record(self, tag: str, *positional: object, **fields: object) -> None:
        """`<tag> <positional...> <k=v...>`; without k=v fields the last positional may hold spaces (a prompt).

        Raises:
            BundleError: a shared tag (use param/xclbin; the version is the constructor's), a bad token.
            TypeError: a value that is not int, float, str or bool.
        """
        self._check_open()
        tag = _token(tag, "record tag")
        if tag in _SHARED_TAGS or tag.startswith("#"):
            raise BundleError(f"record tag {tag!r}: write it with the writer's own method")
        parts = [tag]
        free = positional[-1] if positional and not fields else None
        fixed = positional[:-1] if free is not None else positional
        parts += [_token(v, f"{tag} field") for v in fixed]
        parts += [f"{_token(k, f'{tag} key')}={_token(v, f'{tag} {k}=')}" for k, v in fields.items()]
        if free is not None:
            parts.append(_one_line(_scalar(free, f"{tag} text"), f"{tag} text"))
        self._lines.append(" ".join(parts))

    def comment(self, text: str) -> None:
        """A `# text` line.

        Raises:
            BundleError: text with a line break.
        """
        self._check_open()
        self._lines.append("# " + _one_line(text, "comment"))

    def tensor(self, name: str, array: np.ndarray, dtype: str | None = None) -> TensorInfo:
        """Append `array` to tensors.bin; dtype f32, bf16 (ml_dtypes.bfloat16, or uint16 bits with dtype="bf16"),
        u8 or i32, inferred from the array when not given.

        Raises:
            BundleError: duplicate name, a bad name, a 0-d array, an array of another dtype.
        """
        self._check_open()
        arr = np.asarray(array)
        code = _dtype_code(arr, dtype, name)
        if arr.ndim == 0:
            raise BundleError(f"tensor {name}: a 0-d array has no shape tensors.txt can hold (use shape [1])")
        # uint16 bf16 bits are written as they are; other dtypes in little-endian order (docs/sam3-bundle.md 6).
        want = np.dtype("<u2") if code == "bf16_bits" else DTYPES[code]
        data = np.ascontiguousarray(arr.astype(want, copy=False)).reshape(-1).view(np.uint8)
        return self._append(name, code.removesuffix("_bits"), arr.shape, data.data)

    def raw_tensor(self, name: str, data: bytes | bytearray | memoryview | np.ndarray) -> TensorInfo:
        """Append raw bytes as a u8 tensor of shape [nbytes] (a packed B operand, a RoPE table).

        Raises:
            BundleError: duplicate or bad name, an array that is not uint8.
        """
        self._check_open()
        if isinstance(data, np.ndarray):
            if data.dtype != np.uint8:
                raise BundleError(f"tensor {name}: raw bytes must be uint8, not {data.dtype}")
            view = np.ascontiguousarray(data).reshape(-1).data
        else:
            view = memoryview(data).cast("B")
        return self._append(name, "u8", (view.nbytes,), view)

    def _append(self, name: str, code: str, shape: tuple[int, ...], view: memoryview) -> TensorInfo:
        name = _token(name, "tensor name")
        if name in self._tensors:
            raise BundleError(f"tensor {name} written twice")
        pad = -self._offset % WRITE_ALIGN
        if pad:
            self._blob.write(bytes(pad))
        offset = self._offset + pad
        self._blob.write(view)
        self._offset = offset + view.nbytes
        self._tensors.add(name)
        dims = ",".join(str(d) for d in shape)
        self._index.append(f"{name} {code} {dims} {offset} {view.nbytes}")
        return TensorInfo(name, code, tuple(shape), offset, view.nbytes, len(self._index))

    def file(self, rel_path: str, data: bytes) -> Path:
        """Write a bundle file (kernels/*, vocab.json, merges.txt, case images) at `rel_path`.

        Raises:
            BundleError: an absolute or escaping path, a reserved name, a file written twice.
        """
        self._check_open()
        parts = _rel_parts(rel_path) if not PurePosixPath(rel_path).is_absolute() else None
        if not parts:
            raise BundleError(f"file {rel_path!r}: not a path inside the bundle")
        if parts in self._files or (len(parts) == 1 and parts[0] in _RESERVED + (MANIFEST + ".tmp",)):
            raise BundleError(f"file {rel_path!r}: written twice, or a name the writer owns")
        target = self.root.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as f:
            f.write(data)
        self._files.add(parts)
        return target

    def close(self) -> Path:
        """Finish tensors.bin, write tensors.txt, then manifest.txt (last, via rename); idempotent.

        Raises:
            OSError: the files cannot be written.
        """
        if self._closed:
            return self.root
        self._blob.flush()
        os.fsync(self._blob.fileno())
        self._blob.close()
        self._write_text(INDEX, self._index)
        self._write_text(MANIFEST, self._lines)
        self._closed = True
        return self.root

    def abort(self) -> None:
        """Stop writing without a manifest: what was written stays, and does not open as a bundle."""
        if not self._closed:
            self._blob.close()
            self._closed = True

    def _write_text(self, name: str, lines: list[str]) -> None:
        tmp = self.root / (name + ".tmp")
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _dtype_code(arr: np.ndarray, dtype: str | None, name: str) -> str:
    found = next((code for code, dt in DTYPES.items() if arr.dtype == dt or
                  (code != "bf16" and arr.dtype.newbyteorder("<") == dt)), None)
    if dtype is None:
        if found is None:
            raise BundleError(f"tensor {name}: unknown dtype {arr.dtype} (write f32, bf16, u8 or i32)")
        return found
    if dtype not in DTYPES:
        raise BundleError(f"tensor {name}: unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    if dtype == "bf16" and arr.dtype == np.uint16:
        return "bf16_bits"
    if found != dtype:
        raise BundleError(f"tensor {name}: array is {arr.dtype}, wanted {dtype} (convert it first)")
    return dtype
