"""The xclbin (axlf) container: a bounds-checked parser, a writer, and an mlir-aie style builder.

Pure functions over bytes; the only I/O is reading a file handed to :func:`parse`, through
:mod:`amdxdna_direct.files` (a regular file within the xclbin size limit, docs/files.md). The parse is
bounded by the input: byte fields are views of it, and the bytes every section and array declares are
charged to a budget proportional to the file's size (docs/files.md 5).
Format facts: ``docs/xrt-sequence.md`` section 3 (axlf header, section table, MEM_TOPOLOGY,
CONNECTIVITY, IP_LAYOUT, EMBEDDED_METADATA, AIE_PARTITION), 1.3 (PDI selection) and 2.1 (the
mlir-aie kernel arguments). Every offset and count read from the file is checked before use; any
malformed input raises :class:`XclbinError` naming the section and the field. Struct layouts and enum
values are not declared here: they are read from the one cdef (``headers/xclbin.h`` via :mod:`.abi`).

The dataclasses are the canonical form: :func:`write` regenerates every section from them (sections it
does not decode are kept as raw bytes), so ``parse(write(x)) == x``. Layout-only values (the header's
``length`` and each section's ``offset``/``size``) do not take part in equality.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from xml.sax.saxutils import quoteattr

from . import abi
from .errors import Error
from .insts import read_input

__all__ = [
    "AiePartition", "CdoGroup", "Connection", "Connectivity", "EmbeddedMetadata", "Header", "Ip", "IpLayout",
    "Kernel", "KernelArg", "MemData", "MemTopology", "Pdi", "Section", "Xclbin", "XclbinError",
    "build_mlir_aie", "parse", "write",
]


class XclbinError(Error, ValueError):
    """A malformed or unusable xclbin; the message names the section and the field."""


def _enum(tag: str, prefix: str = "") -> dict[int, str]:
    """value -> enumerator name (without ``prefix``) of an enum of headers/xclbin.h."""
    return {value: name.removeprefix(prefix) for value, name in abi.ffi.typeof(f"enum {tag}").elements.items()}


# Section kinds, memory / IP / CDO types: the enums of headers/xclbin.h (docs/xrt-sequence.md 3.3, 3.4, 3.6, 3.8).
SECTION_KINDS = _enum("axlf_section_kind")
CDO_TYPES = _enum("CDO_TYPE", "CT_")
MEM_TYPES = _enum("MEM_TYPE", "MEM_")
IP_TYPES = _enum("IP_TYPE", "IP_")
EMBEDDED_METADATA: int = abi.EMBEDDED_METADATA
MEM_TOPOLOGY: int = abi.MEM_TOPOLOGY
CONNECTIVITY: int = abi.CONNECTIVITY
IP_LAYOUT: int = abi.IP_LAYOUT
ASK_GROUP_TOPOLOGY: int = abi.ASK_GROUP_TOPOLOGY
ASK_GROUP_CONNECTIVITY: int = abi.ASK_GROUP_CONNECTIVITY
AIE_PARTITION: int = abi.AIE_PARTITION
MEM_DRAM: int = abi.MEM_DRAM
IP_PS_KERNEL: int = abi.IP_PS_KERNEL
ST_DPU: int = abi.ST_DPU
CT_PRIMARY: int = abi.CT_PRIMARY
# XRT xclbin_parser argtype: addressQualifier 0 scalar, 1 global, 2 constant, 3 local, 4 stream
# (docs/xrt-sequence.md 3.7).
ARG_KINDS = {0: "scalar", 1: "global", 2: "constant", 3: "local", 4: "stream"}

MAGIC = b"xclbin2\0"

# struct format codes of the scalar and byte-array member types used in headers/xclbin.h
_CODES = {"uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q", "int32_t": "i"}
_BYTES = ("char", "unsigned char", "uint8_t")


def _member_format(ctype: str, path: str) -> tuple[int, int, str]:
    """(offset, size, struct code) of a member of ``ctype`` given as a dotted path; a nested struct of
    scalars (``array_offset``) becomes its codes in a row."""
    ftype, offset = abi.ffi.typeof(ctype), 0
    for part in path.split("."):
        member = dict(ftype.fields)[part]
        ftype, offset = member.type, offset + member.offset
    if ftype.kind == "primitive":
        code = _CODES[ftype.cname]
    elif ftype.kind == "array" and ftype.item.cname in _BYTES:
        code = f"{ftype.length}s"
    else:
        code = "".join(_CODES[f.type.cname] for _, f in ftype.fields)
    if struct.calcsize("<" + code) != abi.ffi.sizeof(ftype):
        raise ImportError(f"amdxdna_direct.xclbin: {ctype}.{path} is not a packed run of scalars")
    return offset, abi.ffi.sizeof(ftype), code


def _layout(ctype: str, *members: str, end: str | None = None) -> struct.Struct:
    """A little-endian ``struct.Struct`` unpacking ``members`` of ``ctype`` in offset order.

    Offsets, types and padding come from the cdef (headers/xclbin.h), so the parser declares no layout of
    its own; the format spans ``sizeof(ctype)``, or stops at member ``end``.
    """
    fmt, position = "<", 0
    limit = abi.ffi.sizeof(ctype) if end is None else abi.ffi.offsetof(ctype, end)
    for offset, size, code in [*sorted(_member_format(ctype, m) for m in members), (limit, 0, "")]:
        if offset < position:
            raise ImportError(f"amdxdna_direct.xclbin: members of {ctype} overlap at offset {offset}")
        fmt += f"{offset - position}x{code}" if offset > position else code
        position = offset + size
    return struct.Struct(fmt)


# docs/xrt-sequence.md 3.1 / 3.2: the fixed file head, its header and the 40-byte section headers that follow at 0x1C8.
_AXLF_PREFIX = _layout("struct axlf", "m_magic", "m_signature_length", "reserved", "m_keyBlock", "m_uniqueId",
                       end="m_header")
_AXLF_HEADER = _layout("struct axlf_header", "m_length", "m_timeStamp", "m_featureRomTimeStamp", "m_versionPatch",
                       "m_versionMajor", "m_versionMinor", "m_mode", "m_actionMask", "rom_uuid", "m_platformVBNV",
                       "uuid", "m_debug_bin", "m_numSections")
_SECTION_TABLE = abi.ffi.offsetof("struct axlf", "m_sections")
_SECTION_HEADER = _layout("struct axlf_section_header", "m_sectionKind", "m_sectionName", "m_sectionOffset",
                          "m_sectionSize")
_SECTION_ALIGN = 8
# docs/xrt-sequence.md 3.4-3.6: an i32 m_count (MEM_TOPOLOGY and IP_LAYOUT pad it to 8 bytes), then the records.
_MEM_COUNT = _layout("struct mem_topology", "m_count", end="m_mem_data")
_MEM_DATA = _layout("struct mem_data", "m_type", "m_used", "m_size", "m_base_address", "m_tag")
_CONNECTION_COUNT = _layout("struct connectivity", "m_count", end="m_connection")
_CONNECTION = _layout("struct connection", "arg_index", "m_ip_layout_index", "mem_data_index")
_IP_COUNT = _layout("struct ip_layout", "m_count", end="m_ip_data")
_IP_DATA = _layout("struct ip_data", "m_type", "properties", "m_base_address", "m_name")
# docs/xrt-sequence.md 3.8: array_offset members unpack as (element count, byte offset from the section start).
_PARTITION = _layout("struct aie_partition", "schema_version", "mpo_name", "operations_per_cycle",
                     "inference_fingerprint", "pre_post_fingerprint", "info.column_width", "info.start_columns",
                     "aie_pdi", "kernel_commit_id")
_AIE_PDI = _layout("struct aie_pdi", "uuid", "pdi_image", "cdo_groups")
_CDO_GROUP = _layout("struct cdo_group", "mpo_name", "cdo_type", "pdi_id", "dpu_kernel_ids", "pre_cdo_groups")


# --------------------------------------------------------------------------------------------- dataclasses


def _freeze(record: object, *names: str) -> None:
    """Store the sequence fields ``names`` of a frozen dataclass as tuples (lists compare unequal to tuples)."""
    for name in names:
        object.__setattr__(record, name, tuple(getattr(record, name)))


@dataclass(frozen=True)
class Header:
    """``struct axlf`` + ``struct axlf_header`` (docs/xrt-sequence.md 3.1)."""

    uuid: bytes
    version_major: int
    version_minor: int
    version_patch: int
    mode: int
    action_mask: int
    platform_vbnv: str
    timestamp: int
    feature_rom_timestamp: int
    unique_id: int
    interface_uuid: bytes
    debug_bin: bytes
    signature_length: int
    key_block: bytes = field(repr=False)
    length: int = field(default=0, compare=False)

    @property
    def version(self) -> str:
        """``major.minor.patch`` of the xclbinutil that wrote the file."""
        return f"{self.version_major}.{self.version_minor}.{self.version_patch}"


@dataclass(frozen=True)
class MemData:
    """One ``mem_data`` entry of MEM_TOPOLOGY (docs/xrt-sequence.md 3.4)."""

    type: int
    used: int
    size_kb: int
    base_address: int
    tag: str


@dataclass(frozen=True)
class MemTopology:
    """MEM_TOPOLOGY / ASK_GROUP_TOPOLOGY content."""

    entries: tuple[MemData, ...]

    def __post_init__(self) -> None:
        _freeze(self, "entries")


@dataclass(frozen=True)
class Connection:
    """One CONNECTIVITY entry (docs/xrt-sequence.md 3.5): kernel argument -> memory bank."""

    arg_index: int
    ip_layout_index: int
    mem_data_index: int


@dataclass(frozen=True)
class Connectivity:
    """CONNECTIVITY / ASK_GROUP_CONNECTIVITY content."""

    entries: tuple[Connection, ...]

    def __post_init__(self) -> None:
        _freeze(self, "entries")


@dataclass(frozen=True)
class Ip:
    """One ``ip_data`` entry of IP_LAYOUT (docs/xrt-sequence.md 3.6); ``name`` is ``kernel:instance``."""

    type: int
    properties: int
    base_address: int
    name: str

    @property
    def kernel(self) -> str:
        """Kernel part of ``name``."""
        return self.name.partition(":")[0]

    @property
    def instance(self) -> str:
        """Instance part of ``name`` (empty when there is no colon)."""
        return self.name.partition(":")[2]

    @property
    def subtype(self) -> int:
        """PS kernel ``m_subtype`` (bits 1:0; 1 = DPU)."""
        return int((self.properties >> abi.IP_PS_KERNEL_SUBTYPE_SHIFT) & abi.IP_PS_KERNEL_SUBTYPE_MASK)

    @property
    def functional(self) -> int:
        """PS kernel ``m_functional`` (bits 5:4)."""
        return int((self.properties >> abi.IP_PS_KERNEL_FUNCTIONAL_SHIFT) & abi.IP_PS_KERNEL_FUNCTIONAL_MASK)

    @property
    def kernel_id(self) -> int:
        """PS kernel ``m_kernel_id`` (bits 27:16)."""
        return int((self.properties >> abi.IP_PS_KERNEL_KERNEL_ID_SHIFT) & abi.IP_PS_KERNEL_KERNEL_ID_MASK)


@dataclass(frozen=True)
class IpLayout:
    """IP_LAYOUT content."""

    entries: tuple[Ip, ...]

    def __post_init__(self) -> None:
        _freeze(self, "entries")


@dataclass(frozen=True)
class KernelArg:
    """One ``<arg>`` of a kernel: its XRT index and its place in the command regmap (docs/xrt-sequence.md 3.7)."""

    name: str
    index: int
    offset: int
    size: int
    kind: str
    type: str


@dataclass(frozen=True)
class Kernel:
    """One ``<kernel>`` of EMBEDDED_METADATA with its ``<extended-data>``, instances and arguments."""

    name: str
    type: str
    language: str
    dpu_kernel_id: int | None
    functional: int | None
    subtype: int | None
    instances: tuple[str, ...]
    args: tuple[KernelArg, ...]

    @property
    def regmap_size(self) -> int:
        """Bytes of the regmap XRT lays out: max(offset + size) over the arguments (docs/xrt-sequence.md 1.7)."""
        return max((a.offset + a.size for a in self.args), default=0)


@dataclass(frozen=True)
class EmbeddedMetadata:
    """EMBEDDED_METADATA: the XML text; ``kernels`` is decoded from it on construction.

    Raises:
        XclbinError: the XML is malformed, declares a DOCTYPE, or a kernel lacks a required attribute.
    """

    xml: str = field(repr=False)
    kernels: tuple[Kernel, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", _kernels_from_xml(self.xml))

    @classmethod
    def from_kernels(cls, kernels: Sequence[Kernel]) -> EmbeddedMetadata:
        """Write the XML an xclbinutil ``--add-kernel`` would embed for ``kernels``.

        Raises:
            XclbinError: a kernel cannot be represented.
        """
        return cls(_kernels_to_xml(kernels))


@dataclass(frozen=True)
class CdoGroup:
    """``cdo_group`` of an AIE_PARTITION PDI (docs/xrt-sequence.md 3.8)."""

    name: str
    type: int
    pdi_id: int
    dpu_kernel_ids: tuple[int, ...]
    pre_cdo_groups: tuple[int, ...]

    def __post_init__(self) -> None:
        _freeze(self, "dpu_kernel_ids", "pre_cdo_groups")

    @property
    def type_name(self) -> str:
        """``PRIMARY``, ``LITE``, ``PREPOST``, ``UNKNOWN`` or the number."""
        return CDO_TYPES.get(self.type, str(self.type))


@dataclass(frozen=True)
class Pdi:
    """``aie_pdi``: a PDI image with its uuid and CDO groups (docs/xrt-sequence.md 3.8)."""

    uuid: bytes
    # parse() gives a read-only memoryview of the input (docs/files.md 5); a hand-built Pdi may hold bytes.
    image: bytes | memoryview = field(repr=False)
    cdo_groups: tuple[CdoGroup, ...]

    def __post_init__(self) -> None:
        _freeze(self, "cdo_groups")

    def __reduce__(self) -> tuple[type[Pdi], tuple[bytes, bytes, tuple[CdoGroup, ...]]]:
        # a memoryview does not pickle or deepcopy: the image goes as bytes
        return (Pdi, (self.uuid, bytes(self.image), self.cdo_groups))

    @property
    def size(self) -> int:
        """Image size in bytes."""
        return len(self.image)

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the image."""
        return hashlib.sha256(self.image).hexdigest()


@dataclass(frozen=True)
class AiePartition:
    """AIE_PARTITION (docs/xrt-sequence.md 3.8)."""

    schema_version: int
    name: str
    operations_per_cycle: int
    inference_fingerprint: int
    pre_post_fingerprint: int
    column_width: int
    start_columns: tuple[int, ...]
    pdis: tuple[Pdi, ...]
    kernel_commit_id: str

    def __post_init__(self) -> None:
        _freeze(self, "start_columns", "pdis")

    @property
    def ops_per_cycle(self) -> int:
        """``operations_per_cycle``: what XRT passes as CREATE_HWCTX ``max_opc`` (docs/xrt-sequence.md 1.3)."""
        return self.operations_per_cycle


Content = bytes | memoryview | MemTopology | Connectivity | IpLayout | EmbeddedMetadata | AiePartition
_C = TypeVar("_C", MemTopology, Connectivity, IpLayout, EmbeddedMetadata, AiePartition)


@dataclass(frozen=True)
class Section:
    """One section: its table entry and its content (decoded, or raw bytes for kinds not decoded here; parse()
    gives those as a read-only memoryview of the input, docs/files.md 5)."""

    kind: int
    name: str
    content: Content = field(repr=False)
    offset: int = field(default=0, compare=False)
    size: int = field(default=0, compare=False)

    def __reduce__(self) -> tuple[type[Section], tuple[object, ...]]:
        # a memoryview does not pickle or deepcopy: raw content goes as bytes
        content = bytes(self.content) if isinstance(self.content, memoryview) else self.content
        return (Section, (self.kind, self.name, content, self.offset, self.size))

    @property
    def kind_name(self) -> str:
        """The ``axlf_section_kind`` enumerator name, or the number for kinds unknown here."""
        return SECTION_KINDS.get(self.kind, str(self.kind))


@dataclass(frozen=True)
class Xclbin:
    """A parsed xclbin: header and sections, with the views XRT takes of them (first section of a kind).

    The views (``mem_topology``, ``connectivity``, ``ip_layout``, ``partition``, ``kernels``) are None or empty
    without their section.

    Raises:
        XclbinError: from a view, when a hand-built Xclbin holds raw bytes under a kind :func:`parse` decodes.
    """

    header: Header
    sections: tuple[Section, ...]

    def __post_init__(self) -> None:
        _freeze(self, "sections")

    @classmethod
    def load(cls, data: bytes | str | os.PathLike[str]) -> Xclbin:
        """Same as :func:`parse`.

        Raises:
            XclbinError: malformed input.
            FileRefused: the path is not a regular file or is over the xclbin size limit (docs/files.md).
            OSError: the file cannot be read.
            TypeError: ``data`` is neither bytes nor a path.
        """
        return parse(data)

    @property
    def uuid(self) -> bytes:
        """The xclbin uuid (``m_header.uuid``, what ``xrt::xclbin::get_uuid`` returns)."""
        return self.header.uuid

    @property
    def length(self) -> int:
        """``m_header.m_length`` as read (0 for an xclbin built in memory and not yet parsed)."""
        return self.header.length

    def section(self, kind: int) -> Section | None:
        """The first section of ``kind`` (XRT ``get_axlf_section``), or None."""
        return next((s for s in self.sections if s.kind == kind), None)

    def _content(self, kind: int, expected: type[_C]) -> _C | None:
        found = self.section(kind)
        if found is None:
            return None
        if not isinstance(found.content, expected):
            # only a hand-built Xclbin can hold undecoded bytes under a kind that parse() decodes
            raise XclbinError(f"{found.kind_name} section {found.name!r}: content is {type(found.content).__name__}, "
                              f"expected {expected.__name__}")
        return found.content

    @property
    def mem_topology(self) -> MemTopology | None:
        """MEM_TOPOLOGY, or None."""
        return self._content(MEM_TOPOLOGY, MemTopology)

    @property
    def connectivity(self) -> Connectivity | None:
        """CONNECTIVITY, or None."""
        return self._content(CONNECTIVITY, Connectivity)

    @property
    def ip_layout(self) -> IpLayout | None:
        """IP_LAYOUT, or None."""
        return self._content(IP_LAYOUT, IpLayout)

    @property
    def partition(self) -> AiePartition | None:
        """AIE_PARTITION, or None."""
        return self._content(AIE_PARTITION, AiePartition)

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        """Kernels of EMBEDDED_METADATA in file order (empty without the section)."""
        metadata = self._content(EMBEDDED_METADATA, EmbeddedMetadata)
        return metadata.kernels if metadata is not None else ()

    def kernel(self, name: str | None = None) -> Kernel:
        """The kernel called ``name``; with None the first kernel of type ``dpu`` (XRT's CU order).

        Raises:
            XclbinError: no such kernel.
        """
        for k in self.kernels:
            if (k.name == name) if name is not None else (k.type == "dpu"):
                return k
        known = ", ".join(k.name for k in self.kernels) or "none"
        wanted = repr(name) if name is not None else "of type 'dpu'"
        raise XclbinError(f"EMBEDDED_METADATA: no kernel {wanted} (kernels: {known})")

    def pdi_for(self, kernel_name: str | None = None) -> Pdi:
        """The PDI XRT loads for a kernel: the first ``aie_pdi`` having a ``cdo_group`` whose
        ``dpu_kernel_ids`` contains the kernel's ``dpu_kernel_id`` (docs/xrt-sequence.md 1.3, shim hwctx.cpp get_pdi).

        Raises:
            XclbinError: unknown kernel, no dpu_kernel_id, no AIE_PARTITION, or no PDI for that id.
        """
        k = self.kernel(kernel_name)
        if k.dpu_kernel_id is None:
            raise XclbinError(f"EMBEDDED_METADATA: kernel {k.name!r} has no extended-data dpu_kernel_id")
        partition = self.partition
        if partition is None:
            raise XclbinError(f"AIE_PARTITION: section missing, no PDI for kernel {k.name!r}")
        for pdi in partition.pdis:
            if any(k.dpu_kernel_id in g.dpu_kernel_ids for g in pdi.cdo_groups):
                return pdi
        raise XclbinError(f"AIE_PARTITION: no aie_pdi has a cdo_group with dpu_kernel_id 0x{k.dpu_kernel_id:x} "
                          f"(kernel {k.name!r}): No valid DPU kernel found")


# --------------------------------------------------------------------------------------------- bounded reads


# docs/files.md 5: the bytes the arrays, strings and sections of one file may declare in total.
BUDGET_FACTOR = 8
BUDGET_BYTES = 64 << 10


class _Budget:
    """The bytes the records of one file have declared so far, against a limit proportional to its size.

    Overlapping arrays are legal byte-wise but each one is decoded again; the budget bounds the parse's work
    and memory by the file's size whatever the offsets say (docs/files.md 5).
    """

    def __init__(self, file_size: int) -> None:
        self.file_size = file_size
        self.limit = BUDGET_FACTOR * file_size + BUDGET_BYTES
        self.used = 0

    def charge(self, nbytes: int, where: str, name: str) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise XclbinError(f"{where}: {name} ({nbytes} bytes) brings the bytes declared by the file's sections "
                              f"and arrays to {self.used}, over the budget of {self.limit} for a "
                              f"{self.file_size}-byte file ({BUDGET_FACTOR} x size + {BUDGET_BYTES}; "
                              f"overlapping arrays?)")


class _View:
    """Bounds-checked reads from one region of the input, without copying it; errors name the region and
    the field; every array, string and region taken is charged to the parse's budget."""

    def __init__(self, raw: bytes, where: str, budget: _Budget, start: int = 0, size: int | None = None) -> None:
        self.raw = raw
        self.where = where
        self.budget = budget
        self.start = start
        self.size = len(raw) - start if size is None else size

    def fail(self, what: str) -> XclbinError:
        return XclbinError(f"{self.where}: {what}")

    def check(self, offset: int, size: int, name: str) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise self.fail(f"{name} at offset {offset} size {size} lies outside the {self.size} bytes")

    def charge(self, nbytes: int, name: str) -> None:
        self.budget.charge(nbytes, self.where, name)

    def unpack(self, layout: struct.Struct, offset: int, name: str) -> tuple[Any, ...]:
        self.check(offset, layout.size, name)
        return layout.unpack_from(self.raw, self.start + offset)

    def take(self, offset: int, size: int, name: str) -> memoryview:
        """A read-only view of ``size`` bytes at ``offset`` (no copy)."""
        self.check(offset, size, name)
        self.charge(size, name)
        return memoryview(self.raw)[self.start + offset:self.start + offset + size]

    def region(self, offset: int, size: int, where: str, name: str) -> _View:
        """The view of ``size`` bytes at ``offset``, named ``where``, charged to the budget as ``where: name``."""
        self.check(offset, size, where)
        self.budget.charge(size, where, name)
        return _View(self.raw, where, self.budget, self.start + offset, size)

    def whole(self) -> memoryview:
        """A read-only view of the whole region (already charged when the region was taken)."""
        return memoryview(self.raw)[self.start:self.start + self.size]

    def copy(self) -> bytes:
        """A copy of the whole region."""
        return self.raw[self.start:self.start + self.size]

    def records(self, layout: struct.Struct, offset: int, count: int, name: str) -> list[tuple[Any, ...]]:
        """``count`` records of ``layout`` from ``offset``, checked and charged before any is decoded."""
        self.check(offset, count * layout.size, name)
        self.charge(count * layout.size, name)
        base = self.start + offset
        return [layout.unpack_from(self.raw, base + i * layout.size) for i in range(count)]

    def array(self, count: int, offset: int, item: str, name: str) -> tuple[int, ...]:
        """``count`` elements of struct format ``item`` at ``offset`` (an ``array_offset``)."""
        if count == 0:
            return ()
        size = struct.calcsize("<" + item)
        label = f"{name} ({count} elements)"
        self.check(offset, count * size, label)
        self.charge(count * size, label)
        return struct.unpack_from(f"<{count}{item}", self.raw, self.start + offset)

    def cstr(self, offset: int, name: str) -> str:
        """NUL-terminated UTF-8 string at ``offset``."""
        self.check(offset, 1, name)
        begin = self.start + offset
        end = self.raw.find(b"\0", begin, self.start + self.size)
        if end < 0:
            raise self.fail(f"{name} at offset {offset} has no NUL terminator")
        self.charge(end - begin + 1, name)
        return _text(self.raw[begin:end], self.where, name)


def _text(raw: bytes, where: str, name: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise XclbinError(f"{where}: {name} is not UTF-8 ({e.reason} at byte {e.start})") from None


def _fixed(raw: bytes, where: str, name: str) -> str:
    """A fixed-size char array: text up to the first NUL."""
    return _text(raw.split(b"\0", 1)[0], where, name)


# --------------------------------------------------------------------------------------------- parsing


def parse(data: bytes | str | os.PathLike[str]) -> Xclbin:
    """Parse an xclbin given as bytes or as a path.

    Raises:
        XclbinError: the file is truncated or corrupt (the message names the section and the field).
        FileRefused: the path is not a regular file or is over the size limit of its kind (docs/files.md).
        OSError: the file cannot be read.
        TypeError: ``data`` is neither bytes nor a path.
    """
    raw = read_input(data, "parse", kind="xclbin")
    view = _View(raw, "axlf header", _Budget(len(raw)))
    magic, sig_len, _reserved, key_block, unique_id = view.unpack(_AXLF_PREFIX, 0, "struct axlf")
    if magic != MAGIC:
        raise XclbinError(f"axlf header: magic {magic!r}, expected {MAGIC!r}")
    header, count = _parse_header(view, sig_len, key_block, unique_id)
    if header.length > len(raw):
        raise XclbinError(f"axlf header: m_length {header.length} exceeds the {len(raw)} bytes read (truncated)")
    table = f"section table (m_numSections {count})"
    view.check(_SECTION_TABLE, count * _SECTION_HEADER.size, table)
    view.charge(count * _SECTION_HEADER.size, table)
    sections = tuple(_parse_section(view, i) for i in range(count))
    return Xclbin(header=header, sections=sections)


def _parse_header(view: _View, sig_len: int, key_block: bytes, unique_id: int) -> tuple[Header, int]:
    (length, timestamp, rom_timestamp, patch, major, minor, mode, action_mask, interface_uuid, vbnv, uuid,
     debug_bin, count) = view.unpack(_AXLF_HEADER, _AXLF_PREFIX.size, "struct axlf_header")
    header = Header(
        uuid=uuid, version_major=major, version_minor=minor, version_patch=patch, mode=mode,
        action_mask=action_mask, platform_vbnv=_fixed(vbnv, "axlf header", "m_platformVBNV"),
        timestamp=timestamp, feature_rom_timestamp=rom_timestamp, unique_id=unique_id,
        interface_uuid=interface_uuid, debug_bin=debug_bin, signature_length=sig_len, key_block=key_block,
        length=length)
    return header, count


def _parse_section(view: _View, index: int) -> Section:
    where = f"section header {index}"
    kind, name_raw, offset, size = view.unpack(_SECTION_HEADER, _SECTION_TABLE + index * _SECTION_HEADER.size,
                                               where)
    name = _fixed(name_raw, where, "m_sectionName")
    label = f"{SECTION_KINDS.get(kind, f'kind {kind}')} section {index}"
    if offset + size > view.size:
        raise XclbinError(f"{label}: m_sectionOffset {offset} + m_sectionSize {size} exceeds the "
                          f"{view.size}-byte file")
    body = view.region(offset, size, label, "m_sectionSize")
    decoder = _SECTION_DECODERS.get(kind)
    content = decoder(body) if decoder is not None else body.whole()
    return Section(kind=kind, name=name, content=content, offset=offset, size=size)


def _count(view: _View, layout: struct.Struct) -> int:
    (count,) = view.unpack(layout, 0, "m_count")
    if count < 0:
        raise view.fail(f"m_count {count} is negative")
    return int(count)


def _records(view: _View, layout: struct.Struct, start: int, count: int, name: str) -> list[tuple[Any, ...]]:
    return view.records(layout, start, count, f"{name} array (m_count {count})")


def _parse_mem_topology(view: _View) -> MemTopology:
    records = _records(view, _MEM_DATA, _MEM_COUNT.size, _count(view, _MEM_COUNT), "m_mem_data")
    return MemTopology(tuple(
        MemData(type=t, used=u, size_kb=s, base_address=b, tag=_fixed(tag, view.where, f"m_mem_data[{i}].m_tag"))
        for i, (t, u, s, b, tag) in enumerate(records)))


def _parse_connectivity(view: _View) -> Connectivity:
    records = _records(view, _CONNECTION, _CONNECTION_COUNT.size, _count(view, _CONNECTION_COUNT), "m_connection")
    return Connectivity(tuple(Connection(*r) for r in records))


def _parse_ip_layout(view: _View) -> IpLayout:
    records = _records(view, _IP_DATA, _IP_COUNT.size, _count(view, _IP_COUNT), "m_ip_data")
    return IpLayout(tuple(
        Ip(type=t, properties=p, base_address=b, name=_fixed(n, view.where, f"m_ip_data[{i}].m_name"))
        for i, (t, p, b, n) in enumerate(records)))


def _parse_metadata(view: _View) -> EmbeddedMetadata:
    raw = view.copy().rstrip(b"\0")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise view.fail(f"XML is not UTF-8 ({e.reason} at byte {e.start})") from None
    return EmbeddedMetadata(text)


def _parse_partition(view: _View) -> AiePartition:
    (schema, name_off, opc, inference, pre_post, width, ncols, cols_off, npdi, pdi_off,
     commit_off) = view.unpack(_PARTITION, 0, "struct aie_partition")
    records = view.records(_AIE_PDI, pdi_off, npdi, f"aie_pdi array ({npdi} elements)") if npdi else []
    pdis = tuple(_parse_pdi(view, record, i) for i, record in enumerate(records))
    return AiePartition(
        schema_version=schema, name=view.cstr(name_off, "mpo_name"), operations_per_cycle=opc,
        inference_fingerprint=inference, pre_post_fingerprint=pre_post, column_width=width,
        start_columns=view.array(ncols, cols_off, "H", "info.start_columns"), pdis=pdis,
        kernel_commit_id=view.cstr(commit_off, "kernel_commit_id"))


def _parse_pdi(view: _View, record: tuple[Any, ...], index: int) -> Pdi:
    name = f"aie_pdi[{index}]"
    uuid, image_size, image_off, ngroups, groups_off = record
    image = view.take(image_off, image_size, f"{name}.pdi_image") if image_size else b""
    label = f"{name}.cdo_groups ({ngroups} elements)"
    records = view.records(_CDO_GROUP, groups_off, ngroups, label) if ngroups else []
    groups = tuple(_parse_cdo_group(view, r, f"{name}.cdo_groups[{i}]") for i, r in enumerate(records))
    return Pdi(uuid=uuid, image=image, cdo_groups=groups)


def _parse_cdo_group(view: _View, record: tuple[Any, ...], name: str) -> CdoGroup:
    name_off, cdo_type, pdi_id, nids, ids_off, npre, pre_off = record
    return CdoGroup(
        name=view.cstr(name_off, f"{name}.mpo_name"), type=cdo_type, pdi_id=pdi_id,
        dpu_kernel_ids=view.array(nids, ids_off, "Q", f"{name}.dpu_kernel_ids"),
        pre_cdo_groups=view.array(npre, pre_off, "I", f"{name}.pre_cdo_groups"))


_SECTION_DECODERS: dict[int, Callable[[_View], Content]] = {
    MEM_TOPOLOGY: _parse_mem_topology,
    ASK_GROUP_TOPOLOGY: _parse_mem_topology,
    CONNECTIVITY: _parse_connectivity,
    ASK_GROUP_CONNECTIVITY: _parse_connectivity,
    IP_LAYOUT: _parse_ip_layout,
    EMBEDDED_METADATA: _parse_metadata,
    AIE_PARTITION: _parse_partition,
}


# --------------------------------------------------------------------------------------------- XML


_NUMBER = re.compile(r"(0[xX][0-9a-fA-F]{1,16}|[0-9]{1,20})")


def _number(text: str | None, where: str) -> int:
    """XRT reads XML numbers with ``stoul(s, 0, 0)``-like rules; accept decimal and 0x-hex only."""
    if text is None:
        raise XclbinError(f"EMBEDDED_METADATA: {where} missing")
    s = text.strip()
    if not _NUMBER.fullmatch(s):
        raise XclbinError(f"EMBEDDED_METADATA: {where}={text!r} is not a number")
    return int(s, 16) if s[:2] in ("0x", "0X") else int(s, 10)


def _optional_number(text: str | None, where: str) -> int | None:
    return None if text is None else _number(text, where)


def _xml_root(xml: str) -> ET.Element:
    # Refuse DTDs: entity declarations are the only route to entity-expansion attacks (the XML of
    # docs/xrt-sequence.md 3.7 has none).
    if "<!DOCTYPE" in xml or "<!ENTITY" in xml:
        raise XclbinError("EMBEDDED_METADATA: XML declares a DOCTYPE/ENTITY, refused")
    try:
        return ET.fromstring(xml)
    except (ET.ParseError, ValueError, LookupError, RecursionError) as e:
        raise XclbinError(f"EMBEDDED_METADATA: XML does not parse: {e}") from None


def _kernels_from_xml(xml: str) -> tuple[Kernel, ...]:
    root = _xml_root(xml)
    if root.tag != "project":
        raise XclbinError(f"EMBEDDED_METADATA: root element <{root.tag}>, expected <project>")
    # XRT's path: project/platform/device/core/kernel (xclbin_parser.cpp, docs/xrt-sequence.md 3.7).
    return tuple(_kernel(k) for k in root.iterfind("platform/device/core/kernel"))


def _kernel(node: ET.Element) -> Kernel:
    name = node.get("name")
    if name is None:
        raise XclbinError("EMBEDDED_METADATA: <kernel> without a name attribute")
    ext = node.find("extended-data")
    attrs = ext.attrib if ext is not None else {}
    where = f"kernel {name!r} extended-data"
    instances: list[str] = []
    for inst in node.iterfind("instance"):
        instance = inst.get("name")
        if instance is None:
            raise XclbinError(f"EMBEDDED_METADATA: kernel {name!r} has an <instance> without a name")
        instances.append(instance)
    return Kernel(
        name=name, type=node.get("type", ""), language=node.get("language", ""),
        dpu_kernel_id=_optional_number(attrs.get("dpu_kernel_id"), f"{where} dpu_kernel_id"),
        functional=_optional_number(attrs.get("functional"), f"{where} functional"),
        subtype=_optional_number(attrs.get("subtype"), f"{where} subtype"),
        instances=tuple(instances), args=_kernel_args(node, name))


def _kernel_args(node: ET.Element, kernel: str) -> tuple[KernelArg, ...]:
    args: dict[int, KernelArg] = {}
    for n, arg in enumerate(node.iterfind("arg")):
        arg_name = arg.get("name")
        if arg_name is None:
            raise XclbinError(f"EMBEDDED_METADATA: kernel {kernel!r} <arg> {n} without a name")
        where = f"kernel {kernel!r} arg {arg_name!r}"
        qualifier = _number(arg.get("addressQualifier"), f"{where} addressQualifier")
        if qualifier not in ARG_KINDS:
            raise XclbinError(f"EMBEDDED_METADATA: {where} addressQualifier {qualifier} unknown (0..4)")
        index = _number(arg.get("id"), f"{where} id")
        # XRT sorts arguments by id and keeps the first of duplicates (xclbin_parser.cpp get_kernel_arguments).
        args.setdefault(index, KernelArg(
            name=arg_name, index=index, offset=_number(arg.get("offset"), f"{where} offset"),
            size=_number(arg.get("size"), f"{where} size"), kind=ARG_KINDS[qualifier], type=arg.get("type", "")))
    return tuple(args[i] for i in sorted(args))


def _kernels_to_xml(kernels: Sequence[Kernel]) -> str:
    qualifiers = {kind: q for q, kind in ARG_KINDS.items()}
    lines = ['<?xml version="1.0" encoding="utf-8"?>', "<project>", "  <platform>", "    <device>", "      <core>"]
    for k in kernels:
        lines.append(f"        <kernel name={quoteattr(k.name)} language={quoteattr(k.language)} "
                     f"type={quoteattr(k.type)}>")
        ext = [f"{key}={quoteattr(_xml_number(value, key))}" for key, value in
               (("dpu_kernel_id", k.dpu_kernel_id), ("functional", k.functional), ("subtype", k.subtype))
               if value is not None]
        if ext:
            lines.append(f"          <extended-data {' '.join(ext)}/>")
        for a in k.args:
            if a.kind not in qualifiers:
                raise XclbinError(f"EMBEDDED_METADATA: kernel {k.name!r} arg {a.name!r} kind {a.kind!r} unknown")
            lines.append(f"          <arg name={quoteattr(a.name)} addressQualifier=\"{qualifiers[a.kind]}\" "
                         f"id=\"{a.index}\" size=\"0x{a.size:x}\" offset=\"0x{a.offset:x}\" hostOffset=\"0x0\" "
                         f"hostSize=\"0x{a.size:x}\" type={quoteattr(a.type)}/>")
        lines.extend(f"          <instance name={quoteattr(i)}/>" for i in k.instances)
        lines.append("        </kernel>")
    lines += ["      </core>", "    </device>", "  </platform>", "</project>", ""]
    return "\n".join(lines)


def _xml_number(value: int, name: str) -> str:
    return f"0x{value:x}" if name == "dpu_kernel_id" else str(value)


# --------------------------------------------------------------------------------------------- writing


def write(x: Xclbin) -> bytes:
    """Serialise ``x``: header, section table, then every section regenerated from its content.

    Sections are placed in table order, each 8-byte aligned; ``m_length`` is the total size.

    Raises:
        XclbinError: a value does not fit its field (names the section and the field).
    """
    bodies = [_encode_content(s) for s in x.sections]
    table_end = _SECTION_TABLE + max(len(bodies), 1) * _SECTION_HEADER.size
    offsets, position = [], _align(table_end)
    for body in bodies:
        offsets.append(position)
        position = _align(position + len(body))
    total = offsets[-1] + len(bodies[-1]) if bodies else table_end
    out = bytearray(max(total, table_end))
    _pack_header(out, x.header, len(out), len(bodies))
    for i, (s, body, offset) in enumerate(zip(x.sections, bodies, offsets, strict=True)):
        name = _fixed_bytes(s.name, 16, f"section {i}", "m_sectionName")
        _pack(_SECTION_HEADER, out, _SECTION_TABLE + i * _SECTION_HEADER.size, f"section header {i}",
              s.kind, name, offset, len(body))
        out[offset:offset + len(body)] = body
    return bytes(out)


def _align(n: int) -> int:
    return -(-n // _SECTION_ALIGN) * _SECTION_ALIGN


def _pack(layout: struct.Struct, out: bytearray, offset: int, where: str, *values: object) -> None:
    try:
        layout.pack_into(out, offset, *values)
    except struct.error as e:
        raise XclbinError(f"{where}: a value does not fit its field ({e})") from None


def _fixed_bytes(text: str, size: int, where: str, name: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > size or b"\0" in raw:
        raise XclbinError(f"{where}: {name} {text!r} does not fit {size} bytes without NULs")
    return raw


def _pack_header(out: bytearray, h: Header, length: int, count: int) -> None:
    for name, value, size in (("uuid", h.uuid, 16), ("interface_uuid", h.interface_uuid, 16),
                              ("debug_bin", h.debug_bin, 16), ("key_block", h.key_block, 256)):
        if len(value) != size:
            raise XclbinError(f"axlf header: {name} must be {size} bytes, got {len(value)}")
    vbnv = _fixed_bytes(h.platform_vbnv, 64, "axlf header", "m_platformVBNV")
    _pack(_AXLF_PREFIX, out, 0, "axlf header", MAGIC, h.signature_length, b"\xff" * 28, h.key_block, h.unique_id)
    _pack(_AXLF_HEADER, out, _AXLF_PREFIX.size, "axlf header", length, h.timestamp, h.feature_rom_timestamp,
          h.version_patch, h.version_major, h.version_minor, h.mode, h.action_mask, h.interface_uuid, vbnv, h.uuid,
          h.debug_bin, count)


def _encode_content(s: Section) -> bytes:
    where = f"{s.kind_name} section {s.name!r}"
    c = s.content
    if isinstance(c, (bytes, bytearray, memoryview)):
        return bytes(c)
    if isinstance(c, MemTopology):
        return _encode_records(_MEM_COUNT, _MEM_DATA, where, [
            (m.type, m.used, m.size_kb, m.base_address, _fixed_bytes(m.tag, 16, where, "m_tag")) for m in c.entries])
    if isinstance(c, Connectivity):
        return _encode_records(_CONNECTION_COUNT, _CONNECTION, where, [
            (e.arg_index, e.ip_layout_index, e.mem_data_index) for e in c.entries])
    if isinstance(c, IpLayout):
        return _encode_records(_IP_COUNT, _IP_DATA, where, [
            (e.type, e.properties, e.base_address, _fixed_bytes(e.name, 64, where, "m_name")) for e in c.entries])
    if isinstance(c, EmbeddedMetadata):
        return c.xml.encode("utf-8")
    if isinstance(c, AiePartition):
        return _PartitionWriter(c, where).encode()
    raise XclbinError(f"{where}: content of type {type(c).__name__} cannot be written")


def _encode_records(count: struct.Struct, item: struct.Struct, where: str, records: list[tuple[Any, ...]]) -> bytes:
    out = bytearray(count.size + item.size * len(records))
    _pack(count, out, 0, where, len(records))
    for i, r in enumerate(records):
        _pack(item, out, count.size + i * item.size, f"{where} entry {i}", *r)
    return bytes(out)


class _PartitionWriter:
    """Lays out AIE_PARTITION: struct, then referenced data appended 8-byte aligned (offsets from the start)."""

    def __init__(self, p: AiePartition, where: str) -> None:
        self.p = p
        self.where = where
        self.out = bytearray(_PARTITION.size)

    def add(self, blob: bytes | memoryview) -> int:
        self.out.extend(b"\0" * (_align(len(self.out)) - len(self.out)))
        offset = len(self.out)
        self.out.extend(blob)
        return offset

    def string(self, text: str, name: str) -> int:
        raw = text.encode("utf-8")
        if b"\0" in raw:
            raise XclbinError(f"{self.where}: {name} {text!r} contains a NUL")
        return self.add(raw + b"\0")

    def array(self, item: str, values: Sequence[int], name: str) -> int:
        try:
            return self.add(struct.pack(f"<{len(values)}{item}", *values))
        except struct.error as e:
            raise XclbinError(f"{self.where}: {name} does not fit its element type ({e})") from None

    def encode(self) -> bytes:
        p = self.p
        name_off = self.string(p.name, "mpo_name")
        commit_off = self.string(p.kernel_commit_id, "kernel_commit_id")
        cols_off = self.array("H", p.start_columns, "start_columns")
        records = [self.pdi(pdi, i) for i, pdi in enumerate(p.pdis)]
        pdis_off = self.add(b"".join(records))
        _pack(_PARTITION, self.out, 0, self.where, p.schema_version, name_off, p.operations_per_cycle,
              p.inference_fingerprint, p.pre_post_fingerprint, p.column_width, len(p.start_columns), cols_off,
              len(p.pdis), pdis_off, commit_off)
        return bytes(self.out)

    def pdi(self, pdi: Pdi, index: int) -> bytes:
        name = f"aie_pdi[{index}]"
        if len(pdi.uuid) != 16:
            raise XclbinError(f"{self.where}: {name}.uuid must be 16 bytes, got {len(pdi.uuid)}")
        image_off = self.add(pdi.image)
        groups = b"".join(self.cdo_group(g, f"{name}.cdo_groups[{i}]") for i, g in enumerate(pdi.cdo_groups))
        groups_off = self.add(groups)
        record = bytearray(_AIE_PDI.size)
        _pack(_AIE_PDI, record, 0, f"{self.where} {name}", pdi.uuid, len(pdi.image), image_off,
              len(pdi.cdo_groups), groups_off)
        return bytes(record)

    def cdo_group(self, g: CdoGroup, name: str) -> bytes:
        name_off = self.string(g.name, f"{name}.mpo_name")
        ids_off = self.array("Q", g.dpu_kernel_ids, f"{name}.dpu_kernel_ids")
        pre_off = self.array("I", g.pre_cdo_groups, f"{name}.pre_cdo_groups")
        record = bytearray(_CDO_GROUP.size)
        _pack(_CDO_GROUP, record, 0, f"{self.where} {name}", name_off, g.type, g.pdi_id, len(g.dpu_kernel_ids),
              ids_off, len(g.pre_cdo_groups), pre_off)
        return bytes(record)


# --------------------------------------------------------------------------------------------- mlir-aie builder


# What aiecc/xclbinutil put in an mlir-aie xclbin (docs/xrt-sequence.md 2.1, 3.4-3.8, the npu1_1col fixture).
_MLIR_AIE_VERSION = (2, 23, 0)
_MLIR_AIE_MEM = (MemData(type=MEM_DRAM, used=1, size_kb=0x10000, base_address=0x4000000, tag="HOST"),
                 MemData(type=MEM_DRAM, used=1, size_kb=0xC000, base_address=0x4000000, tag="SRAM"))
_HOST_BANK, _SRAM_BANK = 0, 1
_INFERENCE_FINGERPRINT = 23423
_PRE_POST_FINGERPRINT = 12345
_PRE_CDO_GROUP = 0xC1
_PDI_ID = 0x01
_NO_BASE_ADDRESS = 0xFFFF_FFFF_FFFF_FFFF
# aiecc emit_partition: start_columns = range(1, 6 - ncols) for partial-array devices (docs/xrt-sequence.md 3.8).
_NPU1_COLUMNS_PLUS_ONE = 6


def build_mlir_aie(pdi: bytes, *, column_width: int = 1, start_columns: Sequence[int] | None = None,
                   kernel: str = "MLIR_AIE", instance: str = "MLIRAIE", dpu_kernel_id: int = 0x901,
                   functional: int = 0, ops_per_cycle: int = 2048, uuid: bytes | None = None,
                   n_buffers: int = 5) -> Xclbin:
    """An xclbin as aiecc + xclbinutil write it for one PDI and the standard mlir-aie kernel.

    Arguments ``opcode`` (u64 @0), ``instr`` (@8), ``ninstr`` (u32 @0x10), ``bo0..bo{n-1}`` (@0x14 + 8i)
    (docs/xrt-sequence.md 2.1); IP_LAYOUT ``kernel:instance`` of type PS_KERNEL with subtype DPU, ``functional`` and the
    kernel id; MEM_TOPOLOGY banks HOST/SRAM and CONNECTIVITY (instr -> SRAM, buffers -> HOST) like mlir-aie.
    Without ``uuid`` a deterministic one is derived from the contents.

    Raises:
        ValueError: an argument is out of range.
    """
    _check_build_args(column_width, dpu_kernel_id, functional, n_buffers, uuid)
    columns = tuple(range(1, _NPU1_COLUMNS_PLUS_ONE - column_width)) if start_columns is None else tuple(start_columns)
    args = _mlir_aie_args(n_buffers)
    k = Kernel(name=kernel, type="dpu", language="c", dpu_kernel_id=dpu_kernel_id, functional=functional,
               subtype=ST_DPU, instances=(instance,), args=args)
    digest = hashlib.sha256(b"".join([pdi, repr((column_width, columns, k, ops_per_cycle)).encode()])).digest()
    xclbin_uuid = uuid if uuid is not None else digest[:16]
    group = CdoGroup(name="DPU", type=CT_PRIMARY, pdi_id=_PDI_ID, dpu_kernel_ids=(dpu_kernel_id,),
                     pre_cdo_groups=(_PRE_CDO_GROUP,))
    partition = AiePartition(
        schema_version=0, name="", operations_per_cycle=ops_per_cycle, inference_fingerprint=_INFERENCE_FINGERPRINT,
        pre_post_fingerprint=_PRE_POST_FINGERPRINT, column_width=column_width, start_columns=columns,
        pdis=(Pdi(uuid=digest[16:32], image=bytes(pdi), cdo_groups=(group,)),), kernel_commit_id="")
    properties = (ST_DPU << abi.IP_PS_KERNEL_SUBTYPE_SHIFT | functional << abi.IP_PS_KERNEL_FUNCTIONAL_SHIFT
                  | dpu_kernel_id << abi.IP_PS_KERNEL_KERNEL_ID_SHIFT)
    ip = IpLayout((Ip(type=IP_PS_KERNEL, properties=properties, base_address=_NO_BASE_ADDRESS,
                      name=f"{kernel}:{instance}"),))
    connections = (Connection(1, 0, _SRAM_BANK),) + tuple(Connection(3 + i, 0, _HOST_BANK) for i in range(n_buffers))
    sections = (
        Section(MEM_TOPOLOGY, "main_mem_topolo", MemTopology(_MLIR_AIE_MEM)),
        Section(AIE_PARTITION, "main_aie_partit", partition),
        Section(EMBEDDED_METADATA, "", EmbeddedMetadata.from_kernels([k])),
        Section(IP_LAYOUT, "", ip),
        Section(CONNECTIVITY, "", Connectivity(connections)),
        # xclbinutil lists the group connectivity twice (docs/xrt-sequence.md 3.5); the group topology equals
        # MEM_TOPOLOGY.
        Section(ASK_GROUP_CONNECTIVITY, "", Connectivity(connections + connections)),
        Section(ASK_GROUP_TOPOLOGY, "", MemTopology(_MLIR_AIE_MEM)),
    )
    return Xclbin(header=_mlir_aie_header(xclbin_uuid), sections=sections)


def _check_build_args(column_width: int, dpu_kernel_id: int, functional: int, n_buffers: int,
                      uuid: bytes | None) -> None:
    if not 1 <= column_width <= 0xFFFF:
        raise ValueError(f"build_mlir_aie: column_width {column_width} out of range")
    if not 0 <= dpu_kernel_id <= abi.IP_PS_KERNEL_KERNEL_ID_MASK:
        raise ValueError(f"build_mlir_aie: dpu_kernel_id 0x{dpu_kernel_id:x} does not fit the 12-bit m_kernel_id")
    if not 0 <= functional <= abi.IP_PS_KERNEL_FUNCTIONAL_MASK:
        raise ValueError(f"build_mlir_aie: functional {functional} does not fit 2 bits")
    if not 0 <= n_buffers <= 64:
        raise ValueError(f"build_mlir_aie: n_buffers {n_buffers} out of range 0..64")
    if uuid is not None and len(uuid) != 16:
        raise ValueError(f"build_mlir_aie: uuid must be 16 bytes, got {len(uuid)}")


def _mlir_aie_args(n_buffers: int) -> tuple[KernelArg, ...]:
    fixed = (KernelArg("opcode", 0, 0x00, 8, "scalar", "uint64_t"),
             KernelArg("instr", 1, 0x08, 8, "global", "char *"),
             KernelArg("ninstr", 2, 0x10, 4, "scalar", "uint32_t"))
    return fixed + tuple(KernelArg(f"bo{i}", 3 + i, 0x14 + 8 * i, 8, "global", "void*") for i in range(n_buffers))


def _mlir_aie_header(uuid: bytes) -> Header:
    major, minor, patch = _MLIR_AIE_VERSION
    return Header(uuid=bytes(uuid), version_major=major, version_minor=minor, version_patch=patch, mode=0,
                  action_mask=0, platform_vbnv="", timestamp=0, feature_rom_timestamp=0, unique_id=0,
                  interface_uuid=bytes(16), debug_bin=bytes(16), signature_length=-1, key_block=b"\xff" * 256)
