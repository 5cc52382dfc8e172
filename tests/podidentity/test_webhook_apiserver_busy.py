"""The injection webhook's "try again" answer, as the session's real kube-apiserver takes it.

When the webhook's memory budgets are full it answers 429 with ``Retry-After: 1`` instead of
reading more (kiamfast/webhook/limits.py).  What a user checks: the API server's client waits
and calls again within the configuration's ``timeoutSeconds`` (5 s), so a pod created while
the webhook is briefly busy still comes back injected; a webhook busy for the whole call
leaves the pod created uninjected (``failurePolicy: Ignore``), never refused.
"""
from __future__ import annotations

import logging
import threading
import time

import kube
import pytest
from test_webhook_apiserver import (CONFIGS, OPTED_IN, TEST_LABEL, create_namespace,
                                    create_pod, injected, unique, wait_until_registered,
                                    webhook_configuration)

from kiamfast.webhook import limits
from kiamfast.webhook import server as webhook_server

pytestmark = pytest.mark.kube_apiserver

SETTINGS = {"role_key": "iam.amazonaws.com/role", "audience": "kiamfast.io/container-credentials",
            "expiration": 600}


@pytest.fixture
def busy_webhook(cluster, tmp_path):
    """The webhook's server in this process (its budgets in reach), registered for a
    namespace of its own."""
    admin = cluster.admin
    ns = unique("webhook-busy")
    create_namespace(admin, ns, {TEST_LABEL: ns})
    pki = kube.make_pki(tmp_path / "pki")
    srv = webhook_server.make_server(listen=("127.0.0.1", 0), cert=str(pki["cert"]),
                                     key=str(pki["key"]), settings=SETTINGS)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        admin.call("POST", CONFIGS, webhook_configuration(
            ns, port=srv.server_address[1], ca=pki["ca"], namespace_label=ns))
        wait_until_registered(admin, ns)
        yield admin, ns, srv
    finally:
        admin.request("DELETE", f"{CONFIGS}/{ns}")
        srv.shutdown()
        srv.server_close()


def fill(budget) -> int:
    """Reserve all of ``budget``, in reservations small enough to be allowed all of it."""
    held = 0
    while budget.reserve(min(limits.SMALL_COST, budget.total - held), timeout=0) \
            and held < budget.total:
        held += min(limits.SMALL_COST, budget.total - held)
    assert budget.used == budget.total
    return held


def test_a_pod_created_while_the_webhook_is_busy_is_injected_after_a_retry(busy_webhook,
                                                                           caplog):
    admin, ns, srv = busy_webhook
    caplog.set_level(logging.WARNING, logger="kiamfast.webhook")
    held = fill(srv.parsed)                      # as reviews being parsed would
    threading.Timer(1.5, srv.parsed.release, (held,)).start()
    started = time.monotonic()
    pod = create_pod(admin, ns, "while-busy", OPTED_IN)
    assert injected(pod)
    assert time.monotonic() - started >= 1.0                   # it waited Retry-After
    assert "refused 429" in caplog.text


def test_a_pod_created_while_the_webhook_stays_busy_is_created_uninjected(busy_webhook,
                                                                          caplog):
    admin, ns, srv = busy_webhook
    caplog.set_level(logging.WARNING, logger="kiamfast.webhook")
    held = fill(srv.parsed)
    try:
        pod = create_pod(admin, ns, "stays-busy", OPTED_IN)
    finally:
        srv.parsed.release(held)
    assert pod["metadata"]["uid"] and not injected(pod)
    assert "refused 429" in caplog.text
