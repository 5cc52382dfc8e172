"""The whole agent with a container runtime, on loopback: the runtime, not the API server,
says who owns an address.  The runtime is the CRI fault double (real gRPC, no root); the
same cases against a real containerd in network namespaces are in tests/e2e.

Each pod is a loopback source address, with no network namespace of its own for the kernel
to show: the agent takes the runtime's READY at its word (``--address-proof=runtime``; the
kernel's proof is tested in tests/netns and tests/e2e).  The API server (emulator) is
deliberately late or wrong: a pod's address is never published, or a dead pod stays Running
with it."""

from __future__ import annotations

import time

import orjson
import pytest

from agent_process import Agent, Fakes
from agent_process import http as _http
from kiamfast.testing.cri_fault import CriFault, fake_sandbox

ROLE_KEY = "iam.amazonaws.com/role"
LIST = "/latest/meta-data/iam/security-credentials/"


def http(port: int, path: str, *, source: str = "127.0.0.1") -> tuple[int, bytes]:
    return _http(port, f"GET {path}", source=source)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    fakes = Fakes()
    cri = CriFault().start()
    agent = Agent(fakes, tmp_path_factory.mktemp("agent-runtime"),
                  extra=["--listen-host=127.0.0.1", f"--cri-endpoint={cri.endpoint}",
                         "--address-proof=runtime"])
    try:
        agent.wait_ready(30)
        yield {"port": agent.port, "api": fakes.api, "cri": cri, "sts": fakes.sts,
               "log": agent.log_path}
    finally:
        agent.stop()
        cri.close()
        fakes.stop()


def role_of(node, ip: str) -> tuple[int, str]:
    """(status, the role STS says the served credentials belong to) for a pod at `ip`."""
    import boto3
    status, body = http(node["port"], LIST, source=ip)
    if status != 200:
        return status, body.decode()
    status, doc = http(node["port"], LIST + body.decode(), source=ip)
    assert status == 200, doc
    creds = orjson.loads(doc)
    arn = boto3.client("sts", endpoint_url=node["sts"].url, region_name="us-east-1",
                       aws_access_key_id=creds["AccessKeyId"],
                       aws_secret_access_key=creds["SecretAccessKey"],
                       aws_session_token=creds["Token"]).get_caller_identity()["Arn"]
    return status, arn.split(":assumed-role/")[1].split("/")[0]


def pod(node, name: str, *, role: str, ips=(), phase="Pending") -> str:
    node["api"].pods.create("default", name, node="n1", annotations={ROLE_KEY: role},
                            ips=list(ips), phase=phase)
    return node["api"].pods.get("default", name)["metadata"]["uid"]


def until(pred, timeout=10.0):
    """Wait for ``pred()`` to be truthy; returns what it returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := pred():
            return result
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_first_call_of_a_pod_the_api_has_no_address_for(node):
    uid = pod(node, "early", role="role-early")
    node["cri"].put(fake_sandbox(name="early", uid=uid, ip="127.0.0.21",
                                 annotations={ROLE_KEY: "role-early"}))
    assert node["api"].pods.get("default", "early")["status"].get("podIP") is None
    assert role_of(node, "127.0.0.21") == (200, "role-early")


def test_reused_address_while_the_api_shows_the_old_pod_running(node):
    old = pod(node, "old", role="role-old", ips=["127.0.0.22"], phase="Running")
    old_sb = fake_sandbox(name="old", uid=old, ip="127.0.0.22", annotations={ROLE_KEY: "role-old"})
    node["cri"].put(old_sb)
    assert role_of(node, "127.0.0.22") == (200, "role-old")
    node["cri"].stop_sandbox(old_sb.id)                 # the old pod's sandbox stops ...
    new = pod(node, "new", role="role-new")            # ... and a new one gets its address
    node["cri"].put(fake_sandbox(name="new", uid=new, ip="127.0.0.22",
                                 annotations={ROLE_KEY: "role-new"}))
    assert node["api"].pods.get("default", "old")["status"]["podIP"] == "127.0.0.22"
    for _ in range(20):                                 # never the old pod's role
        assert role_of(node, "127.0.0.22") == (200, "role-new")


def test_a_stopped_sandbox_gets_nothing_even_while_the_api_says_running(node):
    uid = pod(node, "stopping", role="role-stop", ips=["127.0.0.23"], phase="Running")
    sb = fake_sandbox(name="stopping", uid=uid, ip="127.0.0.23", annotations={ROLE_KEY: "role-stop"})
    node["cri"].put(sb)
    assert role_of(node, "127.0.0.23") == (200, "role-stop")
    node["cri"].stop_sandbox(sb.id)
    status, _ = role_of(node, "127.0.0.23")
    assert status == 503       # the API's claim waits for a proof that never comes


def test_runtime_outage_answers_nothing_without_the_kernels_proof_and_recovers(node):
    uid = pod(node, "steady", role="role-steady", ips=["127.0.0.24"], phase="Running")
    node["cri"].put(fake_sandbox(name="steady", uid=uid, ip="127.0.0.24",
                                 annotations={ROLE_KEY: "role-steady"}))
    assert role_of(node, "127.0.0.24") == (200, "role-steady")
    pod(node, "api-only", role="role-api", ips=["127.0.0.25"], phase="Running")   # no sandbox
    node["cri"].stop()                                  # the socket is gone
    until(lambda: b"unreachable" in http(node["port"], "/healthz")[1])
    health = orjson.loads(http(node["port"], "/healthz")[1])
    assert node["cri"].endpoint in health["runtime"]
    # One rendering: each worker caches /metrics for a second, so a second request may be
    # answered by a worker whose copy predates the outage.
    def metrics_after_outage():
        body = http(node["port"], "/metrics")[1]
        return body if b"kiamfast_runtime_up 0" in body else None
    metrics = until(metrics_after_outage)
    assert b'kiamfast_runtime_total{kind="failed_polls"}' in metrics      # the poller's
    assert b'kiamfast_runtime_total{kind="status_calls"} ' in metrics     # the client's
    # Meanwhile nothing proves who holds an address (no kernel here): nobody is answered
    # with a role (503: retry), never another identity.
    assert role_of(node, "127.0.0.24")[0] == 503
    assert role_of(node, "127.0.0.25")[0] == 503
    node["cri"].start()
    until(lambda: b'"runtime":"ok"' in http(node["port"], "/healthz")[1])
    until(lambda: role_of(node, "127.0.0.24") == (200, "role-steady"))
    assert role_of(node, "127.0.0.25")[0] == 503        # no sandbox holds it: only a claim
    until(lambda: b"kiamfast_runtime_up 1" in http(node["port"], "/metrics")[1])
