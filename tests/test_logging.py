"""Logging done the library way (docs/cli.md "Logging"): a NullHandler on the package logger, one
logger per module, ``AMDXDNA_TRACE`` installing its handler once, and no trace line printed twice when the
application configures logging itself.

Oracles: Python's logging rules (a record reaching no handler goes to ``logging.lastResort``, which prints
WARNING and above to stderr; a record propagates to every ancestor's handlers), and the device's own ioctl
counters (``Device.stats``): one trace line per ioctl issued.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "amdxdna_direct"
PREFIX = "amdxdna-trace: "

# The README's passthrough run on the emulator, with an application's logging set up before or after the
# import (argv[1]), and the trace enabled a second time on request (argv[2]).
APP = textwrap.dedent("""
    import json, logging, sys
    import numpy as np

    def configure():
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="app %(name)s: %(message)s")

    if sys.argv[1] == "before":
        configure()
    from amdxdna_direct import insts, open_device, trace, xclbin
    from amdxdna_direct.emu import Passthrough
    if sys.argv[1] == "after":
        configure()
    if sys.argv[2] == "twice":
        trace.enable()
        trace.enable()
    logging.getLogger("amdxdna_direct.app_probe").warning("a library warning")
    design = xclbin.build_mlir_aie(bytes(256))
    stream = insts.encode(insts.dma_stream(3, [(0, 4096, "in"), (2, 4096, "out")]))
    with open_device("emu:npu1") as dev:
        dev.emulator.models.bind(stream, Passthrough())
        ctx = dev.hw_context(design)
        src, dst = dev.bo(4096), dev.bo(4096)
        src.array(np.int32)[:16] = np.arange(16)
        src.sync()
        ctx.kernel().prepare_npu(stream, [src, None, dst]).start().wait(timeout=30)
        dst.sync()
        assert (dst.array(np.int32)[:16] == np.arange(16)).all()
    ioctls = sum(v for k, v in dev.stats.items() if k.isupper())
    handlers = [type(h).__name__ for h in logging.getLogger("amdxdna_direct.trace").handlers]
    print(json.dumps({"ioctls": ioctls, "handlers": handlers}))
""")


def _run_app(tmp_path: Path, order: str, times: str = "once", trace: str = "1") -> tuple[dict, list[str]]:
    script = tmp_path / "app.py"
    script.write_text(APP)
    env = dict(os.environ, PYTHONPATH=str(REPO), AMDXDNA_TRACE=trace)
    done = subprocess.run([sys.executable, str(script), order, times], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr.splitlines()


@pytest.mark.parametrize("order", ["before", "after"])
def test_each_trace_line_once_under_an_applications_basicconfig(tmp_path, order):
    report, lines = _run_app(tmp_path, order)
    records = [line for line in lines if line.startswith(PREFIX) and "us" in line and "(" in line]
    ioctl_lines = [line for line in records if " -> " in line]
    assert report["ioctls"] > 10
    assert len(ioctl_lines) == report["ioctls"]                      # one line per ioctl the device counted
    assert not [line for line in lines if line.startswith("app amdxdna_direct.trace")]  # no second copy
    assert report["handlers"] == ["StreamHandler"]
    # The application's handler still gets the library's other records.
    assert "app amdxdna_direct.app_probe: a library warning" in lines


def test_the_trace_handler_is_installed_once(tmp_path):
    report, lines = _run_app(tmp_path, "none", "twice")
    assert report["handlers"] == ["StreamHandler"]
    ioctl_lines = [line for line in lines if line.startswith(PREFIX) and " -> " in line]
    assert len(ioctl_lines) == report["ioctls"]


def test_without_logging_setup_the_library_prints_nothing(tmp_path):
    # No handler anywhere would send the warning to logging.lastResort (stderr): the package's NullHandler
    # stops that; the trace is off, so stderr stays empty.
    report, lines = _run_app(tmp_path, "none", trace="0")
    assert lines == []
    assert report["handlers"] == []


def test_the_package_logger_has_a_null_handler():
    import amdxdna_direct  # noqa: F401  (the import installs it)

    handlers = logging.getLogger("amdxdna_direct").handlers
    assert [type(h) for h in handlers if isinstance(h, logging.NullHandler)] == [logging.NullHandler]


def test_enable_and_disable_restore_propagation():
    import io

    from amdxdna_direct import trace

    log = logging.getLogger("amdxdna_direct.trace")
    before = log.propagate, list(log.handlers)
    handler = trace.enable(io.StringIO())
    try:
        assert log.propagate is False and handler in log.handlers
    finally:
        trace.disable()
    assert (log.propagate, log.handlers) == before


def _logger_names(path: Path) -> list[str]:
    """The argument text of every ``logging.getLogger(...)`` call in a module."""
    tree = ast.parse(path.read_text(), str(path))
    return [ast.unparse(node.args[0]) if node.args else "" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("logging.getLogger", "getLogger")]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_logs_under_its_own_name(path):
    names = _logger_names(path)
    wrong = [name for name in names if name != "__name__"]
    if path == PACKAGE / "trace.py":  # the package logger's NullHandler is installed from here
        wrong = [name for name in wrong if name != "__name__.rpartition('.')[0]"]
    assert wrong == [], f"{path.relative_to(REPO)}: logging.getLogger({', '.join(wrong)}): use __name__"
