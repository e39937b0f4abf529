"""The emulated NPUs: PCI identity, geometry, firmware answers and driver options (docs/uapi.md 8).

``PROFILES`` maps a profile name to its ``Profile``; any field is an ``EmuDevice`` keyword override
(docs/emulator.md, Profiles).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TileMetadata:
    """amdxdna_drm_query_aie_tile_metadata of one tile kind."""

    row_count: int
    row_start: int
    dma_channel_count: int
    lock_count: int
    event_reg_count: int


@dataclass(frozen=True)
class Profile:
    """One emulated NPU: PCI identity, geometry, firmware answers and driver options.

    Geometry, context limit and placement are docs/uapi.md 8 facts; AIE metadata, clocks, firmware version and
    TOPS are emulator guesses (docs/uapi.md 8: "real values come from firmware").
    """

    name: str
    pci_device: int
    pci_revision: int
    vbnv: str
    columns: int                    # physical columns reported by firmware
    first_col: int                  # first column a partial partition may use
    aligned_placement: bool         # NPU4/5/6: start column is a multiple of the width
    hwctx_limit: int
    txn_dev_gen: int                # TXN header device generation the firmware accepts (H3b)
    aie_version: tuple[int, int]
    aie_arch: tuple[int, int]       # version field of QUERY_AIE_METADATA
    col_size: int                   # bytes of one column's status dump (QUERY_AIE_STATUS)
    core: TileMetadata
    mem: TileMetadata
    shim: TileMetadata
    dpm_clocks: tuple[tuple[int, int], ...]     # (MP-NPU MHz, H-clock MHz) per DPM level
    firmware_version: tuple[int, int, int, int]
    tops_max: int
    rows: int = 6
    core_rows: int = 4
    drm_minor: int = 10             # feature level (docs/uapi.md 11): 0.10 has every ioctl the emulator models
    expandable_heap: bool = False   # True models the 2026 expandable heap: several chunks per fd (docs/uapi.md 4.4)
    dev_heap_max_size: int = 512 << 20  # expandable heap: device window per fd (docs/uapi.md 4.4, 8; NPU1 64 MiB)
    wait_cmd: bool = False          # True models the out-of-tree driver's WAIT_CMD (docs/uapi.md 4.11, 12)
    qos_size: int = 24              # bytes read from qos_p (32 on out-of-tree builds, docs/uapi.md 12)
    coherent: bool = False          # True: one copy of every buffer, SYNC_BO a no-op (fast; docs/emulator.md)
    hwctx_entry_size: int = 144     # GET_ARRAY HW_CONTEXT_ALL entry: 144 mainline, 160 staging/OOT (+ name)


_AIE2_CORE = TileMetadata(row_count=4, row_start=2, dma_channel_count=4, lock_count=16, event_reg_count=128)
_AIE2_MEM = TileMetadata(row_count=1, row_start=1, dma_channel_count=12, lock_count=64, event_reg_count=128)
_AIE2_SHIM = TileMetadata(row_count=1, row_start=0, dma_channel_count=4, lock_count=16, event_reg_count=128)


def _npu(name: str, revision: int) -> Profile:
    """The NPU4-family defaults under `name`; ``dataclasses.replace`` derives a different NPU from it."""
    return Profile(name=name, pci_device=0x17F0, pci_revision=revision, vbnv=f"RyzenAI-{name}", columns=8,
                   first_col=0, aligned_placement=True, hwctx_limit=16, txn_dev_gen=4, aie_version=(1, 1),
                   aie_arch=(2, 1), col_size=4096, core=_AIE2_CORE, mem=_AIE2_MEM, shim=_AIE2_SHIM,
                   dpm_clocks=((396, 792), (600, 1056), (792, 1152), (975, 1267), (975, 1267), (1056, 1408),
                               (1152, 1584), (1267, 1800)),
                   firmware_version=(1, 0, 0, 63), tops_max=50)


PROFILES: dict[str, Profile] = {
    "npu1": replace(_npu("npu1", 0x00), pci_device=0x1502, columns=5, first_col=1, aligned_placement=False,
                    hwctx_limit=6, txn_dev_gen=3, aie_arch=(2, 0), dev_heap_max_size=64 << 20,
                    dpm_clocks=((400, 800), (600, 1024), (600, 1024), (600, 1024), (600, 1024), (720, 1309),
                                (720, 1309), (847, 1600)),
                    firmware_version=(1, 5, 5, 391), tops_max=10),
    "npu4": _npu("npu4", 0x10),
    "npu5": _npu("npu5", 0x11),
    "npu6": _npu("npu6", 0x20),
}
DEFAULT_PROFILE = "npu4"
