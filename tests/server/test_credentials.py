"""Credential routes (sdk-imds.md §10 L1–L8, C1–C8 where the worker decides) and kube2iam §3."""

from __future__ import annotations

import json
import re
import time

import pytest

from kiamfast import channel, table

from server_support import ACCOUNT, BASE_ARN

LIST = "/latest/meta-data/iam/security-credentials/"
TOKEN = "X-aws-ec2-metadata-token"
EXPIRATION_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def authed(server, path, *, source="127.0.0.1", method="GET"):
    token = server.token(source=source)
    return server.get(path, source=source, method=method, headers={TOKEN: token})


# ---- listing -------------------------------------------------------------------------------

def test_l1_listing_is_exactly_the_role_name(make_server, pods, loop_kind):
    server = make_server(loop_kind=loop_kind)
    pods.add("127.0.0.1", "app-role")
    r = authed(server, LIST)
    assert r.status == 200
    assert r.body == b"app-role"
    assert r.header("Content-Type") == "text/plain"


def test_l2_listing_without_trailing_slash(server, pods):
    pods.add("127.0.0.1", "app-role")
    assert authed(server, LIST.rstrip("/")).body == b"app-role"


@pytest.mark.parametrize("version", ["2016-09-02", "2021-07-15", "latest"])
def test_l3_any_version_prefix(server, pods, version):
    pods.add("127.0.0.1", "app-role")
    r = authed(server, f"/{version}/meta-data/iam/security-credentials/")
    assert (r.status, r.body) == (200, b"app-role")


def test_l4_garbage_expired_and_foreign_tokens_are_401(server, pods):
    from kiamfast.server.tokens import TokenSigner

    pods.add("127.0.0.1", "app-role")
    garbage = server.get(LIST, headers={TOKEN: "not-a-token"})
    assert garbage.status == 401
    foreign = TokenSigner(b"some-other-agent-key-0123456789!").issue(
        table.ip_key("127.0.0.1"), 21600, int(time.time())).decode()
    assert server.get(LIST, headers={TOKEN: foreign}).status == 401
    short = server.token(ttl=1)
    assert server.get(LIST, headers={TOKEN: short}).status == 200
    time.sleep(2.1)
    assert server.get(LIST, headers={TOKEN: short}).status == 401


def test_l5_tokenless_get_is_served_in_optional_mode(server, pods):
    pods.add("127.0.0.1", "app-role")
    r = server.get(LIST)
    assert (r.status, r.body) == (200, b"app-role")


def test_l5_tokenless_get_is_401_in_required_mode(make_server, pods):
    server = make_server(imdsv2="required")
    pods.add("127.0.0.1", "app-role")
    assert server.get(LIST).status == 401
    assert server.get(LIST + "app-role").status == 401
    assert server.get("/latest/meta-data/placement/region").status == 401
    r = authed(server, LIST)
    assert (r.status, r.body) == (200, b"app-role")


def test_l6_pod_without_role_is_404_with_kube2iam_text(server, pods):
    pods.add("127.0.0.1", None)
    r = server.get(LIST)
    assert r.status == 404
    assert r.text == "unable to find role for IP 127.0.0.1\n"
    assert server.get(LIST + "anything").status == 404


def test_unknown_ip_when_synced_is_404_with_kube2iam_text(server, pods):
    r = server.get(LIST, source="127.0.0.77")
    assert r.status == 404
    assert r.text == 'pod with specificed IP "127.0.0.77" not found\n'
    # synced and nobody pending: no waiting, but the control process still hears nothing
    assert server.waiting() == 0


def test_a_pod_without_a_role_is_404_and_never_anothers_role(server, pods):
    """kube2iam's --default-role applies to pods without an annotation (the control process
    decides that); the worker never serves a role to an address no pod owns."""
    pods.add("127.0.0.1", None)
    pods.add("127.0.0.2", "own-role")
    assert server.get(LIST, source="127.0.0.1").status == 404
    assert server.get(LIST, source="127.0.0.2").body == b"own-role"


def test_denied_pod_is_404(server, pods):
    pods.add("127.0.0.1", "forbidden-role", pod_state=table.POD_DENIED)
    r = server.get(LIST)
    assert r.status == 404
    assert "not valid for its namespace" in r.text


def test_denied_pod_gets_kube2iams_text_once_the_control_process_names_the_role(
        server, pods, writer):
    pods.add("127.0.0.3", "forbidden-role", uid="uid-denied", pod_state=table.POD_DENIED)
    writer.write_aux(table.AUX_DENIALS, json.dumps(
        {"uid-denied": [BASE_ARN + "forbidden-role", "shop"]}).encode())
    r = server.get(LIST, source="127.0.0.3")
    assert (r.status, r.text) == (404, f"role requested {BASE_ARN}forbidden-role not valid "
                                       f"for namespace of pod at 127.0.0.3 with namespace shop\n")
    writer.write_aux(table.AUX_DENIALS, b"not json")      # garbage: the generic text, no 500
    assert server.get(LIST, source="127.0.0.3").status == 404


# ---- L8: paths that must be intercepted, whatever their spelling -----------------------------

@pytest.mark.parametrize("path", [
    "//latest/meta-data/iam/security-credentials/",
    "/latest/meta-data/iam//security-credentials/",
    "/latest/meta-data/./iam/security-credentials/",
    "/latest/meta-data/iam%2Fsecurity-credentials/",
    "/latest/meta-data/iam%2fsecurity-credentials",
    "/latest/meta-data/x/../iam/security-credentials/",
    "/latest/meta-data/%69am/security-credentials/",
    "/latest/META-DATA/IAM/SECURITY-CREDENTIALS/",
    "/latest/meta-data\\iam\\security-credentials\\",
    "/latest/meta-data/iam/security-credentials/?x=1",
])
def test_l8_odd_spellings_are_intercepted(server, pods, imds, path):
    pods.add("127.0.0.1", "app-role")
    r = server.get(path)
    assert r.status in (200, 400, 404), r
    if r.status == 200:
        assert r.body == b"app-role"
    assert imds.requests == []


@pytest.mark.parametrize("path", [
    "/latest/meta-data/iam/security-credentials%252F",
    "/latest/meta-data/iam;x=1/security-credentials/",
    "/latest/meta-data/%zz/iam",
])
def test_l8_refused_spellings_are_400_and_never_upstream(server, imds, path):
    assert server.get(path).status == 400
    assert imds.requests == []


# ---- documents -----------------------------------------------------------------------------

def test_c1_document_has_every_field(server, pods):
    pods.add("127.0.0.1", "app-role")
    r = authed(server, LIST + "app-role")
    assert r.status == 200
    doc = json.loads(r.body)
    for key in ("Code", "LastUpdated", "Type", "AccessKeyId", "SecretAccessKey", "Token",
                "Expiration"):
        assert key in doc, key
    assert doc["Code"] == "Success"
    assert doc["Type"] == "AWS-HMAC"
    assert EXPIRATION_RE.match(doc["Expiration"])
    expires = time.mktime(time.strptime(doc["Expiration"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert expires - time.time() >= 15 * 60
    assert r.header("Content-Type") == "text/plain"
    assert r.header("Content-Length") == str(len(r.body))


def test_c2_repeat_get_returns_the_same_keys(server, pods):
    pods.add("127.0.0.1", "app-role")
    a = json.loads(server.get(LIST + "app-role").body)["AccessKeyId"]
    b = json.loads(server.get(LIST + "app-role").body)["AccessKeyId"]
    assert a == b


def test_c2_new_credentials_in_the_table_are_served_at_once(server, pods):
    pods.add("127.0.0.1", "app-role", access_key="ASIAFIRST")
    assert json.loads(server.get(LIST + "app-role").body)["AccessKeyId"] == "ASIAFIRST"
    pods.role_slot("app-role", access_key="ASIASECOND")  # the control process rotated
    assert json.loads(server.get(LIST + "app-role").body)["AccessKeyId"] == "ASIASECOND"


def test_c3_another_role_name_is_404(server, pods):
    pods.add("127.0.0.1", "app-role")
    r = authed(server, LIST + "other-role")
    assert r.status == 404
    assert r.text == "Invalid role other-role\n"


def test_document_accepts_kube2iam_names_too(server, pods):
    pods.add("127.0.0.1", "team/app-role")  # a role with a path
    assert server.get(LIST).body == b"app-role"
    for name in ("app-role", "team/app-role", BASE_ARN + "team/app-role"):
        assert server.get(LIST + name).status == 200, name


def test_c4_permanent_sts_failure_is_200_with_an_error_document(server, pods):
    pods.add("127.0.0.1", "app-role", error_code="AccessDenied")
    r = server.get(LIST + "app-role")
    assert r.status == 200
    assert json.loads(r.body)["Code"] == "AssumeRoleUnauthorizedAccess"


def test_c4_transient_sts_failure_is_503(server, pods):
    pods.add("127.0.0.1", "app-role", state=table.CRED_ERROR)
    assert server.get(LIST + "app-role").status == 503
    assert server.get(LIST).status == 503


def test_expired_credentials_are_503_and_asked_for(server, pods):
    slot = pods.add("127.0.0.1", "app-role", serve_for=-1)
    assert server.get(LIST + "app-role").status == 503
    assert (channel.WANT_CREDENTIALS, slot) in server.messages()


def test_c6_extended_listing_and_document(server, pods, imds):
    pods.add("127.0.0.1", "app-role")
    listing = authed(server, "/latest/meta-data/iam/security-credentials-extended/")
    assert (listing.status, listing.body) == (200, b"app-role")
    assert server.get("/latest/meta-data/iam/security-credentials-extended").body == b"app-role"
    doc = server.get("/latest/meta-data/iam/security-credentials-extended/app-role")
    assert doc.status == 200
    assert json.loads(doc.body)["AccountId"] == ACCOUNT
    assert server.get("/latest/meta-data/iam/security-credentials-extended/x").status == 404
    assert imds.requests == []


def test_c7_iam_info_is_synthesized_for_the_pod_role(server, pods, imds):
    pods.add("127.0.0.1", "app-role")
    r = server.get("/latest/meta-data/iam/info")
    assert r.status == 200
    info = json.loads(r.body)
    assert info["InstanceProfileArn"].endswith(":instance-profile/app-role")
    assert imds.identity.node_role not in r.text
    assert server.get("/latest/meta-data/iam/info", source="127.0.0.50").status == 404
    assert imds.requests == []


@pytest.mark.parametrize("path", [
    "/latest/meta-data/identity-credentials/ec2/security-credentials/ec2-instance",
    "/latest/meta-data/identity-credentials/",
    "/latest/user-data",
    "/latest/user-data/",
    "/2009-04-04/user-data",
    "/latest/meta-data/iam",
    "/latest/meta-data/iam/",
    "/latest/meta-data/iam/whatever",
    "/meta-data/iam/security-credentials/",
])
def test_c8_blocked_paths_are_404_and_never_upstream(server, pods, imds, path):
    pods.add("127.0.0.1", "app-role")
    r = server.get(path)
    assert r.status == 404
    assert b"NODE" not in r.body
    assert imds.requests == []


# ---- kube2iam compatibility ------------------------------------------------------------------

@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE", "PATCH"])
def test_credential_routes_take_any_method(server, pods, method):
    pods.add("127.0.0.1", "app-role")
    r = server.get(LIST, method=method)
    assert (r.status, r.body) == (200, b"app-role")


def test_head_gets_the_headers_without_the_body(server, pods):
    pods.add("127.0.0.1", "app-role")
    r = server.get(LIST + "app-role", method="HEAD")
    assert r.status == 200
    assert int(r.header("Content-Length")) > 100


def test_ip_reuse_is_seen_on_the_same_connection(server, pods):
    """IPs get reused: the table is consulted on every request, never cached per connection."""
    from server_support import Client, build

    pods.add("127.0.0.1", "role-a", uid="pod-a")
    with Client(server.port) as c:
        assert c.request(build("GET", LIST)).body == b"role-a"
        pods.add("127.0.0.1", "role-b", uid="pod-b")  # pod B got A's address
        assert c.request(build("GET", LIST)).body == b"role-b"
        pods.t.release_ip("127.0.0.1", "pod-b")
        assert c.request(build("GET", LIST)).status == 404


def test_many_pods_each_get_their_own_role(server, pods):
    for i in range(2, 40):
        pods.add(f"127.0.0.{i}", f"role-{i}")
    for i in range(2, 40):
        r = server.get(LIST + f"role-{i}", source=f"127.0.0.{i}")
        assert r.status == 200
        assert json.loads(r.body)["AccessKeyId"] == pods.keys[BASE_ARN + f"role-{i}"]


def test_ipv6_clients_are_looked_up_by_their_ipv6_address(server, pods):
    pods.add("::1", "v6-role")
    from server_support import Client, build

    with Client(server.port, host="::1", source="::1") as c:
        r = c.request(build("GET", LIST))
    assert (r.status, r.body) == (200, b"v6-role")


def test_the_node_address_never_gets_credentials(make_server, pods, writer):
    """hostNetwork pods and the node itself share the node IP: no pod's role, no default."""
    pods.add("127.0.0.9", "some-pod-role")  # even if the table (wrongly) had it
    pods.add("127.0.0.10", "default-role")
    server = make_server(host_ip="127.0.0.9")
    r = server.get(LIST, source="127.0.0.9")
    assert r.status == 404
    assert r.text == "unable to find role for IP 127.0.0.9\n"
    assert server.get(LIST + "default-role", source="127.0.0.9").status == 404
    assert server.get(LIST, source="127.0.0.10").body == b"default-role"
