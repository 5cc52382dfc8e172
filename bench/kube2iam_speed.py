"""kube2iam and kiamfast side by side, same run: the hot path, CPU, RSS.

Both agents run against the same fakes (tests/kube2iam/kube2iam_harness.py's ``Cluster``:
the API server emulator, moto's STS behind the recording proxy, the fake metadata service)
and get the same requests from the same load generator, wrk, so that every figure is a
ratio measured seconds apart on the same machine. kube2iam is the real binary
(tests/tools/build_kube2iam.sh) at its default log level (it logs every request at info, to
a file here); kiamfast runs at its default too (info; it logs no request).

* **Cached credential GET, 64 connections** (wrk -t1 -c64, one pod, the role's
  credentials already cached by both), the agent pinned to CPU 0 with every process it has,
  wrk on CPU 1; interleaved rounds, ratios per round then the median:

  (a) to the agent's own address and port (loopback, the pod is 127.0.0.1);
  (b) through the DNAT, as a pod sends it: wrk runs in a pod network namespace and asks
      169.254.169.254:80, which the node namespace's nat PREROUTING rule sends to the
      agent (root only; without root the report says it was skipped).

  The pod asks with the IMDSv2 token it got from that agent, as botocore does, and the
  role it is served is checked against what STS issued before the load. Reported:
  requests/s, p50/p99 (wrk's), the agent's CPU seconds per 1,000 requests (all its
  processes, from their CPU clocks; also beyond its idle background), wrk's and the
  agent's CPU use (a round where neither had its core is flagged machine-bound), RSS
  (kiamfast: the sum of its processes).
* Node start, beside kube2iam too, is bench/node_start.py's.
* **Scaling**: kiamfast with ``--workers 1`` and ``--workers 2``, and kube2iam (Go, as many
  threads as cores), unpinned on both cores with wrk beside them.

    python bench/kube2iam_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchutil import ROOT, Unavailable, cpu_seconds, median, rss_bytes

for _p in (ROOT / "tests", ROOT / "tests" / "kube2iam", ROOT / "tests" / "e2e"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import bench_agent as ba                    # noqa: E402
import loadgen                              # noqa: E402
from kube2iam_harness import MISSING, NODE, Cluster, Kube2iam, kube2iam_binary  # noqa: E402

from kiamfast.testing.net import http_request, one_request, split_response, wait_port  # noqa: E402

AGENTS = ("kube2iam", "kiamfast")
CONNECTIONS = 64
SERVER_CPU, LOAD_CPU = 0, 1
CREDS = "/latest/meta-data/iam/security-credentials/"
# The DNAT path: the node namespace's bridge address, the pod's address, the rule's target.
NODE_IP, DNAT_POD_IP = "10.77.0.1", "10.77.0.2"
METADATA = ("169.254.169.254", 80)


@dataclass
class Options:
    rounds: int = 5
    duration: float = 3.0
    workers: tuple[int, ...] = (1, 2)
    dnat: bool = True


QUICK = Options(rounds=1, duration=1.0, workers=())


@dataclass
class Load:
    """One wrk run against one agent."""
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    failed: int                # non-2xx answers, failed connects, reads and writes
    timeouts: int              # no answer within wrk's 2 s
    cpu_s_per_1k: float        # the agent's CPU seconds (all processes) per 1,000 requests
    wrk_util: float            # wrk's CPU seconds per second: 1.0 = its core saturated
    idle_s_per_1k: float = 0.0  # of cpu_s_per_1k, what the agent spends idle in that time

    @classmethod
    def from_wrk(cls, w: dict) -> "Load":
        return cls(rps=w["rps"], p50_ms=w["p50_ms"], p99_ms=w["p99_ms"],
                   requests=w["requests"], failed=w["errors"] - w["timeouts"] + w["non2xx"],
                   timeouts=w["timeouts"],
                   cpu_s_per_1k=w["cpu_us_per_req"] / 1e3, wrk_util=w["client_util"])

    @property
    def marginal_s_per_1k(self) -> float:
        """CPU per 1,000 requests beyond the agent's idle background (timers, watch): what
        a core's throughput is made of, however starved the round was."""
        return self.cpu_s_per_1k - self.idle_s_per_1k

    @property
    def agent_util(self) -> float:
        """The agent's CPU seconds per second: 1.0 = its core saturated."""
        return self.rps * self.cpu_s_per_1k / 1e3


@dataclass
class Result:
    options: dict
    paths: dict = field(default_factory=dict)      # path -> agent -> [Load per round]
    identity: dict = field(default_factory=dict)   # path -> agent -> role the pod was served
    rss_mib: dict = field(default_factory=dict)    # agent -> RSS after the loopback rounds
    scaling: dict = field(default_factory=dict)    # label -> [Load per round]
    skipped: dict = field(default_factory=dict)    # what was not measured -> why
    load: list = field(default_factory=list)       # 1-min load average, start and end
    idle: dict = field(default_factory=dict)       # path -> agent -> idle CPU s per s


# ---- the agents ------------------------------------------------------------------------------

@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """This thread on ``cpus`` while the body forks: a child inherits its parent thread's
    affinity (and Go sizes GOMAXPROCS from it at start)."""
    if not cpus:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


@dataclass
class Running:
    name: str
    port: int
    pids: Callable[[], list[int]]     # every pid of the agent, now
    stop: Callable[[], object]
    token: str = ""           # the IMDSv2 token the benchmark's pod got from this agent
    idle_rate: float = 0.0    # CPU seconds per second with no request (all processes)

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids())

    def measure_idle(self, seconds: float) -> None:
        """CPU the agent spends unloaded, over ``seconds`` (a measurement, not a wait)."""
        c0, t0 = self.cpu(), time.monotonic()
        time.sleep(seconds)
        self.idle_rate = (self.cpu() - c0) / (time.monotonic() - t0)

    def rss_mib(self) -> float:
        return sum(rss_bytes(p) for p in self.pids()) / 2**20


def start_kube2iam(cluster: Cluster, workdir: Path, cpus: set[int] | None) -> Running:
    with pinned(cpus):
        k = Kube2iam(cluster, workdir, [f"--base-role-arn={ba.BASE_ARN}"])
    return Running("kube2iam", k.port, lambda: [k.proc.pid], k.stop)


def start_kiamfast(cluster: Cluster, tmp: str, cpus: set[int] | None, *, workers: int = 1,
                   listen_host: str = "127.0.0.1", host_ip: str = ba.HOST_IP) -> Running:
    stack = contextlib.ExitStack()
    a = stack.enter_context(ba.agent(
        cluster, workers=workers, cpus=cpus, sts_qps=100, sts_burst=100,
        extra=["--log-level=info", f"--listen-host={listen_host}", f"--host-ip={host_ip}",
               "--ready-prefetch-timeout=120s"]))
    return Running("kiamfast", a.port, a.all_pids, stack.close)


def start(name: str, cluster: Cluster, tmp: str, cpus: set[int] | None, **kw) -> Running:
    if name == "kube2iam":
        return start_kube2iam(cluster, Path(tmp) / f"kube2iam-{time.monotonic_ns()}", cpus)
    return start_kiamfast(cluster, tmp, cpus, **kw)


# ---- requests --------------------------------------------------------------------------------

def fetch(dest: tuple[str, int], path: str, **kw) -> tuple[int, bytes]:
    """GET ``path`` on a fresh connection (from ``source`` if given): (status, body)."""
    status, _, body = split_response(one_request(dest[1], http_request("GET", path),
                                                 host=dest[0], **kw))
    return status, body


def served_role(cluster: Cluster, dest: tuple[str, int], role: str, *,
                source: str | None = None) -> str | None:
    """The role whose credentials the agent at ``dest`` answers ``source`` for ``role``'s
    path, as STS issued them (None: not a 200 with a key STS issued)."""
    import json
    try:
        status, body = fetch(dest, CREDS + role, source=source, timeout=2.0)
    except OSError:
        return None
    if status != 200:
        return None
    arn = cluster.role_issued(json.loads(body).get("AccessKeyId", ""))
    return arn.rsplit("/", 1)[-1] if arn else None


def wait_served(cluster: Cluster, port: int, role: str, source: str | None,
                dest: tuple[str, int] | None = None, timeout: float = 60.0) -> str:
    """Ask until the agent answers 200 (kube2iam fetches a role's credentials on the first
    request); the role it served."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = served_role(cluster, dest or ("127.0.0.1", port), role, source=source)
        if got:
            return got
        time.sleep(0.02)
    raise RuntimeError(f"the agent on {port} never served {role}")


def prepare(cluster: Cluster, agent: Running, source: str | None,
            dest: tuple[str, int] | None = None) -> str:
    """Once the agent serves the pod: the pod's token for the load, and the role it was
    served (checked against what STS issued)."""
    role = wait_served(cluster, agent.port, "bench-role-0", source, dest)
    agent.token = put_token(dest or ("127.0.0.1", agent.port), source=source)
    return role


def put_token(dest: tuple[str, int], *, source: str | None = None) -> str:
    """An IMDSv2 token from the agent at ``dest`` (kube2iam passes the PUT to the metadata
    service; kiamfast signs its own, bound to the pod)."""
    status, _, body = split_response(one_request(dest[1], http_request(
        "PUT", "/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"}),
        host=dest[0], source=source))
    assert status == 200, (status, body)
    return body.decode()


def wrk(url_host: str, port: int, role: str, agent: Running, duration: float,
        cpus: list[int] | None, tmp: str, prefix: list[str] | None = None) -> Load:
    """wrk with the token this agent gave the pod (as botocore sends the GET)."""
    w = loadgen.run_wrk(port, loadgen.WRK_GET.format(path=CREDS + role, token=agent.token),
                        connections=CONNECTIONS, duration=duration, cpus=cpus,
                        server_pids=agent.pids(), tmp=tmp, host=url_host, argv_prefix=prefix)
    load = Load.from_wrk(w)
    if load.rps:
        load.idle_s_per_1k = agent.idle_rate / load.rps * 1e3
    return load


# ---- (a) and (b): the hot path -------------------------------------------------------------

def hot_path_rounds(res: Result, path: str, agents: dict[str, Running], opts: Options,
                    tmp: str, *, host: str, port_of, prefix: list[str] | None = None,
                    cpus: list[int] | None = (LOAD_CPU,), log=print, before=None) -> None:
    for name, agent in agents.items():
        agent.measure_idle(1.0)
        res.idle.setdefault(path, {})[name] = agent.idle_rate
    for rnd in range(opts.rounds):
        for name, agent in agents.items():
            if before:
                before(agent)
            r = wrk(host, port_of(agent), "bench-role-0", agent, opts.duration,
                    list(cpus) if cpus else None, tmp, prefix)
            res.paths.setdefault(path, {}).setdefault(name, []).append(r)
        log(f"  kube2iam speed: {path} round {rnd + 1}/{opts.rounds} done")


def loopback_hot_path(res: Result, opts: Options, tmp: str, log) -> None:
    cluster = Cluster()
    agents: dict[str, Running] = {}
    try:
        cluster.api.pods.create("bench", "wrk-pod", node=NODE, ips=["127.0.0.1"],
                                annotations={ba.ROLE_KEY: "bench-role-0"}, phase="Running")
        for name in AGENTS:
            agents[name] = start(name, cluster, tmp, {SERVER_CPU})
            wait_port(agents[name].port, timeout=60)
            res.identity.setdefault("host", {})[name] = prepare(
                cluster, agents[name], "127.0.0.1")
        hot_path_rounds(res, "host", agents, opts, tmp, host="127.0.0.1",
                        port_of=lambda a: a.port, log=log)
        res.rss_mib = {name: a.rss_mib() for name, a in agents.items()}
        if opts.workers:
            scaling(res, cluster, opts, tmp, log)
    finally:
        for a in agents.values():
            a.stop()
        cluster.stop()


def scaling(res: Result, cluster: Cluster, opts: Options, tmp: str, log) -> None:
    """kiamfast at each ``--workers`` and kube2iam, one at a time, nothing pinned."""
    runs = [(f"kiamfast --workers {n}", "kiamfast", {"workers": n}) for n in opts.workers]
    for label, name, kw in runs + [("kube2iam", "kube2iam", {})]:
        agent = start(name, cluster, tmp, None, **kw)
        try:
            wait_port(agent.port, timeout=60)
            prepare(cluster, agent, "127.0.0.1")
            for _ in range(opts.rounds):
                res.scaling.setdefault(label, []).append(wrk(
                    "127.0.0.1", agent.port, "bench-role-0", agent, opts.duration, None, tmp))
        finally:
            agent.stop()
    log("  kube2iam speed: scaling done")


def dnat_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root: the DNAT path needs network namespaces and iptables"
    import netns
    return netns.unavailable_reason()


def dnat_hot_path(res: Result, opts: Options, tmp: str, log) -> None:
    """(b): the fakes and both agents in a node namespace, wrk in a pod namespace asking
    169.254.169.254:80; the node's nat rule names one agent at a time."""
    import netns
    node = netns.NodeNet(host_ip=NODE_IP)
    agents: dict[str, Running] = {}
    cluster = None
    try:
        pod = node.add_pod(DNAT_POD_IP)
        cluster = netns.call_in_netns(node.ns, Cluster)
        cluster.api.pods.create("bench", "wrk-pod", node=NODE, ips=[DNAT_POD_IP],
                                annotations={ba.ROLE_KEY: "bench-role-0"}, phase="Running")
        for name in AGENTS:
            agents[name] = netns.call_in_netns(
                node.ns, start, name, cluster, tmp, {SERVER_CPU},
                **({"listen_host": "0.0.0.0", "host_ip": NODE_IP}
                   if name == "kiamfast" else {}))
            netns.call_in_netns(node.ns, wait_port, agents[name].port, timeout=60)
        for name, agent in agents.items():
            dnat_to(node, agent.port)
            res.identity.setdefault("dnat", {})[name] = netns.call_in_netns(
                pod.ns, prepare, cluster, agent, None, METADATA)
        hot_path_rounds(res, "dnat", agents, opts, tmp, host=METADATA[0],
                        port_of=lambda a: METADATA[1], prefix=pod.ns.argv([]), log=log,
                        before=lambda a: dnat_to(node, a.port))
    finally:
        for a in agents.values():
            a.stop()
        if cluster is not None:
            cluster.stop()
        node.destroy()


def dnat_to(node, port: int) -> None:
    """The node's only nat PREROUTING rule: pods' metadata requests to NODE_IP:port (what
    both agents install with --iptables)."""
    node.ns.run(["iptables", "-t", "nat", "-F", "PREROUTING"], check=True)
    node.ns.run(["iptables", "-t", "nat", "-A", "PREROUTING", "-d", METADATA[0], "-p", "tcp",
                 "--dport", str(METADATA[1]), "-i", "kfbr0", "-j", "DNAT",
                 "--to-destination", f"{NODE_IP}:{port}"], check=True)


# ---- the whole comparison --------------------------------------------------------------------

def run(opts: Options, log=print) -> Result:
    if kube2iam_binary() is None:
        raise Unavailable(MISSING)
    if len(os.sched_getaffinity(0)) < 2:
        raise RuntimeError("needs 2 CPUs: the agent on one, wrk on the other")
    res = Result(options=dict(opts.__dict__), load=[os.getloadavg()[0]])
    with tempfile.TemporaryDirectory(prefix="kiamfast-bench-k2i-") as tmp:
        loopback_hot_path(res, opts, tmp, log)
        reason = dnat_unavailable() if opts.dnat else "not asked for"
        if reason:
            res.skipped["through the DNAT"] = reason
        else:
            dnat_hot_path(res, opts, tmp, log)
    res.load.append(os.getloadavg()[0])
    return res


# ---- summaries -------------------------------------------------------------------------------

def ratios(runs: dict[str, list[Load]]) -> dict[str, float]:
    """kiamfast ÷ kube2iam per round, then the median: throughput and CPU efficiency
    (kube2iam's CPU per request ÷ kiamfast's, all of it and beyond the idle background);
    p99 kiamfast ÷ kube2iam."""
    pairs = list(zip(runs["kiamfast"], runs["kube2iam"]))
    return {"rps": median([k.rps / g.rps for k, g in pairs if g.rps]),
            "cpu": median([g.cpu_s_per_1k / k.cpu_s_per_1k for k, g in pairs
                           if k.cpu_s_per_1k]),
            "marginal": median([g.marginal_s_per_1k / k.marginal_s_per_1k for k, g in pairs
                                if k.marginal_s_per_1k > 0]),
            "p99": median([k.p99_ms / g.p99_ms for k, g in pairs if g.p99_ms])}


SATURATED = 0.8


def machine_bound(runs: dict[str, list[Load]]) -> bool:
    """Neither the agent nor wrk had most of its core in the median round: other tenants
    of the machine did, and the throughput and latency figures are theirs, not the agents'
    (CPU per request still holds)."""
    return any(median([max(r.agent_util, r.wrk_util) for r in rs]) < SATURATED
               for rs in runs.values())


def med(runs: list[Load], attr: str) -> float:
    return median([getattr(r, attr) for r in runs])


PATH_NAMES = {"host": "(a) host address and port", "dnat": "(b) through the DNAT"}


def markdown(res: Result) -> str:
    o = res.options
    lines = [f"Cached credential GET, wrk -t1 -c{CONNECTIONS} (one pod), the agent pinned to "
             f"CPU {SERVER_CPU} (all its processes), wrk on CPU {LOAD_CPU}; {o['rounds']} "
             f"interleaved rounds of {o['duration']:g} s, medians; ratios per round, then the "
             "median. Both agents at their default log level.", "",
             "| path | agent | req/s | p50 ms | p99 ms | CPU s / 1,000 req | of which idle "
             "background | agent CPU use | wrk CPU use | failed | timed out | served role |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for path, runs in res.paths.items():
        for name in AGENTS:
            rs = runs[name]
            lines.append(f"| {PATH_NAMES[path]} | {name} | {med(rs, 'rps'):,.0f} | "
                         f"{med(rs, 'p50_ms'):.2f} | {med(rs, 'p99_ms'):.2f} | "
                         f"{med(rs, 'cpu_s_per_1k'):.3f} | {med(rs, 'idle_s_per_1k'):.3f} | "
                         f"{med(rs, 'agent_util'):.0%} | "
                         f"{med(rs, 'wrk_util'):.0%} | {sum(r.failed for r in rs)} | "
                         f"{sum(r.timeouts for r in rs)} | "
                         f"{res.identity[path][name]} |")
    for what, why in res.skipped.items():
        lines.append(f"| {what} | — | skipped: {why} | | | | | | | | | |")
    lines += ["", f"Load average (1 min) {res.load[0]:.1f} at the start, {res.load[-1]:.1f} at "
              f"the end, on {os.cpu_count()} CPUs. A CPU use well below 100 % for both the "
              "agent and wrk means neither had its core: other tenants took it, and the "
              "throughput and latency of that round are the machine's; CPU per request "
              "is the figure that holds, beyond the idle background above all (what each "
              "agent's processes spend with no request, measured for 1 s before the rounds: "
              + ", ".join(f"{PATH_NAMES[p][:3]} {a} {v * 1e3:.1f} ms/s"
                          for p, agents in res.idle.items() for a, v in agents.items())
              + "; in a starved round it is spread over few requests). "
              "Per request kiamfast makes one read and one write; "
              "kube2iam (strace) two writes, its answer and its log line, and one or two "
              "reads."]
    lines += ["", "| path | kiamfast ÷ kube2iam: throughput | requests per CPU-second "
              "(kube2iam's CPU per request ÷ kiamfast's) | the same beyond the idle "
              "background | p99 |", "|---|---:|---:|---:|---:|"]
    for path, runs in res.paths.items():
        r = ratios(runs)
        lines.append(f"| {PATH_NAMES[path]} | {r['rps']:.1f}× | {r['cpu']:.1f}× | "
                     f"{r['marginal']:.1f}× | 1/{1 / r['p99']:.0f} |")
    if res.rss_mib:
        lines += ["", "RSS after the loopback rounds (kiamfast: supervisor, control process "
                  "and worker together): " + ", ".join(
                      f"{n} {v:.1f} MiB" for n, v in res.rss_mib.items()) + "."]
    if res.scaling:
        lines += ["", f"Scaling, nothing pinned (2 cores shared with wrk): medians of "
                  f"{o['rounds']} rounds. Per core = req/s ÷ the agent's CPU use.", "",
                  "| agent | req/s | agent CPU cores used | req/s per core | p99 ms |",
                  "|---|---:|---:|---:|---:|"]
        for label, rs in res.scaling.items():
            per_core = 1e3 / med(rs, "cpu_s_per_1k")
            lines.append(f"| {label} | {med(rs, 'rps'):,.0f} | "
                         f"{med(rs, 'rps') / per_core:.2f} | {per_core:,.0f} | "
                         f"{med(rs, 'p99_ms'):.2f} |")
    return "\n".join(lines)


def headline(res: Result) -> list[tuple[str, str, str, str]]:
    ok = lambda c: "✅" if c else "❌"   # noqa: E731
    rows = []
    for path, runs in res.paths.items():
        r = ratios(runs)
        bound = machine_bound(runs)
        verdict = lambda good: ok(good) if good or not bound else (   # noqa: E731
            "⚠️ machine-bound: neither the agent nor wrk had its core")
        rows.append((f"vs kube2iam, {PATH_NAMES[path]}: throughput, each pinned to one core",
                     f"{r['rps']:.1f}×", "≥ 6×", verdict(r["rps"] >= 6)))
        rows.append((f"vs kube2iam, {PATH_NAMES[path]}: requests per CPU-second (kube2iam's "
                     "CPU per request ÷ kiamfast's; beyond the idle background)",
                     f"{r['cpu']:.1f}× ({r['marginal']:.1f}×)", "≥ 6×",
                     ok(r["marginal"] >= 6)))
        rows.append((f"vs kube2iam, {PATH_NAMES[path]}: p99 at {CONNECTIONS} connections",
                     f"1/{1 / r['p99']:.0f}", "≤ 1/10", verdict(r["p99"] <= 0.1)))
    for what, why in res.skipped.items():
        rows.append((f"vs kube2iam, {what}", f"skipped: {why}", "", ""))
    failed = {n: sum(r.failed + r.timeouts for runs in (*res.paths.values(), res.scaling)
                     for label, rs in runs.items() if label.startswith(n) for r in rs)
              for n in AGENTS}
    wrong = {n: sum(role != "bench-role-0" for path in res.identity.values()
                    for agent, role in path.items() if agent == n) for n in AGENTS}
    rows.append(("vs kube2iam runs: wrong roles, failed or timed-out requests: kiamfast "
                 "(kube2iam)", f"{wrong['kiamfast']}, {failed['kiamfast']} "
                 f"({wrong['kube2iam']}, {failed['kube2iam']})", "0, 0",
                 ok(wrong["kiamfast"] == 0 and failed["kiamfast"] == 0)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run(QUICK if args.quick else Options(),
              log=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
