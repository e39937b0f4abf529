"""Proofs that headers/*.h, and so amdxdna_direct.abi, describe the real ABI.

Oracles, each independent of cffi's reading of our headers:
  (a) gcc compiling the same headers (sizeof / offsetof / bit positions / constant values);
  (b) the system's own headers: libdrm's drm.h, XRT's xclbin.h and ert.h, glibc's sys/mman.h;
  (c) the facts in docs/ (docs/uapi.md Appendix A, the request tables of docs/uapi.md, the axlf
      offsets of docs/xrt-sequence.md section 3) and a real xclbin with the JSON it was built from.
Plus: a header copy with two fields swapped is reported, and the wheel carries the headers and
imports in a clean venv with no compiler on PATH.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from fixture_files import REPO_FIXTURES, SHARED
from pycparser import c_ast, c_parser  # type: ignore[import-untyped]  # ships no type information

from amdxdna_direct import abi

if TYPE_CHECKING:
    import _cffi_backend
    import cffi

    #: An FFI a proof reads: the module's (cffi's out-of-line object) or one parsed from headers (``abi.build_ffi``).
    FFI = _cffi_backend.FFI | cffi.FFI

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
HEADERS = REPO / "headers"
SPEC = SHARED / "spec"
FIXTURE_NPU1 = REPO_FIXTURES / "xdna" / "mlir-aie-npu1_1col"
GCC = shutil.which("gcc")

# .ci/run installs gcc, libdrm-dev, libxrt-dev and wheel: there a missing one fails the proof instead of skipping it.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def requires(available: bool, reason: str) -> pytest.MarkDecorator:
    """Mark a test that needs a tool or file: skipped with ``reason`` when absent, failed when absent in CI."""
    return pytest.mark.requires(available=available, reason=reason)


@pytest.fixture(autouse=True)
def _check_requirements(request: pytest.FixtureRequest) -> None:
    for mark in request.node.iter_markers("requires"):
        if not mark.kwargs["available"]:
            if IN_CI:
                pytest.fail(f"{mark.kwargs['reason']}; .ci/run installs it, so CI must run this proof")
            pytest.skip(mark.kwargs["reason"])


def matched(pattern: str, text: str, flags: int = 0) -> re.Match[str]:
    """The first match of ``pattern`` in ``text``; the test fails when there is none."""
    match = re.search(pattern, text, flags)
    assert match is not None, f"{pattern!r} not found in {text[:200]!r}"
    return match


def present(found: T | None) -> T:
    """What a test's ``requires`` mark made sure of (without it the test is skipped, or failed in CI)."""
    if found is None:
        pytest.fail("a test ran without the tool or header it needs: its requires mark is missing")
    return found


needs_gcc = requires(GCC is not None, "gcc is not on PATH (apt-get install gcc)")
needs_spec = pytest.mark.skipif(not SPEC.is_dir(), reason=f"{SPEC} is absent (shared/ must sit beside the repo)")


# ---------------------------------------------------------------------------------------------
# Layout model shared by every oracle

@dataclass(frozen=True)
class Field:
    """Where a member lives: byte offset and size, or (first bit, width) for a bit-field."""

    offset: int | None
    size: int | None  # None for a flexible array member
    bits: tuple[int, int] | None = None


@dataclass(frozen=True)
class Layout:
    size: int
    align: int
    fields: dict[str, Field]


FIELD, FLEX, BIT = "field", "flex", "bit"


def compare_layouts(reference: dict[str, Layout], ours: dict[str, Layout], oracle: str) -> list[str]:
    """List every struct/field of ``reference`` that ``ours`` lacks or places differently."""
    problems = []
    for tag, ref in sorted(reference.items()):
        mine = ours.get(tag)
        if mine is None:
            problems.append(f"{tag}: not declared in headers/ ({oracle} has it)")
            continue
        if (mine.size, mine.align) != (ref.size, ref.align):
            problems.append(f"{tag}: size/align {mine.size}/{mine.align}, {oracle} says {ref.size}/{ref.align}")
        for path, field in ref.fields.items():
            if path not in mine.fields:
                problems.append(f"{tag}.{path}: missing in headers/ ({oracle} has it)")
            elif mine.fields[path] != field:
                problems.append(f"{tag}.{path}: headers/ {mine.fields[path]}, {oracle} {field}")
    return problems


def compare_constants(reference: dict[str, int], ours: dict[str, int], oracle: str) -> list[str]:
    """List every constant of ``reference`` that ``ours`` lacks or values differently."""
    problems = []
    for name, value in sorted(reference.items()):
        if name not in ours:
            problems.append(f"{name}: missing in headers/ ({oracle} = {value})")
        elif ours[name] != value:
            problems.append(f"{name}: headers/ {ours[name]}, {oracle} {value}")
    return problems


# ---------------------------------------------------------------------------------------------
# cffi's view

def cffi_layouts(ffi: FFI) -> dict[str, Layout]:
    """Every struct and union of a cdef, with all members (anonymous members flattened as C does)."""
    _, structs, unions = ffi.list_types()
    tags = [f"struct {name}" for name in structs] + [f"union {name}" for name in unions]
    return {tag: Layout(ffi.sizeof(tag), ffi.alignof(tag), dict(_cffi_fields(ffi, ffi.typeof(tag), "", 0)))
            for tag in tags}


def _cffi_fields(ffi: FFI, ctype: cffi.FFI.CType, prefix: str, base: int) -> Iterator[tuple[str, Field]]:
    for name, field in ctype.fields:
        path, offset, ftype = prefix + name, base + field.offset, field.type
        if field.bitsize >= 0:
            yield path, Field(None, None, (offset * 8 + field.bitshift, field.bitsize))
            continue
        flexible = ftype.kind == "array" and ftype.length is None
        yield path, Field(offset, None if flexible else ffi.sizeof(ftype))
        # a named member of an anonymous struct type: cffi lists that type nowhere else
        if ftype.kind in ("struct", "union") and "$" in ftype.cname:
            yield from _cffi_fields(ffi, ftype, path + ".", offset)


def member_kinds(layout: Layout) -> dict[str, str]:
    """What the C probe must print for each member of a cffi layout."""
    return {path: BIT if f.bits else FLEX if f.size is None else FIELD for path, f in layout.fields.items()}


# ---------------------------------------------------------------------------------------------
# gcc's view: one generated C program per oracle

PROBE_PRELUDE = r"""
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
static void probe_bits(const char *tag, const char *path, const unsigned char *raw, size_t n) {
    size_t first = (size_t)-1, count = 0;
    for (size_t i = 0; i < n * 8; i++)
        if ((raw[i / 8] >> (i % 8)) & 1) { if (first == (size_t)-1) first = i; count++; }
    printf("B|%s|%s|%zu|%zu\n", tag, path, first, count);
}
#define PROBE_BITS(T, P) do { T v; memset(&v, 0, sizeof v); v.P = 0; v.P--; \
    probe_bits(#T, #P, (const unsigned char *)&v, sizeof v); } while (0)
#define PROBE_CONST(N) do { if ((N) < 0) printf("C|%s|%lld\n", #N, (long long)(N)); \
    else printf("C|%s|%llu\n", #N, (unsigned long long)(N)); } while (0)
"""


def probe_source(includes: str, structs: dict[str, dict[str, str]], constants: list[str], extra: str = "") -> str:
    """C source printing sizeof/alignof/offsetof/bit positions of ``structs`` and the values of ``constants``."""
    lines = [PROBE_PRELUDE, includes, extra, "int main(void) {"]
    for tag, members in structs.items():
        lines.append(f'printf("S|%s|%zu|%zu\\n", "{tag}", sizeof({tag}), _Alignof({tag}));')
        for path, kind in members.items():
            if kind == BIT:
                lines.append(f"PROBE_BITS({tag}, {path});")
            elif kind == FLEX:
                lines.append(f'printf("F|%s|%s|%zu|-\\n", "{tag}", "{path}", offsetof({tag}, {path}));')
            else:
                lines.append(f'printf("F|%s|%s|%zu|%zu\\n", "{tag}", "{path}", offsetof({tag}, {path}), '
                             f"sizeof((({tag} *)0)->{path}));")
    lines += [f"PROBE_CONST({name});" for name in constants]
    lines += ["return 0;", "}"]
    return "\n".join(lines)


def run_probe(source: str, workdir: Path, flags: tuple[str, ...] = ()) -> tuple[dict[str, Layout], dict[str, int]]:
    """Compile and run a probe with gcc; parse what it prints."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "probe.c").write_text(source)
    cmd = [present(GCC), "-std=gnu11", "-O0", "-Wall", "-Werror=incompatible-pointer-types",
           "-Werror=implicit-function-declaration", *flags, "-o", str(workdir / "probe"), str(workdir / "probe.c")]
    built = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        pytest.fail(f"gcc failed on {workdir / 'probe.c'}:\n{built.stderr[:4000]}")
    output = subprocess.run([str(workdir / "probe")], capture_output=True, text=True, check=True).stdout
    return parse_probe(output)


def parse_probe(output: str) -> tuple[dict[str, Layout], dict[str, int]]:
    sizes: dict[str, tuple[int, int]] = {}
    fields: dict[str, dict[str, Field]] = {}
    constants: dict[str, int] = {}
    for line in output.splitlines():
        kind, *rest = line.split("|")
        if kind == "S":
            sizes[rest[0]] = (int(rest[1]), int(rest[2]))
            fields[rest[0]] = {}
        elif kind == "F":
            fields[rest[0]][rest[1]] = Field(int(rest[2]), None if rest[3] == "-" else int(rest[3]))
        elif kind == "B":
            fields[rest[0]][rest[1]] = Field(None, None, (int(rest[2]), int(rest[3])))
        elif kind == "C":
            constants[rest[0]] = int(rest[1])
    layouts = {tag: Layout(size, align, fields[tag]) for tag, (size, align) in sizes.items()}
    return layouts, constants


# ---------------------------------------------------------------------------------------------
# reading struct / enum definitions out of a foreign header (names only; numbers come from gcc)

_PARSER_TYPES = ("__u8 __u16 __u32 __u64 __s8 __s16 __s32 __s64 __kernel_size_t size_t bool xuid_t uuid_t "
                 "uint8_t uint16_t uint32_t uint64_t int8_t int16_t int32_t int64_t").split()


def strip_c(text: str) -> str:
    """Drop comments and preprocessor lines (drm.h has #defines inside struct bodies)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def extract_block(text: str, keyword: str, name: str) -> str | None:
    """The ``keyword name { ... };`` definition in ``text``, or None."""
    match = re.search(rf"\b{keyword}\s+{re.escape(name)}\s*\{{", text)
    if match is None:
        return None
    depth = 0
    for index in range(match.end() - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[match.start():index + 1] + ";"
    return None


def foreign_definitions(header: Path, struct_names: Iterable[str],
                        enum_names: Iterable[str]) -> tuple[dict[str, dict[str, str]], dict[str, list[str]]]:
    """Members (path -> kind) of each named struct, and enumerator names of each named enum, found in ``header``."""
    text = strip_c(header.read_text(errors="replace"))
    prelude = "typedef int " + ", ".join(_PARSER_TYPES) + ";\n"
    structs, enums = {}, {}
    for name in struct_names:
        block = extract_block(text, "struct", name)
        if block is not None:
            node = c_parser.CParser().parse(prelude + block).ext[-1].type
            structs[f"struct {name}"] = dict(_ast_members(node.decls, ""))
    for name in enum_names:
        block = extract_block(text, "enum", name)
        if block is not None:
            node = c_parser.CParser().parse(prelude + block).ext[-1].type
            enums[name] = [item.name for item in node.values.enumerators]
    return structs, enums


def _ast_members(decls: Iterable[Any] | None, prefix: str) -> Iterator[tuple[str, str]]:  # pycparser nodes
    for decl in decls or ():
        dtype = decl.type
        if decl.name is None:  # anonymous struct/union member: its members belong to the parent
            yield from _ast_members(dtype.decls, prefix)
            continue
        path = prefix + decl.name
        if decl.bitsize is not None:
            yield path, BIT
        elif isinstance(dtype, c_ast.ArrayDecl) and dtype.dim is None:
            yield path, FLEX
        else:
            yield path, FIELD
            inner = getattr(dtype, "type", None)
            if isinstance(inner, (c_ast.Struct, c_ast.Union)) and inner.name is None and inner.decls:
                yield from _ast_members(inner.decls, path + ".")


def defined_macros(header: Path) -> set[str]:
    return set(re.findall(r"^\s*#\s*define\s+(\w+)", header.read_text(errors="replace"), flags=re.M))


# ---------------------------------------------------------------------------------------------
# our side, for a given FFI (the real one, or one built from an altered copy)

def our_constants(ffi: FFI) -> dict[str, int]:
    return abi.integer_constants(ffi.dlopen(None))


def our_enums(ffi: FFI, directory: Path) -> dict[str, dict[str, int]]:
    """Enumerators of each enum tag declared in our headers, by tag."""
    return {name: dict(ffi.typeof(f"enum {name}").relements) for name in enum_tags(directory)}


def enum_tags(directory: Path) -> list[str]:
    """Enum tags declared in our headers (cffi does not list enums)."""
    text = "\n".join((directory / name).read_text() for name in abi.HEADER_FILES)
    return re.findall(r"\benum\s+(\w+)\s*\{", text)


def with_ert_header_bits(ffi: FFI, layouts: dict[str, Layout]) -> dict[str, Layout]:
    """Add the ERT_HDR_<FIELD>_SHIFT/_MASK constants as bit-fields of every ert struct's ``header`` word.

    XRT declares the header as C bit-fields; we declare a plain word plus shift/mask pairs
    (headers/ert.h), so this is how the two are compared bit for bit.
    """
    constants = our_constants(ffi)
    bits = {}
    for name, shift in constants.items():
        match = re.fullmatch(r"ERT_HDR_(\w+)_SHIFT", name)
        if match is None:
            continue
        mask = constants[f"ERT_HDR_{match.group(1)}_MASK"]
        width = mask.bit_length()
        bits[match.group(1).lower()] = (shift, width if mask == (1 << width) - 1 else -1)
    result = dict(layouts)
    for tag, layout in layouts.items():
        if tag.startswith("struct ert_") and "header" in layout.fields:
            header = layout.fields["header"].offset
            assert header is not None, f"{tag}.header is a bit-field"
            base = header * 8
            extra = {path: Field(None, None, (base + shift, width)) for path, (shift, width) in bits.items()}
            result[tag] = Layout(layout.size, layout.align, {**layout.fields, **extra})
    return result


# ---------------------------------------------------------------------------------------------
# (a) gcc vs cffi on headers/

OUR_INCLUDES = "\n".join(f'#include "{name}"' for name in abi.HEADER_FILES)


def _gcc_on_our_headers(workdir: Path,
                        directory: Path) -> tuple[dict[str, Layout], tuple[dict[str, Layout], dict[str, int]]]:
    ffi = abi.build_ffi(directory)
    mine = cffi_layouts(ffi)
    source = probe_source(OUR_INCLUDES, {tag: member_kinds(layout) for tag, layout in mine.items()},
                          sorted(our_constants(ffi)))
    return mine, run_probe(source, workdir, ("-I", str(directory)))


@needs_gcc
def test_gcc_and_cffi_agree_on_every_struct_and_field(tmp_path: Path) -> None:
    mine, (gcc_layouts, _) = _gcc_on_our_headers(tmp_path, HEADERS)
    assert len(mine) >= 60, "the cdef should declare the whole uAPI, DRM, ERT and axlf set"
    assert set(gcc_layouts) == set(mine)
    assert compare_layouts(gcc_layouts, mine, "gcc") == []
    assert compare_layouts(mine, gcc_layouts, "cffi") == []


@needs_gcc
def test_gcc_and_cffi_agree_on_every_constant(tmp_path: Path) -> None:
    _, (_, gcc_constants) = _gcc_on_our_headers(tmp_path, HEADERS)
    mine = our_constants(abi.ffi)
    assert len(mine) > 100
    assert compare_constants(gcc_constants, mine, "gcc") == []
    # ... and the module re-exports each of them under its C name
    assert {name: getattr(abi, name) for name in mine} == mine


# ---------------------------------------------------------------------------------------------
# (b) against the system headers

def dpkg_header(package: str, suffixes: tuple[str, ...]) -> tuple[Path, str] | None:
    """(include root, relative path) of the first file of ``package`` ending in one of ``suffixes``."""
    listing = ""
    if shutil.which("dpkg"):
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=False).stdout
    fallbacks = [f"/usr/include/{suffix}" for suffix in suffixes]
    for line in listing.splitlines() + fallbacks:
        for suffix in suffixes:
            if line.endswith("/" + suffix) and Path(line).is_file():
                return Path(line[: -len(suffix)]), suffix
    return None


def request_numbers() -> dict[str, int]:
    """Every DRM_IOCTL_* request number of the abi module (DRM_IOCTL_BASE is the type byte, not a request)."""
    return {name: getattr(abi, name) for name in dir(abi) if name.startswith("DRM_IOCTL_") and name != "DRM_IOCTL_BASE"}


def system_comparison(ffi: FFI, directory: Path, header: tuple[Path, str], includes: str, workdir: Path) -> list[str]:
    """Every struct / field / mirrored enum / shared macro of a system header, compared with ours."""
    root, relative = header
    path = root / relative
    mine = with_ert_header_bits(ffi, cffi_layouts(ffi))
    struct_names = [tag.split(" ", 1)[1] for tag in mine if tag.startswith("struct ")]
    theirs, their_enums = foreign_definitions(path, struct_names, enum_tags(directory))
    constants = our_constants(ffi)
    requests = request_numbers()
    macros = defined_macros(path)
    shared_macros = sorted(macros & (set(constants) | set(requests)))
    enumerators = sorted({item for items in their_enums.values() for item in items})
    source = probe_source(includes, theirs, shared_macros + enumerators)
    layouts, values = run_probe(source, workdir, ("-I", str(root)))
    problems = compare_layouts(layouts, mine, relative)
    problems += compare_constants({name: values[name] for name in shared_macros}, {**constants, **requests}, relative)
    mine_enums = our_enums(ffi, directory)
    for tag, items in their_enums.items():
        problems += compare_constants({item: values[item] for item in items}, mine_enums.get(tag, {}),
                                      f"{relative} enum {tag}")
    if not theirs:
        problems.append(f"{relative}: none of our structs found (wrong header?)")
    return problems


DRM_H = dpkg_header("libdrm-dev", ("libdrm/drm.h",))
XCLBIN_H = dpkg_header("libxrt-dev", ("xrt/detail/xclbin.h", "xrt/xclbin.h"))
ERT_H = dpkg_header("libxrt-dev", ("xrt/detail/ert.h", "xrt/ert.h"))
needs_drm_h = requires(DRM_H is not None, "libdrm drm.h not installed (apt-get install libdrm-dev)")
needs_xrt_h = requires(XCLBIN_H is not None and ERT_H is not None,
                       "XRT xclbin.h/ert.h not installed (apt-get install libxrt-dev uuid-dev)")


def drm_includes() -> str:
    return f"#include <fcntl.h>\n#include <{present(DRM_H)[1]}>"


@needs_gcc
@needs_drm_h
def test_drm_subset_matches_libdrm(tmp_path: Path) -> None:
    problems = system_comparison(abi.ffi, HEADERS, present(DRM_H), drm_includes(), tmp_path)
    assert problems == []


@needs_gcc
@needs_drm_h
def test_drm_comparison_covers_every_drm_struct_and_request(tmp_path: Path) -> None:
    # the comparison above is only worth something if it saw our structs and requests
    root, relative = present(DRM_H)
    path = root / relative
    structs, _ = foreign_definitions(path, [tag[7:] for tag in cffi_layouts(abi.ffi) if tag.startswith("struct drm_")],
                                     [])
    assert len(structs) == 10
    assert {"DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT", "DRM_IOCTL_GEM_CLOSE", "DRM_IOCTL_VERSION"} <= defined_macros(path)


@needs_gcc
@needs_xrt_h
def test_axlf_structs_match_xrt(tmp_path: Path) -> None:
    includes = f"#include <{present(XCLBIN_H)[1]}>"
    problems = system_comparison(abi.ffi, HEADERS, present(XCLBIN_H), includes, tmp_path)
    assert problems == []


@needs_gcc
@needs_xrt_h
def test_ert_structs_and_header_bits_match_xrt(tmp_path: Path) -> None:
    includes = f"#include <stdbool.h>\n#include <{present(ERT_H)[1]}>"
    problems = system_comparison(abi.ffi, HEADERS, present(ERT_H), includes, tmp_path)
    assert problems == []
    root, relative = present(ERT_H)
    structs, enums = foreign_definitions(root / relative, ["ert_packet", "ert_start_kernel_cmd"],
                                         ["ert_cmd_opcode", "ert_cmd_state"])
    assert structs["struct ert_start_kernel_cmd"]["count"] == BIT, "XRT's bit-fields are what gets compared"
    assert "ERT_START_CU" in enums["ert_cmd_opcode"]


@needs_gcc
def test_libc_subset_matches_glibc(tmp_path: Path) -> None:
    text = (HEADERS / "libc.h").read_text()
    mine = our_constants(abi.build_ffi(HEADERS))
    names = sorted(set(re.findall(r"^#define\s+(\w+)", text, flags=re.M)))
    # each prototype becomes a pointer initialised with glibc's function: gcc rejects a mismatch
    checks = []
    for ret, name, params in re.findall(r"^([\w \*]+?)\s*\b(\w+)\((.*)\);$", text, flags=re.M):
        checks.append(f"static {ret} (*probe_{name})({params}) = {name};")
    assert len(checks) == 2
    source = probe_source("#include <sys/mman.h>", {}, names, "\n".join(checks))
    _, values = run_probe(source, tmp_path)
    assert compare_constants(values, {name: mine[name] for name in names}, "sys/mman.h") == []


# ---------------------------------------------------------------------------------------------
# (c) the spec facts

def read_facts(*paths: Path) -> tuple[dict[str, int], dict[tuple[str, str], int], dict[str, int]]:
    """Struct sizes, field offsets, and NAME=value lines of docs/uapi.md Appendix A."""
    sizes, offsets, values = {}, {}, {}
    for path in paths:
        for line in path.read_text().splitlines():
            if match := re.fullmatch(r"struct (\w+) size=(\d+)", line.strip()):
                sizes[match.group(1)] = int(match.group(2))
            elif match := re.fullmatch(r"(\w+)\.(\w+) off=(\d+)", line.strip()):
                offsets[(match.group(1), match.group(2))] = int(match.group(3))
            elif "=" in line:
                values.update(_fact_values(line.split()))
            elif line.strip():
                raise ValueError(f"{path.name}: unrecognised fact line {line!r}")
    return sizes, offsets, values


def _fact_values(tokens: list[str]) -> dict[str, int]:
    # "DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL=1 WAIT_FOR_SUBMIT=2": later tokens reuse the first one's prefix
    first, _, first_value = tokens[0].partition("=")
    values = {first: int(first_value, 0)}
    for token in tokens[1:]:
        suffix, _, value = token.partition("=")
        prefixes = [first[:i] for i in range(1, len(first)) if first[i - 1] == "_"]
        matches = [p + suffix for p in prefixes if hasattr(abi, p + suffix)]
        values[matches[-1] if matches else suffix] = int(value, 0)
    return values


def facts_mismatches(ffi: FFI, sizes: dict[str, int], offsets: dict[tuple[str, str], int]) -> list[str]:
    problems = []
    for name, size in sorted(sizes.items()):
        if ffi.sizeof(f"struct {name}") != size:
            problems.append(f"struct {name}: sizeof {ffi.sizeof(f'struct {name}')}, facts say {size}")
    for (name, field), offset in sorted(offsets.items()):
        if ffi.offsetof(f"struct {name}", field) != offset:
            problems.append(f"{name}.{field}: offset {ffi.offsetof(f'struct {name}', field)}, facts say {offset}")
    return problems


@cache
def spec_facts() -> tuple[dict[str, int], dict[tuple[str, str], int], dict[str, int]]:
    return read_facts(SPEC / "abi-facts-amdxdna.txt", SPEC / "abi-facts-drm.txt")


@needs_spec
def test_every_size_and_offset_of_the_abi_facts() -> None:
    sizes, offsets, _ = spec_facts()
    assert len(sizes) == 47 and len(offsets) == 224  # every line of both files was read (unknown lines raise)
    assert facts_mismatches(abi.ffi, sizes, offsets) == []


@needs_spec
def test_every_request_number_and_flag_of_the_abi_facts() -> None:
    _, _, values = spec_facts()
    assert len(values) == 24
    assert {name: getattr(abi, name, None) for name in values} == values


def spec_table_rows(markdown: str, start: str, end: str, pattern: str) -> list[tuple[str, ...]]:
    section = markdown[markdown.index(start):markdown.index(end)]
    return re.findall(pattern, section, flags=re.M)


@needs_spec
def test_amdxdna_request_table_of_spec_section_1a() -> None:
    text = (SPEC / "amdxdna-uapi.md").read_text()
    rows = spec_table_rows(text, "### 1a.", "### 1b.",
                           r"^\| (\d+) \| (\w+) \| ([^|]*)\| (\w+) \((\d+)\) \| (0x[0-9A-Fa-f]+) \|")
    assert len(rows) == 11
    for index, name, direction, struct, size, request in rows:
        number = getattr(abi, f"DRM_IOCTL_AMDXDNA_{name}")
        assert number == int(request, 16), name
        assert abi.ffi.sizeof(f"struct {struct}") == int(size)
        assert number & 0xFF == 0x40 + int(index)
        assert number >> 30 == (3 if "IOWR" in direction else 1), name
        assert abi.IOCTLS[number] == (name, f"struct {struct}")
    assert abi.DRM_IOCTL_AMDXDNA_WAIT_CMD_OOT == 0xC0106449  # docs/uapi.md 1a notes, the OOT IOWR encoding


@needs_spec
def test_drm_core_request_table_of_spec_section_5() -> None:
    text = (SPEC / "amdxdna-uapi.md").read_text()
    rows = spec_table_rows(text, "## 5. DRM core", "**Upstream wait model",
                           r"^\| ([A-Z_]+) \| (0x[0-9A-Fa-f]+) \| (\w+) \((\d+)[^|]*\| (0x[0-9A-Fa-f]+)")
    ours = {name for name in request_numbers() if "AMDXDNA" not in name}
    checked = set()
    for name, nr, struct, size, request in rows:
        if f"DRM_IOCTL_{name}" not in ours:
            continue  # rows for ioctls the project does not use (HANDLE_TO_FD, TRANSFER, EVENTFD)
        # the first size/request of a row is the older layout that headers/drm.h mirrors
        assert getattr(abi, f"DRM_IOCTL_{name}") == int(request, 16), name
        assert abi.ffi.sizeof(f"struct {struct}") == int(size), name
        assert getattr(abi, f"DRM_IOCTL_{name}") & 0xFF == int(nr, 16)
        checked.add(f"DRM_IOCTL_{name}")
    assert checked == ours


# axlf offsets worked out from docs/xrt-sequence.md 3.1, 3.2 and 3.8 (file / section offsets).
AXLF_OFFSETS = {
    "axlf": {"m_magic": 0x000, "m_signature_length": 0x008, "reserved": 0x00C, "m_keyBlock": 0x028,
             "m_uniqueId": 0x128, "m_header": 0x130, "m_sections": 0x1C8},
    "axlf_header": {"m_length": 0x00, "m_timeStamp": 0x08, "m_featureRomTimeStamp": 0x10, "m_versionPatch": 0x18,
                    "m_versionMajor": 0x1A, "m_versionMinor": 0x1B, "m_mode": 0x1C, "m_actionMask": 0x1E,
                    "rom_uuid": 0x20, "m_platformVBNV": 0x30, "uuid": 0x70, "m_debug_bin": 0x80,
                    "m_numSections": 0x90},
    "axlf_section_header": {"m_sectionKind": 0x00, "m_sectionName": 0x04, "m_sectionOffset": 0x18,
                            "m_sectionSize": 0x20},
    "mem_data": {"m_type": 0, "m_used": 1, "m_size": 8, "m_base_address": 16, "m_tag": 24},
    "connection": {"arg_index": 0, "m_ip_layout_index": 4, "mem_data_index": 8},
    "ip_data": {"m_type": 0, "properties": 4, "m_base_address": 8, "m_name": 16},
    "aie_partition": {"schema_version": 0x00, "padding0": 0x01, "mpo_name": 0x04, "operations_per_cycle": 0x08,
                      "padding": 0x0C, "inference_fingerprint": 0x10, "pre_post_fingerprint": 0x18, "info": 0x20,
                      "aie_pdi": 0x78, "kernel_commit_id": 0x80, "reserved": 0x84},
    # 3.8: info at 0x20 holds column_width @0x20, 6 pad, start_columns @0x28, 72 reserved
    "aie_partition_info": {"column_width": 0x00, "padding": 0x02, "start_columns": 0x08, "reserved": 0x10},
    "aie_pdi": {"uuid": 0x00, "pdi_image": 0x10, "cdo_groups": 0x18, "reserved": 0x20},
    "cdo_group": {"mpo_name": 0x00, "cdo_type": 0x04, "padding": 0x05, "pdi_id": 0x08, "dpu_kernel_ids": 0x10,
                  "pre_cdo_groups": 0x18, "reserved": 0x20},
    "array_offset": {"size": 0, "offset": 4},
}
AXLF_SIZES = {"axlf_header": 152, "axlf_section_header": 40, "mem_data": 40, "connection": 12, "ip_data": 80,
              "aie_partition": 184, "aie_partition_info": 88, "aie_pdi": 96, "cdo_group": 96, "array_offset": 8}


# ERT payload offsets from docs/uapi.md 6.2-6.5 (bytes after the header word / CU masks).
ERT_OFFSETS = {
    "ert_start_kernel_cmd": {"header": 0, "cu_mask": 4, "data": 8},                          # 6.2
    "ert_npu_data": {"instruction_buffer": 0, "instruction_buffer_size": 8, "instruction_prop_count": 12,
                     "data": 16},                                                              # 6.3
    "ert_npu_preempt_data": {"instruction_buffer": 0, "save_buffer": 8, "restore_buffer": 16,
                             "instruction_buffer_size": 24, "save_buffer_size": 28, "restore_buffer_size": 32,
                             "instruction_prop_count": 36, "data": 40},                       # 6.4
    "ert_cmd_chain_data": {"command_count": 0, "submit_index": 4, "error_index": 8, "reserved": 12,
                           "data": 24},                                                        # 6.5
}
ERT_SIZES = {"ert_npu_data": 16, "ert_npu_preempt_data": 40, "ert_cmd_chain_data": 24}


def flat_offsets(table: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    return {(struct, member): offset for struct, members in table.items() for member, offset in members.items()}


def test_axlf_layout_of_spec_section_3() -> None:
    assert facts_mismatches(abi.ffi, AXLF_SIZES, flat_offsets(AXLF_OFFSETS)) == []
    assert (abi.AIE_PARTITION, abi.MEM_TOPOLOGY, abi.IP_LAYOUT, abi.IP_PS_KERNEL, abi.CT_PRIMARY) == (32, 6, 8, 7, 1)


def test_ert_packet_layout_of_spec_section_6() -> None:
    ffi = abi.ffi
    # 6.1: header bit fields
    header = (abi.ERT_CMD_STATE_NEW | 15 << abi.ERT_HDR_COUNT_SHIFT | abi.ERT_START_CU << abi.ERT_HDR_OPCODE_SHIFT
              | abi.ERT_CU << abi.ERT_HDR_TYPE_SHIFT)
    # docs/xrt-sequence.md 1.7: the standard mlir-aie START_CU header (count 16)
    assert header + (1 << 12) == 0x30010001
    assert (abi.ERT_HDR_STATE_MASK, abi.ERT_HDR_EXTRA_CU_MASKS_SHIFT, abi.ERT_HDR_COUNT_MASK) == (0xF, 10, 0x7FF)
    assert (abi.ERT_HDR_OPCODE_SHIFT, abi.ERT_HDR_OPCODE_MASK, abi.ERT_HDR_TYPE_SHIFT) == (23, 0x1F, 28)
    # 3 / 1.7: opcodes and states
    assert (abi.ERT_START_CU, abi.ERT_START_DPU, abi.ERT_CMD_CHAIN, abi.ERT_START_NPU, abi.ERT_START_NPU_PREEMPT,
            abi.ERT_START_NPU_PREEMPT_ELF) == (0, 18, 19, 20, 21, 22)
    assert [abi.ERT_CMD_STATE_NEW, abi.ERT_CMD_STATE_COMPLETED, abi.ERT_CMD_STATE_ERROR, abi.ERT_CMD_STATE_ABORT,
            abi.ERT_CMD_STATE_TIMEOUT, abi.ERT_CMD_STATE_NORESPONSE] == [1, 4, 5, 6, 8, 9]
    # 6.2-6.5: payloads; a chain entry is a u64 (24 + 8*count bytes)
    assert facts_mismatches(ffi, ERT_SIZES, flat_offsets(ERT_OFFSETS)) == []
    assert ffi.sizeof("uint64_t") == ffi.sizeof(ffi.typeof("struct ert_cmd_chain_data").fields[-1][1].type.item)


@needs_spec
@needs_drm_h
@needs_xrt_h
def test_every_struct_and_field_of_the_headers_is_pinned_by_an_independent_oracle() -> None:
    # A moved or resized member changes its offset or its struct's size; the proofs above catch that for every
    # member some oracle other than cffi places: the facts files, the spec tables, libdrm's and XRT's headers.
    sizes, offsets, _ = spec_facts()
    pinned_sizes = set(sizes) | set(AXLF_SIZES) | set(ERT_SIZES)
    pinned = set(offsets) | set(flat_offsets(AXLF_OFFSETS)) | set(flat_offsets(ERT_OFFSETS))
    mine = cffi_layouts(abi.ffi)
    names = [tag.removeprefix("struct ") for tag in mine if tag.startswith("struct ")]
    for header in (DRM_H, XCLBIN_H, ERT_H):
        root, relative = present(header)
        theirs, _ = foreign_definitions(root / relative, names, [])
        for tag, members in theirs.items():
            pinned_sizes.add(tag.removeprefix("struct "))
            pinned.update((tag.removeprefix("struct "), path) for path in members)
    unpinned = [f"{tag} (size)" for tag in mine if tag.removeprefix("struct ") not in pinned_sizes]
    unpinned += [f"{tag}.{path}" for tag, layout in mine.items() for path in layout.fields
                 if (tag.removeprefix("struct "), path) not in pinned]
    assert len(mine) >= 60 and unpinned == []


@pytest.mark.skipif(not FIXTURE_NPU1.is_dir(), reason=f"{FIXTURE_NPU1} is absent")
def test_axlf_structs_decode_a_real_xclbin_as_its_build_json_says() -> None:
    ffi = abi.ffi
    data = (FIXTURE_NPU1 / "aie.xclbin").read_bytes()
    base = ffi.cast("char *", ffi.from_buffer(data))
    top = ffi.cast("struct axlf *", base)
    assert ffi.string(top.m_magic) == b"xclbin2"
    assert top.m_header.m_length == len(data) and top.m_header.m_numSections == 7
    headers = ffi.cast("struct axlf_section_header *", ffi.addressof(top, "m_sections"))
    sections = {headers[i].m_sectionKind: base + headers[i].m_sectionOffset for i in range(7)}

    partition_json = json.loads((FIXTURE_NPU1 / "main_aie_partition.json").read_text())["aie_partition"]
    section = sections[abi.AIE_PARTITION]
    part = ffi.cast("struct aie_partition *", section)
    assert part.operations_per_cycle == int(partition_json["operations_per_cycle"])
    assert part.inference_fingerprint == int(partition_json["inference_fingerprint"])
    assert part.pre_post_fingerprint == int(partition_json["pre_post_fingerprint"])
    assert part.info.column_width == partition_json["partition"]["column_width"]
    starts = ffi.cast("uint16_t *", section + part.info.start_columns.offset)
    assert [starts[i] for i in range(part.info.start_columns.size)] == partition_json["partition"]["start_columns"]

    assert part.aie_pdi.size == len(partition_json["PDIs"]) == 1
    pdi = ffi.cast("struct aie_pdi *", section + part.aie_pdi.offset)
    image = bytes(ffi.buffer(section + pdi.pdi_image.offset, pdi.pdi_image.size))
    assert len(image) == 2640 and image[:8] == bytes.fromhex("DD000000 44332211")  # docs/xrt-sequence.md 3.8
    group_json = partition_json["PDIs"][0]["cdo_groups"][0]
    group = ffi.cast("struct cdo_group *", section + pdi.cdo_groups.offset)
    assert ffi.string(section + group.mpo_name).decode() == group_json["name"]
    assert group.cdo_type == abi.CT_PRIMARY and group_json["type"] == "PRIMARY"
    assert group.pdi_id == int(group_json["pdi_id"], 16)
    for member, ctype in (("dpu_kernel_ids", "uint64_t *"), ("pre_cdo_groups", "uint32_t *")):
        array = getattr(group, member)
        items = ffi.cast(ctype, section + array.offset)
        assert [items[i] for i in range(array.size)] == [int(k, 16) for k in group_json[member]]

    topology_json = json.loads((FIXTURE_NPU1 / "main_mem_topology.json").read_text())["mem_topology"]
    topology = ffi.cast("struct mem_topology *", sections[abi.MEM_TOPOLOGY])
    banks = ffi.cast("struct mem_data *", ffi.addressof(topology, "m_mem_data"))
    assert topology.m_count == int(topology_json["m_count"])
    for i, bank in enumerate(topology_json["m_mem_data"]):
        assert (banks[i].m_type, banks[i].m_used) == (getattr(abi, bank["m_type"]), int(bank["m_used"]))
        assert banks[i].m_size == int(bank["m_sizeKB"], 16)
        assert banks[i].m_base_address == int(bank["m_base_address"], 16)
        assert ffi.string(banks[i].m_tag).decode() == bank["m_tag"]


# ---------------------------------------------------------------------------------------------
# the comparisons catch a moved field

def swap_fields(text: str, struct: str, first: str, second: str) -> str:
    """Swap two member declaration lines inside ``struct``'s body."""
    block = extract_block(text, "struct", struct)
    assert block is not None, f"struct {struct} is not defined here"
    a = matched(rf"^.*\b{first};$", block, re.M).group(0)
    b = matched(rf"^.*\b{second};$", block, re.M).group(0)
    swapped = block.replace(a, "\0").replace(b, a).replace("\0", b)
    return text.replace(block, swapped)


def altered_headers(tmp_path: Path, header: str, struct: str, first: str, second: str) -> Path:
    directory = tmp_path / "headers"
    shutil.copytree(HEADERS, directory)
    target = directory / header
    target.write_text(swap_fields(target.read_text(), struct, first, second))
    return directory


@needs_spec
def test_facts_comparison_reports_two_swapped_fields(tmp_path: Path) -> None:
    directory = altered_headers(tmp_path, "amdxdna_accel.h", "amdxdna_drm_create_bo", "vaddr", "size")
    sizes, offsets, _ = spec_facts()
    problems = facts_mismatches(abi.build_ffi(directory), sizes, offsets)
    assert problems == ["amdxdna_drm_create_bo.size: offset 8, facts say 16",
                        "amdxdna_drm_create_bo.vaddr: offset 16, facts say 8"]


@needs_gcc
@needs_drm_h
def test_libdrm_comparison_reports_two_swapped_fields(tmp_path: Path) -> None:
    directory = altered_headers(tmp_path, "drm.h", "drm_syncobj_timeline_wait", "handles", "points")
    problems = system_comparison(abi.build_ffi(directory), directory, present(DRM_H), drm_includes(),
                                 tmp_path / "probe")
    assert len(problems) == 2
    assert all(p.startswith("struct drm_syncobj_timeline_wait.") for p in problems)
    assert {p.split(":")[0].rsplit(".", 1)[1] for p in problems} == {"handles", "points"}


@needs_gcc
@needs_xrt_h
def test_xrt_and_spec_comparisons_report_two_swapped_axlf_fields(tmp_path: Path) -> None:
    directory = altered_headers(tmp_path, "xclbin.h", "axlf_section_header", "m_sectionOffset", "m_sectionSize")
    ffi = abi.build_ffi(directory)
    xclbin_h = present(XCLBIN_H)
    problems = system_comparison(ffi, directory, xclbin_h, f"#include <{xclbin_h[1]}>", tmp_path / "probe")
    assert sorted(p.split(":")[0] for p in problems) == ["struct axlf_section_header.m_sectionOffset",
                                                         "struct axlf_section_header.m_sectionSize"]
    assert facts_mismatches(ffi, AXLF_SIZES, flat_offsets(AXLF_OFFSETS)) == [
        "axlf_section_header.m_sectionOffset: offset 32, facts say 24",
        "axlf_section_header.m_sectionSize: offset 24, facts say 32"]


@needs_gcc
@needs_xrt_h
def test_xrt_comparison_reports_a_moved_header_bit_field(tmp_path: Path) -> None:
    directory = tmp_path / "headers"
    shutil.copytree(HEADERS, directory)
    ert = directory / "ert.h"
    ert.write_text(ert.read_text().replace("#define ERT_HDR_COUNT_SHIFT 12", "#define ERT_HDR_COUNT_SHIFT 13"))
    problems = system_comparison(abi.build_ffi(directory), directory, present(ERT_H), "#include <stdbool.h>\n"
                                 f"#include <{present(ERT_H)[1]}>", tmp_path / "probe")
    assert problems and all(".count:" in p for p in problems)


@needs_gcc
def test_gcc_comparison_catches_a_layout_cffi_gets_wrong(tmp_path: Path) -> None:
    # gcc vs cffi is the check on cffi itself: feed it one layout that differs and it must say so
    mine = cffi_layouts(abi.ffi)
    wrong = dict(mine)
    tag = "struct amdxdna_drm_exec_cmd"
    wrong[tag] = Layout(mine[tag].size, mine[tag].align, {**mine[tag].fields, "seq": Field(44, 8)})
    assert compare_layouts(mine, wrong, "gcc") == [f"{tag}.seq: headers/ {Field(44, 8)}, gcc {Field(48, 8)}"]


# ---------------------------------------------------------------------------------------------
# abi module API

def test_prime_set_state_and_hwctx_entry_layouts_by_hand() -> None:
    """What Bo.export / Device.import_bo, set_power_mode and hw_contexts send, typed in from docs/uapi.md
    5 (PRIME rows: drm_prime_handle (12) {u32 handle; u32 flags; s32 fd}, DRM_CLOEXEC 0x80000, DRM_RDWR 2),
    1a (SET_STATE 0xC0106448, GET_ARRAY 0xC018644A), 2.4-2.5 (set_state, set_power_mode, hwctx_entry)."""
    ffi = abi.ffi
    assert (abi.DRM_IOCTL_PRIME_HANDLE_TO_FD, abi.DRM_IOCTL_PRIME_FD_TO_HANDLE) == (0xC00C642D, 0xC00C642E)
    assert ffi.sizeof("struct drm_prime_handle") == 12
    assert [ffi.offsetof("struct drm_prime_handle", f) for f in ("handle", "flags", "fd")] == [0, 4, 8]
    assert ffi.typeof("struct drm_prime_handle").fields[2][1].type.cname == "int32_t"     # fd is signed
    assert (abi.DRM_RDWR, abi.DRM_CLOEXEC) == (2, 0x80000)
    assert (abi.DRM_IOCTL_AMDXDNA_SET_STATE, abi.DRM_IOCTL_AMDXDNA_GET_ARRAY) == (0xC0106448, 0xC018644A)
    assert [ffi.offsetof("struct amdxdna_drm_set_state", f) for f in ("param", "buffer_size", "buffer")] == [0, 4, 8]
    assert ffi.sizeof("struct amdxdna_drm_set_power_mode") == 8 and abi.DRM_AMDXDNA_SET_POWER_MODE == 0
    assert ffi.offsetof("struct amdxdna_drm_set_power_mode", "pad") == 1
    assert (abi.POWER_MODE_DEFAULT, abi.POWER_MODE_HIGH, abi.POWER_MODE_TURBO) == (0, 3, 4)
    assert ffi.sizeof("struct amdxdna_drm_hwctx_entry") == 160                      # staging / out-of-tree size
    assert [ffi.offsetof("struct amdxdna_drm_hwctx_entry", f) for f in
            ("pid", "priority", "state", "txn_op_idx", "fatal_error_app_module", "pad", "name")] == \
        [16, 64, 88, 116, 136, 140, 144]                                             # mainline entries end at 144
    assert (abi.AMDXDNA_HWCTX_STATE_IDLE, abi.AMDXDNA_HWCTX_STATE_ACTIVE) == (0, 1)
    assert abi.AMDXDNA_MAX_NUM_ELEMENT == 1024


def test_ioc_layout_and_encoding() -> None:
    assert (abi._IOC_NRSHIFT, abi._IOC_TYPESHIFT, abi._IOC_SIZESHIFT, abi._IOC_DIRSHIFT) == (0, 8, 16, 30)
    assert (abi._IOC_NONE, abi._IOC_WRITE, abi._IOC_READ) == (0, 1, 2)
    # docs/uapi.md 1: request = dir<<30 | size<<16 | 'd'<<8 | nr
    assert abi._IOWR(0x64, 0x46, "struct amdxdna_drm_exec_cmd") == 3 << 30 | 56 << 16 | 0x64 << 8 | 0x46
    assert abi._IOR(0x64, 1, "uint32_t") == 2 << 30 | 4 << 16 | 0x64 << 8 | 1
    assert abi._IOW(0x64, 9, "struct drm_gem_close") == 1 << 30 | 8 << 16 | 0x64 << 8 | 9
    with pytest.raises(ValueError, match="size=16384 does not fit in 14 bits"):
        abi._IOC(abi._IOC_WRITE, 0x64, 0, 1 << 14)
    with pytest.raises(ValueError, match="nr=256"):
        abi._IOC(abi._IOC_WRITE, 0x64, 256, 8)


def test_ioctls_table_names_every_request_with_its_struct() -> None:
    requests = request_numbers()
    assert len(requests) == 25 and set(requests.values()) == set(abi.IOCTLS)
    for name, number in requests.items():
        short, ctype = abi.IOCTLS[number]
        assert name.removeprefix("DRM_IOCTL_").removeprefix("AMDXDNA_").removesuffix("_OOT") == short
        assert (number >> 16) & 0x3FFF == abi.ffi.sizeof(ctype)


def test_new_sets_fields_and_validates() -> None:
    bo = abi.new("struct amdxdna_drm_create_bo", size=4096, type=abi.AMDXDNA_BO_CMD)
    raw = bytes(abi.ffi.buffer(bo))
    assert len(raw) == 32 and raw[16:24] == (4096).to_bytes(8, "little") and raw[24:28] == (4).to_bytes(4, "little")
    assert raw[:16] == bytes(16) and raw[28:] == bytes(4)
    with pytest.raises(TypeError, match="no field 'sz'"):
        abi.new("struct amdxdna_drm_create_bo", sz=1)
    with pytest.raises(ValueError, match="handle=4294967296 does not fit"):
        abi.new("struct amdxdna_drm_create_bo", handle=1 << 32)
    with pytest.raises(TypeError, match=r"size='4096' has the wrong type"):
        abi.new("struct amdxdna_drm_create_bo", size="4096")
    with pytest.raises(TypeError, match="not a declared C type"):
        abi.new("struct no_such_struct")


def test_address_of_is_the_process_address() -> None:
    info = abi.new("struct amdxdna_drm_get_bo_info", handle=7, xdna_addr=abi.AMDXDNA_INVALID_ADDR)
    address = abi.address_of(info)
    assert ctypes.string_at(address, 48) == bytes(abi.ffi.buffer(info))
    words = abi.ffi.new("uint32_t[4]", [1, 2, 3, 4])
    assert ctypes.string_at(abi.address_of(words), 16) == b"".join(i.to_bytes(4, "little") for i in (1, 2, 3, 4))
    with pytest.raises(TypeError, match="expected a cffi pointer"):
        abi.address_of(bytearray(8))


def test_libc_mmap_and_munmap_work_through_the_cdef() -> None:
    length = 1 << 16
    pointer = abi.libc.mmap(abi.ffi.NULL, length, abi.PROT_READ | abi.PROT_WRITE, abi.MAP_PRIVATE | abi.MAP_ANONYMOUS,
                            -1, 0)
    assert pointer != abi.MAP_FAILED
    abi.ffi.buffer(pointer, length)[0:4] = b"xdna"
    assert ctypes.string_at(int(abi.ffi.cast("uintptr_t", pointer)), 4) == b"xdna"
    assert abi.libc.munmap(pointer, length) == 0


def test_header_dir_prefers_the_package_copy_and_reports_absence(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert abi.header_dir() in (Path(abi.__file__).resolve().parent / "headers", HEADERS)
    monkeypatch.setattr(abi, "_PACKAGE_DIR", tmp_path / "pkg")
    with pytest.raises(FileNotFoundError, match="headers libc.h, drm.h") as raised:
        abi.header_dir()
    assert raised.value.errno == errno.ENOENT and raised.value.filename.startswith(str(tmp_path / "pkg"))


# ---------------------------------------------------------------------------------------------
# packaging: the wheel carries the headers and works without a compiler

def _can_build_wheels_offline() -> bool:
    # pyproject.toml's SPDX licence fields need setuptools >= 77, which also builds wheels without the 'wheel'
    # package (>= 70.1); a fresh Python 3.11 venv still bundles setuptools 65.
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (77, 0)


def build_wheel(tmp_path: Path) -> Path:
    """``pip wheel`` of a copy of the repo's packaged files (pip builds in-tree), offline; returns the wheel."""
    source = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("amdxdna_direct", "sam3", "headers"):
        shutil.copytree(REPO / name, source / name, ignore=skip)
    for path in REPO.iterdir():
        if path.is_file():
            shutil.copy2(path, source / path.name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("amdxdna_direct-*.whl")
    return wheel


def requirement_name(line: str) -> str:
    """The normalised project name of a Requires-Dist value (PEP 503: case and ``_``/``.`` folded to ``-``)."""
    return re.sub(r"[-_.]+", "-", matched(r"[A-Za-z0-9._-]+", line).group(0)).lower()


def check_wheel_contents(archive: zipfile.ZipFile) -> None:
    """Name, licence, dependencies (three for the runtime; the sam3 and test extras), both console scripts, every
    module, the headers and the typing markers inside."""
    names = set(archive.namelist())
    for name in abi.HEADER_FILES:
        assert archive.read(f"amdxdna_direct/headers/{name}") == (HEADERS / name).read_bytes()
    sources = {path.relative_to(REPO).as_posix() for package in ("amdxdna_direct", "sam3")
               for path in (REPO / package).rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(sources - names) == [], "pyproject.toml [tool.setuptools] packages misses a subpackage"
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    meta = archive.read(metadata).decode()
    assert re.search(r"^Name: amdxdna-direct$", meta, flags=re.M)
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, flags=re.M)
    assert sorted(requirement_name(r) for r in requires if "extra ==" not in r) == ["cffi", "ml-dtypes", "numpy"]
    assert re.findall(r"^Provides-Extra: (.+)$", meta, flags=re.M) == ["sam3", "hub", "test"]
    extras: dict[str, set[str]] = {}
    for r in requires:
        found = re.search(r"extra == \"(\w+)\"", r)
        if found:
            extras.setdefault(found.group(1), set()).add(requirement_name(r))
    assert extras == {"sam3": {"pillow", "safetensors", "tokenizers"}, "hub": {"huggingface-hub"},
                      "test": {"hypothesis", "pytest", "pillow", "safetensors", "tokenizers", "huggingface-hub"}}
    assert re.search(r"^License-Expression: Apache-2\.0$", meta, flags=re.M)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {"amdxdna_direct/py.typed", "sam3/py.typed"} <= names
    scripts = archive.read(entry_points).decode()
    assert re.search(r"^amdxdna = amdxdna_direct\.cli:main$", scripts, flags=re.M)
    assert re.search(r"^sam3 = sam3\.cli:main$", scripts, flags=re.M)


def test_ci_runs_the_readme_test_command() -> None:
    # .ci/run reads its test command out of the README (issue 2 item 8); run that extraction here
    script = (REPO / ".ci" / "run").read_text()
    (assignment,) = re.findall(r"^test_command=\$\((.*)\)$", script, flags=re.M)
    extracted = subprocess.run(["bash", "-c", assignment], cwd=REPO, capture_output=True, text=True, check=True,
                               timeout=30).stdout.strip()
    block = matched(r"```sh\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert extracted == commands[1] == "pip install -e '.[test]' && python -m pytest -q"
    assert 'bash -c "set -e; $test_command"' in script


# A TXN stream with one WRITE32 (docs/xrt-sequence.md 2.3): header 0.1 devGen 3, 1 op, 40 bytes; op [0x00, 0, addr, 0,
# value, 24].
TINY_STREAM = (0x06030100, 0x101, 1, 40, 0x00, 0, 0x1D204, 0, 5, 24)

WHEEL_PROBE = """
import json, shutil, sys
from amdxdna_direct import abi, open_device
with open_device("emu:npu1") as device:
    size = device.bo(4096).size
print(json.dumps([abi.__file__, str(abi.header_dir()), abi.ffi.sizeof("struct amdxdna_drm_exec_cmd"),
                  shutil.which("gcc"), abi.DRM_IOCTL_AMDXDNA_EXEC_CMD, size,
                  type(abi.ffi).__module__, "pycparser" in sys.modules]))
"""


@pytest.mark.ci
@requires(_can_build_wheels_offline(),
          "needs setuptools >= 77 to build this project's wheel offline (pip install 'setuptools>=77')")
def test_wheel_ships_headers_and_works_in_a_clean_venv_without_gcc(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        check_wheel_contents(archive)

    # a venv without pip and without the repo: numpy/cffi come from the system, amdxdna_direct only from the wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300)
    env = {"PATH": str(venv / "bin"), "HOME": str(tmp_path)}
    result = subprocess.run([str(python), "-I", "-c", WHEEL_PROBE], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    module_file, headers, size, gcc, request, bo_size, ffi_module, pycparser = json.loads(result.stdout)
    assert (ffi_module, pycparser) == ("_cffi_backend", False)     # the generated declarations, nothing parsed
    site = venv.resolve()
    assert Path(module_file).resolve().is_relative_to(site) and Path(headers).resolve().is_relative_to(site)
    assert Path(headers).name == "headers" and Path(headers).parent.name == "amdxdna_direct"
    assert (size, gcc, request, bo_size) == (56, None, abi.DRM_IOCTL_AMDXDNA_EXEC_CMD, 4096)

    # the console script the wheel installed
    stream = tmp_path / "tiny.bin"
    stream.write_bytes(b"".join(word.to_bytes(4, "little") for word in TINY_STREAM))
    done = subprocess.run([str(venv / "bin" / "amdxdna"), "insts", "--json", str(stream)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ops"] == [{"op": "write32", "addr": 0x1D204, "value": 5}]

    # both console scripts report the wheel's version, and the installed metadata carries the licence (what
    # `pip show` lists: License-Expression) with the licence text beside it
    version = wheel.name.split("-")[1]
    for script in ("amdxdna", "sam3"):
        done = subprocess.run([str(venv / "bin" / script), "--version"], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)
        assert done.returncode == 0 and version in done.stdout, (script, done.stdout, done.stderr)
    probe = ("import importlib.metadata as m, json; d = m.distribution('amdxdna-direct'); "
             "print(json.dumps([d.metadata['License-Expression'], "
             "[f.name for f in d.files if f.name == 'LICENSE'], d.version]))")
    done = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert json.loads(done.stdout) == ["Apache-2.0", ["LICENSE"], version], done.stderr


# ---- the generated declarations module (out-of-line ABI mode) -----------------------------------------


def test_the_generated_declarations_are_current() -> None:
    """``_abi_decl.py`` is what ``write_decl_module`` makes of headers/ today (cffi's output plus the cdef's
    digest); after changing a header, regenerate it as the message says."""
    committed = (REPO / "amdxdna_direct" / "_abi_decl.py").read_text(encoding="utf-8")
    fresh = abi.decl_module_source(HEADERS)
    assert fresh == committed, ("amdxdna_direct/_abi_decl.py is stale: run "
                                "python -c 'from amdxdna_direct import abi; abi.write_decl_module()'")
    assert f"CDEF_SHA256 = {abi.cdef_digest(abi.read_cdef(HEADERS))!r}" in committed
    assert "_cffi_backend.FFI('amdxdna_direct._abi_decl'" in committed


def test_the_generated_declarations_match_the_parsed_headers() -> None:
    parsed = abi.build_ffi(HEADERS)
    assert type(abi.ffi).__module__ == "_cffi_backend"                 # the out-of-line object, not cffi.FFI
    assert cffi_layouts(abi.ffi) == cffi_layouts(parsed)
    assert our_constants(abi.ffi) == our_constants(parsed)
    assert abi.ffi.list_types() == parsed.list_types()


# ---- the generated typed constants (what a static checker sees of the re-exported names) ------------

CONSTANTS_FILE = REPO / "amdxdna_direct" / "_abi_constants.py"
STALE = "python -c 'from amdxdna_direct import abi; abi.write_decl_module()'"


def declared_constants(text: str) -> list[tuple[str, str, int]]:
    """``(header, name, value)`` of every ``NAME: Final = value`` line of a constants module, in file order."""
    declared, header = [], ""
    for line in text.splitlines():
        if section := re.fullmatch(r"# ---- (\S+) ----", line):
            header = section.group(1)
        elif constant := re.fullmatch(r"(\w+): Final = (-?\d+)", line):
            declared.append((header, constant.group(1), int(constant.group(2))))
    return declared


def test_the_generated_constants_are_current() -> None:
    """``_abi_constants.py`` is what ``write_decl_module`` makes of headers/ today; after changing a header,
    regenerate it as the message says."""
    committed = CONSTANTS_FILE.read_text(encoding="utf-8")
    assert abi.constants_module_source(HEADERS) == committed, f"amdxdna_direct/_abi_constants.py is stale: run {STALE}"
    assert f"_CDEF_SHA256: Final = {abi.cdef_digest(abi.read_cdef(HEADERS))!r}" in committed


def test_the_generated_constants_are_every_header_constant_once_in_header_order() -> None:
    declared = declared_constants(CONSTANTS_FILE.read_text(encoding="utf-8"))
    names = [name for _, name, _ in declared]
    values = {name: value for _, name, value in declared}
    # every #define and enum value of the cdef, once, with cffi's value, which is also what the import exports
    assert len(names) == len(values) and values == our_constants(abi.ffi)
    assert {name: getattr(abi, name) for name in names} == values
    # under its own header, in HEADER_FILES order: the #defines of each header in file order, each enum's
    # enumerators together and in declaration order (as pycparser reads the enum)
    assert list(dict.fromkeys(header for header, _, _ in declared)) == list(abi.HEADER_FILES)
    for header_file in abi.HEADER_FILES:
        text = strip_c_comments((HEADERS / header_file).read_text())
        defines = re.findall(r"^\s*#\s*define\s+(\w+)", text, flags=re.M)
        _, enums = foreign_definitions(HEADERS / header_file, [], re.findall(r"\benum\s+(\w+)\s*\{", text))
        mine = [name for header, name, _ in declared if header == header_file]
        assert sorted(mine) == sorted(defines + [name for items in enums.values() for name in items]), header_file
        assert [name for name in mine if name in defines] == defines, header_file
        for tag, enumerators in enums.items():
            first = mine.index(enumerators[0])
            assert mine[first:first + len(enumerators)] == enumerators, f"{header_file} enum {tag}"


def strip_c_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def test_a_changed_constant_makes_the_committed_constants_stale(tmp_path: Path) -> None:
    directory = tmp_path / "headers"
    shutil.copytree(HEADERS, directory)
    ert = directory / "ert.h"
    ert.write_text(ert.read_text().replace("#define ERT_HDR_COUNT_SHIFT 12", "#define ERT_HDR_COUNT_SHIFT 13"))
    committed, fresh = CONSTANTS_FILE.read_text(encoding="utf-8"), abi.constants_module_source(directory)
    digests = {abi.cdef_digest(abi.read_cdef(d)) for d in (HEADERS, directory)}
    assert set(committed.splitlines()) ^ set(fresh.splitlines()) == {
        "ERT_HDR_COUNT_SHIFT: Final = 12", "ERT_HDR_COUNT_SHIFT: Final = 13",
        *(f"_CDEF_SHA256: Final = {digest!r}" for digest in digests)}


def test_constants_in_header_order_refuses_definitions_that_are_not_the_constants() -> None:
    source = "/* ==== a.h ==== */\n#define A 1\nenum e { B = 2, C };\n"
    assert abi.constants_in_header_order(source, {"C": 3, "A": 1, "B": 2}) == [("a.h", "A", 1), ("a.h", "B", 2),
                                                                               ("a.h", "C", 3)]
    with pytest.raises(ValueError, match=r"definitions \['A'\] are not cdef constants, cdef constants \['D'\] have "
                                         r"no definition"):
        abi.constants_in_header_order(source, {"B": 2, "C": 3, "D": 4})


IMPORT_PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s %(message)s")
from amdxdna_direct import abi
print(json.dumps([type(abi.ffi).__module__, "pycparser" in sys.modules, getattr(abi, "AMDXDNA_PROBE_ONLY", None),
                  abi.DRM_IOCTL_AMDXDNA_EXEC_CMD, abi.__file__]))
"""


def _probe_import(root: Path) -> tuple[list[Any], str]:  # the probe's JSON
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, env=env, cwd=root,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def _package_copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(REPO / "amdxdna_direct", root / "amdxdna_direct", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(HEADERS, root / "headers")
    return root


def test_import_parses_no_c_and_logs_nothing(tmp_path: Path) -> None:
    (ffi_module, pycparser, _, request, where), log = _probe_import(_package_copy(tmp_path))
    assert (ffi_module, pycparser, request) == ("_cffi_backend", False, abi.DRM_IOCTL_AMDXDNA_EXEC_CMD)
    assert Path(where).is_relative_to(tmp_path) and "amdxdna_direct.abi" not in log


def test_without_the_generated_module_the_headers_are_parsed_and_a_debug_line_says_so(tmp_path: Path) -> None:
    root = _package_copy(tmp_path)
    (root / "amdxdna_direct" / "_abi_decl.py").unlink()
    (ffi_module, pycparser, _, request, _), log = _probe_import(root)
    assert (ffi_module, pycparser, request) == ("cffi.api", True, abi.DRM_IOCTL_AMDXDNA_EXEC_CMD)
    assert re.search(r"^DEBUG amdxdna_direct\.abi .*_abi_decl\.py is missing: parsing the headers in .*headers at "
                     r"import \(in-line ABI mode, pycparser\)$", log, flags=re.M), log


def test_a_stale_generated_module_is_not_used(tmp_path: Path) -> None:
    """Headers edited without regenerating: the import parses them (so the new constant is there) and warns."""
    root = _package_copy(tmp_path)
    header = root / "headers" / "amdxdna_accel.h"
    header.write_text(header.read_text() + "\n#define AMDXDNA_PROBE_ONLY 7\n")
    (ffi_module, pycparser, probe, _, _), log = _probe_import(root)
    assert (ffi_module, pycparser, probe) == ("cffi.api", True, 7)
    assert re.search(r"^WARNING amdxdna_direct\.abi .*_abi_decl\.py was generated from other headers than .*: "
                     r"parsing the headers at import instead", log, flags=re.M), log
    regenerated = abi.write_decl_module(root / "amdxdna_direct" / "_abi_decl.py", root / "headers")
    assert "AMDXDNA_PROBE_ONLY" in regenerated.read_text()
    constants = declared_constants((root / "amdxdna_direct" / "_abi_constants.py").read_text())
    assert constants[-1] == ("xclbin.h", "CT_PREPOST", 3) and ("amdxdna_accel.h", "AMDXDNA_PROBE_ONLY", 7) in constants
    (ffi_module, pycparser, probe, _, _), log = _probe_import(root)
    assert (ffi_module, pycparser, probe) == ("_cffi_backend", False, 7) and "WARNING" not in log


def test_new_reports_an_unknown_type_as_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"new\('struct no_such_struct'\): not a declared C type of known size"):
        abi.new("struct no_such_struct")
    with pytest.raises(TypeError, match="no field 'nope'"):
        abi.new("struct drm_gem_close", nope=1)
