"""Node start: kiamfast beside the real kube2iam in one run, on a fresh node whose pods are
already asking (issue 32's measure).

A scenario is N pods over R roles on the node of bench_agent's cluster: the Kubernetes API
emulator, moto's STS behind the fault proxy (no added latency: a local STS), nginx as the
metadata service.  The two agents take turns on the same fakes (neither always first), each
run a fresh process (kiamfast: a fresh table, the node tainted with its startup taint;
kube2iam: the real binary, tests/tools/build_kube2iam.sh), so every comparison is between
runs seconds apart on the same machine.  Per run:

* **The pods ask before the agent starts.**  A client process (this file with
  ``--pods-client``) makes every pod a loopback source address (127.0.x.y, as bench_agent
  does) asking as botocore does: PUT a token, GET the listing, GET the document of the
  listed role, each with botocore's 1 s timeout, on one connection; and again 100 ms after
  the attempt began, until the pod has its own role's credentials.  Once every pod asks,
  the agent is started.  Per pod: seconds from the agent's process start to its first
  document of its own role (the role STS issued the access key for, from the proxy's
  record), and every document of another role (must be 0 for kiamfast; kube2iam's are
  recorded).  STS calls are counted.
* **Memory** of every process of the agent: RSS and PSS (``/proc/PID/smaps_rollup``),
  sampled every 50 ms until every pod is served (peak) and once more a second after the
  agent is settled (steady); the kernel's own RSS peak (VmHWM); the table file's tmpfs
  pages apart (``st_blocks``): they are charged to the pod's memory limit as shmem, mapped
  or not.  PSS includes each process's share of the mapped table (``Pss_Shmem``, shown).
* **Milestones** from kiamfast's own log lines (``start: <what> after <s>s``,
  kiamfast/milestones.py), seconds from the supervisor's process start: table created or
  adopted, worker listening, pods listed, first STS answer, all roles fetched, ready, taint
  removed.  For both agents the client sees the first answer of any kind.
* **The restart** (a container restart): with the pods asking again, every process of the
  agent is killed (SIGKILL) and the agent started again with the same table and token key;
  per pod, seconds from the new process start to its first answer with its own role.
  kube2iam keeps nothing across a restart, so its restart is a start (measured the same
  way).

Once per run of the benchmark, each process's imports in a bare interpreter (median of a
few): seconds and peak RSS, beside the bare interpreter.

``python bench/node_start.py [--quick] [--runs N] [--scenario 60x20 ...]`` prints the
report; ``bench/run --only node-start`` puts it in the benchmark report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchutil import (ROOT, child_env, children, cmdline, median, pod_addresses, proc_memory,
                       python, stop)

AGENTS = ("kiamfast", "kube2iam")
CREDS = "/latest/meta-data/iam/security-credentials/"
PERIOD = 0.1                 # a pod asks again 100 ms after its previous attempt began
CLIENT_TIMEOUT = 1.0         # botocore's IMDS timeout (DEFAULT_METADATA_SERVICE_TIMEOUT)
STARTUP_TAINT = "kiamfast.io/agent-not-ready"
MILESTONES = ("table created", "table adopted", "worker listening", "runtime answered",
              "pods listed", "STS client built", "first STS answer", "all roles fetched",
              "ready", "taint removed")
_MARK = re.compile(r'start: ([^"\n]+?) after ([0-9.]+)s')

for _p in (ROOT / "tests", ROOT / "tests" / "kube2iam"):
    if str(_p) not in sys.path:
        sys.path.append(str(_p))


@dataclass
class Options:
    scenarios: tuple[tuple[int, int], ...] = ((60, 20), (250, 100))   # (pods, roles)
    runs: int = 5                  # starts per agent and scenario, alternating
    restart: bool = True
    imports: int = 5               # bare-interpreter import measurements per process
    kiamfast_flags: tuple[str, ...] = ()
    timeout: float = 60.0          # a run in which some pod is not served by then: NaN
    # kiamfast's addresses: "fault", a container runtime (the CRI double) holding a READY
    # sandbox per pod, as on a real node; "none", the API alone (--cri-endpoint=none)
    runtime: str = "fault"
    sts_latency: float = 0.0       # added to every STS call (a regional STS: ~0.02-0.05 s)


QUICK = Options(scenarios=((12, 4),), runs=1, imports=1, timeout=45.0)


@dataclass
class Run:
    agent: str
    case: str                      # "start" or "restart"
    pods: int
    roles: int
    index: int                     # the alternation round
    served_s: list[float]          # per pod: first document of its own role (NaN: never)
    wrong: int                     # documents of another role
    wrong_roles: list[str]
    first_answer_s: float          # the first HTTP answer any pod got
    sts_calls: int
    attempts: int
    milestones: dict[str, float] = field(default_factory=dict)
    memory: dict = field(default_factory=dict)

    @property
    def served(self) -> int:
        return sum(1 for t in self.served_s if t == t)

    @property
    def every_s(self) -> float:
        return max(self.served_s) if self.served == self.pods else float("nan")

    @property
    def median_s(self) -> float:
        return statistics.median(self.served_s) if self.served == self.pods else float("nan")

    @property
    def first_s(self) -> float:
        return min((t for t in self.served_s if t == t), default=float("nan"))


@dataclass
class Result:
    options: dict
    runs: list[Run] = field(default_factory=list)
    imports: dict = field(default_factory=dict)     # process -> {"s": ..., "rss_mib": ...}
    load: list = field(default_factory=list)


# ---- the pods: a client process ------------------------------------------------------------

async def _exchange(loop, sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    await loop.sock_sendall(sock, request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            raise ConnectionError("closed before the head")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in
              (line.partition(b":") for line in lines[1:])}
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                raise ConnectionError("closed in a chunked body")
            body += chunk
        out, rest = b"", body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if not size:
                return status, out
            out, rest = out + rest[:size], rest[size + 2:]
    length = int(fields.get(b"content-length", b"0"))
    while len(body) < length:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            raise ConnectionError("closed in the body")
        body += chunk
    return status, body[:length]


def _get(path: str, token: str | None) -> bytes:
    extra = f"X-aws-ec2-metadata-token: {token}\r\n" if token else ""
    return (f"GET {path} HTTP/1.1\r\nHost: 169.254.169.254\r\nAccept-Encoding: identity\r\n"
            f"{extra}\r\n").encode()


_PUT = (b"PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\n"
        b"X-aws-ec2-metadata-token-ttl-seconds: 21600\r\nContent-Length: 0\r\n\r\n")


async def _attempt(loop, port: int, ip: str, pod: dict) -> str | None:
    """One fetch as botocore's (token, listing, document): the role served, if any."""
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.bind((ip, 0))
        await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), CLIENT_TIMEOUT)
        status, body = await asyncio.wait_for(_exchange(loop, sock, _PUT), CLIENT_TIMEOUT)
        pod["first_answer"] = pod["first_answer"] or time.monotonic()
        token = body.decode() if status == 200 else None   # 403/404/405: IMDSv1, as botocore
        status, body = await asyncio.wait_for(_exchange(loop, sock, _get(CREDS, token)),
                                              CLIENT_TIMEOUT)
        if status != 200 or not body:
            return None
        name = body.decode().split("\n")[0].strip()
        status, body = await asyncio.wait_for(
            _exchange(loop, sock, _get(CREDS + name, token)), CLIENT_TIMEOUT)
        if status != 200:
            return None
        try:
            key = json.loads(body).get("AccessKeyId", "")
        except ValueError:
            return None
        if key:
            pod["answers"].append((time.monotonic(), name, key))
            return name
        return None
    except (OSError, asyncio.TimeoutError, ValueError, IndexError) as e:
        kind = type(e).__name__
        pod["errors"][kind] = pod["errors"].get(kind, 0) + 1
        return None
    finally:
        sock.close()


async def _pod(loop, port: int, ip: str, role: str, pod: dict, deadline: float) -> None:
    while time.monotonic() < deadline:
        began = time.monotonic()
        pod["attempts"] += 1
        if await _attempt(loop, port, ip, pod) == role:
            pod["served"] = time.monotonic()
            return
        await asyncio.sleep(max(0.0, began + PERIOD - time.monotonic()))


async def _pods_main(spec: dict) -> dict:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + spec["timeout"]
    pods = {ip: {"attempts": 0, "answers": [], "errors": {}, "served": None,
                 "first_answer": None} for ip, _ in spec["pods"]}
    tasks = [asyncio.create_task(_pod(loop, spec["port"], ip, role, pods[ip], deadline))
             for ip, role in spec["pods"]]
    await asyncio.sleep(2 * PERIOD)      # every pod has made its first attempt
    print("asking", flush=True)
    await asyncio.gather(*tasks)
    return pods


def pods_client_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        import uvloop
        result = uvloop.run(_pods_main(spec))
    except ImportError:
        result = asyncio.run(_pods_main(spec))
    print(json.dumps(result), flush=True)
    return 0


class Pods:
    """The client process: every pod asking the agent on ``port`` until served."""

    def __init__(self, port: int, pods: dict[str, str], timeout: float) -> None:
        spec = json.dumps({"port": port, "pods": sorted(pods.items()), "timeout": timeout})
        self.proc = subprocess.Popen([python(), __file__, "--pods-client", spec],
                                     env=child_env(), stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "asking":
            self.proc.kill()
            raise RuntimeError(f"the pods' client did not start: {line!r}")

    def result(self, timeout: float) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---- memory --------------------------------------------------------------------------------

def smaps(pid: int) -> dict[str, int]:
    """RSS, PSS and its shmem part, the RSS peak (bytes) of one process; {} if it is gone."""
    m = proc_memory(pid)
    if not m:
        return {}
    return {"rss": m.get("Rss", 0), "pss": m.get("Pss", 0), "pss_shmem": m.get("Pss_Shmem", 0),
            "hwm": m.get("VmHWM", 0)}


def tmpfs_bytes(path: str) -> int:
    """What a file on tmpfs holds in memory (its allocated blocks)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


class Sampler:
    """Every 50 ms: each process's RSS and PSS, keeping the peak of each and of the sum."""

    def __init__(self, processes, table_path: str | None = None) -> None:
        self.processes = processes        # () -> {name: pid}
        self.table_path = table_path
        self.peak: dict[str, dict[str, int]] = {}
        self.peak_total = {"rss": 0, "pss": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.sample()

    def sample(self) -> dict[str, dict[str, int]]:
        now = {name: m for name, pid in self.processes().items() if (m := smaps(pid))}
        for name, m in now.items():
            p = self.peak.setdefault(name, {})
            for k, v in m.items():
                p[k] = max(p.get(k, 0), v)
        for k in ("rss", "pss"):
            self.peak_total[k] = max(self.peak_total[k], sum(m.get(k, 0) for m in now.values()))
        return now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ---- the agents ----------------------------------------------------------------------------

def agent_port() -> int:
    """A free port below the ephemeral range: the pods' client binds thousands of sockets
    to ephemeral ports of their addresses, and kube2iam listens on every address (a port
    they hold would make its bind fail)."""
    import random
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


class Kiamfast:
    """``python -m kiamfast`` for the bench node, on a table path that outlives a run."""

    name = "kiamfast"

    def __init__(self, c, *, table_path: str, flags: tuple[str, ...]) -> None:
        import bench_agent as ba
        self.c = c
        self.port = agent_port()
        self.table_path = table_path
        self.argv = ba.agent_argv(c, port=self.port, table_path=table_path, extra=[
            "--log-level=info", f"--node-startup-taint={STARTUP_TAINT}",
            "--ready-prefetch-timeout=120s", *flags])
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.log_path = ""

    def start(self, label: str) -> None:
        self.c.api.nodes.add(self.c.node, taints=[{"key": STARTUP_TAINT,
                                                  "effect": "NoSchedule"}])
        self.log_path = os.path.join(self.c.tmp, f"kiamfast-{label}.log")
        with open(self.log_path, "wb") as log:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(self.argv, env=child_env(), stdout=log,
                                         stderr=subprocess.STDOUT)

    def processes(self) -> dict[str, int]:
        if self.proc is None or self.proc.poll() is not None:
            return {}
        out = {"supervisor": self.proc.pid}
        for pid in children(self.proc.pid):
            args = cmdline(pid)
            if "kiamfast.server.worker" in args:
                out[f"worker-{args[args.index('--worker-index') + 1]}"
                    if "--worker-index" in args else "worker"] = pid
            elif "kiamfast.control" in args:
                out["control"] = pid
        return out

    def settle(self, timeout: float) -> None:
        """Until /readyz says 200 and the startup taint is gone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiamfast exited: {self.log_tail()}")
            if ("taint removed" in self.milestones() or "taint disabled" in self.milestones()):
                return
            time.sleep(0.05)
        raise RuntimeError(f"kiamfast not ready in {timeout:g} s: {self.log_tail()}")

    def milestones(self) -> dict[str, float]:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return {}
        out: dict[str, float] = {}
        for what, seconds in _MARK.findall(text):
            out.setdefault(what, float(seconds))
        return out

    def kill(self) -> None:
        """Every process at once (SIGKILL), as a container restart does."""
        pids = list(self.processes().values())
        for pid in reversed(pids):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        stop(self.proc, timeout=15)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


class Kube2iam:
    """The real kube2iam against the same node, started as kube2iam_harness.BenchKube2iam
    starts it (on a port chosen before the pods ask)."""

    name = "kube2iam"
    table_path = None

    def __init__(self, c) -> None:
        from kube2iam_harness import NoRegionsEc2
        self.c = c
        self.port = agent_port()
        self.ec2 = NoRegionsEc2().start()
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self, label: str) -> None:
        import bench_agent as ba
        from kube2iam_harness import kube2iam_binary, kube2iam_env
        c = self.c
        argv = [str(kube2iam_binary()), f"--api-server={c.api.url}",
                f"--api-token={c.api.token}", f"--node={c.node}", "--iptables=false",
                f"--host-ip={ba.HOST_IP}", f"--app-port={self.port}",
                f"--metrics-port={self.port}", f"--metadata-addr=127.0.0.1:{c.imds_port}",
                f"--base-role-arn={ba.BASE_ARN}"]
        env = kube2iam_env(Path(c.tmp), sts_url=c.proxy.url, ec2_url=self.ec2.url,
                           imds_url=f"http://127.0.0.1:{c.imds_port}")
        self.log_path = os.path.join(c.tmp, f"kube2iam-{label}.log")
        with open(self.log_path, "wb") as log:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                         start_new_session=True)

    def processes(self) -> dict[str, int]:
        if self.proc is None or self.proc.poll() is not None:
            return {}
        return {"kube2iam": self.proc.pid}

    def settle(self, timeout: float) -> None:
        time.sleep(1.0)       # it fetches on demand: every pod served is all it does

    def milestones(self) -> dict[str, float]:
        return {}

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.ec2.stop()


# ---- one start -----------------------------------------------------------------------------

def _judge(agent, c, pods: dict[str, str], raw: dict, *, case: str, index: int, roles: int,
           calls_before: int) -> Run:
    keys = c.access_keys()
    served_s, wrong, wrong_roles, first = [], 0, [], float("nan")
    attempts = 0
    for ip, role in sorted(pods.items()):
        p = raw[ip]
        attempts += p["attempts"]
        if p["first_answer"] is not None:
            t = p["first_answer"] - agent.started
            first = t if first != first else min(first, t)
        own = None
        for at, _, key in p["answers"]:
            issued = keys.get(key)
            if issued == role:
                own = at - agent.started if own is None else own
            else:
                wrong += 1
                wrong_roles.append(f"{role} got {issued or 'a key STS never issued'}")
        served_s.append(own if own is not None else float("nan"))
    calls = len(c.proxy.assume_role_calls()) - calls_before
    return Run(agent=agent.name, case=case, pods=len(pods), roles=roles, index=index,
               served_s=served_s, wrong=wrong, wrong_roles=wrong_roles[:10],
               first_answer_s=first, sts_calls=calls, attempts=attempts)


def one_start(agent, c, pods: dict[str, str], *, roles: int, index: int, opts: Options,
              log) -> list[Run]:
    """Start ``agent`` with every pod asking; then, if asked, kill and restart it with the
    pods asking again.  The runs of this start (and its restart)."""
    out = []
    calls_before = len(c.proxy.assume_role_calls())
    client = Pods(agent.port, pods, opts.timeout)
    sampler = None
    try:
        agent.start(f"{index}-start")
        sampler = Sampler(agent.processes)
        raw = client.result(opts.timeout + 30)
        sampler.stop()
        agent.settle(opts.timeout)
        time.sleep(1.0)
        steady = sampler.sample()
        run = _judge(agent, c, pods, raw, case="start", index=index, roles=roles,
                     calls_before=calls_before)
        if run.served < run.pods:
            log(f"  node start: {agent.name} served {run.served} of {run.pods} pods; its log "
                f"ends:\n{agent.log_tail()}")
        run.milestones = agent.milestones()
        run.memory = {"peak": sampler.peak, "peak_total": sampler.peak_total,
                      "steady": steady, "table": tmpfs_bytes(agent.table_path)
                      if agent.table_path else 0}
        out.append(run)
        if opts.restart:
            calls_before = len(c.proxy.assume_role_calls())
            agent.kill()
            client = Pods(agent.port, pods, opts.timeout)
            agent.start(f"{index}-restart")
            raw = client.result(opts.timeout + 30)
            run = _judge(agent, c, pods, raw, case="restart", index=index, roles=roles,
                         calls_before=calls_before)
            agent.settle(opts.timeout)
            run.milestones = agent.milestones()
            out.append(run)
    finally:
        if sampler is not None:
            sampler.stop()
        client.close()
        agent.stop()
    log(f"  node start: {agent.name} {len(pods)} pods, round {index + 1}: every pod served "
        f"after {out[0].every_s:.2f} s" if out else f"  node start: {agent.name} failed")
    return out


@contextlib.contextmanager
def node_runtime(kind: str, c, pods: dict[str, str]):
    """The node's pods in the API and, for ``kind`` "fault", each with a READY sandbox of
    the same uid, name and annotations in a container runtime (the CRI double, which the
    agent asks over real gRPC); yields kiamfast's --cri-endpoint."""
    import uuid

    import bench_agent as ba
    sandboxes = []
    for ip, role in sorted(pods.items()):
        uid = str(uuid.uuid4())
        name = c.add_pod(ip, role, uid=uid)
        sandboxes.append(dict(name=name, ip=ip, namespace="bench", uid=uid,
                              annotations={ba.ROLE_KEY: role}))
    if kind == "none":
        yield "none"
        return
    from kiamfast.testing.cri_fault import CriFault, fake_sandbox
    with CriFault() as runtime:
        runtime.put(*(fake_sandbox(**s) for s in sandboxes))
        yield runtime.endpoint


def scenario(res: Result, pods_n: int, roles: int, opts: Options, log) -> None:
    import bench_agent as ba
    from kiamfast.table import files_beside
    pods = {ip: ba.role_name(i % roles) for i, ip in enumerate(pod_addresses(pods_n))}
    with ba.cluster(sts_latency=opts.sts_latency) as c, \
            node_runtime(opts.runtime, c, pods) as endpoint:
        warm_sts(c.proxy.url)
        for index in range(opts.runs):
            for name in AGENTS if index % 2 == 0 else AGENTS[::-1]:   # neither always first
                if name == "kiamfast":
                    table = f"/dev/shm/kiamfast-bench-start-{os.getpid()}-{secrets.token_hex(4)}"
                    # loopback pods: no namespace of their own for the kernel to show
                    proof = ("--address-proof=runtime",) if endpoint != "none" else ()
                    agent = Kiamfast(c, table_path=table, flags=(
                        f"--cri-endpoint={endpoint}", *proof, *opts.kiamfast_flags))
                else:
                    agent, table = Kube2iam(c), None
                try:
                    res.runs += one_start(agent, c, pods, roles=roles, index=index, opts=opts,
                                          log=log)
                finally:
                    for path in (table, *((table + ".key", *files_beside(table)) if table
                                          else ())):
                        if path:
                            with contextlib.suppress(OSError):
                                os.unlink(path)


def warm_sts(url: str) -> None:
    """One AssumeRole before the first start: moto builds its STS backend at its first call
    (~0.3 s), which would otherwise fall on whichever agent starts first."""
    from kiamfast.control.iam.sts import StsClient
    from kiamfast.testing.aws_env import offline
    with offline():
        client = StsClient(endpoint_url=url, region="us-east-1")
        try:
            client.assume_role_sync("arn:aws:iam::123456789012:role/bench-warm-up", "warm-up")
        finally:
            client.close()


# ---- imports -------------------------------------------------------------------------------

IMPORTS = {
    "bare interpreter": "",
    "supervisor (kiamfast.cli, kiamfast.supervisor)": "import kiamfast.cli, kiamfast.supervisor",
    "worker (kiamfast.server.worker, _server)": "import kiamfast.server.worker, kiamfast._server",
    "control (kiamfast.control.start, .process)": "import kiamfast.control.start, "
                                                   "kiamfast.control.process",
    "control + a botocore STS client": (
        "import kiamfast.control.start, kiamfast.control.process\n"
        "from kiamfast.control.iam.sts import StsClient\n"
        "StsClient(endpoint_url='http://127.0.0.1:9', region='us-east-1').close()"),
}


_PROBE = """\
import os, time
def _since_start():
    with open("/proc/self/stat", "rb") as f:
        started = int(f.read().rsplit(b")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started
{code}
with open("/proc/self/status") as f:
    hwm = [line.split()[1] for line in f if line.startswith("VmHWM:")][0]
print(_since_start(), hwm)
"""


def measure_imports(reps: int) -> dict[str, dict[str, float]]:
    """Each entry in a fresh ``python -P``: seconds from the interpreter's start (/proc,
    10 ms steps) to the end of the imports, and peak RSS (VmHWM: the process's own since
    exec; getrusage's would count the forking parent's)."""
    out = {}
    for what, code in IMPORTS.items():
        secs, rss = [], []
        for _ in range(reps):
            p = subprocess.run([python(), "-P", "-c", _PROBE.format(code=code)],
                               env=child_env(), capture_output=True, text=True, timeout=60,
                               cwd="/")
            if p.returncode:
                raise RuntimeError(f"importing for {what!r} failed: {p.stderr[-2000:]}")
            s, kb = p.stdout.split()
            secs.append(float(s))
            rss.append(int(kb) / 1024)
        out[what] = {"s": statistics.median(secs), "rss_mib": statistics.median(rss)}
    return out


# ---- the whole comparison ------------------------------------------------------------------

def run(opts: Options = Options(), log=print) -> Result:
    import bench_agent as ba
    from benchutil import Unavailable
    from kube2iam_harness import MISSING, kube2iam_binary
    if kube2iam_binary() is None:
        raise Unavailable(MISSING)
    if not ba.full_agent_available():
        raise RuntimeError("needs the full agent")
    res = Result(options=dict(opts.__dict__), load=[os.getloadavg()[0]])
    res.imports = measure_imports(opts.imports)
    log("  node start: imports measured")
    for pods_n, roles in opts.scenarios:
        scenario(res, pods_n, roles, opts, log)
    res.load.append(os.getloadavg()[0])
    return res


# ---- summaries -----------------------------------------------------------------------------

def runs_of(res: Result, agent: str, pods: int, case: str = "start") -> list[Run]:
    return [r for r in res.runs if r.agent == agent and r.pods == pods and r.case == case]


def _rng(xs: list[float], fmt: str = "{:.2f}") -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "—"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return (fmt.format(median(xs)) + " (" + fmt.format(min(xs)) + "–" + fmt.format(max(xs))
            + ")")


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def compare(res: Result, pods: int) -> dict:
    """The issue's targets for one scenario, from the paired runs (same round)."""
    k = {r.index: r for r in runs_of(res, "kiamfast", pods)}
    g = {r.index: r for r in runs_of(res, "kube2iam", pods)}
    pairs = [(k[i], g[i]) for i in sorted(k) if i in g]
    no_later = all(a.every_s <= b.every_s for a, b in pairs) if pairs else False
    ratio = median([a.median_s / b.median_s for a, b in pairs if b.median_s])
    every = [a.every_s for a, _ in pairs]
    return {"pairs": len(pairs), "no_later_every_run": no_later, "median_ratio": ratio,
            "kiamfast_every_max": max(every) if every and all(x == x for x in every)
            else float("nan")}


def memory_rows(res: Result, pods: int) -> list[str]:
    rows = []
    for agent in AGENTS:
        rs = runs_of(res, agent, pods)
        names = sorted({n for r in rs for n in r.memory.get("steady", {})})
        for name in names:
            steady = [r.memory["steady"].get(name, {}) for r in rs]
            peak = [r.memory["peak"].get(name, {}) for r in rs]
            rows.append(f"| {pods} | {agent} | {name} | "
                        f"{_mib(median([m.get('rss', 0) for m in steady]))} | "
                        f"{_mib(median([m.get('pss', 0) for m in steady]))} | "
                        f"{_mib(median([m.get('pss_shmem', 0) for m in steady]))} | "
                        f"{_mib(median([m.get('pss', 0) for m in peak]))} | "
                        f"{_mib(median([m.get('hwm', 0) for m in peak]))} |")
        total_steady = [sum(m.get("pss", 0) for m in r.memory["steady"].values()) for r in rs]
        total_rss = [sum(m.get("rss", 0) for m in r.memory["steady"].values()) for r in rs]
        table = [r.memory.get("table", 0) for r in rs]
        rows.append(f"| {pods} | {agent} | **all** | {_mib(median(total_rss))} | "
                    f"**{_mib(median(total_steady))}** | | "
                    f"{_mib(median([r.memory['peak_total']['pss'] for r in rs]))} | "
                    f"table file (tmpfs): {_mib(median(table))} |")
    return rows


def markdown(res: Result) -> str:
    o = res.options
    lines = [f"The node holds N pods over R roles, every pod asking (token, listing, document; "
             f"1 s timeout; again 100 ms after each attempt began) before the agent starts; "
             f"{o['runs']} start(s) per agent and scenario, alternating; STS is moto with " + (
                 f"{o['sts_latency'] * 1000:.0f} ms added to every call" if o.get("sts_latency")
                 else "no added latency (a local STS)") + "; kiamfast " + (
                 "API-only (`--cri-endpoint=none`), " if o.get("runtime") == "none" else
                 "with a container runtime holding a READY sandbox per pod (the CRI double, "
                 "over gRPC, as containerd on a node), ") +
             (f"with `{' '.join(o['kiamfast_flags'])}`" if o["kiamfast_flags"]
              else "its default STS limits (`--sts-qps 5 --sts-burst 100`)") + ". Seconds from the "
             "agent's process start; medians (min–max) over the runs.", "",
             "| pods / roles | agent | every pod served its own role | median pod | first pod "
             "| first answer of any kind | answers with another role | STS calls |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for pods, roles in o["scenarios"]:
        for agent in AGENTS:
            rs = runs_of(res, agent, pods)
            if not rs:
                continue
            lines.append(f"| {pods} / {roles} | {agent} | {_rng([r.every_s for r in rs])} | "
                         f"{_rng([r.median_s for r in rs])} | {_rng([r.first_s for r in rs])} "
                         f"| {_rng([r.first_answer_s for r in rs])} | "
                         f"{sum(r.wrong for r in rs)} | "
                         f"{_rng([r.sts_calls for r in rs], '{:.0f}')} |")
    lines += ["", "Targets per scenario (runs paired by round):", "",
              "| pods / roles | kiamfast no later than kube2iam in every run | median pod, "
              "kiamfast ÷ kube2iam (target ≤ 0.5) | kiamfast's slowest run to every pod |",
              "|---|---|---:|---:|"]
    for pods, roles in o["scenarios"]:
        cmp = compare(res, pods)
        lines.append(f"| {pods} / {roles} | {'yes' if cmp['no_later_every_run'] else 'no'} "
                     f"({cmp['pairs']} pairs) | {cmp['median_ratio']:.2f} | "
                     f"{cmp['kiamfast_every_max']:.2f} s |")
    if o["restart"]:
        lines += ["", "Restart (every process killed, started again with the same table and "
                  "token key; the pods asking): seconds from the new process start.", "",
                  "| pods / roles | agent | first pod served | median pod | every pod | "
                  "answers with another role | STS calls |", "|---|---|---:|---:|---:|---:|---:|"]
        for pods, roles in o["scenarios"]:
            for agent in AGENTS:
                rs = runs_of(res, agent, pods, "restart")
                if rs:
                    lines.append(f"| {pods} / {roles} | {agent} | "
                                 f"{_rng([r.first_s for r in rs], '{:.3f}')} | "
                                 f"{_rng([r.median_s for r in rs], '{:.3f}')} | "
                                 f"{_rng([r.every_s for r in rs], '{:.3f}')} | "
                                 f"{sum(r.wrong for r in rs)} | "
                                 f"{_rng([r.sts_calls for r in rs], '{:.0f}')} |")
    lines += ["", "kiamfast's milestones (its log, seconds from the supervisor's process "
              "start; medians):", "",
              "| pods / roles | case | " + " | ".join(MILESTONES) + " |",
              "|---|---|" + "---:|" * len(MILESTONES)]
    for pods, roles in o["scenarios"]:
        for case in ("start", "restart"):
            rs = runs_of(res, "kiamfast", pods, case)
            if rs:
                cells = [_rng([r.milestones.get(m, float("nan")) for r in rs], "{:.3f}")
                         for m in MILESTONES]
                lines.append(f"| {pods} / {roles} | {case} | " + " | ".join(cells) + " |")
    lines += ["", "Memory (MiB), steady = a second after the agent settled (kiamfast: ready "
              "and taint removed), peak = while the pods were being served (sampled every "
              "50 ms; VmHWM is the kernel's RSS peak). PSS counts each process's share of "
              "the mapped table (of which shmem); the table file's tmpfs pages are given "
              "apart.", "",
              "| pods | agent | process | RSS | PSS | of which shmem | peak PSS | peak RSS "
              "(VmHWM) |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    for pods, _ in o["scenarios"]:
        lines += memory_rows(res, pods)
    if res.imports:
        lines += ["", "Imports in a bare `python -P` (median of "
                  f"{o['imports']}): seconds from the interpreter's start to the end of the "
                  "imports (10 ms steps), and peak RSS.", "",
                  "| process | s | peak RSS MiB |", "|---|---:|---:|"]
        lines += [f"| {k} | {v['s']:.2f} | {v['rss_mib']:.1f} |" for k, v in res.imports.items()]
    lines += ["", f"Load average (1 min) {res.load[0]:.1f} at the start, {res.load[-1]:.1f} at "
              f"the end, on {os.cpu_count()} CPUs."]
    return "\n".join(lines)


def headline(res: Result) -> list[tuple[str, str, str, str]]:
    ok = lambda c: "✅" if c else "❌"   # noqa: E731
    rows = []
    o = res.options
    for pods, roles in o["scenarios"]:
        cmp = compare(res, pods)
        bound = 1.0 if pods <= 60 else 2.0
        rows.append((f"node start, {pods} pods / {roles} roles: every pod its own role, "
                     "kiamfast vs kube2iam (medians)",
                     f"{median([r.every_s for r in runs_of(res, 'kiamfast', pods)]):.2f} s vs "
                     f"{median([r.every_s for r in runs_of(res, 'kube2iam', pods)]):.2f} s",
                     f"no later in every run, < {bound:g} s",
                     ok(cmp["no_later_every_run"] and cmp["kiamfast_every_max"] < bound)))
        rows.append((f"node start, {pods} pods: median pod, kiamfast ÷ kube2iam",
                     f"{cmp['median_ratio']:.2f}", "≤ 0.5", ok(cmp["median_ratio"] <= 0.5)))
        rs = runs_of(res, "kiamfast", pods)
        pss = median([sum(m.get("pss", 0) for m in r.memory["steady"].values()) for r in rs])
        k2i = median([sum(m.get("pss", 0) for m in r.memory["steady"].values())
                      for r in runs_of(res, "kube2iam", pods)])
        limit = 72 if pods <= 60 else 100
        rows.append((f"node start, {pods} pods: PSS of all the agent's processes, kiamfast "
                     "(kube2iam)", f"{_mib(pss)} MiB ({_mib(k2i)})", f"≤ {limit} MiB",
                     ok(pss <= limit * 2**20)))
        rr = runs_of(res, "kiamfast", pods, "restart")
        if rr:
            rows.append((f"restart, {pods} pods: first pod served (from the process start)",
                         f"{median([r.first_s for r in rr]):.3f} s", "≤ 0.3 s "
                         "(owner proven current)", ok(median([r.first_s for r in rr]) <= 0.3)))
    wrong = sum(r.wrong for r in res.runs if r.agent == "kiamfast")
    unserved = sum(r.pods - r.served for r in res.runs if r.agent == "kiamfast")
    rows.append(("node start: kiamfast answers with another role, pods never served (kube2iam)",
                 f"{wrong}, {unserved} ({sum(r.wrong for r in res.runs if r.agent == 'kube2iam')}"
                 f", {sum(r.pods - r.served for r in res.runs if r.agent == 'kube2iam')})",
                 "0, 0", ok(wrong == 0 and unserved == 0)))
    return rows


def plot(res: Result, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    scen = res.options["scenarios"]
    fig, axes = plt.subplots(1, len(scen), figsize=(6 * len(scen), 4), squeeze=False)
    colors = {"kiamfast": "tab:blue", "kube2iam": "tab:orange"}
    for ax, (pods, roles) in zip(axes[0], scen):
        for agent in AGENTS:
            for i, r in enumerate(runs_of(res, agent, pods)):
                xs = sorted(t for t in r.served_s if t == t)
                ax.step(xs, [(j + 1) / pods for j in range(len(xs))], where="post",
                        color=colors[agent], alpha=0.6, label=agent if i == 0 else None)
        ks = runs_of(res, "kiamfast", pods)
        for m, style in (("worker listening", ":"), ("pods listed", "--"),
                         ("first STS answer", "-."), ("ready", "-")):
            t = median([r.milestones.get(m, float("nan")) for r in ks])
            if t == t:
                ax.axvline(t, color="tab:blue", linestyle=style, linewidth=0.8,
                           label=f"kiamfast: {m}")
        ax.set_xlabel("seconds from the agent's process start")
        ax.set_ylabel("pods served their own role")
        ax.set_title(f"{pods} pods / {roles} roles, every pod asking from the start",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "node_start.png", dpi=110)
    plt.close(fig)
    return ["node_start.png"]


def _scenario(text: str) -> tuple[int, int]:
    pods, _, roles = text.partition("x")
    return int(pods), int(roles)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pods-client"]:
        return pods_client_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--scenario", action="append", type=_scenario,
                    help="PODSxROLES (repeatable), e.g. 60x20")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--kiamfast-flag", action="append", default=[],
                    help="an extra flag for kiamfast (repeatable)")
    ap.add_argument("--runtime", choices=("fault", "none"), default="fault",
                    help="kiamfast's addresses from a container runtime (the CRI double, "
                         "default) or from the API alone")
    ap.add_argument("--sts-latency", type=float, default=0.0,
                    help="seconds added to every STS call (default 0: a local STS)")
    ap.add_argument("--json", help="also write the runs here")
    args = ap.parse_args(argv)
    opts = QUICK if args.quick else Options()
    if args.runs:
        opts.runs = args.runs
    if args.scenario:
        opts.scenarios = tuple(args.scenario)
    opts.restart = not args.no_restart
    opts.kiamfast_flags = tuple(args.kiamfast_flag)
    opts.runtime = args.runtime
    opts.sts_latency = args.sts_latency
    res = run(opts, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"options": res.options, "imports": res.imports,
             "runs": [dict(r.__dict__) for r in res.runs]}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
