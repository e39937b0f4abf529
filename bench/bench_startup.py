"""Start-up cost: ``import amdxdna_direct`` and ``amdxdna --help``, this tree against another one, in one run.

Run: ``python bench/bench_startup.py [--before /tmp/before] [--runs 15] [--importtime]``

Three commands: ``import amdxdna_direct`` (the package: its names load on first use), ``from amdxdna_direct
import open_device, Bo, Kernel`` (what a program uses: the runtime, numpy with it) and ``amdxdna --help``.
numpy's own import is not the package's to shorten: a goal is judged on the package's time without it, and
both figures are printed.

``--before`` is a checkout of the version to compare with (default ``/tmp/before``; make one with
``git -C <repo> worktree add --detach /tmp/before HEAD``); without it only this tree is measured.
Every command runs as a fresh ``python`` process with the tree first on ``PYTHONPATH`` (so each side
imports its own package) and bytecode already cached (one unmeasured run first; the bytecode goes to a
temporary ``PYTHONPYCACHEPREFIX``, also when the environment sets ``PYTHONDONTWRITEBYTECODE``). The runs alternate
between the trees so that a busy machine slows both alike; figures are medians.

Figures per command: the process's wall time, and the import's own time as ``-X importtime``
reports it (the cumulative times of the top-level ``amdxdna_direct`` imports; interpreter start-up excluded),
with numpy's share of it (numpy's own import, nested inside) shown beside. The interpreter
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
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
IMPORT = "import amdxdna_direct"
RUNTIME = "from amdxdna_direct import open_device, Bo, Kernel"
HELP = ("import sys; sys.argv = ['amdxdna', '--help']\n"
        "from amdxdna_direct.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass")
COUNT = ("import contextlib, io, sys\n"
         "with contextlib.redirect_stdout(io.StringIO()):\n    exec({code!r})\n"
         "mods = sorted(sys.modules)\n"
         "heavy = [m for m in ('pycparser', 'xml', 'email', 'http', 'ssl', 'urllib.request', 'ml_dtypes', 'numpy',"
         " 'cffi') if m in sys.modules]\n"
         "print(len(mods), ','.join(heavy))")
GOALS = {"import": 100.0, "runtime": 100.0, "--help": 150.0}
_ROW = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( +)(\S+)$")
_CACHE = tempfile.mkdtemp(prefix="bench-startup-pyc-")


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("AMDXDNA_TRACE", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(_CACHE, tree.name or "root")
    return env


def _run(tree: Path, code: str, importtime: bool = False) -> tuple[float, float | None, float | None, str]:
    """One fresh interpreter: (wall ms, the package's import ms, numpy's share of it in ms, stdout); both import
    figures are None without ``importtime``."""
    argv = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-c", code]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=tree, env=_env(tree), capture_output=True, text=True, check=False)
    wall = (time.perf_counter() - start) * 1e3
    if done.returncode != 0:
        raise SystemExit(f"bench_startup: {argv[-1][:40]!r} failed in {tree}:\n{done.stderr[-2000:]}")
    own = numpy_ms = None
    if importtime:
        rows = [m for m in map(_ROW.match, done.stderr.splitlines()) if m]
        tops = [int(m.group(1)) for m in rows if len(m.group(2)) == 1 and m.group(3).startswith("amdxdna_direct")]
        numpy = [int(m.group(1)) for m in rows if m.group(3) == "numpy" and len(m.group(2)) > 1]
        own = sum(tops) / 1e3 if tops else None
        numpy_ms = sum(numpy) / 1e3
    return wall, own, numpy_ms, done.stdout


def _measure(trees: dict[str, Path], code: str, runs: int) -> dict[str, tuple[float, float]]:
    """Median (wall ms, own import ms) per tree, runs alternated between the trees."""
    walls: dict[str, list[float]] = {name: [] for name in trees}
    owns: dict[str, list[float]] = {name: [] for name in trees}
    numpys: dict[str, list[float]] = {name: [] for name in trees}
    for tree in trees.values():
        _run(tree, code)  # bytecode cached before measuring
    for _ in range(runs):
        for name, tree in trees.items():
            walls[name].append(_run(tree, code)[0])
            _wall, own, numpy, _out = _run(tree, code, importtime=True)
            if own is not None and numpy is not None:
                owns[name].append(own)
                numpys[name].append(numpy)
    nan = float("nan")
    return {name: (statistics.median(walls[name]), statistics.median(owns[name]) if owns[name] else nan,
                   statistics.median(numpys[name]) if numpys[name] else nan) for name in trees}


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
    print(f"  interpreter alone (python -c pass): {base:7.1f} ms wall;  import numpy: {numpy:7.1f} ms wall "
          f"({numpy - base:.1f} ms over the interpreter)")
    for label, code in (("import", IMPORT), ("runtime", RUNTIME), ("--help", HELP)):
        figures = _measure(trees, code, args.runs)
        goal = GOALS[label]
        for name, (wall, own, numpy_share) in figures.items():
            count, heavy = _run(trees[name], COUNT.format(code=code))[3].split(" ")
            without = own - numpy_share
            line = (f"  {label:7s} {name:6s}: {wall:7.1f} ms wall ({wall - base:6.1f} ms over the interpreter), "
                    f"import's own {own:6.1f} ms (numpy {numpy_share:5.1f} of it)  goal <= {goal:.0f} ms: "
                    f"{'met' if without <= goal else 'NOT met'} ({without:.1f} ms without numpy's)")
            print(line)
            print(f"                  modules loaded {count}, heavy ones: {heavy.strip() or 'none'}")
        if "before" in figures:
            (now_wall, now_own, _), (old_wall, old_own, _) = figures["now"], figures["before"]
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
