"""Correctness under churn: pods replaced at a high rate, their addresses reused, while their
clients hammer the agent. Counts what must never happen: an answer naming a role other than
the asking pod's. And what must not happen often: no answer within the SDK's budget (1 s).

The node holds ``slots`` pods, each of a random role out of ``roles``, each with one client
(an SDK stand-in) that, for as long as its pod lives, fetches a token (``PUT
/latest/api/token``), then loops: ``GET .../security-credentials/`` (the listing: must be
the pod's role name) and ``GET .../security-credentials/<its role>`` (the document: its
AccessKeyId must be one STS issued for that role, checked against the STS proxy's records
afterwards). A churner replaces up to ``rate`` pods per second; each replacement of pod A by
pod B on one address follows the kubelet's order on a real node:

1. B is created in the API (Pending, no address: it was scheduled); the agent prefetches
   B's credentials from the watch;
2. A starts terminating (``deletionTimestamp``); its client stops once its request in
   flight is answered (its containers are killed), and acknowledges;
3. A's address is freed, and ``gap`` seconds later (CNI: teardown of A's sandbox, set-up of
   B's) B holds it; B's client starts at once.

Who tells the agent of step 3 is the runtime switch (``--runtime``):

* ``none`` (bench/run's ``churn`` section): no runtime; the API server publishes A's end
  (Failed, deleted) and, ``gap`` later, B's address and Running, in order and at once. So a
  wrong answer means the agent named A's (or any other) role to B's client after the API
  server had published A's end and B's claim: the agent's only help is the watch
  (``--cri-endpoint=none``). Addresses are 127.0.x.y; the clients of all pods share a few
  processes; a bare watch client in a process of its own measures the API server's own
  delivery lag beside the agent's. ``--agent kube2iam`` runs the same churn against
  kube2iam 0.15 itself (tests/tools/build_kube2iam.sh builds it), which is always API-only.
* ``containerd``, ``crio``, ``fault`` or ``auto`` (bench/run's ``runtime`` section): the
  node's runtime (bench/cri_node.py: a real containerd when root and containerd are there,
  else the CRI fault double; ``crio``: CRI-O's order of a stop on real namespaces, A's
  sandbox still READY for 0.2-1.5 s after its address went to B) removes A's sandbox and at
  once (gap 0) starts B's, which gets A's address; the API server hears of it only seconds later: A's end after 0.5-3 s, B's
  address after 0.5-3 s, in either order, or never (a quarter of the pods). Between the two
  the API server still shows A Running with the address B asks from: only the runtime can
  name the right pod. (A real kubelet on this VM reports B's address 0.7 s median, 1.4 s
  max after B's app started when idle, 12.7 s and 17.6 s with its API client throttled to
  2 requests/s: bench/kubelet_timing.py. The 0.5-3 s here lies between the two.) Two modes
  run the same churn with the same seed, one replacement at a time, one after the other:
  the agent with ``--cri-endpoint`` and the same agent with ``--cri-endpoint=none``, which
  can only follow the API and is expected to name A's role. Each pod's client is a
  process of its own, living exactly as long as its sandbox is READY; with containerd it
  is forked into the sandbox's network namespace, where a DNAT rule sends its
  127.0.0.1:<port> to the agent on the bridge, so the source address it binds is the
  sandbox's own. A wrong role is judged against who really held the address when the
  request was sent.

The pods' clients and the sum of what they saw are bench/churn_clients.py's.

    python bench/churn.py [--quick] [--runtime none|auto|containerd|crio|fault] [--requests N]
        [--rate R] [--gap S] [--slots N] [--min-replacements N] [--max-seconds S]
        [--agent kiamfast|kube2iam]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import multiprocessing as mp
import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from benchutil import cpu_seconds, pod_addresses, summarize_us

import bench_agent as ba  # noqa: E402  (benchutil put the repo on sys.path)
import cri_node  # noqa: E402
from cri_node import NAMESPACE, Pod, Sandbox, new_api_pod, populate, sandbox_for  # noqa: E402
from churn_clients import SandboxClients, Shared, SharedClients, Tally, tally  # noqa: E402
from loadgen import CREDENTIALS  # noqa: E402

from kiamfast.testing.net import http_request, one_request, split_response  # noqa: E402

API_ONLY = "none"
# Each switch's scenario: what the module docstring describes.
SCENARIOS = {
    API_ONLY: dict(slots=256, roles=40, rate=50.0, gap=0.01, max_seconds=240.0, late=None,
                   never=0.0, seed=3),
    "runtime": dict(slots=16, roles=8, rate=20.0, gap=0.0, max_seconds=600.0,
                    late=(0.5, 3.0), never=0.25, seed=11),
}


# ---- a witness of the watch ------------------------------------------------------------------

def _witness_main(port: int, token: str, node: str, stop, conn) -> None:
    """A bare watch client in its own process: when did each pod's end (phase Failed) and
    each pod's IP reach a watcher? Separates the API server's (emulator's) delivery lag from
    the agent's own."""
    import socket as _socket

    import orjson

    from scale_sim import _Stream

    class Witness(_Stream):
        __slots__ = ("pending", "ended", "claimed")

        def _data(self, data: bytes) -> None:
            *whole, self.pending = (self.pending + data).split(b"\n")
            now = time.perf_counter()
            for line in whole:
                ev = orjson.loads(line)
                obj = ev.get("object") or {}
                name = (obj.get("metadata") or {}).get("name")
                st = obj.get("status") or {}
                if st.get("phase") == "Failed" and name not in self.ended:
                    self.ended[name] = now
                if st.get("podIP") and name not in self.claimed:
                    self.claimed[name] = now

    sock = _socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"GET /api/v1/pods?watch=1&fieldSelector=spec.nodeName%3D{node} HTTP/1.1\r\n"
                 f"Host: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    sock.settimeout(0.2)
    w = Witness(sock)
    w.pending, w.ended, w.claimed = b"", {}, {}
    while not stop.value:
        try:
            data = sock.recv(1 << 16)
        except _socket.timeout:
            continue
        if not data:
            break
        w.feed(data)
    conn.send({"ended": w.ended, "claimed": w.claimed})
    sock.close()


def _spread(ms: np.ndarray, *, p99: bool = True) -> dict:
    if ms.size == 0:
        return {"n": 0, "p50": float("nan"), "max": float("nan"),
                **({"p99": float("nan")} if p99 else {})}
    return {"n": int(ms.size), "p50": float(np.median(ms)), "max": float(ms.max()),
            **({"p99": float(np.percentile(ms, 99))} if p99 else {})}


# ---- the churn -------------------------------------------------------------------------------

@dataclass
class _Replacement:
    name: str                  # the new pod
    uid: str
    role: int
    step: str = "stopping"     # the old pod's client is stopping, then "gap"
    since: float = 0.0         # time.monotonic() the step began
    due: float = 0.0           # "gap": when the new pod gets the address


class Churner:
    """Replaces pods (see the module docstring), each replacement a few steps that
    :meth:`pump` advances; with a runtime, one replacement at a time and the API late."""

    def __init__(self, *, c: ba.Cluster, node, clients, sh: Shared, pods: list[Pod],
                 role_names: list[bytes], rng: random.Random, gap: float,
                 late: tuple[float, float] | None, never: float) -> None:
        self.c, self.node, self.clients, self.sh, self.pods = c, node, clients, sh, pods
        self.role_names, self.rng, self.gap, self.late, self.never = (
            role_names, rng, gap, late, never)
        self.at_once = len(pods) if node is None else 1
        self.stages: dict[int, _Replacement] = {}
        self.events: list[tuple[float, int, object]] = []   # (due, seq, action): the API, late
        self._seq = itertools.count()
        self.ended: set[str] = set()
        self.pub_end: dict[str, float] = {}    # pod -> perf_counter() the API was told its end
        self.pub_ip: dict[str, float] = {}     # pod -> ... its address
        self.replaced = self.reused = self.never_published = 0

    def start(self, *, elapsed: float, rate: float) -> None:
        """Begin the replacements due by now (``rate`` per second since the start)."""
        due = min(int(elapsed * rate) - self.replaced - len(self.stages),
                  self.at_once - len(self.stages))
        free = [i for i in range(len(self.pods)) if i not in self.stages]
        for _ in range(max(0, min(due, len(free)))):
            self.begin(free.pop(self.rng.randrange(len(free))))

    def begin(self, slot: int) -> None:
        role = self.rng.randrange(len(self.role_names))
        name, uid = new_api_pod(self.c, self.role_names[role])          # 1. scheduled
        self.c.api.pods.mark_terminating(NAMESPACE, self.pods[slot].name)  # 2. deleted
        self.sh.want[slot] = 0
        self.stages[slot] = _Replacement(name=name, uid=uid, role=role, since=time.monotonic())

    def pump(self) -> None:
        """Publish what is due at the API, reap stopped clients, advance the steps."""
        now = time.monotonic()
        while self.events and self.events[0][0] <= now:
            heapq.heappop(self.events)[2]()
        self.clients.pump()
        for slot, r in list(self.stages.items()):
            if r.step == "stopping" and self.sh.ack[slot] == self.sh.gen[slot]:
                self._free(slot, r)
            elif r.step == "stopping" and self.node is not None and now - r.since > 10:
                raise RuntimeError(f"the client of slot {slot} did not stop in 10 s")
            if r.step == "gap" and time.monotonic() >= r.due:    # gap 0: at once
                self._claim(slot, r)

    def _free(self, slot: int, r: _Replacement) -> None:
        """3. The old pod's containers are gone: its address is free."""
        old = self.pods[slot]
        self.clients.pod_stopped(slot)
        if self.node is not None:
            self.node.remove_sandbox(old.sandbox)
        self._tell_api(lambda: self.publish_end(old.name))
        self.sh.ended[slot] = time.perf_counter()
        r.step, r.due = "gap", time.monotonic() + self.gap

    def _claim(self, slot: int, r: _Replacement) -> None:
        """... and ``gap`` later the new pod holds an address (the same, as a rule)."""
        old = self.pods[slot]
        role = self.role_names[r.role]
        sb = (sandbox_for(self.node, slot, name=r.name, uid=r.uid, role=role)
              if self.node is not None else old.sandbox)
        self.reused += sb.ip == old.sandbox.ip
        if self.late is not None and self.rng.random() < self.never:
            self.never_published += 1
        else:
            self._tell_api(lambda: self.publish_ip(r.name, sb.ip))
        self.sh.claimed[slot] = time.perf_counter()
        self.sh.prev[slot], self.sh.role[slot] = self.sh.role[slot], r.role
        self.sh.gen[slot] += 1
        self.pods[slot] = Pod(name=r.name, role=r.role, sandbox=sb)
        self.sh.want[slot] = 1
        self.clients.pod_started(slot, sb)
        del self.stages[slot]
        self.replaced += 1

    def _tell_api(self, action) -> None:
        """At once without a runtime; with one, 0.5-3 s later (``late``)."""
        if self.late is None:
            action()
        else:
            heapq.heappush(self.events, (time.monotonic() + self.rng.uniform(*self.late),
                                         next(self._seq), action))

    def publish_end(self, name: str) -> None:
        if name not in self.ended:
            self.ended.add(name)
            self.c.api.pods.set_phase(NAMESPACE, name, "Failed")
            self.pub_end[name] = time.perf_counter()
            self.c.api.pods.delete(NAMESPACE, name)

    def publish_ip(self, name: str, ip: str) -> None:
        if name not in self.ended:   # a dead pod's address is not reported any more
            self.c.api.pods.set_ips(NAMESPACE, name, [ip])
            self.pub_ip[name] = time.perf_counter()
            self.c.api.pods.set_phase(NAMESPACE, name, "Running")


def _listing(port: int, ip: str) -> bytes:
    request = http_request("GET", CREDENTIALS.decode())
    return split_response(one_request(port, request, source=ip, timeout=2))[2]


def _idle_lag(c: ba.Cluster, port: int, pods: list[Pod], sh: Shared,
              role_names: list[bytes], rng: random.Random, *, n: int) -> np.ndarray:
    """Baseline without a runtime: with no load, ms from a replacement's IP publication
    until the agent names the new pod's role (polled every 0.5 ms), the same replacement
    steps as the churn's."""
    lags = []
    for _ in range(n):
        i = rng.randrange(len(pods))
        new_role = (sh.role[i] + 1 + rng.randrange(len(role_names) - 1)) % len(role_names)
        new = c.add_pod("", role_names[new_role].decode(), namespace=NAMESPACE,
                        phase="Pending")
        c.api.pods.mark_terminating(NAMESPACE, pods[i].name)
        c.api.pods.set_phase(NAMESPACE, pods[i].name, "Failed")
        c.api.pods.delete(NAMESPACE, pods[i].name)
        t0 = time.perf_counter()
        c.api.pods.set_ips(NAMESPACE, new, [pods[i].sandbox.ip])
        c.api.pods.set_phase(NAMESPACE, new, "Running")
        pods[i] = Pod(name=new, role=new_role, sandbox=pods[i].sandbox)
        sh.prev[i], sh.role[i] = sh.role[i], new_role
        deadline = t0 + 5
        while (_listing(port, pods[i].sandbox.ip) != role_names[new_role]
               and time.perf_counter() < deadline):
            time.sleep(0.0005)
        lags.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.02)
    return np.array(lags)


class _Witness:
    """A bare watch client in a process of its own (see :func:`_witness_main`)."""

    def __init__(self, c: ba.Cluster, sh: Shared) -> None:
        ctx = mp.get_context("fork")
        self.pipe, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_witness_main, args=(
            c.api.port, c.api.token, c.node, sh.stop_all, child), daemon=True)
        self.proc.start()
        child.close()

    def finish(self) -> dict:
        seen = self.pipe.recv() if self.pipe.poll(10) else {"ended": {}, "claimed": {}}
        self.proc.join(5)
        return seen


@dataclass
class ChurnResult:
    mode: str              # the agent and its source of truth
    runtime: str           # what held the addresses: no runtime, the fault double, containerd
    slots: int
    roles: int
    rate: float
    gap: float
    seconds: float
    replacements: int
    reused: int            # replacements whose new pod got exactly the freed address
    never_published: int   # new pods whose address the API never heard of
    lost_clients: int      # client processes that died without a report
    tally: Tally
    first_ok: dict = field(default_factory=dict)   # B's address known -> its first right answer
    idle_lag: dict = field(default_factory=dict)   # the same, one replacement at a time, no load
    delivery: dict = field(default_factory=dict)   # bare watcher's lag behind the API, ms
    agent_restarts: str = ""
    control_cpu: float = float("nan")   # the control process's CPU seconds during the churn


def run_mode(node, *, runtime_on: bool = False, agent: str = "kiamfast", slots: int,
             roles: int, rate: float, gap: float, requests: int, max_seconds: float,
             min_replacements: int = 0, late: tuple[float, float] | None, never: float,
             seed: int, processes: int | None = None, idle_samples: int = 0,
             log=print) -> ChurnResult:
    """One agent through the churn: without a runtime (``node`` None), or on ``node``'s
    with the agent using it (``runtime_on``) or not."""
    role_names = [ba.role_name(r).encode() for r in range(roles)]
    rng = random.Random(seed)
    sh = Shared.create(slots)
    if node is None:
        mode = "full agent" if agent == "kiamfast" else agent
        extra: list[str] = []
    else:
        mode = "runtime (--cri-endpoint)" if runtime_on else "API only (--cri-endpoint=none)"
        extra = [f"--cri-endpoint={node.endpoint if runtime_on else 'none'}",
                 *node.agent_flags]
    with ba.cluster() as c:
        if node is None:       # every address held; every role in use from the start, so
            pods = []          # a new pod never waits on STS (a wait is the agent's)
            for ip in pod_addresses(slots):
                role = rng.randrange(roles)
                pods.append(Pod(name=c.add_pod(ip, role_names[role].decode(),
                                               namespace=NAMESPACE),
                                role=role, sandbox=Sandbox(id="", ip=ip, netns=None)))
        else:
            pods = populate(c, node, role_names=role_names, slots=slots)
        for i, pod in enumerate(pods):
            sh.role[i], sh.prev[i], sh.gen[i], sh.want[i], sh.ack[i] = pod.role, -1, 1, 1, 0
        try:
            with _agent_under_test(c, agent, extra) as a:
                a.wait_ready(120)
                if node is None:
                    idle = _idle_lag(c, a.port, pods, sh, role_names, rng, n=idle_samples)
                    witness = _Witness(c, sh)
                    c.api.traffic.wait_watches(2, node=c.node, timeout=10)
                    clients = SharedClients(
                        port=a.port, addrs=[p.sandbox.ip for p in pods], role_names=role_names,
                        sh=sh, processes=processes or max(1, len(os.sched_getaffinity(0)) - 1))
                else:
                    idle, witness = np.zeros(0), None
                    clients = SandboxClients(port=a.port, agent_host=node.agent_host,
                                             role_names=role_names, sh=sh)
                ch = Churner(c=c, node=node, clients=clients, sh=sh, pods=pods,
                             role_names=role_names, rng=rng, gap=gap, late=late, never=never)
                clients.start(pods)
                control = a.processes()["control"] if agent == "kiamfast" else []
                cpu0 = sum(map(cpu_seconds, control))
                t0 = last_log = time.monotonic()
                try:
                    while True:
                        now = time.monotonic()
                        ch.pump()
                        done = clients.progress()
                        if (done >= requests and ch.replaced >= min_replacements) or \
                                now - t0 > max_seconds:
                            break
                        ch.start(elapsed=now - t0, rate=rate)
                        if now - last_log > 10:
                            last_log = now
                            log(f"  churn, {mode}: {now - t0:.0f} s, {ch.replaced} "
                                f"replacements, {done:,} requests")
                        time.sleep(0.002)
                finally:
                    results, lost = clients.finish()
                    seen = witness.finish() if witness else {"ended": {}, "claimed": {}}
                seconds = time.monotonic() - t0
                control_cpu = (sum(map(cpu_seconds, control)) - cpu0 if control
                               else float("nan"))
                keymap = c.access_keys()
                sup = a.log_tail(4000)
        finally:
            if node is not None:
                cri_node.remove_pods(node, pods)
    delivery = {
        "old pod's end": np.array([seen["ended"][n] - t for n, t in ch.pub_end.items()
                                   if n in seen["ended"]]) * 1e3,
        "new pod's IP": np.array([seen["claimed"][n] - t for n, t in ch.pub_ip.items()
                                  if n in seen["claimed"]]) * 1e3}
    t = tally(results, role_names=role_names, keymap=keymap)
    return ChurnResult(
        mode=mode, runtime=node.kind if node is not None else "none (addresses from the API)",
        slots=slots, roles=roles, rate=rate, gap=gap, seconds=seconds,
        replacements=ch.replaced, reused=ch.reused, never_published=ch.never_published,
        lost_clients=lost, tally=t, first_ok=_spread(t.first_ok_ms),
        idle_lag=_spread(idle, p99=False) if node is None else {},
        delivery={k: _spread(v) for k, v in delivery.items()} if node is None else {},
        agent_restarts="exited with" in sup and sup[-600:] or "", control_cpu=control_cpu)


def _agent_under_test(c: ba.Cluster, agent: str, extra: list[str]):
    """kiamfast or kube2iam (API-only) for ``c``'s node, as a context manager."""
    if agent == "kube2iam":
        tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
        sys.path[:0] = [os.path.join(tests, "kube2iam"), tests]
        from kube2iam_harness import Kube2iam
        return Kube2iam(c, c.workdir / "kube2iam", [f"--base-role-arn={ba.BASE_ARN}"])
    return ba.agent(c, sts_qps=100, sts_burst=100, extra=extra)


def run(*, runtime: str = API_ONLY, requests: int = 1_000_000, min_replacements: int = 0,
        agent: str = "kiamfast", log=print, **scenario) -> list[ChurnResult]:
    """The churn with the runtime switch at ``runtime`` (see the module docstring): one
    result without a runtime, two with one (the agent using it, then not); ``scenario``
    overrides the switch's SCENARIOS entry (slots, roles, rate, gap, max_seconds, late,
    never, seed) and passes processes and idle_samples (API-only)."""
    kw = {**SCENARIOS[API_ONLY if runtime == API_ONLY else "runtime"],
          **({"idle_samples": 20} if runtime == API_ONLY else {}), **scenario}
    common = dict(requests=requests, min_replacements=min_replacements, log=log, **kw)
    if runtime == API_ONLY:
        return [run_mode(None, agent=agent, **common)]
    if agent != "kiamfast":
        raise ValueError(f"{agent} has no runtime view: run it with --runtime none")
    node = cri_node.make_node(runtime, kw["slots"])
    results = []
    try:
        for on in (True, False):
            r = run_mode(node, runtime_on=on, **common)
            log(f"  {r.mode}: {r.tally.wrong:,} wrong roles in {r.tally.requests:,} "
                f"credential requests, {r.replacements} replacements ({r.reused} reused the "
                f"address), {r.tally.not_200:,} not 200, {r.seconds:.0f} s")
            results.append(r)
        return results
    finally:
        node.close()


# ---- the report ------------------------------------------------------------------------------

def markdown(results: list[ChurnResult]) -> str:
    return (_markdown_api_only(results[0]) if len(results) == 1
            else _markdown_runtime(results))


def _markdown_api_only(r: ChurnResult) -> str:
    t = r.tally
    s = summarize_us(t.latencies_us)
    lines = [
        f"{r.slots} pod addresses, {r.roles} roles; {r.replacements:,} pods replaced in "
        f"{r.seconds:.0f} s ({r.replacements / r.seconds:.0f}/s, every address reused about "
        f"every {r.slots / max(r.replacements / r.seconds, 1e-9):.0f} s); gap between the old "
        f"pod's delete and the new pod's IP: {r.gap * 1e3:g} ms; {t.pods:,} pod clients.", "",
        "| credential requests | right role | **wrong role** | of which the previous pod's "
        "| not 200 | later than 1 s (SDK budget) | abandoned (> 3 s) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {t.requests:,} | {t.ok:,} | **{t.wrong}** | {t.wrong_prev} | {t.not_served:,} | "
        f"{t.late} | {t.hung} |", "",
        "Answers by status: " + ", ".join(f"{k}: {v:,}" for k, v in sorted(t.statuses.items()))
        + f". Token PUTs failed: {t.put_fail}. Connections refused: {t.connect_fail}.", "",
        f"Latency of the credential requests: p50 {s['p50']:.3f} ms, p90 {s['p90']:.3f} ms, "
        f"p99 {s['p99']:.3f} ms, p99.9 {s['p999']:.3f} ms, max {s['max']:.1f} ms."]
    if t.wrong_lags:
        ends = [a for a, _ in t.wrong_lags if a == a]
        ips = [b for _, b in t.wrong_lags if b == b]
        lines += ["", ("Every wrong answer named the address's previous pod's role. "
                       if t.wrong == t.wrong_prev else "") + f"The wrong listings came at most "
                  f"{max(ends, default=float('nan')):.1f} ms after the API server published the "
                  f"old pod's end (median {float(np.median(ends)) if ends else float('nan'):.1f}"
                  f" ms) and at most {max(ips, default=float('nan')):.1f} ms after it published "
                  "the new pod's IP: the agent had not yet applied those watch events (its lag "
                  "behind the API server), not a torn or crossed read."]
    if r.first_ok.get("n"):
        f = r.first_ok
        lines += ["", f"A new pod's client got its first right listing {f['p50']:.1f} ms "
                  f"(median; p99 {f['p99']:.1f} ms, max {f['max']:.1f} ms, {f['n']:,} pods) "
                  "after the API server published its IP: the time the agent took to apply "
                  "the events, or the request's own latency when it had already."
                  + (f" Without load (baseline, same agent before the run, {r.idle_lag['n']} "
                     f"replacements one at a time): median {r.idle_lag['p50']:.1f} ms, max "
                     f"{r.idle_lag['max']:.1f} ms." if r.idle_lag.get("n") else "")]
    if r.delivery:
        lines += ["", "For comparison, a bare watch client in its own process (same node, same "
                  "run) received these events this long after the API server published them: "
                  + "; ".join(f"{k}: median {v['p50']:.1f} ms, p99 {v['p99']:.1f} ms, max "
                              f"{v['max']:.1f} ms ({v['n']:,} events)"
                              for k, v in r.delivery.items()) + "."]
    if t.samples:
        lines += ["", "Examples of wrong or failed answers:", ""] + [f"- `{x}`" for x in t.samples]
    return "\n".join(lines)


def _markdown_runtime(results: list[ChurnResult]) -> str:
    r0 = results[0]
    lines = [
        f"Runtime: **{r0.runtime}**. {r0.slots} sandboxes, {r0.roles} roles; "
        f"{r0.replacements / max(r0.seconds, 1e-9):.1f} replacements/s; each replacement "
        "reuses the address at once (gap 0); the API server hears of the old pod's end and of "
        "the new pod's address 0.5-3 s later, in either order, and of a quarter of the new "
        "addresses never.", "",
        "| agent | credential requests | right | **wrong role** | of which the previous pod's "
        "| not 200 | > 1 s | replacements (address reused) | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        t = r.tally
        lines.append(f"| {r.mode} | {t.requests:,} | {t.ok:,} | **{t.wrong:,}** | "
                     f"{t.wrong_prev:,} | {t.not_200:,} | {t.late:,} | {r.replacements:,} "
                     f"({r.reused:,}) | {r.seconds:.0f} |")
    for r in results:
        t = r.tally
        s = summarize_us(t.latencies_us)
        f = r.first_ok
        lines += ["", f"{r.mode}: answers by status "
                  + ", ".join(f"{k}: {v:,}" for k, v in sorted(t.statuses.items()))
                  + f"; token PUTs failed {t.put_fail}, connections failed {t.connect_fail}, "
                  f"{t.pods:,} pod clients ({r.lost_clients} lost without a report); "
                  f"latency p50 {s['p50']:.3f} ms, p99 {s['p99']:.3f} ms, max "
                  f"{s['max']:.1f} ms; a new pod's first right answer "
                  + (f"{f['p50']:.1f} ms (p99 {f['p99']:.1f} ms) after its sandbox was READY"
                     if f.get("n") else "not measured")
                  + f"; the control process used {r.control_cpu:.2f} s of CPU, "
                  f"{r.control_cpu / max(r.replacements, 1) * 1e3:.1f} s per 1,000 replaced "
                  "pods (with the clients' requests)."]
        if t.samples:
            lines += ["", "Examples (\"the old pod's end\" and \"the new pod's IP published\" "
                      "are, here, the old sandbox's removal and the new sandbox READY; the API "
                      "heard of them later):", ""]
            lines += [f"- `{x}`" for x in t.samples[:5]]
    return "\n".join(lines)


def headline(results: list[ChurnResult], *, quick: bool = False
             ) -> list[tuple[str, str, str, str]]:
    """(what, value, target, verdict) rows for bench/report.py's summary table of a run
    with a runtime (``quick``: a short run, judged on its wrong roles only)."""
    rt, api = results
    enough = quick or rt.tally.requests >= 1_000_000
    return [(f"runtime churn ({rt.runtime.split(' (')[0]}, gap 0, API late): wrong roles with "
             f"--cri-endpoint (of {rt.tally.requests:,}; {rt.replacements} reuses)",
             str(rt.tally.wrong), "0 in ≥ 1,000,000",
             "✅" if rt.tally.wrong == 0 and enough else "❌"),
            (f"the same churn, API only (of {api.tally.requests:,})", f"{api.tally.wrong:,}",
             "(for comparison)", "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runtime", choices=(API_ONLY, "auto", "containerd", "crio", "fault"),
                    default=API_ONLY)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--rate", type=float)
    ap.add_argument("--gap", type=float)
    ap.add_argument("--slots", type=int)
    ap.add_argument("--min-replacements", type=int)
    ap.add_argument("--max-seconds", type=float, help="stop a mode's churn after this long")
    ap.add_argument("--agent", choices=["kiamfast", "kube2iam"], default="kiamfast")
    args = ap.parse_args(argv)
    scenario = {k: v for k, v in (("rate", args.rate), ("gap", args.gap),
                                  ("slots", args.slots), ("max_seconds", args.max_seconds))
                if v is not None}
    with_runtime = args.runtime != API_ONLY
    min_rep = args.min_replacements if args.min_replacements is not None else (
        (20 if args.quick else 200) if with_runtime else 0)
    results = run(runtime=args.runtime, agent=args.agent, min_replacements=min_rep,
                  requests=args.requests or (50_000 if args.quick else 1_000_000), **scenario)
    print(markdown(results))
    return 1 if results[0].tally.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
