"""The emulated NPUs and the driver versions bound to them (docs/uapi.md 8; docs/emulator.md, Profiles).

An emulator profile is an NPU (``NPUS``: PCI identity, geometry, firmware answers) with a driver version
(``DRIVERS``: the kernel's uAPI and behaviour, docs/emulator.md "Driver profiles"), named ``<npu>`` or
``<npu>:<driver>``, optionally followed by the variants ``:coherent`` and ``:null`` in any order (``resolve``).
``PROFILES`` maps each NPU name to that NPU with the default driver, the newest mainline kernel modelled. Any
``Profile`` field is an ``EmuDevice`` keyword override.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


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
    driver: str = "linux-7.0"       # the driver version's name (DRIVERS)
    drm_minor: int = 6              # feature level (docs/uapi.md 11; 7.0 is 0.6)
    version_major: int = 0          # DRM_IOCTL_VERSION major: 0 upstream, 1 out of tree
    reported_minor: int | None = None   # DRM_IOCTL_VERSION minor when it is not the feature level (out of tree: 0)
    expandable_heap: bool = False   # True models the 2026 expandable heap: several chunks per fd (docs/uapi.md 4.4)
    dev_heap_max_size: int = 512 << 20  # expandable heap: device window per fd (docs/uapi.md 4.4, 8; NPU1 64 MiB)
    wait_cmd: bool = False          # True models the out-of-tree driver's WAIT_CMD (docs/uapi.md 4.11, 12)
    qos_size: int = 24              # bytes read from qos_p (32 on out-of-tree builds, docs/uapi.md 12)
    coherent: bool = False          # True: one copy of every buffer, SYNC_BO a no-op (fast; docs/emulator.md)
    hwctx_entry_size: int = 144     # GET_ARRAY HW_CONTEXT_ALL entry: 144 mainline, 160 staging/OOT (+ name)
    temporal_only: bool = False     # 7.0+ NPU4/5/6: every context spans all columns from 0, time-shared
    tdr_timeout: float = 60.0       # seconds before a hung job is timed out (drm_sched 60 s; out of tree 2 s)
    staging_reports: bool = False   # out of tree: 0xFF payload fill and health record of a failed command,
                                    # hwctx_id / heap_usage / health in HW_CONTEXT_ALL, SYNC_BO range check
    flush_on_close: bool = False    # 6.14-6.19 amdxdna_flush: every close of a copy of the fd destroys its contexts
    single_cmd_path: bool = False   # before 0.6 (force_cmdlist off): a lone command goes out as one message
    legacy_dpu_slot: bool = False   # 7.0 NPU1: START_NPU in the legacy DPU command-list slot (34 argument words)
    null_firmware: bool = False     # True: every command completes at once, no stream read, no model run
                                    # (a tool for measuring the host, docs/emulator.md "The null firmware")


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


_NPU_BASES: dict[str, Profile] = {
    "npu1": replace(_npu("npu1", 0x00), pci_device=0x1502, columns=5, first_col=1, aligned_placement=False,
                    hwctx_limit=6, txn_dev_gen=3, aie_arch=(2, 0), dev_heap_max_size=64 << 20,
                    dpm_clocks=((400, 800), (600, 1024), (600, 1024), (600, 1024), (600, 1024), (720, 1309),
                                (720, 1309), (847, 1600)),
                    firmware_version=(1, 5, 5, 391), tops_max=10),
    "npu4": _npu("npu4", 0x10),
    "npu5": _npu("npu5", 0x11),
    "npu6": _npu("npu6", 0x20),
}
NPUS = tuple(_NPU_BASES)

# The driver versions (docs/emulator.md, Driver profiles): Profile fields each sets. 6.19 shares 6.18's uAPI and
# flush; the mainline 0.10 / staging uAPI is reachable by overrides (drm_minor=10, expandable_heap=True).
DRIVERS: dict[str, dict[str, Any]] = {
    "linux-6.14": {"drm_minor": 0, "flush_on_close": True, "single_cmd_path": True},     # 6.14-6.17
    "linux-6.18": {"drm_minor": 1, "flush_on_close": True, "single_cmd_path": True},
    "linux-7.0": {"drm_minor": 6, "temporal_only": True},
    "xdna-oot": {"drm_minor": 10, "version_major": 1, "reported_minor": 0, "wait_cmd": True, "qos_size": 32,
                 "hwctx_entry_size": 160, "expandable_heap": True, "temporal_only": True, "tdr_timeout": 2.0,
                 "staging_reports": True},
}
DEFAULT_DRIVER = "linux-7.0"
DEFAULT_PROFILE = "npu4"
COHERENT = "coherent"
NULL = "null"
# The variants a name may end with, in any order, each once: the Profile field each one sets.
VARIANTS = {COHERENT: "coherent", NULL: "null_firmware"}


def profile_for(npu: str, driver: str = DEFAULT_DRIVER) -> Profile:
    """NPU `npu` under driver version `driver`.

    Raises:
        KeyError: an unknown NPU or driver name.
    """
    if npu not in _NPU_BASES:
        raise KeyError(f"unknown emulator profile {npu!r} (profiles: {', '.join(NPUS)}), each optionally "
                       f":<driver> ({', '.join(DRIVERS)})")
    if driver not in DRIVERS:
        raise KeyError(f"unknown emulator driver {driver!r} (drivers: {', '.join(DRIVERS)}; a last "
                       f"':{COHERENT}' models the caches away)")
    fields = dict(_DRIVER_DEFAULTS, **DRIVERS[driver])
    # TEMPORAL_ONLY is an NPU4-family resource mode (docs/emulator.md, Driver profiles): NPU1 stays spatial.
    fields["temporal_only"] = fields["temporal_only"] and _NPU_BASES[npu].aligned_placement
    # 7.0's NPU1 firmware table entry never enables the NPU command slot: START_NPU uses the legacy DPU slot (S20).
    legacy = driver == "linux-7.0" and not _NPU_BASES[npu].aligned_placement
    return replace(_NPU_BASES[npu], driver=driver, legacy_dpu_slot=legacy, **fields)


def resolve(spec: str) -> Profile:
    """The Profile ``<npu>[:<driver>][:coherent][:null]`` names (an empty NPU: the default one; the variants in
    any order, each at most once).

    Raises:
        KeyError: an unknown NPU, driver or variant, or a variant given twice, naming what is known.
    """
    npu, *rest = spec.split(":")
    chosen: dict[str, Any] = {}
    while rest and rest[-1] in VARIANTS:
        field = VARIANTS[rest.pop()]
        if field in chosen:
            raise KeyError(f"emulator profile {spec!r}: a variant is given twice")
        chosen[field] = True
    if len(rest) > 1:
        raise KeyError(f"emulator profile {spec!r}: expected <npu>[:<driver>][:coherent][:null] "
                       f"(drivers: {', '.join(DRIVERS)})")
    profile = profile_for(npu or DEFAULT_PROFILE, rest[0] if rest else DEFAULT_DRIVER)
    return replace(profile, **chosen) if chosen else profile

_DRIVER_FIELDS = ("drm_minor", "version_major", "reported_minor", "wait_cmd", "qos_size", "hwctx_entry_size",
                  "expandable_heap", "temporal_only", "tdr_timeout", "staging_reports", "flush_on_close",
                  "single_cmd_path")
_DRIVER_DEFAULTS = {name: getattr(Profile, name) for name in _DRIVER_FIELDS}
PROFILES: dict[str, Profile] = {npu: profile_for(npu) for npu in NPUS}
