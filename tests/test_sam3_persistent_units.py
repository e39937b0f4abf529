"""Persistent command units (docs/sam3-npu.md 7): a warm forward allocates nothing and builds no packet, the command
buffers stay as many as the bundle's operand sets need, a timed-out command's packets are never rewritten, and the
outputs equal a fresh instance's. Oracles: the device's ioctl counters (CREATE_BO, GET_BO_INFO, GEM_CLOSE), the
packet counts computed from the geometry, and a fresh `Sam3` (every packet built for that one forward)."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from amdxdna_direct import errors
from amdxdna_direct.device import open_device
from amdxdna_direct.emu import EmuDevice
from sam3 import kernels, pack
from sam3.build import Geometry, build
from sam3.bundle import Bundle
from sam3.npu import Npu, NpuError
from sam3.pipeline import Sam3

# The packets the NPU layer kept per operand set before its units were persistent: a stage whose layers' units held
# more than this rebuilt them every forward.
OLD_CACHE_PACKETS = 512
ALLOCATING = ("CREATE_BO", "GET_BO_INFO", "GEM_CLOSE")


def mid_geometry() -> Geometry:
    """The tiny model over 32 x 32 tokens, with 9 ViT and 8 DETR layers: 64 chunks of 16 rows per GEMM."""
    return Geometry.derive(
        "mid", image_size=64, patch=2, grid=32, window=8, vit_dim=64, vit_heads=2, vit_layers=9, vit_ffn_pad=96,
        vit_global=(4,), vit_eps=1e-6, d_model=32, d_heads=2, d_layers=8, d_ffn=64, dec_layers=1, queries=4,
        mask_size=128, neck_splits=(64, 128, 32), text_len=8, text_dim=32, text_heads=2, text_layers=1,
        text_ffn=64, text_eps=1e-5, m=16, tile_k=16, tile_n=16, ct_k=8, mha_d_head=32,
        overrides={"d_s": {"ct_k": 16}, "m_head": {"tile_n": 8, "m": 32}, "v_fc1": {"tile_n": 32}})


@pytest.fixture(scope="module")
def mid(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mid") / "dev", mid_geometry(), variant="device-f32")


@pytest.fixture(scope="module", params=["host", "device-f32"])
def tiny(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("tiny") / request.param, "tiny", variant=request.param)


def images(n):
    return [np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8) for seed in range(n)]


def counts(sam, fn, *args):
    """What `fn(*args)` cost: the allocating ioctls and the packets built."""
    stats, built = dict(sam.npu.device.stats), sam.npu.packets_built
    fn(*args)
    spent = {name: sam.npu.device.stats[name] - stats.get(name, 0) for name in ALLOCATING}
    return spent | {"packets": sam.npu.packets_built - built}


NOTHING = dict.fromkeys(ALLOCATING, 0) | {"packets": 0}


def test_the_mid_geometry_exceeds_the_old_cache(mid):
    with Bundle.open(mid) as b:
        p = b.params
        tokens = p.grid * p.grid
        vit_packets = tokens // b.gemms["v_qkv"].m * p.vit_layers          # one weight buffer per layer
        cross_packets = tokens // b.gemms["d_s"].m * (p.d_layers + 1)       # a slot per DETR layer, one for the masks
    assert vit_packets > OLD_CACHE_PACKETS and cross_packets > OLD_CACHE_PACKETS


def test_warm_forwards_and_new_prompts_allocate_nothing(mid):
    first, second = images(2)
    with Sam3(mid, "emu:npu4") as sam:
        sam.segment(first, "cat")
        assert sam.npu.packets_built > 0
        held = sam.npu.command_bos
        assert counts(sam, sam.segment, second, "cat") == NOTHING       # a new image: the image side too
        assert counts(sam, sam.segment, first, "cat") == NOTHING
        assert counts(sam, sam.segment, first, "a dog") == NOTHING      # a new prompt on the cached image
        assert sam.npu.command_bos == held


def test_command_buffers_stay_constant_over_twenty_forwards(tiny):
    pictures = images(3)
    with Sam3(tiny, "emu:npu4") as sam:
        sam.segment(pictures[0], "cat")
        stats = sam.npu.device.stats
        live, held = stats["CREATE_BO"] - stats["GEM_CLOSE"], sam.npu.command_bos
        for i in range(20):
            sam.segment(pictures[i % 3], ("cat", "a dog", "two birds")[i % 2 + i % 3 // 2])
            assert stats["CREATE_BO"] - stats["GEM_CLOSE"] == live and sam.npu.command_bos == held


def test_outputs_equal_a_fresh_instance(tiny):
    """Each forward after units were rewritten by other images and prompts gives what a fresh instance gives."""
    pictures = images(2)
    with Sam3(tiny, "emu:npu4") as warm:
        for picture in pictures:
            warm.segment(picture, "a dog")
        results = [warm.segment(pictures[0], "cat"), warm.segment(pictures[1], "cat")]
    for picture, got in zip(pictures, results, strict=True):
        with Sam3(tiny, "emu:npu4") as fresh:
            want = fresh.segment(picture, "cat")
        np.testing.assert_array_equal(got.mask_logits.masks, want.mask_logits.masks)
        np.testing.assert_array_equal(got.decoded.logits, want.decoded.logits)
        np.testing.assert_array_equal(got.scores, want.scores)
        np.testing.assert_array_equal(got.boxes, want.boxes)


def test_a_timed_out_command_keeps_its_packets(tmp_path):
    """A command still on the device after its wait expired is waited for before its packets are rewritten; one
    still running is refused, its packet untouched."""
    root = build(tmp_path / "host", "tiny", variant="host")
    emu = EmuDevice("npu4", tdr_timeout=1.0)
    try:
        with open_device(emu) as dev, Npu(root, dev, timeout=0.05) as npu:
            g = npu.spec("v_o")
            io = npu.io("v_o", g.m)
            bias = np.zeros(g.n, np.float32) if g.bias else None
            w1, w2 = (npu.upload(pack.pack_b(np.full((g.k, g.n), v, np.float32), bias, g.tile_k, g.tile_n, g.ct_k))
                      for v in (0.5, 0.25))
            io.set_a(np.ones((g.m, g.k), np.float32))
            npu.run_synced(io, w1)
            run = npu._pools["v_o"].runs[0]
            emu.faults.hang(npu.bundle.insts_bytes("v_o"))
            with pytest.raises(NpuError, match="v_o: chunk 0 of 1 failed"):
                npu.run_synced(io, w1)
            assert run.in_flight
            packet = bytes(run.packet.array(np.uint8))
            with pytest.raises(NpuError, match="v_o: its previous submission timed out and is still running"):
                npu.run(io, w2)
            assert bytes(run.packet.array(np.uint8)) == packet and w1 in run.buffers
            deadline = time.monotonic() + 10
            while run.in_flight and time.monotonic() < deadline:     # the TDR ends the hung command
                with contextlib.suppress(errors.CommandError):       # its TIMEOUT state is the expected outcome
                    run.wait(0.2)
            assert not run.in_flight
            npu.run(io, w2)
            assert w2 in run.buffers and w1 not in run.buffers
            want = kernels.apply_epilogue(np.full((g.m, g.n), 0.25 * g.k, np.float32), kernels.epilogue_mode(
                npu.bundle.insts_bytes("v_o")))
            np.testing.assert_allclose(pack.from_bf16(io.get_c(g.m)), want, rtol=1e-2)
    finally:
        emu.close()
