"""sam3 driven the way users get it wrong: hand-edited bundles, misused Npu calls, threads, a closed Npu, and
the demo's failure paths. Each error is the documented type naming the key, field or argument, raised before
anything reaches the device; nothing leaks."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from fixture_files import fixture

from amdxdna_direct import xclbin
from amdxdna_direct.device import open_device
from amdxdna_direct.emu import EmuDevice
from sam3 import demo, pack
from sam3.build import ConvShape, Geometry, build
from sam3.bundle import MAX_BUFFER_BYTES, Bundle, BundleError
from sam3.npu import Npu, NpuError, pull, push

TOL = 1e-2  # bf16 output rounding plus accumulation order, relative to max|reference|


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("misuse") / "tiny", "tiny")


@pytest.fixture()
def bundle_copy(built, tmp_path):
    """A private copy of the tiny bundle and its manifest (as a dict) to edit; `save(doc)` writes it back."""
    root = tmp_path / "b"
    shutil.copytree(built, root)
    doc = json.loads((root / "manifest.json").read_text())

    def save(new: dict | None = None, raw: str | None = None) -> Path:
        (root / "manifest.json").write_text(raw if raw is not None else json.dumps(new if new is not None else doc))
        return root
    return root, doc, save


@pytest.fixture()
def device():
    """An emulated NPU4 and a Device on it (shared with the Npu under test, so counters outlive the Npu)."""
    emu = EmuDevice("npu4")
    dev = open_device(emu)
    yield emu, dev
    dev.close()
    emu.close()


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# hand-edited bundles


@pytest.mark.parametrize("target", [["npu4"], {"npu": 4}, 4, None])
def test_target_of_the_wrong_type(bundle_copy, target):
    _, doc, save = bundle_copy
    doc["target"] = target
    with pytest.raises(BundleError, match="manifest target: unknown NPU") as e:
        Bundle.load(save())
    assert e.value.field == "target"


def test_format_must_be_the_integer_1(bundle_copy):
    _, doc, save = bundle_copy
    doc["format"] = 1.0
    with pytest.raises(BundleError, match=r"manifest format: 1\.0 is not supported"):
        Bundle.load(save())


def test_deeply_nested_manifest(bundle_copy):
    _, _, save = bundle_copy
    with pytest.raises(BundleError, match="manifest.json nests too deeply") as e:
        Bundle.load(save(raw='{"a":' * 100_000 + "1" + "}" * 100_000))
    assert e.value.field == "manifest.json"


def test_duplicate_json_names(bundle_copy):
    root, doc, save = bundle_copy
    text = json.dumps(doc)
    # A hand edit that adds "m" to the first GEMM instead of changing it: json would keep the last silently.
    with pytest.raises(BundleError, match=r"'m' appears twice in one object"):
        Bundle.load(save(raw=text.replace('"m": 32,', '"m": 32, "m": 64,', 1)))
    xclbins = json.dumps(doc["xclbins"])[1:-1]
    with pytest.raises(BundleError, match=r"'attn_gemm' appears twice"):
        Bundle.load(save(raw=text.replace(xclbins, xclbins + ", " + xclbins.split("}, ")[0] + "}")))


def _loop(root: Path) -> str:
    (root / "insts" / "loop.bin").symlink_to("loop.bin")
    return "insts/loop.bin"


@pytest.mark.parametrize("make, message", [
    (lambda root: "insts/a\0b.bin", "holds a NUL byte"),
    (lambda root: "x" * 5000, "cannot be resolved: .*File name too long"),
    (_loop, "cannot be resolved: .*[Ss]ymlink loop"),
])
def test_unresolvable_paths_name_key_and_field(bundle_copy, make, message):
    root, doc, save = bundle_copy
    doc["gemms"][0]["insts"] = make(root)
    with pytest.raises(BundleError, match=f"blk0.qkv.insts: path .*{message}") as e:
        Bundle.load(save())
    assert (e.value.key, e.value.field) == ("blk0.qkv", "insts")


def test_unresolvable_bundle_directory(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(BundleError, match="cannot resolve the directory"):
        Bundle.load(tmp_path / "loop")
    with pytest.raises(BundleError, match="cannot resolve the directory"):
        Bundle.load(str(tmp_path / "a\0b"))


def test_weights_that_is_not_a_directory(bundle_copy):
    root, _, save = bundle_copy
    shutil.rmtree(root / "weights")
    (root / "weights").write_text("not a folder")
    with pytest.raises(BundleError, match="weights is not a directory") as e:
        Bundle.load(save())
    assert e.value.field == "weights"


@pytest.mark.parametrize("section, field, value, message", [
    ("gemms", "m", 10**30, r"blk0\.qkv\.m: A \(\(m-1\)\*lda \+ k"),
    ("gemms", "m", 2**33, r"blk0\.qkv\.m: A .* at most 17179869180 bytes"),
    ("ops", "elems", 2**62, r"blk0\.gelu\.elems: each buffer would be 9223372036854775808 bytes"),
    ("ops", "elems", 41, r"blk0\.gelu\.elems: each buffer would be 82 bytes; a kernel buffer is a whole number"),
])
def test_buffer_sizes_beyond_a_shim_descriptor(bundle_copy, section, field, value, message):
    """A size no shim DMA descriptor can move (not whole words, or more than 2^32 - 1 words) is refused at load,
    before it reaches an allocation (it used to load, then fail deep inside the runtime)."""
    _, doc, save = bundle_copy
    entry = doc[section][0]
    entry[field] = value
    with pytest.raises(BundleError, match=message) as e:
        Bundle.load(save())
    assert (e.value.key, e.value.field) == (entry["key"], field)
    assert MAX_BUFFER_BYTES == 4 * (2**32 - 1)


def test_kernel_with_too_few_buffer_arguments(bundle_copy):
    root, _, save = bundle_copy
    (root / "xclbin" / "mha.xclbin").write_bytes(xclbin.write(xclbin.build_mlir_aie(b"\x02" * 64, n_buffers=2)))
    with pytest.raises(BundleError, match=r"blk0\.attn\.xclbin: .* needs a scalar opcode, an instruction buffer, "
                                          r"a scalar word count and 4 buffer\(s\)") as e:
        Bundle.load(save())
    assert (e.value.key, e.value.field) == ("blk0.attn", "xclbin")


def test_dpu_kernel_is_not_an_mlir_aie_kernel(bundle_copy):
    """A real xclbin whose kernel takes scalar argv: it used to load, then crash in prepare with a TypeError."""
    root, doc, save = bundle_copy
    shutil.copy(fixture("amd-npu4/preemption_4x4.xclbin"), root / "xclbin" / "attn_gemm.xclbin")
    doc["xclbins"]["attn_gemm"]["kernel"] = "DPU"
    with pytest.raises(BundleError, match=r"kernel 'DPU' declares \(opcode: scalar, .*argv0: scalar"):
        Bundle.load(save())


# ---------------------------------------------------------------------------------------------
# Npu misuse


@pytest.fixture()
def npu(built, device):
    with Npu(built, device[1]) as n:
        yield n


def test_closed_npu_refuses_and_leaks_nothing(built, device):
    emu, dev = device
    n = Npu(built, dev)
    io, w = n.io("blk0.qkv", 32), n.weight_slot("blk0.qkv")
    n.close()
    assert emu.counters.live()["hwctx"] == 0
    calls = [lambda: n.run(io, w), lambda: n.run_synced(io, w), lambda: n.prepare(io, w),
             lambda: n.run_args("blk0.gelu", [dev.bo(81920)]), lambda: n.io("blk0.qkv", 32),
             lambda: n.conv_io("neck.conv16", 4, 4), lambda: n.mha_io("blk0.attn"), lambda: n.upload(b"1234")]
    for call in calls:
        with pytest.raises(NpuError, match="the Npu is closed"):
            call()
    assert emu.counters.live()["hwctx"] == 0  # run used to load a context nobody would release
    n.close()


def test_weights_of_the_wrong_size(npu):
    io = npu.io("blk0.qkv", 32)  # b_bytes 64 * 192 * 2
    for size in (100, 24576 + 4096):
        with pytest.raises(ValueError, match=rf"blk0\.qkv: weights of {size} bytes, B takes b_bytes=24576 \(kn\)"):
            npu.run(io, npu.device.bo(size))
    with pytest.raises(TypeError, match=r"blk0\.qkv: weights must be a Bo, got ndarray"):
        npu.run_synced(io, np.zeros(12288, np.uint16))
    assert npu.device.stats["EXEC_CMD"] == 0


def test_weights_of_another_device(npu):
    with open_device("emu:npu4") as other:
        with pytest.raises(ValueError, match=r"blk0\.qkv: weights belongs to device emu:npu4, not this Npu's"):
            npu.run(npu.io("blk0.qkv", 32), other.bo(24576))


def test_run_args_checks_buffers_before_the_device(npu):
    elems = npu.ops["blk0.gelu"].elems
    with pytest.raises(ValueError, match=r"blk0\.gelu: run_args takes 1 buffer\(s\) \(argument 0\), got 0"):
        npu.run_args("blk0.gelu", [])
    with pytest.raises(ValueError, match=rf"blk0\.gelu: argument 0 has 64 bytes, the kernel reads {elems * 2}"):
        npu.run_args("blk0.gelu", [npu.device.bo(64)])
    with pytest.raises(ValueError, match=r"blk0\.qkv: run_args takes 3 buffer\(s\) \(A, B, C\), got 1"):
        npu.run_args("blk0.qkv", [npu.device.bo(4096)])
    with pytest.raises(ValueError, match=r"blk0\.attn: run_args takes 4 buffer\(s\) \(q, k, v, o\), got 2"):
        npu.run_args("blk0.attn", [npu.device.bo(8192)] * 2)
    with pytest.raises(TypeError, match=r"blk0\.gelu: argument 0 must be a Bo, got ndarray"):
        npu.run_args("blk0.gelu", [np.zeros(elems, np.uint16)])
    assert npu.device.stats["EXEC_CMD"] == 0  # every one used to fail on the device (command ERROR, EIO)
    # A GEMM run through run_args with the right buffers computes (A, B, C in order).
    g = npu.spec("blk0.proj")
    rng = np.random.default_rng(1)
    x, w = (pack.round_bf16(rng.standard_normal(s, dtype=np.float32)) for s in ((g.m, g.k), (g.k, g.n)))
    a, b, c = npu.upload(pack.to_bf16(x)), npu.upload(pack.pack_b(w, g.b_layout)), npu.device.bo(g.m * g.n * 2)
    npu.run_args("blk0.proj", [a, b, c])
    assert _rel(pack.from_bf16(pull(c, g.m * g.n)).reshape(g.m, g.n), x @ w) < TOL


def test_operands_of_the_wrong_type(npu):
    io, m, w = npu.io("blk0.qkv", 32), npu.mha_io("blk0.attn"), npu.weight_slot("blk0.qkv")
    cases = [(lambda: npu.run(5, w), r"Npu: operands must be an Io, got int"),
             (lambda: npu.run(m, w), r"blk0\.attn: operands must be an Io, got MhaIo"),
             (lambda: npu.run_synced(m, w), r"blk0\.attn: operands must be an Io, got MhaIo"),
             (lambda: npu.prepare(None, w), r"Npu: operands must be an Io, got NoneType"),
             (lambda: npu.run_mha(io), r"blk0\.qkv: attention operands must be an MhaIo, got Io"),
             (lambda: npu.io_chained("blk0.fc2", 5), r"blk0\.fc2: io_chained source must be an Io, got int")]
    for call, message in cases:  # each used to be an AttributeError from inside the layer
        with pytest.raises(TypeError, match=message):
            call()


@pytest.mark.parametrize("call, message", [
    (lambda n: n.io("blk0.qkv", 5.5), r"blk0\.qkv: rows must be an integer, got float 5\.5"),
    (lambda n: n.io("blk0.qkv", "32"), r"blk0\.qkv: rows must be an integer, got str '32'"),
    (lambda n: n.io("blk0.qkv", True), r"blk0\.qkv: rows must be an integer, got bool"),
    (lambda n: n.conv_io("neck.conv16", 2.5, 3), r"neck\.conv16: map height must be an integer, got float 2\.5"),
    (lambda n: n.conv_io("neck.conv16", 3, True), r"neck\.conv16: map width must be an integer, got bool"),
    (lambda n: n.mha_io("blk0.attn", 1.5), r"blk0\.attn: batch must be an integer, got float 1\.5"),
    (lambda n: n.io("blk0.qkv", 40).get_c(2.0), r"blk0\.qkv: get_c rows must be an integer, got float"),
    (lambda n: pull(n.weight_slot("blk0.qkv"), 2.0), r"pull count must be an integer, got float"),
    (lambda n: pull(n.weight_slot("blk0.qkv"), 2, dtype=object), r"pull: dtype must be numeric, got object"),
    (lambda n: push(np.array([object()]), n.weight_slot("blk0.qkv")), r"push: expected numeric data"),
])
def test_counts_must_be_integers(npu, call, message):
    """Floats used to be accepted (conv_io(2.5, 3) allocated a map of 2.5 rows) or fail deep inside numpy."""
    with pytest.raises(TypeError, match=message):
        call(npu)


def test_numpy_integers_are_counts(npu):
    assert npu.io("blk0.qkv", np.int64(33)).rows == 64
    assert npu.conv_io("neck.conv16", np.int32(1), np.uint8(1)).rows == 16  # ceil(1*3/4) = 1 -> m = 16
    assert npu.mha_io("blk0.attn", np.int16(2)).batch == 2


def test_pull_outside_the_buffer_names_the_range(npu):
    w = npu.weight_slot("blk0.qkv")  # 24576 bytes
    for count, offset in ((12289, 0), (-1, 0), (4, -2), (10**20, 0), (2, 24574)):
        with pytest.raises(ValueError, match=rf"pull\(count={count}, dtype=uint16, offset={offset}\) outside a "
                                             r"24576-byte buffer"):
            pull(w, count, offset=offset)
    assert pull(w, 2, offset=24572).tolist() == [0, 0]


def test_tiny_maps_and_single_rows_against_numpy(npu):
    """The smallest shapes the layer accepts: 1 row of a GEMM, 1x1 / 1xN / Nx1 maps of the convolution."""
    rng = np.random.default_rng(7)
    g = npu.spec("blk0.fc1")  # tiled:16,32
    w = pack.round_bf16(rng.standard_normal((g.k, g.n), dtype=np.float32))
    wbo = npu.upload(pack.pack_b(w, g.b_layout))
    io = npu.io("blk0.fc1", 1)
    x = pack.round_bf16(rng.standard_normal((1, g.k), dtype=np.float32))
    io.set_a(x)
    npu.run_synced(io, wbo)
    assert (io.rows, len(io.chunks)) == (32, 1) and _rel(pack.from_bf16(io.get_c(1)), x @ w) < TOL
    geom = npu.conv_geometry("neck.conv32")
    weight = pack.round_bf16(rng.standard_normal((geom.cout, geom.d, 3, 3), dtype=np.float32))
    wbo = npu.upload(pack.pack_conv3x3(weight, geom.p))
    for h, w_ in ((1, 1), (1, 7), (5, 1)):
        from sam3 import reference
        x = pack.round_bf16(rng.standard_normal((h, w_, geom.d), dtype=np.float32))
        io = npu.conv_io("neck.conv32", h, w_)
        io.set_a(pack.conv_input(x, geom, io.rows))
        npu.run_synced(io, wbo)
        assert _rel(pack.conv_output(io.get_c(io.rows), geom, h, w_), reference.conv3x3(x, weight)) < TOL


def test_threads_share_one_npu(built, device):
    """Four threads on one Npu with one resident context: every use evicts. Without the Npu's lock a thread's
    context was destroyed under it ("context is closed") and two loads of one context leaked one."""
    emu, dev = device
    keys = ["blk0.qkv", "blk0.fc1", "blk0.proj", "blk0.fc2"]
    failures: list[str] = []
    with Npu(built, dev, max_contexts=1) as n:
        barrier = threading.Barrier(len(keys))

        def work(key: str, seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                g = n.spec(key)
                w = pack.round_bf16(rng.standard_normal((g.k, g.n), dtype=np.float32))
                wbo, io = n.upload(pack.pack_b(w, g.b_layout)), n.io(key, 64)
                barrier.wait(timeout=10)
                for _ in range(6):
                    x = pack.round_bf16(rng.standard_normal((64, g.k), dtype=np.float32))
                    io.set_a(x)
                    n.run_synced(io, wbo)
                    if _rel(pack.from_bf16(io.get_c(64)), x @ w) >= TOL:
                        failures.append(f"{key}: wrong result")
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                failures.append(f"{key}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(k, i)) for i, k in enumerate(keys)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert failures == []
        assert n.evictions >= 4 and emu.counters.live()["hwctx"] == 1
    assert emu.counters.live()["hwctx"] == 0


def test_copy_pool_started_once_under_threads(monkeypatch):
    """Two first wide copies from two threads used to start two pools (one never shut down)."""
    made: list[object] = []
    real = pack.ThreadPoolExecutor

    class Slow(real):
        def __init__(self, *args, **kwargs):
            made.append(self)
            started.wait(timeout=0.2)  # holds the first constructor until the other thread has checked the pool
            super().__init__(*args, **kwargs)

    started = threading.Event()
    monkeypatch.setattr(pack, "ThreadPoolExecutor", Slow)
    monkeypatch.setattr(pack, "_pool", None)
    pools: list[object] = []
    threads = [threading.Thread(target=lambda: pools.append(pack._executor())) for _ in range(2)]
    for t in threads:
        t.start()
    started.set()
    for t in threads:
        t.join(timeout=5)
    try:
        assert len(made) == 1 and pools[0] is pools[1]
    finally:
        for pool in made:
            pool.shutdown()


# ---------------------------------------------------------------------------------------------
# the builder and the demo


def test_build_error_names_the_kernel(tmp_path):
    odd = Geometry(name="odd", grid=(4, 4), width=6, heads=3, mlp=10, window=2, m=1, fc1_tiles=(3, 5),
                   convs=(ConvShape("c0", 3, 5, 2, 3, 1, 1),))
    with pytest.raises(ValueError, match=r"odd preset, kernel c0: dma_stream: buffer 2 size 18 bytes"):
        build(tmp_path / "odd", odd)


def test_demo_json_is_strict_when_a_result_is_nan(built, tmp_path, capsys):
    root = tmp_path / "nan"
    shutil.copytree(built, root)
    w = np.fromfile(root / "weights" / "blk0.qkv.bin", np.uint16)
    w[5] = 0x7FC0  # a bf16 NaN in a hand-made weights file
    w.tofile(root / "weights" / "blk0.qkv.bin")
    rc = demo.main(["demo", "--bundle", str(root), "--device", "emu", "--json"])
    out = capsys.readouterr().out

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")
    doc = json.loads(out, parse_constant=refuse)  # the document used to carry NaN
    assert rc == 1 and doc["ok"] is False
    assert doc["stages"][0]["name"] == "qkv" and doc["stages"][0]["max_rel_err"] is None
    assert demo.main(["demo", "--bundle", str(root), "--device", "emu"]) == 1
    assert "n/a" in capsys.readouterr().out


def test_demo_unwritable_cache_exits_1(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("SAM3_CACHE", str(tmp_path / "file"))
    rc = demo.main(["demo", "--device", "emu", "--json"])
    out = capsys.readouterr()
    assert rc == 1 and out.out == ""
    assert out.err.startswith("sam3-npu demo: ") and f"bundle cache {tmp_path / 'file' / 'bundles'}" in out.err
    assert "Traceback" not in out.err
    assert os.path.isfile(tmp_path / "file")


@pytest.mark.parametrize("layout", ["tiled:²,32", "tiled:١٦,٣٢", "conv3x3:⁴"])
def test_layout_parameters_are_ascii_digits(layout):
    with pytest.raises(ValueError, match=rf"b_layout '{layout}': expected \d positive integer parameter"):
        pack.parse_layout(layout)


@pytest.mark.parametrize("timeout", ["5", -1, float("nan"), True])
def test_npu_timeout_checked_at_open(built, device, timeout):
    """A bad timeout used to be noticed by the first stage's wait, after its commands were submitted."""
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0 or None"):
        Npu(built, device[1], timeout=timeout)
    assert device[1].stats["EXEC_CMD"] == 0


def test_stage_after_a_timeout(built):
    """A stage that timed out is still on the device; the next run of the same operands used to raise
    RuntimeError ("still in flight: wait() first", about a Run the caller cannot reach). It now waits for that
    submission first (bounded by the Npu's timeout), then runs."""
    emu = EmuDevice("npu4", tdr_timeout=1.0)
    try:
        with open_device(emu) as dev, Npu(built, dev, timeout=0) as n:
            g = n.spec("blk0.qkv")
            rng = np.random.default_rng(3)
            w = pack.round_bf16(rng.standard_normal((g.k, g.n), dtype=np.float32))
            wbo, io = n.upload(pack.pack_b(w, g.b_layout)), n.io("blk0.qkv", 256)  # 8 chunks: a RunList
            x = pack.round_bf16(rng.standard_normal((256, g.k), dtype=np.float32))
            io.set_a(x)
            emu.faults.hang(g.insts.read_bytes())  # the first chunk never finishes: the driver's TDR ends it
            with pytest.raises(NpuError, match=r"blk0\.qkv: chunk 0 of 8 failed: .*not finished after 0 s"):
                n.run(io, wbo)
            with pytest.raises(NpuError, match=r"blk0\.qkv: its previous submission of 8 chunk\(s\) timed out and "
                                               r"is still running after another 0 s") as e:
                n.run(io, wbo)
            assert e.value.key == "blk0.qkv"
            n.timeout = 10  # the TDR ends the hung submission; the stage then runs again, whole
            n.run(io, wbo)
            assert _rel(pack.from_bf16(io.get_c(256)), x @ w) < TOL
        assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}
    finally:
        emu.close()


def test_upload_refuses_a_path_string(npu):
    with pytest.raises(TypeError, match=r"upload: expected bytes or a numeric array, got str 'weights/blk0\.qkv"):
        npu.upload("weights/blk0.qkv.bin")  # used to upload the path's text as UCS-4


@pytest.mark.parametrize("call, message", [
    (lambda n: n.io(["blk0.qkv"], 32), r"no GEMM \['blk0\.qkv'\]"),
    (lambda n: n.mha_io({}, 1), r"no MHA \{\}"),
    (lambda n: n.run_args(["blk0.gelu"], []), r"no kernel \['blk0\.gelu'\]"),
])
def test_unhashable_keys(npu, call, message):
    with pytest.raises(NpuError, match=message):  # used to be "TypeError: unhashable type"
        call(npu)


def test_build_weights_archive_checked_before_writing(tmp_path):
    np.save(tmp_path / "w.npy", np.zeros((64, 192), np.float32))
    np.savez(tmp_path / "str.npz", **{"blk0.qkv": np.full((64, 192), "a")})
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not a zip")
    np.savez(tmp_path / "shape.npz", **{"neck.conv16": np.zeros((32, 32, 3, 3)), "blk0.qkv": np.zeros((3, 3))})
    cases = [("w.npy", r"w\.npy: not a weights archive: a single array \(\.npy\)"),
             ("str.npz", r"weights for blk0\.qkv: dtype <U1, expected real numbers"),
             ("junk.npz", r"junk\.npz: not a weights archive: File is not a zip file"),
             ("shape.npz", r"weights for blk0\.qkv: shape \(3, 3\), the tiny preset needs \(64, 192\)")]
    for name, message in cases:  # a ValueError from deep inside numpy, a BadZipFile traceback, or half a bundle
        with pytest.raises(ValueError, match=message):
            build(tmp_path / "out", "tiny", weights=tmp_path / name)
        assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        build(tmp_path / "out", "tiny", seed=-1)
    assert demo.main(["build", str(tmp_path / "out"), "--weights", str(tmp_path / "junk.npz")]) == 1


def test_fresh_buffers_every_forward_do_not_accumulate(built, device):
    """A serving loop that uploads new weights for one Io, or runs an op over a new Io's C, every forward: each
    operand set's command packets (and the buffers they pin) used to be kept for the Npu's lifetime."""
    import gc

    from sam3.npu import UNIT_CACHE

    emu, dev = device
    with Npu(built, dev) as n:
        g = n.spec("blk0.qkv")
        io = n.io("blk0.qkv", 256)  # 8 chunks: each weight buffer gets a RunList and 8 Runs
        rng = np.random.default_rng(5)
        x = pack.round_bf16(rng.standard_normal((256, g.k), dtype=np.float32))
        io.set_a(x)
        live = []
        for _ in range(UNIT_CACHE + 6):
            w = pack.round_bf16(rng.standard_normal((g.k, g.n), dtype=np.float32))
            wbo = n.upload(pack.pack_b(w, g.b_layout))
            n.run(io, wbo)
            act = n.io("blk0.fc1", 256)
            n.run_args("blk0.gelu", [act.c])
            del wbo, act
            gc.collect()
            live.append(emu.counters.live()["bos"])
        assert _rel(pack.from_bf16(io.get_c(256)), x @ w) < TOL
        assert live[UNIT_CACHE + 1] == live[-1]
        first = n.upload(pack.pack_b(w, g.b_layout))
        for _ in range(UNIT_CACHE + 2):  # reused weights stay cached; a dropped unit is rebuilt on next use
            n.run(io, first)
            n.run(io, n.upload(pack.pack_b(w, g.b_layout)))
        assert _rel(pack.from_bf16(io.get_c(256)), x @ w) < TOL
    assert emu.counters.live()["hwctx"] == 0


def test_key_too_long_for_a_file_name(bundle_copy):
    root, doc, save = bundle_copy
    key = "k" * 300
    (root / "weights" / "blk0.qkv.bin").unlink()
    doc["gemms"][0]["key"] = key
    assert Bundle.load(save()).weights(key) is None  # used to raise OSError (ENAMETOOLONG)


@pytest.mark.parametrize("text", ["²", "1e3", "-1", "0x2"])
def test_env_cap_that_is_not_a_decimal(built, device, monkeypatch, text):
    monkeypatch.setenv("SAM3_MAX_CONTEXTS", text)
    with pytest.raises(ValueError, match=rf"SAM3_MAX_CONTEXTS='{text}': expected a positive integer"):
        Npu(built, device[1])


def test_context_wider_than_the_array(bundle_copy, device):
    """An xclbin for 16 columns on an 8-column NPU4 used to load, then at first use evict every resident context
    (its CREATE_HWCTX refusal reads as "no room") before failing."""
    root, _, save = bundle_copy
    (root / "xclbin" / "attn_gemm.xclbin").write_bytes(
        xclbin.write(xclbin.build_mlir_aie(b"\x03" * 64, column_width=16, start_columns=[0])))
    emu, dev = device
    with pytest.raises(NpuError, match=r"blk0\.proj: xclbin/attn_gemm\.xclbin needs 16 AIE columns, the device "
                                       r"has 8") as e:
        Npu(Bundle.load(save()), dev)
    assert e.value.key == "blk0.proj" and emu.counters.live()["hwctx"] == 0


def test_conv_output_refuses_floats(npu):
    """C converted to float32 first used to be viewed as twice as many bf16 bit patterns: a silently wrong map."""
    geom = npu.conv_geometry("neck.conv16")
    io = npu.conv_io("neck.conv16", 4, 4)
    c = io.get_c(io.rows)
    assert pack.conv_output(c, geom, 4, 4).shape == (4, 4, geom.cout)
    with pytest.raises(TypeError, match=r"conv_output: expected bf16 data .* got float32"):
        pack.conv_output(pack.from_bf16(c), geom, 4, 4)
    with pytest.raises(TypeError, match=r"b_matrix: expected bf16 data .* got float64"):
        pack.b_matrix(np.zeros(64 * 96, np.float64), "kn", 64, 192)
    with pytest.raises(TypeError, match=r"unpack_conv3x3: expected bf16 data .* got float32"):
        pack.unpack_conv3x3(np.zeros(6 * 32 * 3 * 4 * 32 // 2, np.float32), 32, 4, 32)
    raw = np.arange(8, dtype=np.uint16)
    assert np.array_equal(pack.b_matrix(raw.view(np.uint8), "kn", 2, 4), pack.b_matrix(raw, "kn", 2, 4))
    with pytest.raises(ValueError, match=r"b_matrix: 3 bytes are not a whole number of bf16 values"):
        pack.b_matrix(np.zeros(3, np.uint8), "kn", 1, 1)
    with pytest.raises(ValueError, match=r"conv_output: map size -1x4 must be positive"):
        pack.conv_output(c, geom, -1, 4)


@pytest.mark.parametrize("call, message", [
    (lambda: pack.split_heads(np.zeros((4, 8)), 0), r"split_heads: .* 0 heads"),
    (lambda: pack.split_heads(np.zeros(8), 2), r"split_heads: expected \[\.\.\., seq, width\]"),
    (lambda: pack.merge_heads(np.zeros((4, 8))), r"merge_heads: expected \[\.\.\., heads, seq, d\]"),
    (lambda: pack.window_partition(np.zeros((4, 4, 2)), 0), r"window_partition: .* win 0"),
    (lambda: pack.window_merge(np.zeros((4, 4, 2)), 0, 4, 4), r"window_merge: .* win 0"),
    (lambda: pack.ConvGeometry(4, 2, 3).rows(4, 4, 0), r"ConvGeometry\.rows: m must be positive, got 0"),
])
def test_reshuffles_refuse_degenerate_sizes(call, message):
    with pytest.raises(ValueError, match=message):  # ZeroDivisionError or a bare unpacking error before
        call()


def test_conv_a_must_be_a_whole_y(npu):
    """A raw [h][w][D] map pushed as a convolution's A used to be accepted: no pad columns, shifted windows."""
    geom = npu.conv_geometry("neck.conv16")
    io = npu.conv_io("neck.conv16", 4, 4)  # ceil(4*6/4) = 6 -> 16 rows; Y = (16*4 + 2) * 32 elements
    x = np.ones((4, 4, geom.d), np.float32)
    with pytest.raises(ValueError, match=r"neck\.conv16: set_a of 512 elements, a convolution's A is Y of 2112 "
                                         r"\(pack\.conv_input\(x, geometry, 16\)\)"):
        io.set_a(x)
    assert io.set_a(pack.conv_input(x, geom, io.rows)) == 2112 * 2
