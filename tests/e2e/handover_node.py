"""Agents that hand an end-to-end node over, and pods asking through the DNAT all along.

The agents share what the chart's hostPath shares (the table, the token key, the handover
socket: a directory of the node's workdir, mode 0700); each has its own ready file, as each
pod has its own container file system.  Pods ask with :class:`steady_calls.Caller` threads
that live in the pod's network namespace and connect to 169.254.169.254:80, so every call
goes through the node's real DNAT rules.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from e2e_cluster import NODE_ACCESS_KEY_PREFIX, Agent, Node, Pod
from netns import METADATA_IP, Netns, _setns

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from steady_calls import Call, Caller, summary  # noqa: E402

KEEP_RULES = ["--iptables-check-interval=1s", "--iptables-backstop"]


def state_dir(node: Node) -> Path:
    path = node.workdir / "state"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def handover_agent(node: Node, name: str, *, handover: bool = True,
                   keeper: str | None = None, extra: list[str] = ()) -> Agent:
    """An agent of the node's DaemonSet (not started), with the shared state."""
    state = state_dir(node)
    args = [f"--table-path={state / 'table'}", f"--token-key-file={state / 'token-key'}",
            f"--ready-file={node.workdir / f'ready-{name}'}", *KEEP_RULES]
    if handover:
        args.append(f"--handover-socket={state / 'handover.sock'}")
    if keeper:
        args.append(f"--socket-keeper={keeper}")
    agent = node.agent(extra_args=[*args, *extra])
    agent.ready_path = node.workdir / f"ready-{name}"
    return agent


def serving(agent: Agent) -> bool:
    return agent.ready_path.exists()


def idle(agent: Agent) -> bool:
    return agent.running() and agent.children() == {}


def wait_until(condition, what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(what() if callable(what) else what)
        time.sleep(0.02)


def entering(ns: Netns):
    def enter() -> None:
        fd = os.open(ns.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(fd)
        finally:
            os.close(fd)
    return enter


def pod_callers(pods: list[Pod], *, interval: float = 0.05, timeout: float = 1.0,
                keep_alive: tuple[bool, ...] = (False, True)) -> list[Caller]:
    """For each pod one caller per ``keep_alive`` entry, started."""
    out = []
    for pod in pods:
        for k in keep_alive:
            caller = Caller(METADATA_IP, 80, pod.role, keep_alive=k, interval=interval,
                            timeout=timeout, enter=entering(pod.net.ns),
                            name_=f"{pod.name}-{'ka' if k else 'fresh'}")
            caller.pod = pod
            caller.start()
            out.append(caller)
    return out


def stop_all(callers: list[Caller]) -> list[tuple[Pod, Call]]:
    return [(caller.pod, call) for caller in callers for call in caller.stop()]


def node_role(calls: list[tuple[Pod, Call]]) -> list[Call]:
    return [c for _, c in calls if c.access_key and c.access_key.startswith(
        NODE_ACCESS_KEY_PREFIX)]


def another_role(node: Node, calls: list[tuple[Pod, Call]]) -> list[tuple[Pod, Call]]:
    """Answers whose key STS did not issue for the asking pod's role."""
    return [(p, c) for p, c in calls if c.ok and node.sts.role_of(c.access_key) != p.role]


def outcomes(calls: list[tuple[Pod, Call]]) -> dict[str, int]:
    return summary([c for _, c in calls])


def failed(calls: list[tuple[Pod, Call]]) -> list[Call]:
    return [c for _, c in calls if not c.ok]


__all__ = ["KEEP_RULES", "another_role", "failed", "handover_agent", "idle", "node_role",
           "outcomes", "pod_callers", "serving", "state_dir", "stop_all", "wait_until"]
