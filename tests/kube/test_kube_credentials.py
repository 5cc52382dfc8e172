"""kiamfast.kube.credentials: a rotating token file re-read when it changes (at most every
few seconds, at once after a 401), and exec plugins run, cached until they expire, and run
again after a 401. Real files and a real plugin process; the clock is injected."""
from __future__ import annotations

import datetime
import json
import os
import sys
import textwrap

import pytest

from kiamfast.kube import credentials as creds


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rotate(path, token: str) -> None:
    """As the kubelet does: write a new file beside it, rename it over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(token)
    os.replace(tmp, path)


# ---- token files ------------------------------------------------------------------------------

def test_token_file_is_reread_when_it_changes_at_most_every_interval(tmp_path):
    path = tmp_path / "token"
    path.write_text("first\n")
    clock = Clock()
    token = creds.TokenFile(str(path), what="token", check_interval=5.0, clock=clock)
    assert token.authorization() == "Bearer first" and token.fresh()
    rotate(path, "second")
    clock.now += 4.9
    assert token.authorization() == "Bearer first"        # not checked yet
    clock.now += 0.2
    assert not token.fresh()
    assert token.authorization() == "Bearer second"
    assert token.reads == 2
    clock.now += 10
    assert token.authorization() == "Bearer second" and token.reads == 2   # unchanged: no read


def test_a_401_makes_the_next_call_read_the_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("expired")
    clock = Clock()
    token = creds.TokenFile(str(path), what="token", check_interval=60.0, clock=clock)
    rotate(path, "renewed")
    token.rejected("Bearer someone-else")          # a 401 for another value changes nothing
    assert token.authorization() == "Bearer expired"
    token.rejected("Bearer expired")
    assert not token.fresh()
    assert token.authorization() == "Bearer renewed"


def test_a_file_being_swapped_or_emptied_keeps_the_last_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("good")
    clock = Clock()
    token = creds.TokenFile(str(path), what="token", check_interval=1.0, clock=clock)
    os.unlink(path)
    clock.now += 2
    assert token.authorization() == "Bearer good"
    path.write_text("")
    clock.now += 2
    assert token.authorization() == "Bearer good"
    path.write_text("next")
    clock.now += 2
    assert token.authorization() == "Bearer next"


# ---- exec plugins ------------------------------------------------------------------------------

PLUGIN = textwrap.dedent("""\
    #!{python}
    # A credential plugin as aws eks get-token is: reads KUBERNETES_EXEC_INFO, prints an
    # ExecCredential. Each run appends a line to $RUNS and answers with the next token of
    # $TOKENS (the last one again when they run out).
    import json, os, sys
    info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
    runs = os.environ["RUNS"]
    with open(runs, "a") as f:
        f.write(json.dumps({{"args": sys.argv[1:], "info": info,
                             "region": os.environ.get("AWS_REGION")}}) + "\\n")
    n = sum(1 for _ in open(runs))
    if os.environ.get("FAIL"):
        print("something went wrong", file=sys.stderr)
        print("error: no credentials for cluster", file=sys.stderr)
        sys.exit(3)
    tokens = os.environ.get("TOKENS", "").split(",")
    status = {{"token": tokens[min(n, len(tokens)) - 1]}}
    if os.environ.get("CERT"):
        status = {{"clientCertificateData": open(os.environ["CERT"]).read(),
                  "clientKeyData": open(os.environ["KEY"]).read()}}
    if os.environ.get("EXPIRES"):
        status["expirationTimestamp"] = os.environ["EXPIRES"]
    print(os.environ.get("OUTPUT") or json.dumps({{"apiVersion": info["apiVersion"],
                                                   "kind": "ExecCredential",
                                                   "status": status}}))
    """)


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "get-token"
    path.write_text(PLUGIN.format(python=sys.executable))
    path.chmod(0o755)
    runs = tmp_path / "runs"

    def make(*, env=None, clock=None, api_version="client.authentication.k8s.io/v1",
             cluster=None):
        return creds.ExecPlugin(command=str(path), args=["eks", "get-token"],
                                env={"RUNS": str(runs), **(env or {})},
                                api_version=api_version, what="user 'eks'", cluster=cluster,
                                clock=clock or Clock())
    make.runs = lambda: [json.loads(line) for line in runs.read_text().splitlines()] \
        if runs.exists() else []
    return make


def stamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def test_exec_plugin_runs_once_and_is_cached_until_it_expires(plugin):
    clock = Clock(1_700_000_000.0)
    p = plugin(env={"TOKENS": "one,two", "EXPIRES": stamp(clock.now + 900),
                    "AWS_REGION": "eu-west-1"}, clock=clock)
    assert not p.fresh()
    assert p.authorization() == "Bearer one"
    assert p.authorization() == "Bearer one" and p.fresh()
    runs = plugin.runs()
    assert len(runs) == 1
    assert runs[0]["args"] == ["eks", "get-token"] and runs[0]["region"] == "eu-west-1"
    assert runs[0]["info"] == {"apiVersion": "client.authentication.k8s.io/v1",
                               "kind": "ExecCredential", "spec": {"interactive": False}}
    clock.now += 899
    assert p.authorization() == "Bearer one"
    clock.now += 1
    assert not p.fresh()
    assert p.authorization() == "Bearer two" and len(plugin.runs()) == 2


def test_exec_plugin_runs_again_after_a_401(plugin):
    p = plugin(env={"TOKENS": "stale,good"})            # no expiry: cached until refused
    assert p.authorization() == "Bearer stale"
    p.rejected("Bearer other")
    assert p.authorization() == "Bearer stale" and len(plugin.runs()) == 1
    p.rejected("Bearer stale")
    assert p.authorization() == "Bearer good" and len(plugin.runs()) == 2


def test_exec_plugin_v1beta1_with_cluster_info_and_a_client_certificate(plugin, pki):
    cluster = {"server": "https://k8s:6443", "certificate-authority-data": "Q0E="}
    p = plugin(api_version="client.authentication.k8s.io/v1beta1", cluster=cluster,
               env={"CERT": str(pki["cert"]), "KEY": str(pki["key"])})
    assert p.authorization() is None
    assert p.client_cert() == (pki["cert"].read_bytes(), pki["key"].read_bytes())
    assert plugin.runs()[0]["info"]["spec"] == {"interactive": False, "cluster": cluster}
    assert plugin.runs()[0]["info"]["apiVersion"] == "client.authentication.k8s.io/v1beta1"


@pytest.mark.parametrize("env, message", [
    ({"FAIL": "1"}, "user 'eks': exec plugin '{cmd}' exited with 3: error: no credentials "
                    "for cluster"),
    ({"OUTPUT": "not json"}, "user 'eks': exec plugin '{cmd}': its output is not JSON"),
    ({"OUTPUT": '{"apiVersion": "client.authentication.k8s.io/v1beta1", '
                '"kind": "ExecCredential", "status": {"token": "t"}}'},
     "user 'eks': exec plugin '{cmd}': it answered 'client.authentication.k8s.io/v1beta1', "
     "not 'client.authentication.k8s.io/v1'"),
    ({"OUTPUT": '{"apiVersion": "client.authentication.k8s.io/v1", '
                '"kind": "ExecCredential", "status": {}}'},
     "user 'eks': exec plugin '{cmd}': its ExecCredential has neither a token nor a client "
     "certificate"),
    ({"TOKENS": "t", "EXPIRES": "tomorrow"},
     "user 'eks': exec plugin '{cmd}': expirationTimestamp 'tomorrow' is not an RFC 3339 "
     "time"),
])
def test_exec_plugin_failures_are_one_line_and_retried_next_time(plugin, tmp_path, env,
                                                                 message):
    p = plugin(env=env)
    for attempt in (1, 2):
        with pytest.raises(creds.CredentialError) as e:
            p.authorization()
        assert str(e.value) == message.format(cmd=tmp_path / "get-token")
        assert len(plugin.runs()) == attempt          # not cached: the next call runs it
