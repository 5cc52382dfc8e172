"""docs/upgrade-and-rollback.md shows no command that no test runs.

Every ``sh`` block of the page is named (``<!-- commands: NAME -->``, tests/docs/
upgrade_page.py), every name is registered below with the test module that runs it, and
that module asks for the block by name: a block added, renamed or dropped on either side
fails here. The commands themselves run in tests/k8s/test_chart_upgrade_and_rollback.py
against the real API server, controllers and kubelet, with the page's placeholders filled
in.
"""
import re
from pathlib import Path

import upgrade_page

ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS = ROOT / "tests" / "k8s" / "test_chart_upgrade_and_rollback.py"
RUN_BY = {
    "upgrade": ROLLOUTS,
    "rolling": ROLLOUTS,
    "on-delete": ROLLOUTS,
    "switch": ROLLOUTS,
    "rollback": ROLLOUTS,
    "untaint": ROLLOUTS,
    "rollback-to-kube2iam": ROLLOUTS,
    "node-cleanup": ROLLOUTS,
}


def test_every_shell_block_of_the_page_is_named():
    text = upgrade_page.PAGE.read_text()
    assert text.count("```sh") == len(upgrade_page.blocks()), \
        "a ```sh block without <!-- commands: NAME --> right before it"


def test_every_block_is_run_by_the_test_registered_for_it():
    assert set(upgrade_page.blocks()) == set(RUN_BY)
    for name, module in RUN_BY.items():
        source = module.read_text()
        assert re.search(r'(run_page\(control, |script\()"%s"' % re.escape(name), source), \
            f"{module.name} does not run the page's {name} block"


def test_every_placeholder_is_one_the_tests_fill():
    known = {"<release>", "<namespace>", "<your-values.yaml>", "<daemonset>", "<node>",
             "<revision>", "<name>", "<chart>"}
    for name, body in upgrade_page.blocks().items():
        assert set(upgrade_page.PLACEHOLDER.findall(body)) <= known, name


def test_the_on_delete_commands_are_the_install_notes():
    # The chart's notes print the same commands with the release's names (an explicit
    # OnDelete: tests/deploy/test_chart_switch.py renders them).
    notes = (ROOT / "deploy" / "chart" / "kiamfast" / "templates" / "_notes.tpl").read_text()
    for argv in upgrade_page.commands("on-delete", {
            "<namespace>": "NS", "<node>": "NODE", "<release>": "REL", "<name>": "NAME"}):
        line = " ".join(argv).replace("-n NS", "--namespace NS")
        template = line.replace("NS", "{{ .Release.Namespace }}").replace(
            "REL", "{{ .Release.Name }}").replace("NAME", '{{ include "kiamfast.name" . }}'
                                                  ).replace("NODE", "<node>")
        assert template in notes, line
