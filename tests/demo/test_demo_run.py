"""``kiamfast demo`` end to end: it passes when the agent is right and fails when it is not.

These run the real command (API emulator, moto STS, fake metadata service, the agent, real
botocore clients on 127.0.10.x) and check what a user reads: the exit status, the pod
table, the race results, the JSON.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from demo_support import REPO, demo_env, leftovers, run_demo
from kiamfast.demo import scenario as sc

pytestmark = pytest.mark.slow

ROW = re.compile(r"^\s+(?P<mark>✓|✗)\s+(?P<pod>\S+)\s+(?P<ip>127\.\S+)\s+"
                 r"(?P<annotated>\S+)\s+(?P<received>.+?)\s{3,}(?P<latency>[\d.]+ m?s|—)$")


def kubectl_binary() -> Path:
    """The kubectl tests/k8s/build.sh built (the version tests/k8s/kubernetes requires)."""
    gomod = (REPO / "tests/k8s/kubernetes/go.mod").read_text()
    version = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)", gomod,
                        re.MULTILINE)[1]
    tools = Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")
    path = tools / f"kubectl-{version}" / "kubectl"
    if not path.is_file():
        pytest.skip(f"needs kubectl ({path}): run tests/run")
    return path


def _rows(stdout: str) -> dict[str, dict[str, str]]:
    return {m["pod"]: m.groupdict() for m in map(ROW.match, stdout.splitlines()) if m}


def test_demo_passes_and_each_pod_gets_its_own_role():
    run = run_demo()
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    # Progress while starting, one line per component.
    for step in ("Kubernetes API server emulator", "STS (moto", "fake EC2 metadata service",
                 "starting the kiamfast agent", "waiting for it"):
        assert re.search(re.escape(step) + r".*… ok \(", out), f"no progress line for {step}"
    rows = _rows(out)
    assert set(rows) == {p.ref for p in sc.PODS}, out
    for pod in sc.PODS:
        row = rows[pod.ref]
        assert row["mark"] == "✓", row
        assert row["ip"] == pod.ip
        if pod.role is None:
            assert row["annotated"] == "(none)"
            assert row["received"] == sc.DEFAULT_ROLE
        elif pod.expect is None:
            assert row["annotated"] == pod.role
            assert row["received"] == "refused (404)"
        else:
            assert row["annotated"] == row["received"] == pod.role
    # Both races replayed, each pod with its own role.
    assert re.search(r"✓ before the API server had its IP: shop/fresh got shop-fresh", out)
    assert re.search(r"✓ cart-v1 alone on 127\.0\.10\.40: shop/cart-v1 got shop-cart-v1", out)
    assert re.search(r"✓ cart-v1 not deleted yet: shop/cart-v2 got shop-cart-v2", out)
    assert re.search(r"✓ after cart-v1's late delete: shop/cart-v2 got shop-cart-v2", out)
    assert "✗" not in out
    assert re.search(r"^✓ all \d+ checks passed", out, re.M)
    files, procs = leftovers(run.pid)
    assert files == [] and procs == []


def test_demo_json_reports_every_check():
    run = run_demo("--json")
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(run.stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["error"] is None
    assert "starting the kiamfast agent" in run.stderr  # progress stays readable
    pods = {p["pod"]: p for p in doc["pods"]}
    for pod in sc.PODS:
        p = pods[pod.ref]
        assert p["ok"] and p["expected_role"] == pod.expect
        if pod.expect:
            assert p["observed"]["method"] == "iam-role"
            assert p["observed"]["arn"].startswith(
                f"arn:aws:sts::{sc.ACCOUNT}:assumed-role/{pod.expect.rsplit('/', 1)[1]}/")
        assert p["observed"]["sources"] == [pod.ip]
    sections = {c["section"] for c in doc["checks"]}
    assert sections == {"pods", "race-late-ip", "race-ip-reuse", "identity"}
    assert all(c["ok"] for c in doc["checks"])
    assert all(s["ok"] for s in doc["steps"])


def test_demo_fails_on_a_wrong_or_missing_credential():
    """Expect checkout to get catalog's role and the intruder to get its role: both wrong."""
    run = run_demo("--json", "--expect", "shop/checkout=shop-catalog",
                   "--expect", "shop/intruder=billing-admin")
    assert run.returncode == 1, run.stdout + run.stderr
    doc = json.loads(run.stdout)
    # A failed run keeps its files for a look (the agent's log); said so, then removed here.
    workdir = Path(doc["agent"]["log"]).parent
    assert f"files kept for a look: {workdir}" in run.stderr
    shutil.rmtree(workdir)
    assert doc["ok"] is False
    pods = {p["pod"]: p for p in doc["pods"]}
    checkout, intruder = pods["shop/checkout"], pods["shop/intruder"]
    assert not checkout["ok"] and checkout["received"] == "shop-checkout"
    assert "wrong role" in checkout["problem"]
    assert not intruder["ok"] and intruder["problem"].startswith("no credentials")
    assert all(p["ok"] for ref, p in pods.items() if ref not in ("shop/checkout",
                                                                  "shop/intruder"))
    # The human output on stderr marks them.
    assert re.search(r"✗ shop/checkout .* shop-checkout", run.stderr)
    assert re.search(r"✗ 2 of \d+ checks failed", run.stderr)
    files, procs = leftovers(run.pid)
    assert files == [] and procs == []


def test_demo_refuses_an_unknown_pod_in_expect():
    run = run_demo("--expect", "nowhere/nobody=x")
    assert run.returncode == 2
    assert "no demo pod 'nowhere/nobody'" in run.stderr


def test_keep_running_serves_the_printed_curl_line_until_interrupted():
    # Started with SIGINT ignored, as a script's background job inherits it (and as this
    # test runs under a runner started so): Ctrl-C's signal must stop it all the same.
    proc = subprocess.Popen([sys.executable, "-m", "kiamfast", "demo", "--keep-running"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=demo_env(), cwd=REPO,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.strip().startswith("kubectl "):
                break
        text = "".join(lines)
        assert "Still running" in text, text
        curl = next(ln.strip() for ln in lines if ln.strip().startswith("curl") and
                    ln.strip().endswith("shop-checkout"))
        by_hand = next(ln.strip() for ln in lines if "python -m kiamfast.demo.pod" in ln)
        # The printed python line is a pod by hand: it gets checkout's role from STS.
        argv = by_hand.split()
        env = demo_env()
        env["AWS_ACCESS_KEY_ID"] = "AKIAFROMTHESHELL"  # a shell's credentials are ignored
        result = subprocess.run([sys.executable] + argv[1:], capture_output=True, text=True,
                                env=env, timeout=30)
        report = json.loads(result.stdout)
        assert report["method"] == "iam-role"
        assert "assumed-role/shop-checkout/" in report["arn"]
        if os.path.exists("/usr/bin/curl") or os.path.exists("/bin/curl"):
            doc = subprocess.run(curl.split(), capture_output=True, text=True, timeout=30)
            assert json.loads(doc.stdout)["Code"] == "Success"
        # The printed kubectl line, run by the real kubectl, lists the demo's pods.
        kubectl = shlex.split(next(ln for ln in lines if ln.strip().startswith("kubectl ")))
        listed = subprocess.run([str(kubectl_binary()), *kubectl[1:]], capture_output=True,
                                text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        rows = {tuple(row.split()[:2]): row.split()[2:] for row in listed.stdout.splitlines()}
        for pod in sc.PODS:
            namespace, name = pod.ref.split("/")
            assert rows[(namespace, name)] == [pod.ip, pod.role or "<none>"], listed.stdout
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rest, _ = proc.communicate()
    assert proc.returncode == 0, "".join(lines) + rest
    files, procs = leftovers(proc.pid)
    assert files == [] and procs == []
