"""The pod-address races against kube2iam 0.15 itself and kiamfast, in the same run.

Each agent runs as the agent of its own node (kube2iam_node): a node network namespace, a
real containerd with CNI whose sandboxes are the pods, the API server emulator, which is as
late as on a real node (a pod's address reaches it only when the test says so, a dead pod
stays Running with its address until the test deletes it), STS behind the recording proxy.
kube2iam installs its own DNAT rule (``--iptables``); kiamfast runs with the DaemonSet's
flags, its container runtime included. The clients are botocore-style fetches (token, listing,
document; 1 s timeout per request, as botocore), and STS judges whose identity each answer
carried (race_record).

(a) early pod: the pod asks before the API shows its address, which the API learns 1 s later.
(b) reused address: the old pod's sandbox is gone, a new pod has its address, the API still
    shows the old pod Running with it; later the old pod's delete and the new address arrive.
(c) churn: (b) again and again on one address; and bench/churn.py (API-only, at 20
    replacements a second) against both.

For kiamfast the tests assert that no answer ever carried another identity and that the
pod's own credentials came. Whether the first call already had them is recorded, not
asserted: it depends on how soon the runtime answers on a loaded machine (kiamfast fails
closed with a 503 when the runtime has not answered within its wait budget). For kube2iam
the tests assert only that the measurement ran: its numbers are printed (``RACE {...}`` lines; run with ``-s``) and recorded when
``KUBE2IAM_RACES_RECORD`` names a file (docs/kube2iam-races.json, quoted by docs/performance.md).
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kube2iam_harness import kube2iam_binary
from kube2iam_node import AGENTS, skip_unless_available, start_agent
from race_record import fetch, fetch_until_own, identity, module_record, outcome, spread, wrong

BENCH = Path(__file__).resolve().parents[2] / "bench"
PUBLISH_AFTER = 1.0     # (a): the API learns the pod's address this long after its first call
STALE_FETCHES = 10      # (b), (c): fetches from the new pod while the API shows the old one
REPLACEMENTS = 6        # (c): pods replaced on one address
# (b), (c): host-local is made to hand out only this address (each case its own)
REUSED = {"reuse": "10.88.0.51", "churn": "10.88.0.61"}
BENCH_CHURN = dict(slots=32, roles=8, rate=20.0, gap=0.01, requests=0, min_replacements=200,
                   max_seconds=60.0, idle_samples=5)

RECORD, _write_record = module_record()


@pytest.fixture(scope="module", params=AGENTS)
def runtime_node(request, tmp_path_factory):
    """(node, agent name): a node with its own containerd and the agent, ready."""
    skip_unless_available(runtime=True)
    from runtime_node import RuntimeNode
    node = RuntimeNode(tmp_path_factory.mktemp(f"races-{request.param}") / "node")
    try:
        start_agent(node, request.param)
        yield node, request.param
    except BaseException:
        print("\n===== agent output =====\n" + node.agent_logs())
        raise
    finally:
        node.close()


def logs(node) -> str:
    return "\n" + node.agent_logs()


@pytest.mark.root
def test_a_early_pod_asks_before_the_api_has_its_address(runtime_node):
    node, agent = runtime_node
    pod = node.add_pod("early", role="role-early")
    assert node.api.pods.get("default", "early")["status"].get("podIP") is None
    kubelet = threading.Timer(PUBLISH_AFTER, node.publish_ip, args=(pod,))
    start = time.monotonic()
    kubelet.start()
    try:
        samples, first_own = fetch_until_own(pod, since=start)
    finally:
        kubelet.join()
    first = samples[0]
    RECORD.add(agent, "early pod", {
        "first call": outcome(pod, first), "first call identity": identity(pod, first),
        "seconds to the first own credentials": first_own, "fetches": len(samples),
        "wrong identities": len(wrong(pod, samples)),
        "API learns the address after (s)": PUBLISH_AFTER})
    assert samples, "no fetch ran"
    if agent == "kiamfast":
        assert wrong(pod, samples) == [], [outcome(pod, s) for s in samples] + [logs(node)]
        assert first_own is not None, outcome(pod, samples[-1]) + logs(node)


def replace_on_reused_address(node, old, name: str, role: str):
    """The old pod's sandbox goes, the new pod's sandbox gets its address; the API still
    shows the old pod Running with it and has no address for the new one."""
    node.containerd.set_range(old.ip, old.ip)
    try:
        node.remove_sandbox(old)
        new = node.add_pod(name, role=role)
    finally:
        node.containerd.set_range(None, None)
    assert new.ip == old.ip, new.sandbox
    assert node.api.pods.get("default", old.name)["status"]["podIP"] == old.ip
    return new


def pod_on_reused_address(node, address: str, name: str, role: str):
    """An established pod (address in the API, credentials served once) on ``address``."""
    node.containerd.set_range(address, address)
    try:
        pod = node.add_pod(name, role=role, ip_in_api=True)
    finally:
        node.containerd.set_range(None, None)
    assert pod.ip == address, pod.sandbox
    assert identity(pod, pod.wait_credentials()) == "own", logs(node)
    return pod


def reuse_once(node, old, name: str, role: str) -> dict:
    """One replacement on the reused address; what the new pod got, before and after the
    API caught up (the old pod's late delete, then the new address)."""
    new = replace_on_reused_address(node, old, name, role)
    stale = [fetch(new) for _ in range(STALE_FETCHES)]
    caught_up = time.monotonic()
    node.api.pods.delete("default", old.name)
    node.publish_ip(new)
    after, first_own = fetch_until_own(new, since=caught_up)
    return {"new": new, "stale": stale, "after": after, "first_own": first_own,
            "wrong_stale": wrong(new, stale), "wrong_after": wrong(new, after),
            "old_role_answers": sum(identity(new, s) == f"role {old.role}" for s in stale)}


@pytest.mark.root
def test_b_reused_address_while_the_api_shows_the_old_pod(runtime_node):
    node, agent = runtime_node
    old = pod_on_reused_address(node, REUSED["reuse"], "old", "role-old")
    got = reuse_once(node, old, "new", "role-new")
    stale = got["stale"]
    RECORD.add(agent, "reused address", {
        "first call": outcome(got["new"], stale[0]),
        "fetches while the API shows the old pod": len(stale),
        "wrong identities then": len(got["wrong_stale"]),
        "of which the old pod's role": got["old_role_answers"],
        "wrong identities after the API caught up": len(got["wrong_after"]),
        "seconds from the API catching up to the first own credentials": got["first_own"]})
    assert len(stale) == STALE_FETCHES and got["after"]
    if agent == "kiamfast":
        assert got["wrong_stale"] == [] and got["wrong_after"] == [], \
            [outcome(got["new"], s) for s in got["wrong_stale"] + got["wrong_after"]] \
            + [logs(node)]
        assert got["first_own"] is not None, outcome(got["new"], got["after"][-1]) + logs(node)


@pytest.mark.root
def test_c_churn_on_one_address_with_the_api_late(runtime_node):
    node, agent = runtime_node
    prev = pod_on_reused_address(node, REUSED["churn"], "churn-0", "churn-role-0")
    rounds = []
    for i in range(1, REPLACEMENTS + 1):
        got = reuse_once(node, prev, f"churn-{i}", f"churn-role-{i % 2}")
        rounds.append(got)
        prev = got["new"]
    RECORD.add(agent, "churn on one address (containerd)", {
        "replacements": len(rounds),
        "fetches": sum(len(r["stale"]) + len(r["after"]) for r in rounds),
        "wrong identities": sum(len(r["wrong_stale"]) + len(r["wrong_after"]) for r in rounds),
        "replacements with a wrong identity": sum(bool(r["wrong_stale"] or r["wrong_after"])
                                                  for r in rounds),
        "first calls with the pod's own role": sum(identity(r["new"], r["stale"][0]) == "own"
                                                   for r in rounds),
        "seconds from the API catching up to the first own credentials":
            spread([r["first_own"] for r in rounds])})
    assert len(rounds) == REPLACEMENTS
    if agent == "kiamfast":
        bad = [outcome(r["new"], s) for r in rounds for s in r["wrong_stale"] + r["wrong_after"]]
        assert bad == [], bad + [logs(node)]
        assert all(r["first_own"] is not None for r in rounds), logs(node)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("agent", AGENTS)
def test_c_bench_churn_api_only(agent):
    """bench/churn.py, both agents API-only (kube2iam always is; kiamfast with
    ``--cri-endpoint=none``): recorded for both, asserted for neither beyond the run itself,
    since without the runtime an agent can only be as late as its watch (the guarantee is
    the runtime's: the churn test above)."""
    if agent == "kube2iam" and kube2iam_binary() is None:
        pytest.skip("needs kube2iam: run tests/tools/build_kube2iam.sh")
    sys.path.insert(0, str(BENCH))
    import churn
    (r,) = churn.run(agent=agent, log=lambda *_: None, **BENCH_CHURN)
    t = r.tally
    RECORD.add(agent, "bench/churn.py (API-only)", {
        "addresses": r.slots, "replacements": r.replacements, "seconds": round(r.seconds, 1),
        "credential requests": t.requests, "right role": t.ok,
        "wrong role listings": t.wrong_prev + t.wrong_other,
        "of which the previous pod's": t.wrong_prev,
        "documents with another role's key": t.wrong_document,
        "not 200": t.not_served, "later than 1 s": t.late,
        "ms from the new IP to the first right listing": {
            k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.first_ok.items()}})
    assert r.replacements >= BENCH_CHURN["min_replacements"] and t.requests > 0, r
