"""amdxdna run: numpy files in and out on the emulator.

Oracles: the real npu1_1col fixture (its insts.bin patches buffer slots 0 and 2, BD lengths 68 and 64 bytes,
decoded by hand in docs/xrt-sequence.md 2.3), numpy for the GEMM, and the XRT per-run ioctls of
docs/xrt-sequence.md 1.8-1.9 (one EXEC_CMD, one SYNCOBJ_TIMELINE_WAIT).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import test_cli_isolation
from fixture_files import REPO_FIXTURES

from amdxdna_direct import insts
from amdxdna_direct.cli import main, run_cmd
from amdxdna_direct.cli.run_cmd import BufferSpec, UsageError
from amdxdna_direct.emu import EmuDevice
from amdxdna_direct.xclbin import build_mlir_aie, write

# Every test here runs under the guard: no file of the real system is read (test_cli_isolation).
no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")

NPU1_1COL = REPO_FIXTURES / "xdna/mlir-aie-npu1_1col"
needs_fixture = pytest.mark.skipif(not (NPU1_1COL / "aie.xclbin").exists(), reason=f"fixtures absent: {NPU1_1COL}")


@needs_fixture
def test_passthrough_on_the_npu1_fixture_returns_the_input(tmp_path, capsys):
    data = np.arange(16, dtype=np.int32) * 7 - 3  # 64 bytes: the output BD of the fixture is 16 words
    np.save(tmp_path / "in.npy", data)
    rc = main(["run", "--device", "emu:npu1", "--model", "passthrough", "--xclbin", str(NPU1_1COL / "aie.xclbin"),
               "--insts", str(NPU1_1COL / "insts.bin"), "--in", str(tmp_path / "in.npy"),
               "--out", str(tmp_path / "out.npy"), "--repeat", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data)
    assert "bo0: " in out and "bo2: " in out  # the stream patches slots 0 and 2
    assert "time per run: min" in out and "median" in out and "max" in out
    assert "ioctls per run: 2 (EXEC_CMD 1, SYNCOBJ_TIMELINE_WAIT 1)" in out


@needs_fixture
def test_json_report_and_explicit_slots(tmp_path, capsys):
    data = np.arange(64, dtype=np.uint8)
    np.save(tmp_path / "in.npy", data)
    rc = main(["run", "--device", "emu:npu1", "--model", "passthrough", "--xclbin", str(NPU1_1COL / "aie.xclbin"),
               "--insts", str(NPU1_1COL / "insts.bin"), "--out", f"2={tmp_path / 'out.npy'}", "--out-size", "64",
               "--in", f"0={tmp_path / 'in.npy'}", "--json", "--repeat", "4"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["runs"] == 4
    assert report["ioctls_per_run"] == {"EXEC_CMD": 1, "SYNCOBJ_TIMELINE_WAIT": 1}
    assert report["seconds"]["min"] <= report["seconds"]["median"] <= report["seconds"]["max"]
    assert report["outputs"] == [{"slot": 2, "path": str(tmp_path / "out.npy"), "bytes": 64, "dtype": "uint8",
                                  "shape": [64]}]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data)


def test_gemm_model_equals_numpy(tmp_path, capsys):
    m, k, n = 8, 16, 24
    rng = np.random.default_rng(6)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    (tmp_path / "gemm.xclbin").write_bytes(write(build_mlir_aie(b"gemm", column_width=1, n_buffers=3)))
    stream = insts.dma_stream(4, [(0, a.nbytes, "in"), (1, b.nbytes, "in"), (2, m * n * 2, "out")])
    (tmp_path / "gemm.bin").write_bytes(insts.encode(stream))
    rc = main(["run", "--device", "emu:npu4", "--model", f"gemm:{m},{k},{n}", "--xclbin", str(tmp_path / "gemm.xclbin"),
               "--insts", str(tmp_path / "gemm.bin"), "--in", str(tmp_path / "a.npy"), "--in", str(tmp_path / "b.npy"),
               "--out", str(tmp_path / "c.npy"), "--out-size", str(m * n * 2)])
    assert rc == 0, capsys.readouterr().err
    c = np.load(tmp_path / "c.npy").view(ml_dtypes.bfloat16)  # .npy stores bfloat16 as 2-byte void
    assert c.shape == (m * n,)
    expected = (a.astype(np.float32) @ b.astype(np.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(c.reshape(m, n).astype(np.float32), expected.astype(np.float32))


def test_a_stream_with_ops_the_runtime_does_not_decode_runs(tmp_path, capsys):
    # MASKPOLL (28 bytes, size in word 6) and RECORD_TIMER (custom op, size in word 1) inserted by hand before the
    # final SYNC: `run` uploads the stream as given (docs/runtime.md 1) and the copy still happens.
    data = np.arange(64, dtype=np.uint8)
    np.save(tmp_path / "in.npy", data)
    (tmp_path / "copy.xclbin").write_bytes(write(build_mlir_aie(b"copy", column_width=1, n_buffers=2)))
    stream = insts.dma_stream(4, [(0, 64, "in"), (1, 64, "out")])
    words = insts.encode_words(stream)
    sync_at = insts.layout(stream)[-1]
    extra = [0x04, 0, 0x1D204, 0, 0, 0, 28, 0x83, 12, 1]
    body = words[4:sync_at] + extra + words[sync_at:]
    raw = np.array([words[0], words[1], words[2] + 2, 4 * (4 + len(body))] + body, "<u4").tobytes()
    (tmp_path / "copy.bin").write_bytes(raw)
    rc = main(["run", "--device", "emu:npu4", "--model", "passthrough", "--xclbin", str(tmp_path / "copy.xclbin"),
               "--insts", str(tmp_path / "copy.bin"), "--in", str(tmp_path / "in.npy"), "--out",
               str(tmp_path / "out.npy"), "--out-size", "64"])
    assert rc == 0, capsys.readouterr().err
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data)


@needs_fixture
def test_command_error_exits_1(tmp_path, capsys):
    np.save(tmp_path / "in.npy", np.zeros(16, np.int32))
    with EmuDevice("npu1") as emu:
        emu.faults.error(insts.encode(insts.load(NPU1_1COL / "insts.bin")))
        args = run_args(tmp_path, device=emu, inputs=[str(tmp_path / "in.npy")], outputs=[str(tmp_path / "out.npy")])
        assert run_cmd.run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("amdxdna run: ") and "ERROR" in err
    assert not (tmp_path / "out.npy").exists()


def run_args(tmp_path, **overrides) -> argparse.Namespace:
    values = dict(device="emu:npu1", xclbin=str(NPU1_1COL / "aie.xclbin"), insts=str(NPU1_1COL / "insts.bin"),
                  kernel=None, inputs=[], outputs=[], out_sizes=[], out_dtype=None, repeat=1, timeout=10.0,
                  model="passthrough", json=False)
    values.update(overrides)
    return argparse.Namespace(**values)


@needs_fixture
@pytest.mark.parametrize("argv_tail, message", [
    (["--device", "/dev/accel/accel9", "--model", "passthrough"], "not the emulator"),
    (["--device", "emu:npu1", "--model", "conv"], "unknown model"),
    (["--device", "emu:npu1", "--model", "gemm:1,2"], "gemm:M,K,N"),
    (["--device", "emu:npu1", "--model", "gemm:0,2,2"], "gemm:M,K,N"),
    (["--device", "emu:npu9"], "unknown emulator profile 'npu9'"),
    (["--device", "emu:npu1", "--repeat", "0"], "--repeat 0"),
    (["--device", "emu:npu1", "--timeout", "0"], "--timeout 0.0"),
    (["--device", "emu:npu1", "--repeat", "two"], "invalid int value: 'two'"),
    (["--device", "emu:npu1", "--out", "0=x.npy", "--out", "2=y.npy"], "--out-size"),
    (["--device", "emu:npu1", "--in", "IN", "--out", "OUT", "--out-size", "6", "--out-dtype", "int32"],
     "--out-size 6: not a whole number of int32 elements"),
    (["--device", "emu:npu1", "--in", "IN", "--out", "OUT", "--out-dtype", "float128x"], "not a numpy or ml_dtypes"),
    (["--device", "emu:npu1", "--in", "IN", "--in", "IN", "--in", "IN"], "name the slot of the extra ones"),
    (["--device", "emu:npu1", "--in=-3=IN"], "slot must be a non-negative integer"),
    (["--device", "emu:npu1", "--kernel", "NOPE", "--in", "IN", "--out", "OUT"],
     "--kernel 'NOPE': EMBEDDED_METADATA: no kernel 'NOPE' (kernels: MLIR_AIE)"),  # main_kernels.json
])
def test_usage_errors_exit_2(tmp_path, capsys, argv_tail, message):
    np.save(tmp_path / "in.npy", np.zeros(16, np.int32))
    argv_tail = [t.replace("IN", str(tmp_path / "in.npy")).replace("OUT", str(tmp_path / "out.npy")) for t in argv_tail]
    rc = main(["run", "--xclbin", str(NPU1_1COL / "aie.xclbin"), "--insts", str(NPU1_1COL / "insts.bin"), *argv_tail])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.npy").exists()


def write_bad_files(tmp_path: Path) -> dict[str, str]:
    """Malformed and missing inputs: a truncated axlf, a stream whose length is not whole words, a non-.npy."""
    (tmp_path / "bad.xclbin").write_bytes(b"xclbin2\0" + bytes(8))
    (tmp_path / "bad.bin").write_bytes(b"\x00\x01\x03")
    (tmp_path / "bad.npy").write_bytes(b"this is not numpy")
    np.save(tmp_path / "in.npy", np.zeros(16, np.int32))
    names = ("bad.xclbin", "bad.bin", "bad.npy", "in.npy", "missing.xclbin", "missing.npy")
    return {name: str(tmp_path / name) for name in names}


@needs_fixture
@pytest.mark.parametrize("option, file, message", [
    ("--xclbin", "bad.xclbin", "axlf header"),
    ("--xclbin", "missing.xclbin", "ENOENT (No such file or directory)"),
    ("--insts", "bad.bin", "not a multiple of 4"),
    ("--in", "bad.npy", "not a .npy file (it does not start with b'\\x93NUMPY')"),
    ("--in", "missing.npy", "ENOENT (No such file or directory)"),
])
def test_unreadable_or_malformed_input_files_exit_1(tmp_path, capsys, option, file, message):
    files = write_bad_files(tmp_path)
    argv = {"--xclbin": str(NPU1_1COL / "aie.xclbin"), "--insts": str(NPU1_1COL / "insts.bin"), "--in": files["in.npy"]}
    argv[option] = files[file]
    rc = main(["run", "--device", "emu:npu1", "--model", "passthrough", *(x for kv in argv.items() for x in kv),
               "--out", str(tmp_path / "out.npy")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert err.startswith(f"amdxdna run: {option} {files[file]}: ") and message in err
    assert not (tmp_path / "out.npy").exists()


@needs_fixture
def test_unwritable_output_exits_1(tmp_path, capsys):
    np.save(tmp_path / "in.npy", np.zeros(16, np.int32))
    out = tmp_path / "no-such-dir" / "out.npy"
    rc = main(["run", "--device", "emu:npu1", "--model", "passthrough", "--xclbin", str(NPU1_1COL / "aie.xclbin"),
               "--insts", str(NPU1_1COL / "insts.bin"), "--in", str(tmp_path / "in.npy"), "--out", str(out)])
    assert rc == 1
    assert capsys.readouterr().err == f"amdxdna run: --out {out}: ENOENT (No such file or directory)\n"


def test_assign_slots_follows_the_patched_slots():
    a, b, c = (BufferSpec(Path(p), None, d) for p, d in (("a", "in"), ("b", "in"), ("c", "out")))
    assert run_cmd.assign_slots([a, c], [0, 2]) == {0: a, 2: c}
    explicit = BufferSpec(Path("x"), 0, "out")
    assert run_cmd.assign_slots([a, explicit], [0, 2]) == {0: explicit, 2: a}
    assert run_cmd.assign_slots([a, b, c], []) == {0: a, 1: b, 2: c}
    with pytest.raises(UsageError, match="patches slots \\[0, 2\\]; name the slot"):
        run_cmd.assign_slots([a, b, c], [0, 2])
    with pytest.raises(UsageError, match="no buffer for slot\\(s\\) \\[2\\]"):
        run_cmd.assign_slots([a], [0, 2])
    with pytest.raises(UsageError, match="two buffers on slot 0"):
        run_cmd.assign_slots([explicit, BufferSpec(Path("y"), 0, "in")], [0, 2])
    with pytest.raises(UsageError, match=r"--out 1=x: the instruction stream patches slots \[0, 2\] only"):
        run_cmd.assign_slots([a, BufferSpec(Path("x"), 1, "out")], [0, 2])
    assert run_cmd.assign_slots([BufferSpec(Path("x"), 4, "out")], []) == {4: BufferSpec(Path("x"), 4, "out")}


def test_parse_buffer_and_model():
    assert run_cmd.parse_buffer("3=out.npy", "out") == BufferSpec(Path("out.npy"), 3, "out")
    assert run_cmd.parse_buffer("a=b.npy", "in") == BufferSpec(Path("a=b.npy"), None, "in")
    with pytest.raises(UsageError, match="non-negative"):
        run_cmd.parse_buffer("-1=x.npy", "in")
    with pytest.raises(UsageError, match="non-negative"):  # a digit to str.isdigit, not to int()
        run_cmd.parse_buffer("\u00b2=x.npy", "in")
    gemm = run_cmd.parse_model("gemm:2,3,4")
    assert (gemm.m, gemm.k, gemm.n, gemm.lda) == (2, 3, 4, 3)
    assert run_cmd.parse_model("passthrough").name == "passthrough"


def test_a_stream_that_patches_no_buffer_is_run_and_its_failure_is_one_line(tmp_path, capsys):
    # No --in, no --out, and a stream with no buffer DMA: there is nothing to size, and the run still reaches the
    # device (here the emulator, which has no model bound: one ERROR line, exit 1; it used to end in an
    # AttributeError traceback while sizing the outputs).
    (tmp_path / "none.xclbin").write_bytes(write(build_mlir_aie(b"none", column_width=1, n_buffers=2)))
    (tmp_path / "none.bin").write_bytes(insts.encode(insts.dma_stream(4, [])))
    rc = main(["run", "--device", "emu:npu4", "--xclbin", str(tmp_path / "none.xclbin"),
               "--insts", str(tmp_path / "none.bin")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("amdxdna run: MLIR_AIE (hwctx=") and "command ERROR" in err
    assert "no model bound to instruction stream sha256" in err
