"""The webhook's ServiceAccount cache (kiamfast.webhook.accounts), with a clock
and a read of the test's; the real GET against a real API server: test_webhook_apiserver.py.

What a user checks: a burst of pods of one ServiceAccount is one read, an annotation changed
on the account reaches new pods after the TTL, a failing read answers "no annotations" and
is logged once per episode, and the cache stays bounded.
"""
from __future__ import annotations

import logging
import threading

from kiamfast.webhook.accounts import FAILED_TTL, TTL, AccountAnnotations


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Reads:
    def __init__(self, answers):
        self.answers = answers        # (ns, name) -> annotations, or an exception to raise
        self.calls = []

    def __call__(self, namespace, name):
        self.calls.append((namespace, name))
        answer = self.answers[(namespace, name)]
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)


def test_answers_are_cached_for_the_ttl_then_read_again():
    clock, reads = Clock(), Reads({("ns", "app"): {"a": "1"}})
    accounts = AccountAnnotations(reads, clock=clock)
    assert [accounts.get("ns", "app") for _ in range(1000)] == [{"a": "1"}] * 1000
    assert reads.calls == [("ns", "app")]
    reads.answers[("ns", "app")] = {"a": "2"}
    clock.now += TTL - 0.1
    assert accounts.get("ns", "app") == {"a": "1"}
    clock.now += 0.2
    assert accounts.get("ns", "app") == {"a": "2"}
    assert len(reads.calls) == 2


def test_concurrent_asks_for_one_account_share_one_read():
    release = threading.Event()
    calls = []

    def slow_read(namespace, name):
        calls.append(name)
        release.wait(5)
        return {"a": "1"}

    accounts = AccountAnnotations(slow_read)
    results = []
    threads = [threading.Thread(target=lambda: results.append(accounts.get("ns", "app")))
               for _ in range(20)]
    for t in threads:
        t.start()
    while not calls:
        threading.Event().wait(0.01)
    release.set()
    for t in threads:
        t.join(10)
    assert calls == ["app"]
    assert results == [{"a": "1"}] * 20


def test_a_failing_read_answers_none_is_cached_briefly_and_logged_once(caplog):
    clock = Clock()
    reads = Reads({("ns", "a"): PermissionError("403 forbidden"),
                   ("ns", "b"): TimeoutError("timed out")})
    accounts = AccountAnnotations(reads, clock=clock)
    with caplog.at_level(logging.INFO, logger="kiamfast.webhook"):
        assert accounts.get("ns", "a") is None
        assert accounts.get("ns", "a") is None            # cached: no second read
        assert accounts.get("ns", "b") is None            # the same episode: no second line
        assert len(reads.calls) == 2
        clock.now += FAILED_TTL + 0.1
        reads.answers[("ns", "a")] = {"x": "y"}
        assert accounts.get("ns", "a") == {"x": "y"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "cannot read ServiceAccounts" in lines[0] and "403 forbidden" in lines[0]
    assert lines[1] == "reading ServiceAccounts works again"
    assert accounts.failing == ""


def test_the_cache_is_bounded():
    reads = Reads({("ns", str(i)): {} for i in range(50)})
    accounts = AccountAnnotations(reads, size=10)
    for i in range(50):
        accounts.get("ns", str(i))
    assert len(accounts._cache) == 10
    accounts.get("ns", "49")                              # the newest are kept
    assert len(reads.calls) == 50


def test_a_read_from_an_api_server_that_never_answers_ends_within_the_bound(tmp_path, caplog):
    """A real socket that accepts and never answers (a hung API server): the read through
    the agent's API client gives up after READ_TIMEOUT (one attempt, no retries), so the API server's call to the webhook (5 s in the chart) is
    answered, uninjected, before it gives up itself."""
    import socket
    import time

    import yaml

    from kiamfast.webhook.accounts import (
        READ_TIMEOUT,
        api_client,
        service_account_read,
    )
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {
            "server": f"https://127.0.0.1:{hung.getsockname()[1]}",
            "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    accounts = AccountAnnotations(service_account_read(
        lambda: api_client(kubeconfig=str(kubeconfig))))
    try:
        started = time.monotonic()
        assert accounts.get("ns", "app") is None
        took = time.monotonic() - started
    finally:
        hung.close()
    assert READ_TIMEOUT - 0.2 < took < 4.5, took
    assert "cannot read ServiceAccounts" in caplog.text
