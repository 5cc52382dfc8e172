"""Churn with a container runtime: addresses reused at once while the API server is told late
and in the wrong order, so that only the runtime can name the right pod. Counts what must
never happen: a request from pod B's address answered with any role but B's.

The node holds ``slots`` sandboxes, each one pod with a random role out of ``roles``. A
churner replaces up to ``rate`` pods per second (a real containerd here allows fewer); each
replacement of pod A by pod B on one slot follows the kubelet's order on a real node, with
the API server as late as it is there:

1. B is created in the API (Pending, no address: it was scheduled); the agent prefetches
   B's credentials from the watch;
2. A is marked terminating; A's client stops once its request in flight is answered and
   acknowledges (its containers are killed), and A's sandbox is stopped and removed;
3. at once (gap 0) B's sandbox is started and gets A's address (host-local's range is
   exactly the slots, so the address just freed is the only one free; the fault double
   reuses it by construction), and B's client starts as soon as the sandbox is READY;
4. only seconds later does the API hear of it: A's end (Failed, deleted) after 0.5-3 s, and
   B's address after 0.5-3 s, in either order, or never (a quarter of the pods).

So between 3 and 4 the API server still shows A Running with the address B is asking
from. (A real kubelet on this VM reports B's address 0.7 s median, 1.4 s max after B's app
started when idle, 12.7 s and 17.6 s with its API client throttled to 2 requests/s:
bench/kubelet_timing.py. The 0.5-3 s here lies between the two.) Both modes run the same churn with the same seed, one after the other: (a) the agent
with ``--cri-endpoint`` and (b) the same agent with ``--cri-endpoint=none``, which can only
follow the API and is expected to name A's role.

Which runtime: a real containerd (tests/cri/containerd.py) when root and containerd are
there, else the CRI fault double (kiamfast/testing/cri_fault.py) with loopback addresses;
the output says which. With containerd, this process moves into a fresh network namespace
standing for the node (the API emulator, STS, the metadata fake and the agent all live on
its loopback), every sandbox has its own network namespace with a real CNI address, and
each sandbox's client is a process forked into that namespace, where a DNAT rule sends its
127.0.0.1:<port> to the agent on the bridge (the client is bench/churn.py's, unchanged,
and a source address it binds is the sandbox's own). With the fault double, the client
binds the slot's 127.0.x.y. Either way one client process per sandbox, living exactly as
long as its sandbox is READY, so a wrong role is judged against who really held the
address when the request was sent.

    python bench/runtime_churn.py [--quick] [--requests N] [--rate R] [--slots S]
        [--runtime auto|containerd|fault]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import heapq
import ipaddress
import itertools
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from benchutil import ROOT, pod_addresses, summarize_us

import bench_agent as ba  # noqa: E402  (benchutil put the repo on sys.path)
import churn  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "cri"))

# Client processes are forked while this process has gRPC channels: skip gRPC's fork
# handlers (the children never use gRPC) and their log line per fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

NAMESPACE = "bench"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


# ---- network namespaces ----------------------------------------------------------------------

def enter_netns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (threads it starts
    and processes it forks afterwards are born there; sockets stay where they were made)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside_netns(path: str):
    """This thread in ``path`` for the duration, then back where it was."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter_netns(path)
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace")
    finally:
        os.close(home)


# ---- the node's runtime: a real containerd, or the fault double ------------------------------

@dataclass(frozen=True)
class Sandbox:
    id: str
    ip: str
    netns: str | None   # the sandbox's network namespace (None: a loopback address)


class FaultNode:
    """The CRI fault double; sandbox addresses are loopback addresses, one per slot."""

    kind = "CRI fault double (real gRPC, loopback addresses)"
    agent_flags: list[str] = []          # bench_agent's defaults: the agent on 127.0.0.1
    agent_host = "127.0.0.1"

    def __init__(self, slots: int) -> None:
        from kiamfast.testing.cri_fault import CriFault
        self.addrs = pod_addresses(slots)
        self.cri = CriFault().start()
        self.endpoint = self.cri.endpoint

    def run_sandbox(self, slot: int, *, name: str, uid: str, annotations: dict) -> Sandbox:
        from kiamfast.testing.cri_fault import fake_sandbox
        sb = fake_sandbox(name=name, uid=uid, namespace=NAMESPACE, ip=self.addrs[slot],
                          annotations=annotations)
        self.cri.put(sb)
        return Sandbox(id=sb.id, ip=sb.ip, netns=None)

    def remove_sandbox(self, sandbox: Sandbox) -> None:
        self.cri.stop_sandbox(sandbox.id)   # NOTREADY first, as a runtime's stop is
        self.cri.remove(sandbox.id)

    def close(self) -> None:
        self.cri.close()


class ContainerdNode:
    """A real containerd in a fresh node network namespace, which this thread enters (so
    create it before any server thread starts, and close it to come back)."""

    kind = "real containerd (CNI bridge + host-local addresses, clients in the sandboxes)"

    def __init__(self, slots: int, *, subnet: str = "10.89.0.0/24") -> None:
        from containerd import Containerd, NodeNetns
        self.netns = NodeNetns()
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            enter_netns(self.netns.path)
            # generous: under a load average of 20-30 here a StopPodSandbox took over 10 s
            self.ctd = Containerd(netns=self.netns.name, subnet=subnet,
                                  call_timeout=120.0).start()
            net = ipaddress.ip_network(subnet)
            first = net.network_address + 10
            # exactly one address per slot: a freed address is the next one handed out
            self.ctd.set_range(str(first), str(first + slots - 1))
        except BaseException:
            self.close()
            raise
        self.endpoint = self.ctd.endpoint
        self.agent_host = self.ctd.gateway   # the node's address on the bridge
        self.agent_flags = ["--listen-host="]  # every address of the node namespace

    def run_sandbox(self, slot: int, *, name: str, uid: str, annotations: dict) -> Sandbox:
        info = self.ctd.run_sandbox(name, uid=uid, namespace=NAMESPACE,
                                    annotations=annotations)
        return Sandbox(id=info.id, ip=info.ip, netns=info.netns_path)

    def remove_sandbox(self, sandbox: Sandbox) -> None:
        self.ctd.remove_sandbox(sandbox.id)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if getattr(self, "ctd", None) is not None:
                self.ctd.close()
        _libc.setns(self._home, CLONE_NEWNET)
        os.close(self._home)
        self.netns.delete()


def containerd_unavailable() -> str | None:
    from containerd import unavailable_reason
    return unavailable_reason() or (None if shutil.which("iptables") else
                                    "needs iptables (the DNAT in each sandbox): run "
                                    "`sh tests/cri/setup.sh`")


def make_node(kind: str, slots: int):
    """'containerd', 'fault', or 'auto' (containerd when it can run here)."""
    if kind == "auto":
        kind = "fault" if containerd_unavailable() else "containerd"
    if kind == "containerd":
        reason = containerd_unavailable()
        if reason:
            raise RuntimeError(reason)
        return ContainerdNode(slots)
    return FaultNode(slots)


# ---- one client process per sandbox ----------------------------------------------------------

def sandbox_client_main(*, port: int, slot: int, sandbox: Sandbox, agent_host: str,
                        role_names: list[bytes], sh: churn.Shared, conn) -> None:
    """bench/churn.py's client for one pod, run from inside its sandbox's network. Niced:
    on two cores, closed-loop clients would otherwise starve containerd and the churn."""
    os.nice(10)
    if sandbox.netns:
        enter_netns(sandbox.netns)
        # churn's client connects to 127.0.0.1:<port>; here that is the agent on the bridge
        subprocess.run(["iptables", "-w", "-t", "nat", "-A", "OUTPUT", "-d", "127.0.0.1/32",
                        "-p", "tcp", "--dport", str(port), "-j", "DNAT", "--to-destination",
                        f"{agent_host}:{port}"], check=True, capture_output=True)
    churn._client_main(port, [(slot, sandbox.ip)], role_names, sh, 0, None, conn)


@dataclass
class Client:
    """The parent's handle on one sandbox's client process."""
    proc: mp.Process
    pipe: object
    stop: object       # its own stop_all flag
    progress: object   # its own progress counter (requests answered)


def start_client(*, port: int, slot: int, sandbox: Sandbox, agent_host: str,
                 role_names: list[bytes], sh: churn.Shared) -> Client:
    ctx = mp.get_context("fork")
    mine = dataclasses.replace(sh, stop_all=mp.RawValue(ctypes.c_int32, 0),
                               progress=mp.RawArray(ctypes.c_int64, 1))
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=sandbox_client_main, daemon=True, kwargs=dict(
        port=port, slot=slot, sandbox=sandbox, agent_host=agent_host, role_names=role_names,
        sh=mine, conn=child))
    proc.start()
    child.close()
    return Client(proc=proc, pipe=parent, stop=mine.stop_all, progress=mine.progress)


def report_of(cl: Client) -> dict | None:
    """A stopped client's report, or None if its process died without one (a client that
    never reports is counted as lost, so its requests cannot silently vanish)."""
    try:
        report = cl.pipe.recv()
    except EOFError:
        report = None
    cl.proc.join(5)
    return report


def collect(clients: list[Client], *, timeout: float = 30.0) -> tuple[list[dict], int]:
    """Stop these clients: what they reported, and how many reported nothing."""
    for cl in clients:
        cl.stop.value = 1
    out, lost = [], 0
    deadline = time.monotonic() + timeout
    for cl in clients:
        report = (report_of(cl) if cl.pipe.poll(max(0.0, deadline - time.monotonic()))
                  else None)
        if report is None:
            lost += 1
        else:
            out.append(report)
    return out, lost


@dataclass
class Tally:
    """What the client processes reported, summed (bench/churn.py's counters)."""
    requests: int = 0
    ok: int = 0
    wrong_listing: int = 0
    wrong_prev: int = 0
    wrong_document: int = 0
    statuses: dict = field(default_factory=dict)
    late: int = 0
    hung: int = 0
    put_fail: int = 0
    connect_fail: int = 0
    pods: int = 0
    samples: list = field(default_factory=list)
    latencies_us: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    seconds: float = 0.0    # summed over clients (client-seconds)

    @property
    def wrong(self) -> int:
        return self.wrong_listing + self.wrong_document

    @property
    def not_200(self) -> int:
        return sum(v for k, v in self.statuses.items() if k != 200)


def tally(results: list[dict], *, role_names: list[bytes], keymap: dict[str, str]) -> Tally:
    """Sum the clients' reports; a document is wrong when STS issued its key for another
    role than the asking pod's (``keymap``: AccessKeyId -> role name)."""
    t = Tally()
    lats = []
    for r in results:
        st = r["stats"]
        t.requests += st["requests"]
        t.ok += st["ok"]
        t.wrong_listing += st["wrong_prev"] + st["wrong_other"]
        t.wrong_prev += st["wrong_prev"]
        t.late += st["late"]
        t.hung += st["hung"]
        t.put_fail += st["put_fail"]
        t.connect_fail += st["connect_fail"]
        t.pods += st["pods"]
        t.seconds += r["elapsed"]
        for k, v in r["statuses"].items():
            t.statuses[k] = t.statuses.get(k, 0) + v
        for (role, akid), n in r["keys"].items():
            if keymap.get(akid) == role_names[role].decode():
                t.ok += n
            else:
                t.wrong_document += n
                if len(t.samples) < 8:
                    t.samples.append(f"document for {role_names[role].decode()} carried "
                                     f"{akid} (issued for {keymap.get(akid)}) x{n}")
        t.samples += r["samples"][:max(0, 8 - len(t.samples))]
        lats.append(np.frombuffer(r["lat"], dtype=np.uint32))
    if lats:
        t.latencies_us = np.concatenate(lats)
    return t


# ---- the churn -------------------------------------------------------------------------------

@dataclass
class ModeResult:
    mode: str
    runtime: str
    slots: int
    roles: int
    seconds: float
    replacements: int
    reused: int            # replacements whose new sandbox got exactly the freed address
    never_published: int   # new pods whose address the API never heard of
    lost_clients: int      # client processes that died without a report
    tally: Tally


@dataclass
class Pod:
    name: str
    role: int
    sandbox: Sandbox
    client: Client | None = None


def new_api_pod(c: ba.Cluster, role: bytes) -> tuple[str, str]:
    """A pod scheduled on the node (Pending, no address yet): its name and UID."""
    name = c.add_pod("", role.decode(), namespace=NAMESPACE, phase="Pending")
    return name, c.api.get_pod(NAMESPACE, name)["metadata"]["uid"]


def sandbox_for(node, slot: int, *, name: str, uid: str, role: bytes) -> Sandbox:
    """The pod's sandbox, labelled and annotated as the kubelet does."""
    return node.run_sandbox(slot, name=name, uid=uid, annotations={ba.ROLE_KEY: role.decode()})


def populate(*, c: ba.Cluster, node, sh: churn.Shared, role_names: list[bytes],
             slots: int) -> list[Pod]:
    """Every slot's first pod, known to the API (so the agent is ready with them); every
    role in use from the start, so no later pod waits on STS."""
    pods = []
    for i in range(slots):
        role = i % len(role_names)
        name, uid = new_api_pod(c, role_names[role])
        sb = sandbox_for(node, i, name=name, uid=uid, role=role_names[role])
        c.api.set_pod_ips(NAMESPACE, name, [sb.ip])
        c.api.set_pod_phase(NAMESPACE, name, "Running")
        pods.append(Pod(name=name, role=role, sandbox=sb))
        sh.role[i], sh.prev[i], sh.gen[i] = role, -1, 1
    return pods


class Churner:
    """Drives one mode: the API emulator (late), the runtime (at once), the clients."""

    def __init__(self, *, c: ba.Cluster, node, port: int, sh: churn.Shared,
                 role_names: list[bytes], rng: random.Random, late: tuple[float, float],
                 never: float) -> None:
        self.c, self.node, self.port, self.sh = c, node, port, sh
        self.role_names, self.rng, self.late, self.never = role_names, rng, late, never
        self.pods: list[Pod] = []
        self.events: list[tuple[float, int, object]] = []   # (due, seq, action): the API, late
        self._seq = itertools.count()
        self.ended: set[str] = set()
        self.stopping: list[Client] = []
        self.results: list[dict] = []
        self.replacements = self.reused = self.never_published = self.lost = 0

    def start_clients(self) -> None:
        for i, pod in enumerate(self.pods):
            pod.client = self._client(i, pod.sandbox)
            self.sh.want[i] = 1

    def _client(self, slot: int, sandbox: Sandbox) -> Client:
        return start_client(port=self.port, slot=slot, sandbox=sandbox,
                            agent_host=self.node.agent_host, role_names=self.role_names,
                            sh=self.sh)

    # -- the API server, late --------------------------------------------------------------
    def later(self, delay: float, action) -> None:
        heapq.heappush(self.events, (time.monotonic() + delay, next(self._seq), action))

    def pump(self) -> None:
        """Publish what is due; reap clients that have reported."""
        now = time.monotonic()
        while self.events and self.events[0][0] <= now:
            heapq.heappop(self.events)[2]()
        for cl in list(self.stopping):
            if cl.pipe.poll(0):
                self.stopping.remove(cl)
                report = report_of(cl)
                if report is None:
                    self.lost += 1
                else:
                    self.results.append(report)

    def publish_end(self, name: str) -> None:
        if name not in self.ended:
            self.ended.add(name)
            self.c.api.set_pod_phase(NAMESPACE, name, "Failed")
            self.c.api.delete_pod(NAMESPACE, name)

    def publish_ip(self, name: str, ip: str) -> None:
        if name not in self.ended:   # a dead pod's address is not reported any more
            self.c.api.set_pod_ips(NAMESPACE, name, [ip])
            self.c.api.set_pod_phase(NAMESPACE, name, "Running")

    # -- one replacement ---------------------------------------------------------------------
    def replace(self, slot: int) -> None:
        sh, old = self.sh, self.pods[slot]
        role = self.rng.randrange(len(self.role_names))
        name, uid = new_api_pod(self.c, self.role_names[role])  # 1. scheduled
        self.c.api.mark_pod_terminating(NAMESPACE, old.name)    # 2. deleted by its owner
        sh.want[slot] = 0
        deadline = time.monotonic() + 10
        while sh.ack[slot] != sh.gen[slot]:                     # its containers are killed
            if time.monotonic() > deadline:
                raise RuntimeError(f"the client of slot {slot} did not stop in 10 s")
            self.pump()
            time.sleep(0.0005)
        old.client.stop.value = 1
        self.stopping.append(old.client)
        self.node.remove_sandbox(old.sandbox)
        sh.ended[slot] = time.perf_counter()
        sb = sandbox_for(self.node, slot, name=name, uid=uid,    # 3. gap 0: the new sandbox
                         role=self.role_names[role])
        sh.claimed[slot] = time.perf_counter()
        self.reused += sb.ip == old.sandbox.ip
        sh.prev[slot], sh.role[slot] = sh.role[slot], role
        sh.gen[slot] += 1
        new = Pod(name=name, role=role, sandbox=sb, client=self._client(slot, sb))
        self.pods[slot] = new
        sh.want[slot] = 1
        lo, hi = self.late                                      # 4. the API, seconds later
        old_name = old.name
        self.later(self.rng.uniform(lo, hi), lambda: self.publish_end(old_name))
        if self.rng.random() < self.never:
            self.never_published += 1
        else:
            self.later(self.rng.uniform(lo, hi), lambda: self.publish_ip(name, sb.ip))
        self.replacements += 1

    def progress(self) -> int:
        live = sum(p.client.progress[0] for p in self.pods if p.client)
        return live + sum(r["stats"]["requests"] for r in self.results) + sum(
            cl.progress[0] for cl in self.stopping)

    def finish(self) -> list[dict]:
        clients = [p.client for p in self.pods if p.client] + self.stopping
        self.stopping = []
        results, lost = collect(clients)
        self.lost += lost
        return self.results + results


def run_mode(node, *, runtime_on: bool, slots: int, roles: int, rate: float, requests: int,
             max_seconds: float, min_replacements: int = 0,
             late: tuple[float, float] = (0.5, 3.0), never: float = 0.25, seed: int = 11,
             log=print) -> ModeResult:
    """One agent (with the runtime or API only) through the churn; ``late``: the range of
    the API's delays (s), ``never``: the share of new pods whose address it never hears."""
    role_names = [ba.role_name(r).encode() for r in range(roles)]
    sh = churn.Shared.create(slots)
    mode = "runtime (--cri-endpoint)" if runtime_on else "API only (--cri-endpoint=none)"
    with ba.cluster() as c:
        extra = [f"--cri-endpoint={node.endpoint if runtime_on else 'none'}",
                 *node.agent_flags]
        with ba.agent(c, sts_qps=100, sts_burst=100, extra=extra) as a:
            ch = Churner(c=c, node=node, port=a.port, sh=sh, role_names=role_names,
                         rng=random.Random(seed), late=late, never=never)
            try:
                ch.pods = populate(c=c, node=node, sh=sh, role_names=role_names, slots=slots)
                a.wait_ready(120)
                ch.start_clients()
                t0 = last_log = time.monotonic()
                while True:
                    now = time.monotonic()
                    ch.pump()
                    done = ch.progress()
                    if (done >= requests and ch.replacements >= min_replacements) or \
                            now - t0 > max_seconds:
                        break
                    if ch.replacements < (now - t0) * rate:
                        ch.replace(ch.rng.randrange(slots))
                    else:
                        time.sleep(0.002)
                    if now - last_log > 10:
                        last_log = now
                        log(f"  {mode}: {now - t0:.0f} s, {ch.replacements} replacements, "
                            f"{done:,} requests")
                seconds = time.monotonic() - t0
                results = ch.finish()
                keymap = c.access_keys()
            finally:
                for pod in ch.pods:
                    with contextlib.suppress(Exception):
                        node.remove_sandbox(pod.sandbox)
    return ModeResult(mode=mode, runtime=node.kind, slots=slots, roles=roles, seconds=seconds,
                      replacements=ch.replacements, reused=ch.reused,
                      never_published=ch.never_published, lost_clients=ch.lost,
                      tally=tally(results, role_names=role_names, keymap=keymap))


def run(*, runtime: str = "auto", slots: int = 16, roles: int = 8, rate: float = 20.0,
        requests: int = 1_000_000, min_replacements: int = 0, max_seconds: float = 600.0,
        log=print) -> list[ModeResult]:
    """Both modes, same churn (same seed), one after the other on the same runtime. A real
    containerd replaces a pod in 0.1-1 s here (stop + run sandbox, CPU shared with the
    load), below ``rate``: then the churn is as fast as the runtime allows, and
    ``min_replacements`` keeps a mode running past ``requests`` until it has seen that
    many reuses."""
    node = make_node(runtime, slots)
    results = []
    try:
        for on in (True, False):
            r = run_mode(node, runtime_on=on, slots=slots, roles=roles, rate=rate,
                         requests=requests, min_replacements=min_replacements,
                         max_seconds=max_seconds, log=log)
            log(f"  {r.mode}: {r.tally.wrong:,} wrong roles in {r.tally.requests:,} credential "
                f"requests, {r.replacements} replacements ({r.reused} reused the address), "
                f"{r.tally.not_200:,} not 200, {r.seconds:.0f} s")
            results.append(r)
        return results
    finally:
        node.close()


def markdown(results: list[ModeResult]) -> str:
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
        lines += ["", f"{r.mode}: answers by status "
                  + ", ".join(f"{k}: {v:,}" for k, v in sorted(t.statuses.items()))
                  + f"; token PUTs failed {t.put_fail}, connections failed {t.connect_fail}, "
                  f"{t.pods:,} pod clients ({r.lost_clients} lost without a report); "
                  f"latency p50 {s['p50']:.3f} ms, p99 {s['p99']:.3f} ms, max "
                  f"{s['max']:.1f} ms."]
        if t.samples:
            lines += ["", "Examples (bench/churn.py's wording: \"the old pod's end\" and \"the "
                      "new pod's IP published\" are, here, the old sandbox's removal and the "
                      "new sandbox READY; the API heard of them later):", ""]
            lines += [f"- `{x}`" for x in t.samples[:5]]
    return "\n".join(lines)


def headline(results: list[ModeResult], *, quick: bool = False
             ) -> list[tuple[str, str, str, str]]:
    """(what, value, target, verdict) rows for bench/report.py's summary table (``quick``:
    a short run, judged on its wrong roles only)."""
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
    ap.add_argument("--requests", type=int)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--min-replacements", type=int)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--runtime", choices=("auto", "containerd", "fault"), default="auto")
    args = ap.parse_args(argv)
    n = args.requests or (50_000 if args.quick else 1_000_000)
    min_rep = args.min_replacements if args.min_replacements is not None else (
        20 if args.quick else 200)
    results = run(runtime=args.runtime, slots=args.slots, rate=args.rate, requests=n,
                  min_replacements=min_rep)
    print(markdown(results))
    return 1 if results[0].tally.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
