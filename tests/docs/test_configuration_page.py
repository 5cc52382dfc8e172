"""docs/configuration.md's flag table is the one the flag definitions make, and the one
``kiamfast --help`` shows."""

import re
from pathlib import Path

import flag_reference
from kiamfast.cli import main, render_flag_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_flag_table_is_generated_from_the_flag_definitions():
    assert flag_reference.page_table(PAGE.read_text()) == render_flag_reference().strip("\n"), (
        "docs/configuration.md's flag table is stale: python3 tests/docs/flag_reference.py "
        "--update")


def test_kiamfast_help_lists_the_flags_of_the_table_in_its_order(capsys):
    assert main(["--help"]) == 0
    shown = re.findall(r"^  --([a-z0-9-]+)", capsys.readouterr().out, re.M)
    names = re.findall(r"^\| `--([a-z0-9-]+)` \|", flag_reference.page_table(PAGE.read_text()),
                       re.M)
    assert shown == names


def test_the_exit_codes_are_listed_in_one_place_with_the_codes_the_agent_uses():
    from kiamfast.config import EXIT_CONFIG
    section = PAGE.read_text().split("## Exit codes", 1)[1]
    codes = re.findall(r"^\| `(\d+)` \|", section, re.M)
    assert codes == ["0", "1", "2", f"{EXIT_CONFIG}"]
    assert "no cluster configured" in section
