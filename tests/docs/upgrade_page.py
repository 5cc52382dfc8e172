"""The commands of docs/upgrade-and-rollback.md, as the tests run them.

Every ``sh`` block of the page follows a marker naming it, ``<!-- commands: NAME -->``. A
test that runs a block takes it from here by name (:func:`commands` for one-line commands,
:func:`script` for a block run as a shell script), with the page's placeholders
(``<release>``, ``<namespace>``, ...) filled in; tests/docs/test_upgrade_page.py checks that
every block is named and that the test its name is registered with asks for it, so no
command on the page goes unrun.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "upgrade-and-rollback.md"
MARKED = re.compile(r"<!-- commands: ([a-z0-9-]+) -->\n```sh\n(.*?)```", re.S)
PLACEHOLDER = re.compile(r"<[a-z][a-z0-9-]*(?:\.yaml)?>")


def blocks(text: str | None = None) -> dict[str, str]:
    """Name -> the block's text, for every marked block of the page."""
    found: dict[str, str] = {}
    for name, body in MARKED.findall(PAGE.read_text() if text is None else text):
        assert name not in found, f"two blocks are named {name}"
        found[name] = body
    return found


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``<placeholder>`` replaced; every one must have a value."""
    out = PLACEHOLDER.sub(lambda m: values.get(m.group(0), m.group(0)), text)
    left = PLACEHOLDER.findall(out)
    assert not left, f"no value for {left} in {text!r}"
    return out


def commands(name: str, values: dict[str, str]) -> list[list[str]]:
    """The block's commands (comments skipped, ``\\`` continuations joined), each as the
    argv a shell would run, placeholders filled."""
    out, current = [], ""
    for raw in blocks()[name].splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(shlex.split(fill(current + line, values)))
        current = ""
    assert out, f"block {name} has no command"
    return out


def script(name: str, values: dict[str, str]) -> str:
    """The whole block as a shell script, placeholders filled."""
    return fill(blocks()[name], values)
