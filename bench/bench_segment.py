#!/usr/bin/env python3
"""End-to-end `segment` (image + prompt -> instances) on the emulator: host time per stage and what each forward
costs in ioctls, allocations, packets, copies and syncs.

    python bench/bench_segment.py [--bundle DIR] [--fixture] [--full] [--null] [--reps N] [--before DIR] [--json]

--fixture exports tests/fixtures/sam3-tiny (the transformers checkpoint) and segments its first case; --full builds
(once, cached) the generated full-size bundle (1008 px, ViT 1024 x 32, device-resident, f32 residual stream) and
segments its reference image; --bundle DIR segments that bundle's reference image. --null runs on the null firmware
(`emu:npu4:null`, docs/emulator.md): every command completes at once without running its model, so what is left is
the host's own work and the dispatch path (the number a real NPU leaves to the host; the outputs are meaningless).

Phases: the first forward (packets built, weights uploaded), `--reps` warm forwards (each a new image, the same
prompt: the image side runs every time) and a new prompt on the cached image. Per phase: wall ms by stage, device
ms (submissions to completions), and the counts of one forward: ioctls by name, CREATE_BO, packets built, bytes
copied host <-> buffers, SYNC_BO; then the process's peak RSS. With --before DIR (a tree holding an older
`amdxdna_direct` and `sam3` with the null firmware) both trees are measured, one after the other in fresh
processes, and the ratios are printed side by side; without it, --full --null is compared with the figures quoted
in issue 23 (measured the same way before the command units were persistent).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TINY = ROOT / "tests" / "fixtures" / "sam3-tiny"
# Issue 23's figures for --full on stubbed-out kernel models, before persistent command units (quoted, another run).
QUOTED = {"first forward": {"ms": 24000.0},
          "warm forward": {"ms": 28000.0, "CREATE_BO": 13272, "packets": 12808},
          "new prompt, cached image": {"ms": 8500.0, "CREATE_BO": 1176, "packets": 1134},
          "peak_rss_mb": 3300.0}
PHASES = ("first forward", "warm forward", "new prompt, cached image")


def fixture_bundle(work: Path) -> tuple[Path, Path, str]:
    from sam3.export import export

    if not (TINY / "hf").is_dir():
        raise SystemExit(f"{TINY} absent: --fixture needs the repository's tests/fixtures")
    case = json.loads((TINY / "cases.json").read_text())["cases"][0]
    root = export(TINY / "hf", work / "fixture", reference=TINY / "reference.npz")
    return root, TINY / case["image"], case["prompt"]


def reference_image(root: Path) -> tuple[Path, Path, str]:
    from sam3.bundle import Bundle

    with Bundle.open(root) as b:
        if b.ref_image is None or not b.ref_prompt:
            raise SystemExit(f"{root}: no ref_image / ref_prompt record")
        return root, b.ref_image, b.ref_prompt


def full_bundle() -> Path:
    from sam3.build import build_cached
    from sam3.demo import cache_dir

    return build_cached(cache_dir(), "sam3", "device-f32", target="npu4")


def _forward(sam, image, prompt) -> dict[str, object]:
    """One segment call: wall and device seconds, seconds by stage, and the counters it moved."""
    npu = sam.npu
    stats, built = Counter(npu.device.stats), npu.packets_built
    device = npu.device_seconds
    begin = time.perf_counter()
    result = sam.segment(image, prompt)
    wall = time.perf_counter() - begin
    moved = Counter(npu.device.stats)
    moved.subtract(stats)
    counts = {k: v for k, v in moved.items() if v}
    return {"ms": wall * 1e3, "device_ms": (npu.device_seconds - device) * 1e3,
            "stages_ms": {k: v * 1e3 for k, v in result.timing.stages.items()},
            "counts": counts, "packets": npu.packets_built - built, "command_bos": npu.command_bos}


def measure(root: Path, image: Path, prompt: str, reps: int, null: bool) -> dict[str, object]:
    """The three phases on bundle `root` (see the module docstring), as JSON-ready data."""
    import numpy as np

    from sam3 import preprocess
    from sam3.demo import EMULATOR_TIMEOUT
    from sam3.pipeline import Sam3

    rgb = preprocess.load_rgb(image)
    # each warm forward on another image (the image side runs), of the same size: the reference rolled by a row
    others = [np.ascontiguousarray(np.roll(rgb, i + 1, axis=0)) for i in range(reps)]
    device = "emu:npu4:null" if null else "emu:npu4"
    start = time.perf_counter()
    with Sam3(root, device, timeout=EMULATOR_TIMEOUT) as sam:
        opened = (time.perf_counter() - start) * 1e3
        first = _forward(sam, rgb, prompt)
        rss_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        warm = [_forward(sam, other, prompt) for other in others]
        new_prompt = _forward(sam, others[-1] if others else rgb, f"{prompt} and a dog")
    return {"bundle": root.name, "image": Path(image).name, "prompt": prompt, "device": device, "open_ms": opened,
            "first forward": first, "warm forward": _median(warm), "new prompt, cached image": new_prompt,
            "peak_rss_mb_first": rss_first, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _median(runs: list[dict]) -> dict:
    """The median run by wall time (its counts are those of every warm forward: they are deterministic)."""
    if not runs:
        return {}
    ranked = sorted(runs, key=lambda r: r["ms"])
    chosen = dict(ranked[len(ranked) // 2])
    chosen["ms_all"] = [r["ms"] for r in runs]
    chosen["ms"] = statistics.median(r["ms"] for r in runs)
    return chosen


def show(row: dict, before: dict | None, quoted: bool) -> None:
    """Print one measurement, with ratios to `before` (measured) or to issue 23's figures (quoted)."""
    print(f"{row['bundle']}: {row['image']} / {row['prompt']!r} on {row['device']}; open {row['open_ms']:.0f} ms")
    for phase in PHASES:
        now = row[phase]
        if not now:
            continue
        old = (before or {}).get(phase) or (QUOTED.get(phase) if quoted else None) or {}
        counts = now["counts"]
        line = (f"  {phase:26s} {now['ms']:9.1f} ms wall ({now['device_ms']:.1f} ms device), CREATE_BO "
                f"{counts.get('CREATE_BO', 0)}, packets built {now['packets']}, EXEC_CMD {counts.get('EXEC_CMD', 0)}, "
                f"SYNC_BO {counts.get('SYNC_BO', 0)}, copied in {counts.get('bytes_in', 0) / 2**20:.1f} MiB / out "
                f"{counts.get('bytes_out', 0) / 2**20:.1f} MiB, command BOs held {now['command_bos']}")
        print(line)
        if old:
            how = "before, measured" if before else "before, quoted (issue 23)"
            ratio = f"{now['ms'] / old['ms']:.3f}x" if old.get("ms") else "-"
            old_counts = old.get("counts", old)
            print(f"  {'':26s} {how}: {old['ms']:.1f} ms ({ratio}), CREATE_BO {old_counts.get('CREATE_BO', '-')}, "
                  f"packets built {old.get('packets', '-')}")
        stages = "  ".join(f"{k} {v:.1f}" for k, v in now["stages_ms"].items())
        print(f"  {'':26s} by stage (ms): {stages}")
        ioctls = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if not k.startswith("bytes_"))
        print(f"  {'':26s} ioctls: {ioctls}")
    rss_old = (before or {}).get("peak_rss_mb") or (QUOTED["peak_rss_mb"] if quoted else None)
    extra = f" (before: {rss_old:.0f} MB)" if rss_old else ""
    print(f"  peak RSS {row['peak_rss_mb']:.0f} MB{extra}; after the first forward {row['peak_rss_mb_first']:.0f} MB")


def _targets(args: argparse.Namespace, work: Path) -> list[tuple[Path, Path, str]]:
    targets = []
    if args.fixture or not (args.bundle or args.full):
        targets.append(fixture_bundle(work))
    if args.bundle:
        targets.append(reference_image(args.bundle))
    if args.full:
        targets.append(reference_image(full_bundle()))
    return targets


def _in_tree(tree: Path, target: tuple[Path, Path, str], args: argparse.Namespace) -> dict:
    """`measure` in a fresh process with `tree` first on the path."""
    env = dict(os.environ, PYTHONPATH=str(tree), AMDXDNA_TRACE="")
    cmd = [sys.executable, str(Path(__file__)), "--worker", *map(str, target), "--reps", str(args.reps)]
    out = subprocess.run(cmd + ["--null"] * args.null, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, help="segment this bundle's reference image")
    p.add_argument("--fixture", action="store_true", help="export and segment the sam3-tiny fixture (tests/fixtures)")
    p.add_argument("--full", action="store_true", help="the generated full-size bundle (minutes a forward without "
                                                       "--null)")
    p.add_argument("--null", action="store_true", help="the null firmware: host work and dispatch only")
    p.add_argument("--reps", type=int, default=3, help="warm forwards (default 3)")
    p.add_argument("--before", type=Path, help="a tree with the older code, measured after this one")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON lines")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        root, image, prompt = args.worker
        print(json.dumps(measure(Path(root), Path(image), prompt, args.reps, args.null)))
        return 0
    with tempfile.TemporaryDirectory() as work:
        for target in _targets(args, Path(work)):
            row = _in_tree(ROOT, target, args)
            before = _in_tree(args.before.resolve(), target, args) if args.before else None
            if args.json:
                print(json.dumps({"now": row, "before": before}))
            else:
                show(row, before, quoted=args.full and args.null and target[0].name.startswith("sam3-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
