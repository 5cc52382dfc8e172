"""docs/configuration.md's flag table, generated from the agent's own flag definitions
(``kiamfast.config.FLAGS`` through ``kiamfast.cli.render_flag_reference``).

    python3 tests/docs/flag_reference.py --update   # rewrite the table after a flag change

tests/docs/test_configuration_page.py fails when the page's table is not the one this makes.
"""
from __future__ import annotations

import sys
from pathlib import Path

from kiamfast.cli import render_flag_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
START = "<!-- flag-reference:start -->"
END = "<!-- flag-reference:end -->"


def page_table(page: str) -> str:
    start, end = page.index(START), page.index(END)
    return page[start + len(START):end].strip("\n")


def with_table(page: str, table: str) -> str:
    start, end = page.index(START), page.index(END)
    return page[:start + len(START)] + "\n" + table.strip("\n") + "\n" + page[end:]


def main(argv: list[str]) -> int:
    if argv != ["--update"]:
        sys.stderr.write("usage: flag_reference.py --update\n")
        return 2
    PAGE.write_text(with_table(PAGE.read_text(), render_flag_reference()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
