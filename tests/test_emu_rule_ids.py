"""Every rule ID sits at the code that enforces it (``grep -rn 'rule E4' amdxdna_direct/emu`` lands there), and the
rule tables of docs/driver-rules.md and docs/emulator.md name exactly the IDs the code cites, both ways."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMU = ROOT / "amdxdna_direct" / "emu"
RULE_ID = re.compile(r"\b[Rr]ule ([DHBEI]\d{1,2}|\d{2})\b")


def doc_rules() -> dict[str, set[str]]:
    """Rule ID -> the emulator files its "modelled in" cell of docs/emulator.md names."""
    doc = (ROOT / "docs" / "emulator.md").read_text()
    rows = re.findall(r"^\| ((?:[DHBEI])?\d+) [^|]*\|([^|]*)\|[^|]*\|$", doc, re.M)
    return {rule: set(re.findall(r"(\w+\.py)", cell)) for rule, cell in rows}


def lettered_rules() -> list[str]:
    """The rule lines of docs/driver-rules.md (``- E4 ...``)."""
    return re.findall(r"^- ([DHBEI]\d{1,2}) ", (ROOT / "docs" / "driver-rules.md").read_text(), re.M)


def code_rules() -> dict[str, set[str]]:
    """Rule ID -> the emulator files whose text cites it as ``rule <ID>``."""
    found: dict[str, set[str]] = {}
    for path in sorted(EMU.glob("*.py")):
        for rule in RULE_ID.findall(path.read_text()):
            found.setdefault(rule, set()).add(path.name)
    return found


def test_driver_rules_and_the_emulator_table_list_the_same_49_rules():
    lettered = lettered_rules()
    assert len(lettered) == len(set(lettered)) == 49
    table = doc_rules()
    assert {r for r in table if not r.isdigit()} == set(lettered)
    assert {r for r in table if r.isdigit()} == {str(n) for n in range(50, 57)}


def test_every_documented_rule_is_cited_in_the_code():
    missing = sorted(set(doc_rules()) - set(code_rules()))
    assert missing == [], f"rules of the docs that no emulator file cites as 'rule <ID>': {missing}"


def test_every_rule_the_code_cites_is_documented():
    unknown = sorted(set(code_rules()) - set(doc_rules()))
    assert unknown == [], f"'rule <ID>' in the emulator that no docs table has: {unknown}"


def test_each_rule_is_cited_in_a_file_its_row_names():
    cited = code_rules()
    astray = {rule: (sorted(files), sorted(cited.get(rule, ()))) for rule, files in doc_rules().items()
              if files and not files & cited.get(rule, set())}
    assert astray == {}, f"rule: (files the table names, files citing it): {astray}"


def test_the_id_pattern_reads_what_the_code_writes():
    assert RULE_ID.findall("# rule E4: an unknown arg (docs/driver-rules.md)") == ["E4"]
    assert RULE_ID.findall('"""Rule 51 (inferred)') == ["51"]
    assert RULE_ID.findall("rules H1-H14, E12x, rule E123") == []
