"""The fake metadata service the other tests rely on behaves like IMDS and records everything."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from kiamfast.testing.fake_imds import FakeImds


def call(fake, path, *, method="GET", headers=None):
    req = urllib.request.Request(fake.url + path, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_token_flow_and_records():
    with FakeImds(token_mode="required") as fake:
        assert call(fake, "/latest/meta-data/instance-id")[0] == 401
        status, token, headers = call(fake, "/latest/api/token", method="PUT",
                                      headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        assert status == 200 and headers["X-Aws-Ec2-Metadata-Token-Ttl-Seconds"] == "60"
        assert headers["Server"] == "EC2ws"
        status, body, _ = call(fake, "/latest/meta-data/instance-id",
                               headers={"X-aws-ec2-metadata-token": token.decode()})
        assert (status, body) == (200, b"i-0fa4e1a5e0000cafe")
        assert [r.path for r in fake.requests] == [
            "/latest/meta-data/instance-id", "/latest/api/token",
            "/latest/meta-data/instance-id"]
        assert fake.requests[-1].token == token.decode()


@pytest.mark.parametrize("ttl", ["", "0", "21601", "x"])
def test_bad_ttl_is_400(ttl):
    with FakeImds() as fake:
        assert call(fake, "/latest/api/token", method="PUT",
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})[0] == 400


def test_node_secrets_are_marked():
    with FakeImds() as fake:
        status, body, _ = call(fake, "/latest/meta-data/iam/security-credentials/eks-node-role")
        assert status == 200 and json.loads(body)["AccessKeyId"].startswith("ASIANODE")
        assert b"NODE-SECRET" in call(fake, "/latest/user-data")[1]
        assert call(fake, "/2021-07-15/meta-data/placement/region")[1] == b"eu-west-1"


def test_v1_only_mode_refuses_the_put():
    with FakeImds(token_mode="v1-only", token_put_status=404) as fake:
        assert call(fake, "/latest/api/token", method="PUT",
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})[0] == 404
        assert call(fake, "/latest/meta-data/instance-id")[0] == 200


def test_runs_as_a_process():
    proc = subprocess.Popen([sys.executable, "-m", "kiamfast.testing.fake_imds", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = json.loads(proc.stdout.readline())
        host, port = line["listening"].rsplit(":", 1)
        with urllib.request.urlopen(f"http://{host}:{port}/latest/meta-data/instance-id",
                                    timeout=5) as resp:
            assert resp.read() == b"i-0fa4e1a5e0000cafe"
    finally:
        proc.terminate()
        proc.wait(5)
