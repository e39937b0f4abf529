"""amdxdna trace: a child program's ioctls, decoded and summarised.

Oracles: the ioctls a small script provably makes (spec xrt-npu-sequence.md 1.2 and 1.4: VERSION at open,
CREATE_BO + GET_BO_INFO per buffer, GEM_CLOSE at close), the errno of a GEM_CLOSE on an unknown handle
(spec driver-rules D7: EINVAL), and hand-written lines in amdxdna_direct.trace's record format.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from amdxdna_direct.cli import main
from amdxdna_direct.cli.trace_cmd import TraceRecord, parse_fields, parse_line, summarise

SCRIPT = textwrap.dedent("""
    import sys
    from amdxdna_direct import abi, errors, open_device

    with open_device("emu:npu1") as dev:
        bo = dev.bo(8192)
        print("script stdout")
        print("script stderr", file=sys.stderr)
        try:
            dev.raw_ioctl(abi.DRM_IOCTL_GEM_CLOSE, abi.ffi.buffer(abi.new("struct drm_gem_close", handle=77)))
        except errors.XdnaError:
            pass
        bo.close()
    sys.exit(3)
""")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Run the script once under ``amdxdna trace --json -o FILE``; return (exit code, document)."""
    tmp = tmp_path_factory.mktemp("trace")
    (tmp / "script.py").write_text(SCRIPT)
    rc = main(["trace", "--json", "-o", str(tmp / "trace.json"), "--", sys.executable, str(tmp / "script.py")])
    return rc, json.loads((tmp / "trace.json").read_text())


def test_exit_status_of_the_program_is_returned(traced):
    rc, document = traced
    assert rc == 3
    assert document["exit_status"] == 3


def test_records_are_decoded(traced):
    records = traced[1]["records"]
    names = [r["name"] for r in records]
    assert names[0] == "VERSION"
    create = next(r for r in records if r["name"] == "CREATE_BO" and r["fields"]["size"] == 8192)
    assert create["result"] == 0 and create["error"] == ""
    assert create["fields"]["type"] == 1  # AMDXDNA_BO_SHMEM
    handle = create["changed"]["handle"]
    assert any(r["name"] == "GET_BO_INFO" and r["fields"]["handle"] == handle for r in records)
    assert any(r["name"] == "GEM_CLOSE" and r["fields"]["handle"] == handle and r["result"] == 0 for r in records)
    failed = [r for r in records if r["error"]]
    assert [(r["name"], r["fields"]["handle"], r["error"].split()[0]) for r in failed] == [("GEM_CLOSE", 77, "EINVAL")]
    assert all(r["device"] == "emu:npu1" and r["seconds"] > 0 for r in records)


def test_summary_counts_every_record(traced):
    document = traced[1]
    summary = document["summary"]
    assert sum(row["count"] for row in summary.values()) == len(document["records"])
    assert summary["GEM_CLOSE"]["errors"] == 1
    assert summary["VERSION"]["count"] == 1


def test_text_log_and_passthrough(tmp_path, capfd):
    (tmp_path / "script.py").write_text(SCRIPT)
    rc = main(["trace", "--", sys.executable, str(tmp_path / "script.py")])
    out, err = capfd.readouterr()
    assert rc == 3
    assert "script stdout" in out
    assert "script stderr" in err
    assert "amdxdna-trace" not in err  # trace lines are taken out of the program's stderr
    assert "ioctl summary for pid" not in err
    assert "emu:npu1 GEM_CLOSE(handle=77, pad=0) -> EINVAL (Invalid argument)" in out
    assert "exited with status 3" in out
    table = out[out.index("ioctl "):].splitlines()
    assert table[-1].split()[0] == "total"


def test_no_command_and_missing_program(capsys):
    assert main(["trace"]) == 2
    assert "no COMMAND" in capsys.readouterr().err
    assert main(["trace", "--", "/nonexistent/program"]) == 1
    assert "cannot start" in capsys.readouterr().err


def test_parse_line_success_and_failure():
    ok = parse_line("emu:npu4 CREATE_HWCTX(ext=0, qos_p=0x7f00aa, num_tiles=4) -> 0 {handle=1, syncobj_handle=2} "
                    "41.2us")
    assert ok == TraceRecord("emu:npu4", "CREATE_HWCTX", {"ext": 0, "qos_p": 0x7F00AA, "num_tiles": 4}, 0,
                             {"handle": 1, "syncobj_handle": 2}, "", pytest.approx(41.2e-6))
    bad = parse_line("/dev/accel/accel0 EXEC_CMD(hwctx=9) -> ENOENT (No such file or directory) 3.0us")
    assert (bad.name, bad.result, bad.error) == ("EXEC_CMD", None, "ENOENT (No such file or directory)")
    assert parse_line("ioctl summary for pid 12:") is None
    assert parse_fields("name=b'amdxdna', len=-1") == {"name": "b'amdxdna'", "len": -1}
    assert summarise([ok, bad, bad]) == {"CREATE_HWCTX": {"count": 1, "errors": 0, "total_ms": pytest.approx(0.0412)},
                                         "EXEC_CMD": {"count": 2, "errors": 2, "total_ms": pytest.approx(0.006)}}


def test_output_file_that_cannot_be_written(tmp_path, capsys):
    rc = main(["trace", "-o", str(tmp_path / "missing-dir" / "t.txt"), "--", sys.executable, "-c", "pass"])
    assert rc == 2
    assert "cannot write" in capsys.readouterr().err


def test_signal_exit_status(tmp_path):
    script = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert main(["trace", "--no-log", "-o", str(tmp_path / "t.txt"), "--", sys.executable, "-c", script]) == 128 + 15
    assert "was killed by signal 15" in (tmp_path / "t.txt").read_text()
