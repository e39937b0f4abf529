"""Seeded fuzzing of the three parsers a user hands files to: xclbin, TXN streams and sam3 bundles.

Inputs are made by the project's writers (``xclbin.write``/``build_mlir_aie``, ``insts.encode``/``dma_stream``,
a hand bundle as ``tests/test_sam3_bundle.py`` writes it) and mutated: byte flips, truncations, inserted
bytes, duplicated or inserted sections and ops, huge counts and offsets, mutated manifest and tensor-index
lines. Each input must end in the parser's result or one of the documented errors (docs/files.md): never
IndexError, struct.error, MemoryError, OverflowError, UnicodeDecodeError... Each is measured: its
tracemalloc peak must stay under 64 MB + 8 x its size; its time is reported, with only a generous bound
that catches a hang (the budget of docs/files.md 5 is what bounds the work). About 30 s in all.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from test_sam3_bundle import BODY, write_hand_bundle
from test_xclbin import overlapping_xclbin

from amdxdna_direct import insts, xclbin
from amdxdna_direct.files import FileRefused
from amdxdna_direct.insts import BlockWrite, DdrPatch, InstsError, MaskWrite, RawOp, Stream, Sync, Write32
from amdxdna_direct.xclbin import Section, XclbinError
from sam3.bundle import Bundle, BundleError, summarize

DOCUMENTED = (XclbinError, InstsError, BundleError, FileRefused)
MEMORY_BASE = 64 << 20
MEMORY_PER_BYTE = 8
HANG_SECONDS = 2.0
SPECIAL_U32 = (0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFF, 0x10000, 0x7FFFFFF0, 4, 8, 96)


class Meter:
    """Runs one input after another, each under tracemalloc, and keeps what went wrong."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failures: list[str] = []
        self.outcomes: dict[str, int] = {}
        self.max_seconds = 0.0
        self.max_peak = 0
        self.count = 0

    def run(self, label: str, size: int, work: Callable[[], object]) -> None:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        try:
            work()
            outcome = "accepted"
        except DOCUMENTED as e:
            outcome = type(e).__name__
        except Exception as e:  # noqa: BLE001 - the point: any other exception is a defect to report
            outcome = "UNDOCUMENTED"
            self.failures.append(f"{label}: {type(e).__name__}: {e!s:.300}")
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] - base
        self.count += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.max_seconds = max(self.max_seconds, seconds)
        self.max_peak = max(self.max_peak, peak)
        if peak > MEMORY_BASE + MEMORY_PER_BYTE * size:
            self.failures.append(f"{label}: tracemalloc peak {peak} bytes for a {size}-byte input")
        if seconds > HANG_SECONDS:
            self.failures.append(f"{label}: {seconds:.1f} s")

    def report(self) -> None:
        print(f"\n{self.name}: {self.count} inputs, outcomes {dict(sorted(self.outcomes.items()))}, "
              f"max {self.max_seconds * 1e3:.1f} ms, max peak {self.max_peak / 1e6:.2f} MB")
        assert not self.failures, "\n".join(self.failures[:20])


@pytest.fixture
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def _u32_at(rng: random.Random, data: bytes, where: int, value: int) -> bytes:
    where = min(where, max(len(data) - 4, 0))
    return data[:where] + struct.pack("<I", value & 0xFFFFFFFF) + data[where + 4:]


def _byte_mutation(rng: random.Random, data: bytes, spots: list[int]) -> tuple[str, bytes]:
    """One generic mutation: flip, truncate, insert, a special u32 or u64, a copied chunk."""
    if not data:
        return "grow", bytes(rng.randrange(256) for _ in range(8))
    where = rng.choice(spots) if spots and rng.random() < 0.7 else rng.randrange(len(data))
    where = min(where, len(data) - 1)
    kind = rng.randrange(6)
    if kind == 0:
        return f"flip@{where}", data[:where] + bytes([data[where] ^ rng.randrange(1, 256)]) + data[where + 1:]
    if kind == 1:
        cut = rng.randrange(len(data))
        return f"truncate@{cut}", data[:cut]
    if kind == 2:
        extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 17)))
        return f"insert@{where}", data[:where] + extra + data[where:]
    if kind == 3:
        value = rng.choice(SPECIAL_U32 + (len(data), len(data) - 1, len(data) + 1, where))
        return f"u32@{where}={value:#x}", _u32_at(rng, data, where, value)
    if kind == 4:
        value = rng.choice((1 << 63, (1 << 64) - 1, 1 << 32, len(data)))
        return f"u64@{where}={value:#x}", data[:where] + struct.pack("<Q", value) + data[where + 8:]
    start, length = rng.randrange(len(data)), rng.randrange(1, 200)
    chunk = data[start:start + length]
    return f"copy {start}+{length}@{where}", data[:where] + chunk + data[where + len(chunk):]


# --------------------------------------------------------------------------------------------- xclbin


def _xclbin_seeds() -> list[bytes]:
    base = xclbin.build_mlir_aie(bytes(range(200)), n_buffers=3)
    wide = xclbin.build_mlir_aie(b"\x01" * 64, column_width=4, start_columns=(0, 4), kernel="K2", dpu_kernel_id=0x902)
    two = dataclasses.replace(base, sections=base.sections + wide.sections[1:3])
    one = overlapping_xclbin(6 << 10, npdi=2)
    off = struct.unpack_from("<Q", one, 0x1C8 + 0x18)[0]
    one = one[:off + 184 + 24] + struct.pack("<I", 1) + one[off + 184 + 28:off + 184 + 96 + 24] + \
        struct.pack("<I", 1) + one[off + 184 + 96 + 28:]
    return [xclbin.write(base), xclbin.write(wide), xclbin.write(two), one, overlapping_xclbin(2 << 10)]


def _xclbin_spots(raw: bytes) -> list[int]:
    """Header, section table and the first/last bytes of every section (where the counts and offsets are)."""
    count = min(struct.unpack_from("<I", raw, 0x1C0)[0], 64)
    spots = list(range(0x130, 0x1C8 + 40 * count))
    for i in range(count):
        offset, size = struct.unpack_from("<QQ", raw, 0x1C8 + 40 * i + 0x18)
        spots += range(offset, min(offset + 256, offset + size, len(raw)))
        spots += range(max(offset, offset + size - 256), min(offset + size, len(raw)))
    return spots


def _xclbin_structural(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    """Mutations that keep the file readable past its header: duplicated, pointed-together or inserted sections."""
    count = struct.unpack_from("<I", raw, 0x1C0)[0]
    kind = rng.randrange(4)
    if kind == 0 and count:
        a, b = rng.randrange(count), rng.randrange(count)
        entry = raw[0x1C8 + 40 * a:0x1C8 + 40 * a + 40]
        return f"section {b} := section {a}", raw[:0x1C8 + 40 * b] + entry + raw[0x1C8 + 40 * b + 40:]
    if kind == 1 and count:
        a, b = rng.randrange(count), rng.randrange(count)
        field_a, field_b = 0x1C8 + 40 * a + 0x18, 0x1C8 + 40 * b + 0x18
        return f"section {b} offset := section {a}'s", raw[:field_b] + raw[field_a:field_a + 8] + raw[field_b + 8:]
    if kind == 2:
        return f"m_numSections := {count + 1}", _u32_at(rng, raw, 0x1C0, count + 1)
    x = xclbin.parse(raw)
    body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400)))
    section_kind = rng.choice((xclbin.AIE_PARTITION, xclbin.MEM_TOPOLOGY, xclbin.IP_LAYOUT, xclbin.CONNECTIVITY,
                               xclbin.EMBEDDED_METADATA, xclbin.ASK_GROUP_TOPOLOGY, 99))
    sections = list(x.sections)
    sections.insert(rng.randrange(len(sections) + 1), Section(section_kind, "fuzz", body))
    return f"inserted kind {section_kind} of {len(body)} random bytes", xclbin.write(
        dataclasses.replace(x, sections=tuple(sections)))


def _parse_xclbin(data: bytes) -> None:
    x = xclbin.parse(data)
    # whatever parses writes back to the same value, and its views work
    if xclbin.parse(xclbin.write(x)) != x:
        raise AssertionError("parse(write(x)) != x")
    for k in x.kernels:
        try:
            x.pdi_for(k.name)
        except XclbinError:
            pass


def test_fuzz_xclbin(traced):
    rng = random.Random(13)
    meter = Meter("xclbin")
    seeds = _xclbin_seeds()
    spots = [_xclbin_spots(s) for s in seeds]
    for case in range(2500):
        i = rng.randrange(len(seeds))
        data, steps = seeds[i], []
        for _ in range(rng.randrange(1, 4)):
            if rng.random() < 0.25 and len(data) >= 0x1C8 and data[:8] == b"xclbin2\0":
                try:
                    step, data = _xclbin_structural(rng, data)
                except XclbinError:
                    continue
            else:
                step, data = _byte_mutation(rng, data, spots[i])
            steps.append(step)
        if rng.random() < 0.5 and len(data) >= 0x138:  # keep m_length consistent, to reach the sections
            data = data[:0x130] + struct.pack("<Q", len(data)) + data[0x138:]
        meter.run(f"xclbin case {case} (seed {i}: {', '.join(steps)})", len(data), lambda d=data: _parse_xclbin(d))
    meter.report()


# --------------------------------------------------------------------------------------------- TXN


def _txn_seeds() -> list[bytes]:
    ops = (Write32(addr=0x1D204, value=0x80000001), BlockWrite(addr=0x1D020, words=(1, 2, 3, 4, 5, 6, 7, 8)),
           MaskWrite(addr=0x1D200, value=0xF00, mask=0x1F00), DdrPatch(reg_addr=0x1D024, arg_idx=2, arg_plus=64),
           Sync(direction=0, row=0, col=0, channel=0, row_num=1, col_num=1))
    raw = RawOp(0x82, (0x82, 16, 7, 9), "custom")
    streams = [
        Stream(major=0, minor=1, dev_gen=3, rows=6, cols=1, mem_tile_rows=1, ops=ops + (raw,)),
        Stream(major=1, minor=0, dev_gen=4, rows=6, cols=4, mem_tile_rows=1, ops=ops),
        insts.dma_stream(3, [(0, 4096, "in"), (1, 1024, "in"), (2, 2048, "out")], rtp=(5, 6)),
        insts.dma_stream(4, [(0, 64, "in"), (1, 64, "out")]),
    ]
    return [insts.encode(s) for s in streams]


def _txn_mutation(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    n = len(data) // 4
    kind = rng.randrange(5)
    if kind == 0 and n > 4:  # an op-sized run of words duplicated elsewhere
        start, length = rng.randrange(4, n), rng.randrange(1, 16)
        chunk = data[4 * start:4 * (start + length)]
        at = 4 * rng.randrange(4, n + 1)
        return f"dup words {start}+{length}@{at // 4}", data[:at] + chunk + data[at:]
    if kind == 1 and n > 2:
        value = rng.choice(SPECIAL_U32 + (n, n + 1, 0xFFFFFFFF))
        return f"num_ops={value:#x}", _u32_at(rng, data, 8, value)
    if kind == 2 and n:
        at = rng.randrange(n)
        value = rng.choice(SPECIAL_U32 + (rng.randrange(0x100), 4 * (n - at), 4 * (n - at) + 4))
        return f"word {at}={value:#x}", _u32_at(rng, data, 4 * at, value)
    if kind == 3 and n:
        at = rng.randrange(n)
        return f"opcode@{at}", _u32_at(rng, data, 4 * at, rng.choice((0, 1, 2, 3, 4, 5, 6, 7, 8, 0x80, 0x81, 0x82,
                                                                     0x83, 0x84, 0x85, 0xFF)))
    return _byte_mutation(rng, data, [])


def _load_txn(data: bytes, strict: bool) -> None:
    s = insts.load(data, strict=strict)
    if not insts.stream_bytes(data) == insts.encode(s):
        raise AssertionError("encode(decode(b)) != b")
    insts.raw_ops(s)


def test_fuzz_txn(traced):
    rng = random.Random(13)
    meter = Meter("TXN")
    seeds = _txn_seeds()
    for case in range(6000):
        i = rng.randrange(len(seeds))
        data, steps = seeds[i], []
        for _ in range(rng.randrange(1, 4)):
            step, data = _txn_mutation(rng, data)
            steps.append(step)
        if rng.random() < 0.6 and len(data) >= 16:  # keep size_bytes right, to reach the ops
            data = _u32_at(rng, data, 12, len(data))
        if rng.random() < 0.15:  # the text form: one hex word per line
            words = struct.unpack(f"<{len(data) // 4}I", data[:len(data) // 4 * 4])
            data = "".join(f"{w:08X}\n" for w in words).encode()
            if rng.random() < 0.5:
                step, data = _byte_mutation(rng, data, [])
                steps.append(f"text {step}")
        strict = rng.random() < 0.3
        meter.run(f"TXN case {case} (seed {i}, strict={strict}: {', '.join(steps)})", len(data),
                  lambda d=data, s=strict: _load_txn(d, s))
    meter.report()


# --------------------------------------------------------------------------------------------- bundles


HUGE = ("99999999999999999999999999999999", "18446744073709551616", "18446744073709551615", "4294967296",
        "9" * 5000, "-1", "+0", "1e999", "nan", "inf", "-inf", "0x10", "", "\x00", "\udcff", "é", "\u2028",
        "1,2,", ",", "=", "a=b=c", "\\u{110000}", "\\", "\\x", "9223372036854775808")


def _line_mutation(rng: random.Random, lines: list[str]) -> tuple[str, list[str]]:
    lines = list(lines)
    if not lines:
        return "add", ["version 2"]
    at = rng.randrange(len(lines))
    fields = lines[at].split(" ")
    kind = rng.randrange(7)
    if kind == 0:
        return f"delete line {at + 1}", lines[:at] + lines[at + 1:]
    if kind == 1:
        other = rng.randrange(len(lines))
        return f"duplicate line {other + 1}@{at + 1}", lines[:at] + [lines[other]] + lines[at:]
    if kind == 2 and len(fields) > 1:
        j = rng.randrange(len(fields))
        value = rng.choice(HUGE)
        if "=" in fields[j] and rng.random() < 0.7:
            fields[j] = fields[j].split("=", 1)[0] + "=" + value
        else:
            fields[j] = value
        return f"line {at + 1} field {j} := {value[:20]!r}", lines[:at] + [" ".join(fields)] + lines[at + 1:]
    if kind == 3:
        cut = rng.randrange(len(lines[at]) + 1)
        return f"truncate line {at + 1}@{cut}", lines[:at] + [lines[at][:cut]] + lines[at + 1:]
    if kind == 4:
        j = rng.randrange(len(fields))
        return f"line {at + 1} field {j} doubled", lines[:at] + [" ".join(fields[:j + 1] + fields[j:])] + lines[at + 1:]
    if kind == 5:
        line = lines[at]
        if line:
            k = rng.randrange(len(line))
            line = line[:k] + chr(rng.choice((0, 9, 13, 0x1C, 0x85, 0xA0, 0x3000, 0xFFFD, rng.randrange(32, 127))))\
                + line[k + 1:]
        return f"line {at + 1} char changed", lines[:at] + [line] + lines[at + 1:]
    extra = rng.choice(("gemm g2 ctx=gemm insts=kernels/conv.insts.bin M=1 K=1 N=1 lda=1 tile_k=1 tile_n=1 ct_k=1 "
                        "bias=0 b_bytes=99999999999999999999", "version 99999999999999999999", "param grid 0",
                        "x.t f32 99999999999,99999999999 0 8", "x.u u8 1 18446744073709551615 1",
                        "xclbin z /etc/passwd K", "xclbin z ../../x K", "mha m xclbin=kernels/mha.xclbin "
                        "insts=kernels/mha_d.insts.bin heads=0 seq=0 d=0 token_major=1 elems=0",
                        "case 99999999999999999999 cases/x.png p", "y f32 " + ",".join(["2"] * 40) + " 0 4"))
    return f"insert {extra[:30]!r}@{at + 1}", lines[:at] + [extra] + lines[at:]


def _open_bundle(root: Path) -> None:
    with Bundle.open(root) as b:
        summarize(b)


def test_fuzz_bundles(traced, tmp_path):
    base = write_hand_bundle(tmp_path / "base", BODY)
    for name in ("v_qkv", "conv", "mha_win", "mha_d", "rope", "addln"):
        (base / "kernels" / f"{name}.insts.bin").write_bytes(struct.pack("<2I", 0x06030100, len(name)))
    _open_bundle(base)  # the seed itself is valid
    root = tmp_path / "fuzz"
    shutil.copytree(base, root)
    texts = {name: (base / name).read_text() for name in ("manifest.txt", "tensors.txt")}
    rng = random.Random(13)
    meter = Meter("bundle")
    for case in range(500):
        name = rng.choice(("manifest.txt", "manifest.txt", "tensors.txt"))
        lines, steps = texts[name].split("\n"), []
        for _ in range(rng.randrange(1, 4)):
            step, lines = _line_mutation(rng, lines)
            steps.append(step)
        data = "\n".join(lines).encode("utf-8", "surrogateescape")
        if rng.random() < 0.1:
            step, data = _byte_mutation(rng, data, [])
            steps.append(step)
        for other, text in texts.items():
            (root / other).write_text(text)
        (root / name).write_bytes(data)
        meter.run(f"bundle case {case} ({name}: {'; '.join(steps)})", len(data), lambda: _open_bundle(root))
    meter.report()


# --------------------------------------------------------------------------------------------- regressions


def test_regression_a_manifest_path_with_a_nul_is_a_bundle_error(tmp_path):
    # found by test_fuzz_bundles with other seeds: the path check raised a bare ValueError (embedded null byte)
    root = write_hand_bundle(tmp_path / "b", "op z xclbin=kernels/a\0b.xclbin insts=kernels/x.bin\n")
    line = (root / "manifest.txt").read_text().split("\n").index("op z xclbin=kernels/a\0b.xclbin insts=kernels/x.bin")
    with pytest.raises(BundleError) as e:
        Bundle.open(root)
    assert str(e.value).startswith(f"manifest.txt:{line + 1}: xclbin path 'kernels/a\\x00b.xclbin' contains a NUL "
                                   "character")


# --------------------------------------------------------------------------------------------- Sam3 and export


def _param_mutation(rng: random.Random, lines: list[str]) -> tuple[str, list[str]]:
    """A param or kernel-record value changed to 0, 1, a small odd size or an absurd one; or a record deleted."""
    at = rng.choice([i for i, ln in enumerate(lines) if ln.split(" ", 1)[0] in ("param", "gemm", "mha", "op")])
    fields = lines[at].split(" ")
    value = rng.choice(("0", "1", "3", "7", "1000000", "99999999999"))
    if fields[0] == "param" and rng.random() < 0.8:
        fields[2:] = [value]
    elif fields[0] != "param" and rng.random() < 0.8:
        j = rng.choice([j for j, f in enumerate(fields) if "=" in f and f.split("=")[0] not in ("ctx", "insts",
                                                                                                 "xclbin", "name")])
        fields[j] = fields[j].split("=")[0] + "=" + value
    else:
        return f"delete line {at + 1}", lines[:at] + lines[at + 1:]
    return f"line {at + 1} := {' '.join(fields)[:60]!r}", lines[:at] + [" ".join(fields)] + lines[at + 1:]


def test_fuzz_bundles_through_sam3(traced, tmp_path):
    """Mutated built bundles through Sam3() open and segment: the result or one of the project's errors (the
    `amdxdna_direct.errors.Error` root every documented error has: BundleError, NpuError, TextError, ...)."""
    import numpy as np

    from amdxdna_direct.errors import Error
    from sam3 import build
    from sam3.pipeline import Sam3

    base = build.build(tmp_path / "base", "tiny", variant="host")
    root = tmp_path / "fuzz"
    shutil.copytree(base, root)
    text = (base / "manifest.txt").read_text()
    rng = random.Random(26)
    meter = Meter("sam3 bundle")
    image = np.zeros((12, 9, 3), np.uint8)

    def run() -> None:
        try:
            with Sam3(root, "emu") as sam:
                sam.segment(image, "a cat")
        except Error as e:
            raise BundleError(f"documented: {type(e).__name__}") from e

    # The emulator's device memory is most of a run's peak: the bound is the unmutated bundle's run, twice.
    tracemalloc.reset_peak()
    base_mem = tracemalloc.get_traced_memory()[0]
    run()
    allowance = 2 * (tracemalloc.get_traced_memory()[1] - base_mem) // MEMORY_PER_BYTE
    for case in range(60):
        lines, steps = text.split("\n"), []
        for _ in range(rng.randrange(1, 3)):
            step, lines = _param_mutation(rng, lines)
            steps.append(step)
        data = "\n".join(lines)
        (root / "manifest.txt").write_text(data)
        meter.run(f"sam3 case {case} ({'; '.join(steps)})", len(data) + allowance, run)
    meter.report()


def _safetensors_mutation(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """A mutation of the header (its JSON as text) or of the length prefix."""
    (length,) = struct.unpack_from("<Q", data)
    header = data[8:8 + length].decode()
    kind = rng.randrange(6)
    if kind == 0:
        value = rng.choice((0, 1, length - 1, length + 1, len(data), 1 << 40, (1 << 64) - 1))
        return f"length := {value}", struct.pack("<Q", value) + data[8:]
    if kind == 1:
        return "dtype := Q9", data[:8] + header.replace('"F32"', '"Q9"', 1).encode() + data[8 + length:]
    if kind == 2:
        new = header.replace("[", "[-1, ", 1)
        return "a negative dim", struct.pack("<Q", len(new)) + new.encode() + data[8 + length:]
    if kind == 3:
        new = header.replace("[", "[4294967296, ", 1)
        return "a huge dim", struct.pack("<Q", len(new)) + new.encode() + data[8 + length:]
    if kind == 4:
        new = header.replace('"data_offsets":[', '"data_offsets":[9', 1)
        return "an offset shifted", struct.pack("<Q", len(new)) + new.encode() + data[8 + length:]
    cut = rng.randrange(len(data))
    return f"truncate@{cut}", data[:cut]


def test_fuzz_checkpoints_through_export(traced, tmp_path):
    """Mutated safetensors headers and config values through sam3 export: exit 1 with one line naming the file, or
    a bundle (which then opens): never a traceback."""
    import json

    from fixture_files import REPO_FIXTURES

    from sam3 import export

    hf = REPO_FIXTURES / "sam3-tiny" / "hf"
    if not (hf / "model.safetensors").is_file():
        pytest.skip(f"fixture {hf} absent (tests/fixtures incomplete in this checkout)")
    weights = (hf / "model.safetensors").read_bytes()
    config = json.loads((hf / "config.json").read_text())
    root = tmp_path / "hf"
    root.mkdir()
    for f in hf.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (root / f.name).symlink_to(f)
    rng = random.Random(7)
    meter = Meter("export")
    sizes = [("vision_config", "backbone_config", "num_hidden_layers"), ("detr_encoder_config", "num_layers"),
             ("text_config", "num_hidden_layers"), ("vision_config", "fpn_hidden_size"),
             ("detr_decoder_config", "num_queries"), ("text_config", "layer_norm_eps")]
    for case in range(30):
        cfg, data = json.loads(json.dumps(config)), weights
        if rng.random() < 0.5:
            step, data = _safetensors_mutation(rng, weights)
        else:
            *path, key = rng.choice(sizes)
            node = cfg
            for p in path:
                node = node[p]
            node[key] = rng.choice((None, {"a": 1}, [1, 2], -3, 0, 10 ** 8, 1e300, "8", True, 3))
            step = f"config {'.'.join([*path, key])} := {node[key]!r}"
        (root / "model.safetensors").write_bytes(data)
        (root / "config.json").write_text(json.dumps(cfg))
        out = tmp_path / f"out{case}"

        def run(out: Path = out) -> None:
            if export.main(["--model", str(root), "--out", str(out), "--vit", "host"]) != 0:
                assert not out.exists()
                raise BundleError("exit 1")

        meter.run(f"export case {case} ({step})", len(data), run)
    meter.report()
