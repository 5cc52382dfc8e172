"""What the STS client sends: the same bytes botocore's stock client sends, verified on the wire.

The client leaves botocore's legacy endpoint table out (kiamfast/control/iam/sts.py). The
reference is the client kiamfast built before that change, ``create_client('sts')`` on a
plain session: for the same inputs and the same clock, both must produce the same request,
byte for byte: URL, body, every header (the per-request ``amz-sdk-invocation-id`` UUID
aside), so the same SigV4 signature. Then moto, with its signature check switched on,
accepts what the client signs and refuses a wrong key the way STS does; proxies from the
environment and TLS verification against ``AWS_CA_BUNDLE`` behave as botocore's.

Nothing leaves loopback: requests to AWS host names are answered by a ``before-send``
handler in the process, never sent.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
import threading
import urllib.request

import pytest

from kiamfast.control.iam.sts import StsClient, StsTransient

ROLE = "arn:aws:iam::123456789012:role/team/app"
FIXED = dt.datetime(2026, 5, 1, 12, 0, 0)   # what botocore's clock returns: naive UTC
ANSWER = b"""<AssumeRoleResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
<AssumeRoleResult><Credentials><AccessKeyId>ASIAEXAMPLEEXAMPLE00</AccessKeyId>
<SecretAccessKey>secret</SecretAccessKey><SessionToken>token</SessionToken>
<Expiration>2026-05-01T12:30:00Z</Expiration></Credentials>
<AssumedRoleUser><AssumedRoleId>AROAEXAMPLE:node-1-app</AssumedRoleId>
<Arn>arn:aws:sts::123456789012:assumed-role/app/node-1-app</Arn></AssumedRoleUser>
</AssumeRoleResult><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata>
</AssumeRoleResponse>"""

REGIONS = [
    "us-east-1", "eu-west-1", "ap-southeast-7", "xx-new-1",     # aws (one no table lists)
    "cn-north-1", "us-gov-west-1", "us-iso-east-1", "us-isob-east-1", "eu-isoe-west-1",
    "eusc-de-east-1",                                            # the other partitions
    "aws-global", "us-east-1-fips", "us-gov-east-1-fips",        # pseudo-regions
]
VARIANTS = {"plain": {}, "fips": {"AWS_USE_FIPS_ENDPOINT": "true"},
            "dualstack": {"AWS_USE_DUALSTACK_ENDPOINT": "true"},
            "fips+dualstack": {"AWS_USE_FIPS_ENDPOINT": "true",
                               "AWS_USE_DUALSTACK_ENDPOINT": "true"}}


def stock_client(region: str, endpoint_url: str | None):
    """The client as kiamfast built it before issue 32: the reference."""
    import botocore.config
    import botocore.session
    session = botocore.session.get_session()
    session.set_config_variable("sts_regional_endpoints", "regional")
    config = botocore.config.Config(
        retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=2.0,
        read_timeout=5.0, max_pool_connections=8, user_agent_extra="kiamfast")
    return session.create_client("sts", region_name=region, endpoint_url=endpoint_url,
                                 config=config)


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def capture(client) -> dict:
    """Answer the next AssumeRole in the process and return the request as prepared."""
    import botocore.awsrequest
    seen: dict = {}

    def before_send(request, **_):
        seen.update(method=request.method, url=request.url, body=request.body,
                    headers={k: v for k, v in request.headers.items()
                             if k.lower() != "amz-sdk-invocation-id"})
        return botocore.awsrequest.AWSResponse(request.url, 200, {}, _Body(ANSWER))

    client.meta.events.register("before-send.sts.AssumeRole", before_send)
    return seen


def kiamfast_request(region: str, endpoint_url: str | None) -> tuple[dict, str]:
    client = StsClient(region=region, endpoint_url=endpoint_url)
    try:
        seen = capture(client.load())
        creds = client.assume_role_sync(ROLE, "node-1-app", external_id="ext-1", duration=1800,
                                        tags=[("kiamfast-namespace", "ns"), ("team", "a b")],
                                        transitive=True)
        assert creds.access_key_id == "ASIAEXAMPLEEXAMPLE00"
        return seen, client.endpoint_url
    finally:
        client.close()


def stock_request(region: str, endpoint_url: str | None) -> dict:
    client = stock_client(region, endpoint_url)
    seen = capture(client)
    client.assume_role(RoleArn=ROLE, RoleSessionName="node-1-app", DurationSeconds=1800,
                       ExternalId="ext-1",
                       Tags=[{"Key": "kiamfast-namespace", "Value": "ns"},
                             {"Key": "team", "Value": "a b"}],
                       TransitiveTagKeys=["kiamfast-namespace", "team"])
    client.close()
    return seen


@pytest.fixture
def frozen_clock(monkeypatch):
    import botocore.auth
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: FIXED)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("region", REGIONS)
def test_the_signed_request_is_botocores_own(region, variant, frozen_clock, monkeypatch):
    for name, value in VARIANTS[variant].items():
        monkeypatch.setenv(name, value)
    try:
        reference = stock_request(region, None)
    except Exception as exc:        # botocore refuses the combination: so must we, alike
        with pytest.raises(type(exc)):
            kiamfast_request(region, None)
        return
    ours, endpoint = kiamfast_request(region, None)
    assert ours == reference
    assert b"Signature=" in ours["headers"]["Authorization"]
    assert endpoint + "/" == ours["url"]           # endpoint_url says where calls go


@pytest.mark.parametrize("region", ["eu-west-1", "cn-north-1", "aws-global"])
def test_an_endpoint_given_is_signed_for_as_botocore_does(region, frozen_clock):
    ours, endpoint = kiamfast_request(region, "http://127.0.0.1:9")
    assert ours == stock_request(region, "http://127.0.0.1:9")
    assert endpoint == "http://127.0.0.1:9"


def test_the_endpoint_table_is_left_out_only_where_the_rule_set_decides_alone(monkeypatch):
    import botocore.loaders
    read: list[str] = []
    load_file = botocore.loaders.JSONFileLoader.load_file

    def spy(self, path, *args, **kwargs):
        read.append(os.path.basename(path))
        return load_file(self, path, *args, **kwargs)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", spy)

    def tables_read(region: str) -> list[str]:
        read.clear()
        StsClient(region=region, endpoint_url=None).close()
        return sorted(set(read))

    eu = tables_read("eu-west-1")
    assert "endpoints" not in eu and "endpoint-rule-set-1" in eu and "service-2" in eu
    assert "endpoints" in tables_read("aws-global")        # a pseudo-region: as before
    monkeypatch.setenv("AWS_USE_DUALSTACK_ENDPOINT", "true")
    assert "endpoints" in tables_read("eu-west-1")         # dualstack: as before


# ---- on the wire ---------------------------------------------------------------------------------

def _moto_auth(moto_url: str, count: str) -> None:
    """moto's switch for its signature and IAM checks: on after ``count`` more actions."""
    urllib.request.urlopen(urllib.request.Request(
        moto_url + "/moto-api/reset-auth", data=count.encode(), method="POST",
        headers={"Content-Type": "text/plain"}), timeout=10).read()


def test_moto_checking_signatures_accepts_ours_and_refuses_a_wrong_key(moto_sts, proxy,
                                                                       monkeypatch):
    import botocore.session
    iam = botocore.session.get_session().create_client("iam", region_name="us-east-1",
                                                       endpoint_url=moto_sts.url)
    _moto_auth(moto_sts.url, "3")        # the three IAM calls below, then every call checked
    try:
        iam.create_user(UserName="kiamfast-node")
        key = iam.create_access_key(UserName="kiamfast-node")["AccessKey"]
        iam.put_user_policy(UserName="kiamfast-node", PolicyName="assume", PolicyDocument=(
            json.dumps({"Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}]})))
        outcomes = {}
        for label, key_id, secret in [("ours", key["AccessKeyId"], key["SecretAccessKey"]),
                                      ("wrong secret", key["AccessKeyId"], "x" * 40),
                                      ("unknown key", "AKIAUNKNOWNUNKNOWN00", "y" * 40)]:
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
            client = StsClient(endpoint_url=proxy.url)
            try:
                outcomes[label] = client.assume_role_sync(ROLE, "n1").access_key_id[:4]
            except StsTransient as exc:
                outcomes[label] = (exc.code, exc.status)
            finally:
                client.close()
    finally:
        _moto_auth(moto_sts.url, "inf")
    assert outcomes == {"ours": "ASIA", "wrong secret": ("SignatureDoesNotMatch", 403),
                        "unknown key": ("InvalidClientTokenId", 403)}


def test_a_proxy_from_the_environment_carries_the_calls(proxy, monkeypatch):
    # HTTP_PROXY here, with an http:// endpoint whose name resolves nowhere: the call can
    # only arrive through the proxy (botocore takes HTTPS_PROXY the same way, and tunnels).
    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    client = StsClient(endpoint_url="http://sts.kiamfast-test.invalid")
    try:
        assert client.assume_role_sync(ROLE, "n1").access_key_id.startswith("ASIA")
    finally:
        client.close()
    (call,) = proxy.assume_role_calls()
    assert call.role_arn == ROLE


class _TlsFront:
    """TLS on 127.0.0.1 with a self-signed certificate, relayed as plain bytes to moto."""

    def __init__(self, upstream_port: int, tmp_path):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
        import ipaddress
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiamfast test sts")])
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(hours=1))
                .add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        self.cert_file = tmp_path / "sts-ca.pem"
        self.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file = tmp_path / "sts-key.pem"
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(self.cert_file, key_file)
        self._upstream = upstream_port
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn):
        try:
            tls = self._ctx.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()            # the client refused our certificate
            return
        up = socket.create_connection(("127.0.0.1", self._upstream))

        def pump(src, dst):
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(up, tls), daemon=True).start()
        pump(tls, up)

    def close(self):
        self._sock.close()


def test_tls_is_verified_against_the_system_bundle_or_aws_ca_bundle(proxy, tmp_path,
                                                                     monkeypatch):
    front = _TlsFront(int(proxy.url.rsplit(":", 1)[1]), tmp_path)
    try:
        monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
        client = StsClient(endpoint_url=front.url)
        try:
            with pytest.raises(StsTransient) as info:
                client.assume_role_sync(ROLE, "n1")
        finally:
            client.close()
        assert info.value.code == "SSLError"
        assert proxy.assume_role_calls() == []             # nothing sent to an unknown peer
        monkeypatch.setenv("AWS_CA_BUNDLE", str(front.cert_file))
        client = StsClient(endpoint_url=front.url)
        try:
            assert client.assume_role_sync(ROLE, "n1").access_key_id.startswith("ASIA")
        finally:
            client.close()
        assert len(proxy.assume_role_calls()) == 1
    finally:
        front.close()


def test_the_lean_loader_finds_a_service_by_its_own_directory_as_botocore_would():
    import botocore.exceptions
    import botocore.loaders
    from kiamfast.control.iam.sts_session import lean_loader
    stock = botocore.loaders.Loader()
    lean = lean_loader(stock)
    services = lean.list_available_services("service-2")
    assert "sts" in services and "sso" in services            # the chain's own clients
    assert "no-such-service" not in services and "../sts" not in services
    assert list(services) == stock.list_available_services("service-2")
    assert lean.load_service_model("sso", "service-2") == stock.load_service_model(
        "sso", "service-2")
    with pytest.raises(botocore.exceptions.UnknownServiceError):
        lean.load_service_model("no-such-service", "service-2")
