"""How ``kiamfast demo`` talks to a person: progress lines, the pod table, the races, a verdict.

Why it exists: the demo is the README's first command, read by someone who has never seen
kiamfast. It must say what it is doing while it starts (each step on one line with how long
it took), then show in one aligned table what every pod asked for and what it really got,
then tell the two race stories in a sentence each with their outcome, and end with one line
that says whether everything was right.

Plain text with optional colour (only on a terminal, never with ``NO_COLOR`` or
``--no-color``) and ✓/✗ marks (ASCII stand-ins when the stream cannot encode them). No
cursor tricks: the output reads the same in a terminal, a log or a CI transcript.

This module only formats; it decides nothing (see :mod:`kiamfast.demo.check`).
"""

from __future__ import annotations

import contextlib
import os
import textwrap
import time
from dataclasses import dataclass
from typing import Iterator, TextIO

__all__ = ["Step", "Ui", "fmt_ms"]


@dataclass
class Step:
    """One startup step as shown and as reported in ``--json``."""

    name: str
    ok: bool = False
    ms: float = 0.0
    detail: str = ""


_STYLES = {"ok": "\033[32m", "bad": "\033[31;1m", "dim": "\033[2m", "bold": "\033[1m",
           "warn": "\033[33m"}
_RESET = "\033[0m"


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    if ms >= 10:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms"


class Ui:
    """Writes the demo's human output to ``stream``."""

    def __init__(self, stream: TextIO, *, color: bool | None = None) -> None:
        self.stream = stream
        if color is None:
            color = stream.isatty() and not os.environ.get("NO_COLOR") \
                and os.environ.get("TERM") != "dumb"
        self.color = color
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "✓✗…—↳".encode(encoding)
            self.unicode = True
        except (UnicodeEncodeError, LookupError):
            self.unicode = False
        self.steps: list[Step] = []

    # ------------------------------------------------------------------ primitives

    @property
    def tick(self) -> str:
        return "✓" if self.unicode else "ok"

    @property
    def cross(self) -> str:
        return "✗" if self.unicode else "XX"

    def mark(self, ok: bool) -> str:
        return self.paint(self.tick if ok else self.cross, "ok" if ok else "bad")

    def paint(self, text: str, style: str) -> str:
        if not self.color or not style:
            return text
        return f"{_STYLES[style]}{text}{_RESET}"

    def text(self, s: str) -> str:
        if self.unicode:
            return s
        return (s.replace("…", "...").replace("—", "-").replace("↳", "->")
                .replace("✓", "ok").replace("✗", "XX"))

    def write(self, s: str = "", style: str = "") -> None:
        self.stream.write(self.paint(self.text(s), style) + "\n")
        self.stream.flush()

    # ------------------------------------------------------------------ sections

    def para(self, s: str, *, indent: str = "  ", style: str = "dim",
             width: int = 92) -> None:
        """A paragraph wrapped to ``width`` columns."""
        for line in textwrap.wrap(self.text(s), width=width - len(indent)):
            self.write(indent + line, style)

    def title(self, s: str) -> None:
        self.write()
        self.write(s, "bold")

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[Step]:
        """``  starting X… ok (12 ms)`` around the block; ``FAILED`` if it raises."""
        step = Step(name)
        self.steps.append(step)
        self.stream.write(self.text(f"  {name}… "))
        self.stream.flush()
        started = time.perf_counter()
        try:
            yield step
        except BaseException:
            step.ms = (time.perf_counter() - started) * 1000
            self.stream.write(self.paint("FAILED", "bad")
                              + self.paint(f" ({fmt_ms(step.ms)})", "dim") + "\n")
            self.stream.flush()
            raise
        step.ms = (time.perf_counter() - started) * 1000
        step.ok = True
        detail = f", {step.detail}" if step.detail else ""
        self.stream.write(self.paint("ok", "ok")
                          + self.paint(self.text(f" ({fmt_ms(step.ms)}{detail})"), "dim")
                          + "\n")
        self.stream.flush()

    def table(self, header: list[str], rows: list[list[str]], *, marks: list[bool],
              styles: list[list[str]], right: set[int] = frozenset(),
              notes: list[str | tuple[str, str] | None]) -> None:
        """Aligned columns, each row led by its ✓/✗ mark; ``notes[i]`` (text, or (text,
        style)) goes on a line of its own under row i, below the second column."""
        widths = [len(self.text(h)) for h in header]
        for row in rows:
            for i, t in enumerate(row):
                widths[i] = max(widths[i], len(self.text(t)))
        gap = "   "
        mark_width = len(self.tick)
        lead = "  " + " " * mark_width + " "
        self.write(lead + gap.join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
                   "bold")
        for row, ok, style, note in zip(rows, marks, styles, notes):
            cells = []
            for i, t in enumerate(row):
                t = self.text(t)
                t = t.rjust(widths[i]) if i in right else t.ljust(widths[i])
                cells.append(self.paint(t, style[i]))
            self.stream.write("  " + self.mark(ok).ljust(mark_width) + " "
                              + gap.join(cells).rstrip() + "\n")
            if note:
                text, st = (note, "dim") if isinstance(note, str) else note
                self.stream.write(lead + " " * (widths[0] + len(gap))
                                  + self.paint(self.text(f"↳ {text}"), st) + "\n")
        self.stream.flush()

    def check_line(self, ok: bool, text: str, *, problem: str | None = None,
                   indent: str = "  ") -> None:
        line = f"{indent}{self.mark(ok)} {self.text(text)}"
        if problem:
            line += self.paint(self.text(f" — {problem}"), "bad")
        self.stream.write(line + "\n")
        self.stream.flush()

    def summary(self, ok: bool, text: str) -> None:
        self.write()
        self.stream.write(self.mark(ok) + " " + self.paint(self.text(text), "bold") + "\n")
        self.stream.flush()


