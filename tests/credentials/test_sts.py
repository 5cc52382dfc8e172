"""The STS client against moto behind the fault proxy: parameters sent, errors classified."""
from __future__ import annotations

import asyncio
import datetime as dt
import os

import pytest

from kiamfast.control.iam import sts as stsmod
from kiamfast.control.iam.sts import StsClient, StsDenied, StsThrottled, StsTransient

ROLE = "arn:aws:iam::123456789012:role/team/app"


def test_assume_role_sends_what_was_asked(sts, proxy):
    creds = sts.assume_role_sync(ROLE, "node-1-app", external_id="ext-1", duration=1800,
                                 tags=[("kiamfast-namespace", "ns")])
    assert creds.access_key_id.startswith("ASIA")
    assert creds.expiration.tzinfo is not None
    left = creds.expires_at - dt.datetime.now(dt.timezone.utc).timestamp()
    assert 1700 < left <= 1800
    (call,) = proxy.assume_role_calls()
    assert call.role_arn == ROLE and call.session_name == "node-1-app"
    assert call.external_id == "ext-1" and call.params["DurationSeconds"] == "1800"
    assert call.tags == {"kiamfast-namespace": "ns"}
    assert call.access_key_id == creds.access_key_id


def test_no_external_id_is_omitted_not_empty(sts, proxy):
    sts.assume_role_sync(ROLE, "n1", external_id=None)
    sts.assume_role_sync(ROLE, "n1", external_id="")
    assert [c.external_id for c in proxy.assume_role_calls()] == [None, None]


def test_async_call_runs_off_the_event_loop(sts, proxy):
    proxy.latency = 0.2

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        results = await asyncio.gather(*(sts.assume_role(ROLE, f"s{i}") for i in range(4)))
        t.cancel()
        return ticks, results

    ticks, results = asyncio.run(main())
    assert ticks > 3  # the loop kept running while STS was slow
    assert len({r.access_key_id for r in results}) == 4


@pytest.mark.parametrize("fault, exc, code", [
    ("throttle", StsThrottled, "Throttling"),
    ("5xx", StsTransient, "InternalFailure"),
    ("deny", StsDenied, "AccessDenied"),
    ("down", StsTransient, "ConnectionClosedError"),
])
def test_failures_are_classified(sts, proxy, fault, exc, code):
    proxy.add_fault(fault)
    with pytest.raises(exc) as info:
        sts.assume_role_sync(ROLE, "n1")
    assert info.value.code == code
    assert info.value.role_arn == ROLE
    assert "secret" not in str(info.value).lower()


def test_botocore_retries_when_asked_to(proxy):
    client = StsClient(endpoint_url=proxy.url, max_attempts=2)
    try:
        proxy.add_fault("5xx", count=1)
        assert client.assume_role_sync(ROLE, "n1").access_key_id
        assert [c.outcome for c in proxy.assume_role_calls()] == ["5xx", "ok"]
    finally:
        client.close()


def test_invalid_role_is_denied_before_sending(sts, proxy):
    with pytest.raises(StsDenied) as info:
        sts.assume_role_sync("app", "n1")  # no base ARN: kube2iam passes the bare name
    assert info.value.code == "ValidationError"
    assert proxy.assume_role_calls() == []


def test_unreachable_endpoint_is_transient():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    client = StsClient(endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1,
                       connect_timeout=1)
    try:
        with pytest.raises(StsTransient):
            client.assume_role_sync(ROLE, "n1")
    finally:
        client.close()


@pytest.mark.parametrize("raw, clean", [
    ("node-1-app", "node-1-app"),
    ("ns.pod-0", "ns.pod-0"),
    ("a b/c:d", "a-b-c-d"),
    ("x", "x-"),
    ("", "--"),
    ("n" * 100, "n" * 64),
    ("é@+=,.", "-@+=,."),
])
def test_session_names_are_sanitised(raw, clean):
    assert stsmod.sanitize_session_name(raw) == clean


def test_region_resolution():
    assert stsmod.resolve_region("eu-west-1", {"AWS_REGION": "us-west-2"}) == "eu-west-1"
    assert stsmod.resolve_region(None, {"AWS_REGION": "us-west-2",
                                        "AWS_DEFAULT_REGION": "eu-central-1"}) == "us-west-2"
    assert stsmod.resolve_region("", {"AWS_DEFAULT_REGION": "eu-central-1"}) == "eu-central-1"
    assert stsmod.resolve_region(None, {}) == "us-east-1"


def test_regional_endpoint_by_default():
    client = StsClient(region="eu-west-1")
    try:
        assert client.endpoint_url == "https://sts.eu-west-1.amazonaws.com"
    finally:
        client.close()


def test_standard_endpoint_variable_is_honoured(proxy):
    os.environ["AWS_ENDPOINT_URL_STS"] = proxy.url
    try:
        client = StsClient(region="eu-west-1")
    finally:
        del os.environ["AWS_ENDPOINT_URL_STS"]
    try:
        assert client.endpoint_url == proxy.url
        client.assume_role_sync(ROLE, "n1")
        assert len(proxy.assume_role_calls()) == 1
    finally:
        client.close()


def test_explicit_endpoint_wins_over_the_variable(proxy):
    os.environ["AWS_ENDPOINT_URL_STS"] = "http://127.0.0.1:9"
    try:
        client = StsClient(region="eu-west-1", endpoint_url=proxy.url)
    finally:
        del os.environ["AWS_ENDPOINT_URL_STS"]
    try:
        assert client.endpoint_url == proxy.url
    finally:
        client.close()


def test_from_config(proxy):
    from kiamfast.config import Config
    client = StsClient.from_config(Config(sts_region="eu-west-2", sts_endpoint=proxy.url))
    try:
        assert client.region == "eu-west-2" and client.endpoint_url == proxy.url
    finally:
        client.close()
    client = StsClient.from_config(Config())
    try:
        assert client.endpoint_url == "https://sts.us-east-1.amazonaws.com"
    finally:
        client.close()


# ---- built cheaply, off the event loop, and again when it found nothing --------------------------

_IMPORTS_AND_BUILDS = r"""
import sys, threading
import kiamfast.control.start, kiamfast.control.iam.manager, kiamfast.control.iam.sts as sts
print(sorted(m for m in sys.modules if m.startswith("botocore")))
builders = []

class Spy:          # records which thread imports botocore's session module
    def find_spec(self, name, path=None, target=None):
        if name == "botocore.session":
            builders.append(threading.current_thread().name)
        return None

sys.meta_path.insert(0, Spy())
from kiamfast.config import Config
client = sts.StsClient.from_config(Config(sts_endpoint=sys.argv[1]))
print(client.assume_role_sync("arn:aws:iam::123456789012:role/team/app", "n1").access_key_id)
print(builders)
client.close()
"""


def test_importing_the_control_side_loads_no_botocore_and_from_config_builds_on_the_sts_thread(
        proxy):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _IMPORTS_AND_BUILDS, proxy.url], check=True,
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert out[0] == "[]"                                  # nothing of botocore at import
    assert out[1].startswith("ASIA")
    (thread,) = eval(out[2])
    assert thread.startswith("kiamfast-sts")               # not the caller's (event loop's)


def test_a_deferred_build_that_fails_is_tried_again_by_the_next_call(proxy, monkeypatch):
    from kiamfast.config import Config
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")   # botocore: ProfileNotFound
    client = StsClient.from_config(Config(sts_endpoint=proxy.url))
    try:
        with pytest.raises(StsTransient) as info:
            client.assume_role_sync(ROLE, "n1")
        assert info.value.code == "ProfileNotFound"
        monkeypatch.delenv("AWS_PROFILE")
        assert client.assume_role_sync(ROLE, "n1").access_key_id.startswith("ASIA")
    finally:
        client.close()
    assert len(proxy.assume_role_calls()) == 1


def test_credentials_that_appear_after_the_client_was_built_are_used(proxy, monkeypatch):
    # botocore hands a client the credentials its session found when it was built, and
    # none later: a node whose metadata service answered nothing at start must not need a
    # restart of the agent to get its credentials.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    client = StsClient(endpoint_url=proxy.url)
    try:
        with pytest.raises(StsTransient) as info:
            client.assume_role_sync(ROLE, "n1")
        assert info.value.code == "NoCredentialsError"
        assert proxy.assume_role_calls() == []
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        assert client.assume_role_sync(ROLE, "n1").access_key_id.startswith("ASIA")
    finally:
        client.close()


def test_own_credentials_come_from_the_instance_profile_at_botocores_metadata_address(
        proxy, monkeypatch):
    # The agent's own identity: botocore's chain down to the instance profile, read from
    # 169.254.169.254 or AWS_EC2_METADATA_SERVICE_ENDPOINT (here a fake IMDS on loopback),
    # as botocore does for any process on the node; --metadata-addr plays no part.
    from kiamfast.testing.fake_imds import FakeImds
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED"):
        monkeypatch.delenv(var)
    with FakeImds() as imds:
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url)
        client = StsClient(endpoint_url=proxy.url)
        signed_by = []
        client.load().meta.events.register(
            "before-send.sts.AssumeRole",
            lambda request, **_: signed_by.append(request.headers["Authorization"]))
        try:
            assert client.assume_role_sync(ROLE, "n1").access_key_id.startswith("ASIA")
        finally:
            client.close()
        node = imds.identity
        paths = [r.path for r in imds.requests]
    assert f"/latest/meta-data/iam/security-credentials/{node.node_role}" in paths
    (authorization,) = signed_by
    assert f"Credential={node.node_access_key}/".encode() in authorization


def test_a_name_that_is_no_region_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="--sts-region"):
        StsClient(region="eu-west-1/../x", defer=True)
