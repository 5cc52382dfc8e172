"""The route watch (kiamfast/control/cri/routes.py) against the real kernel.

Each test builds a "host" network namespace and pod namespaces joined to it by veth pairs,
routes the pods' addresses as CNIs do (``ptp``, Calico, the AWS VPC CNI: a /32 or /128 on
the veth's host end; a bridge CNI: a subnet route on the bridge), opens a `RouteWatch` in
the host namespace and changes things under it: a link deleted and a new one made, a host
end moved in from the pod's namespace with the dead pod's interface index (what Calico and
the AWS VPC CNI do), a route moved, policy rules, lost notifications.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import subprocess
import threading
import time
from typing import Any, Callable

import pytest

from kiamfast.control.cri.routes import RouteWatch

pytestmark = pytest.mark.root

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class Namespace:
    """``ip netns add`` under a name of this test run; deleted (with its links) at close."""

    def __init__(self, role: str) -> None:
        self.name = f"kf-rt-{os.getpid()}-{role}-{secrets.token_hex(2)}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        self.ip("link", "set", "lo", "up")

    def ip(self, *argv: str) -> str:
        return subprocess.run(["ip", "-n", self.name, *argv], check=True, capture_output=True,
                              text=True).stdout

    def ifindex(self, link: str) -> int:
        return int(self.ip("-o", "link", "show", link).split(":", 1)[0])

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on a thread inside this namespace: the sockets it opens stay in it."""
        box: dict[str, Any] = {}

        def body() -> None:
            fd = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e
            finally:
                os.close(fd)

        t = threading.Thread(target=body)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0:
        pytest.skip("the route watch tests need root (network namespaces)")
    made: list[Namespace] = []

    def make(role: str) -> Namespace:
        made.append(Namespace(role))
        return made[-1]

    yield make
    for ns in reversed(made):
        ns.close()


@pytest.fixture
def host(namespaces):
    return namespaces("host")


def watch_in(host: Namespace, **kw: Any) -> RouteWatch:
    w = RouteWatch(**kw)
    assert host.call(w.open)
    return w


def pod_veth(host: Namespace, pod: Namespace, link: str, *addresses: str) -> int:
    """A pod's veth as ptp makes it: the pair from the host, the peer in the pod, the host
    end up, a host route per address on it.  Returns the host end's ifindex."""
    host.ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
    host.ip("link", "set", link, "up")
    for address in addresses:
        host.ip("route", "add", address, "dev", link, "scope", "link")
    return host.ifindex(link)


def moved_in_veth(host: Namespace, pod: Namespace, link: str, address: str) -> int:
    """A pod's veth as Calico and the AWS VPC CNI make it: the pair inside the pod's
    namespace, the host end moved out (LinkSetNsFd), then the host route."""
    pod.ip("link", "add", "eth0", "type", "veth", "peer", "name", link)
    pod.ip("link", "set", link, "netns", host.name)
    host.ip("link", "set", link, "up")
    host.ip("route", "add", address, "dev", link, "scope", "link")
    return host.ifindex(link)


def view_now(watch: RouteWatch) -> int:
    """A runtime view begins: the control process refreshes the watch, then polls."""
    watch.refresh()
    return time.monotonic_ns()


def test_a_pod_veth_with_a_host_route_keeps_its_path(host, namespaces):
    w = watch_in(host)
    pod_veth(host, namespaces("pod"), "kfv1", "10.9.0.5/32", "fd09::5/128")
    since = view_now(w)
    assert w.path_kept("10.9.0.5", since) is True
    assert w.path_kept("fd09::5", since) is True
    assert w.path_kept("10.9.0.6", since) is None           # not routed here: no evidence
    host.ip("link", "add", "kfv2", "type", "veth", "peer", "name", "eth0",
            "netns", namespaces("other").name)              # other pods come and go
    host.ip("link", "set", "kfv2", "up")
    host.ip("route", "add", "10.9.0.7/32", "dev", "kfv2")
    w.drain()
    assert w.path_kept("10.9.0.5", since) is True
    assert w.path_kept("10.9.0.7", since) is False          # new since the view


def test_a_bridge_subnet_route_proves_nothing(host, namespaces):
    """The bridge CNI: one subnet route on the bridge for every pod behind it."""
    w = watch_in(host)
    pod = namespaces("pod")
    host.ip("link", "add", "kfbr", "type", "bridge")
    host.ip("addr", "add", "10.9.1.1/24", "dev", "kfbr")
    host.ip("link", "set", "kfbr", "up")
    host.ip("link", "add", "kfp1", "master", "kfbr", "type", "veth", "peer", "name", "eth0",
            "netns", pod.name)
    host.ip("link", "set", "kfp1", "up")
    pod.ip("addr", "add", "10.9.1.5/24", "dev", "eth0")
    since = view_now(w)
    assert w.path_kept("10.9.1.5", since) is None


def test_a_link_deleted_and_a_new_one_made_changes_the_path(host, namespaces):
    w = watch_in(host)
    old = pod_veth(host, namespaces("old"), "kfv1", "10.9.0.5/32")
    since = view_now(w)
    host.ip("link", "del", "kfv1")                          # the old sandbox is gone
    new = pod_veth(host, namespaces("new"), "kfv1", "10.9.0.5/32")   # same name, new pod
    assert new != old
    w.drain()
    assert w.path_kept("10.9.0.5", since) is False
    assert w.path_kept("10.9.0.5", view_now(w)) is True     # a later view vouches for it


def test_a_host_end_moved_in_with_the_dead_pods_ifindex_changes_the_path(host, namespaces):
    """Linux keeps a moved device's index when it is free in the new namespace, so the next
    pod's host end can carry the dead pod's index at once: comparing indexes would take it
    for the same link.  The notifications do not."""
    w = watch_in(host)
    old = moved_in_veth(host, namespaces("old"), "kfeni1", "10.9.0.5/32")
    since = view_now(w)
    assert w.path_kept("10.9.0.5", since) is True
    host.ip("link", "del", "kfeni1")
    new = moved_in_veth(host, namespaces("new"), "kfeni2", "10.9.0.5/32")
    assert new == old, "the kernel did not reuse the index: the case is not reproduced"
    w.drain()
    assert w.path_kept("10.9.0.5", since) is False


def test_a_route_moved_to_another_link_changes_the_path(host, namespaces):
    w = watch_in(host)
    pod_veth(host, namespaces("a"), "kfv1", "10.9.0.5/32", "fd09::5/128")
    pod_veth(host, namespaces("b"), "kfv2")
    since = view_now(w)
    host.ip("route", "replace", "10.9.0.5/32", "dev", "kfv2", "scope", "link")
    host.ip("-6", "route", "replace", "fd09::5/128", "dev", "kfv2")
    w.drain()
    assert w.path_kept("10.9.0.5", since) is False
    assert w.path_kept("fd09::5", since) is False


def test_a_route_through_a_gateway_or_twice_proves_nothing(host, namespaces):
    w = watch_in(host)
    pod_veth(host, namespaces("a"), "kfv1", "10.9.0.5/32")
    host.ip("route", "add", "10.9.0.6/32", "via", "10.9.0.5", "dev", "kfv1")
    host.ip("route", "add", "10.9.0.5/32", "dev", "kfv1", "metric", "10")   # two entries
    since = view_now(w)
    assert w.path_kept("10.9.0.6", since) is None
    assert w.path_kept("10.9.0.5", since) is None


def test_policy_rules_that_cannot_divert_replies_keep_the_evidence(host, namespaces):
    """The AWS VPC CNI's rules for a pod on a secondary ENI: `to <pod> lookup main`,
    `not fwmark 0x80/0x80 lookup main`, `from <pod> lookup <eni table>`."""
    w = watch_in(host)
    pod_veth(host, namespaces("pod"), "kfv1", "10.9.0.5/32")
    host.ip("addr", "add", "10.77.0.1/32", "dev", "lo")     # the node's own address
    host.ip("route", "add", "default", "dev", "lo", "table", "2")
    host.ip("rule", "add", "to", "10.9.0.5/32", "lookup", "main", "pref", "512")
    host.ip("rule", "add", "not", "fwmark", "0x80/0x80", "lookup", "main", "pref", "1024")
    host.ip("rule", "add", "from", "10.9.0.5/32", "lookup", "2", "pref", "1536")
    since = view_now(w)
    assert w.path_kept("10.9.0.5", since) is True
    host.ip("rule", "add", "from", "10.9.0.6/32", "lookup", "2", "pref", "1536")   # a new pod
    w.drain()
    assert w.path_kept("10.9.0.5", since) is True


@pytest.mark.parametrize("rule", [
    ["lookup", "100"],                                   # another table for everything
    ["fwmark", "0x1", "lookup", "100"],                  # for marked traffic
    ["from", "10.77.0.0/24", "lookup", "100"],           # for the node's own address
    ["iif", "lo", "lookup", "100"],                      # for locally generated traffic
    ["to", "10.9.0.0/24", "goto", "32767"],              # past the main table
])
def test_policy_rules_that_may_divert_replies_leave_no_evidence(host, namespaces, rule):
    w = watch_in(host)
    pod_veth(host, namespaces("pod"), "kfv1", "10.9.0.5/32")
    host.ip("addr", "add", "10.77.0.1/24", "dev", "lo")
    before = view_now(w)
    assert w.path_kept("10.9.0.5", before) is True
    host.ip("rule", "add", *rule, "pref", "100")
    w.drain()
    assert w.path_kept("10.9.0.5", before) is None      # changed since that view
    assert w.path_kept("10.9.0.5", view_now(w)) is None  # and in place now
    host.ip("rule", "del", "pref", "100")
    assert w.path_kept("10.9.0.5", view_now(w)) is True


def test_a_unicast_route_in_the_local_table_leaves_no_evidence(host, namespaces):
    """The local table is asked before main: a route there may take replies elsewhere."""
    w = watch_in(host)
    pod_veth(host, namespaces("a"), "kfv1", "10.9.0.5/32")
    pod_veth(host, namespaces("b"), "kfv2")
    since = view_now(w)
    host.ip("route", "add", "10.9.0.0/24", "dev", "kfv2", "table", "local")
    w.drain()
    assert w.path_kept("10.9.0.5", since) is None
    assert w.path_kept("10.9.0.5", view_now(w)) is None
    host.ip("route", "del", "10.9.0.0/24", "dev", "kfv2", "table", "local")
    assert w.path_kept("10.9.0.5", view_now(w)) is True


def test_a_local_address_inside_a_source_rule_leaves_no_evidence(host, namespaces):
    """`from P lookup T` is harmless only while the host holds no address in P: a reply
    leaves from the address the pod connected to."""
    w = watch_in(host)
    pod_veth(host, namespaces("pod"), "kfv1", "10.9.0.5/32")
    host.ip("route", "add", "default", "dev", "lo", "table", "2")
    host.ip("rule", "add", "from", "10.66.0.0/24", "lookup", "2", "pref", "1536")
    since = view_now(w)
    assert w.path_kept("10.9.0.5", since) is True
    host.ip("addr", "add", "10.66.0.1/32", "dev", "lo")
    w.drain()
    assert w.path_kept("10.9.0.5", since) is None
    assert w.path_kept("10.9.0.5", view_now(w)) is None


def test_lost_notifications_restart_the_evidence(host, namespaces):
    w = watch_in(host, rcvbuf=4096)
    pod_veth(host, namespaces("pod"), "kfv1", "10.9.0.5/32")
    since = view_now(w)
    batch = "".join(f"route add 10.9.{n // 250 + 2}.{n % 250 + 1}/32 dev kfv1\n"
                    for n in range(500))
    subprocess.run(["ip", "-n", host.name, "-batch", "-"], input=batch, text=True, check=True)
    w.drain()
    assert w.stats["overruns"] >= 1
    assert w.path_kept("10.9.0.5", since) is None       # changes may have gone unseen
    assert w.path_kept("10.9.0.5", view_now(w)) is True


def test_a_host_with_many_pods(host, namespaces):
    """250 pods (twice the kubelet's default maximum): every answer right after one dump."""
    pods = [namespaces(f"p{n}") for n in range(250)]
    batch = []
    for n, pod in enumerate(pods):
        batch += [f"link add kfv{n} type veth peer name eth0 netns {pod.name}",
                  f"link set kfv{n} up",
                  f"route add 10.9.{n // 200}.{n % 200 + 1}/32 dev kfv{n} scope link"]
    subprocess.run(["ip", "-n", host.name, "-batch", "-"], input="\n".join(batch) + "\n",
                   text=True, check=True)
    w = watch_in(host)
    since = view_now(w)
    kept = [w.path_kept(f"10.9.{n // 200}.{n % 200 + 1}", since) for n in range(250)]
    assert kept == [True] * 250


def test_a_watch_that_cannot_open_its_dump_socket_closes_its_subscription(host, monkeypatch):
    """No descriptor left behind when the second socket fails (EMFILE, a seccomp filter):
    open() says False and the control process goes on without the watch."""
    from kiamfast.control.cri import routes
    real_subscribe, opened = routes.subscribe, []

    def subscribe(rcvbuf: int):
        opened.append(real_subscribe(rcvbuf))
        return opened[-1]

    def no_dumps(**kw):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(routes, "subscribe", subscribe)
    monkeypatch.setattr(routes, "Dumps", no_dumps)
    w = RouteWatch()
    assert host.call(w.open) is False
    assert not w.watching
    assert [s.fileno() for s in opened] == [-1]     # closed
