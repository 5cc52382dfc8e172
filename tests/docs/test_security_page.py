"""docs/security.md's limits are the code's: every row of its limit tables names the constants
it quotes, and each constant's value is among the row's figures."""

import importlib
import re
from pathlib import Path

from kiamfast.server.settings import WorkerSettings

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
SECTION = PAGE.split("## Every limit, and why", 1)[1]


def limit_rows() -> list[tuple[str, list[str]]]:
    """(the row's text but its last cell, the constants of its last cell)."""
    rows = []
    for line in SECTION.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"`[\w.]+`(, `\w+`)*", cells[-1]):
            rows.append((" | ".join(cells[:-1]), re.findall(r"`([\w.]+)`", cells[-1])))
    return rows


def value(dotted: str, module: str | None) -> object:
    if "." not in dotted:                 # a name of the previous one's module
        return getattr(importlib.import_module(f"kiamfast.{module}"), dotted)
    path, name = dotted.rsplit(".", 1)
    if path.endswith("WorkerSettings"):
        return getattr(WorkerSettings(), name)
    return getattr(importlib.import_module(f"kiamfast.{path}"), name)


def test_every_limit_quoted_is_the_value_in_the_code():
    rows = limit_rows()
    assert len(rows) >= 25, rows
    for text, names in rows:
        figures = {float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)}
        module = names[0].rsplit(".", 1)[0]
        for name in names:
            got = value(name, module)
            assert float(got) in figures, f"{name} is {got}, the page says: {text}"
