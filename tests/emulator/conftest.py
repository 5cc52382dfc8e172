"""Fixtures for the API server emulator tests: a running emulator and real-client handles."""

from __future__ import annotations

import json
from typing import Iterator

import pytest
from kubernetes import client, config

from kiamfast.testing.apiserver import ApiServer


@pytest.fixture
def srv() -> Iterator[ApiServer]:
    with ApiServer(bookmark_interval=0.2) as server:
        yield server


@pytest.fixture
def kubeconfig(srv: ApiServer, tmp_path) -> str:
    return srv.write_kubeconfig(tmp_path / "kubeconfig")


def make_api(kubeconfig_path: str) -> client.CoreV1Api:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig_path), client_configuration=cfg)
    return client.CoreV1Api(client.ApiClient(cfg))


@pytest.fixture
def api(kubeconfig: str) -> client.CoreV1Api:
    return make_api(kubeconfig)


@pytest.fixture
def api_factory():
    """Build a CoreV1Api from a kubeconfig path (for second clients, wrong tokens, ...)."""
    return make_api


@pytest.fixture
def read_events():
    """Parse a raw watch response into events (see ``raw_events``)."""
    return raw_events


def raw_events(resp) -> Iterator[dict]:
    """Parse a raw (``_preload_content=False``) watch response into events, line by line."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
    assert not buf.strip(), f"partial line at stream end: {buf!r}"


@pytest.fixture
def caught_up(srv: ApiServer, read_events):
    """Watch with ``list_fn`` until a bookmark reports the server's current RV; return the
    non-bookmark events (a fast, exact alternative to waiting for ``timeoutSeconds``)."""

    def run(list_fn, **kw) -> list[dict]:
        target = int(srv.resource_version)
        kw.setdefault("_request_timeout", 15)
        resp = list_fn(watch=True, _preload_content=False, allow_watch_bookmarks=True, **kw)
        out = []
        for ev in read_events(resp):
            if ev["type"] == "BOOKMARK":
                if int(ev["object"]["metadata"]["resourceVersion"]) >= target:
                    resp.close()
                    break
                continue
            out.append(ev)
        return out

    return run
