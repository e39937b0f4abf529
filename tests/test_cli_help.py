"""--help of every subcommand, and one exit-code rule for all of them.

The rule (docs/cli.md, each subcommand's epilog): 0 success; 1 failure, which includes an input file that
cannot be read or is malformed (xclbin, instruction stream, .npy) and an output that cannot be written;
2 usage error (the command line itself is wrong). Oracles: argparse's own option table (every option must
appear in the help with its meaning and default), the README, and files malformed on purpose.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
import test_cli_isolation

from amdxdna_direct.cli import build_parser, main

# Every test here runs under the guard: no file of the real system is read (test_cli_isolation).
no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")

DEVICE_COMMANDS = ("info", "top", "doctor", "validate", "configure", "run", "trace")
OPTION_DOCUMENTED = ("info", "top", "doctor", "validate", "configure")  # docs/cli.md lists these options one by one
README_COMMANDS = ("info", "doctor", "run", "trace", "xclbin", "insts")  # the README's table (docs/cli.md: all)
FILE_COMMANDS = ("xclbin", "insts")
README = Path(__file__).resolve().parents[1] / "README.md"
CLI_DOC = Path(__file__).resolve().parents[1] / "docs/cli.md"
NPU1_1COL = Path(__file__).resolve().parent / "fixtures/xdna/mlir-aie-npu1_1col"
needs_fixture = pytest.mark.skipif(not (NPU1_1COL / "aie.xclbin").exists(), reason=f"fixtures absent: {NPU1_1COL}")


def subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("name", DEVICE_COMMANDS)
def test_help_lists_every_option_with_meaning_and_default(name, capsys):
    assert main([name, "--help"]) == 0
    text = capsys.readouterr().out
    parser = subparser(name)
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert options, name
    for action in options:
        assert all(flag in text for flag in action.option_strings), action.option_strings
        assert action.help and len(action.help) > 20, action.option_strings
        if not action.required:
            assert "default" in action.help, f"{name} {action.option_strings[0]} does not state its default"
    assert "--device" in text and "--json" in text  # --device everywhere, --json where the output is data
    assert "exit codes:" in text
    assert re.search(r"^  1 +\S", text, re.MULTILINE) and re.search(r"^  2 +usage error", text, re.MULTILINE)


@pytest.mark.parametrize("name", DEVICE_COMMANDS + FILE_COMMANDS)
def test_listed_in_the_top_level_help_and_documented(name, capsys):
    assert main(["--help"]) == 0
    assert re.search(rf"^    {name} +\S", capsys.readouterr().out, re.MULTILINE)  # with its one-line summary
    # Device commands have a section of docs/cli.md; the file commands are named in its introduction.
    assert (f"`amdxdna {name}`" if name in FILE_COMMANDS else f"### `amdxdna {name}") in CLI_DOC.read_text()
    if name in README_COMMANDS:
        readme = README.read_text()
        section = readme[readme.index("## The command line"):]
        section = section[:section.index("\n## ")]
        assert f"`amdxdna {name}" in section


def test_every_option_of_every_command_is_in_the_cli_doc():
    doc = CLI_DOC.read_text()
    for name in OPTION_DOCUMENTED:
        section = doc[doc.index(f"### `amdxdna {name}`"):]
        section = section[:section.find("\n### ", 1) if "\n### " in section[1:] else len(section)]
        options = [a for a in subparser(name)._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        missing = [a.option_strings[-1] for a in options if f"`{a.option_strings[-1]}" not in section]
        assert missing == [], f"docs/cli.md `amdxdna {name}` lacks {missing}"


@pytest.mark.parametrize("name", FILE_COMMANDS + ("run",))
def test_epilog_says_a_malformed_file_exits_1(name):
    epilog = subparser(name).epilog
    line_1 = epilog[epilog.index("\n  1 "):epilog.index("\n  2 ")]
    assert "cannot be read" in line_1 and ("malformed" in line_1 or "not a valid" in line_1)


def test_unknown_option_and_missing_command_exit_2(capsys):
    for argv in (["frobnicate"], [], *([name, "--no-such-option"] for name in DEVICE_COMMANDS + FILE_COMMANDS)):
        assert main(argv) == 2, argv
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


@needs_fixture
def test_a_malformed_input_file_exits_1_in_every_command(tmp_path, capsys):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00\x01\x03")  # neither an axlf header nor whole 32-bit words
    good_xclbin, good_insts = str(NPU1_1COL / "aie.xclbin"), str(NPU1_1COL / "insts.bin")
    runs = {
        "xclbin": ["xclbin", str(bad)],
        "insts": ["insts", str(bad)],
        "run --xclbin": ["run", "--device", "emu:npu1", "--xclbin", str(bad), "--insts", good_insts],
        "run --insts": ["run", "--device", "emu:npu1", "--xclbin", good_xclbin, "--insts", str(bad)],
        "run --in": ["run", "--device", "emu:npu1", "--model", "passthrough", "--xclbin", good_xclbin,
                     "--insts", good_insts, "--in", str(bad), "--out", str(tmp_path / "o.npy")],
        "doctor --xclbin": ["doctor", "--device", "emu:npu1", "--root", str(tmp_path), "--xclbin", str(bad),
                            "--insts", good_insts],
    }
    codes = {what: main(argv) for what, argv in runs.items()}
    assert codes == dict.fromkeys(runs, 1)
    capsys.readouterr()
    missing = str(tmp_path / "missing")
    assert [main(["xclbin", missing]), main(["insts", missing]),
            main(["run", "--device", "emu:npu1", "--xclbin", missing, "--insts", good_insts])] == [1, 1, 1]
    assert capsys.readouterr().err.count("ENOENT") == 3


def test_trace_exit_status_is_the_programs(capsys):
    assert main(["trace", "--no-log", "--", sys.executable, "-c", "raise SystemExit(7)"]) == 7
    assert "exited with status 7" in capsys.readouterr().out


def test_the_top_level_help_imports_no_subcommand():
    # issue 14: `amdxdna --help` lists the commands from the registry alone, and imports neither numpy nor cffi
    # (the package's names load on first use). Oracle: sys.modules after the help, against a bare
    # `import amdxdna_direct` in the same kind of process.
    probe = ("import sys, contextlib, io\n"
             "base = set(sys.modules)\n"
             "from amdxdna_direct.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    code = main(['--help'])\n"
             "new = set(sys.modules) - base\n"
             "print(code, sorted(m for m in new if m.startswith('amdxdna_direct.')),"
             " sorted(m for m in new if m.split('.')[0] in ('numpy', 'cffi', 'ml_dtypes')))\n")
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import amdxdna_direct\n" + probe], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 ['amdxdna_direct.cli', 'amdxdna_direct.errors', 'amdxdna_direct.files'] []"


def test_the_lazy_help_is_the_full_parsers_help(capsys):
    from amdxdna_direct.cli import COMMANDS

    assert main(["--help"]) == 0
    lazy = capsys.readouterr().out
    assert lazy == build_parser().format_help()
    assert list(COMMANDS) == ["xclbin", "insts", *(n for n in COMMANDS if n not in FILE_COMMANDS)]
    for name, (_, summary) in COMMANDS.items():
        assert subparser(name).description and f"    {name}" in lazy and summary.split()[0] in lazy


def test_the_cli_doc_covers_every_command_and_points_to_the_sam3_doc():
    from amdxdna_direct.cli import COMMANDS

    doc = CLI_DOC.read_text()
    assert all(f"### `amdxdna {name}" in doc for name in COMMANDS)
    assert "docs/sam3-cli.md" in doc and "### Conventions" in doc and "### Logging" in doc


def test_version_is_printed_on_stdout(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("amdxdna (amdxdna-direct) ")


def test_a_usage_error_is_one_line_naming_the_command_and_a_json_error_with_json(capsys):
    assert main(["info", "--nope"]) == 2
    assert capsys.readouterr().err == ("amdxdna info: error: unrecognized arguments: --nope "
                                       "(see `amdxdna info --help`)\n")
    assert main(["run", "--json", "--repeat", "x"]) == 2
    out, err = capsys.readouterr()
    import json

    assert json.loads(out) == {"schema": 1, "command": "run", "ok": False,
                               "error": "argument --repeat: invalid int value: 'x'"}
    assert err == "amdxdna run: error: argument --repeat: invalid int value: 'x' (see `amdxdna run --help`)\n"
