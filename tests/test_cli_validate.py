"""amdxdna validate on the emulator: the mlir-aie npu1 and npu2 fixtures, designs this test generates,
XRT's validate directories and archives in a fake tree, and the SAM3 bundle interface.

Oracles: the fixtures' buffer descriptors decoded by hand (npu1_1col patches slots 0 and 2, the output BD
is 16 words; npu2_1col patches 0 with 128 words and 1 with 4096), the sizes this test gives its own
designs, an ``ar`` archive built here byte by byte (ar(5)), and a model that corrupts the output.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import test_cli_isolation
from fixture_files import FIXTURES

import sam3  # noqa: F401  (registers its bundle reader, as the installed entry point does)
from amdxdna_direct import insts, open_device
from amdxdna_direct.cli import main, validate_cmd
from amdxdna_direct.emu import EmuDevice
from amdxdna_direct.xclbin import build_mlir_aie, write

no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")

NPU1_1COL = FIXTURES / "mlir-aie-npu1_1col"
NPU2_1COL = FIXTURES / "mlir-aie-npu2_1col"
needs_npu1 = pytest.mark.skipif(not (NPU1_1COL / "aie.xclbin").is_file(),
                                reason=f"fixture {NPU1_1COL} absent (tests/fixtures incomplete in this checkout)")
needs_npu2 = pytest.mark.skipif(not (NPU2_1COL / "final.xclbin").is_file(),
                                reason=f"fixture {NPU2_1COL} absent (tests/fixtures incomplete in this checkout)")
QUICK = ["--runs", "5", "--chain", "4", "--repeat", "2", "--json"]


def generated_design(tmp_path: Path, dev_gen: int, size: int = 1024, name: str = "copy") -> tuple[Path, Path]:
    """A passthrough design written with the project's own writers: a 1-column mlir-aie xclbin and a DMA stream
    moving ``size`` bytes from slot 0 to slot 1."""
    xclbin, stream = tmp_path / f"{name}.xclbin", tmp_path / f"{name}.bin"
    xclbin.write_bytes(write(build_mlir_aie(b"validate test PDI", column_width=1, n_buffers=2)))
    stream.write_bytes(insts.encode(insts.dma_stream(dev_gen, [(0, size, "in"), (1, size, "out")])))
    return xclbin, stream


def validate(argv: list[str], capsys) -> tuple[int, dict]:
    rc = main(["validate", *argv])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip().startswith("{") else {}


def check_timings(report: dict, runs: int = 5, chain: int = 4) -> None:
    latency, throughput = report["latency"], report["throughput"]
    assert latency["runs"] == runs and throughput["runs"] == chain and throughput["repeat"] == 2
    for spread in (latency["host_us"], latency["device_us"], latency["end_to_end_us"], throughput["per_dispatch_us"]):
        assert 0 < spread["min"] <= spread["median"] <= spread["p99"]
    assert latency["end_to_end_us"]["min"] >= latency["host_us"]["min"]  # dispatch is part of the whole
    assert throughput["runs_per_s"] > 0 and throughput["chains"] == 1  # 4 runs fit one chain packet


@needs_npu1
def test_npu1_fixture_passthrough_on_the_emulator(capsys):
    rc, doc = validate(["--device", "emu:npu1", "--xclbin", str(NPU1_1COL / "aie.xclbin"), "--insts",
                        str(NPU1_1COL / "insts.bin"), "--passthrough", *QUICK], capsys)
    assert rc == 0
    report, = doc["designs"]
    assert (doc["device"], doc["generation"], report["status"]) == ("emu:npu1", "npu1", "pass")
    assert report["buffers"] == {"bo0": 68, "bo2": 64}  # input BD 17 words, output BD 16 words
    assert report["check"] == "passed: bo2 == bo0 (64 bytes)"
    check_timings(report)


@needs_npu2
def test_npu2_fixture_on_the_npu4_emulator_with_a_model(capsys):
    rc, doc = validate(["--device", "emu:npu4", "--xclbin", str(NPU2_1COL / "final.xclbin"), "--insts",
                        str(NPU2_1COL / "insts.bin"), "--model", "passthrough", *QUICK], capsys)
    assert rc == 0
    report, = doc["designs"]
    assert report["status"] == "pass" and report["buffers"] == {"bo0": 512, "bo1": 16384}
    assert report["check"] == "passed: bo1 == bo0 (512 bytes)"  # the model copies min(in, out) bytes
    check_timings(report)


@needs_npu2
def test_design_without_a_model_is_skipped_on_the_emulator(capsys):
    rc = main(["validate", "--device", "emu:npu4", "--xclbin", str(NPU2_1COL / "final.xclbin"), "--insts",
               str(NPU2_1COL / "insts.bin")])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "[skipped] final.xclbin + insts.bin: the emulator has no model bound to this design's stream" in out
    assert "no design ran" in err


@pytest.mark.parametrize("profile, dev_gen", [("npu1", 3), ("npu4", 4)])
def test_generated_design_on_both_generations(tmp_path, capsys, profile, dev_gen):
    xclbin, stream = generated_design(tmp_path, dev_gen, size=2048)
    rc, doc = validate(["--device", f"emu:{profile}", "--xclbin", str(xclbin), "--insts", str(stream),
                        "--passthrough", *QUICK], capsys)
    assert rc == 0
    report, = doc["designs"]
    assert report["buffers"] == {"bo0": 2048, "bo1": 2048}
    assert report["check"] == "passed: bo1 == bo0 (2048 bytes)"
    check_timings(report)


def test_text_report(tmp_path, capsys):
    xclbin, stream = generated_design(tmp_path, 4)
    assert main(["validate", "--device", "emu:npu4", "--xclbin", str(xclbin), "--insts", str(stream),
                 "--passthrough", "--runs", "3", "--chain", "2", "--repeat", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device emu:npu4 (npu4)"
    assert lines[1] == "[pass] copy.xclbin + copy.bin"
    assert lines[2].split() == ["buffers", "bo0", "1024", "B,", "bo1", "1024", "B"]
    assert lines[3].strip() == "output      passed: bo1 == bo0 (1024 bytes)"
    assert lines[4].strip() == "chained     passed: bo1 == bo0 (1024 bytes)"
    assert lines[5].strip().startswith("latency     3 runs: host dispatch min ")
    assert "submit to completion" in lines[5] and "end to end" in lines[5]
    assert lines[6].strip().startswith("throughput  2 chained runs x 2 (1 chain packet(s)): per dispatch min ")
    assert re.fullmatch(r"chain/one   a chained dispatch takes \d+\.\d\dx the median end to end of a single run",
                        lines[7].strip())


class Corrupt:
    """An emulator model that writes the inverse of the input: a passthrough check must fail."""

    name = "corrupt"

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        src, dst = args[min(args)], args[max(args)]
        dst[:src.nbytes] = ~src[:dst.nbytes]


def test_a_wrong_output_fails_the_check(tmp_path):
    xclbin, stream = generated_design(tmp_path, 4, size=256)
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        design = validate_cmd.Design("corrupting", xclbin, stream, passthrough=True, model=Corrupt())
        report = validate_cmd.validate_design(dev, design, runs=2, chain=2, repeat=1)
    assert report["status"] == "fail"
    assert report["check"].startswith("failed: output bo1 differs from input bo0 in 256 of 256 bytes, first at byte 0")


class FailsAfter:
    """A passthrough that faults from its (n+1)-th run on: the single runs pass, the chained ones fail."""

    name = "fails-after"

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        from amdxdna_direct.emu.memory import DeviceFault

        self.calls += 1
        if self.calls > self.n:
            raise DeviceFault(f"run {self.calls}: this model fails after {self.n} runs")
        src, dst = args[min(args)], args[max(args)]
        dst[:src.nbytes] = src[:dst.nbytes]


def test_the_chained_dispatch_is_checked_as_the_single_one(tmp_path):
    """The same design as a chain: its output is checked too (a pattern of its own), its time compared with a
    single run's; a chain that fails where single runs pass says so and names SAM3_CHAINS=0."""
    xclbin, stream = generated_design(tmp_path, 4, size=256)
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        design = validate_cmd.Design("copy", xclbin, stream, passthrough=True)
        report = validate_cmd.validate_design(dev, design, runs=2, chain=3, repeat=1)
    assert report["status"] == "pass" and report["chain_check"] == "passed: bo1 == bo0 (256 bytes)"
    assert report["chain_vs_single"] > 0
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        design = validate_cmd.Design("chain-only fault", xclbin, stream, passthrough=True, model=FailsAfter(3))
        report = validate_cmd.validate_design(dev, design, runs=2, chain=3, repeat=1)
    assert report["status"] == "fail"
    assert report["detail"].startswith("the chain of 3 runs failed where single runs passed: ")
    assert "this model fails after 3 runs" in report["detail"] and "SAM3_CHAINS=0" in report["detail"]


def test_a_failing_run_fails_the_design(tmp_path, capsys):
    xclbin, stream = generated_design(tmp_path, 4)
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        emu.faults.error(stream.read_bytes())
        design = validate_cmd.Design("erroring", xclbin, stream, passthrough=True)
        report = validate_cmd.validate_design(dev, design, runs=2, chain=2, repeat=1)
    assert report["status"] == "fail" and "ERROR" in report["detail"]


def test_a_malformed_design_file_fails_with_exit_1(tmp_path, capsys):
    _, stream = generated_design(tmp_path, 4)
    (tmp_path / "bad.xclbin").write_bytes(b"not an xclbin")
    rc, doc = validate(["--device", "emu:npu4", "--xclbin", str(tmp_path / "bad.xclbin"), "--insts", str(stream),
                        "--passthrough", *QUICK], capsys)
    assert rc == 1
    assert doc["designs"][0]["detail"].startswith(f"xclbin {tmp_path / 'bad.xclbin'}: ")


def test_without_a_design_it_says_what_it_needs(tmp_path, capsys):
    assert main(["validate", "--device", "emu:npu4", "--xrt", str(tmp_path / "no-xrt")]) == 2
    err = capsys.readouterr().err
    assert "no design to run. It needs one of: --xclbin X --insts I" in err and "--bundle DIR" in err
    assert f"{tmp_path / 'no-xrt' / 'share/amdxdna/bins'} does not exist" in err


def test_usage_errors(tmp_path, capsys):
    xclbin, stream = generated_design(tmp_path, 4)
    cases = {
        "--xclbin and --insts go together": ["--device", "emu:npu4", "--xclbin", str(xclbin)],
        "is not the emulator": ["--device", str(tmp_path / "accel0"), "--xclbin", str(xclbin), "--insts",
                                str(stream), "--model", "passthrough"],
        "unknown model": ["--device", "emu:npu4", "--xclbin", str(xclbin), "--insts", str(stream), "--model", "fft"],
        "must be at least 1": ["--device", "emu:npu4", "--runs", "0"],
        "give --xclbin and --insts": ["--device", "emu:npu4", "--passthrough"],
    }
    for words, argv in cases.items():
        assert main(["validate", *argv]) == 2, argv
        assert words in capsys.readouterr().err, words


def ar_archive(members: dict[str, bytes]) -> bytes:
    """An ar(5) archive: "!<arch>\\n", then per member a 60-byte header (name/ 16, mtime 12, uid 6, gid 6,
    mode 8, size 10, "`\\n") and the data padded to an even length; names over 15 bytes via a GNU // table."""
    table = b"".join(name.encode() + b"/\n" for name in members if len(name) > 15)
    out = [b"!<arch>\n"]

    def member(name: str, data: bytes) -> None:
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{644:<8}{len(data):<10}`\n".encode()
        out.append(header + data + (b"\n" if len(data) % 2 else b""))

    if table:
        member("//", table)
    offset = 0
    for name, data in members.items():
        if len(name) > 15:
            member(f"/{offset}", data)
            offset += len(name) + 2
        else:
            member(name + "/", data)
    return b"".join(out)


def test_read_ar_archive():
    members = {"validate.xclbin": b"x" * 7, "nop.elf": b"\x7fELF", "recipe_latency_strx.json": b"{}"}
    assert validate_cmd.read_ar(ar_archive(members)) == members
    with pytest.raises(ValueError, match="no !<arch> magic"):
        validate_cmd.read_ar(b"PK\x03\x04")


def test_xrt_validate_designs_are_found_and_explained(tmp_path, capsys):
    bins = tmp_path / "xrt/share/amdxdna/bins"
    (bins / "17f0_10").mkdir(parents=True)
    (bins / "17f0_10/validate.xclbin").write_bytes(b"xclbin")
    (bins / "17f0_10/nop.elf").write_bytes(b"\x7fELF")
    (bins / "1502_00").mkdir()
    (bins / "1502_00/validate.xclbin").write_bytes(b"npu1 only")
    (bins / "xrt_smi_strx.a").write_bytes(ar_archive({"validate.xclbin": b"x", "nop.elf": b"e",
                                                      "recipe_latency.json": b"{}"}))
    assert main(["validate", "--device", "emu:npu4", "--xrt", str(tmp_path / "xrt"), *QUICK]) == 2
    out, err = capsys.readouterr()
    # Nothing runnable (XRT's designs run ELF control code): no report but the JSON error object, the reasons on
    # stderr in one line.
    error = json.loads(out)
    assert (error["schema"], error["command"], error["ok"]) == (1, "validate", False)
    assert error["error"] in err and err.count("\n") == 1
    assert [d["status"] for d in error["designs"]] == ["skipped", "skipped"]
    assert "XRT 17f0_10/validate.xclbin: no TXN instruction stream beside it" in err and "nop.elf" in err
    assert "XRT xrt_smi_strx.a: holds nop.elf, recipe_latency.json, validate.xclbin" in err
    assert "1502_00" not in err  # another generation's directory


def test_xrt_design_with_a_txn_stream_runs(tmp_path, capsys):
    bins = tmp_path / "xrt/share/amdxdna/bins/17f0_10"
    bins.mkdir(parents=True)
    generated_design(bins, 4, name="validate")
    found, note = validate_cmd.find_xrt_designs(tmp_path / "xrt", "npu4")
    assert note == "" and [(d.name, d.skip) for d in found] == [("XRT 17f0_10/validate.xclbin", "")]
    assert found[0].insts == bins / "validate.bin"


@pytest.mark.parametrize("variant", ["host", "device-f32"])
def test_a_generated_sam3_bundles_kernels_are_validated(tmp_path, capsys, variant):
    """Every kernel of a SAM3 bundle in IRON's format runs, its model (what the manifest says it computes) bound
    on the emulator; the buffers are sized from each stream's DMA extents."""
    from sam3.build import build
    from sam3.bundle import Bundle

    root = build(tmp_path / "b", "tiny", variant=variant)
    with Bundle.open(root) as bundle:
        keys = bundle.kernel_keys()
        b_bytes = bundle.gemms["v_qkv"].b_bytes
    rc, doc = validate(["--device", "emu:npu4", "--bundle", str(root), *QUICK], capsys)
    assert rc == 0
    assert [d["design"] for d in doc["designs"]] == [f"bundle {k}" for k in keys]
    assert {d["status"] for d in doc["designs"]} == {"pass"}
    (qkv,) = [d for d in doc["designs"] if d["design"] == "bundle v_qkv"]
    assert qkv["buffers"]["bo1"] == b_bytes
    check_timings(qkv)


def test_a_broken_bundle_is_skipped_with_the_reason(tmp_path, capsys):
    assert main(["validate", "--device", "emu:npu4", "--bundle", str(tmp_path)]) == 2
    assert f"--bundle {tmp_path}: skipped: the bundle cannot be opened: " in capsys.readouterr().err


def test_bundle_interface_missing_is_skipped_with_a_clear_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sam3.bundle", None)  # import sam3.bundle raises ImportError
    assert main(["validate", "--device", "emu:npu4", "--bundle", str(tmp_path)]) == 2
    assert f"--bundle {tmp_path}: skipped: the sam3 package is not importable" in capsys.readouterr().err


def test_bundle_designs_come_from_registered_readers_not_from_an_import(tmp_path, capsys, monkeypatch):
    from amdxdna_direct import extensions

    monkeypatch.setattr(extensions, "_READERS", {})
    monkeypatch.setattr(extensions, "BUNDLE_READER_GROUP", "amdxdna_direct.no_such_group")
    assert main(["validate", "--device", "emu:npu4", "--bundle", str(tmp_path)]) == 2
    assert "skipped: no bundle reader is registered" in capsys.readouterr().err
    seen = []
    extensions.register_bundle_reader("test", lambda d: seen.append(d) or [])
    assert validate_cmd.find_bundle_designs(str(tmp_path)) == ([], "")
    assert seen == [str(tmp_path)]
    with pytest.raises(TypeError):
        extensions.register_bundle_reader("bad", 3)


def test_cli_conventions_shared_by_both_command_lines(capsys):
    from amdxdna_direct.cli import conventions

    assert conventions.error_document("check", "boom", file="x") == {
        "schema": 1, "command": "check", "ok": False, "error": "boom", "file": "x"}
    assert conventions.report_failure("sam3", "check", "a\nb", as_json=True) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == "a\nb" and err == "sam3 check: a\\nb\n"
    assert conventions.version_line("sam3").startswith("sam3 (amdxdna-direct) ")
