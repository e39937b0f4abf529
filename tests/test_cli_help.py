"""--help of info, doctor, run and trace: every option explained with its default, exit codes in the epilog."""

from __future__ import annotations

import argparse
import re

import pytest

from amdxdna_direct.cli import build_parser, main

COMMANDS = ("info", "doctor", "run", "trace")


def subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("name", COMMANDS)
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
    assert "--device" in text  # --device everywhere (issue 6)
    assert "exit codes:" in text
    assert re.search(r"^  1 +\S", text, re.MULTILINE) and re.search(r"^  2 +usage error", text, re.MULTILINE)


@pytest.mark.parametrize("name", COMMANDS)
def test_listed_in_the_top_level_help(name, capsys):
    assert main(["--help"]) == 0
    assert f"    {name} " in capsys.readouterr().out


def test_json_wherever_output_is_data():
    for name in COMMANDS:
        assert "--json" in subparser(name)._option_string_actions, name
