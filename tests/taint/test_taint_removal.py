"""Removing the startup taint, against the API server emulator over real HTTP.

What an operator checks: after the agent is ready its node no longer carries
``kiamfast.io/agent-not-ready``, every other taint is untouched, and a concurrent change to
the node's taints (another controller) neither loses that change nor leaves our taint behind.
"""

from __future__ import annotations

import pytest

from kubernetes import client
from taint_support import KEY, OTHER, core_api, taints

from kiamfast.control.taint import TaintError, remove_startup_taint

OURS_NOEXEC = {"key": KEY, "value": "true", "effect": "NoExecute"}
OURS_NOSCHED = {"key": KEY, "effect": "NoSchedule"}
UNREACHABLE = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}


def test_removes_only_our_taint(srv, tmp_path):
    srv.add_node("node-a", taints=[OTHER, OURS_NOEXEC, UNREACHABLE])
    api = core_api(srv, tmp_path)
    assert remove_startup_taint(api, "node-a", KEY) is True
    assert taints(srv, "node-a") == [OTHER, UNREACHABLE]
    # Idempotent: a second call finds nothing to do.
    assert remove_startup_taint(api, "node-a", KEY) is False
    assert taints(srv, "node-a") == [OTHER, UNREACHABLE]


def test_removes_every_effect_of_our_key(srv, tmp_path):
    srv.add_node("node-b", taints=[OURS_NOSCHED, OTHER, OURS_NOEXEC])
    assert remove_startup_taint(core_api(srv, tmp_path), "node-b", KEY) is True
    assert taints(srv, "node-b") == [OTHER]


def test_only_taint_leaves_an_untainted_node(srv, tmp_path):
    srv.add_node("node-c", taints=[OURS_NOEXEC])
    assert remove_startup_taint(core_api(srv, tmp_path), "node-c", KEY) is True
    assert taints(srv, "node-c") == []


def test_absent_taint_and_disabled_key(srv, tmp_path):
    srv.add_node("node-d")
    api = core_api(srv, tmp_path)
    assert remove_startup_taint(api, "node-d", KEY) is False
    srv.add_node("node-e", taints=[OURS_NOEXEC])
    assert remove_startup_taint(api, "node-e", "") is False  # --node-startup-taint=""
    assert taints(srv, "node-e") == [OURS_NOEXEC]


def test_missing_node_is_a_clear_error(srv, tmp_path):
    with pytest.raises(TaintError, match="not found") as e:
        remove_startup_taint(core_api(srv, tmp_path), "no-such-node", KEY)
    assert e.value.status == 404


def test_concurrent_change_between_read_and_patch_is_kept(srv, tmp_path):
    """Another controller adds a taint right after our read: our JSON patch's test fails,
    we read again, and both its taint survives and ours goes."""
    srv.add_node("node-f", taints=[OURS_NOEXEC])
    reads = []

    class RacingApi(client.CoreV1Api):
        def read_node(self, name, **kw):
            response = super().read_node(name, **kw)
            reads.append(name)
            if len(reads) == 1:  # the node lifecycle controller strikes
                srv.set_node_taints(name, [UNREACHABLE, OURS_NOEXEC])
            return response

    api = core_api(srv, tmp_path, RacingApi)
    assert remove_startup_taint(api, "node-f", KEY) is True
    assert len(reads) == 2
    assert taints(srv, "node-f") == [UNREACHABLE]


def test_someone_else_removing_it_first_is_not_an_error(srv, tmp_path):
    srv.add_node("node-g", taints=[OTHER, OURS_NOEXEC])

    class RacingApi(client.CoreV1Api):
        def read_node(self, name, **kw):
            response = super().read_node(name, **kw)
            if taints(srv, name) != [OTHER]:
                srv.set_node_taints(name, [OTHER])
            return response

    assert remove_startup_taint(core_api(srv, tmp_path, RacingApi), "node-g", KEY) is False
    assert taints(srv, "node-g") == [OTHER]


def test_losing_the_race_every_time_gives_up(srv, tmp_path):
    srv.add_node("node-h", taints=[OURS_NOEXEC, OTHER])

    class AlwaysRacing(client.CoreV1Api):
        def read_node(self, name, **kw):
            response = super().read_node(name, **kw)
            # Right after every read, someone reorders the list: our entry moves.
            srv.set_node_taints(name, list(reversed(taints(srv, name))))
            return response

    with pytest.raises(TaintError, match="after 3 attempts"):
        remove_startup_taint(core_api(srv, tmp_path, AlwaysRacing), "node-h", KEY, attempts=3)
    assert sorted(map(str, taints(srv, "node-h"))) == sorted(map(str, [OURS_NOEXEC, OTHER]))


def test_changes_elsewhere_in_the_list_do_not_matter(srv, tmp_path):
    srv.add_node("node-k", taints=[OTHER, OURS_NOEXEC])

    class Racing(client.CoreV1Api):
        def read_node(self, name, **kw):
            response = super().read_node(name, **kw)
            srv.set_node_taints(name, [UNREACHABLE, OURS_NOEXEC])  # index 1 is still ours
            return response

    assert remove_startup_taint(core_api(srv, tmp_path, Racing), "node-k", KEY) is True
    assert taints(srv, "node-k") == [UNREACHABLE]


def test_transient_server_errors_are_retried(srv, tmp_path):
    srv.add_node("node-i", taints=[OURS_NOEXEC])
    srv.fail_next(2, status=500, path_prefix="/api/v1/nodes/node-i")
    assert remove_startup_taint(core_api(srv, tmp_path), "node-i", KEY) is True
    assert taints(srv, "node-i") == []


def test_forbidden_names_the_missing_permission(srv, tmp_path):
    srv.add_node("node-j", taints=[OURS_NOEXEC])
    srv.fail_next(1, status=403, path_prefix="/api/v1/nodes/node-j")
    with pytest.raises(TaintError, match="get and patch on nodes") as e:
        remove_startup_taint(core_api(srv, tmp_path), "node-j", KEY)
    assert e.value.status == 403
