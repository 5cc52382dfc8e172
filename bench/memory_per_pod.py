"""Memory kept per replaced pod: what the agent still holds of the pods it has seen go.

Two measurements:

* **agent** (the default): the whole agent (``python -m kiamfast``: supervisor, control
  process, workers) on a loopback node (kiamfast.testing.loopback: the API server emulator,
  moto's STS behind the fault proxy, the fake metadata service) while pods are replaced
  ``--rate`` times a second through the API on ``--churned`` reused addresses, as a real node
  replaces them (the new pod created Pending, the old one terminating, Succeeded, deleted,
  then the new one Running with the address), and ``--steady`` pods ask for their role every
  100 ms.  Every ``--every`` seconds the PSS of each process (``/proc/PID/smaps_rollup``; the
  table's shared pages split between them) is sampled, and its anonymous memory (its heap).
  Reported: the samples (the issue's table), the answers (ok, failed, wrong: another role's
  listing), and the control process's growth per replaced pod, fitted over the samples
  after the first ``--warmup`` seconds to its anonymous memory: PSS also counts a share of
  the pages it maps from files other processes of the machine map too (libpython, the
  extensions), so it moves in all three processes at once when unrelated processes come and
  go, and the private file pages the kernel may drop and read again.
  ``--runtime fault`` adds the container runtime (the CRI fault double: each replacement also
  swaps the address's sandbox).
* **control** (``--control N``): the whole control process (``ControlProcess``: the API
  watches through kiamfast's own client, the runtime poller and its CRI client against the
  CRI fault double, the credential manager, the publish loop, health) in this process, with
  the emulator and the runtime double beside it, pods replaced through them as in
  **agent**; tracemalloc on for N replacements: the bytes its code still holds after them.
* **inprocess** (``--inprocess N``): N replacements through the control process's own rooms
  in this process (kiamfast/testing/pod_churn.py, as tests/memory), with tracemalloc on for
  all of them: the bytes the control process's code still holds after every tenth of them
  (and after a quiet spell, the grace periods over), against those it held before.  The
  goal: under 1 MiB kept over 1,000,000 replaced pods.

    python bench/memory_per_pod.py [--minutes 10] [--rate 20] [--steady 30] [--churned 20]
        [--runtime none|fault] [--every 20] [--warmup 60] [--json PATH]
    python bench/memory_per_pod.py --control 8000 [--json PATH]
    python bench/memory_per_pod.py --inprocess 1000000 [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import threading
import time
import tracemalloc
from dataclasses import asdict, dataclass, field

import numpy as np

from benchutil import aws_env, machine_facts, proc_memory

from kiamfast.testing.loopback import ROLE_KEY, LoopbackNode  # noqa: E402
from kiamfast.testing.net import http_request, one_request, split_response  # noqa: E402

NAMESPACE = "churn"
CREDS = "/latest/meta-data/iam/security-credentials/"
MIB = 1 << 20


# ---- the whole agent ------------------------------------------------------------------------

@dataclass
class Sample:
    seconds: float
    replaced: int
    pss: dict[str, int]              # "control", "workers", "supervisor": bytes
    anon: dict[str, int] = field(default_factory=dict)   # their anonymous memory, bytes


@dataclass
class AgentResult:
    rate: float
    steady: int
    churned: int
    runtime: str
    samples: list[Sample] = field(default_factory=list)
    answers: dict[str, int] = field(default_factory=dict)
    control_bytes_per_pod: float = 0.0
    control_fit_stderr: float = 0.0


def memory(pid: int) -> tuple[int, int]:
    """(PSS, anonymous memory) of one process, bytes; 0s if it is gone."""
    m = proc_memory(pid)
    return m.get("Pss", 0), m.get("Anonymous", 0)


def sample_memory(agent) -> tuple[dict[str, int], dict[str, int]]:
    """PSS and anonymous memory of the agent's processes by role."""
    procs = agent.processes()
    pss, anon = {}, {}
    for role, key in (("control", "control"), ("workers", "worker"),
                      ("supervisor", "supervisor")):
        got = [memory(p) for p in procs[key]]
        pss[role], anon[role] = sum(m[0] for m in got), sum(m[1] for m in got)
    return pss, anon


class Askers:
    """The steady pods: each asks for its role's listing every ``interval`` seconds on a
    fresh connection from its address (a thread each); counts ok, failed and wrong
    (another role named)."""

    def __init__(self, port: int, pods: dict[str, str], interval: float = 0.1) -> None:
        self.port, self.pods, self.interval = port, pods, interval
        self.counts = {"ok": 0, "failed": 0, "wrong": 0}
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(ip, role), daemon=True,
                                          name=f"asker-{ip}") for ip, role in pods.items()]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _ask(self, ip: str, role: str) -> None:
        request = http_request("GET", CREDS)
        while not self._halt.is_set():
            started = time.monotonic()
            try:
                status, _, body = split_response(one_request(self.port, request, source=ip,
                                                             timeout=1.0))
                kind = ("ok" if status == 200 and body.decode() == role else
                        "wrong" if status == 200 else "failed")
            except OSError:
                kind = "failed"
            with self._lock:
                self.counts[kind] += 1
            self._halt.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self) -> dict[str, int]:
        self._halt.set()
        for t in self._threads:
            t.join(10)
        return dict(self.counts)


class Churn(threading.Thread):
    """Replaces pods through the API (and the runtime double, if any) at ``rate`` a second,
    round robin over ``addresses``."""

    def __init__(self, node: LoopbackNode, addresses: list[str], rate: float,
                 roles: int = 10, prefix: str = "job") -> None:
        super().__init__(name="churn", daemon=True)
        self.node, self.addresses, self.rate, self.roles = node, addresses, rate, roles
        self.prefix = prefix
        self.replaced = 0
        self.live: dict[str, tuple[str, object]] = {}   # ip -> (name, sandbox or None)
        self._seq = 0
        self._halt = threading.Event()

    def add(self, ip: str) -> None:
        from kiamfast.testing.cri_fault import fake_sandbox
        self._seq += 1
        name, role = f"{self.prefix}-{self._seq}", f"role-{self._seq % self.roles}"
        pods = self.node.api.pods
        pods.create(NAMESPACE, name, node=self.node.node, annotations={ROLE_KEY: role},
                    ips=None, phase="Pending")
        sandbox = None
        if self.node.runtime is not None:
            uid = pods.get(NAMESPACE, name)["metadata"]["uid"]
            sandbox = fake_sandbox(name=name, namespace=NAMESPACE, uid=uid, ip=ip,
                                   annotations={ROLE_KEY: role})
        old = self.live.get(ip)
        if old is not None:
            pods.mark_terminating(NAMESPACE, old[0])
            if old[1] is not None:
                self.node.runtime.remove(old[1].id)
            if sandbox is not None:
                self.node.runtime.put(sandbox)
            pods.set_phase(NAMESPACE, old[0], "Succeeded")
            pods.delete(NAMESPACE, old[0])
        elif sandbox is not None:
            self.node.runtime.put(sandbox)
        pods.set_ips(NAMESPACE, name, [ip])
        pods.set_phase(NAMESPACE, name, "Running")
        self.live[ip] = (name, sandbox)

    def run(self) -> None:
        start = time.monotonic()
        while not self._halt.is_set():
            self.add(self.addresses[self.replaced % len(self.addresses)])
            self.replaced += 1
            self._halt.wait(max(0.0, start + self.replaced / self.rate - time.monotonic()))

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def run_agent(*, minutes: float, rate: float, steady: int, churned: int, runtime: str,
              every: float, warmup: float, log=print) -> AgentResult:
    result = AgentResult(rate=rate, steady=steady, churned=churned, runtime=runtime)
    with aws_env(), LoopbackNode(node="memory-node", host_ip="127.0.0.2",
                                 runtime_name="cri-fault" if runtime == "fault" else None
                                 ) as node:
        roles = {f"127.0.1.{i + 1}": f"role-{i % 10}" for i in range(steady)}
        churn = Churn(node, [f"127.0.2.{i + 1}" for i in range(churned)], rate)
        for ip, role in roles.items():
            node.add_pod(ip, role, namespace="steady")
        if node.runtime is not None:
            from kiamfast.testing.cri_fault import fake_sandbox
            for ip, role in roles.items():
                name = node.pods[ip][0]
                uid = node.api.pods.get("steady", name)["metadata"]["uid"]
                node.runtime.put(fake_sandbox(name=name, namespace="steady", uid=uid, ip=ip,
                                              annotations={ROLE_KEY: role}))
        for ip in churn.addresses:
            churn.add(ip)
        with node.agent(extra=["--sts-region=us-east-1", "--listen-host=127.0.0.1",
                               "--log-level=warn", "--workers=1"]) as agent:
            agent.wait_ready(60)
            askers = Askers(agent.port, roles)
            askers.start()
            churn.start()
            started = time.monotonic()
            try:
                while True:
                    elapsed = time.monotonic() - started
                    s = Sample(round(elapsed, 1), churn.replaced, *sample_memory(agent))
                    result.samples.append(s)
                    log(f"{s.seconds:7.0f}s {s.replaced:8d} replaced  control "
                        f"{s.pss['control'] / MIB:6.1f} MiB  workers "
                        f"{s.pss['workers'] / MIB:5.1f} MiB  supervisor "
                        f"{s.pss['supervisor'] / MIB:5.1f} MiB  (control heap "
                        f"{s.anon['control'] / MIB:6.2f} MiB)")
                    if elapsed >= minutes * 60:
                        break
                    time.sleep(min(every, max(0.0, minutes * 60 - elapsed)))
                    agent.check()
            finally:
                churn.stop()
                result.answers = askers.stop()
    fit = [s for s in result.samples if s.seconds >= warmup]
    if len(fit) >= 3:
        x = np.array([s.replaced for s in fit], dtype=float)
        y = np.array([s.anon["control"] for s in fit], dtype=float)
        (slope, _), cov = np.polyfit(x, y, 1, cov=True)
        result.control_bytes_per_pod = float(slope)
        result.control_fit_stderr = float(np.sqrt(cov[0][0]))
    return result


# ---- in-process ---------------------------------------------------------------------------

@dataclass
class Checkpoint:
    replaced: int
    seconds: float
    kept_bytes: int                  # held by the control process's code, vs before
    top: list[str]


OWN_CODE = [tracemalloc.Filter(True, "*/kiamfast/*"),
            tracemalloc.Filter(False, "*/kiamfast/testing/*")]


def kept_since(before: tracemalloc.Snapshot, replaced: int, started: float) -> Checkpoint:
    """What the control process's code holds now beyond ``before`` (tracemalloc on), after
    ``replaced`` pods since ``started``; the largest sites kept for the report."""
    stats = tracemalloc.take_snapshot().filter_traces(OWN_CODE).compare_to(before, "lineno")
    return Checkpoint(replaced, round(time.monotonic() - started, 1),
                      sum(s.size_diff for s in stats),
                      [str(s) for s in stats[:3] if s.size_diff > 0])


def run_inprocess(count: int, *, checkpoints: int = 10, warmup: int = 2_000,
                  log=print) -> list[Checkpoint]:
    from kiamfast.testing.pod_churn import churn_node
    churned = ["10.0.1.2", "10.0.1.3"]
    out: list[Checkpoint] = []

    async def scenario() -> None:
        async with churn_node(roles=5, rate=20.0) as node:
            node.start(["10.0.1.1", *churned])
            await node.run(warmup, churned=churned)
            await node.settle(300)
            gc.collect()
            tracemalloc.start(1)
            try:
                before = tracemalloc.take_snapshot().filter_traces(OWN_CODE)
                started = time.monotonic()
                step = count // checkpoints
                for _ in range(checkpoints):
                    await node.run(step, churned=churned)
                    await node.settle(300)
                    gc.collect()
                    c = kept_since(before, node.replaced - warmup, started)
                    out.append(c)
                    log(f"{c.replaced:9d} replaced  {c.kept_bytes:9d} bytes kept "
                        f"({c.kept_bytes / max(1, c.replaced):.3f} per pod)  {c.seconds:.0f}s")
            finally:
                tracemalloc.stop()

    asyncio.run(scenario())
    return out


def run_control(count: int, *, warmup: int = 500, steady: int = 10, churned: int = 10,
                log=print) -> Checkpoint:
    import socket
    import tempfile
    from kiamfast import table as tbl
    from kiamfast.config import Config
    from kiamfast.control.iam.sts import StsClient
    from kiamfast.control.process import ControlProcess
    from kiamfast.kube.config import load_config
    from kiamfast.supervisor.statefiles import table_layout
    out: list[Checkpoint] = []
    with aws_env(), LoopbackNode(node="memory-node", runtime_name="cri-fault") as node:
        path = tempfile.mktemp(prefix="kiamfast-memory-", dir="/dev/shm")
        config = Config(node=node.node, host_ip="127.0.0.2", base_role_arn=node.base_role_arn,
                        sts_endpoint=node.sts.url, sts_region="us-east-1",
                        metadata_addr=node.imds_addr, kubeconfig=str(node.kubeconfig),
                        cri_endpoint=node.runtime.endpoint, iptables=False, table_path=path,
                        node_startup_taint="", debug=True)
        table = tbl.Table.create(path, **table_layout(config))
        ours, workers = socket.socketpair()
        ours.setblocking(False)
        control = ControlProcess(config, table, [ours],
                                 sts=StsClient.from_config(config, start=False),
                                 api_config=load_config(kubeconfig=config.kubeconfig))
        churn = Churn(node, [f"127.0.2.{i + 1}" for i in range(churned)], rate=0.0)
        steady_pods = Churn(node, [f"127.0.1.{i + 1}" for i in range(steady)], rate=0.0,
                            prefix="steady")

        def replace(n: int) -> None:
            for i in range(n):
                churn.add(churn.addresses[churn.replaced % len(churn.addresses)])
                churn.replaced += 1
                if i % 20 == 19:
                    time.sleep(0.01)      # the control process keeps up (one GIL)

        async def drive() -> None:
            loop = asyncio.get_running_loop()
            try:
                while not control.ready:
                    await asyncio.sleep(0.05)
                for ip in steady_pods.addresses:
                    steady_pods.add(ip)
                await loop.run_in_executor(None, replace, warmup)
                await asyncio.sleep(3)
                gc.collect()
                tracemalloc.start(1)
                try:
                    before = tracemalloc.take_snapshot().filter_traces(OWN_CODE)
                    started = time.monotonic()
                    await loop.run_in_executor(None, replace, count)
                    await asyncio.sleep(5)
                    gc.collect()
                    c = kept_since(before, count, started)
                finally:
                    tracemalloc.stop()
                out.append(c)
                log(f"{c.replaced:9d} replaced  {c.kept_bytes:9d} bytes kept by the control "
                    f"process ({c.kept_bytes / max(1, c.replaced):.3f} per pod)")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)     # as the supervisor stops it

        async def both() -> None:
            driver = asyncio.create_task(drive())
            try:
                await control.run()
            finally:
                await driver

        try:
            asyncio.run(both())
        finally:
            workers.close()
            table.close()
            os.unlink(path)
    return out[0]


# ---- the report ---------------------------------------------------------------------------

def agent_table(r: AgentResult) -> str:
    rows = ["| seconds | pods replaced | control process PSS | workers | supervisor | "
            "control process, anonymous |", "|---|---|---|---|---|---|"]
    rows += [f"| {s.seconds:.0f} | {s.replaced:,} | {s.pss['control'] / MIB:.1f} MiB | "
             f"{s.pss['workers'] / MIB:.1f} MiB | {s.pss['supervisor'] / MIB:.1f} MiB | "
             f"{s.anon['control'] / MIB:.2f} MiB |" for s in r.samples]
    return "\n".join(rows)


def agent_summary(r: AgentResult, warmup: float) -> str:
    return (f"answers: {r.answers['ok']:,} ok, {r.answers['failed']:,} failed, "
            f"{r.answers['wrong']:,} wrong; control process (anonymous memory): "
            f"{r.control_bytes_per_pod:+.1f} ± {r.control_fit_stderr:.1f} bytes per replaced "
            f"pod after {warmup:.0f} s ({r.control_bytes_per_pod * 1e6 / MIB:+.2f} MiB per "
            f"1,000,000)")


def inprocess_table(points: list[Checkpoint]) -> str:
    rows = ["| pods replaced | kept by the control process's code | per pod | seconds |",
            "|---|---|---|---|"]
    rows += [f"| {c.replaced:,} | {c.kept_bytes:,} bytes | "
             f"{c.kept_bytes / max(1, c.replaced):.3f} | {c.seconds:.0f} |" for c in points]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inprocess", type=int, default=0, metavar="N")
    p.add_argument("--control", type=int, default=0, metavar="N")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--steady", type=int, default=30)
    p.add_argument("--churned", type=int, default=20)
    p.add_argument("--runtime", choices=("none", "fault"), default="none")
    p.add_argument("--every", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=60.0)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    facts = machine_facts()
    if a.control:
        c = run_control(a.control)
        print(f"\nkept by the control process over {c.replaced:,} replaced pods: "
              f"{c.kept_bytes:,} bytes; largest: {c.top}")
        report = {"machine": facts, "control": asdict(c)}
    elif a.inprocess:
        points = run_inprocess(a.inprocess)
        print("\n" + inprocess_table(points))
        report = {"machine": facts, "inprocess": [asdict(c) for c in points]}
    else:
        r = run_agent(minutes=a.minutes, rate=a.rate, steady=a.steady, churned=a.churned,
                      runtime=a.runtime, every=a.every, warmup=a.warmup)
        print("\n" + agent_table(r) + "\n\n" + agent_summary(r, a.warmup))
        report = {"machine": facts, "agent": asdict(r)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
