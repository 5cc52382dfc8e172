"""docs/architecture.md's "To change X, edit Y" table names files and names that exist: a
move or a rename that leaves it behind fails here, not in a newcomer's hands."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROL = ROOT / "kiamfast" / "control"
TOP = ("kiamfast/", "ext/", "deploy/", "docs/", "bench/", "tests/")


def rows() -> list[tuple[str, list[str]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("### To change X, edit Y"):]
    table = table[:table.index("\n\n", table.index("| to change | edit |"))]
    out = []
    for line in table.splitlines():
        cells = line.split("|")
        if len(cells) == 4 and cells[1].strip() not in ("to change", "---"):
            out.append((cells[1].strip(), re.findall(r"`([^`]+)`", cells[2])))
    return out


def is_path(token: str) -> bool:
    return "/" in token or token.endswith((".py", ".pyx", ".yaml", ".md"))


def resolve(token: str) -> Path:
    return ROOT / token if token.startswith(TOP) else CONTROL / token


def sources(paths: list[Path]) -> str:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    return "\n".join(f.read_text() for f in files)


def test_every_row_names_files_that_exist_and_names_found_in_them():
    table = rows()
    assert len(table) >= 15, table
    problems = []
    for what, tokens in table:
        paths = [resolve(t) for t in tokens if is_path(t)]
        problems += [f"{what}: {p.relative_to(ROOT)} does not exist" for p in paths
                     if not p.exists()]
        text = sources([p for p in paths if p.exists()])
        for name in (t for t in tokens if not is_path(t) and not t.startswith("-")):
            for part in name.split("."):
                if not re.search(rf"\b{re.escape(part)}\b", text):
                    problems.append(f"{what}: `{name}` is in none of its files")
    assert problems == []


def test_the_check_catches_a_stale_row(monkeypatch):
    assert not resolve("cri/routes.py").exists()          # issue 40 deleted it
    assert resolve("cri/client.py").exists()
    assert not re.search(r"\bNoSuchName\b", sources([resolve("cri/client.py")]))
