"""Every command of the docs' ``sh`` blocks (README.md, deploy/README.md, docs/*.md) is
checked: run here where it can run (the values files are written by their own heredocs, the
``curl`` lines asked of a running agent), rendered where it needs a cluster (``helm install``
and ``helm upgrade`` by the real ``helm template``, ``kubectl apply -k`` by the kustomize
renderer of tests/deploy), or run by the test named for it (which must exist and run it). A
new command that none of these covers fails the test, as does one that no longer works.
The commands in the tables of docs/performance.md are checked to name real benchmarks.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "deploy"))
from kustomize_lite import render as kustomize  # noqa: E402
from test_chart import helm  # noqa: E402   (the real helm; skips, naming its build, without it)

# docs/upgrade-and-rollback.md's blocks are run, each by name, on a real kubelet node
# (tests/docs/test_upgrade_page.py checks every block has its runner).
RUN_BY_NAME = ROOT / "docs" / "upgrade-and-rollback.md"
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md",
         *sorted(p for p in (ROOT / "docs").glob("*.md") if p != RUN_BY_NAME)]
# A kube2iam user's values file, for the switch commands' `<your-values.yaml>`.
KUBE2IAM_VALUES = ROOT / "tests" / "deploy" / "kube2iam-values" / "default.yaml"
PLACEHOLDERS = {"<release>": "kube2iam", "<namespace>": "kube-system",
                "<your-values.yaml>": str(KUBE2IAM_VALUES),
                "kube2iam-values.yaml": str(KUBE2IAM_VALUES)}

# Commands another test runs as written (the file, and what in it shows it does).
ELSEWHERE = {
    "pip install -e '.[demo]' && kiamfast demo": ("tests/demo/test_demo_run.py", '"demo"'),
    "tests/run": (".ci/run", "tests/run"),
    "iptables -t nat -S PREROUTING": ("tests/k8s/test_chart_install.py", "removal_commands"),
    "rm -rf /run/kiamfast": ("tests/k8s/test_chart_install.py", "removal_commands"),
    # the backstop's removal loop (install.md's block, run whole by the same test)
    "for chain in INPUT FORWARD; do": ("tests/k8s/test_chart_install.py", "removal_commands"),
    'iptables -S "$chain"': ("tests/k8s/test_chart_install.py", "removal_commands"),
    "done": ("tests/k8s/test_chart_install.py", "removal_commands"),
    "ip link del kiamfast0": ("tests/k8s/test_chart_install_container_credentials.py",
                              "removal_commands"),
    "helm uninstall": ("tests/k8s/test_chart_install.py", '"uninstall"'),
    "deploy/image/build.sh": ("tests/image/conftest.py", '"image" / "build.sh"'),
    "apt-get install buildah mmdebstrap": ("tests/run", "need mmdebstrap"),
    "deploy/release.sh": ("tests/release/conftest.py", "runs ``deploy/release.sh"),
    "helm install kiamfast oci://": ("tests/release/test_release.py", 'release.helm("install"'),
}
# What the agent's own routes answer (anything else would go to the node's metadata service).
CURL_ANSWERS = {"/readyz": r"\Aok\n\Z", "/healthz": r'"hostIP":.*"runtime":',
                "/metrics": r"^# TYPE kiamfast_http_requests_total counter$"}
# Commands nothing here can run, and why.
NOT_RUN = {
    "buildah login": "your registry's credentials (the release test's registry on loopback "
                     "takes none)",
    "aws ecr ": "your AWS account (ECR); deploy/ci/github-actions-release.yaml's release "
                "command, the same route, runs as a dry run in tests/release",
    "aws iam ": "your AWS account (IAM); tests/docs/test_install_page.py checks the policies "
                "these commands take",
    "kubectl -n kube-system logs": "a cluster with the agent running in it",
    "kubectl -n <namespace> exec": "an affected pod in a cluster (the same call from a pod, "
                                   "through the real DNAT rule: tests/k8s)",
}


COMMENT = re.compile(r"\s+#\s.*$")   # a trailing comment (none of the commands has a # else)


@dataclass
class Command:
    page: str
    block: int
    text: str          # continuation lines joined, comments dropped; a heredoc with its body
    comment: str = ""  # the line's trailing comment ("# or deploy/overlays/eks": rendered too)


def commands() -> list[Command]:
    found = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for number, block in enumerate(re.findall(r"```sh\n(.*?)```", page.read_text(), re.S)):
            lines = iter(block.splitlines())
            for line in lines:
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                heredoc = re.search(r"<<'(\w+)'$", line)
                if heredoc:
                    body = []
                    for more in lines:
                        body.append(more)
                        if more == heredoc.group(1):
                            break
                    found.append(Command(name, number, "\n".join([line, *body])))
                    continue
                while line.endswith("\\"):
                    line = line[:-1].rstrip() + " " + next(lines).strip()
                comment = COMMENT.search(line)
                found.append(Command(name, number, COMMENT.sub("", line).strip(),
                                     comment.group(0) if comment else ""))
    return found


def covered_elsewhere(text: str) -> tuple[str, str] | None:
    return next((where for prefix, where in ELSEWHERE.items() if text.startswith(prefix)), None)


def not_run(text: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if text.startswith(prefix)), None)


def test_the_blocks_are_found():
    texts = [c.text for c in commands()]
    assert len(texts) >= 20, texts
    assert "tests/run" in texts
    assert any(t.startswith("cat > values.yaml <<'EOF'\n") and t.endswith("\nEOF")
               for t in texts)


def test_commands_run_elsewhere_are_run_there():
    for command in commands():
        where = covered_elsewhere(command.text)
        if where:
            path, marker = where
            assert marker in (ROOT / path).read_text(), (command, path, marker)


def test_every_helm_and_kubectl_command_renders(tmp_path):
    """The values heredocs are written (in a directory of their own, as a user's shell
    would); each helm install/upgrade is rendered with ``helm template``, each
    ``kubectl apply -k`` with the kustomize renderer: each must make the agent's DaemonSet."""
    checked = 0
    last_values: Path | None = None
    for command in commands():
        words = command.text.split("\n", 1)[0].split()
        if covered_elsewhere(command.text) or not_run(command.text):
            continue
        if words[:2] == ["cat", ">"]:
            subprocess.run(["sh", "-ec", command.text], cwd=tmp_path, check=True)
            last_values = tmp_path / words[2]
            continue
        if words[:2] in (["helm", "install"], ["helm", "upgrade"]):
            args = shlex.split(command.text)
            args = [PLACEHOLDERS.get(a, a) for a in args]
            assert not [a for a in args if a.startswith("<")], command
            release, chart, rest = args[2], ROOT / args[3], args[4:]
            if "--reuse-values" in rest:       # the installed release's values
                assert last_values is not None, command
                rest = [a for a in rest if a != "--reuse-values"] + ["-f", str(last_values)]
            rest = [str(tmp_path / a) if (tmp_path / a).exists() else a for a in rest]
            result = helm("template", release, str(chart), *rest)
            assert result.returncode == 0, (command, result.stderr)
            assert "kind: DaemonSet" in result.stdout, command
            checked += 1
            continue
        if words[:3] == ["kubectl", "apply", "-k"]:
            for directory in [words[3], *re.findall(r"\bor (deploy/[\w/-]+)", command.comment)]:
                objects = kustomize(ROOT / directory)
                assert [o for o in objects if o["kind"] == "DaemonSet"], (command, directory)
                checked += 1
            continue
        if words[0] == "curl":
            continue    # test_the_curl_commands_answer_from_a_running_agent
        pytest.fail(f"{command.page}: nothing checks {command.text!r}: run it here, render it, "
                    "or name the test that runs it in ELSEWHERE")
    assert checked >= 8, checked


def test_the_curl_commands_answer_from_a_running_agent(tmp_path):
    from needs import need_tool
    need_tool("curl")
    from agent_process import Agent, Fakes
    curls = [c for c in commands() if c.text.startswith("curl ")]
    assert len(curls) >= 3, curls
    fakes = Fakes()
    agent = Agent(fakes, tmp_path / "agent", extra=["--listen-host=127.0.0.1"])
    try:
        agent.wait_ready(30)
        for command in curls:
            path = re.search(r"localhost:8181(/\S*)", command.text).group(1)
            assert path in CURL_ANSWERS, f"{command.page}: what should {path} answer?"
            args = shlex.split(command.text.replace("localhost:8181",
                                                    f"127.0.0.1:{agent.port}"))
            result = subprocess.run([*args, "--fail", "--max-time", "10"],
                                    capture_output=True, text=True, timeout=20)
            assert result.returncode == 0, (command, result)
            assert re.search(CURL_ANSWERS[path], result.stdout, re.M), (command, result.stdout)
    finally:
        agent.stop()
        fakes.stop()


def test_the_benchmark_commands_of_the_performance_page_exist():
    sys.path.insert(0, str(ROOT / "bench"))
    from report import SECTIONS
    page = (ROOT / "docs" / "performance.md").read_text()
    sections = re.findall(r"bench/run --only ([\w,-]+)", page)
    assert sections
    for named in sections:
        assert set(named.split(",")) <= set(SECTIONS), named
    for path in set(re.findall(r"\b((?:bench|tests)/[\w/]+\.py)\b", page)):
        assert (ROOT / path).exists(), path
