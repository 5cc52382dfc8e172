"""The kernel's word on who holds an address (kiamfast/control/netns/watch.py), against the
real kernel: network namespaces, veths and addresses made here, in a namespace standing for
the node that this test's thread enters (as the agent runs in the node's).

What it must get right: an address counts for a sandbox only while it is configured in that
sandbox's namespace and in no other namespace the watch sees (the node's own included); a
change reaches it through notifications, without a poll; a namespace that goes away takes
its addresses with it, and the nsid the kernel gives the next namespace never makes the
next namespace's addresses the old sandbox's; a path that is no network namespace, the
node's own, or gone proves nothing.
"""
from __future__ import annotations

import ctypes
import os
import select
import subprocess
import time
from types import SimpleNamespace

import pytest

from kiamfast.control.netns import wire
from kiamfast.control.netns.watch import NetnsWatch

pytestmark = pytest.mark.root

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=20)


@pytest.fixture
def node():
    """A fresh namespace standing for the node, entered by this thread; helpers to make
    pod namespaces with veths into it."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid()}-{os.urandom(3).hex()}"
    made: list[str] = []

    def netns(name: str) -> str:
        full = f"kfw-{name}-{tag}"
        ip("netns", "add", full)
        made.append(full)
        return full

    node_name = netns("node")
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    fd = os.open(f"/var/run/netns/{node_name}", os.O_RDONLY)
    assert _libc.setns(fd, CLONE_NEWNET) == 0
    os.close(fd)
    links = [0]

    def pod(name: str, *addresses: str, link: bool = True) -> SimpleNamespace:
        """A pod namespace holding ``addresses`` on eth0 (a veth into the node)."""
        full = netns(name)
        if link:
            links[0] += 1
            ip("link", "add", f"kfw{links[0]}", "type", "veth", "peer", "name", "eth0",
               "netns", full)
            ip("-n", full, "link", "set", "eth0", "up")
        for address in addresses:
            ip("-n", full, "addr", "add", address, "dev", "eth0" if link else "lo",
               *(["nodad"] if ":" in address else []))
        return SimpleNamespace(name=full, path=f"/var/run/netns/{full}")

    try:
        yield SimpleNamespace(name=node_name, netns=netns, pod=pod)
    finally:
        _libc.setns(home, CLONE_NEWNET)
        os.close(home)
        for full in made:
            subprocess.run(["ip", "netns", "del", full], capture_output=True, timeout=20)


def sandbox(sandbox_id: str, path: str) -> SimpleNamespace:
    return SimpleNamespace(id=sandbox_id, netns=path)


def settle(watch: NetnsWatch, wanted, timeout: float = 5.0) -> None:
    """Notifications only, no poll: drain whenever the socket is readable."""
    deadline = time.monotonic() + timeout
    while not wanted():
        left = deadline - time.monotonic()
        assert left > 0, "the watch never saw the change"
        if select.select([watch.fileno()], [], [], left)[0]:
            watch.refresh()


@pytest.fixture
def watch(node):
    w = NetnsWatch()
    w.open()
    yield w
    w.close()


def test_an_address_counts_only_in_the_one_namespace_holding_it(node, watch):
    a = node.pod("a", "10.9.0.5/24", "fd00:9::5/64")
    sb = sandbox("sb-a", a.path)
    watch.track([sb])
    assert watch.addresses_of(sb) == {"10.9.0.5", "fd00:9::5"}   # no loopback, no fe80::
    b = node.pod("b", "10.9.0.5/24")           # the same address in a second namespace
    settle(watch, lambda: watch.addresses_of(sb) == {"fd00:9::5"})
    ip("-n", b.name, "addr", "del", "10.9.0.5/24", "dev", "eth0")
    settle(watch, lambda: watch.addresses_of(sb) == {"10.9.0.5", "fd00:9::5"})
    ip("addr", "add", "10.9.0.5/32", "dev", "lo")   # the node's own address: nobody's
    settle(watch, lambda: watch.addresses_of(sb) == {"fd00:9::5"})


def test_crio_order_the_address_leaves_at_once_and_the_next_namespace_has_it(node, watch):
    a = node.pod("a", "10.9.0.7/24")
    sb_a = sandbox("sb-a", a.path)
    watch.track([sb_a])
    assert watch.addresses_of(sb_a) == {"10.9.0.7"}
    ip("link", "del", "kfw1")                  # CNI DEL: the veth pair and the address go
    settle(watch, lambda: watch.addresses_of(sb_a) == frozenset())
    b = node.pod("b", "10.9.0.7/24")           # CNI ADD of the next sandbox
    sb_b = sandbox("sb-b", b.path)
    watch.track([sb_a, sb_b])
    assert watch.addresses_of(sb_a) == frozenset()
    assert watch.addresses_of(sb_b) == {"10.9.0.7"}


def test_a_namespace_without_an_nsid_gets_one_and_its_notifications(node, watch):
    c = node.pod("c", "10.9.0.9/32", link=False)   # no veth: the kernel gave it no nsid
    sb = sandbox("sb-c", c.path)
    watch.track([sb])
    assert watch.addresses_of(sb) == {"10.9.0.9"}
    ip("-n", c.name, "addr", "add", "169.254.172.9/32", "dev", "lo")
    settle(watch, lambda: watch.addresses_of(sb) == {"10.9.0.9", "169.254.172.9"})


def test_a_deleted_namespaces_nsid_never_carries_the_next_ones_addresses_to_it(node, watch):
    a = node.pod("a", "10.9.0.11/24")
    sb_a = sandbox("sb-a", a.path)
    watch.track([sb_a])
    requests = wire.Requests()
    fd = os.open(a.path, os.O_RDONLY)
    nsid_a = requests.nsid(fd)
    os.close(fd)
    ip("netns", "del", a.name)
    settle(watch, lambda: watch.addresses_of(sb_a) is None)
    # The kernel hands the lowest free nsid to the next namespace: often a's.
    b = node.pod("b", "10.9.0.12/24")
    fd = os.open(b.path, os.O_RDONLY)
    assert requests.nsid(fd) >= 0
    os.close(fd)
    requests.close()
    watch.refresh()
    assert watch.addresses_of(sb_a) is None, nsid_a
    assert watch.addresses_of(sandbox("sb-b", b.path)) is None     # not tracked
    watch.track([sb_a, sandbox("sb-b", b.path)])
    assert watch.addresses_of(sb_a) is None
    assert watch.addresses_of(sandbox("sb-b", b.path)) == {"10.9.0.12"}


@pytest.mark.parametrize("what", ["missing", "not a namespace", "the node's own", "empty"])
def test_a_path_that_is_no_sandbox_namespace_proves_nothing(node, watch, tmp_path, what,
                                                            caplog):
    path = {"missing": str(tmp_path / "gone"),
            "not a namespace": str(tmp_path / "file"),
            "the node's own": "/proc/thread-self/ns/net",
            "empty": ""}[what]
    (tmp_path / "file").write_text("x")
    sb = sandbox("sb-x", path)
    watch.track([sb])
    assert watch.addresses_of(sb) is None
    watch.track([sb])                          # asked again later: logged once
    assert len([r for r in caplog.records if "sb-x" in r.getMessage()]) == 1


def test_an_overrun_forgets_everything_and_reads_it_again(node):
    a = node.pod("a", "10.9.0.20/24")
    sb = sandbox("sb-a", a.path)
    watch = NetnsWatch(rcvbuf=4096)            # tiny: a burst overruns it
    watch.open()
    try:
        watch.track([sb])
        for i in range(200):
            ip("-n", a.name, "addr", "add", f"10.9.1.{i}/32", "dev", "eth0")
        ip("-n", a.name, "addr", "del", "10.9.0.20/24", "dev", "eth0")
        watch.refresh()
        assert watch.counters["overruns"] >= 1
        held = watch.addresses_of(sb)
        assert held is not None and "10.9.0.20" not in held and len(held) == 200
    finally:
        watch.close()


def test_without_net_broadcast_the_watch_cannot_open(node, tmp_path):
    """The agent needs CAP_NET_BROADCAST to hear other namespaces: without it, open() says
    so (the control process then refuses to start, naming it)."""
    script = ("from kiamfast.control.netns.watch import NetnsWatch\n"
              "try:\n    NetnsWatch().open()\nexcept OSError as e:\n    print('refused', e)\n"
              "else:\n    print('opened')\n")
    proc = subprocess.run(["setpriv", "--bounding-set=-net_broadcast", "--inh-caps=-all",
                           "ip", "netns", "exec", node.name, "python3", "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith("refused"), proc.stdout + proc.stderr
