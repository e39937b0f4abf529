"""``amdxdna xclbin`` and ``amdxdna insts``: JSON documents against the fixture oracles, text, exit codes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
import subprocess
import sys
import uuid as uuidlib
from pathlib import Path

import pytest
from fixture_files import fixture

from amdxdna_direct import xclbin
from amdxdna_direct.cli import main

REPO = Path(__file__).resolve().parents[1]
NPU1 = "mlir-aie-npu1_1col"


def run_json(capsys, *argv: str) -> dict:
    """The document of ``amdxdna COMMAND FILE --json`` without its envelope (schema, command, file), checked."""
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    doc = json.loads(out.out)
    assert (doc.pop("schema"), doc.pop("command"), doc.pop("file")) == (1, argv[0], argv[-1])  # docs/cli.md
    return doc


# --------------------------------------------------------------------------------------------- xclbin


def test_xclbin_json_document(capsys):
    path = fixture(f"{NPU1}/aie.xclbin")
    raw = path.read_bytes()
    doc = run_json(capsys, "xclbin", str(path))
    assert set(doc) == {"uuid", "length", "sections", "kernels", "partition"}
    assert doc["uuid"] == raw[0x1A0:0x1B0].hex() and doc["length"] == len(raw) == 9095
    assert [s["kind"] for s in doc["sections"]] == [
        "MEM_TOPOLOGY", "AIE_PARTITION", "EMBEDDED_METADATA", "IP_LAYOUT", "CONNECTIVITY", "ASK_GROUP_CONNECTIVITY",
        "ASK_GROUP_TOPOLOGY"]
    for i, s in enumerate(doc["sections"]):
        assert set(s) == {"kind", "name", "offset", "size"}
        assert (s["offset"], s["size"]) == struct.unpack_from("<QQ", raw, 0x1C8 + 40 * i + 0x18)

    (kernel,) = doc["kernels"]
    (want,) = json.loads(fixture(f"{NPU1}/main_kernels.json").read_text())["ps-kernels"]["kernels"]
    assert set(kernel) == {"name", "type", "dpu_kernel_id", "instances", "args"}
    assert (kernel["name"], kernel["type"], kernel["dpu_kernel_id"], kernel["instances"]) == (
        want["name"], want["type"], int(want["extended-data"]["dpu_kernel_id"], 16), ["MLIRAIE"])
    sizes = {"uint64_t": 8, "char *": 8, "uint32_t": 4, "void*": 8}
    assert kernel["args"] == [{"name": a["name"], "index": i, "offset": int(a["offset"], 16), "size": sizes[a["type"]],
                               "kind": a["address-qualifier"].lower()} for i, a in enumerate(want["arguments"])]

    part = doc["partition"]
    want = json.loads(fixture(f"{NPU1}/main_aie_partition.json").read_text())["aie_partition"]
    assert set(part) == {"column_width", "start_columns", "ops_per_cycle", "pdis"}
    assert (part["column_width"], part["start_columns"], part["ops_per_cycle"]) == (
        want["partition"]["column_width"], want["partition"]["start_columns"], int(want["operations_per_cycle"]))
    (pdi,) = part["pdis"]
    assert set(pdi) == {"uuid", "size", "sha256", "cdo_groups"}
    assert pdi["uuid"] == uuidlib.UUID(want["PDIs"][0]["uuid"]).hex
    # the PDI image is the 2640 bytes starting with the PDI magic (docs/xrt-sequence.md 3.8), found in the raw file
    start = raw.index(bytes.fromhex("DD000000 44332211 88776655 CCBBAA99"))
    assert (pdi["size"], pdi["sha256"]) == (2640, hashlib.sha256(raw[start:start + 2640]).hexdigest())
    assert pdi["cdo_groups"] == [{"name": g["name"], "type": g["type"], "pdi_id": int(g["pdi_id"], 16),
                                  "dpu_kernel_ids": [int(v, 16) for v in g["dpu_kernel_ids"]],
                                  "pre_cdo_groups": [int(v, 16) for v in g["pre_cdo_groups"]]}
                                 for g in want["PDIs"][0]["cdo_groups"]]


# Issue 2 item 7, read literally: the key set of every object of the two documents.
XCLBIN_KEYS = {"uuid", "length", "sections", "kernels", "partition"}
SECTION_KEYS = {"kind", "name", "offset", "size"}
KERNEL_KEYS = {"name", "type", "dpu_kernel_id", "instances", "args"}
ARG_KEYS = {"name", "index", "offset", "size", "kind"}
PARTITION_KEYS = {"column_width", "start_columns", "ops_per_cycle", "pdis"}
PDI_KEYS = {"uuid", "size", "sha256", "cdo_groups"}
CDO_GROUP_KEYS = {"name", "type", "pdi_id", "dpu_kernel_ids", "pre_cdo_groups"}
INSTS_KEYS = {"format", "major", "minor", "dev_gen", "rows", "cols", "mem_tile_rows", "num_ops", "size_bytes", "pad",
              "ops"}
OP_KEYS = {"write32": {"op", "addr", "value"}, "blockwrite": {"op", "addr", "words"},
           "maskwrite": {"op", "addr", "value", "mask"}, "ddr_patch": {"op", "reg_addr", "arg_idx", "arg_plus"},
           "sync": {"op", "direction", "row", "col", "channel", "row_num", "col_num"},
           "raw": {"op", "opcode", "name", "words", "size_bytes", "reason", "sized"}}
HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.mark.parametrize("rel", ["mlir-aie-npu1_1col/aie.xclbin", "mlir-aie-npu2_1col/final.xclbin",
                                 "amd-npu4/preemption_4x4.xclbin", "amd-npu4/preemption_4x8.xclbin",
                                 "amd-npu1/validate_throughput_phx.xclbin"])
def test_xclbin_json_schema_of_every_fixture(capsys, rel):
    doc = run_json(capsys, "xclbin", str(fixture(rel)))
    assert set(doc) == XCLBIN_KEYS and HEX32.fullmatch(doc["uuid"]) and doc["length"] == fixture(rel).stat().st_size
    assert all(set(s) == SECTION_KEYS and isinstance(s["kind"], str) for s in doc["sections"])
    for kernel in doc["kernels"]:
        assert set(kernel) == KERNEL_KEYS and isinstance(kernel["instances"], list)
        assert all(set(a) == ARG_KEYS and a["kind"] in ("scalar", "global") for a in kernel["args"])
    part = doc["partition"]
    assert set(part) == PARTITION_KEYS and part["pdis"]
    for pdi in part["pdis"]:
        assert set(pdi) == PDI_KEYS and HEX32.fullmatch(pdi["uuid"]) and re.fullmatch(r"[0-9a-f]{64}", pdi["sha256"])
        assert all(set(g) == CDO_GROUP_KEYS and g["type"] in ("UNKNOWN", "PRIMARY", "LITE", "PREPOST")
                   for g in pdi["cdo_groups"])


@pytest.mark.parametrize("rel", ["mlir-aie-npu1_1col/insts.bin", "mlir-aie-npu2_1col/insts.bin"])
def test_insts_json_schema_of_every_fixture(capsys, rel):
    doc = run_json(capsys, "insts", str(fixture(rel)))
    assert set(doc) == INSTS_KEYS and doc["format"] == "txn" and doc["size_bytes"] == fixture(rel).stat().st_size
    assert doc["num_ops"] == len(doc["ops"]) and all(set(op) == OP_KEYS[op["op"]] for op in doc["ops"])


def test_xclbin_json_amd_fixture_and_null_partition(capsys, tmp_path):
    doc = run_json(capsys, "xclbin", str(fixture("amd-npu4/preemption_4x4.xclbin")))
    assert [(k["name"], k["dpu_kernel_id"]) for k in doc["kernels"]] == [("vadd", None), ("DPU", 0x100),
                                                                          ("DPU_ELF", 0x100)]
    assert doc["partition"]["column_width"] == 4
    x = xclbin.build_mlir_aie(b"p")
    bare = tmp_path / "bare.xclbin"
    sections = tuple(s for s in x.sections if s.kind != xclbin.AIE_PARTITION)
    bare.write_bytes(xclbin.write(dataclasses.replace(x, sections=sections)))
    assert run_json(capsys, "xclbin", str(bare))["partition"] is None


def test_xclbin_text_summary(capsys):
    assert main(["xclbin", str(fixture(f"{NPU1}/aie.xclbin"))]) == 0
    out = capsys.readouterr().out
    for expected in ("uuid             2d73dbc8-1584-17fc-a4c2-a796b48d7b94", "version          2.23.0",
                     "MEM_TOPOLOGY (6)", "main_aie_partit", "MLIR_AIE:MLIRAIE PS_KERNEL properties 0x09010001",
                     "MLIR_AIE type dpu dpu_kernel_id 0x901 instances MLIRAIE", "start columns    1, 2, 3, 4",
                     "cdo group DPU PRIMARY pdi_id 0x1 dpu_kernel_ids 0x901 pre_cdo_groups 0xc1"):
        assert expected in out


# --------------------------------------------------------------------------------------------- insts


# The npu1_1col insts.bin ops worked out by hand from its words (docs/xrt-sequence.md 2.3).
BD = [0, 0, 0, 0x80000000, 0x02000000, 0, 0x02000000]
NPU1_OPS_JSON = [
    {"op": "blockwrite", "addr": 0x1D020, "words": [0x10] + BD},
    {"op": "ddr_patch", "reg_addr": 0x1D024, "arg_idx": 2, "arg_plus": 0},
    {"op": "maskwrite", "addr": 0x1D200, "value": 0xF00, "mask": 0x1F00},
    {"op": "write32", "addr": 0x1D204, "value": 0x80000001},
    {"op": "blockwrite", "addr": 0x1D000, "words": [0x11] + BD},
    {"op": "ddr_patch", "reg_addr": 0x1D004, "arg_idx": 0, "arg_plus": 0},
    {"op": "maskwrite", "addr": 0x1D210, "value": 0xF00, "mask": 0x1F00},
    {"op": "write32", "addr": 0x1D214, "value": 0x80000000},
    {"op": "sync", "direction": 0, "row": 0, "col": 0, "channel": 0, "row_num": 1, "col_num": 1},
]


def test_insts_json_document(capsys):
    doc = run_json(capsys, "insts", str(fixture(f"{NPU1}/insts.bin")))
    assert doc == {"format": "txn", "major": 0, "minor": 1, "dev_gen": 3, "rows": 6, "cols": 1, "mem_tile_rows": 1,
                   "num_ops": 9, "size_bytes": 328, "pad": 0, "ops": NPU1_OPS_JSON}


def test_insts_txt_file_gives_the_same_document(capsys, tmp_path):
    raw = fixture(f"{NPU1}/insts.bin").read_bytes()
    text = tmp_path / "insts.txt"
    text.write_text("".join(f"{w:08X}\n" for w in struct.unpack(f"<{len(raw) // 4}I", raw)))
    assert run_json(capsys, "insts", str(text))["ops"] == NPU1_OPS_JSON


def test_insts_text_listing_has_word_offsets(capsys):
    assert main(["insts", str(fixture(f"{NPU1}/insts.bin"))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "TXN 0.1  dev_gen 3  rows 6  cols 1  mem_tile_rows 1  ops 9  size 328 bytes"
    offsets = [int(line.split()[0]) for line in lines[2:] if line.split()[1].isupper()]
    assert offsets == [4, 16, 28, 35, 41, 53, 65, 72, 78]
    assert "DDR_PATCH   reg_addr 0x0001d024 (col 0 row 0 +0x1d024)  arg_idx 2  arg_plus 0x0" in lines[4]
    assert lines[3].split() == ["00000010", "00000000", "00000000", "00000000", "80000000", "02000000", "00000000",
                                "02000000"]


# A generated 0.1 stream (words laid out by hand from aie-rt's structs, docs/runtime.md 1.1): WRITE32, MASKPOLL
# (28 bytes, size in word 6), RECORD_TIMER and MERGE_SYNC (custom ops, size in word 1), then an op of unknown
# length (0x20) that takes the rest.
RAW_STREAM = [0x06040100, 0x101, 5, 4 * 25,
              0, 0, 0x1D204, 0, 5, 24,
              0x04, 0, 0x1D204, 0, 0x1, 0xF, 28,
              0x83, 12, 7,
              0x84, 12, 0x00010002,
              0x20, 1]
# A WRITE32 whose op header carries col/row bytes: kept raw, the listing says why.
ODD_WRITE = [0x06040100, 0x101, 1, 40, 0x00020100, 0, 0x1D204, 0, 5, 24]


def test_insts_says_why_a_known_op_is_kept_raw(capsys, tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(struct.pack(f"<{len(ODD_WRITE)}I", *ODD_WRITE))
    assert main(["insts", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[2] == \
        "     4  RAW WRITE32  opcode 0x00  24 bytes  kept raw: op header 0x00020100 has non-zero col/row/padding bytes"


def test_insts_shows_raw_ops_with_their_words_and_size(capsys, tmp_path):
    path = tmp_path / "raw.bin"
    path.write_bytes(struct.pack(f"<{len(RAW_STREAM)}I", *RAW_STREAM))
    doc = run_json(capsys, "insts", str(path))
    assert set(doc) == INSTS_KEYS and doc["num_ops"] == 5 and doc["size_bytes"] == 100
    assert all(set(op) == OP_KEYS[op["op"]] for op in doc["ops"])
    raw = [(op["name"], op["opcode"], op["size_bytes"], op["words"], op["sized"]) for op in doc["ops"][1:]]
    assert raw == [("MASKPOLL", 0x04, 28, RAW_STREAM[10:17], True), ("RECORD_TIMER", 0x83, 12, RAW_STREAM[17:20], True),
                   ("MERGE_SYNC", 0x84, 12, RAW_STREAM[20:23], True), ("OP_0x20", 0x20, 8, [0x20, 1], False)]
    assert main(["insts", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "TXN 0.1  dev_gen 4  rows 6  cols 1  mem_tile_rows 1  ops 5  size 100 bytes"
    assert lines[3] == "    10  RAW MASKPOLL opcode 0x04  28 bytes"
    assert lines[4].split() == ["00000004", "00000000", "0001d204", "00000000", "00000001", "0000000f", "0000001c"]
    assert lines[5] == "    17  RAW RECORD_TIMER opcode 0x83  12 bytes"
    assert lines[-2] == "    23  RAW OP_0x20  opcode 0x20  8 bytes to the end (length unknown, op count not checked)"
    assert lines[-1].split() == ["00000020", "00000001"]


# --------------------------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize("command", ["xclbin", "insts"])
def test_missing_file_exits_1_with_errno_name(capsys, command, tmp_path):
    assert main([command, str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert f"amdxdna {command}: " in err and "ENOENT (No such file or directory)" in err
    assert "Traceback" not in err


def test_format_errors_exit_1_with_the_parser_message(capsys, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(struct.pack("<5I", 0x06030100, 0x101, 1, 24, 0x05))
    assert main(["insts", str(bad)]) == 1
    assert capsys.readouterr().err.strip() == \
        f"amdxdna insts: {bad}: word 3: header size_bytes 24 disagrees with the stream length 20"
    assert main(["xclbin", str(bad)]) == 1
    assert "axlf header: struct axlf at offset 0 size 304 lies outside the 20 bytes" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["bogus"], ["xclbin"], ["insts", "a", "b"], ["xclbin", "--nope", "f"]])
def test_usage_errors_exit_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("amdxdna") and "error: " in err and "--help`)" in err and err.count("\n") == 1, err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "xclbin" in capsys.readouterr().out


def test_python_dash_m_entry_point():
    path = fixture(f"{NPU1}/insts.bin")
    done = subprocess.run([sys.executable, "-m", "amdxdna_direct.cli", "insts", "--json", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ops"] == NPU1_OPS_JSON
    done = subprocess.run([sys.executable, "-m", "amdxdna_direct.cli", "insts"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("amdxdna insts: error: the following arguments are required")
