"""The runtime path end to end: a real containerd, real sandboxes, real SDKs inside them.

Each test gets a fresh node with its own containerd (runtime_node.RuntimeNode) and starts the
agent as the DaemonSet does, with ``--cri-endpoint`` on that containerd's socket. The API
server emulator is deliberately late or wrong, as on a busy real node: a new pod has no
address in the API (its sandbox is already up), a dead pod stays Running with its address.
Clients run inside the sandboxes' network namespaces with nothing AWS-related in their
environment, so their SDK's default chain ends at 169.254.169.254 and the node's DNAT rule.
The judge is STS: credentials count as a pod's own only if STS issued their key for the
pod's role (and GetCallerIdentity says so), never by what the agent claims.

What a user of the agent relies on, one test each: an early caller's first SDK call (three
SDKs) and a pod the watch has not delivered yet; a reused address never yields the previous
pod's role; a dead or stopped sandbox gets nothing; containerd killed and restarted; the
agent killed and restarted; a hostNetwork pod; a sandbox's IPv6 address.
"""

from __future__ import annotations

import time

import pytest
from cri_api.v1 import api_pb2 as cri

from connection_probe import ConnectionProber
from e2e_cluster import APP_PORT, assert_own_role, wrong_answers
from needs import need_js_sdk, need_tool
from runtime_node import RuntimeNode, SandboxPod, wait_until

pytestmark = pytest.mark.root


def runtime_health(node: RuntimeNode) -> str:
    return node.healthz().get("runtime", "")


# ---- early callers ------------------------------------------------------------------------------

def _botocore(pod: SandboxPod) -> str | None:
    """The role STS names for botocore's credentials (GetCallerIdentity with them)."""
    creds = pod.botocore_credentials()
    assert_own_role(pod, creds)
    return creds["Arn"].split("/")[1]


def _awscli(pod: SandboxPod) -> str | None:
    """`aws sts get-caller-identity`: STS itself names the role of the CLI's credentials."""
    ident = pod.awscli_identity()
    assert "Arn" in ident, ident
    return ident["Arn"].split("/")[1]


def _js(pod: SandboxPod) -> str | None:
    """The JS SDK's fromInstanceMetadata(); STS says which role it issued the key for."""
    need_js_sdk()
    creds = pod.js_credentials()
    assert_own_role(pod, creds)
    return pod.node.sts.role_of(creds["AccessKeyId"])


@pytest.mark.parametrize("sdk", [_botocore, _awscli, _js], ids=["botocore", "awscli", "js"])
def test_early_caller_gets_its_own_role_on_its_first_sdk_call(runtime_node, sdk):
    node = runtime_node
    node.start_agent()
    pod = node.add_pod("early", role="role-early")
    assert node.api.pods.get("default", "early")["status"].get("podIP") is None

    role = sdk(pod)          # the first requests this sandbox ever sends

    assert role == "role-early", node.agent_logs()
    assert node.api.pods.get("default", "early")["status"].get("podIP") is None, \
        "the API caught up before the call: this would not test the runtime path"
    assert node.imds_credential_requests() == []


def test_pod_the_watch_has_not_delivered_is_decided_from_its_sandbox(runtime_node):
    """No pod object at all yet (the watch is behind): the sandbox's annotations, which
    the kubelet copies from the pod, decide; the first SDK call gets the pod's role."""
    node = runtime_node
    node.start_agent()
    pod = node.add_pod("unseen", role="role-unseen", in_api=False)
    assert node.api.pods.get("default", "unseen") is None

    assert_own_role(pod, pod.botocore_credentials())


# ---- a reused address ---------------------------------------------------------------------------

def test_reused_address_never_yields_the_previous_pods_role(runtime_node):
    """One address, four pods in turn, roles alternating; the API is never told that any
    of them died, so it shows every previous pod Running with the address. Each new pod is
    probed from its first request on and asks with botocore: never the previous role."""
    node = runtime_node
    agent = node.start_agent()
    reused = "10.88.0.77"
    node.containerd.set_range(reused, reused)
    previous = node.add_pod("gen-0", role="role-a", ip_in_api=True)
    assert previous.wait_credentials().ok, agent.log()
    for gen in range(1, 4):
        node.remove_sandbox(previous)
        pod = node.add_pod(f"gen-{gen}", role="role-b" if gen % 2 else "role-a")
        assert pod.ip == reused, pod.sandbox
        assert node.api.pods.get("default", previous.name)["status"]["podIP"] == reused
        prober = pod.prober(interval=0.02).start()
        creds = pod.botocore_credentials()
        time.sleep(0.2)
        samples = prober.stop()
        assert_own_role(pod, creds)
        assert samples and wrong_answers(pod, samples) == [], \
            (f"generation {gen}", wrong_answers(pod, samples)[:10])
        node.publish_ip(pod)     # the API catches up with this one; the others stay Running
        previous = pod
    assert node.imds_credential_requests() == []


# ---- sandboxes that die ---------------------------------------------------------------------------

def test_dead_or_stopped_sandbox_gets_no_credentials_while_its_client_keeps_asking(runtime_node):
    """The pod's pause process dies (its network stays up, containerd marks it NOTREADY),
    then the kubelet stops the sandbox and runs the next attempt, which gets a new address;
    the API shows the pod Running with its first address all along. A client in the dead
    sandbox keeps opening connections: none opened after containerd said NOTREADY is
    answered 200 (neither the role listing nor credentials). The new sandbox's first SDK
    call gets the pod's own role."""
    node = runtime_node
    agent = node.start_agent()
    pod = node.add_pod("dying", role="role-dying", ip_in_api=True)
    assert pod.wait_credentials().ok, agent.log()

    prober = ConnectionProber(pod.net.ns, "role-dying", interval=0.005).start()
    assert prober.wait_for(lambda a: a.access_key is not None, timeout=5), prober.snapshot()[-5:]
    notready_at = node.kill_pause(pod)
    refused = prober.wait_for(lambda a: a.started > notready_at and a.status != 0, timeout=5)
    time.sleep(0.5)
    reborn = node.recreate_sandbox(pod)      # StopPodSandbox of the dead one, then attempt 1
    time.sleep(0.3)
    attempts = prober.stop()
    creds = reborn.botocore_credentials()

    api = node.api.pods.get("default", "dying")["status"]
    assert (api["phase"], api["podIP"]) == ("Running", pod.ip), api
    late = [a for a in attempts if a.started > notready_at]
    assert refused is not None, \
        f"no HTTP answer after NOTREADY (the network stayed up): {late[:5]}"
    served = [a for a in late if a.status == 200]
    assert served == [], served[:5]
    assert {a.status for a in late if a.status} <= {404, 503}, {a.status for a in late}
    assert reborn.ip != pod.ip, reborn.sandbox
    assert_own_role(reborn, creds)
    assert node.imds_credential_requests() == []


# ---- the runtime goes away and comes back -------------------------------------------------------

def test_containerd_killed_then_restarted(runtime_node):
    node = runtime_node
    agent = node.start_agent()
    steady = node.add_pod("steady", role="role-steady", ip_in_api=True)
    assert steady.wait_credentials().ok, agent.log()
    wait_until(lambda: runtime_health(node) == "ok", timeout=15, what="runtime ok")
    prober = steady.prober(interval=0.02).start()

    node.containerd.kill()           # containerd only: shims and sandboxes live on
    health = wait_until(lambda: (h := runtime_health(node)).startswith("unreachable") and h,
                        timeout=10, what="/healthz runtime unreachable")
    assert node.containerd.endpoint in health, health
    wait_until(lambda: node.metric("kiamfast_runtime_up") == 0, timeout=10,
               what="kiamfast_runtime_up 0")
    down_at = time.monotonic()
    # Meanwhile the API's view: the established pod is served, by its first SDK call.
    assert_own_role(steady, steady.botocore_credentials())
    assert "unavailable" in agent.log() and node.containerd.endpoint in agent.log()

    node.containerd.start()
    # (the agent retries with a jittered backoff, up to 30 s)
    wait_until(lambda: runtime_health(node) == "ok", timeout=40, what="/healthz runtime ok")
    wait_until(lambda: node.metric("kiamfast_runtime_up") == 1, timeout=10,
               what="kiamfast_runtime_up 1")
    assert node.containerd.status(steady.sandbox.id).state == cri.SANDBOX_READY
    # The runtime path is back: a pod the API has no address for is served at once.
    early = node.add_pod("after-restart", role="role-after")
    assert_own_role(early, early.botocore_credentials())
    samples = prober.stop()

    assert wrong_answers(steady, samples) == [], wrong_answers(steady, samples)[:10]
    assert [s for s in samples if s.at > down_at and s.ok], "nothing served during the outage"
    assert node.imds_credential_requests() == []


def test_reused_address_right_after_containerd_restarts(runtime_node):
    """containerd was down for a few seconds and comes back; at once the kubelet replaces a
    dead pod's sandbox and the new one gets the old address (the API still shows the old
    pod Running with it, and nothing for the new one). The runtime answers again, so the
    new pod must never get the old pod's role, from its first request on."""
    node = runtime_node
    agent = node.start_agent()
    reused = "10.88.0.91"
    node.containerd.set_range(reused, reused)
    old = node.add_pod("old", role="role-old", ip_in_api=True)
    assert old.wait_credentials().ok, agent.log()

    node.containerd.kill()
    wait_until(lambda: runtime_health(node).startswith("unreachable"), timeout=10,
               what="/healthz runtime unreachable")
    time.sleep(10.0)                 # a short outage, as a containerd upgrade or crash loop
    node.containerd.start()
    node.remove_sandbox(old)
    new = node.add_pod("new", role="role-new")
    assert new.ip == reused and node.api.pods.get("default", "old")["status"]["podIP"] == reused
    prober = new.prober(interval=0.02).start()
    creds = new.botocore_credentials()
    wait_until(lambda: runtime_health(node) == "ok", timeout=40, what="/healthz runtime ok")
    time.sleep(0.3)
    samples = prober.stop()

    assert wrong_answers(new, samples) == [], \
        (f"{len(wrong_answers(new, samples))} of {len(samples)} answers wrong",
         wrong_answers(new, samples)[:5])
    assert_own_role(new, creds)


def test_agent_killed_and_restarted_while_sandboxes_run(runtime_node):
    """kill -9 of the whole agent (supervisor, control, workers), then the same container
    starts again (same table file). While it is down a sandbox dies and its address goes
    to a new one (the API still shows the dead pod Running with it). After the restart
    every pod gets its own credentials again, the early one (whose address only the runtime
    knows) and the new one on the reused address included; in between a pod gets nothing,
    never the node's role or the dead pod's. The new agent adopts the table: the pods that
    stayed get the exact keys they had, and STS issues a key only for the new pod."""
    node = runtime_node
    agent = node.start_agent()
    reused = "10.88.0.60"
    node.containerd.set_range(reused, reused)
    doomed = node.add_pod("doomed", role="role-doomed", ip_in_api=True)
    node.containerd.set_range(None, None)
    established = node.add_pod("established", role="role-est", ip_in_api=True)
    early = node.add_pod("early", role="role-early")
    before = {pod.name: pod.wait_credentials().access_key for pod in (doomed, established, early)}
    for pod in (doomed, established, early):
        assert_own_role(pod, {"AccessKeyId": before[pod.name]})
    issued = node.sts.issued()

    agent.kill()
    assert not agent.running()
    assert node.dnat_rules(), "the DNAT rule went with the agent (fail open)"
    down = early.fetch(timeout=1.0)
    assert down.status == 0 and down.access_key is None, down
    node.remove_sandbox(doomed)
    node.containerd.set_range(reused, reused)
    successor = node.add_pod("successor", role="role-successor")
    assert successor.ip == reused, successor.sandbox
    prober = successor.prober(interval=0.02).start()   # asking before the agent is back

    agent.start().wait_ready()
    for pod in (early, established):
        assert pod.fetch().access_key == before[pod.name], agent.log()
    for pod in (early, successor):
        assert_own_role(pod, pod.botocore_credentials())
    samples = prober.stop()
    new_keys = [arn for key, arn in node.sts.issued().items() if key not in issued]
    assert [arn.rsplit("/", 1)[1] for arn in new_keys] == ["role-successor"], agent.log()

    assert wrong_answers(successor, samples, allowed_errors=(0, 503, 404)) == [], \
        wrong_answers(successor, samples, allowed_errors=(0, 503, 404))[:10]
    assert [s for s in samples if s.ok], "the successor was never served while probing"
    assert node.imds_credential_requests() == []


# ---- hostNetwork and IPv6 -----------------------------------------------------------------------

def test_host_network_pod_never_gets_pod_credentials(runtime_node):
    """A hostNetwork pod with a role (API: hostNetwork, the host's IP; runtime: a sandbox
    in the node's network) asks the agent directly from each of the node's addresses."""
    node = runtime_node
    agent = node.start_agent()
    other = node.add_pod("ordinary", role="role-ordinary", ip_in_api=True)
    assert other.wait_credentials().ok, agent.log()
    host = node.add_pod("hostnet", role="role-host", ip_in_api=True, host_network=True)
    assert node.api.pods.get("default", "hostnet")["spec"].get("hostNetwork") is True

    for source in (node.host_ip, node.containerd.gateway, "127.0.0.1"):
        url = f"http://{source}:{APP_PORT}/latest/meta-data/iam/security-credentials/"
        proc = host.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                         "--interface", source, url])
        assert proc.stdout == "404", (source, proc.stdout, proc.stderr)
    sdk = host.botocore_credentials(
        who_am_i=False, AWS_EC2_METADATA_SERVICE_ENDPOINT=f"http://{node.host_ip}:{APP_PORT}/")
    assert (sdk.get("error"), sdk.get("exit")) == ("no credentials", 3), sdk
    assert node.host_ip not in node.debug_store()["rolesByIP"]
    assert not [k for k, arn in node.sts.issued().items() if arn.endswith("/role-host")]


def test_ipv6_address_of_a_sandbox_is_owned_by_its_pod(runtime_node):
    """The sandbox's additional_ips IPv6 address belongs to its pod: /debug/store maps it,
    and botocore in IPv6 endpoint mode (fd00:ec2::254, the agent's ip6tables DNAT rule)
    gets the pod's own role while the API has no address for the pod at all."""
    need_tool("ip6tables")
    node = runtime_node
    node.start_agent(extra_args=["--metadata-ipv6", f"--host-ipv6={node.gateway6}"])
    pod = node.add_pod("dual", role="role-dual")
    assert pod.ip6 and pod.ip6.startswith("fd00:88::"), pod.sandbox

    store = wait_until(lambda: (s := node.debug_store())["rolesByIP"].get(pod.ip6) and s,
                       timeout=10, what=f"{pod.ip6} in /debug/store")
    assert store["rolesByIP"][pod.ip6] == "role-dual" == store["rolesByIP"][pod.ip]
    assert store["namespaceByIP"][pod.ip6] == "default"

    creds = pod.botocore_credentials(AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE="IPv6")
    assert_own_role(pod, creds)
    assert node.imds_credential_requests() == []
