"""The README's promises that can drift: its commands and its configuration reference."""

import os
import re
from pathlib import Path

from kiamfast.cli import render_flag_reference

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_configuration_reference_is_generated_from_the_cli():
    section = re.search(r"<!-- flag-reference:start -->\n(.*?)\n<!-- flag-reference:end -->",
                        README, re.S)
    assert section, "README lost its flag-reference markers"
    assert section.group(1).strip() == render_flag_reference().strip(), (
        "README's configuration reference is stale: regenerate it from "
        "kiamfast.cli.render_flag_reference()")


def test_readme_opens_with_the_demo_and_the_test_command():
    block = re.search(r"```sh\n(.*?)```", README, re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands[0] == "pip install -e '.[demo]' && kiamfast demo"
    assert commands[1] == "tests/run"   # sets up what the tests need, then runs pytest
    assert os.access(ROOT / "tests" / "run", os.X_OK)


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tests/run" in ci.splitlines()
