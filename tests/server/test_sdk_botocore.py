"""A real SDK against the worker (sdk-imds.md §10 E1): botocore's own IMDS credential chain.

botocore runs in a subprocess whose environment points its metadata endpoint at the worker
on 127.0.0.1 and hides every other credential source, so nothing leaks between tests and
nothing can reach a real metadata service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_support import BASE_ARN

SCRIPT = r"""
import json, socket, sys

# Belt and braces: this process must never reach a real metadata service.
_connect = socket.socket.connect
def _guarded(self, address):
    if isinstance(address, tuple) and address[0] in ("169.254.169.254", "fd00:ec2::254"):
        raise SystemExit("attempted to contact the real metadata service")
    return _connect(self, address)
socket.socket.connect = _guarded

import botocore.session
from botocore.utils import IMDSRegionProvider
session = botocore.session.Session()
creds = session.get_credentials()
out = {"method": creds.method if creds else None}
if creds is not None:
    frozen = creds.get_frozen_credentials()
    out.update(access_key=frozen.access_key, secret_key=frozen.secret_key, token=frozen.token)
out["region"] = IMDSRegionProvider(session).provide()
print(json.dumps(out))
"""


def run_botocore(port: int, tmp_path, **extra_env: str) -> dict:
    empty = tmp_path / "empty"
    empty.write_text("")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "BOTO"))}
    env.update({
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{port}",
        "AWS_SHARED_CREDENTIALS_FILE": str(empty),
        "AWS_CONFIG_FILE": str(empty),
        "AWS_METADATA_SERVICE_TIMEOUT": "2",
        "AWS_METADATA_SERVICE_NUM_ATTEMPTS": "1",
        **extra_env,
    })
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("v1_disabled", [False, True])
def test_e1_botocore_gets_the_pod_credentials(server, pods, imds, tmp_path, v1_disabled):
    pods.add("127.0.0.1", "app-role", access_key="ASIABOTOCORE0000001")
    env = {"AWS_EC2_METADATA_V1_DISABLED": "true"} if v1_disabled else {}
    out = run_botocore(server.port, tmp_path, **env)
    assert out["method"] == "iam-role"
    assert out["access_key"] == "ASIABOTOCORE0000001"
    assert out["secret_key"] == "secret/ASIABOTOCORE0000001"
    assert out["token"] == "session-token-ASIABOTOCORE0000001"
    assert out["region"] == "eu-west-1"  # passthrough of placement/availability-zone
    # botocore asked the worker, and only the region lookup went upstream
    assert all("iam" not in r.path for r in imds.requests)


def test_e1_botocore_in_required_mode(make_server, pods, tmp_path):
    server = make_server(imdsv2="required")
    pods.add("127.0.0.1", "app-role", access_key="ASIAREQUIRED0000001")
    out = run_botocore(server.port, tmp_path, AWS_EC2_METADATA_V1_DISABLED="true")
    assert out["access_key"] == "ASIAREQUIRED0000001"


def test_e1_botocore_with_kube2iam_style_role_path(server, pods, tmp_path):
    pods.add("127.0.0.1", "team/app-role", access_key="ASIAPATHROLE0000001")
    out = run_botocore(server.port, tmp_path)
    assert out["access_key"] == "ASIAPATHROLE0000001"


def test_e1_botocore_gets_nothing_for_a_pod_without_role(server, pods, tmp_path):
    pods.add("127.0.0.1", None)
    out = run_botocore(server.port, tmp_path)
    assert out["method"] is None


def test_e1_botocore_never_gets_node_credentials(server, pods, imds, tmp_path):
    # Unknown pod: botocore must end up with nothing, never with the node's role upstream.
    out = run_botocore(server.port, tmp_path)
    assert out["method"] is None
    assert not any(r.path.startswith("/latest/meta-data/iam") for r in imds.requests)
    assert BASE_ARN  # (the pod role prefix is irrelevant here)
