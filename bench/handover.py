"""Handing the node over: what pods see while the agent is upgraded, restarted or crashes.

A node built from network namespaces (tests/e2e: the bridge, the real DNAT rule, the API
server emulator, moto's STS, the fake metadata service that hands out the node's role) with
30 pods of 10 roles, each asking for its credential document every 100 ms with the SDKs'
1 s timeout, half of them on a fresh connection each time and half on one keep-alive
connection (tests/steady_calls.py), while

* **surge**: a second kiamfast takes the node over (--handover-socket);
* **rolling**: the agent is stopped (SIGTERM) and a new one started without keeper or
  handover, as the kubelet does with maxUnavailable (minus its own stop, image and start
  work); *kiamfast's part* is the time from the new process's start to the first pod's
  answer;
* **crash**: the agent's whole process tree is killed (SIGKILL, as an OOM kill of its
  container) and started again at once, with a socket keeper holding the sockets;
* **kube2iam**: the real kube2iam (tests/tools/build_kube2iam.sh) restarted (SIGTERM) and
  killed (SIGKILL), then started again, on a node of its own with the same pods.

Reported per scenario: calls, unanswered (anything but the document: refused, reset, timed
out, 503...), wrong (a key STS did not issue for the pod's role, or the node's), the longest
time any pod went without an answer, and when the event began and ended.  Also what the
socket keeper costs (RSS and PSS), and what re-asserting the DNAT rule costs per check
(``iptables -C`` on a nat table of 22,000 rules, nft and legacy).

    python bench/handover.py [--quick]      (root: network namespaces and iptables)
"""
from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from benchutil import ROOT, proc_memory

for _p in (ROOT / "tests", ROOT / "tests" / "e2e", ROOT / "tests" / "kube2iam"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@dataclass
class Options:
    pods: int = 30           # at most 200 (one /24)
    roles: int = 10
    interval: float = 0.1
    timeout: float = 1.0
    settle: float = 2.0          # steady calls before and after each event


QUICK = Options(pods=10, roles=5, settle=1.0)


@dataclass
class Scenario:
    agent: str
    name: str
    calls: int = 0
    unanswered: int = 0
    wrong: int = 0
    node_role: int = 0
    wrong_calls: list[str] = field(default_factory=list)   # the first few, for the report
    outcomes: dict[str, int] = field(default_factory=dict)
    longest_gap: float = 0.0        # seconds a pod went without an answer, worst pod
    event: float = 0.0              # seconds the event itself took (start to its end)
    start_to_first_answer: float = float("nan")   # rolling/restarts: the new process's part
    start_to_ready: float = float("nan")


@dataclass
class Result:
    options: dict
    scenarios: list[Scenario] = field(default_factory=list)
    keeper: dict[str, dict[str, int]] = field(default_factory=dict)
    recheck: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


# ---- the node and its pods --------------------------------------------------------------------

def make_node(tmp: Path, opts: Options):
    from e2e_cluster import Node
    node = Node(tmp, taint=False)
    pods = [node.add_pod(f"pod-{i}", f"10.77.0.{10 + i}", role=f"role-{i % opts.roles}")
            for i in range(opts.pods)]
    return node, pods


def ask(pods, opts: Options):
    """Per pod one caller on fresh connections and one on a keep-alive connection."""
    from handover_node import pod_callers
    return pod_callers(pods, interval=opts.interval, timeout=opts.timeout,
                       keep_alive=(False, True))


def judge(node, scenario: Scenario, callers) -> Scenario:
    from steady_calls import summary
    per_pod: dict[str, list] = defaultdict(list)
    for caller in callers:
        for call in caller.stop():
            per_pod[caller.pod.name].append((caller.pod, call))
    # read once every caller has stopped: a key issued while they still asked is in it
    issued = node.sts.issued()
    scenario.calls = sum(len(v) for v in per_pod.values())
    every = [c for v in per_pod.values() for _, c in v]
    scenario.outcomes = summary(every)
    scenario.unanswered = sum(1 for c in every if not c.ok)
    for pod_calls in per_pod.values():
        for pod, call in pod_calls:
            if call.access_key and call.access_key.startswith("ASIANODE"):
                scenario.node_role += 1
            elif call.ok:
                arn = issued.get(call.access_key, "")
                if arn.rsplit("/", 1)[-1] != pod.role:
                    scenario.wrong += 1
                    if len(scenario.wrong_calls) < 5:
                        scenario.wrong_calls.append(
                            f"{pod.name} ({pod.role}) got {call.access_key}, "
                            f"issued for {arn or 'nothing STS answered'}")
        ends = sorted(c.at + c.took for _, c in pod_calls if c.ok)
        starts = sorted(c.at for _, c in pod_calls)
        if starts:
            # from the first call to the last: a pod that never got an answer counts whole
            points = [starts[0], *ends, starts[-1]]
            gap = max((b - a for a, b in zip(points, points[1:])), default=0.0)
            scenario.longest_gap = max(scenario.longest_gap, gap)
    scenario.node_role += len(node.imds_credential_requests())
    return scenario


def first_answer_after(callers, t0: float) -> float:
    ends = [c.at + c.took for caller in callers for c in caller.snapshot()
            if c.ok and c.at >= t0]
    return (min(ends) - t0) if ends else float("nan")


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.01)


# ---- kiamfast ---------------------------------------------------------------------------------

def kiamfast_scenarios(res: Result, opts: Options, tmp: Path, log) -> None:
    from handover_node import handover_agent, idle, serving
    node, pods = make_node(tmp / "kiamfast", opts)
    keepers = []
    try:
        # one keeper per pod of the DaemonSet (each pod has its own emptyDir)
        paths = []
        for pod_name in ("agent-0", "agent-1"):
            path = str(tmp / "kiamfast" / f"{pod_name}-emptydir" / "keeper.sock")
            Path(path).parent.mkdir(parents=True)
            keepers.append(node.net.ns.popen([sys.executable, "-m", "kiamfast", "keep-sockets",
                                              "--socket", path], stderr=subprocess.DEVNULL))
            paths.append(path)
        agent = handover_agent(node, "agent-0", keeper=paths[0]).start()
        agent.wait_ready(timeout=120)
        for pod in pods:
            assert pod.wait_credentials(timeout=60).ok, pod

        # surge
        log("  kiamfast: surge handover")
        callers = ask(pods, opts)
        time.sleep(opts.settle)
        t0 = time.monotonic()
        new = handover_agent(node, "agent-1", keeper=paths[1]).start()
        wait_for(lambda: serving(new) and idle(agent))
        event = time.monotonic() - t0
        time.sleep(opts.settle)
        res.scenarios.append(judge(node, Scenario("kiamfast", "surge handover",
                                                  event=event), callers))
        agent.stop()
        agent = new

        # container crash, with the keeper
        log("  kiamfast: container crash (SIGKILL of the tree), keeper holding the sockets")
        res.keeper["kiamfast keep-sockets (the pod's keeper)"] = memory(keepers[1].pid)
        agent, scenario = replaced(node, pods, opts, "kiamfast", "container crash, keeper",
                                   stop=agent.kill, start=agent.start,
                                   ready=lambda a: wait_for(lambda: serving(a)))
        res.scenarios.append(scenario)

        # rolling: no keeper, no handover
        log("  kiamfast: rolling restart (SIGTERM, then a new agent; no keeper, no handover)")
        agent.stop()
        for keeper in keepers:    # their pods are gone: they held the port
            keeper.terminate()
            keeper.wait(10)
        keepers = []
        plain = handover_agent(node, "plain-0", handover=False).start()
        plain.wait_ready(timeout=120)
        _, scenario = replaced(
            node, pods, opts, "kiamfast", "rolling restart", stop=plain.stop,
            start=lambda: handover_agent(node, "plain-1", handover=False).start(),
            ready=lambda a: wait_for(lambda: serving(a)))
        res.scenarios.append(scenario)
    finally:
        for keeper in keepers:
            keeper.terminate()
            keeper.wait(10)
        node.close()


def replaced(node, pods, opts: Options, agent: str, name: str, *, stop, start, ready):
    """The pods asking, ``stop()`` the serving agent and ``start()`` the next (returned with
    the scenario): the gap timed from the new start to the first answer after it and to
    ``ready(new)``, and from the stop to ready (the event)."""
    callers = ask(pods, opts)
    time.sleep(opts.settle)
    t0 = time.monotonic()
    stop()
    started = time.monotonic()
    new = start()
    first = first_answer_wait(callers, started)
    ready(new)
    done = time.monotonic()
    time.sleep(opts.settle)
    return new, judge(node, Scenario(agent, name, event=done - t0, start_to_first_answer=first,
                                     start_to_ready=done - started), callers)


def first_answer_wait(callers, t0: float, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = first_answer_after(callers, t0)
        if got == got:   # not nan
            return got
        time.sleep(0.005)
    return float("nan")


# ---- kube2iam ---------------------------------------------------------------------------------

def kube2iam_scenarios(res: Result, opts: Options, tmp: Path, log) -> None:
    from kube2iam_harness import kube2iam_binary
    if kube2iam_binary() is None:
        res.skipped.append("kube2iam: not built (tests/tools/build_kube2iam.sh)")
        return
    from kube2iam_node import Kube2iamAgent
    node, pods = make_node(tmp / "kube2iam", opts)
    try:
        agent = Kube2iamAgent(node)
        agent.wait_ready()
        for pod in pods:
            assert pod.wait_credentials(timeout=60).ok, pod
        for name, stop in (("restart (SIGTERM)", stop_kube2iam_term),
                           ("crash (SIGKILL)", stop_kube2iam_kill)):
            log(f"  kube2iam: {name}")
            agent, scenario = replaced(node, pods, opts, "kube2iam", name,
                                       stop=functools.partial(stop, agent),
                                       start=lambda: Kube2iamAgent(node),
                                       ready=lambda a: a.wait_ready())
            res.scenarios.append(scenario)
    finally:
        node.close()


def stop_kube2iam_term(agent) -> None:
    agent.close()


def stop_kube2iam_kill(agent) -> None:
    os.killpg(agent.proc.pid, 9)
    agent.proc.wait(10)
    agent.ec2.stop()


# ---- what the pieces cost --------------------------------------------------------------------

def memory(pid: int) -> dict[str, int]:
    """Rss, Pss and Private_Dirty (KiB) of one process (smaps_rollup)."""
    m = proc_memory(pid)
    return {k: m[k] // 1024 for k in ("Rss", "Pss", "Private_Dirty") if k in m}


def keeper_memory(res: Result, tmp: Path) -> None:
    """The keeper started both ways, each holding one deposited socket."""
    from kiamfast import fdpass
    from kiamfast.sockets import listen_socket
    forms = {"python -m kiamfast.socket_keeper": [sys.executable, "-m", "kiamfast.socket_keeper"]}
    script = shutil.which("kiamfast", path=os.path.dirname(sys.executable))
    if script:
        forms["kiamfast keep-sockets (console script)"] = [script, "keep-sockets"]
    held = listen_socket("127.0.0.1", 0)
    try:
        for name, argv in forms.items():
            path = str(tmp / f"keeper-{len(res.keeper)}.sock")
            proc = subprocess.Popen([*argv, "--socket", path], stderr=subprocess.DEVNULL)
            try:
                wait_for(lambda: os.path.exists(path), 30)
                with fdpass.connect(path) as conn:
                    fdpass.send(conn, {"op": "put", "note": {}, "sockets": [
                        {"kind": "app", "host": "127.0.0.1", "port": 1}]}, [held.fileno()])
                    fdpass.receive(conn)
                time.sleep(0.2)
                res.keeper[name] = memory(proc.pid)
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        held.close()


def recheck_cost(res: Result, log) -> None:
    """CPU and wall time of one ``iptables -C`` of the DNAT rule, nft and legacy, on a nat
    table as kube-proxy leaves it for 2,000 Services of 3 endpoints (22,000 rules)."""
    from netns import Netns
    rules = ["*nat", ":KUBE-SERVICES - [0:0]"]
    for i in range(2000):
        rules.append(f":KUBE-SVC-{i:05d} - [0:0]")
        rules += [f":KUBE-SEP-{i:05d}{j} - [0:0]" for j in range(3)]
    rules.append("-A PREROUTING -j KUBE-SERVICES")
    for i in range(2000):
        a, b = divmod(i, 250)
        rules.append(f"-A KUBE-SERVICES -d 10.96.{a}.{b}/32 -p tcp -m tcp --dport 80 "
                     f"-j KUBE-SVC-{i:05d}")
        for j in range(3):
            rules.append(f"-A KUBE-SVC-{i:05d} -m statistic --mode random --probability 0.33 "
                         f"-j KUBE-SEP-{i:05d}{j}")
            rules.append(f"-A KUBE-SEP-{i:05d}{j} -p tcp -m tcp -j DNAT "
                         f"--to-destination 10.1.{a}.{b + j}:8080")
    rules += ["-A PREROUTING -d 169.254.169.254/32 -i eth0 -p tcp -m tcp --dport 80 -j DNAT "
              "--to-destination 10.0.0.1:8181", "COMMIT", ""]
    ns = Netns.create("kf-node")
    try:
        for backend in ("nft", "legacy"):
            if not shutil.which(f"iptables-{backend}"):
                continue
            subprocess.run(ns.argv([f"iptables-{backend}-restore"]), input="\n".join(rules),
                           text=True, check=True)
            check = ns.argv([sys.executable, "-c", _RECHECK, backend])
            out = subprocess.run(check, capture_output=True, text=True, timeout=300)
            wall, cpu = map(float, out.stdout.split())
            res.recheck[backend] = {"wall_ms": wall, "cpu_ms": cpu, "rules": len(rules) - 4}
            log(f"  iptables-{backend} -C: {cpu:.1f} ms CPU, {wall:.1f} ms")
    finally:
        ns.delete()


_RECHECK = """
import resource, subprocess, sys, time
argv = [f"iptables-{sys.argv[1]}", "-w", "5", "-t", "nat", "-C", "PREROUTING", "-p", "tcp",
        "-d", "169.254.169.254", "--dport", "80", "-j", "DNAT", "--to-destination",
        "10.0.0.1:8181", "-i", "eth0"]
n = 40
r0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.monotonic()
for _ in range(n):
    assert subprocess.run(argv, capture_output=True).returncode == 0
t1 = time.monotonic(); r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / n
print(1000 * (t1 - t0) / n, 1000 * cpu)
"""


# ---- the run -----------------------------------------------------------------------------------

def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root: the handover benchmark needs network namespaces and iptables"
    import netns
    return netns.unavailable_reason()


def run(opts: Options, log=print) -> Result:
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    from e2e_cluster import sweep_stale_runs
    sweep_stale_runs()
    res = Result(options=opts.__dict__.copy())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="kf-handover-") as tmp:
        log("kiamfast: surge, crash, rolling")
        kiamfast_scenarios(res, opts, Path(tmp), log)
        log("kube2iam: restart and crash")
        kube2iam_scenarios(res, opts, Path(tmp), log)
        keeper_memory(res, Path(tmp))
    log("re-asserting the DNAT rule: iptables -C on 22,000 nat rules")
    recheck_cost(res, log)
    return res


def _ms(seconds: float) -> str:
    return "–" if seconds != seconds else f"{seconds * 1000:,.0f} ms"


def markdown(res: Result) -> str:
    o = res.options
    lines = [f"{o['pods']} pods of {o['roles']} roles, each asking every "
             f"{o['interval'] * 1000:.0f} ms with a {o['timeout']:g} s timeout (half on fresh "
             "connections, half keep-alive) through the node's DNAT rule, "
             f"{o['settle']:g} s before and after each event.", "",
             "| agent | event | calls | unanswered | wrong role | node's role | longest a pod "
             "went unanswered | new process: first answer / ready | outcomes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in res.scenarios:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items()) if k != "ok")
        lines.append(f"| {s.agent} | {s.name} | {s.calls:,} | {s.unanswered} | {s.wrong} | "
                     f"{s.node_role} | {_ms(s.longest_gap)} | {_ms(s.start_to_first_answer)}"
                     f" / {_ms(s.start_to_ready)} | {outcomes or '–'} |")
    if res.keeper:
        lines += ["", "The socket keeper's memory, holding one socket:", "",
                  "| started as | RSS | PSS | private dirty |", "|---|---|---|---|"]
        for name, m in res.keeper.items():
            lines.append(f"| {name} | {m.get('Rss', 0) / 1024:.1f} MiB | "
                         f"{m.get('Pss', 0) / 1024:.1f} MiB | "
                         f"{m.get('Private_Dirty', 0) / 1024:.1f} MiB |")
    if res.recheck:
        lines += ["", "Re-asserting the DNAT rule (`--iptables-check-interval`): one "
                  "`iptables -C` on a nat table of "
                  f"{next(iter(res.recheck.values()))['rules']:,} rules:", ""]
        lines += [f"* {backend}: {r['cpu_ms']:.1f} ms CPU, {r['wall_ms']:.1f} ms"
                  for backend, r in res.recheck.items()]
    lines += [f"* skipped: {s}" for s in res.skipped]
    return "\n".join(lines) + "\n"


def headline(res: Result) -> list[tuple[str, str, str, str]]:
    rows = []
    by = {(s.agent, s.name): s for s in res.scenarios}
    for name in ("surge handover", "container crash, keeper"):
        s = by.get(("kiamfast", name))
        if s:
            rows.append((f"handover, kiamfast {name}: unanswered, wrong role",
                         f"{s.unanswered}, {s.wrong + s.node_role}", "0, 0",
                         "ok" if s.unanswered == 0 and s.wrong + s.node_role == 0 else "MISSED"))
    s = by.get(("kiamfast", "rolling restart"))
    if s:
        rows.append(("handover, kiamfast rolling restart: process start to first answer",
                     _ms(s.start_to_first_answer), "< 300 ms",
                     "ok" if s.start_to_first_answer < 0.3 else "MISSED"))
    node_role = sum(s.node_role + s.wrong for s in res.scenarios if s.agent == "kiamfast")
    rows.append(("handover, kiamfast: answers with another role or the node's", str(node_role),
                 "0", "ok" if node_role == 0 else "MISSED"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run(QUICK if args.quick else Options())
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
