"""Correctness under churn: pods replaced at a high rate with IP reuse while their clients
hammer the agent. Counts what must never happen: an answer naming a role other than the
asking pod's. And what must not happen often: no answer within the SDK's budget (1 s).

The node: ``ips`` addresses (127.0.x.y), each always held by one pod of a random role out
of ``roles``. Each pod has one client (an SDK stand-in, in load-generator processes) that,
for as long as its pod lives, fetches a token (``PUT /latest/api/token``), then loops:
``GET .../security-credentials/`` (the listing: must be the pod's role name) and
``GET .../security-credentials/<its role>`` (the document: its AccessKeyId must be one STS
issued for that role, checked against the STS proxy's records afterwards).

A churner (in this process, driving the API emulator) replaces ``rate`` pods per second,
each replacement following a kubelet's order of events on a real node:

1. the new pod B is created on the node, Pending, without an IP (it was scheduled);
2. the old pod A starts terminating (``deletionTimestamp``); its client stops once its
   request in flight is answered (its containers are killed), and acknowledges;
3. A's phase turns Failed (the kubelet's final status) and A is deleted;
4. ``gap`` seconds later (CNI: teardown of A's sandbox, set-up of B's) B's IP is published,
   the IP A had, and B turns Running; B's client starts at once.

So a wrong answer means the agent named A's (or any other) role to B's client after the
API server had published A's end and B's claim; a request "not served" is any answer but a
200, or one later than the SDK budget. The agent's only help here is the watch (it runs
API-only, ``--cri-endpoint=none``; bench/runtime_churn.py is the same churn with the
container runtime). ``--agent kube2iam`` runs the same churn against kube2iam 0.15 itself
(tests/tools/build_kube2iam.sh builds it), which is always API-only.

    python bench/churn.py [--quick] [--requests N] [--rate R] [--gap S] [--agent kube2iam]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import random
import socket
import sys
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from benchutil import pod_addresses, set_affinity, summarize_us

SDK_BUDGET = 1.0          # botocore: DEFAULT_METADATA_SERVICE_TIMEOUT, 1 attempt
HANG_TIMEOUT = 3.0        # a request unanswered this long is abandoned (and counted late)
LISTING = b"/latest/meta-data/iam/security-credentials/"
PUT = (b"PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\n"
       b"User-Agent: churn\r\nX-aws-ec2-metadata-token-ttl-seconds: 21600\r\n"
       b"Content-Length: 0\r\n\r\n")


def _get(path: bytes, token: bytes) -> bytes:
    return (b"GET %s HTTP/1.1\r\nHost: 169.254.169.254\r\nUser-Agent: churn\r\n"
            b"X-aws-ec2-metadata-token: %s\r\n\r\n" % (path, token))


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

def _client_main(port: int, mine: list[tuple[int, str]], role_names: list[bytes],
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
            self.send(PUT)

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
                self.send(_get(LISTING, self.token))
            else:
                self.send(_get(LISTING + role_names[self.role], self.token))

        # -- responses ---------------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            buf = self.buf + data if self.buf else data
            while True:
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    break
                j = buf.find(b"Content-Length:", 0, i)
                n = i + 4 + (int(buf[j + 15:buf.find(b"\r\n", j)]) if j >= 0 else 0)
                if len(buf) < n:
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


# ---- the run ---------------------------------------------------------------------------------

def _listing(port: int, ip: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), source_address=(ip, 0),
                                  timeout=2) as s:
        s.sendall(b"GET /latest/meta-data/iam/security-credentials/ HTTP/1.1\r\nHost: x\r\n"
                  b"Connection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.partition(b"\r\n\r\n")[2]


def _idle_lag(c, port: int, addrs: list[str], names: list[str], sh: Shared,
              role_names: list[bytes], rng: random.Random, *, n: int) -> np.ndarray:
    """Baseline: with no load, ms from a replacement's IP publication until the agent
    names the new pod's role (polled every 0.5 ms), the same replacement steps as below."""
    lags = []
    for _ in range(n):
        i = rng.randrange(len(addrs))
        new_role = (sh.role[i] + 1 + rng.randrange(len(role_names) - 1)) % len(role_names)
        new = c.add_pod("", role_names[new_role].decode(), namespace="bench", phase="Pending")
        c.api.mark_pod_terminating("bench", names[i])
        c.api.set_pod_phase("bench", names[i], "Failed")
        c.api.delete_pod("bench", names[i])
        t0 = time.perf_counter()
        c.api.set_pod_ips("bench", new, [addrs[i]])
        c.api.set_pod_phase("bench", new, "Running")
        names[i] = new
        sh.prev[i], sh.role[i] = sh.role[i], new_role
        deadline = t0 + 5
        while _listing(port, addrs[i]) != role_names[new_role] and time.perf_counter() < deadline:
            time.sleep(0.0005)
        lags.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.02)
    return np.array(lags)


@dataclass
class ChurnResult:
    mode: str
    ips: int
    roles: int
    rate: float
    gap: float
    seconds: float
    replacements: int
    requests: int
    ok: int
    wrong_prev: int
    wrong_other: int
    wrong_document: int
    late: int
    hung: int
    statuses: dict
    put_fail: int
    pods: int
    connect_fail: int
    latencies_us: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    samples: list = field(default_factory=list)
    wrong_lags: list = field(default_factory=list)
    delivery: dict = field(default_factory=dict)   # bare watcher's lag behind the API, ms
    first_ok: dict = field(default_factory=dict)   # new pod: IP published -> first right answer
    idle_lag: dict = field(default_factory=dict)   # the same, one replacement at a time, no load
    agent_restarts: str = ""

    @property
    def wrong(self) -> int:
        return self.wrong_prev + self.wrong_other + self.wrong_document

    @property
    def not_served(self) -> int:
        return sum(v for k, v in self.statuses.items() if k != 200) + self.hung


def run(*, ips: int = 256, roles: int = 40, rate: float = 50.0, gap: float = 0.01,
        requests: int = 1_000_000, max_seconds: float = 240.0, processes: int | None = None,
        idle_samples: int = 20, min_replacements: int = 0, agent: str = "kiamfast",
        log=print) -> ChurnResult:
    import bench_agent as ba

    if not ba.full_agent_available():
        raise RuntimeError("needs the full agent (kiamfast.control.process is not there yet)")
    addrs = pod_addresses(ips)
    role_names = [ba.role_name(r).encode() for r in range(roles)]
    rng = random.Random(3)
    cpus = sorted(os.sched_getaffinity(0))
    processes = processes or max(1, len(cpus) - 1)
    sh = Shared.create(ips)
    with ba.cluster() as c:
        names: list[str] = []
        for i, ip in enumerate(addrs):
            r = rng.randrange(roles)
            names.append(c.add_pod(ip, role_names[r].decode(), namespace="bench"))
            sh.role[i], sh.prev[i], sh.gen[i], sh.want[i], sh.ack[i] = r, -1, 1, 1, 0
        # every role in use from the start, so a new pod never waits on STS (and a wait is
        # the agent's, not the fault proxy's)
        with _agent_under_test(c, agent) as a:
            a.wait_ready(120)
            idle = _idle_lag(c, a.port, addrs, names, sh, role_names, rng, n=idle_samples)
            ctx = mp.get_context("fork")
            w_parent, w_child = ctx.Pipe(duplex=False)
            witness = ctx.Process(target=_witness_main, args=(
                c.api.port, "bench-token", c.node, sh.stop_all, w_child), daemon=True)
            witness.start()
            w_child.close()
            c.api.wait_watches(2, node=c.node, timeout=10)
            pub_end: dict[str, float] = {}
            pub_ip: dict[str, float] = {}
            pipes, procs = [], []
            for j in range(processes):
                mine = [(i, addrs[i]) for i in range(j, ips, processes)]
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_client_main, args=(
                    a.port, mine, role_names, sh, j, cpus[1 + j % (len(cpus) - 1)]
                    if len(cpus) > 1 else None, child), daemon=True)
                p.start()
                child.close()
                pipes.append(parent)
                procs.append(p)
            t0 = time.monotonic()
            replaced = 0
            stage: dict[int, tuple] = {}
            done_requests = 0
            last_log = t0
            try:
                while True:
                    now = time.monotonic()
                    elapsed = now - t0
                    if elapsed > max_seconds:
                        break
                    due = int(elapsed * rate) - replaced - len(stage)
                    free = [i for i in range(ips) if i not in stage]
                    for _ in range(max(0, min(due, len(free)))):
                        i = free.pop(rng.randrange(len(free)))
                        new_role = rng.randrange(roles)
                        new = c.add_pod("", role_names[new_role].decode(), namespace="bench",
                                        phase="Pending")
                        c.api.mark_pod_terminating("bench", names[i])
                        sh.want[i] = 0
                        stage[i] = ("stopping", new, new_role)
                    for i, st_ in list(stage.items()):
                        if st_[0] == "stopping" and sh.ack[i] == sh.gen[i]:
                            c.api.set_pod_phase("bench", names[i], "Failed")
                            sh.ended[i] = pub_end[names[i]] = time.perf_counter()
                            c.api.delete_pod("bench", names[i])
                            stage[i] = ("gap", st_[1], st_[2], time.monotonic() + gap)
                        elif st_[0] == "gap" and time.monotonic() >= st_[3]:
                            _, new, new_role, _ = st_
                            c.api.set_pod_ips("bench", new, [addrs[i]])
                            sh.claimed[i] = pub_ip[new] = time.perf_counter()
                            c.api.set_pod_phase("bench", new, "Running")
                            names[i] = new
                            sh.prev[i] = sh.role[i]
                            sh.role[i] = new_role
                            sh.gen[i] += 1
                            sh.want[i] = 1
                            del stage[i]
                            replaced += 1
                    if now - last_log > 5:
                        last_log = now
                        log(f"  churn: {elapsed:.0f} s, {replaced} replacements, "
                            f"{done_requests:,} requests")
                    done_requests = sum(sh.progress[j] for j in range(processes))
                    if done_requests >= requests and replaced >= min_replacements:
                        break
                    time.sleep(0.002)
            finally:
                sh.stop_all.value = 1
                results = [pp.recv() if pp.poll(30) else None for pp in pipes]
                seen = w_parent.recv() if w_parent.poll(10) else {"ended": {}, "claimed": {}}
                for p in (*procs, witness):
                    p.join(5)
            seconds = time.monotonic() - t0
            keymap = c.access_keys()
            sup = a.log_tail(4000)
    results = [r for r in results if r]
    tot = {k: sum(r["stats"][k] for r in results) for k in results[0]["stats"]}
    statuses: dict[int, int] = {}
    for r in results:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    wrong_doc = 0
    doc_samples = []
    for r in results:
        for (role, akid), n in r["keys"].items():
            if keymap.get(akid) != role_names[role].decode():
                wrong_doc += n
                doc_samples.append(f"document for {role_names[role].decode()} carried "
                                   f"{akid} (issued for {keymap.get(akid)}) x{n}")
            else:
                tot["ok"] += n
    lat = np.concatenate([np.frombuffer(r["lat"], dtype=np.uint32) for r in results])
    delivery = {
        "old pod's end": np.array([seen["ended"][n] - t for n, t in pub_end.items()
                                   if n in seen["ended"]]) * 1e3,
        "new pod's IP": np.array([seen["claimed"][n] - t for n, t in pub_ip.items()
                                  if n in seen["claimed"]]) * 1e3}
    fok = np.concatenate([np.frombuffer(r["first_ok"], dtype=np.float64) for r in results])
    return ChurnResult(
        idle_lag={"n": int(idle.size), "p50": float(np.median(idle)) if idle.size else float("nan"),
                  "max": float(idle.max()) if idle.size else float("nan")},
        first_ok={"n": int(fok.size), "p50": float(np.median(fok)) if fok.size else float("nan"),
                  "p99": float(np.percentile(fok, 99)) if fok.size else float("nan"),
                  "max": float(fok.max()) if fok.size else float("nan")},
        delivery={k: {"n": int(v.size), "p50": float(np.median(v)) if v.size else float("nan"),
                      "p99": float(np.percentile(v, 99)) if v.size else float("nan"),
                      "max": float(v.max()) if v.size else float("nan")}
                  for k, v in delivery.items()},
        mode="full agent" if agent == "kiamfast" else agent, ips=ips, roles=roles, rate=rate, gap=gap, seconds=seconds,
        replacements=replaced, requests=tot["requests"], ok=tot["ok"],
        wrong_prev=tot["wrong_prev"], wrong_other=tot["wrong_other"],
        wrong_document=wrong_doc, late=tot["late"], hung=tot["hung"], statuses=statuses,
        put_fail=tot["put_fail"], pods=tot["pods"], connect_fail=tot["connect_fail"],
        latencies_us=lat, wrong_lags=[x for r in results for x in r["wrong_lags"]],
        samples=[s for r in results for s in r["samples"]][:8] +
        doc_samples[:4], agent_restarts="exited with" in sup and sup[-600:] or "")


def _agent_under_test(c, agent: str):
    """kiamfast (API-only) or kube2iam for ``c``'s node, as a context manager."""
    import bench_agent as ba
    if agent == "kube2iam":
        tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
        sys.path[:0] = [os.path.join(tests, "kube2iam"), tests]
        from kube2iam_harness import Kube2iam
        return Kube2iam(c, c.workdir / "kube2iam", [f"--base-role-arn={ba.BASE_ARN}"])
    return ba.agent(c, sts_qps=100, sts_burst=100)


def markdown(r: ChurnResult) -> str:
    s = summarize_us(r.latencies_us)
    lines = [
        f"{r.ips} pod addresses, {r.roles} roles; {r.replacements:,} pods replaced in "
        f"{r.seconds:.0f} s ({r.replacements / r.seconds:.0f}/s, every address reused about "
        f"every {r.ips / max(r.replacements / r.seconds, 1e-9):.0f} s); gap between the old "
        f"pod's delete and the new pod's IP: {r.gap * 1e3:g} ms; {r.pods:,} pod clients.", "",
        "| credential requests | right role | **wrong role** | of which the previous pod's "
        "| not 200 | later than 1 s (SDK budget) | abandoned (> 3 s) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r.requests:,} | {r.ok:,} | **{r.wrong}** | {r.wrong_prev} | {r.not_served:,} | "
        f"{r.late} | {r.hung} |", "",
        "Answers by status: " + ", ".join(f"{k}: {v:,}" for k, v in sorted(r.statuses.items()))
        + f". Token PUTs failed: {r.put_fail}. Connections refused: {r.connect_fail}.", "",
        f"Latency of the credential requests: p50 {s['p50']:.3f} ms, p90 {s['p90']:.3f} ms, "
        f"p99 {s['p99']:.3f} ms, p99.9 {s['p999']:.3f} ms, max {s['max']:.1f} ms."]
    if r.wrong_lags:
        ends = [a for a, _ in r.wrong_lags if a == a]
        ips = [b for _, b in r.wrong_lags if b == b]
        lines += ["", ("Every wrong answer named the address's previous pod's role. "
                       if r.wrong == r.wrong_prev else "") + f"The wrong listings came at most "
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
    if r.samples:
        lines += ["", "Examples of wrong or failed answers:", ""] + [f"- `{x}`" for x in r.samples]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--gap", type=float, default=0.01)
    ap.add_argument("--agent", choices=["kiamfast", "kube2iam"], default="kiamfast")
    args = ap.parse_args(argv)
    n = args.requests or (50_000 if args.quick else 1_000_000)
    r = run(requests=n, rate=args.rate, gap=args.gap, agent=args.agent)
    print(markdown(r))
    return 1 if r.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
