"""The demo's pod client: a botocore process whose every connection leaves from the pod's IP.

Checked against the fake metadata service, which records the client address of every
request: that address is all the agent identifies a pod by.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from demo_support import REPO, demo_env
from kiamfast.demo import scenario as sc
from kiamfast.testing.fake_imds import FakeImds


def _pod(ip: str, imds: str, sts_url: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = demo_env() | env_extra
    return subprocess.run([sys.executable, "-m", "kiamfast.demo.pod", "--ip", ip,
                           "--imds", imds, "--sts-endpoint", sts_url],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)


def test_every_request_comes_from_the_pod_address_and_uses_the_metadata_service(sts):
    with FakeImds() as imds:
        proc = _pod("127.0.10.91", imds.url + "/", sts.endpoint_url,
                    AWS_ACCESS_KEY_ID="AKIAFROMENV", AWS_SECRET_ACCESS_KEY="x",
                    AWS_EC2_METADATA_DISABLED="true")
        seen = imds.requests
    report = json.loads(proc.stdout)
    assert report["method"] == "iam-role"  # not the environment's keys
    assert report["sources"] == ["127.0.10.91"]
    paths = [r.path for r in seen]
    assert "/latest/api/token" in paths
    assert "/latest/meta-data/iam/security-credentials/" in paths
    assert {r.client for r in seen} == {"127.0.10.91"}
    # STS was asked with those credentials (the node's, from the fake: not an assumed role).
    assert report["arn"] == "arn:aws:sts::123456789012:user/moto"


def test_without_credentials_it_reports_the_agents_answer(sts):
    with FakeImds() as imds:
        imds.identity.node_role = ""  # listing answers 200 with an empty body: no role
        proc = _pod("127.0.10.92", imds.url + "/", sts.endpoint_url)
    report = json.loads(proc.stdout)
    assert report["method"] is None and report["access_key"] is None
    assert report["listing_status"] == 200
    assert report["sources"] == ["127.0.10.92"]


@pytest.mark.parametrize("args", [
    ["--ip", "10.0.0.5", "--imds", "http://127.0.0.1:1/", "--sts-endpoint",
     "http://127.0.0.1:2"],
    ["--ip", "127.0.10.5", "--imds", "http://169.254.169.254/", "--sts-endpoint",
     "http://127.0.0.1:2"],
    ["--ip", "127.0.10.5", "--imds", "http://127.0.0.1:1/", "--sts-endpoint",
     "https://sts.amazonaws.com"],
])
def test_it_refuses_anything_off_loopback(args):
    proc = subprocess.run([sys.executable, "-m", "kiamfast.demo.pod", *args],
                          capture_output=True, text=True, env=demo_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert "loopback" in proc.stderr or "127/8" in proc.stderr


def test_scenario_pods_have_distinct_loopback_addresses():
    main = [p.ip for p in sc.PODS + (sc.LATE_IP_POD, sc.REUSE_OLD_POD)]
    assert len(set(main)) == len(main)
    assert sc.REUSE_NEW_POD.ip == sc.REUSE_OLD_POD.ip
    assert all(ip.startswith("127.") for ip in main)


def test_expectation_syntax():
    assert sc.parse_expectation("shop/checkout=shop-catalog") == (
        "shop/checkout", sc.BASE_ROLE_ARN + "shop-catalog")
    assert sc.parse_expectation("shop/intruder=none") == ("shop/intruder", None)
    arn = "arn:aws:iam::210987654321:role/x"
    assert sc.parse_expectation(f"shop/checkout={arn}") == ("shop/checkout", arn)
    for bad in ("shop/checkout", "nowhere/x=y", "=x", "shop/checkout="):
        with pytest.raises(sc.ExpectationError):
            sc.parse_expectation(bad)
