"""amdxdna trace: a child program's ioctls, decoded and summarised.

Oracles: the ioctls a small script provably makes (docs/xrt-sequence.md 1.2 and 1.4: VERSION at open,
CREATE_BO + GET_BO_INFO per buffer, GEM_CLOSE at close), the errno of a GEM_CLOSE on an unknown handle
(docs/driver-rules.md D7: EINVAL), and hand-written lines in amdxdna_direct.trace's record format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_cli_isolation

from amdxdna_direct.cli import main
from amdxdna_direct.cli.trace_cmd import TRACE_PREFIX, TraceRecord, parse_fields, parse_line, summarise

# Every test here runs under the guard: no file of the real system is read (test_cli_isolation).
no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    from amdxdna_direct import abi, errors, open_device

    with open_device() as dev:  # the device amdxdna trace --device exports as AMDXDNA_DEVICE
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
    rc = main(["trace", "--device", "emu:npu1", "--json", "-o", str(tmp / "trace.json"), "--", sys.executable,
               str(tmp / "script.py")])
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
    rc = main(["trace", "--device", "emu:npu1", "--", sys.executable, str(tmp_path / "script.py")])
    out, err = capfd.readouterr()
    assert rc == 3
    assert "script stdout" in out
    assert err == "script stderr\n"  # trace lines and the per-process summary table are taken out of stderr
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
    out = tmp_path / "missing-dir" / "t.txt"
    rc = main(["trace", "-o", str(out), "--", sys.executable, "-c", "raise SystemExit(5)"])
    assert rc == 1  # a file that cannot be written is a failure (1), as in every amdxdna command; 5 never ran
    assert capsys.readouterr().err == f"amdxdna trace: -o {out}: cannot write: ENOENT (No such file or directory)\n"


def test_unknown_emulator_profile_is_a_usage_error(capsys):
    assert main(["trace", "--device", "emu:npu9", "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert "argument --device: emu:npu9: unknown emulator profile 'npu9'" in err and err.count("\n") == 1


def test_environment_trace_lines_are_what_the_command_decodes(tmp_path):
    # AMDXDNA_TRACE=1 alone: the program's stderr carries the lines amdxdna trace parses (the format contract).
    (tmp_path / "script.py").write_text(SCRIPT)
    env = dict(os.environ, AMDXDNA_TRACE="1", AMDXDNA_DEVICE="emu:npu1", PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, str(tmp_path / "script.py")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 3
    lines = stderr.splitlines()
    traced = [line.removeprefix(TRACE_PREFIX) for line in lines if line.startswith(TRACE_PREFIX)]
    assert traced[-1] == f"ioctl summary for pid {child.pid}:"
    records = [parse_line(text) for text in traced[:-1]]
    assert None not in records  # every other trace line is a record the command decodes
    failed = [(r.name, r.fields["handle"], r.error.split()[0]) for r in records if r.error]
    assert failed == [("GEM_CLOSE", 77, "EINVAL")]
    expected = summarise(records)
    table = lines[lines.index(TRACE_PREFIX + traced[-1]) + 2:]  # after the header line and the column titles
    assert [row.split()[:3] for row in table] == [[name, str(row["count"]), str(row["errors"])]
                                                  for name, row in expected.items()]


def test_json_on_stdout_keeps_the_programs_stdout_out_of_the_document(tmp_path):
    # issue 16 item 6: with --json and no -o the program's stdout goes to stderr; stdout is the document alone.
    (tmp_path / "script.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "amdxdna_direct.cli", "trace", "--device", "emu:npu1", "--json",
                           "--", sys.executable, str(tmp_path / "script.py")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 3
    document = json.loads(done.stdout)
    assert (document["schema"], document["command"], document["exit_status"]) == (1, "trace", 3)
    assert document["program"][-1] == str(tmp_path / "script.py")
    assert "script stdout" in done.stderr and "script stderr" in done.stderr


def test_the_json_document_has_the_schema_and_names_the_program(traced):
    _, document = traced
    assert (document["schema"], document["command"]) == (1, "trace")
    assert document["program"][0] == sys.executable and document["program"][1].endswith("script.py")
