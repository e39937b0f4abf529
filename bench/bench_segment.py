#!/usr/bin/env python3
"""End-to-end `segment` (image file + prompt -> instances) on the emulator, split into host time and device time.

    python bench/bench_segment.py [--bundle DIR] [--fixture] [--full] [--reps N]

--fixture exports tests/fixtures/sam3-tiny (the transformers checkpoint) and segments its first case;
--full builds (once, cached) the generated full-size bundle (1008 px, ViT 1024 x 32) and segments its reference
image; --bundle DIR segments that bundle's reference image. Per stage: wall time, the part spent from
submissions to completions (on the emulator: its numpy models; on an NPU: the device) and the host's share,
which is what a real NPU leaves to the host and so the number to drive down. The first forward (packets built,
weights uploaded) and the warm ones are shown apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Runnable from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sam3.demo import EMULATOR_TIMEOUT, cache_dir  # noqa: E402
from sam3.pipeline import Sam3  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sam3-tiny"


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


def measure(root: Path, image: Path, prompt: str, reps: int) -> None:
    start = time.perf_counter()
    with Sam3(root, "emu", timeout=EMULATOR_TIMEOUT) as sam:
        opened = time.perf_counter() - start
        runs = []
        for _ in range(reps + 1):
            sam._image_key = None  # every forward runs the image side too (the end-to-end number)
            begin = time.perf_counter()
            result = sam.segment(image, prompt)
            runs.append((time.perf_counter() - begin, result.timing))
    print(f"{root.name}: {image.name} / {prompt!r}; open {opened:.2f} s; {len(result.instances)} instance(s)")
    for label, chosen in (("first forward", runs[:1]), (f"warm forwards (median of {reps})", runs[1:])):
        wall = statistics.median(r[0] for r in chosen)
        npu = statistics.median(sum(r[1].npu.values()) for r in chosen)
        print(f"  {label}: {wall * 1e3:9.1f} ms wall = {npu * 1e3:9.1f} ms device + {(wall - npu) * 1e3:9.1f} ms "
              f"host ({100 * (wall - npu) / wall:.0f}% host)")
    timing = runs[-1][1]
    print("  last forward by stage (ms):  " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in timing.stages.items()))
    print("  device by kernel (ms):       " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in timing.npu.items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, help="segment this bundle's reference image")
    p.add_argument("--fixture", action="store_true", help="export and segment the sam3-tiny fixture (tests/fixtures)")
    p.add_argument("--full", action="store_true", help="the generated full-size bundle (slow: minutes a forward)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    targets = []
    with tempfile.TemporaryDirectory() as work:
        if args.fixture or not (args.bundle or args.full):
            targets.append(fixture_bundle(Path(work)))
        if args.bundle:
            targets.append(reference_image(args.bundle))
        if args.full:
            from sam3.build import build_cached

            targets.append(reference_image(build_cached(cache_dir(), "sam3", "device-f32", target="npu4")))
        for root, image, prompt in targets:
            measure(root, image, prompt, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
