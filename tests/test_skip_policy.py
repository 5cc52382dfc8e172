"""The skip policy of tests/conftest.py, tried on a tiny pytest session of its own.

A real pytest runs in a subprocess on a temporary directory holding a copy of the suite's
root conftest and test files that skip in every way pytest allows (a call to pytest.skip, a
skipif mark, a skipping fixture, a module that skips as a whole, an xfail). With CI=true
the session must fail and show each reason; without it the same session passes.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

TESTS = textwrap.dedent('''
    import pytest

    @pytest.fixture
    def tool():
        pytest.skip("needs frobnicator-in-fixture")

    def test_passes():
        assert True

    def test_skips_in_body():
        pytest.skip("needs frobnicator-in-body")

    @pytest.mark.skipif(True, reason="needs frobnicator-in-mark")
    def test_skips_by_mark():
        pass

    def test_skips_in_fixture(tool):
        pass

    @pytest.mark.xfail(reason="frobnicator-xfail")
    def test_xfails():
        assert False
''')

MODULE_SKIP = textwrap.dedent('''
    import pytest
    pytest.skip("needs frobnicator-module", allow_module_level=True)

    def test_never_collected():
        pass
''')

REASONS = ("frobnicator-in-body", "frobnicator-in-mark", "frobnicator-in-fixture",
           "frobnicator-xfail", "frobnicator-module")


@pytest.fixture
def session_dir(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_tiny.py").write_text(TESTS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    return tmp_path


def run_pytest(where: Path, *, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"   # only pytest and the conftest under test
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                           "--continue-on-collection-errors", str(where)],
                          cwd=where, env=env, capture_output=True, text=True, timeout=120)


def tally_of(out: str) -> dict[str, int]:
    """The final line's counts: "2 failed, 1 passed, 3 errors in 0.02s" -> {...}."""
    last = out.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) ([a-z]+)", last)}


def test_in_ci_every_skip_fails_the_run_with_its_reason(session_dir):
    p = run_pytest(session_dir, ci=True)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    summary = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    for reason in REASONS:   # each skip is reported as a failure that gives its reason
        assert any(reason in line for line in summary), (reason, out)
    tally = tally_of(out)
    assert tally.get("passed") == 1 and tally.get("skipped", 0) == 0, out
    failures = tally.get("failed", 0) + tally.get("errors", 0) + tally.get("error", 0)
    assert failures == len(REASONS), out


def test_outside_ci_skips_stay_skips(session_dir):
    p = run_pytest(session_dir, ci=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert tally_of(out) == {"passed": 1, "skipped": 4, "xfailed": 1}, out
