"""Start-up cost: ``import amdxdna_direct`` and ``amdxdna --help``, this tree against another one, in one run.

Run: ``python bench/bench_startup.py [--before /tmp/before] [--runs 15] [--importtime]``

``--before`` is a checkout of the version to compare with (default ``/tmp/before``; make one with
``git -C <repo> worktree add --detach /tmp/before HEAD``); without it only this tree is measured.
Every command runs as a fresh ``python`` process with the tree first on ``PYTHONPATH`` (so each side
imports its own package) and bytecode already cached (one unmeasured run first). The runs alternate
between the trees so that a busy machine slows both alike; figures are medians.

Two figures per command: the process's wall time, and the import's own time as ``-X importtime``
reports it (cumulative time of the top-level package; interpreter start-up excluded). The interpreter
alone (``python -c pass``) and ``import numpy`` are printed for scale. Goals (issue 14): import
<= 100 ms, ``--help`` <= 150 ms. Deterministic counts: modules imported, and whether pycparser, xml,
email, http or ssl are among them.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
IMPORT = "import amdxdna_direct"
HELP = ("import sys; sys.argv = ['amdxdna', '--help']\n"
        "from amdxdna_direct.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass")
COUNT = ("import contextlib, io, sys\n"
         "with contextlib.redirect_stdout(io.StringIO()):\n    exec({code!r})\n"
         "mods = sorted(sys.modules)\n"
         "heavy = [m for m in ('pycparser', 'xml', 'email', 'http', 'ssl', 'urllib.request', 'ml_dtypes') "
         "if m in sys.modules]\n"
         "print(len(mods), ','.join(heavy))")
GOALS = {"import": 100.0, "--help": 150.0}
_CUMULATIVE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| (\S+)$")


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("AMDXDNA_TRACE", None)
    return env


def _run(tree: Path, code: str, importtime: bool = False) -> tuple[float, float | None, str]:
    """One fresh interpreter: (wall ms, the top-level import's own ms or None, stdout)."""
    argv = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-c", code]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=_env(tree), capture_output=True, text=True, check=False)
    wall = (time.perf_counter() - start) * 1e3
    if done.returncode != 0:
        raise SystemExit(f"bench_startup: {argv[-1][:40]!r} failed in {tree}:\n{done.stderr[-2000:]}")
    own = None
    if importtime:
        tops = [int(m.group(1)) for m in map(_CUMULATIVE.match, done.stderr.splitlines())
                if m and m.group(2) in ("amdxdna_direct", "amdxdna_direct.cli")]
        own = max(tops) / 1e3 if tops else None
    return wall, own, done.stdout


def _measure(trees: dict[str, Path], code: str, runs: int) -> dict[str, tuple[float, float]]:
    """Median (wall ms, own import ms) per tree, runs alternated between the trees."""
    walls: dict[str, list[float]] = {name: [] for name in trees}
    owns: dict[str, list[float]] = {name: [] for name in trees}
    for tree in trees.values():
        _run(tree, code)  # bytecode cached before measuring
    for _ in range(runs):
        for name, tree in trees.items():
            walls[name].append(_run(tree, code)[0])
            own = _run(tree, code, importtime=True)[1]
            if own is not None:
                owns[name].append(own)
    return {name: (statistics.median(walls[name]), statistics.median(owns[name]) if owns[name] else float("nan"))
            for name in trees}


def main(argv: list[str] | None = None) -> int:
    """Print the start-up figures; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=Path("/tmp/before"),
                        help="a checkout to compare with (default /tmp/before; skipped when absent)")
    parser.add_argument("--runs", type=int, default=15, help="runs per command and tree (default 15)")
    parser.add_argument("--importtime", action="store_true",
                        help="also print this tree's 12 slowest modules of the import (self time)")
    args = parser.parse_args(argv)
    trees = {"now": HERE}
    if (args.before / "amdxdna_direct" / "__init__.py").is_file():
        trees["before"] = args.before.resolve()
    else:
        print(f"(no checkout at {args.before}: this tree only)")
    print(f"python {sys.version.split()[0]}, {args.runs} runs each, medians; trees: "
          + ", ".join(f"{k}={v}" for k, v in trees.items()))
    print("  load average at start: %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 1))
    base = _measure({"python": HERE}, "pass", args.runs)["python"][0]
    numpy = _measure({"numpy": HERE}, "import numpy", args.runs)["numpy"][0]
    print(f"  interpreter alone (python -c pass): {base:7.1f} ms wall;  import numpy: {numpy:7.1f} ms wall")
    for label, code in (("import", IMPORT), ("--help", HELP)):
        figures = _measure(trees, code, args.runs)
        goal = GOALS[label]
        for name, (wall, own) in figures.items():
            count, heavy = _run(trees[name], COUNT.format(code=code))[2].split(" ")
            line = (f"  {label:7s} {name:6s}: {wall:7.1f} ms wall ({wall - base:6.1f} ms over the interpreter), "
                    f"import's own {own:6.1f} ms  goal <= {goal:.0f} ms: "
                    f"{'met' if own <= goal else 'NOT met'} (own time)")
            print(line)
            print(f"                  modules loaded {count}, heavy ones: {heavy.strip() or 'none'}")
        if "before" in figures:
            (now_wall, now_own), (old_wall, old_own) = figures["now"], figures["before"]
            print(f"  {label:7s} now / before: wall {now_wall / old_wall:.2f}x, import's own {now_own / old_own:.2f}x")
    if args.importtime:
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", IMPORT], cwd=HERE, env=_env(HERE),
                              capture_output=True, text=True, check=True)
        rows = [(int(line.split("|")[0].split(":")[1]), line.split("|")[2].strip())
                for line in done.stderr.splitlines()[1:] if line.startswith("import time:")]
        print("  slowest modules of the import (self us):")
        for us, name in sorted(rows, reverse=True)[:12]:
            print(f"    {us:8d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
