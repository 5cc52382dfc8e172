"""The whole agent with a container runtime, on loopback: the runtime, not the API server,
says who owns an address.  The runtime is the CRI fault double (real gRPC, no root); the
same cases against a real containerd in network namespaces are in tests/e2e.

Each pod is a loopback source address.  The API server (emulator) is deliberately late or
wrong: a pod's address is never published, or a dead pod stays Running with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import pytest

from kiamfast.testing.apiserver import ApiServer
from kiamfast.testing.cri_fault import CriFault, fake_sandbox
from kiamfast.testing.fake_imds import FakeImds
from kiamfast.testing.sts import MotoSts

from test_agent_loopback import free_port, http

ROLE_KEY = "iam.amazonaws.com/role"
LIST = "/latest/meta-data/iam/security-credentials/"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent-runtime")
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_EC2_METADATA_DISABLED="true", AWS_REGION="us-east-1")
    api = ApiServer().start()
    sts = MotoSts()
    sts.start()
    imds = FakeImds().start()
    cri = CriFault().start()
    api.add_node("n1")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiamfast", f"--kubeconfig={api.write_kubeconfig(str(d / 'kc'))}",
         "--node=n1", "--host-ip=127.0.0.1", "--base-role-arn=arn:aws:iam::123456789012:role/",
         f"--sts-endpoint={sts.url}", f"--metadata-addr={imds.addr}", f"--app-port={port}", f"--metrics-port={port}",
         "--listen-host=127.0.0.1", f"--table-path={d / 'table'}",
         f"--token-key-file={d / 'key'}", f"--cri-endpoint={cri.endpoint}",
         "--iptables=false", "--node-startup-taint="],
        env=env, stderr=open(d / "agent.log", "wb"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, (d / "agent.log").read_text()
        try:
            if http(port, "/readyz")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.05)
    else:
        raise AssertionError("agent never ready:\n" + (d / "agent.log").read_text())
    yield {"port": port, "api": api, "cri": cri, "sts": sts, "log": d / "agent.log"}
    proc.terminate()
    proc.wait(20)
    cri.close()
    imds.stop()
    sts.stop()
    api.stop()


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
    node["api"].create_pod("default", name, node="n1", annotations={ROLE_KEY: role},
                           ips=list(ips), phase=phase)
    return node["api"].get_pod("default", name)["metadata"]["uid"]


def until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_first_call_of_a_pod_the_api_has_no_address_for(node):
    uid = pod(node, "early", role="role-early")
    node["cri"].put(fake_sandbox(name="early", uid=uid, ip="127.0.0.21",
                                 annotations={ROLE_KEY: "role-early"}))
    assert node["api"].get_pod("default", "early")["status"].get("podIP") is None
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
    assert node["api"].get_pod("default", "old")["status"]["podIP"] == "127.0.0.22"
    for _ in range(20):                                 # never the old pod's role
        assert role_of(node, "127.0.0.22") == (200, "role-new")


def test_a_stopped_sandbox_gets_nothing_even_while_the_api_says_running(node):
    uid = pod(node, "stopping", role="role-stop", ips=["127.0.0.23"], phase="Running")
    sb = fake_sandbox(name="stopping", uid=uid, ip="127.0.0.23", annotations={ROLE_KEY: "role-stop"})
    node["cri"].put(sb)
    assert role_of(node, "127.0.0.23") == (200, "role-stop")
    node["cri"].stop_sandbox(sb.id)
    status, _ = role_of(node, "127.0.0.23")
    assert status == 404


def test_runtime_outage_falls_back_to_the_api_and_recovers(node):
    pod(node, "steady", role="role-steady", ips=["127.0.0.24"], phase="Running")
    node["cri"].stop()                                  # the socket is gone
    until(lambda: b"unreachable" in http(node["port"], "/healthz")[1])
    health = orjson.loads(http(node["port"], "/healthz")[1])
    assert node["cri"].endpoint in health["runtime"]
    until(lambda: b"kiamfast_runtime_up 0" in http(node["port"], "/metrics")[1])
    # The API's view meanwhile: published addresses are served, never another identity.
    assert role_of(node, "127.0.0.24") == (200, "role-steady")
    node["cri"].start()
    until(lambda: b'"runtime":"ok"' in http(node["port"], "/healthz")[1])
    assert role_of(node, "127.0.0.24")[0] == 404        # no sandbox holds it: nobody's
    until(lambda: b"kiamfast_runtime_up 1" in http(node["port"], "/metrics")[1])
