"""Every log line at warning or above the agent's code can write, as an operator reads it.

The calls are found in the source (``<logger>.warning/error/critical/exception(...)`` and
``<logger>.log(logging.WARNING ...)``), and each message is reduced to its template: the
fixed text, with ``…`` where a value is filled in. docs/troubleshooting.md lists each one
(tests/docs/test_troubleshooting_page.py).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kiamfast"
LEVELS = {"warning": "warning", "warn": "warning", "error": "error", "exception": "error",
          "critical": "critical", "fatal": "critical"}
PLACEHOLDER = re.compile(r"%(?:\([a-z_]+\))?[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[sdrifxXeEgG]")
# A message that is a value only: the text that value is made from (file, attribute set).
WHOLE_VALUE = {("control/cri/source.py", "self.link.broken"): ("control/cri/link.py",
                                                                 "self.broken")}


@dataclass(frozen=True)
class LogLine:
    where: str       # path under kiamfast/ and line
    level: str       # warning, error or critical
    template: str    # the fixed text, "…" for each value


def template(node: ast.expr) -> str | None:
    """The fixed text of a message expression, ``…`` for what is filled in; None when it has
    no fixed text at all."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = PLACEHOLDER.sub("…", node.value).replace("%%", "%")
    elif isinstance(node, ast.JoinedStr):
        text = "".join(part.value if isinstance(part, ast.Constant) else "…"
                       for part in node.values)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = template(node.left), template(node.right)
        text = (left or "…") + (right or "…")
    else:
        return None
    return None if not text.strip("… ") else text


def _assigned_text(path: Path, target: str) -> str:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == target for t in node.targets):
            text = template(node.value)
            if text:
                return text
    raise AssertionError(f"{path}: no text assigned to {target}")


def _level(call: ast.Call) -> str | None:
    name = call.func.attr    # type: ignore[attr-defined]
    if name in LEVELS:
        return LEVELS[name]
    if name == "log" and call.args:
        first = ast.unparse(call.args[0])   # e.g. "logging.WARNING if loud else logging.DEBUG"
        for level in ("CRITICAL", "ERROR", "WARNING"):
            if level in first:
                return level.lower()
    return None


def log_lines() -> list[LogLine]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and ast.unparse(node.func.value).lower().endswith(("log", "logger"))):
                continue
            level = _level(node)
            if level is None:
                continue
            args = node.args[1:] if node.func.attr == "log" else node.args
            assert args, f"{rel}:{node.lineno}: a log call without a message"
            text = template(args[0])
            if text is None and args[0:2] and ast.unparse(args[0]) in ("'%s'", '"%s"'):
                source = WHOLE_VALUE.get((rel, ast.unparse(args[1])))
                assert source, f"{rel}:{node.lineno}: a message that is a value only"
                text = _assigned_text(PACKAGE / source[0], source[1])
            assert text, f"{rel}:{node.lineno}: a message with no fixed text"
            found.append(LogLine(f"{rel}:{node.lineno}", level, text))
    return found


if __name__ == "__main__":
    for line in log_lines():
        print(f"{line.where}\t{line.level}\t{line.template}")
