"""docs/troubleshooting.md explains every log line at warning or above the code can write,
at its level, and no line the code no longer writes (the lines: tests/docs/log_lines.py)."""

import ast
import re
from pathlib import Path

import log_lines

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
SECTION = PAGE.split("## Every log line at warning or above", 1)[1]
ROW = re.compile(r"^\| `(.+?)` \| (warning|error|critical) \| (.+?) \| (.+?) \|$", re.M)


def documented() -> dict[str, str]:
    rows = {}
    for template, level, meaning, action in ROW.findall(SECTION):
        assert template not in rows, f"{template!r} is on the page twice"
        assert meaning.strip() and action.strip(), template
        rows[template] = level
    return rows


def test_the_scan_finds_the_log_calls_and_their_templates():
    lines = log_lines.log_lines()
    assert len(lines) > 80, len(lines)
    levels = {line.level for line in lines}
    assert levels == {"warning", "error"}, levels
    # The reduction an operator reads: fixed text, "…" for each value.
    call = ast.parse('log.warning("pod %s/%s: %.1fs, %d%% (%r)", a, b, c, d, e)').body[0]
    assert log_lines.template(call.value.args[0]) == "pod …/…: …s, …% (…)"
    fstring = ast.parse('f"link {name} broken ({error!r})"').body[0].value
    assert log_lines.template(fstring) == "link … broken (…)"


def test_every_log_line_is_explained_at_its_level():
    rows = documented()
    missing = sorted({f"{line.level}: {line.template}   ({line.where})"
                      for line in log_lines.log_lines() if line.template not in rows})
    assert missing == [], "log lines docs/troubleshooting.md does not explain"
    wrong = sorted({f"{line.template}: {rows[line.template]} on the page, {line.level} in "
                    f"{line.where}" for line in log_lines.log_lines()
                    if rows[line.template] != line.level})
    assert wrong == []


def test_every_line_on_the_page_is_still_logged():
    logged = {line.template for line in log_lines.log_lines()}
    assert sorted(set(documented()) - logged) == [], "lines the code no longer logs"


def test_the_start_failures_quoted_are_what_the_agent_says(capsys):
    """The page's examples of a bad start, asked of the agent's own command line."""
    from kiamfast.cli import main
    from kiamfast.kube.cluster import NO_CLUSTER
    page = " ".join(PAGE.split("## The agent does not start", 1)[1].split("\n## ")[0].split())
    for argv in (["--workers", "0"], ["--iptables", "false"]):
        assert main(argv) == 2
        said = capsys.readouterr().err.strip()
        assert len(said.splitlines()) == 1 and f"`{said}`" in page, (argv, said)
    assert f"`cannot start: {NO_CLUSTER}`" in page
