"""The demo's judge, fed with what real clients observed: it must fail everything wrong.

The observations come from the real pod client (:mod:`kiamfast.demo.pod`, a botocore
process bound to a 127/8 address) against the fake metadata service and moto's STS, the
same components the demo runs, so the judge is tested on the data it sees in the demo.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from demo_support import REPO, demo_env
from kiamfast.demo.check import assumed_role, judge, role_identity

ACCOUNT = "123456789012"
CHECKOUT = f"arn:aws:iam::{ACCOUNT}:role/shop-checkout"
CATALOG = f"arn:aws:iam::{ACCOUNT}:role/shop-catalog"


def _assumed(sts, role_arn: str) -> dict:
    """What a pod client reports after receiving ``role_arn``'s credentials over IMDS."""
    import botocore.session

    session = botocore.session.get_session()
    node = session.create_client("sts", endpoint_url=sts.endpoint_url, region_name="us-east-1",
                                 aws_access_key_id="AKIANODE", aws_secret_access_key="x")
    creds = node.assume_role(RoleArn=role_arn, RoleSessionName="demo-node")["Credentials"]
    pod = session.create_client("sts", endpoint_url=sts.endpoint_url, region_name="us-east-1",
                                aws_access_key_id=creds["AccessKeyId"],
                                aws_secret_access_key=creds["SecretAccessKey"],
                                aws_session_token=creds["SessionToken"])
    return {"ip": "127.0.10.11", "method": "iam-role", "access_key": creds["AccessKeyId"],
            "first_call_ms": 3.0, "arn": pod.get_caller_identity()["Arn"], "sts_error": None,
            "listing_status": None, "error": None, "sources": ["127.0.10.11"]}


def test_the_right_role_passes(sts):
    observed = _assumed(sts, CHECKOUT)
    verdict = judge(CHECKOUT, observed, ip="127.0.10.11")
    assert verdict.ok and verdict.received == "shop-checkout" and verdict.account == ACCOUNT


def test_another_pods_role_fails(sts):
    verdict = judge(CATALOG, _assumed(sts, CHECKOUT), ip="127.0.10.11")
    assert not verdict.ok
    assert verdict.received == "shop-checkout"
    assert verdict.problem == "wrong role: expected shop-catalog"


def test_the_same_role_name_in_another_account_fails(sts):
    observed = _assumed(sts, "arn:aws:iam::210987654321:role/shop-checkout")
    verdict = judge(CHECKOUT, observed, ip="127.0.10.11")
    assert not verdict.ok and "in 123456789012" in verdict.problem


def test_a_role_for_a_pod_that_must_be_refused_fails(sts):
    verdict = judge(None, _assumed(sts, CHECKOUT), ip="127.0.10.11")
    assert not verdict.ok and verdict.problem == "got a role but should have been refused"


def test_credentials_from_another_source_fail(sts):
    observed = _assumed(sts, CHECKOUT) | {"method": "env"}
    assert not judge(CHECKOUT, observed, ip="127.0.10.11").ok


def test_connections_from_another_address_prove_nothing(sts):
    observed = _assumed(sts, CHECKOUT) | {"sources": ["127.0.10.11", "127.0.0.1"]}
    verdict = judge(CHECKOUT, observed, ip="127.0.10.11")
    assert not verdict.ok and "127.0.0.1" in verdict.problem


def test_credentials_sts_does_not_know_as_a_role_fail(sts):
    observed = _assumed(sts, CHECKOUT) | {"arn": "arn:aws:sts::123456789012:user/moto"}
    verdict = judge(CHECKOUT, observed, ip="127.0.10.11")
    assert not verdict.ok and verdict.received == "unverified"


def test_the_nodes_own_credentials_always_fail(sts):
    """A pod client that reached the node's metadata service directly (the fake marks the
    node's keys ASIANODE): wrong whatever was expected, even "nothing"."""
    from kiamfast.testing.fake_imds import FakeImds

    with FakeImds() as imds:
        proc = subprocess.run(
            [sys.executable, "-m", "kiamfast.demo.pod", "--ip", "127.0.10.77",
             "--imds", imds.url + "/", "--sts-endpoint", sts.endpoint_url],
            capture_output=True, text=True, env=demo_env(), cwd=REPO, timeout=60)
    import json

    observed = json.loads(proc.stdout)
    assert observed["access_key"].startswith("ASIANODE")
    for expected in (CHECKOUT, None):
        verdict = judge(expected, observed, ip="127.0.10.77")
        assert not verdict.ok and verdict.received == "the NODE's role"


def _none(status: int | None, error: str | None = None) -> dict:
    return {"ip": "127.0.10.13", "method": None, "access_key": None, "first_call_ms": 2.0,
            "arn": None, "sts_error": None, "listing_status": status, "error": error,
            "sources": ["127.0.10.13"]}


def test_refusal_passes_only_as_a_404():
    assert judge(None, _none(404), ip="127.0.10.13").ok
    assert judge(None, _none(404), ip="127.0.10.13").received == "refused (404)"
    for status in (503, 500, None):
        verdict = judge(None, _none(status), ip="127.0.10.13")
        assert not verdict.ok, status
    assert not judge(None, _none(404, "ReadTimeoutError: ..."), ip="127.0.10.13").ok


def test_missing_credentials_fail_when_a_role_was_expected():
    verdict = judge(CHECKOUT, _none(503), ip="127.0.10.13")
    assert not verdict.ok
    assert verdict.problem == "no credentials; the agent answered 503"


def test_a_crashed_pod_client_fails_even_when_nothing_was_expected():
    assert not judge(None, {"ip": "127.0.10.13", "crashed": "exit 1: boom"},
                     ip="127.0.10.13").ok


def test_arn_parsing():
    assert assumed_role("arn:aws:sts::123456789012:assumed-role/a-b/node-a-b") == (
        "123456789012", "a-b", "node-a-b")
    assert assumed_role("arn:aws:sts::123456789012:user/moto") is None
    assert assumed_role(None) is None
    assert role_identity("arn:aws:iam::123456789012:role/team/app") == ("123456789012", "app")
    with pytest.raises(ValueError):
        role_identity("arn:aws:iam::123456789012:user/app")
