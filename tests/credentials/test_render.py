"""The rendered parts: what a worker sends must be what real IMDS sends and SDKs accept."""
from __future__ import annotations

import datetime as dt

import orjson
import pytest
from botocore.credentials import InstanceMetadataProvider
from botocore.utils import InstanceMetadataFetcher
from hypothesis import given
from hypothesis import strategies as st

from kiamfast import table as tbl
from kiamfast import credential_parts

ARN = "arn:aws:iam::123456789012:role/team/app"
BASE = "arn:aws:iam::123456789012:role/"
EXP = dt.datetime(2026, 5, 8, 12, 30, 0, 999999, tzinfo=dt.timezone.utc)
NOW = dt.datetime(2026, 5, 8, 11, 30, 7, 250000, tzinfo=dt.timezone.utc).timestamp()


def creds_parts(**kw):
    args = dict(role_arn=ARN, base_role_arn=BASE, access_key_id="ASIAEXAMPLE",
                secret_access_key="secret/+=", session_token="token==", expiration=EXP,
                last_updated=NOW)
    args.update(kw)
    return credential_parts.render_credentials(**args)


def test_the_response_parts_come_before_the_key_part():
    # The five response parts; the manager adds PART_KEY (credential_parts.key_part) after them.
    assert tbl.PART_KEY == len(creds_parts())
    assert credential_parts.PART_COUNT == tbl.PART_KEY + 1 <= tbl.MAX_PARTS


def test_names_listing_name_first_then_kube2iam_form_then_arn():
    names = creds_parts()[tbl.PART_NAMES].decode().split("\n")
    assert names == ["app", "team/app", ARN]
    # no base ARN, or another account: the name and the full ARN
    assert credential_parts.role_names(ARN) == ["app", ARN]
    other = "arn:aws:iam::999999999999:role/app"
    assert credential_parts.role_names(other, BASE) == ["app", other]
    # no path: the relative form equals the name, listed once
    assert credential_parts.role_names(BASE + "app", BASE) == ["app", BASE + "app"]
    # base ARN given without the trailing slash
    assert credential_parts.role_names(ARN, BASE.rstrip("/")) == ["app", "team/app", ARN]


@given(st.text(alphabet=st.characters(codec="ascii", exclude_characters="\n\r"),
               min_size=1, max_size=600))
def test_names_always_fit_the_tables_matcher(path):
    names = credential_parts.role_names(BASE + path, BASE)
    assert names
    assert len("\n".join(names).encode()) <= credential_parts.NAMES_LIMIT


def test_every_response_is_a_complete_imds_style_http_response():
    parts = creds_parts()
    for index in (tbl.PART_LISTING, tbl.PART_DOCUMENT, tbl.PART_EXT_DOCUMENT,
                  tbl.PART_INFO):
        raw = parts[index]
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        status, headers, body = credential_parts.parse_response(raw)
        assert headers["content-type"] == "text/plain"
        assert headers["server"] == "EC2ws"
        assert headers["accept-ranges"] == "none"
        assert headers["last-modified"] == "Fri, 08 May 2026 11:30:07 GMT"
        assert int(headers["content-length"]) == len(body)
        assert "date" not in headers and "connection" not in headers
    assert credential_parts.parse_response(parts[tbl.PART_LISTING])[2] == b"app"


def test_document_fields_order_and_formats():
    body = credential_parts.parse_response(creds_parts()[tbl.PART_DOCUMENT])[2]
    doc = orjson.loads(body)
    assert list(doc) == ["Code", "LastUpdated", "Type", "AccessKeyId", "SecretAccessKey",
                         "Token", "Expiration"]
    assert doc["Code"] == "Success" and doc["Type"] == "AWS-HMAC"
    assert doc["Expiration"] == "2026-05-08T12:30:00Z"        # UTC, fraction dropped
    assert doc["LastUpdated"] == "2026-05-08T11:30:07Z"
    assert doc["SecretAccessKey"] == "secret/+=" and doc["Token"] == "token=="
    dt.datetime.strptime(doc["Expiration"], "%Y-%m-%dT%H:%M:%SZ")  # botocore's strict form


def test_expiration_in_another_timezone_is_written_in_utc():
    cet = dt.timezone(dt.timedelta(hours=2))
    parts = creds_parts(expiration=EXP.astimezone(cet))
    doc = orjson.loads(credential_parts.parse_response(parts[tbl.PART_DOCUMENT])[2])
    assert doc["Expiration"] == "2026-05-08T12:30:00Z"
    with pytest.raises(credential_parts.RenderError):
        creds_parts(expiration=EXP.replace(tzinfo=None))


def test_extended_document_adds_the_account_of_the_role():
    parts = creds_parts()
    doc = orjson.loads(credential_parts.parse_response(parts[tbl.PART_DOCUMENT])[2])
    ext = orjson.loads(credential_parts.parse_response(parts[tbl.PART_EXT_DOCUMENT])[2])
    assert ext == {**doc, "AccountId": "123456789012"}


def test_info_names_an_instance_profile_for_the_pods_role():
    info = orjson.loads(credential_parts.parse_response(creds_parts()[tbl.PART_INFO])[2])
    assert info["Code"] == "Success"
    assert info["InstanceProfileArn"] == "arn:aws:iam::123456789012:instance-profile/app"
    assert info["InstanceProfileId"].startswith("AIPA") and len(info["InstanceProfileId"]) == 21
    assert info["InstanceProfileId"] == credential_parts.instance_profile_id(ARN)
    assert credential_parts.instance_profile_id(ARN) != credential_parts.instance_profile_id(BASE + "other")
    cn = "arn:aws-cn:iam::123456789012:role/app"
    assert credential_parts.instance_profile_arn(cn) == "arn:aws-cn:iam::123456789012:instance-profile/app"


def test_error_parts_list_the_name_and_carry_the_imds_error_document():
    parts = credential_parts.render_error(role_arn=ARN, base_role_arn=BASE, code="AccessDenied",
                                last_updated=NOW)
    assert parts[tbl.PART_NAMES] == creds_parts()[tbl.PART_NAMES]
    assert credential_parts.parse_response(parts[tbl.PART_LISTING])[2] == b"app"
    for index in (tbl.PART_DOCUMENT, tbl.PART_EXT_DOCUMENT):
        status, _, body = credential_parts.parse_response(parts[index])
        doc = orjson.loads(body)
        assert status == 200
        assert doc["Code"] == "AssumeRoleUnauthorizedAccess"
        assert doc["LastUpdated"] == "2026-05-08T11:30:07Z"
        assert "app" in doc["Message"] and "AccessDenied" in doc["Message"]
        assert "AccessKeyId" not in doc


def test_parts_fit_a_table_slot(tmp_path):
    t = tbl.Table.create(str(tmp_path / "t"), ip_capacity=8, cred_capacity=1, value_size=8192,
                         aux_count=0, aux_size=64, max_workers=1)
    parts = creds_parts(session_token="x" * 1400)  # real session tokens: ~800-1200 chars
    t.write_cred(0, parts, serve_until=EXP.timestamp() - 900, state=tbl.CRED_READY)
    state, until, read = t.read_cred(0)
    assert read == parts and state == tbl.CRED_READY
    t.close()


@pytest.mark.parametrize("path", ["app", "team/app"])
def test_botocore_loads_the_rendered_document(imds_stub, path):
    """botocore's own IMDS credential provider, against the bytes a worker would send."""
    exp = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)).replace(microsecond=0)
    parts = creds_parts(expiration=exp, last_updated=dt.datetime.now(dt.timezone.utc))
    with imds_stub(lambda: parts) as stub:
        fetcher = InstanceMetadataFetcher(timeout=2, num_attempts=1, base_url=stub.url, env={})
        creds = InstanceMetadataProvider(iam_role_fetcher=fetcher).load()
        assert creds is not None
        frozen = creds.get_frozen_credentials()
        assert (frozen.access_key, frozen.secret_key, frozen.token) == (
            "ASIAEXAMPLE", "secret/+=", "token==")
        assert creds._expiry_time == exp  # parsed, not "static stability" rewritten
        assert not creds.refresh_needed()
        # botocore asked for the listing, then for the listed name
        assert stub.requests[-1] == "GET /latest/meta-data/iam/security-credentials/app"
        # a URL naming the role kube2iam-style is accepted too
        names = parts[tbl.PART_NAMES].decode().split("\n")
        assert path in names


def test_botocore_gets_no_credentials_from_the_error_document(imds_stub):
    parts = credential_parts.render_error(role_arn=ARN, base_role_arn=BASE, code="AccessDenied",
                                last_updated=NOW)
    with imds_stub(lambda: parts) as stub:
        fetcher = InstanceMetadataFetcher(timeout=2, num_attempts=1, base_url=stub.url, env={})
        assert InstanceMetadataProvider(iam_role_fetcher=fetcher).load() is None


def test_key_part_round_trips_and_garbage_is_refused():
    part = credential_parts.key_part(role_arn="arn:aws:iam::1:role/a", external_id="x", session="node",
                           tags=(("kiamfast-pod", "p"),), access_key_id="ASIA1",
                           expiration=2000.0, fetched_at=1000.0)
    assert b"secret" not in part.lower()
    rec = credential_parts.parse_key_part([b""] * tbl.PART_KEY + [part])
    assert rec["role_arn"] == "arn:aws:iam::1:role/a" and rec["tags"] == [("kiamfast-pod", "p")]
    assert rec["expiration"] == 2000.0 and rec["denied"] is False
    for junk in (b"", b"{", b"[]", b'{"v":2}', b'{"v":1,"role_arn":"a"}'):
        assert credential_parts.parse_key_part([b""] * tbl.PART_KEY + [junk]) is None
    assert credential_parts.parse_key_part([b""] * 3) is None
