"""The agent's link to the runtime, reached through a mount as the DaemonSet reaches it.

The agent runs in a mount namespace of its own that sees the real containerd's socket the
way a container does: through a bind mount of the socket *file* (what the manifests did)
or of its *directory* (what they do now).  containerd recreates its socket when it
restarts, so a file mount keeps the dead inode: the agent's link is dead while containerd
goes on working for the rest of the node.  That is the case where a stale runtime view once
handed a new pod the previous pod's role; STS judges every answer here.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from e2e_cluster import assert_own_role, wrong_answers
from runtime_node import RuntimeNode, wait_until

pytestmark = pytest.mark.root


def bind_mounted(source: Path, target: Path) -> list[str]:
    """argv prefix: run the rest in a new mount namespace where `source` is bind-mounted
    on `target` (a file or a directory, as a container's hostPath volume); a slave of the
    host's, as a container's HostToContainer mounts are (the sandboxes' network namespaces
    the runtime mounts later reach it)."""
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", script, "sh",
            str(source), str(target)]


def runtime_health(node: RuntimeNode) -> str:
    return node.healthz().get("runtime", "")


def test_dead_socket_file_mount_never_hands_a_reused_address_the_old_pods_role(runtime_node):
    node = runtime_node
    target = node.workdir / "cri.sock"
    target.touch()
    agent = node.start_agent(wrapper=bind_mounted(node.containerd.socket, target),
                             extra_args=[f"--cri-endpoint=unix://{target}"])
    reused = "10.88.0.77"
    node.containerd.set_range(reused, reused)
    old = node.add_pod("old", role="role-old", ip_in_api=True)
    assert old.wait_credentials().ok, agent.log()
    wait_until(lambda: runtime_health(node) == "ok", timeout=15, what="runtime ok")

    node.containerd.restart()        # a new socket: the agent's mount still names the old one
    wait_until(lambda: runtime_health(node).startswith("unreachable"), timeout=15,
               what="/healthz runtime unreachable through the dead mount")
    # The node goes on: the kubelet stops the old pod, the API deletes it, a new pod gets
    # its address and the API shows it Running there.
    node.remove_sandbox(old)
    node.api.pods.delete(old.namespace, old.name)
    new = node.add_pod("new", role="role-new", ip_in_api=True)
    assert new.ip == reused
    prober = new.prober(interval=0.02).start()
    time.sleep(6.0)
    samples = prober.stop()

    assert runtime_health(node).startswith("unreachable"), "the link healed: nothing proved"
    assert samples, "no answers at all"
    assert wrong_answers(new, samples) == [], \
        (f"{len(wrong_answers(new, samples))} of {len(samples)} answers wrong",
         wrong_answers(new, samples)[:5])
    assert node.imds_credential_requests() == []

    # The probes: /readyz turns 503, and since the kubelet keeps the node Ready (it reaches
    # containerd) the link is the agent's own and dead: /healthz 500 for the liveness probe,
    # whose restart would renew the mount.
    wait_until(lambda: node.http("GET", "/readyz")[0] == 503, timeout=30, what="/readyz 503")
    status, body = wait_until(lambda: (r := node.http("GET", "/healthz"))[0] == 500 and r,
                              timeout=90, what="/healthz 500 for the dead link")
    assert b"link to unix://" in body and b"broken" in body, body


def test_runtime_down_for_the_whole_node_never_fails_the_liveness_probe(runtime_node):
    """containerd itself is down: the kubelet reports the node not Ready. A restart of the
    agent would cure nothing (and the kubelet could not even do it without the runtime), so
    /healthz stays 200 while /readyz says 503."""
    node = runtime_node
    agent = node.start_agent()
    steady = node.add_pod("steady", role="role-steady", ip_in_api=True)
    assert steady.wait_credentials().ok, agent.log()
    node.containerd.kill()
    down_at = time.monotonic()
    wait_until(lambda: runtime_health(node).startswith("unreachable"), timeout=15,
               what="/healthz runtime unreachable")
    time.sleep(max(0.0, down_at + 35 - time.monotonic()))   # the kubelet's 30 s + a status sync
    node.api.nodes.set_ready(node.name, "False", message="container runtime is down")
    status, body = wait_until(lambda: (r := node.http("GET", "/readyz"))[0] == 503 and r,
                              timeout=30, what="/readyz 503")
    assert body.startswith(b"not ready: waiting for the container runtime's answer: "
                           b"unreachable"), body
    statuses = []
    while time.monotonic() < down_at + 80:                  # past the agent's 60 s grace
        statuses.append(node.http("GET", "/healthz")[0])
        time.sleep(1.0)
    assert set(statuses) == {200}, statuses
    assert "link to" not in agent.log()


def test_socket_directory_mount_survives_a_containerd_restart(runtime_node):
    node = runtime_node
    mounted = node.workdir / "containerd-dir"
    mounted.mkdir()
    socket = mounted / node.containerd.socket.name
    agent = node.start_agent(wrapper=bind_mounted(node.containerd.socket.parent, mounted),
                             extra_args=[f"--cri-endpoint=unix://{socket}"])
    steady = node.add_pod("steady", role="role-steady", ip_in_api=True)
    assert steady.wait_credentials().ok, agent.log()
    wait_until(lambda: runtime_health(node) == "ok", timeout=15, what="runtime ok")

    node.containerd.restart()        # a new socket in the same directory
    # A pod the API has no address for can only be served from a runtime poll through the
    # mount, made after the restart.
    early = node.add_pod("early", role="role-early")
    assert_own_role(early, early.botocore_credentials())
    assert_own_role(steady, steady.botocore_credentials())
    wait_until(lambda: runtime_health(node) == "ok", timeout=30, what="/healthz runtime ok")


def test_auto_endpoint_found_after_the_agent_started(runtime_node):
    """--cri-endpoint=auto on a node whose containerd socket is absent when the agent starts
    (containerd restarting): the agent serves from the API meanwhile and keeps looking; once
    the socket is there, addresses follow the runtime."""
    node = runtime_node
    run_containerd = node.workdir / "run-containerd"   # the container's /run/containerd
    run_containerd.mkdir()
    Path("/run/containerd").mkdir(exist_ok=True)       # the mount point (the shims use it)
    agent = node.start_agent(wrapper=bind_mounted(run_containerd, Path("/run/containerd")),
                             extra_args=["--cri-endpoint=auto"])
    steady = node.add_pod("steady", role="role-steady", ip_in_api=True)
    assert steady.wait_credentials().ok, agent.log()
    assert runtime_health(node).startswith("none found"), runtime_health(node)

    (run_containerd / "containerd.sock").symlink_to(node.containerd.socket)   # it is back
    wait_until(lambda: runtime_health(node) == "ok", timeout=20,
               what="/healthz runtime ok once the socket appeared")
    assert "container runtime socket found: unix:///run/containerd/containerd.sock" \
        in agent.log()
    early = node.add_pod("early", role="role-early")    # the API has no address for it
    assert_own_role(early, early.botocore_credentials())
    assert_own_role(steady, steady.botocore_credentials())
