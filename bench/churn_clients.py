"""The clients of bench/churn.py's pods, and what they saw: each pod's client is an SDK
stand-in (token, then the listing and the document, one request at a time, keep-alive) that
lives exactly as long as its pod and reports every answer it got; the churner and the
clients share a few words per address (:class:`Shared`).

Without a runtime the clients of all pods share a few processes (:class:`SharedClients`);
with one, each pod's client is a process of its own, forked into its sandbox's network
(:class:`SandboxClients`). :func:`tally` sums their reports.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing as mp
import os
import subprocess
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from benchutil import set_affinity

import cri_node  # noqa: E402  (benchutil put the repo on sys.path)
from cri_node import Pod, Sandbox  # noqa: E402
from loadgen import CREDENTIALS, TOKEN_PUT, frame, metadata_get  # noqa: E402

SDK_BUDGET = 1.0          # botocore: DEFAULT_METADATA_SERVICE_TIMEOUT, 1 attempt
HANG_TIMEOUT = 3.0        # a request unanswered this long is abandoned (and counted late)


@dataclass
class Shared:
    """Per-IP words shared by the churner and the client processes (fork-inherited)."""
    want: object   # churner -> client: 1 run, 0 stop
    role: object   # churner -> client: role index of the IP's current pod
    prev: object   # churner -> client: role index of the previous pod (-1 none)
    gen: object    # churner -> client: pod generation on this IP
    ack: object    # client -> churner: the generation whose client has stopped
    stop_all: object
    progress: object  # client process j -> churner: credential requests answered so far
    ended: object     # churner: perf_counter() when the IP's previous pod turned Failed
    claimed: object   # churner: perf_counter() when the IP's current pod's IP was published

    @classmethod
    def create(cls, n: int) -> "Shared":
        return cls(want=mp.RawArray(ctypes.c_int32, n), role=mp.RawArray(ctypes.c_int32, n),
                   prev=mp.RawArray(ctypes.c_int32, n), gen=mp.RawArray(ctypes.c_int32, n),
                   ack=mp.RawArray(ctypes.c_int32, n), stop_all=mp.RawValue(ctypes.c_int32, 0),
                   progress=mp.RawArray(ctypes.c_int64, 64),
                   ended=mp.RawArray(ctypes.c_double, n), claimed=mp.RawArray(ctypes.c_double, n))


# ---- clients ---------------------------------------------------------------------------------

def client_main(port: int, mine: list[tuple[int, str]], role_names: list[bytes],
                 sh: Shared, slot: int, cpu: int | None, conn) -> None:
    import asyncio

    import uvloop

    set_affinity([0], {cpu} if cpu is not None else None)
    perf_ns = time.perf_counter_ns
    lat = array("I")
    st = {"requests": 0, "ok": 0, "wrong_prev": 0, "wrong_other": 0, "late": 0, "hung": 0,
          "put_fail": 0, "pods": 0, "connect_fail": 0}
    statuses: dict[int, int] = {}
    keys: dict[tuple[int, str], int] = {}
    samples: list[str] = []
    wrong_lags: list[tuple[float, float]] = []   # (ms since old pod's end, since new IP)
    first_ok = array("d")   # ms from a new pod's IP publication to its first right listing
    budget_us = int(SDK_BUDGET * 1e6)

    class PodClient(asyncio.Protocol):
        """One pod's SDK: token, then listing/document until its pod is stopped."""

        def __init__(self, idx: int, ip: str) -> None:
            self.idx, self.ip = idx, ip
            self.transport = None
            self.gen = -1
            self.role = -1
            self.prev = -1
            self.token = b""
            self.step = 0          # 0 token, 1 listing, 2 document
            self.t0 = 0
            self.buf = b""
            self.inflight = False
            self.running = False

        # -- life cycle --------------------------------------------------------------------
        def start(self, loop) -> None:
            self.running = True
            self.gen = sh.gen[self.idx]
            self.role = sh.role[self.idx]
            self.prev = sh.prev[self.idx]
            self.step = 0
            self.buf = b""
            self.first = True
            st["pods"] += 1
            loop.create_task(self._connect(loop))

        async def _connect(self, loop) -> None:
            try:
                await loop.create_connection(lambda: self, "127.0.0.1", port,
                                             local_addr=(self.ip, 0))
            except OSError as e:
                st["connect_fail"] += 1
                if len(samples) < 5:
                    samples.append(f"connect {self.ip}: {e}")
                self.stop()

        def stop(self) -> None:
            self.running = False
            self.inflight = False
            if self.transport is not None:
                self.transport.close()
                self.transport = None
            sh.ack[self.idx] = self.gen

        def connection_made(self, transport) -> None:
            self.transport = transport
            self.send(TOKEN_PUT)

        def connection_lost(self, exc) -> None:
            if self.running:
                self.transport = None
                self.stop()

        def send(self, req: bytes) -> None:
            self.inflight = True
            self.t0 = perf_ns()
            self.transport.write(req)

        def next_request(self) -> None:
            if not self.running or self.transport is None:
                return
            if sh.want[self.idx] == 0 or sh.gen[self.idx] != self.gen or sh.stop_all.value:
                self.stop()
                return
            if self.step == 1:
                self.send(metadata_get(CREDENTIALS, self.token))
            else:
                self.send(metadata_get(CREDENTIALS + role_names[self.role], self.token))

        # -- responses ---------------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            buf = self.buf + data if self.buf else data
            while True:
                i, n = frame(buf)
                if i < 0:
                    break
                resp, buf = buf[:n], buf[n:]
                self.inflight = False
                self.answer(resp, i, (perf_ns() - self.t0) // 1000)
            self.buf = buf

        def answer(self, resp: bytes, i: int, us: int) -> None:
            status = int(resp[9:12])
            body = resp[i + 4:]
            if self.step == 0:
                if status != 200:
                    st["put_fail"] += 1
                    self.stop()
                    return
                self.token = body
                self.step = 1
                self.next_request()
                return
            st["requests"] += 1
            lat.append(us)
            statuses[status] = statuses.get(status, 0) + 1
            if us > budget_us:
                st["late"] += 1
            if status == 200:
                if self.step == 1:
                    if body == role_names[self.role]:
                        st["ok"] += 1
                        if self.first:
                            self.first = False
                            if sh.claimed[self.idx]:
                                first_ok.append((time.perf_counter() - sh.claimed[self.idx])
                                                * 1e3)
                    else:
                        self.wrong(body, "listing")
                    self.step = 2
                else:
                    k = body.find(b'"AccessKeyId"')
                    q = body.find(b'"', body.find(b":", k) + 1)
                    akid = body[q + 1:body.find(b'"', q + 1)].decode()
                    keys[(self.role, akid)] = keys.get((self.role, akid), 0) + 1
                    self.step = 1
            else:
                if len(samples) < 8:
                    now = time.perf_counter()
                    samples.append(
                        f"{status} to the {'listing' if self.step == 1 else 'document'} from "
                        f"{self.ip} (role {role_names[self.role].decode()}, previous "
                        f"{role_names[self.prev].decode() if self.prev >= 0 else '-'}), "
                        f"{(now - sh.claimed[self.idx]) * 1e3 if sh.claimed[self.idx] else 0:.1f}"
                        f" ms after its IP was published: {body[:80]!r}")
                self.step = 1 if self.step == 2 else 2
            self.next_request()

        def wrong(self, body: bytes, what: str) -> None:
            now = time.perf_counter()
            lag = ((now - sh.ended[self.idx]) * 1e3 if sh.ended[self.idx] else float("nan"),
                   (now - sh.claimed[self.idx]) * 1e3 if sh.claimed[self.idx] else float("nan"))
            wrong_lags.append(lag)
            try:
                named = role_names.index(body)
            except ValueError:
                named = -2
            if named == self.prev and named >= 0:
                st["wrong_prev"] += 1
            else:
                st["wrong_other"] += 1
            if len(samples) < 8:
                samples.append(f"{what} from {self.ip} (pod gen {self.gen}, role "
                               f"{role_names[self.role].decode()}, previous "
                               f"{role_names[self.prev].decode() if self.prev >= 0 else '-'}):"
                               f" got {body[:80]!r}, {lag[0]:.1f} ms after the old pod's end "
                               f"and {lag[1]:.1f} ms after the new pod's IP were published")

    async def main() -> float:
        loop = asyncio.get_running_loop()
        clients = [PodClient(idx, ip) for idx, ip in mine]
        t_start = time.perf_counter()
        while not sh.stop_all.value:
            sh.progress[slot] = st["requests"]
            now = perf_ns()
            for c in clients:
                if c.running:
                    if c.inflight and now - c.t0 > HANG_TIMEOUT * 1e9:
                        st["hung"] += 1
                        st["late"] += 1
                        c.stop()
                    elif not c.inflight and c.transport is not None and (
                            sh.want[c.idx] == 0 or sh.gen[c.idx] != c.gen):
                        c.stop()
                elif sh.want[c.idx] == 1 and sh.gen[c.idx] != c.gen:
                    c.start(loop)
                elif sh.want[c.idx] == 0 and sh.ack[c.idx] != sh.gen[c.idx]:
                    sh.ack[c.idx] = sh.gen[c.idx]
            await asyncio.sleep(0.001)
        for c in clients:
            if c.running:
                c.stop()
        await asyncio.sleep(0.05)
        return time.perf_counter() - t_start

    elapsed = uvloop.run(main())
    conn.send({"stats": st, "statuses": statuses, "keys": keys, "samples": samples,
               "wrong_lags": wrong_lags, "first_ok": first_ok.tobytes(),
               "lat": lat.tobytes(), "elapsed": elapsed})
    conn.close()


# ---- the clients' processes ------------------------------------------------------------------

class SharedClients:
    """Without a runtime: every pod's client in ``processes`` forked processes, many pods'
    each; a pod's client starts and stops as the churner's shared words say."""

    def __init__(self, *, port: int, addrs: list[str], role_names: list[bytes], sh: Shared,
                 processes: int) -> None:
        self.port, self.addrs, self.role_names, self.sh = port, addrs, role_names, sh
        self.processes = processes
        self.pipes: list = []
        self.procs: list = []

    def start(self, pods: list[Pod]) -> None:
        ctx = mp.get_context("fork")
        cpus = sorted(os.sched_getaffinity(0))
        for j in range(self.processes):
            mine = [(i, self.addrs[i]) for i in range(j, len(self.addrs), self.processes)]
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=client_main, args=(
                self.port, mine, self.role_names, self.sh, j,
                cpus[1 + j % (len(cpus) - 1)] if len(cpus) > 1 else None, child), daemon=True)
            p.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(p)

    def pod_started(self, slot: int, sandbox: Sandbox) -> None:
        pass     # its process starts it: sh.want and sh.gen say so

    def pod_stopped(self, slot: int) -> None:
        pass

    def pump(self) -> None:
        pass

    def progress(self) -> int:
        return sum(self.sh.progress[j] for j in range(self.processes))

    def finish(self) -> tuple[list[dict], int]:
        self.sh.stop_all.value = 1
        results = [pp.recv() if pp.poll(30) else None for pp in self.pipes]
        for p in self.procs:
            p.join(5)
        return [r for r in results if r], sum(r is None for r in results)


def sandbox_client_main(*, port: int, slot: int, sandbox: Sandbox, agent_host: str,
                        role_names: list[bytes], sh: Shared, conn) -> None:
    """One pod's client, run from inside its sandbox's network. Niced: on two cores,
    closed-loop clients would otherwise starve containerd and the churn."""
    os.nice(10)
    if sandbox.netns:
        cri_node.enter_netns(sandbox.netns)
        # the client connects to 127.0.0.1:<port>; here that is the agent on the bridge
        subprocess.run(["iptables", "-w", "-t", "nat", "-A", "OUTPUT", "-d", "127.0.0.1/32",
                        "-p", "tcp", "--dport", str(port), "-j", "DNAT", "--to-destination",
                        f"{agent_host}:{port}"], check=True, capture_output=True)
    client_main(port, [(slot, sandbox.ip)], role_names, sh, 0, None, conn)


@dataclass
class Client:
    """The parent's handle on one sandbox's client process."""
    proc: mp.Process
    pipe: object
    stop: object       # its own stop_all flag
    progress: object   # its own progress counter (requests answered)


def start_client(*, port: int, slot: int, sandbox: Sandbox, agent_host: str,
                 role_names: list[bytes], sh: Shared) -> Client:
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


class SandboxClients:
    """With a runtime: each pod's client a process of its own (see the module docstring),
    started when its sandbox is READY and stopped with it."""

    def __init__(self, *, port: int, agent_host: str, role_names: list[bytes],
                 sh: Shared) -> None:
        self.port, self.agent_host, self.role_names, self.sh = port, agent_host, role_names, sh
        self.live: dict[int, Client] = {}
        self.stopping: list[Client] = []
        self.results: list[dict] = []
        self.lost = 0

    def start(self, pods: list[Pod]) -> None:
        for i, pod in enumerate(pods):
            self.pod_started(i, pod.sandbox)

    def pod_started(self, slot: int, sandbox: Sandbox) -> None:
        self.live[slot] = start_client(port=self.port, slot=slot, sandbox=sandbox,
                                       agent_host=self.agent_host, role_names=self.role_names,
                                       sh=self.sh)

    def pod_stopped(self, slot: int) -> None:
        cl = self.live.pop(slot)
        cl.stop.value = 1
        self.stopping.append(cl)

    def pump(self) -> None:
        """Reap the stopped clients that have reported."""
        for cl in list(self.stopping):
            if cl.pipe.poll(0):
                self.stopping.remove(cl)
                report = report_of(cl)
                if report is None:
                    self.lost += 1
                else:
                    self.results.append(report)

    def progress(self) -> int:
        return (sum(cl.progress[0] for cl in (*self.live.values(), *self.stopping))
                + sum(r["stats"]["requests"] for r in self.results))

    def finish(self) -> tuple[list[dict], int]:
        results, lost = collect([*self.live.values(), *self.stopping])
        self.live, self.stopping = {}, []
        return self.results + results, self.lost + lost


# ---- what the clients saw --------------------------------------------------------------------

@dataclass
class Tally:
    """What the client processes reported, summed."""
    requests: int = 0
    ok: int = 0
    wrong_prev: int = 0          # listings naming the address's previous pod's role
    wrong_other: int = 0         # listings naming any other role
    wrong_document: int = 0      # documents whose key STS issued for another role
    statuses: dict = field(default_factory=dict)
    late: int = 0
    hung: int = 0
    put_fail: int = 0
    connect_fail: int = 0
    pods: int = 0
    samples: list = field(default_factory=list)
    wrong_lags: list = field(default_factory=list)   # (ms since the old pod's end, since B's)
    latencies_us: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    first_ok_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    seconds: float = 0.0    # summed over client processes (client-seconds)

    @property
    def wrong_listing(self) -> int:
        return self.wrong_prev + self.wrong_other

    @property
    def wrong(self) -> int:
        return self.wrong_listing + self.wrong_document

    @property
    def not_200(self) -> int:
        return sum(v for k, v in self.statuses.items() if k != 200)

    @property
    def not_served(self) -> int:
        return self.not_200 + self.hung


def tally(results: list[dict], *, role_names: list[bytes], keymap: dict[str, str]) -> Tally:
    """Sum the clients' reports; a document is wrong when STS issued its key for another
    role than the asking pod's (``keymap``: AccessKeyId -> role name)."""
    t = Tally()
    doc_samples = []
    for r in results:
        st = r["stats"]
        for k in ("requests", "ok", "wrong_prev", "wrong_other", "late", "hung", "put_fail",
                  "connect_fail", "pods"):
            setattr(t, k, getattr(t, k) + st[k])
        t.seconds += r["elapsed"]
        for k, v in r["statuses"].items():
            t.statuses[k] = t.statuses.get(k, 0) + v
        for (role, akid), n in r["keys"].items():
            if keymap.get(akid) == role_names[role].decode():
                t.ok += n
            else:
                t.wrong_document += n
                doc_samples.append(f"document for {role_names[role].decode()} carried "
                                   f"{akid} (issued for {keymap.get(akid)}) x{n}")
        t.samples += r["samples"]
        t.wrong_lags += r["wrong_lags"]
    t.samples = t.samples[:8] + doc_samples[:4]
    if results:
        t.latencies_us = np.concatenate([np.frombuffer(r["lat"], dtype=np.uint32)
                                         for r in results])
        t.first_ok_ms = np.concatenate([np.frombuffer(r["first_ok"], dtype=np.float64)
                                        for r in results])
    return t
