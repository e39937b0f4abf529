"""A new user's first minutes: the committed tree cloned into a temporary directory with no ``../shared`` beside
it, where the README's two commands and its "Using it" example run as written (issue 16).

The commands are taken from the clone's own README (its first ``sh`` block and first ``python`` block), run with
``bash`` in a fresh venv (``--system-site-packages``: the dependencies come from this environment; pip builds
the package in its isolated build environment, as on a user's machine, with the build backend from the index) and
a fresh ``HOME`` (no cached sam3 bundle). The second command runs the whole suite in
the clone: that run is started when collection finishes and this test is moved to the end of the session
(``tests/conftest.py``), so the two suites share the machine instead of adding up. Inside the clone's run this test
skips, saying why. What is cloned is the last commit: uncommitted changes are, by design, not part of it.

The clone's run does not repeat what this session already proves. When this checkout has no change beside its
last commit (as in CI, whose checkout is a clean clone), the tests this session collected from modules that never
look at the shared folder run on exactly the cloned tree with the same outcome, so the clone's run deselects them
(``COVERED``, read by tests/conftest.py) and runs the rest: the modules that read ``../shared`` (``SHARED``, the
tracker fixture's helper), which are the ones that can behave differently without it, besides the README's
commands. The skip share is counted over the whole suite, deselected tests included. With changes in the
checkout, or when this session runs only part of the suite, the clone runs everything.

Oracles: exit codes, the example's printed array (``arange(16)``, what its passthrough design copies), the demo's
``result: OK`` line, and the nested run's summary: no failure, no error, and every skip naming ``../shared`` (or a
tool this machine lacks), with at most 2% of the tests skipped (the fixtures ship in ``tests/fixtures``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NESTED = "AMDXDNA_CLEAN_CLONE_RUN"  # set in the clone's own test run: this test does not recurse
NESTED_SKIP = "this is the clean clone's own test run: the clean-clone test does not recurse"
COVERED = "AMDXDNA_CLEAN_CLONE_COVERED"  # a file of node ids this session runs on the same tree: the clone skips them
# A module that names these can behave differently without ../shared beside the repository: the clone runs it.
READS_SHARED = ("SHARED", "tracker_fixture")
STEP_TIMEOUT = 1200  # seconds per command; the suite itself must stay far below (README: under 5 minutes)
# What a skip of the clone's run may say besides naming the absent shared folder (``../shared``, or its path beside
# the clone): a tool the ABI proofs compare with is missing, or the machine lacks something (a device, a user).
SKIP_REASONS = re.compile(r"\.\./shared|not found|not installed|no such device|needs|PEP 688", re.I)


@dataclass
class Step:
    """One command of the clean-clone run: its command line, exit code and output."""

    name: str
    command: str
    code: int | None = None
    output: str = ""


@dataclass
class CleanCloneRun:
    """Clones the repository and runs the README's commands in the background, step by step."""

    steps: list[Step] = field(default_factory=list)
    error: str | None = None
    skip: str | None = None
    shared: Path | None = None  # where ../shared would be for the clone (absent)
    _thread: threading.Thread | None = None
    _tmp: Path | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _stopped: bool = False

    covered: list[str] = field(default_factory=list)  # node ids this session runs that the clone need not repeat

    def start(self, collected: list[tuple[str, Path]] | None = None) -> None:
        if os.environ.get(NESTED):
            self.skip = NESTED_SKIP
            return
        if shutil.which("git") is None or not (ROOT / ".git").exists():
            self.skip = f"needs git and a git checkout at {ROOT}"
            return
        self._tmp = Path(tempfile.mkdtemp(prefix="amdxdna-clean-clone-"))
        self.shared = self._tmp / "shared"
        self.covered = covered_here(collected or [])
        self._thread = threading.Thread(target=self._run, name="clean-clone", daemon=True)
        self._thread.start()

    def finish(self, timeout: float) -> None:
        """Wait for the run (``stop``, at the session's end, removes it)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.error = f"the clean-clone run did not finish in {timeout:.0f} s"

    def stop(self) -> None:
        """End the run if it is still going (the session ended early: -x, Ctrl-C; or ``finish`` gave up), and remove
        its directory; the README's commands run in their own process group, which is ended whole."""
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        if self._thread is not None:
            self._thread.join(30)
        if self._tmp is not None and (self._thread is None or not self._thread.is_alive()):
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _run(self) -> None:
        assert self._tmp is not None
        try:
            self._steps(self._tmp)
        except Exception as exc:  # reported by the test, with the steps done so far
            self.error = f"{type(exc).__name__}: {exc}"

    def _steps(self, tmp: Path) -> None:
        repo, venv, home, elsewhere = tmp / "repo", tmp / "venv", tmp / "home", tmp / "elsewhere"
        for d in (home, elsewhere):
            d.mkdir()
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(repo)], check=True,
                       capture_output=True, timeout=STEP_TIMEOUT)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                       capture_output=True, timeout=STEP_TIMEOUT)
        # A user's shell: none of this run's pytest, project or CI settings (under CI a missing tool fails a test
        # instead of skipping it; the clone's venv has only what the README's commands install).
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST", "AMDXDNA", "PYTHON", "VIRTUAL_ENV")) and k != "CI"}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", HOME=str(home),
                   VIRTUAL_ENV=str(venv), PIP_DISABLE_PIP_VERSION_CHECK="1",
                   PYTEST_ADDOPTS="-rs -p no:cacheprovider", **{NESTED: "1"})
        if self.covered:
            listing = tmp / "covered.txt"
            listing.write_text("\n".join(self.covered) + "\n")
            env[COVERED] = str(listing)
        readme = (repo / "README.md").read_text()
        sh_block = re.search(r"```sh\n(.*?)```", readme, flags=re.S)
        py_block = re.search(r"```python\n(.*?)```", readme, flags=re.S)
        if sh_block is None or py_block is None:
            raise RuntimeError("the clone's README.md has no sh block or no python block")
        demo, tests = [line.split("#")[0].strip() for line in sh_block.group(1).splitlines() if line.strip()][:2]
        example = elsewhere / "example.py"
        example.write_text(py_block.group(1))
        # The demo first (what a user types first), the example with what it installed (run outside the clone, so
        # it imports the installed package), then the test command.
        for name, command, cwd in (("demo", demo, repo), ("example", f"python {example}", elsewhere),
                                   ("tests", tests, repo)):
            if self._stopped:
                return
            step = Step(name, command)
            self.steps.append(step)
            self._proc = subprocess.Popen(["bash", "-c", f"set -e; {command}"], cwd=cwd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                out, _ = self._proc.communicate(timeout=STEP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                out, _ = self._proc.communicate()
            step.code, step.output = self._proc.returncode, out.decode("utf-8", "replace")
            if step.code != 0:
                return


def checkout_is_clean() -> bool:
    """True when the checkout is its last commit exactly: nothing modified, staged or untracked (ignored files
    aside), so that what this session runs is what the clone runs."""
    done = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, timeout=120)
    return done.returncode == 0 and not done.stdout.strip()


def covered_here(collected: list[tuple[str, Path]]) -> list[str]:
    """The node ids of ``collected`` (node id, module path) the clone's run need not repeat: none unless the
    checkout is clean; then those of modules that never name the shared folder (``READS_SHARED``)."""
    if not collected or not checkout_is_clean():
        return []
    reads: dict[Path, bool] = {}
    for _, path in collected:
        if path not in reads:
            text = path.read_text(encoding="utf-8", errors="replace")
            reads[path] = path.name == Path(__file__).name or any(word in text for word in READS_SHARED)
    return [node for node, path in collected if not reads[path]]


#: The session's run, started by tests/conftest.py when collection finishes (None: not collected).
RUN: CleanCloneRun | None = None


def start(collected: list[tuple[str, Path]] | None = None) -> None:
    """Start the background run (tests/conftest.py calls this once the session's tests are collected, with
    their node ids and module paths)."""
    global RUN
    if RUN is None:
        RUN = CleanCloneRun()
        RUN.start(collected)


def stop() -> None:
    """End the background run, if any (tests/conftest.py calls this when the session finishes)."""
    if RUN is not None:
        RUN.stop()


def _tail(step: Step, lines: int = 40) -> str:
    """The step's command, its failure lines (pytest's FAILED/ERROR summary, a Traceback's last line) and its end."""
    out = step.output.splitlines()
    failures = [line for line in out if line.startswith(("FAILED ", "ERROR ", "E   "))][:20]
    return "\n".join([f"$ {step.command}", *failures, "...", *out[-lines:]])


def test_a_clean_clone_runs_the_readme_commands_and_example():
    start()  # no-op when conftest started it
    assert RUN is not None
    if RUN.skip:
        pytest.skip(RUN.skip)
    RUN.finish(3 * STEP_TIMEOUT)
    steps = {step.name: step for step in RUN.steps}
    assert RUN.error is None, (RUN.error, [_tail(s) for s in RUN.steps])
    assert list(steps) == ["demo", "example", "tests"], [_tail(s) for s in RUN.steps]
    for step in RUN.steps:
        assert step.code == 0, _tail(step)
    assert steps["demo"].command == "pip install '.[sam3]' && sam3 demo"
    assert "result: OK" in steps["demo"].output, _tail(steps["demo"])
    printed = steps["example"].output.strip().splitlines()[-1]
    assert [int(v) for v in printed.strip("[]").split()] == list(range(16)), _tail(steps["example"])

    output = steps["tests"].output
    summary = re.findall(r"^=* ?(.*\bin [\d.]+s.*?) ?=*$", output, flags=re.M)
    assert summary, _tail(steps["tests"])
    counts = {kind: int(n) for n, kind in re.findall(
        r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed|deselected)", summary[-1])}
    assert counts.get("failed", 0) == counts.get("error", 0) == counts.get("errors", 0) == 0, summary[-1]
    # Only the tests this session covers are left out of the clone's run, each one of them.
    assert counts.get("deselected", 0) == len(RUN.covered), (summary[-1], len(RUN.covered))
    # The fixtures ship in tests/fixtures: only the specification texts stay in ../shared (issue 25: <= 2% skip),
    # counted over the whole suite (the deselected tests are run, and pass, here).
    whole = counts["passed"] + counts.get("skipped", 0) + counts.get("deselected", 0)
    assert counts.get("skipped", 0) <= 0.02 * whole, summary[-1]
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", output, flags=re.M)
    assert sum(int(n) for n in re.findall(r"^SKIPPED \[(\d+)\]", output, flags=re.M)) == counts.get("skipped", 0)
    shared = str(RUN.shared) if RUN.shared is not None else "../shared"
    assert reasons.count(NESTED_SKIP) == 1                                  # this test, in the clone's run
    unexplained = sorted({r for r in reasons if shared not in r and r != NESTED_SKIP and not SKIP_REASONS.search(r)})
    assert not unexplained, unexplained
    # The specification texts are not in the clone: the tests that read them say where they looked.
    assert any("../shared" in r or shared in r for r in reasons), reasons[:5]
