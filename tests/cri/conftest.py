"""Fixtures of the container-runtime tests: a real containerd, and the CRI fault double.

The real containerd (tests/cri/containerd.py) runs once per session inside a fresh network
namespace standing for the node, dual-stack (10.88.0.0/24 and fd00:88::/64 from
host-local), so sandboxes get an IPv6 `additional_ips` entry too. Each test gets it clean:
afterwards its sandboxes are removed, host-local's range is reset, and a containerd the
test killed is started again. Without root, containerd, runc or the CNI plugins those
tests skip naming the tool and `sh tests/cri/setup.sh` (in CI the skip policy fails them).

The fault double (kiamfast/testing/cri_fault.py) needs nothing: one per test.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from containerd import Containerd, NodeNetns, unavailable_reason  # noqa: E402

from kiamfast.control.cri.client import RuntimeClient, RuntimeView  # noqa: E402
from kiamfast.control.cri.poller import RuntimePoller  # noqa: E402
from kiamfast.testing.cri_fault import CriFault  # noqa: E402


@pytest.fixture(scope="session")
def containerd_available():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def node_netns(containerd_available):
    """The node's network namespace (loopback up), where containerd and its bridge live."""
    node = NodeNetns()
    try:
        yield node
    finally:
        node.delete()


@pytest.fixture(scope="session")
def session_containerd(node_netns):
    runtime = Containerd(netns=node_netns.name, subnet="10.88.0.0/24", subnet6="fd00:88::/64")
    try:
        runtime.start()
        yield runtime
    finally:
        runtime.close()


@pytest.fixture
def containerd(test_failed, session_containerd):
    """The session's containerd, running, with no sandbox and the whole range."""
    runtime = session_containerd
    if runtime.process is None:
        runtime.start()
    try:
        yield runtime
    finally:
        if test_failed():
            print(f"--- containerd log ({runtime.dir}) ---\n{runtime.log_tail()}")
        if runtime.process is None or runtime.process.poll() is not None:
            runtime.start()
        for sandbox_id in list(runtime.sandboxes):
            runtime.remove_sandbox(sandbox_id)
        runtime.set_range(None, None)


@pytest.fixture
def cri_fault():
    with CriFault() as runtime:
        yield runtime


@pytest.fixture
def client(cri_fault):
    """A client of the fault double with a short deadline (0.5 s); test_runtime_client.py
    has its own, of the real containerd."""
    c = RuntimeClient(cri_fault.endpoint, timeout=0.5)
    try:
        yield c
    finally:
        c.close()


class ViewRecorder:
    """What a RuntimePoller hands its owner: every view and every health change, and a way
    to ask for a view as the lead's request path will (need(T), then wait for S >= T)."""

    def __init__(self) -> None:
        self.views: list[RuntimeView] = []
        self.states: list[tuple[bool, str]] = []
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def on_view(self, view: RuntimeView) -> None:
        self.views.append(view)
        for after_ns, future in self._waiters:
            if view.started_ns >= after_ns and not future.done():
                future.set_result(view)
        self._waiters = [(a, f) for a, f in self._waiters if not f.done()]

    def on_state(self, healthy: bool, message: str) -> None:
        self.states.append((healthy, message))

    async def view_after(self, poller: RuntimePoller, after_ns: int, *,
                         timeout: float = 5.0) -> RuntimeView:
        """The first view applied whose started_ns >= after_ns, asked for with need()."""
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((after_ns, future))
        poller.need(after_ns)
        return await asyncio.wait_for(future, timeout)

    async def until(self, predicate, *, timeout: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not reached in {timeout} s; states={self.states}")
            await asyncio.sleep(0.01)


@pytest.fixture
def recorder():
    return ViewRecorder()
