"""What the runtime polling costs a node with ``sandboxes`` pods (110: the kubelet's default
maximum), with nobody asking for credentials.

Two agents watch the same node at once, one with ``--cri-endpoint`` (it lists the READY
sandboxes every second and asks a sandbox's status only once per sandbox id) and one with
``--cri-endpoint=none``. Over the same window both control processes' CPU time is read
from the kernel (benchutil.cpu_seconds) and their RSS at the end; the polls the runtime
agent made in the window come from its own /metrics (``kiamfast_runtime_total{kind="polls"}``,
published every 2 s, so the count is good to a poll or two). With a real containerd, its CPU
is read too, over the window with the runtime agent polling and over a window of the same
length after that agent stopped: the difference is what the polls cost the runtime.

The runtime is a real containerd when root and containerd are there, else the CRI fault
double (served from this process, so its own cost is not measured); see
bench/cri_node.py.

    python bench/runtime_polling.py [--quick] [--sandboxes N] [--seconds S]
        [--runtime auto|containerd|fault]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass

import bench_agent as ba
import cri_node
from benchutil import cpu_seconds, rss_bytes

POLLS = re.compile(rb'^kiamfast_runtime_total\{kind="polls"\} (\d+)', re.M)


def polls(agent: ba.Agent) -> int:
    status, body = agent.get("/metrics", timeout=5)
    m = POLLS.search(body) if status == 200 else None
    return int(m.group(1)) if m else -1


@dataclass
class PollingResult:
    runtime: str
    sandboxes: int
    seconds: float
    cpu_with: float          # control process CPU seconds per second, --cri-endpoint
    cpu_without: float       # the same, --cri-endpoint=none
    polls: int               # runtime polls in the window
    rss_control_with: int
    rss_control_without: int
    rss_worker_with: int
    rss_worker_without: int
    runtime_cpu_polled: float | None = None   # containerd CPU s/s while polled
    runtime_cpu_idle: float | None = None     # containerd CPU s/s without the polling agent


def _control(agent: ba.Agent) -> int:
    return agent.processes()["control"][0]


def _worker(agent: ba.Agent) -> int:
    return agent.processes()["worker"][0]


def run(*, runtime: str = "auto", sandboxes: int = 110, roles: int = 10,
        seconds: float = 30.0, settle: float = 5.0, log=print) -> PollingResult:
    role_names = [ba.role_name(r).encode() for r in range(roles)]
    node = cri_node.make_node(runtime, sandboxes)
    runtime_pid = node.ctd.process.pid if isinstance(node, cri_node.ContainerdNode) else None
    pods: list[cri_node.Pod] = []
    try:
        with ba.cluster() as c:
            try:
                log(f"  {sandboxes} sandboxes ({node.kind})")
                pods = cri_node.populate(c, node, role_names=role_names, slots=sandboxes)
                flags = node.agent_flags
                with ba.agent(c, sts_qps=100, sts_burst=100,
                              extra=["--cri-endpoint=none", *flags]) as without:
                    with ba.agent(c, sts_qps=100, sts_burst=100,
                                  extra=[f"--cri-endpoint={node.endpoint}", *flags]) as with_rt:
                        with_rt.wait_ready(120)
                        without.wait_ready(120)
                        time.sleep(settle)   # past start-up: first polls, prefetch, publishing
                        pids = (_control(with_rt), _control(without))
                        log(f"  idle window of {seconds:g} s")
                        p0 = polls(with_rt)
                        cpu0 = [cpu_seconds(p) for p in pids]
                        rt0 = cpu_seconds(runtime_pid) if runtime_pid else 0.0
                        t0 = time.monotonic()
                        time.sleep(seconds)
                        cpu1 = [cpu_seconds(p) for p in pids]
                        rt1 = cpu_seconds(runtime_pid) if runtime_pid else 0.0
                        window = time.monotonic() - t0
                        time.sleep(2.1)   # the metrics text is published every 2 s
                        n_polls = polls(with_rt) - p0
                        rss = [rss_bytes(p) for p in pids]
                        rss_w = [rss_bytes(_worker(a)) for a in (with_rt, without)]
                    runtime_idle = None
                    if runtime_pid:
                        log(f"  containerd without the polling agent, {seconds:g} s")
                        r0, t1 = cpu_seconds(runtime_pid), time.monotonic()
                        time.sleep(seconds)
                        runtime_idle = (cpu_seconds(runtime_pid) - r0) / (time.monotonic() - t1)
            finally:
                cri_node.remove_pods(node, pods)
    finally:
        node.close()
    return PollingResult(
        runtime=node.kind, sandboxes=sandboxes, seconds=window,
        cpu_with=(cpu1[0] - cpu0[0]) / window, cpu_without=(cpu1[1] - cpu0[1]) / window,
        polls=n_polls, rss_control_with=rss[0], rss_control_without=rss[1],
        rss_worker_with=rss_w[0], rss_worker_without=rss_w[1],
        runtime_cpu_polled=(rt1 - rt0) / window if runtime_pid else None,
        runtime_cpu_idle=runtime_idle)


def markdown(r: PollingResult) -> str:
    mib = 2 ** 20
    added = r.cpu_with - r.cpu_without
    lines = [
        f"Runtime: **{r.runtime}**; {r.sandboxes} sandboxes and pods, no requests; window "
        f"{r.seconds:.0f} s, {r.polls} runtime polls in it.", "",
        "| control process | CPU (ms per s) | RSS (MiB) | worker RSS (MiB) |",
        "|---|---:|---:|---:|",
        f"| --cri-endpoint | {r.cpu_with * 1e3:.2f} | {r.rss_control_with / mib:.1f} | "
        f"{r.rss_worker_with / mib:.1f} |",
        f"| --cri-endpoint=none | {r.cpu_without * 1e3:.2f} | {r.rss_control_without / mib:.1f}"
        f" | {r.rss_worker_without / mib:.1f} |",
        f"| added by the polling | **{added * 1e3:.2f}** "
        f"({added * 1e3 / max(r.polls / r.seconds, 1e-9):.2f} ms per poll) | "
        f"**{(r.rss_control_with - r.rss_control_without) / mib:+.1f}** | |"]
    if r.runtime_cpu_polled is not None:
        lines += ["", f"containerd's own CPU: {r.runtime_cpu_polled * 1e3:.2f} ms per s while "
                  f"polled, {r.runtime_cpu_idle * 1e3:.2f} ms per s without the polling agent."]
    return "\n".join(lines)


def headline(r: PollingResult) -> list[tuple[str, str, str, str]]:
    """(what, value, target, verdict) rows for bench/report.py's summary table."""
    mib = 2 ** 20
    return [(f"runtime polling, {r.sandboxes} sandboxes, idle: control-process CPU and RSS "
             "added", f"{(r.cpu_with - r.cpu_without) * 1e3:.2f} ms/s, "
             f"{(r.rss_control_with - r.rss_control_without) / mib:+.1f} MiB", "small", "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sandboxes", type=int, default=110)
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--runtime", choices=("auto", "containerd", "fault"), default="auto")
    args = ap.parse_args(argv)
    r = run(runtime=args.runtime, sandboxes=args.sandboxes,
            seconds=args.seconds or (5.0 if args.quick else 30.0))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
