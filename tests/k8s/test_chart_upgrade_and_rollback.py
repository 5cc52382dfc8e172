"""The chart's rollouts as pods see them (issue 33): the real kube-apiserver, DaemonSet
controller, scheduler and kubelet v1.34.2 run the chart, and the operator's commands of
docs/upgrade-and-rollback.md run as written there (helm, and kubectl built beside the other
binaries), while pods on the node ask for their credentials through 169.254.169.254 all
along.

The pods are real pods of the node (sandboxes of its containerd, addresses from its CNI);
the calls are :class:`steady_calls.Caller` threads inside each pod's network namespace,
one on fresh connections and one on a keep-alive connection per pod, every 100 ms with the
SDKs' 1 s timeout, so every call crosses the node's real DNAT rule. STS's record of which
role each key was issued for decides "its own role"; the node's fake metadata service hands
out the node's role (keys ``ASIANODE...``) and records every request. One node for the
module, the steps in order, each starting where the last left the node:

1. ``helm upgrade`` to a second image tag with the chart's defaults (the surge handover):
   every call answered with its own role, none refused; the new pod ran beside the old one,
   no pod was ever unschedulable, the old pod is gone at the end;
2. ``--set maxUnavailable=1`` (kube2iam's way): calls are refused for the gap, measured and
   split into the kubelet's part and kiamfast's (its container's start to its first answer);
3. ``kill -9`` of the agent's container: the socket keeper holds the sockets, calls wait in
   the backlog (a 10 s timeout here) and none is refused; only requests the killed worker
   had in hand may be lost;
4. ``helm rollback`` to the surge release: a handover again, nothing refused;
5. the release uninstalled (its agent removes its rules) and the state directory removed;
   kube2iam-chart installed with the real
   kube2iam and a kube2iam user's values (kube2iam_image.py; fixtures shared with
   test_chart_switch_from_kube2iam.py), then the documented switch to kiamfast: the surge
   through the second port, kube2iam's pod stopping with its chart's preStop hook. Never
   the node's role; how many calls waited or failed is reported;
6. ``helm rollback`` to kube2iam-chart: its ``OnDelete`` replaces no pod until the
   documented ``kubectl delete pod``; then kube2iam serves again (never the node's role), a
   startup taint stays until the documented ``kubectl taint``, and the documented node
   cleanup removes kiamfast's backstop.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kube
import kube2iam_release
import pytest
from chart_cluster import (CHART, IMAGE_REPO, NAMESPACE, ChartControlPlane, ChartNode, helm,
                           helm_binary, metadata_dnat, print_failure_report, ready,
                           removal_commands, state_dir, values_file)
from cri_api.v1 import api_pb2 as cri
from kube2iam_image import NAME as KUBE2IAM_IMAGE
from kube2iam_release import THEIR_CHART, kube2iam_values, node_particulars
from kubelet_node import KubePod

from e2e_cluster import NODE_ACCESS_KEY_PREFIX, STARTUP_TAINT
from netns import METADATA_IP, _setns
from runtime_node import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
import upgrade_page  # noqa: E402
from steady_calls import Call, Caller, longest_silence, summary  # noqa: E402

pytestmark = [pytest.mark.kubelet, pytest.mark.kube_apiserver, pytest.mark.root,
              pytest.mark.slow, pytest.mark.timeout(1800)]

RELEASE = "kf-surge"
KUBE2IAM_RELEASE = "k2i-surge"
DAEMONSET = f"{RELEASE}-kiamfast"
PODS = 4            # each with its own role, asking on a fresh and a keep-alive connection
INTERVAL = 0.1
OFFSET = time.time() - time.monotonic()   # a Caller's monotonic times as wall-clock times


@pytest.fixture(scope="module")
def control(kube_cluster, kubelet_available, tmp_path_factory):
    reason = kube.missing_binaries(("kubectl",))
    if reason:
        pytest.skip(reason)
    with kube2iam_release.control_plane(kube_cluster,
                                        tmp_path_factory.mktemp("surge-control")) as plane:
        yield plane


@pytest.fixture(scope="module")
def node(kube_cluster, control, tmp_path_factory):
    with kube2iam_release.node(kube_cluster, tmp_path_factory.mktemp("surge-node")) as n:
        yield n


@pytest.fixture
def reported(node, control, test_failed):
    """The node; its logs (kubelet, containerd, agent pods, controllers) if the test failed."""
    yield node
    if test_failed():
        print_failure_report(node, control)


@pytest.fixture(scope="module")
def releases(node, control):
    """Both releases this module installs are gone afterwards (the session's etcd outlives
    the module, and a DaemonSet left there would be run by the next module's controllers)."""
    yield
    for release in (RELEASE, KUBE2IAM_RELEASE):
        kube2iam_release.uninstall(control, release)


# ---- the operator's tools --------------------------------------------------------------

def tool_env(control: ChartControlPlane) -> dict[str, str]:
    home = control.dir / "helm"
    return dict(os.environ, KUBECONFIG=str(control.kubeconfig),
                HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
                HELM_DATA_HOME=str(home / "data"))


def run_page(control: ChartControlPlane, block: str, values: dict[str, str],
             *extra: str) -> list[str]:
    """Each command of the page's ``block``, placeholders filled (``extra``: more arguments
    for a ``helm upgrade``, the test node's particulars); their outputs."""
    outputs = []
    for argv in upgrade_page.commands(block, {"<namespace>": NAMESPACE, **values}):
        if argv[0] == "helm":
            argv = [str(helm_binary()), *argv[1:]]
            if argv[1] == "upgrade":
                argv = [*argv, *extra]
        elif argv[0] == "kubectl":
            argv = [str(kube.binary("kubectl", kube.KUBE_VERSION)), *argv[1:]]
        argv = [str(CHART) if a == "deploy/chart/kiamfast" else a for a in argv]
        result = subprocess.run(argv, capture_output=True, text=True, env=tool_env(control),
                                timeout=1000)
        assert result.returncode == 0, (argv, result.stdout, result.stderr)
        outputs.append(result.stdout)
    return outputs


# ---- the node's pods and the agent's ------------------------------------------------------

def verbose_pid(node: ChartNode, method: str, request: Any) -> int:
    answer = node.containerd.call(method, request)
    return int(json.loads(answer.info["info"])["pid"])


def sandbox_netns(node: ChartNode, pod: KubePod) -> str:
    """The network namespace of ``pod``'s sandbox, by its pause process."""
    items = node.containerd.call("ListPodSandbox", cri.ListPodSandboxRequest(
        filter=cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.uid": pod.uid},
                                    state=cri.PodSandboxStateValue(
                                        state=cri.SANDBOX_READY)))).items
    assert items, f"{pod}: no ready sandbox"
    sandbox = max(items, key=lambda s: s.created_at)
    pid = verbose_pid(node, "PodSandboxStatus", cri.PodSandboxStatusRequest(
        pod_sandbox_id=sandbox.id, verbose=True))
    return f"/proc/{pid}/ns/net"


def asking_pods(node: ChartNode) -> list[tuple[KubePod, str]]:
    """PODS pods (role ``surge-<i>``) that only sleep, with their network namespaces."""
    pods = [node.create_app_pod(f"surge-{i}", role=f"surge-{i}", app={
        "image": f"{IMAGE_REPO}:test", "command": ["sleep", "3600"]}) for i in range(PODS)]
    for pod in pods:
        wait_until(lambda p=pod: p.get()["status"].get("phase") == "Running", timeout=120,
                   interval=0.2, what=f"{pod} running")
    return [(pod, sandbox_netns(node, pod)) for pod in pods]


def entering(path: str):
    def enter() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(fd)
        finally:
            os.close(fd)
    return enter


class Asking:
    """``with Asking(node, pods) as asking:`` every pod asks (fresh and keep-alive) until
    the block ends; then ``asking.calls``: (pod, call) pairs, those begun once every pod
    had been answered.  The calls before are the serving agent's own start (kube2iam
    holds a call for a pod its informer has not listed yet for up to 2 s): they count for
    a wrong identity (``every_call``), not for a dropped call or a silence."""

    def __init__(self, node: ChartNode, pods: list[tuple[KubePod, str]], *,
                 timeout: float = 1.0) -> None:
        self.node = node
        self.callers = [(pod, Caller(METADATA_IP, 80, pod.role, keep_alive=keep,
                                     interval=INTERVAL, timeout=timeout, enter=entering(path),
                                     name_=f"{pod.name}-{'ka' if keep else 'fresh'}"))
                        for pod, path in pods for keep in (False, True)]
        self.calls: list[tuple[KubePod, Call]] = []
        self.every_call: list[tuple[KubePod, Call]] = []

    def __enter__(self) -> "Asking":
        for _, caller in self.callers:
            caller.start()
        # Every caller answered before the event begins (a pod's first call may wait for
        # the agent to learn its address).
        wait_until(lambda: all(any(c.ok for c in caller.snapshot())
                               for _, caller in self.callers), timeout=60, interval=0.1,
                   what="every pod answered")
        time.sleep(1.0)
        self.began = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            time.sleep(1.0)
        self.every_call = [(pod, call) for pod, caller in self.callers
                           for call in caller.stop()]
        self.calls = [(pod, call) for pod, call in self.every_call if call.at >= self.began]

    # -- the judgement --------------------------------------------------------------------

    def failed(self) -> list[Call]:
        return [c for _, c in self.calls if not c.ok]

    def nodes_role(self) -> list[Call]:
        return [c for _, c in self.every_call
                if c.access_key and c.access_key.startswith(NODE_ACCESS_KEY_PREFIX)]

    def another_role(self) -> list[tuple[str, Call]]:
        issued = self.node.sts.issued()
        return [(pod.name, c) for pod, c in self.every_call
                if c.ok and not c.access_key.startswith(NODE_ACCESS_KEY_PREFIX)
                and issued.get(c.access_key, "").rsplit("/", 1)[-1] != pod.role]

    def longest_silence(self) -> float:
        return max(longest_silence([c for c in caller.snapshot() if c.at >= self.began])
                   for _, caller in self.callers)

    def report(self, what: str) -> str:
        failed = self.failed()
        window = (f"; failed from {min(c.at for c in failed) + OFFSET:.2f} to "
                  f"{max(c.at + c.took for c in failed) + OFFSET:.2f}" if failed else "")
        line = (f"{what}: {len(self.calls)} calls {summary([c for _, c in self.calls])}; "
                f"the longest a pod went unanswered {self.longest_silence():.2f} s; "
                f"the slowest call {max(c.took for _, c in self.calls):.2f} s{window}")
        print("\n" + line)
        return line

    def never_wrong(self) -> None:
        assert self.nodes_role() == [], self.nodes_role()[:5]
        assert self.another_role() == [], self.another_role()[:5]
        assert self.node.imds_credential_requests() == []


class PodWatch(threading.Thread):
    """The release's pods, followed by a watch while a rollout runs: whether one was ever
    unschedulable, the most that ran at once, how long new ones were Pending.  A watch, not
    a poll: its events come in the API server's order, so a new pod that is Running before
    the old one is marked for deletion is seen so however short the overlap (a surge hands
    the node over within a fraction of a second)."""

    def __init__(self, node: ChartNode, release: str) -> None:
        super().__init__(daemon=True)
        self.node, self.release = node, release
        self.unschedulable: set[str] = set()
        self.most_running = 0
        self.pending_since: dict[str, float] = {}
        self.pending_for: dict[str, float] = {}
        self._done = threading.Event()

    def run(self) -> None:
        path = (f"/api/v1/namespaces/{NAMESPACE}/pods"
                f"?labelSelector=app.kubernetes.io/instance={self.release}")
        pods: dict[str, dict[str, Any]] = {}
        version = ""
        while not self._done.is_set():
            if not version:                       # the start, or a watch the server ended
                listed = self.node.admin.call("GET", path)
                pods = {p["metadata"]["name"]: p for p in listed["items"]}
                version = listed["metadata"]["resourceVersion"]
                self._saw(pods)
            for kind, pod in self._events(f"{path}&watch=1&timeoutSeconds=1"
                                          f"&resourceVersion={version}"):
                if kind == "ERROR":               # e.g. 410 Gone: list again
                    version = ""
                    break
                version = pod["metadata"]["resourceVersion"]
                if kind == "DELETED":
                    pods.pop(pod["metadata"]["name"], None)
                else:
                    pods[pod["metadata"]["name"]] = pod
                self._saw(pods)

    def _events(self, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        admin = self.node.admin
        r = admin.http.request("GET", admin.url + path, preload_content=False, retries=False,
                               headers={"Authorization": f"Bearer {admin.token}"}, timeout=10.0)
        try:
            for line in r:
                if line.strip():
                    event = json.loads(line)
                    yield event["type"], event["object"]
        finally:
            r.release_conn()

    def _saw(self, pods: dict[str, dict[str, Any]]) -> None:
        now = time.monotonic()
        running = 0
        for name, pod in pods.items():
            phase = pod["status"].get("phase")
            if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                   for c in pod["status"].get("conditions", [])):
                self.unschedulable.add(name)
            if phase == "Pending":
                self.pending_since.setdefault(name, now)
            elif name in self.pending_since and name not in self.pending_for:
                self.pending_for[name] = now - self.pending_since[name]
            if phase == "Running" and "deletionTimestamp" not in pod["metadata"]:
                running += 1
        self.most_running = max(self.most_running, running)

    def __enter__(self) -> "PodWatch":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join(10)


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in pod["status"]["containerStatuses"] if s["name"] == name)


def agent_container(pod: dict[str, Any]) -> dict[str, Any]:
    return container_status(pod, pod["spec"]["containers"][0]["name"])


def started_at(node: ChartNode, container_id: str) -> float:
    """When the runtime started the container (wall clock, the runtime's nanoseconds)."""
    status = node.containerd.call("ContainerStatus", cri.ContainerStatusRequest(
        container_id=container_id.split("://", 1)[1])).status
    return status.started_at / 1e9


def only_pod(node: ChartNode, *, image: str, timeout: float = 180) -> dict[str, Any]:
    """The node's one agent pod once it is Ready with ``image`` and every other is gone."""
    def found() -> dict[str, Any] | None:
        pods = node.agent_pods()
        if len(pods) == 1 and ready(pods[0]) and \
                pods[0]["spec"]["containers"][0]["image"] == image:
            return pods[0]
        return None
    return wait_until(found, timeout=timeout, interval=0.3,
                      what=f"one agent pod, Ready, running {image}")


def tag(node: ChartNode, name: str) -> str:
    image = f"{IMAGE_REPO}:{name}"
    subprocess.run(["ctr", "-a", str(node.containerd.socket), "-n", "k8s.io", "images", "tag",
                    "--force", f"{IMAGE_REPO}:test", image], check=True, capture_output=True,
                   timeout=30)
    return image


def kiamfast_values(node: ChartNode, image_tag: str) -> str:
    """A kube2iam user's values plus the node's particulars (chart_cluster), this tag."""
    path = values_file(node, {"image": {"tag": image_tag}})
    named = path.with_name(f"values-{image_tag}.yaml")
    path.rename(named)
    return str(named)


def filter_rules(node: ChartNode) -> list[str]:
    """kiamfast's backstop rules in the node's filter table."""
    out = []
    for chain in ("INPUT", "FORWARD"):
        listed = node.net.ns.run(["iptables", "-S", chain], check=True, timeout=30).stdout
        out += [line for line in listed.splitlines() if "kiamfast: metadata" in line]
    return out


def keeper_memory(node: ChartNode, pod: dict[str, Any]) -> str:
    """The socket keeper's RSS and PSS, and its container's cgroup memory."""
    status = container_status(pod, "socket-keeper")
    pid = verbose_pid(node, "ContainerStatus", cri.ContainerStatusRequest(
        container_id=status["containerID"].split("://", 1)[1], verbose=True))
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmRSS:"))
    pss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/smaps_rollup").read_text()
               .splitlines() if line.startswith("Pss:"))
    return (f"socket keeper: RSS {rss / 1024:.1f} MiB, PSS {pss / 1024:.1f} MiB, its "
            f"container's cgroup {container_memory(pid) / 2**20:.1f} MiB")


def container_memory(pid: int) -> int:
    """The memory charged to ``pid``'s cgroup: ``memory.current`` (v2) or
    ``memory.usage_in_bytes`` of the memory hierarchy (v1, this VM)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.current"
        elif "memory" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes"
        else:
            continue
        if candidate.exists():
            return int(candidate.read_text())
    raise AssertionError(f"no memory cgroup for pid {pid}")


# ---- the steps ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pods(node, releases, control) -> Iterator[list[tuple[KubePod, str]]]:
    """The release installed with the chart's defaults (kiamfast's image, tag ``test``) and
    the pods asking through it."""
    helm(control, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "-f", kiamfast_values(node, "test"))
    agent = only_pod(node, image=f"{IMAGE_REPO}:test")
    assert [c["name"] for c in agent["spec"]["containers"]] == ["kiamfast", "socket-keeper"]
    print("\n" + keeper_memory(node, agent))
    yield asking_pods(node)


def test_the_surge_upgrade_answers_every_call_and_leaves_no_pod_pending(reported, control,
                                                                       pods):
    node = reported
    before = only_pod(node, image=f"{IMAGE_REPO}:test")
    new_image = tag(node, "surge-2")
    started = time.monotonic()
    with Asking(node, pods) as asking, PodWatch(node, RELEASE) as watch:
        run_page(control, "upgrade", {"<release>": RELEASE, "<daemonset>": DAEMONSET,
                                      "<your-values.yaml>": kiamfast_values(node, "surge-2")})
        after = only_pod(node, image=new_image)
    took = time.monotonic() - started
    asking.report(f"surge upgrade ({took:.1f} s from helm upgrade to the old pod gone)")
    print(f"the new pod was Pending for {max(watch.pending_for.values()):.2f} s")
    asking.never_wrong()
    assert asking.failed() == [], asking.failed()[:5]
    assert watch.unschedulable == set()
    assert watch.most_running == 2     # the new pod ran beside the old one: a surge
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    assert len(metadata_dnat(node)) == 1, node.dnat_rules()


def test_rolling_with_max_unavailable_refuses_calls_for_the_gap(reported, control, pods):
    node = reported
    before = only_pod(node, image=f"{IMAGE_REPO}:surge-2")
    new_image = tag(node, "rolling-3")
    with Asking(node, pods) as asking, PodWatch(node, RELEASE) as watch:
        run_page(control, "rolling", {"<release>": RELEASE,
                                      "<your-values.yaml>": kiamfast_values(node, "rolling-3")})
        after = only_pod(node, image=new_image)
    asking.report("rolling update (maxUnavailable 1)")
    asking.never_wrong()
    assert watch.most_running == 1     # the old pod stopped first: no surge
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    failed = asking.failed()
    assert failed, "no call was refused: was this a surge?"
    # The gap, split: from the first failed call to the new agent's container start (the
    # old pod's stop, the controllers, the kubelet), then to the first answer after it
    # (kiamfast's part: process start to first answer from the adopted table).
    first_failed = min(c.at for c in failed) + OFFSET
    start = started_at(node, agent_container(after)["containerID"])
    answered = min(c.at + c.took for _, c in asking.calls if c.ok and c.at + OFFSET > start)
    print(f"gap: {start - first_failed:.2f} s until the new agent's container started, then "
          f"{answered + OFFSET - start:.2f} s to its first answer (kiamfast's part)")


def test_the_agent_container_killed_calls_wait_in_the_keepers_backlog(reported, pods):
    node = reported
    before = only_pod(node, image=f"{IMAGE_REPO}:rolling-3")
    agent = agent_container(before)
    keeper = container_status(before, "socket-keeper")
    with Asking(node, pods, timeout=10.0) as asking:
        killed = time.monotonic()
        subprocess.run(["ctr", "-a", str(node.containerd.socket), "-n", "k8s.io", "tasks",
                        "kill", "-s", "SIGKILL", agent["containerID"].split("://", 1)[1]],
                       check=True, capture_output=True, timeout=30)
        kill_returned = time.monotonic()
        after = wait_until(lambda: (p := only_pod(node, image=f"{IMAGE_REPO}:rolling-3"))
                           and agent_container(p)["restartCount"] > agent["restartCount"] and p,
                           timeout=120, interval=0.3, what="the agent's container restarted")
    asking.report("kill -9 of the agent's container")
    waited = [c for _, c in asking.calls if c.at <= killed + 0.5 and c.at + c.took > killed
              and c.took > 0.5]
    restarted = started_at(node, agent_container(after)["containerID"]) - killed - OFFSET
    over_a_second = [c for _, c in asking.calls if c.took > 1.0]
    print(f"{len(waited)} calls waited in the backlog, the longest "
          f"{max((c.took for c in waited), default=0):.2f} s ({len(over_a_second)} over the "
          f"SDKs' 1 s timeout); the container restarted {restarted:.2f} s after the kill")
    asking.never_wrong()
    # A request the killed worker had accepted dies with it (EOF or reset: a keep-alive
    # caller sends it again, as urllib3 does, a fresh one cannot); every other call waits
    # in the backlog the keeper holds and is answered: none refused, none begun after the
    # kill failed.
    in_hand = [c for c in asking.failed() if c.at <= kill_returned and c.at + c.took >= killed
               and c.outcome in ("eof", "reset")]
    print(f"{len(in_hand)} calls the killed worker held were lost")
    assert asking.failed() == in_hand, asking.failed()[:5]
    assert len(in_hand) <= len(asking.callers)     # at most one in flight per caller
    assert after["metadata"]["uid"] == before["metadata"]["uid"]   # the same pod
    assert container_status(after, "socket-keeper")["restartCount"] == keeper["restartCount"]


def test_helm_rollback_to_the_surge_release_hands_over_again(reported, control, pods):
    node = reported
    before = only_pod(node, image=f"{IMAGE_REPO}:rolling-3")
    with Asking(node, pods) as asking, PodWatch(node, RELEASE) as watch:
        history, *_ = run_page(control, "rollback", {"<release>": RELEASE, "<revision>": "2",
                                                     "<daemonset>": DAEMONSET})
        after = only_pod(node, image=f"{IMAGE_REPO}:surge-2")
    asking.report("helm rollback to the surge release")
    revisions = {line.split()[0]: line for line in history.splitlines()[1:]}
    assert "Upgrade complete" in revisions["2"], history
    asking.never_wrong()
    assert asking.failed() == [], asking.failed()[:5]
    assert watch.most_running == 2     # the surge again
    assert after["metadata"]["uid"] != before["metadata"]["uid"]


def test_the_switch_from_a_kube2iam_release_never_hands_out_the_nodes_role(reported, control,
                                                                           pods):
    node = reported
    # The kiamfast release goes: its agent removes its rules itself (an uninstall), and
    # docs/install.md's removal commands the state directory.
    helm(control, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
    wait_until(lambda: node.agent_pods() == [], timeout=120, interval=0.5,
               what="the agent pod gone")
    wait_until(lambda: metadata_dnat(node) == [] and filter_rules(node) == [], timeout=30,
               interval=0.2, what="the uninstalled agent's rules removed")
    state = state_dir(node)
    node.net.ns.run(["sh", "-ec", removal_commands(state)[0]], check=True, timeout=60)
    assert not state.exists()
    values = kube2iam_values(node)
    helm(control, "install", KUBE2IAM_RELEASE, str(THEIR_CHART), "--namespace", NAMESPACE,
         "-f", str(values))
    kube2iam = only_pod(node, image=KUBE2IAM_IMAGE)
    assert "lifecycle" in kube2iam["spec"]["containers"][0]   # its chart's preStop hook
    with Asking(node, pods) as asking, PodWatch(node, KUBE2IAM_RELEASE) as watch:
        started = time.monotonic()
        run_page(control, "switch", {
            "<release>": KUBE2IAM_RELEASE, "<your-values.yaml>": str(values),
            "<chart>": "kube2iam-chart", "<daemonset>": f"{KUBE2IAM_RELEASE}-kube2iam-chart"},
            "-f", str(node_particulars(node)))
        only_pod(node, image=f"{IMAGE_REPO}:test")
        # kube2iam's pod is gone and kiamfast has moved back to the app port: one rule.
        wait_until(lambda: [r.split("--to-destination ")[1] for r in metadata_dnat(node)] ==
                   [f"{node.host_ip}:8181"], timeout=60, interval=0.2,
                   what="kiamfast back on the app port alone")
        took = time.monotonic() - started
    asking.report(f"the switch from kube2iam ({took:.1f} s from helm upgrade to kiamfast "
                  "alone on the app port)")
    waited = [c for _, c in asking.calls if c.ok and c.took > 0.5]
    print(f"{len(waited)} calls took over 0.5 s; {len(asking.failed())} failed")
    asking.never_wrong()
    assert watch.unschedulable == set()
    assert watch.most_running == 2     # kiamfast's pod ran beside kube2iam's
    assert asking.failed() == [], asking.failed()[:5]


def test_helm_rollback_to_kube2iams_chart_rolls_each_node_when_its_pod_is_deleted(
        reported, control, pods):
    node = reported
    agent = only_pod(node, image=f"{IMAGE_REPO}:test")
    names = {"<release>": KUBE2IAM_RELEASE, "<revision>": "1", "<node>": node.name,
             "<name>": "kube2iam-chart"}
    history, _ = run_page(control, "rollback-to-kube2iam", names)
    revisions = {line.split()[0]: line for line in history.splitlines()[1:]}
    assert "kube2iam-chart" in revisions["1"], history
    ds = node.admin.call("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/"
                                f"{KUBE2IAM_RELEASE}-kube2iam-chart")
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == KUBE2IAM_IMAGE
    time.sleep(5)
    # OnDelete: the rollback replaced no pod; kiamfast still serves the node.
    assert [p["metadata"]["uid"] for p in node.agent_pods()] == [agent["metadata"]["uid"]]
    with Asking(node, pods) as asking:
        _, listed = run_page(control, "on-delete", names)
        only_pod(node, image=KUBE2IAM_IMAGE)
        wait_until(lambda: node.metric("kiamfast_ready") is None, timeout=30, interval=0.3,
                   what="kube2iam answering on the app port")
    asking.report("helm rollback to kube2iam-chart, the node's pod deleted")
    print(listed)
    asking.never_wrong()
    # A node registered with kiamfast's startup taint keeps it under kube2iam, until the
    # page's command takes it away.
    taints = node.admin.get_node(node.name)["spec"].get("taints", [])
    node.admin.call("PATCH", f"/api/v1/nodes/{node.name}", {"spec": {"taints": [
        *taints, {"key": STARTUP_TAINT, "value": "true", "effect": "NoExecute"}]}},
        content_type="application/merge-patch+json")
    time.sleep(3)
    assert STARTUP_TAINT in node.taints()
    run_page(control, "untaint", names)
    assert STARTUP_TAINT not in node.taints()
    # kiamfast's backstop and state directory stay until the page's node cleanup.
    assert filter_rules(node)
    state = state_dir(node)
    node.net.ns.run(["sh", "-ec", node_cleanup(state)], check=True, timeout=60)
    assert filter_rules(node) == [] and not state.exists()
    assert metadata_dnat(node)    # kube2iam's rule, untouched
    assert node.imds_credential_requests() == []


def node_cleanup(state: Path) -> str:
    """The page's node cleanup, for this node's state directory (the chart's default)."""
    text = upgrade_page.script("node-cleanup", {})
    assert "/run/kiamfast" in text
    return text.replace("/run/kiamfast", str(state))
