"""A node at full CPU: what pods' credential calls wait, kiamfast beside kube2iam (issue 41).

A GPU node's CPUs are all busy with a training pod's data loaders, and that pod requests
nearly the whole node; the agent gets the CPU weight of its own request. This bench makes
that node on this machine, with cgroups shaped as the kubelet makes them
(bench/kubelet_cgroups.py):

* **the workload**: a Guaranteed-like pod (``kubepods/pod…``) whose cpu.shares are those a
  pod requesting 90 of 96 cores has on each CPU of a 96-core node (its request scaled to this
  machine's CPUs), one busy process per CPU. No CFS quota: a Guaranteed pod's quota equals
  its request and would leave 6 % idle, which the node's other pods take on a real node;
  here nothing is left idle, the worst of it;
* **the agent** in its pod under ``kubepods/burstable`` (a request) or
  ``kubepods/besteffort`` (none: kube2iam's chart default), weighted as the kubelet
  weighs its request, each agent started in turn on the same node, the same run;
* **the pods**: ``pods`` loopback source addresses of ``roles`` roles, each asking for its
  credential document every ``interval`` with a new connection and the SDKs' 1 s timeout
  (tests/steady_calls.py), from a process in a group of its own at the highest weight
  (a system daemon's place: the callers' own wait is not the agent's);
* every answer is judged: the key STS issued for the pod's own role, within 1 s.

Each case is an agent, its CPU request and a scheduling knob: the kernel's default, a
custom EEVDF slice (``sched_setattr``'s sched_runtime for SCHED_OTHER threads, Linux ≥ 6.12)
or SCHED_RR for the worker (opt-in real time; on a kernel with CONFIG_RT_GROUP_SCHED its
group's cpu.rt_runtime_us bounds it). A knob marked "bench" is applied by this bench to the
agent's threads; the others are the agent's own. Per case: calls, failed or over 1 s, wrong
role, latency percentiles, the agent's run delay per time slice (/proc schedstat, its
threads, read by the bench) and, for kiamfast, what its own CPU-wait series said.

Versions: ``v1`` (cpu.shares), ``v2`` (cpu.weight, where the v2 hierarchy has the cpu
controller) and ``v2 weights on v1`` (the group weights the kernel derives from the
kubelet's v2 cpu.weight, written through v1's cpu.shares: the same weights for the
scheduler, not a v2 measurement). A version this machine cannot make is reported skipped,
with the reason.

    python bench/saturated_node.py [--quick] [--version v1 ...]      (root: cgroups)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from benchutil import ROOT, Unavailable, cpu_seconds, median, summarize_us

for _p in (ROOT / "tests", ROOT / "tests" / "kube2iam"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import bench_agent as ba                  # noqa: E402
import kubelet_cgroups as kc              # noqa: E402

CHART_HELPERS = ROOT / "deploy" / "chart" / "kiamfast" / "templates" / "_helpers.tpl"
CHART_VALUES = ROOT / "deploy" / "chart" / "kiamfast" / "values.yaml"
SDK_TIMEOUT = 1.0
GOAL = {"p99_ms": 20.0, "max_ms": 100.0, "over_1s": 0}


def chart_realtime() -> bool:
    """Whether the chart runs the workers at real-time priority by default."""
    m = re.search(r"^realtimeWorkers:\s*(true|false)", CHART_VALUES.read_text(), re.M)
    return bool(m) and m.group(1) == "true"


def chart_cpu_request() -> int:
    """The chart's default CPU request of the agent container, in millicores."""
    text = CHART_HELPERS.read_text()
    block = text[text.index('define "kiamfast.resources"'):]
    m = re.search(r"cpu:\s*(\d+)m", block)
    assert m, "no cpu request in the chart's kiamfast.resources"
    return int(m.group(1))


FLOOR = "floor"


@dataclass(frozen=True)
class Case:
    agent: str                  # "kiamfast", "kube2iam", or FLOOR: nginx, the machine's floor
    milli: int | None           # CPU request (None: BestEffort)
    saturated: bool = True
    slice_us: int = 0           # a custom EEVDF slice for every thread, set by the bench
    rt: bool = False            # SCHED_RR for the worker, set by the bench
    realtime: bool = False      # the agent's own --worker-realtime
    flood: bool = False         # wrk hammers the agent meanwhile (the bound on harm)
    defer_accept: bool = False  # TCP_DEFER_ACCEPT on its listening socket, set by the bench

    @property
    def label(self) -> str:
        if self.agent == FLOOR:
            return ("floor: nginx answering a document at the callers' weight"
                    + (", saturated" if self.saturated else ", idle node"))
        req = "no request (BestEffort)" if self.milli is None else f"{self.milli}m"
        knobs = ([f"slice {self.slice_us / 1e3:g} ms (bench)"] if self.slice_us else []) + (
            ["SCHED_RR worker (bench)"] if self.rt else []) + (
            ["--worker-realtime"] if self.realtime else []) + (
            ["a pod flooding it (wrk)"] if self.flood else []) + (
            ["TCP_DEFER_ACCEPT (bench)"] if self.defer_accept else [])
        return (f"{self.agent}, {req}" + "".join(f", {k}" for k in knobs)
                + (", saturated" if self.saturated else ", idle node"))


def chart_case(*, saturated: bool = True) -> Case:
    """kiamfast as the chart's defaults run it."""
    return Case("kiamfast", chart_cpu_request(), saturated=saturated, realtime=chart_realtime())


def default_cases() -> tuple[Case, ...]:
    """The chart's defaults idle and saturated, then each candidate alone, then kube2iam
    (its chart's default: no requests; and with a request)."""
    cases = (chart_case(saturated=False), chart_case(),
             Case("kiamfast", 20, saturated=False),
             Case("kiamfast", 20), Case("kiamfast", 50), Case("kiamfast", 100),
             Case("kiamfast", 200),
             Case("kiamfast", 20, defer_accept=True),
             Case("kiamfast", 20, slice_us=100),
             Case("kiamfast", 20, realtime=True),
             Case("kiamfast", 20, flood=True), Case("kiamfast", 20, realtime=True, flood=True),
             Case("kube2iam", None), Case("kube2iam", 50), Case(FLOOR, None))
    return tuple(dict.fromkeys(cases))


@dataclass
class Options:
    pods: int = 30
    roles: int = 10
    interval: float = 0.1
    seconds: float = 6.0
    node_cpus: int = 96             # the node emulated
    workload_cores: float = 90.0    # what its workload pod requests
    versions: tuple[str, ...] = kc.VERSIONS
    rounds: int = 3                 # every case once per round, in a rotated order
    cases: tuple[Case, ...] | None = None       # None: default_cases(), or quick_cases()
    quick: bool = False


QUICK = Options(pods=4, roles=2, seconds=2.0, rounds=1, versions=kc.VERSIONS, quick=True)


def quick_cases() -> tuple[Case, ...]:
    d = chart_cpu_request()
    return tuple(dict.fromkeys((
        chart_case(saturated=False), chart_case(), Case("kiamfast", d, realtime=True),
        Case("kube2iam", None), Case(FLOOR, None))))


@dataclass
class Outcome:
    version: str
    case: Case
    calls: int = 0
    failed: int = 0                 # not the document, or over the SDKs' 1 s
    wrong: int = 0                  # a key STS did not issue for the pod's role
    outcomes: dict = field(default_factory=dict)
    latency_ms: dict = field(default_factory=dict)    # summarize_us of every call
    run_delay_per_slice_ms: float = float("nan")      # the workers' threads, from /proc
    metric_delay_per_slice_ms: float = float("nan")   # the same, from kiamfast's series
    cpu_ms_per_s: float = float("nan")                 # the agent's CPU use during the run
    workload_cpus: float = float("nan")                # CPUs the workload got meanwhile
    flood_rps: float = float("nan")
    wakeups_per_call: float = float("nan")             # the workers' time slices per call
    load: float = float("nan")                         # 1-min load average as it began
    throttled: int = 0
    agent_metric: dict = field(default_factory=dict)  # kiamfast's own CPU-wait series
    warned: bool = False            # kiamfast logged its CPU-wait warning
    lat_us: np.ndarray = field(default_factory=lambda: np.zeros(0))
    round_p99_ms: list = field(default_factory=list)  # each round's p99, for the spread

    @classmethod
    def merged(cls, rounds: list["Outcome"]) -> "Outcome":
        """The rounds of one case as one: every call in one distribution, counts summed,
        per-round rates as medians."""
        first = rounds[0]
        out = cls(first.version, first.case)
        for r in rounds:
            out.calls += r.calls
            out.failed += r.failed
            out.wrong += r.wrong
            for k, v in r.outcomes.items():
                out.outcomes[k] = out.outcomes.get(k, 0) + v
            out.throttled += r.throttled
            out.warned = out.warned or r.warned
        out.lat_us = np.concatenate([r.lat_us for r in rounds])
        out.latency_ms = summarize_us(out.lat_us)
        out.round_p99_ms = [r.latency_ms.get("p99", float("nan")) for r in rounds]
        for name in ("run_delay_per_slice_ms", "metric_delay_per_slice_ms", "cpu_ms_per_s",
                     "workload_cpus", "flood_rps", "wakeups_per_call", "load"):
            setattr(out, name, median([getattr(r, name) for r in rounds]))
        out.agent_metric = rounds[-1].agent_metric
        return out

    def meets_goal(self) -> bool:
        return (self.latency_ms.get("p99", 1e9) < GOAL["p99_ms"]
                and self.latency_ms.get("max", 1e9) < GOAL["max_ms"]
                and self.failed == 0 and self.wrong == 0)


@dataclass
class Result:
    options: dict
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)    # version -> why
    weights: dict = field(default_factory=dict)    # version -> {group: weight}
    default_milli: int = 0


# ---- scheduling knobs ------------------------------------------------------------------------

class SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("sched_util_min", ctypes.c_uint32), ("sched_util_max", ctypes.c_uint32)]


_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_libc = ctypes.CDLL(None, use_errno=True)


def set_slice(tid: int, slice_ns: int) -> None:
    """SCHED_OTHER with a custom EEVDF slice (sched_attr.sched_runtime; 0: the default)."""
    attr = SchedAttr(size=ctypes.sizeof(SchedAttr), sched_policy=os.SCHED_OTHER,
                     sched_runtime=slice_ns)
    if _libc.syscall(_SYS_SCHED_SETATTR[os.uname().machine], tid, ctypes.byref(attr), 0):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def schedstat(pids: list[int]) -> tuple[int, int]:
    """Run delay (ns) and time slices, summed over every thread of ``pids``."""
    delay = slices = 0
    for pid in pids:
        for tid in threads(pid):
            with contextlib.suppress(OSError, ValueError):
                _, d, n = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
                delay += int(d)
                slices += int(n)
    return delay, slices


# ---- the node --------------------------------------------------------------------------------

class Node:
    """The kubelet-shaped tree of one version, its workload and the callers' group."""

    def __init__(self, version: str, opts: Options) -> None:
        self.h = kc.Hierarchy(version)
        self.version = version
        ncpu = len(os.sched_getaffinity(0))
        self.ncpu = ncpu
        self.h.group("kubepods", milli=ncpu * 1000)       # allocatable: the whole machine
        self.workload_milli = round(ncpu * 1000 * opts.workload_cores / opts.node_cpus)
        self.workload = self.h.group("kubepods/pod-workload", milli=self.workload_milli)
        self.callers = self.h.group("bench-callers", shares=kc.MAX_SHARES)
        self.spinners: list[subprocess.Popen] = []
        self.weights = {"kubepods/pod-workload": kc.group_weight(self.workload_milli,
                                                                 _scheduler_version(version))}

    def agent_group(self, name: str, milli: int | None) -> tuple[Path, str]:
        """The agent's container cgroup, as the kubelet places a pod of this request."""
        if milli is None:
            self.h.group("kubepods/besteffort", shares=kc.MIN_SHARES)
            self.h.group(f"kubepods/besteffort/pod-{name}", shares=kc.MIN_SHARES)
            rel = f"kubepods/besteffort/pod-{name}/agent"
            path = self.h.group(rel, shares=kc.MIN_SHARES)
        else:
            self.h.group("kubepods/burstable", milli=milli)    # the only Burstable pod
            self.h.group(f"kubepods/burstable/pod-{name}", milli=milli)
            rel = f"kubepods/burstable/pod-{name}/agent"
            path = self.h.group(rel, milli=milli)
        self.weights[rel] = kc.group_weight(milli or 0, _scheduler_version(self.version),
                                            shares=None if milli else kc.MIN_SHARES)
        return path, rel

    def saturate(self, on: bool) -> None:
        if on and not self.spinners:
            # one data loader per CPU, as the training pod runs them
            self.spinners = [subprocess.Popen(
                [sys.executable, "-c", "while True: pass"],
                preexec_fn=_join(self.workload)) for _ in range(self.ncpu)]
        elif not on:
            for p in self.spinners:
                p.kill()
                p.wait()
            self.spinners = []

    def workload_cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.spinners)

    def close(self) -> None:
        self.saturate(False)
        self.h.close()


def _scheduler_version(version: str) -> str:
    return kc.V1 if version == kc.V1 else kc.V2


def _join(group: Path):
    def enter() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))
    return enter


# ---- the agents ------------------------------------------------------------------------------

@dataclass
class Started:
    pids: Callable[[], list[int]]
    worker_pids: Callable[[], list[int]]
    port: int
    stop: Callable[[], object]
    metrics: Callable[[], str] | None = None
    log: Callable[[], str] | None = None


FLOOR_DOCUMENT = json.dumps({"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": FLOOR,
                             "SecretAccessKey": "s" * 40, "Token": "t" * 600,
                             "Expiration": "2099-01-01T00:00:00Z"}).encode()


def start_floor() -> Started:
    """nginx answering every GET with a credential document: what this machine's kernel,
    callers and load make of a call when the server never waits."""
    from bench_servers import nginx, nginx_worker_pid
    stack = contextlib.ExitStack()
    server = stack.enter_context(nginx(FLOOR_DOCUMENT))
    worker = nginx_worker_pid(server)
    return Started(lambda: [server.pid, worker], lambda: [worker], server.port, stack.close)


def start_agent(case: Case, cluster, workdir: Path) -> Started:
    """The agent of ``case``, ready, every pod's credentials fetched."""
    from kube2iam_harness import Kube2iam
    if case.agent == FLOOR:
        return start_floor()
    if case.agent == "kube2iam":
        k = Kube2iam(cluster, workdir / f"kube2iam-{time.monotonic_ns()}",
                     [f"--base-role-arn={ba.BASE_ARN}"])
        k.wait_listening(60)
        return Started(lambda: [k.proc.pid], lambda: [k.proc.pid], k.port, k.stop,
                       log=k.log)
    stack = contextlib.ExitStack()
    a = stack.enter_context(ba.agent(
        cluster, sts_qps=100, sts_burst=100,
        extra=["--log-level=info", f"--host-ip={ba.HOST_IP}", "--ready-prefetch-timeout=120s",
               *(["--worker-realtime"] if case.realtime else [])]))
    try:
        a.wait_ready(120)
    except BaseException:
        stack.close()
        raise
    return Started(a.all_pids, lambda: a.processes()["worker"], a.port, stack.close,
                   metrics=lambda: a.get("/metrics", timeout=5.0)[1].decode(), log=a.log)


def warm(cluster, port: int, pods: list[tuple[str, str]], timeout: float = 60.0) -> None:
    """Every pod served its own role once (kube2iam fetches on the first request)."""
    import kube2iam_speed as ks
    for ip, role in pods:
        got = ks.wait_served(cluster, port, role, ip, timeout=timeout)
        if got != role:
            raise RuntimeError(f"{ip} was served {got}, not {role}")


def defer_accept(pid: int, port: int) -> int:
    """TCP_DEFER_ACCEPT (1 s) on ``pid``'s listening sockets of ``port``, through a copy of
    each descriptor (pidfd_getfd): the worker wakes for a connection once its request is
    there, not for the handshake and again for the request. How many were set."""
    import socket
    done = 0
    pidfd = os.pidfd_open(pid)
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    continue
            except OSError:
                continue
            copy = _libc.syscall(438, pidfd, int(fd), 0)       # pidfd_getfd
            if copy < 0:
                continue
            s = socket.socket(fileno=copy)
            try:
                if (s.type == socket.SOCK_STREAM
                        and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and s.getsockname()[1] == port):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
                    done += 1
            except OSError:
                pass
            finally:
                s.close()
    finally:
        os.close(pidfd)
    return done


def apply_knobs(case: Case, node: Node, rel: str, agent: Started) -> None:
    if case.defer_accept:
        assert any(defer_accept(pid, agent.port) for pid in agent.worker_pids())
    if case.slice_us:
        for pid in agent.pids():
            for tid in threads(pid):
                with contextlib.suppress(ProcessLookupError):
                    set_slice(tid, case.slice_us * 1000)
    if case.rt:
        for pid in agent.worker_pids():
            for tid in threads(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(1))


# ---- the callers: a process of their own -----------------------------------------------------

def start_flood(node: Node, port: int, opts: Options) -> subprocess.Popen:
    """wrk on keep-alive connections from an address no pod holds (every answer a 404), in
    the callers' group: as much as the agent will take."""
    return subprocess.Popen(
        ["wrk", "-t1", "-c8", f"-d{max(1, round(opts.seconds))}s",
         f"http://127.0.0.1:{port}/latest/meta-data/iam/security-credentials/x"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_join(node.callers))


def stop_flood(proc: subprocess.Popen) -> float:
    """wrk's requests per second, once it has ended."""
    out, _ = proc.communicate(timeout=60)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return float(m.group(1)) if m else float("nan")


def run_callers(node: Node, port: int, pods: list[tuple[str, str]], opts: Options) -> list:
    spec = json.dumps({"port": port, "pods": pods, "interval": opts.interval,
                       "seconds": opts.seconds})
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--callers", spec],
                       capture_output=True, text=True, timeout=opts.seconds + 60,
                       preexec_fn=_join(node.callers))
    if p.returncode:
        raise RuntimeError(f"the callers failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def callers_main(spec_json: str) -> int:
    from steady_calls import Caller
    spec = json.loads(spec_json)
    callers = [Caller("127.0.0.1", spec["port"], role, source=ip, interval=spec["interval"],
                      timeout=SDK_TIMEOUT, name_=ip) for ip, role in spec["pods"]]
    for c in callers:
        c.start()
    time.sleep(spec["seconds"])
    out = [[c.source, c.role, call.took, call.outcome, call.access_key]
           for c in callers for call in c.stop()]
    json.dump(out, sys.stdout)
    return 0


# ---- one case --------------------------------------------------------------------------------

def run_case(node: Node, case: Case, cluster, pods: list[tuple[str, str]], opts: Options,
             workdir: Path, log) -> Outcome:
    node.saturate(case.saturated)
    if case.agent == FLOOR:
        group, rel = node.callers, "bench-callers"
    else:
        group, rel = node.agent_group(
            f"{case.agent}-{case.milli}-{case.slice_us}-{int(case.rt)}", case.milli)
    if case.rt or case.realtime:
        # This kernel has CONFIG_RT_GROUP_SCHED: a group runs no real-time task without
        # runtime of its own, which no kubelet gives. The agent's group gets what the root
        # has, as on kernels without it (most distributions'), where only the kernel's
        # global throttling and the worker's own budget bound it.
        wanted = node.h.root_rt_runtime()
        granted = node.h.set_rt_runtime(rel, wanted)
        if granted < wanted:
            log(f"  saturated node [{node.version}]: {case.label}: real-time runtime "
                f"{granted} of {wanted} us (other groups of this machine hold the rest)")
    agent = start_agent(case, cluster, workdir)
    try:
        if case.agent != FLOOR:
            warm(cluster, agent.port, pods)
        node.h.move(group, agent.pids())
        apply_knobs(case, node, rel, agent)
        time.sleep(1.0)            # settle in its new place
        series0 = cpu_wait_series(agent.metrics()) if agent.metrics else {}
        load = os.getloadavg()[0]
        before = (schedstat(agent.worker_pids()), sum(cpu_seconds(p) for p in agent.pids()),
                  node.h.stat(group), time.monotonic(), node.workload_cpu())
        flood = start_flood(node, agent.port, opts) if case.flood else None
        calls = run_callers(node, agent.port, pods, opts)
        flood_rps = stop_flood(flood) if flood else float("nan")
        after = (schedstat(agent.worker_pids()), sum(cpu_seconds(p) for p in agent.pids()),
                 node.h.stat(group), time.monotonic(), node.workload_cpu())
        out = judge(node.version, case, calls,
                    None if case.agent == FLOOR else cluster.access_keys())
        out.load = load
        (d0, n0), (d1, n1) = before[0], after[0]
        elapsed = after[3] - before[3]
        out.run_delay_per_slice_ms = (d1 - d0) / max(n1 - n0, 1) / 1e6
        out.wakeups_per_call = (n1 - n0) / max(out.calls, 1)
        out.cpu_ms_per_s = (after[1] - before[1]) / elapsed * 1e3
        out.workload_cpus = (after[4] - before[4]) / elapsed
        out.flood_rps = flood_rps
        out.throttled = after[2].get("nr_throttled", 0) - before[2].get("nr_throttled", 0)
        if agent.metrics is not None:
            time.sleep(2.5)        # one more publish of the control process
            out.agent_metric = series1 = cpu_wait_series(agent.metrics())
            delay, slices = (f'kiamfast_cpu_{n}{{process="worker"}}'
                             for n in ("run_delay_seconds_total", "timeslices_total"))
            if series1.get(slices, 0) > series0.get(slices, 0):
                out.metric_delay_per_slice_ms = (
                    (series1[delay] - series0.get(delay, 0)) * 1e3
                    / (series1[slices] - series0.get(slices, 0)))
        if agent.log is not None:
            out.warned = "waited for the CPU" in agent.log()
    finally:
        agent.stop()
        if case.rt or case.realtime:
            node.h.set_rt_runtime(rel, 0, parents=False)
    log(f"  saturated node [{node.version}]: {case.label}: p99 "
        f"{out.latency_ms.get('p99', float('nan')):.1f} ms, {out.failed} failed")
    return out


def judge(version: str, case: Case, calls: list, issued: dict[str, str] | None) -> Outcome:
    """Counts and latencies of ``calls``; a call is wrong when STS did not issue its key for
    its pod's role (``issued`` None: the floor, whose document is nobody's)."""
    out = Outcome(version, case)
    took = np.array([c[2] for c in calls]) * 1e6
    out.calls = len(calls)
    for _, role, t, outcome, key in calls:
        out.outcomes[outcome] = out.outcomes.get(outcome, 0) + 1
        if outcome != "ok" or t > SDK_TIMEOUT:
            out.failed += 1
        elif issued is not None and issued.get(key) != role:
            out.wrong += 1
    out.lat_us = took
    out.latency_ms = summarize_us(took)
    return out


def cpu_wait_series(metrics_text: str) -> dict[str, float]:
    """kiamfast's CPU-wait series (kiamfast_cpu_*) from a /metrics text, summed by name and
    process label."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("kiamfast_cpu_"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


# ---- the whole run ---------------------------------------------------------------------------

def run(opts: Options, log=print) -> Result:
    from kube2iam_harness import MISSING, Cluster, kube2iam_binary
    if kube2iam_binary() is None:
        raise Unavailable(MISSING)
    reasons = {v: kc.unavailable(v) for v in opts.versions}
    if all(reasons.values()):
        raise Unavailable("; ".join(f"{v}: {why}" for v, why in reasons.items()))
    cases = opts.cases or (quick_cases() if opts.quick else default_cases())
    res = Result(options={**asdict(opts), "cases": [c.label for c in cases]},
                 default_milli=chart_cpu_request())
    pods = [(f"127.0.1.{10 + i}", f"sat-role-{i % opts.roles}") for i in range(opts.pods)]
    with tempfile.TemporaryDirectory(prefix="kiamfast-bench-sat-") as tmp:
        for version in opts.versions:
            reason = kc.unavailable(version)
            if reason:
                res.skipped[version] = reason
                log(f"  saturated node [{version}]: skipped: {reason}")
                continue
            cluster = Cluster()
            node = None
            try:
                for ip, role in pods:
                    cluster.add_pod(ip, role, namespace="bench")
                node = Node(version, opts)
                rounds: dict[Case, list[Outcome]] = {c: [] for c in cases}
                for rnd in range(opts.rounds):
                    # rotated each round: no case always follows the same one (the machine
                    # is shared, its load changes; ratios between cases hold per round)
                    for case in cases[rnd % len(cases):] + cases[:rnd % len(cases)]:
                        rounds[case].append(run_case(node, case, cluster, pods, opts,
                                                     Path(tmp), log))
                    log(f"  saturated node [{version}]: round {rnd + 1}/{opts.rounds} done")
                res.outcomes += [Outcome.merged(rs) for rs in rounds.values()]
                res.weights[version] = dict(node.weights)
            finally:
                if node is not None:
                    node.close()
                cluster.stop()
    return res


# ---- the report ------------------------------------------------------------------------------

def markdown(res: Result) -> str:
    o = res.options
    lines = [f"{o['pods']} pods of {o['roles']} roles, each asking for its credential "
             f"document every {o['interval'] * 1e3:.0f} ms on a new connection (SDK timeout "
             f"1 s), {o['rounds']} rounds of {o['seconds']:g} s per case, the cases in a "
             "rotated order each round (latencies: every call of the rounds; in brackets "
             "each round's p99); the workload pod holds the weight a pod "
             f"requesting {o['workload_cores']:g} of {o['node_cpus']} cores has on each CPU, "
             "one busy process per CPU; each agent in turn on the same node, in the same "
             f"run. The chart's default CPU request: {res.default_milli}m.", ""]
    for version in o["versions"]:
        if version in res.skipped:
            lines += [f"**{version}**: skipped on this machine: {res.skipped[version]}.", ""]
            continue
        rows = [r for r in res.outcomes if r.version == version]
        if not rows:
            continue
        w = res.weights.get(version, {})
        lines += [f"**cgroup {version}** (group weights the scheduler sees: "
                  + ", ".join(f"{k.split('/')[-2] if k.endswith('agent') else k} {v}"
                              for k, v in w.items()) + ")", "",
                  "| agent, its CPU request | calls | over 1 s or failed | wrong role | p50 "
                  "| p99 | max | worker's run delay per wake-up: /proc (its own metric) "
                  "| worker wake-ups per call | agent CPU | workload CPUs | load average |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lat = r.latency_ms
            own = ("" if r.case.agent != "kiamfast" else
                   f" ({r.metric_delay_per_slice_ms:.2f}{', warned' if r.warned else ''})")
            flood = "" if r.flood_rps != r.flood_rps else f" (flood {r.flood_rps:,.0f} req/s)"
            lines.append(
                f"| {r.case.label} | {r.calls:,} | {r.failed} | {r.wrong} | "
                f"{lat['p50']:.1f} ms | {lat['p99']:.1f} ms "
                f"({'/'.join(f'{x:.0f}' for x in r.round_p99_ms)}) | {lat['max']:.1f} ms | "
                f"{r.run_delay_per_slice_ms:.2f}{own} ms | {r.wakeups_per_call:.1f} | "
                f"{r.cpu_ms_per_s:.0f} ms/s{flood} | "
                f"{r.workload_cpus:.2f} | {r.load:.1f} |")
        lines.append("")
    lines += ["Latency: from the connect to the whole answer, measured by the callers. The "
              "worker's run delay per wake-up: its threads' wait for a CPU each time they "
              "became runnable, over the run (/proc/PID/task/TID/schedstat read by the bench; "
              "in brackets the same from kiamfast's own kiamfast_cpu_run_delay_seconds_total "
              "and kiamfast_cpu_timeslices_total, \"warned\": it logged its CPU-wait "
              "warning). Agent CPU: all its processes; workload CPUs: what the busy "
              "processes got meanwhile (the harm the agent did them is what they lost); load "
              "average: the machine's 1-minute load as each round of the case began "
              "(median): the machine is shared, and its other tenants run at the root "
              "cgroup's weight beside kubepods. "
              "Knobs marked (bench) were set by the bench on the agent's threads. The floor "
              "is nginx answering a credential document from the callers' own group (the "
              "highest weight): what the kernel's network path, the callers and the "
              "machine's other tenants add to a call that never waits for its server."]
    return "\n".join(lines)


def headline(res: Result) -> list[tuple[str, str, str, str]]:
    """The chart's defaults against the goal (a miss is the machine's when the floor missed
    it too), the old default, kube2iam and the floor beside them."""
    chart = chart_case()
    rows = []
    for version in res.options["versions"]:
        if version in res.skipped:
            rows.append((f"saturated node, {version}", f"skipped: {res.skipped[version]}",
                         "", "—"))
            continue
        mine = [r for r in res.outcomes if r.version == version and r.case.saturated]
        floor = next((r for r in mine if r.case.agent == FLOOR), None)
        for r in mine:
            if not (r.case == chart or r.case == Case("kiamfast", 20)
                    or r.case.agent in ("kube2iam", FLOOR)) or r.case.flood:
                continue
            lat = r.latency_ms
            verdict = ""
            if r.case == chart:
                verdict = "✅" if r.meets_goal() else "❌"
                if not r.meets_goal() and floor is not None and not floor.meets_goal():
                    verdict = (f"⚠️ machine-bound: the floor's p99 was "
                               f"{floor.latency_ms['p99']:.1f} ms")
            rows.append((f"saturated node, {version}: {r.case.label}"
                         + (" (the chart's defaults)" if r.case == chart else "")
                         + ": p99 / max / over 1 s or failed",
                         f"{lat['p99']:.1f} / {lat['max']:.0f} ms / {r.failed}",
                         "< 20 / < 100 ms / 0" if r.case == chart else "", verdict))
    return rows


def plot(res: Result, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from report import percentile_curve
    versions = [v for v in res.options["versions"]
                if any(r.version == v for r in res.outcomes)]
    if not versions:
        return []
    fig, axes = plt.subplots(1, len(versions), figsize=(7 * len(versions), 4.5),
                             squeeze=False)
    for ax, version in zip(axes[0], versions):
        for r in res.outcomes:
            if r.version == version:
                percentile_curve(ax, r.lat_us, r.case.label,
                                 linestyle="-" if r.case.agent == "kiamfast" else "--")
        ax.axhline(20, color="green", linewidth=0.8, alpha=0.6)
        ax.axhline(1000, color="red", linewidth=0.8, alpha=0.6)
        ax.set_ylabel("latency ms")
        ax.set_title(f"cgroup {version}", fontsize=10)
        ax.legend(fontsize=6)
    fig.suptitle("Credential calls on a saturated node (green: 20 ms goal for p99; red: the "
                 "SDKs' 1 s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "saturated_node.png", dpi=110)
    plt.close(fig)
    return ["saturated_node.png"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--callers"]:
        return callers_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--version", action="append", choices=kc.VERSIONS)
    ap.add_argument("--seconds", type=float)
    args = ap.parse_args(argv)
    opts = QUICK if args.quick else Options()
    if args.version:
        opts.versions = tuple(args.version)
    if args.seconds:
        opts.seconds = args.seconds
    res = run(opts, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
