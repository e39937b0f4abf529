"""amdxdna info on the emulator.

Oracles: spec/amdxdna-uapi.md 8 (PCI ids, 5 NPU1 columns with shim row 0, mem row 1, core rows 2-5,
firmware context limits 6/16), 11 (QUERY_RESOURCE_INFO only from feature level 0.4), and the contexts
and commands this test itself creates on a second file descriptor.
"""

from __future__ import annotations

import argparse
import json
import os

from amdxdna_direct import insts, open_device
from amdxdna_direct.cli import info_cmd, main
from amdxdna_direct.doctor import bind_model
from amdxdna_direct.emu import EmuDevice
from amdxdna_direct.emu.models import Passthrough
from amdxdna_direct.xclbin import build_mlir_aie


def test_info_text_on_npu1(capsys):
    assert main(["info", "--device", "emu:npu1"]) == 0
    lines = {line[:12].strip(): line[12:] for line in capsys.readouterr().out.splitlines()}  # 12-column labels
    assert lines["device"] == "emu:npu1"
    assert lines["pci"].startswith("1022:1502 rev 00, npu1, RyzenAI-npu1, KMQ")
    assert lines["driver"].startswith("amdxdna_accel_driver 0.")
    assert "5 columns x 6 rows (shim row 0, mem row 1, core rows 2-5)" in lines["aie"]
    assert "MP-NPU Clock" in lines["clocks"] and "H Clock" in lines["clocks"]
    assert lines["power mode"] == "DEFAULT"
    assert lines["resources"].endswith("contexts 0 of 6")
    assert lines["contexts"] == "none"


def test_info_json_on_npu4():
    emu = EmuDevice("npu4")
    try:
        with open_device(emu) as dev:
            info = info_cmd.collect(dev)
    finally:
        emu.close()
    assert info["pci"]["device"] == "17f0" and info["pci"]["revision"] == "10" and info["pci"]["generation"] == "npu4"
    assert info["aie"]["columns"] == 8 and info["aie"]["tiles"]["core"] == {"row_start": 2, "row_count": 4,
                                                                            "dma_channels": 4, "locks": 16}
    assert info["resources"]["npu_task_max"] == 16
    assert info["contexts"] == []
    json.dumps(info)  # plain data all the way down


def test_context_table_shows_another_fds_context(capsys):
    emu = EmuDevice("npu4")
    try:
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
    finally:
        emu.close()
    assert len(table) == 1
    entry = table[0]
    assert (entry["num_col"], entry["pid"], entry["errors"]) == (2, os.getpid(), 0)
    assert entry["command_submissions"] == entry["command_completions"] == 3
    assert entry["start_col"] % 2 == 0  # NPU4 places contexts at a multiple of their width (spec 4.1 step 6)
    row = text.splitlines()[-1].split()
    assert row == [str(entry["context_id"]), f"{entry['start_col']}-{entry['start_col'] + 1}", str(os.getpid()),
                   "3", "3", "0"]


def test_resource_info_not_supported_before_level_0_4(capsys):
    emu = EmuDevice("npu1", drm_minor=3)
    try:
        assert info_cmd.run(argparse.Namespace(device=emu, json=False)) == 0
    finally:
        emu.close()
    out = capsys.readouterr().out
    assert "resources   not supported by this driver" in out
    assert "feature level 0.3" in out


def test_missing_node_exits_1(tmp_path, capsys):
    assert main(["info", "--device", str(tmp_path / "accel9")]) == 1
    err = capsys.readouterr().err
    assert "ENOENT" in err and "accel9" in err


def test_pci_identity_from_sysfs(tmp_path):
    # The layout of spec 8 / xrt-npu-sequence 1.1: /sys/class/accel/accelN/device -> the PCI device directory.
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
