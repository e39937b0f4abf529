"""amdxdna info on the emulator.

Oracles: docs/uapi.md 8 (PCI ids, 5 NPU1 columns with shim row 0, mem row 1, core rows 2-5,
firmware context limits 6/16), 11 (QUERY_HW_CONTEXTS from feature level 0.0, QUERY_RESOURCE_INFO only
from 0.4), the emulator profile's firmware version and clocks (what GET_INFO must carry back), and the
contexts and commands this test itself creates on a second file descriptor.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import struct
from pathlib import Path

import pytest
import test_cli_isolation
from test_cli_isolation import QUERY_FIRMWARE_VERSION, AlteredDriver, failing_query

from amdxdna_direct import insts, open_device
from amdxdna_direct.cli import configure_cmd, info_cmd, main
from amdxdna_direct.doctor import bind_model
from amdxdna_direct.emu import PROFILES, EmuDevice
from amdxdna_direct.emu.models import Passthrough
from amdxdna_direct.xclbin import build_mlir_aie

# Every test here runs under the guard: no file of the real system is read (test_cli_isolation).
no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")


def test_info_text_on_npu1(capsys):
    assert main(["info", "--device", "emu:npu1"]) == 0
    lines = {line[:12].strip(): line[12:] for line in capsys.readouterr().out.splitlines()}  # 12-column labels
    assert lines["device"] == "emu:npu1"
    assert lines["pci"].startswith("1022:1502 rev 00, npu1, RyzenAI-npu1, KMQ")
    assert lines["driver"].startswith("amdxdna_accel_driver 0.")
    assert "5 columns x 6 rows (shim row 0, mem row 1, core rows 2-5)" in lines["aie"]
    assert lines["firmware"] == "1.5.5.391"  # the npu1 profile's firmware, decoded from GET_INFO
    mp_npu, h_clock = PROFILES["npu1"].dpm_clocks[0]  # DEFAULT power mode runs DPM level 0 (emulator profile)
    assert lines["clocks"] == f"MP-NPU Clock {mp_npu} MHz, H Clock {h_clock} MHz"
    assert lines["power mode"] == "DEFAULT"
    assert lines["resources"].endswith("contexts 0 of 6")
    assert lines["contexts"] == "none"


def test_info_json_on_npu4():
    with EmuDevice("npu4") as emu:
        with open_device(emu) as dev:
            info = info_cmd.collect(dev)
    assert info["pci"]["device"] == "17f0" and info["pci"]["revision"] == "10" and info["pci"]["generation"] == "npu4"
    assert info["aie"]["columns"] == 8 and info["aie"]["tiles"]["core"] == {"row_start": 2, "row_count": 4,
                                                                            "dma_channels": 4, "locks": 16}
    assert info["resources"]["npu_task_max"] == 16
    assert info["contexts"] == []
    json.dumps(info)  # plain data all the way down


def test_context_table_shows_another_fds_context(capsys):
    with EmuDevice("npu4:linux-6.18") as emu:
        with open_device(emu) as other:
            stream = insts.dma_stream(4, [(0, 256, "in"), (1, 256, "out")])
            bind_model(emu, stream, Passthrough())
            ctx = other.hw_context(build_mlir_aie(b"pdi", column_width=2, n_buffers=2))
            a, b = other.bo(4096), other.bo(4096)
            run = ctx.kernel().prepare_npu(stream, [a, b])
            for _ in range(3):
                run.start()
                run.wait(5.0)
            assert info_cmd.run(argparse.Namespace(device=emu, json=True)) == 0
            table = json.loads(capsys.readouterr().out)["contexts"]
            assert info_cmd.run(argparse.Namespace(device=emu, json=False)) == 0
            text = capsys.readouterr().out
    assert len(table) == 1
    entry = table[0]
    assert (entry["num_col"], entry["pid"], entry["errors"]) == (2, os.getpid(), 0)
    assert entry["command_submissions"] == entry["command_completions"] == 3
    assert entry["start_col"] % 2 == 0  # NPU4 places contexts at a multiple of their width (docs/uapi.md 4.1 step 6)
    header, row, details = text.splitlines()[-3:]
    assert header.split() == ["id", "columns", "pid", "process", "state", "prio", "submitted", "completed", "errors"]
    fields = row.split()
    assert fields[:3] == [str(entry["context_id"]), f"{entry['start_col']}-{entry['start_col'] + 1}", str(os.getpid())]
    assert fields[-3:] == ["3", "3", "0"]
    assert details.strip().startswith(f"fw ctx {entry['hwctx_id']}, pasid {entry['pasid']}, heap ")


def test_resource_info_not_supported_before_level_0_4(capsys):
    with EmuDevice("npu1", drm_minor=3) as emu:
        assert info_cmd.run(argparse.Namespace(device=emu, json=False)) == 0
    out = capsys.readouterr().out
    assert "resources   not supported by this driver" in out
    assert "feature level 0.3" in out


def test_feature_level_0_0_still_lists_contexts(capsys):
    # Linux 6.14-6.17: GET_INFO QUERY_HW_CONTEXTS exists from 0.0, QUERY_RESOURCE_INFO only from 0.4 (docs/uapi.md 11).
    with EmuDevice("npu1", drm_minor=0) as emu:
        with open_device(emu) as other:
            held = other.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))  # kept alive while queried
            assert info_cmd.run(argparse.Namespace(device=emu, json=True)) == 0
            held.close()
    info = json.loads(capsys.readouterr().out)
    assert info["driver"]["feature_level"] == 0
    assert info["resources"] == {"error": "not supported by this driver"}
    assert [(c["num_col"], c["pid"]) for c in info["contexts"]] == [(1, os.getpid())]


def test_failed_query_is_shown_and_exits_1(capsys):
    with EmuDevice("npu4") as emu:
        altered = AlteredDriver(emu, fail=failing_query(QUERY_FIRMWARE_VERSION, errno.EIO))
        assert info_cmd.run(argparse.Namespace(device=altered, json=False)) == 1
    out, err = capsys.readouterr()
    firmware = next(line for line in out.splitlines() if line.startswith("firmware"))
    assert "GET_INFO(" in firmware and "EIO" in firmware
    assert "aie         version" in out  # the other queries still answer
    assert err == "amdxdna info: emu:npu4: query failed: firmware\n"


def test_device_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("AMDXDNA_DEVICE", "emu:npu5")
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # docs/uapi.md 8
    assert (info["device"], info["pci"]["device"], info["pci"]["revision"]) == ("emu:npu5", "17f0", "11")


@pytest.mark.parametrize("argv, env", [(["info", "--device", "emu:npu9"], None), (["info"], "emu:npu9"),
                                       (["info", "--device", ""], None)])
def test_bad_device_is_a_usage_error(capsys, monkeypatch, argv, env):
    if env is not None:
        monkeypatch.setenv("AMDXDNA_DEVICE", env)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "argument --device:" in err
    assert "unknown emulator profile 'npu9' (profiles: npu1, npu4, npu5, npu6)" in err or "empty device" in err


def test_missing_node_exits_1(tmp_path, capsys):
    assert main(["info", "--device", str(tmp_path / "accel9")]) == 1
    err = capsys.readouterr().err
    assert "ENOENT" in err and "accel9" in err


def test_pci_identity_from_sysfs(tmp_path):
    # The layout of docs/uapi.md 8 / docs/xrt-sequence.md 1.1: /sys/class/accel/accelN/device -> the PCI device
    # directory.
    pci = tmp_path / "sys/devices/pci0000:00/0000:00:08.2/0000:c6:00.1"
    pci.mkdir(parents=True)
    for name, value in (("vendor", "0x1022"), ("device", "0x17f0"), ("revision", "0x20"), ("vbnv", "RyzenAI-npu6"),
                        ("fw_version", "1.1.2.64"), ("device_type", "0")):
        (pci / name).write_text(value + "\n")
    (tmp_path / "sys/bus/pci/drivers/amdxdna").mkdir(parents=True)
    (pci / "driver").symlink_to(tmp_path / "sys/bus/pci/drivers/amdxdna")
    (tmp_path / "sys/class/accel/accel1").mkdir(parents=True)
    (tmp_path / "sys/class/accel/accel1/device").symlink_to(pci)
    found = info_cmd.sysfs_pci(tmp_path, "accel1")
    assert found == {"source": "/sys/class/accel/accel1/device", "slot": "0000:c6:00.1", "vendor": "1022",
                     "device": "17f0", "revision": "20", "generation": "npu6", "vbnv": "RyzenAI-npu6",
                     "fw_version": "1.1.2.64", "device_type": "KMQ", "driver": "amdxdna"}
    text = info_cmd._format_pci(found)
    assert text == "0000:c6:00.1 1022:17f0 rev 20, npu6, RyzenAI-npu6, KMQ (from /sys/class/accel/accel1/device)"
    assert info_cmd.sysfs_pci(tmp_path, "accel7")["generation"] is None  # no such node: nothing invented


# --- the driver's full context entries (GET_ARRAY) --------------------------------------------------------

DRM_IOCTL_AMDXDNA_GET_ARRAY = 0xC018644A  # docs/uapi.md 1a
# struct amdxdna_drm_hwctx_entry (docs/uapi.md 2.5): (name, offset, struct format); 144 bytes, + char name[16] = 160.
ENTRY_LAYOUT = (("context_id", 0, "I"), ("start_col", 4, "I"), ("num_col", 8, "I"), ("hwctx_id", 12, "I"),
                ("pid", 16, "q"), ("command_submissions", 24, "Q"), ("command_completions", 32, "Q"),
                ("migrations", 40, "Q"), ("preemptions", 48, "Q"), ("errors", 56, "Q"), ("priority", 64, "Q"),
                ("heap_usage", 72, "Q"), ("suspensions", 80, "Q"), ("state", 88, "I"), ("pasid", 92, "I"),
                ("gops", 96, "I"), ("fps", 100, "I"), ("dma_bandwidth", 104, "I"), ("latency", 108, "I"),
                ("frame_exec_time", 112, "I"), ("txn_op_idx", 116, "I"), ("ctx_pc", 120, "I"),
                ("fatal_error_type", 124, "I"), ("fatal_error_exception_type", 128, "I"),
                ("fatal_error_exception_pc", 132, "I"), ("fatal_error_app_module", 136, "I"))
ENTRY_FIELDS = tuple(name for name, _, _ in ENTRY_LAYOUT) + ("name",)


def staging_entry(**values) -> bytes:
    """A 160-byte staging/out-of-tree entry packed by hand at the spec's offsets."""
    raw = bytearray(160)
    for name, offset, fmt in ENTRY_LAYOUT:
        struct.pack_into("<" + fmt, raw, offset, values.get(name, 0))
    raw[144:160] = values.get("name", b"").ljust(16, b"\0")
    return bytes(raw)


def answer_entries(entries: list[bytes], size: int):
    """An AlteredDriver edit: GET_ARRAY(HW_CONTEXT_ALL) answers these entries of ``size`` bytes
    (struct amdxdna_drm_get_array: element_size u32 @4, num_element u32 @8, buffer u64 @16; docs/uapi.md 2.4)."""
    def edit(buf) -> None:
        _, _, _, _, address = struct.unpack_from("<IIIIQ", buf, 0)
        data = b"".join(entries)
        ctypes.memmove(address, data, len(data))
        struct.pack_into("<II", buf, 4, size, len(entries))
    return {DRM_IOCTL_AMDXDNA_GET_ARRAY: edit}


def test_info_json_without_a_device_is_still_json(tmp_path, capsys):
    assert main(["info", "--device", str(tmp_path / "accel5"), "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["device"] == str(tmp_path / "accel5")
    assert "ENOENT" in doc["error"] and "accel5" in doc["error"] and "doctor" in doc["hint"]
    assert (doc["schema"], doc["command"], doc["ok"]) == (1, "info", False)  # the error object, docs/cli.md
    assert "ENOENT" in err


def test_info_json_carries_every_field_of_the_mainline_entry(capsys):
    with EmuDevice("npu4:linux-6.18") as emu:
        with open_device(emu) as other:
            held = other.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2), priority="low")
            assert info_cmd.run(argparse.Namespace(device=emu, json=True)) == 0
            held.close()
    entry, = json.loads(capsys.readouterr().out)["contexts"]
    assert set(ENTRY_FIELDS) <= set(entry)
    assert entry["source"] == "GET_ARRAY" and entry["element_size"] in (144, 160)
    assert entry["priority"] == 0x280 and entry["priority_name"] == "low"  # AMDXDNA_QOS_LOW_PRIORITY (docs/uapi.md 3)
    assert entry["pid"] == os.getpid() and entry["num_col"] == 1
    if entry["element_size"] == 144:
        assert entry["name"] is None  # mainline entries have no process name


def test_emulated_staging_driver_names_the_process(capsys):
    comm = Path("/proc/self/comm").read_text().strip()[:15]  # the task's name, at most TASK_COMM_LEN - 1
    with EmuDevice("npu4:xdna-oot") as emu:
        with open_device(emu) as other:
            held = other.hw_context(build_mlir_aie(b"pdi", column_width=2, n_buffers=2))
            assert info_cmd.run(argparse.Namespace(device=emu, json=True)) == 0
            entry, = json.loads(capsys.readouterr().out)["contexts"]
            assert info_cmd.run(argparse.Namespace(device=emu, json=False)) == 0
            row = capsys.readouterr().out.splitlines()[-2].split()
            held.close()
    assert (entry["element_size"], entry["name"], entry["num_col"]) == (160, comm, 8)     # temporal-only NPU4
    assert set(ENTRY_FIELDS) <= set(entry)
    assert row[2:4] == [str(os.getpid()), comm]


def test_staging_entry_with_name_and_health_record(capsys):
    failed = staging_entry(context_id=3, start_col=2, num_col=2, hwctx_id=9, pid=4242, command_submissions=7,
                           command_completions=6, errors=1, priority=0x100, heap_usage=65536, state=1, pasid=5,
                           gops=40, fps=30, latency=8, txn_op_idx=17, ctx_pc=0x3A0, fatal_error_type=2,
                           fatal_error_exception_type=5, fatal_error_exception_pc=0x1C4, fatal_error_app_module=1,
                           name=b"sam3-demo")
    with EmuDevice("npu4") as emu:
        altered = AlteredDriver(emu, edit=answer_entries([failed], 160))
        assert info_cmd.run(argparse.Namespace(device=altered, json=True)) == 0
        entry, = json.loads(capsys.readouterr().out)["contexts"]
        assert info_cmd.run(argparse.Namespace(device=altered, json=False)) == 0
        text = capsys.readouterr().out
    expected = dict(context_id=3, start_col=2, num_col=2, hwctx_id=9, pid=4242, command_submissions=7,
                    command_completions=6, migrations=0, preemptions=0, errors=1, priority=0x100, heap_usage=65536,
                    suspensions=0, state=1, pasid=5, gops=40, fps=30, dma_bandwidth=0, latency=8, frame_exec_time=0,
                    txn_op_idx=17, ctx_pc=0x3A0, fatal_error_type=2, fatal_error_exception_type=5,
                    fatal_error_exception_pc=0x1C4, fatal_error_app_module=1, name="sam3-demo")
    assert {k: entry[k] for k in ENTRY_FIELDS} == expected
    assert (entry["element_size"], entry["state_name"], entry["priority_name"]) == (160, "ACTIVE", "realtime")
    rows = text.splitlines()[-3:]
    assert rows[0].split() == ["3", "2-3", "4242", "sam3-demo", "ACTIVE", "realtime", "7", "6", "1"]
    assert rows[1].strip() == ("fw ctx 9, pasid 5, heap 65536 B, migrations 0, preemptions 0, suspensions 0; "
                               "QoS gops 40, fps 30, latency 8")
    assert rows[2].strip() == ("health: TXN op 17, pc 0x3a0, fatal error type 2, exception type 5 at pc 0x1c4, "
                               "app module 1")


# --- amdxdna configure --pmode (SET_STATE SET_POWER_MODE) -------------------------------------------------


def configure(device, pmode: str, capsys, as_json: bool = True) -> tuple[int, dict | str, str]:
    rc = configure_cmd.run(argparse.Namespace(device=device, pmode=pmode, json=as_json))
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if as_json else out), err


def test_configure_sets_the_mode_and_info_reads_it_back(capsys):
    with EmuDevice("npu4", cap_sys_admin=True) as emu:
        rc, doc, _ = configure(emu, "high", capsys)
        assert rc == 0 and doc == {"schema": 1, "command": "configure", "device": "emu:npu4", "before": "DEFAULT",
                                   "after": "HIGH"}
        assert info_cmd.run(argparse.Namespace(device=emu, json=True)) == 0
        info = json.loads(capsys.readouterr().out)
        rc, text, _ = configure(emu, "default", capsys, as_json=False)
    assert info["power_mode"] == "HIGH"
    mp_npu, h_clock = PROFILES["npu4"].dpm_clocks[-1]  # HIGH runs the top DPM level (emulator profile)
    assert info["clocks"] == {"MP-NPU Clock": mp_npu, "H Clock": h_clock}
    assert rc == 0 and text == "emu:npu4: power mode HIGH -> DEFAULT\n"


def test_configure_without_cap_sys_admin_says_run_it_with_sudo(capsys):
    with EmuDevice("npu4", cap_sys_admin=False) as emu:
        rc, doc, err = configure(emu, "turbo", capsys)
    assert rc == 1 and doc["device"] == "emu:npu4"
    assert "EACCES" in doc["error"] and "CAP_SYS_ADMIN" in doc["error"]
    assert "`sudo amdxdna configure --pmode turbo`" in err


@pytest.mark.parametrize("pmode", ["low", "medium"])
def test_configure_low_and_medium_are_not_supported(capsys, pmode):
    with EmuDevice("npu1", cap_sys_admin=True) as emu:
        rc, doc, _ = configure(emu, pmode, capsys)
    assert rc == 1 and os.strerror(errno.EOPNOTSUPP) in doc["error"]  # ENOTSUP: the same errno on Linux
    assert f"power mode {pmode.upper()} is not supported by this driver" in doc["error"]


def test_configure_turbo_is_refused_while_a_context_exists(capsys):
    with EmuDevice("npu4", cap_sys_admin=True) as emu, open_device(emu) as other:
        held = other.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        rc, doc, _ = configure(emu, "turbo", capsys)
        held.close()
        after = configure(emu, "turbo", capsys)
    assert rc == 1 and "EINVAL" in doc["error"]
    assert "TURBO is refused while any hardware context exists (1 live)" in doc["error"]
    assert after[0] == 0 and after[1]["after"] == "TURBO"


def test_configure_usage_errors(capsys):
    assert main(["configure", "--device", "emu:npu4"]) == 2
    assert "--pmode" in capsys.readouterr().err
    assert main(["configure", "--device", "emu:npu4", "--pmode", "ludicrous"]) == 2
    assert "invalid choice" in capsys.readouterr().err
