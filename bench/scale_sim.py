"""Scale, simulated: what a cluster of agents costs the API server, STS and the node.

Four questions, each answered against a baseline computed in the same run:

1. **Watch fan-out** (no agent needed): 100 nodes x 110 pods in the API emulator. Every
   agent lists and then watches pods while pods are replaced (delete, create Pending, IP +
   Running: three events each). Per agent, count the events and bytes received with the
   per-node watch (``fieldSelector=spec.nodeName=<node>``, kiamfast and kube2iam with
   ``--node``) and with a cluster-wide watch (kube2iam without ``--node``). All 100 per-node
   watches are real; cluster-wide watches all receive the same stream, so a sample of them
   is opened and checked to agree, and the cluster total is the sample's per-agent figure
   times the node count.
2. **STS calls per hour** for 1,000 nodes x 40 roles: the real credential manager on one
   node's pod events in simulated time (``bench/prefetch.py``'s churn simulation, moto
   behind the fault proxy counting calls) for kiamfast's session policies, against kube2iam
   0.15's policy (a 15 min cache per role per node, misses filled when a pod asks) on the
   same events; nodes are independent under both, so a node's rate times 1,000.
3. **Control-process CPU per 1,000 events** (full agent): the agent's control process
   while its node's pods are replaced, against a bare watch client (raw stream + orjson per
   line, nothing else: the floor for any Python watcher) reading the same events.
4. **RSS of worker and control** at 110 and 250 pods (full agent), against bare
   interpreters that import the same stacks (uvloop + httptools; kubernetes + botocore).

``python bench/scale_sim.py [--quick]`` prints the tables; ``bench/run`` puts them in the
report.
"""

from __future__ import annotations

import argparse
import json
import random
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from benchutil import child_env, cpu_seconds, python, rss_bytes

# ---- 1. watch fan-out ------------------------------------------------------------------------


class _Stream:
    """One raw watch (or list) connection: counts bytes and de-chunks event lines."""

    __slots__ = ("sock", "bytes", "events", "bookmarks", "buf", "head_done", "chunk_left",
                 "line", "closed", "types")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.bytes = 0
        self.events = 0
        self.bookmarks = 0
        self.buf = b""
        self.head_done = False
        self.chunk_left = -1     # -1: expecting a chunk-size line
        self.line = b""
        self.closed = False
        self.types: dict[str, int] = {}

    def feed(self, data: bytes) -> None:
        self.bytes += len(data)
        buf = self.buf + data
        if not self.head_done:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                self.buf = buf
                return
            buf = buf[i + 4:]
            self.head_done = True
        while buf:
            if self.chunk_left < 0:
                i = buf.find(b"\r\n")
                if i < 0:
                    break
                self.chunk_left = int(buf[:i].split(b";")[0], 16)
                buf = buf[i + 2:]
                if self.chunk_left == 0:
                    self.closed = True
                    buf = b""
                    break
            take = buf[:self.chunk_left]
            self._data(take)
            self.chunk_left -= len(take)
            buf = buf[len(take):]
            if self.chunk_left == 0:
                if len(buf) < 2:
                    self.chunk_left = 0
                    break
                buf = buf[2:]
                self.chunk_left = -1
        self.buf = buf

    def _data(self, data: bytes) -> None:
        line = self.line + data
        while True:
            i = line.find(b"\n")
            if i < 0:
                break
            one, line = line[:i], line[i + 1:]
            j = one.find(b'"type":"')
            kind = one[j + 8:one.find(b'"', j + 8)].decode() if j >= 0 else "?"
            if kind == "BOOKMARK":
                self.bookmarks += 1
            else:
                self.events += 1
                self.types[kind] = self.types.get(kind, 0) + 1
        self.line = line


class WatchReaders:
    """Many raw watch connections read by one thread (selectors), counting per stream."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.token = token
        self.sel = selectors.DefaultSelector()
        self.streams: list[_Stream] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="watch-readers")
        self._lock = threading.Lock()

    def open(self, path: str) -> _Stream:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                     f"{self.token}\r\nAccept: application/json\r\n\r\n".encode())
        sock.setblocking(False)
        s = _Stream(sock)
        with self._lock:
            self.streams.append(s)
            self.sel.register(sock, selectors.EVENT_READ, s)
        return s

    def start(self) -> "WatchReaders":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                ready = self.sel.select(timeout=0.05) if self.streams else []
            if not ready:
                time.sleep(0.005) if not self.streams else None
            for key, _ in ready:
                s: _Stream = key.data
                try:
                    data = s.sock.recv(1 << 18)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    with self._lock:
                        self.sel.unregister(s.sock)
                    s.closed = True
                    continue
                s.feed(data)

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        for s in self.streams:
            try:
                s.sock.close()
            except OSError:
                pass


def _http_get_bytes(port: int, token: str, path: str) -> tuple[int, bytes]:
    """A plain GET; (bytes on the wire, body)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                     f"{token}\r\nAccept: application/json\r\nConnection: close\r\n\r\n"
                     .encode())
        parts = []
        while chunk := sock.recv(1 << 20):
            parts.append(chunk)
    raw = b"".join(parts)
    return len(raw), raw.partition(b"\r\n\r\n")[2]


@dataclass
class FanoutResult:
    nodes: int
    pods_per_node: int
    replacements: int
    cluster_events: int
    node_list_bytes: float           # per agent, mean
    node_events: float               # per agent, mean
    node_bytes: float
    wide_list_bytes: float
    wide_events: float
    wide_bytes: float
    wide_sample: int
    wide_agree: bool
    node_events_total: int
    seconds: float
    extra: dict = field(default_factory=dict)


def watch_fanout(*, nodes: int = 100, pods_per_node: int = 110, replace_fraction: float = 0.3,
                 wide_sample: int = 4, seed: int = 11) -> FanoutResult:
    """See the module docstring, question 1."""
    from kiamfast.testing.apiserver import ApiServer

    rng = random.Random(seed)
    t_start = time.monotonic()
    token = "scale-token"
    with ApiServer(token=token, history_window=1_000_000, bookmark_interval=3600) as api:
        names = [f"node-{i:04d}" for i in range(nodes)]
        for n in names:
            api.nodes.add(n)
        live: dict[str, list[tuple[str, str]]] = {n: [] for n in names}  # node -> (pod, ip)
        seq = 0
        for ni, n in enumerate(names):
            for j in range(pods_per_node):
                seq += 1
                ip = f"10.{ni // 200}.{ni % 200}.{j + 1}"
                name = f"app-{seq}"
                api.pods.create("default", name, node=n, ips=[ip], phase="Running",
                                annotations={"iam.amazonaws.com/role": f"role-{seq % 40}"})
                live[n].append((name, ip))
        # Initial lists: what an agent downloads at start (and on every relist).
        node_list = []
        for n in names:
            size, body = _http_get_bytes(api.port, token,
                                         f"/api/v1/pods?fieldSelector=spec.nodeName%3D{n}")
            node_list.append(size)
        wide_list = []
        for _ in range(wide_sample):
            size, body = _http_get_bytes(api.port, token, "/api/v1/pods")
            wide_list.append(size)
        rv = json.loads(body)["metadata"]["resourceVersion"]
        readers = WatchReaders(api.port, token).start()
        node_streams = [readers.open(f"/api/v1/pods?watch=1&resourceVersion={rv}&"
                                     f"allowWatchBookmarks=true&fieldSelector=spec.nodeName"
                                     f"%3D{n}") for n in names]
        wide_streams = [readers.open(f"/api/v1/pods?watch=1&resourceVersion={rv}&"
                                     "allowWatchBookmarks=true") for _ in range(wide_sample)]
        if not api.traffic.wait_watches(nodes + wide_sample, timeout=30):
            raise RuntimeError("watches did not open")
        api.traffic.reset()
        # Churn: replace pods (the new pod reuses the old one's IP, as CNIs do).
        replacements = int(nodes * pods_per_node * replace_fraction)
        for _ in range(replacements):
            n = names[rng.randrange(nodes)]
            k = rng.randrange(len(live[n]))
            old, ip = live[n][k]
            api.pods.delete("default", old)
            seq += 1
            new = f"app-{seq}"
            api.pods.create("default", new, node=n, phase="Pending",
                            annotations={"iam.amazonaws.com/role": f"role-{seq % 40}"})
            api.pods.set_ips("default", new, [ip])
            api.pods.set_phase("default", new, "Running")
            live[n][k] = (new, ip)
        cluster_events = replacements * 4  # DELETED, ADDED, MODIFIED (IP), MODIFIED (phase)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got_node = sum(s.events for s in node_streams)
            got_wide = [s.events for s in wide_streams]
            if got_node >= cluster_events and all(g >= cluster_events for g in got_wide):
                break
            time.sleep(0.05)
        readers.close()
        node_ev = [s.events for s in node_streams]
        wide_ev = [s.events for s in wide_streams]
        return FanoutResult(
            nodes=nodes, pods_per_node=pods_per_node, replacements=replacements,
            cluster_events=cluster_events,
            node_list_bytes=sum(node_list) / nodes,
            node_events=sum(node_ev) / nodes,
            node_bytes=sum(s.bytes for s in node_streams) / nodes,
            wide_list_bytes=sum(wide_list) / wide_sample,
            wide_events=sum(wide_ev) / wide_sample,
            wide_bytes=sum(s.bytes for s in wide_streams) / wide_sample,
            wide_sample=wide_sample,
            wide_agree=len(set(wide_ev)) == 1 and wide_ev[0] == cluster_events,
            node_events_total=sum(node_ev),
            seconds=time.monotonic() - t_start,
            extra={"node_events_min": min(node_ev), "node_events_max": max(node_ev),
                   "emulator": api.traffic.stats()})


# ---- 2. STS calls per hour -------------------------------------------------------------------

@dataclass
class StsRateResult:
    nodes: int
    roles: int
    pods: int
    hours: float
    pod_starts: int
    roles_used: int
    kube2iam_per_node_hour: float
    kiamfast_per_node_hour: dict[str, float]
    served_short: dict[str, int]
    kube2iam_steady_formula: float   # calls / role / node / hour, analytic
    seconds: float


def sts_calls_per_hour(*, nodes: int = 1000, roles: int = 40, pods: int = 110,
                       hours: float = 6.0, mean_life: float = 3600.0,
                       policies: tuple[str, ...] = ("node-role", "pod"),
                       step: float = 60.0) -> StsRateResult:
    """See the module docstring, question 2 (reuses bench/prefetch.py's simulation)."""
    import prefetch as pf

    t0 = time.monotonic()
    events = pf.churn_events(roles=roles, pods=pods, hours=hours, mean_life=mean_life)
    k2i = pf.kube2iam_calls(events, hours=hours) / hours
    ours, short = {}, {}
    for policy in policies:
        out = pf.churn(events, hours=hours, policy=policy, step=step)
        ours[policy] = out["per_hour"]
        short[policy] = out["served_short"]
    return StsRateResult(
        nodes=nodes, roles=roles, pods=pods, hours=hours,
        pod_starts=sum(1 for e in events if e[1] == "start"),
        roles_used=len({e[3] for e in events}),
        kube2iam_per_node_hour=k2i, kiamfast_per_node_hour=ours, served_short=short,
        kube2iam_steady_formula=3600 / 900, seconds=time.monotonic() - t0)


# ---- 3 + 4. the agent's footprint ------------------------------------------------------------

_FLOOR_WORKER = "import asyncio, uvloop, httptools; import sys; sys.stdout.write('up\\n'); " \
    "sys.stdout.flush(); sys.stdin.read()"
_FLOOR_CONTROL = "import kubernetes, botocore.session, orjson, prometheus_client; " \
    "import sys; sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.read()"


def floor_rss() -> dict[str, int]:
    """RSS of bare interpreters importing the worker's and the control process' stacks."""
    out = {}
    for name, code in (("python", "import sys; sys.stdout.write('up\\n'); sys.stdout.flush(); "
                        "sys.stdin.read()"),
                       ("worker floor (uvloop, httptools)", _FLOOR_WORKER),
                       ("control floor (kubernetes, botocore, orjson, prometheus)",
                        _FLOOR_CONTROL)):
        p = subprocess.Popen([python(), "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=child_env())
        try:
            p.stdout.readline()
            out[name] = rss_bytes(p.pid)
        finally:
            p.stdin.close()
            p.wait(5)
    return out


@dataclass
class FootprintResult:
    pods: int
    rss: dict[str, int]              # role -> bytes (summed over processes of that role)
    control_cpu_per_1k: float        # CPU seconds per 1,000 of the node's events
    floor_cpu_per_1k: float          # bare watch client + orjson on the same events
    events: int
    processed: bool                  # the agent's view matched the API at the end
    ready_s: float


def agent_footprint(pods: int, *, roles: int = 40, events: int = 3000,
                    bare_floor: bool = True) -> FootprintResult:
    """Start the agent with ``pods`` pods; RSS when ready; control CPU per 1,000 events."""
    import multiprocessing as mp

    import bench_agent as ba
    from benchutil import pod_addresses

    with ba.cluster() as c:
        ips = pod_addresses(pods)
        for i, ip in enumerate(ips):
            c.add_pod(ip, ba.role_name(i % roles))
        with ba.agent(c, sts_qps=200, sts_burst=200) as a:
            ready = a.wait_ready(120)
            time.sleep(1.0)
            procs = a.processes()
            rss = {"supervisor": rss_bytes(a.pid),
                   "control": sum(rss_bytes(p) for p in procs["control"]),
                   "worker": sum(rss_bytes(p) for p in procs["worker"])}
            control = procs["control"][0]
            rv = c.api.resource_version
            # Floor: a bare client on the same watch, in its own process.
            ctx = mp.get_context("fork")
            parent, child = ctx.Pipe(duplex=False)
            floor_proc = ctx.Process(target=_bare_watch_parse,
                                     args=(c.api.port, "bench-token", c.node, rv, events,
                                           child), daemon=True)
            floor_proc.start()
            c.api.traffic.wait_watches(2, node=c.node, timeout=10)
            time.sleep(0.3)
            cpu0 = cpu_seconds(control)
            n = _drive_events(c, ips, roles=roles, events=events)
            processed = _wait_agent_view(c, a, ips, timeout=60)
            cpu1 = cpu_seconds(control)
            floor = parent.recv() if parent.poll(30) else {"cpu": float("nan"), "events": 0}
            floor_proc.join(5)
            per_1k = (cpu1 - cpu0) / n * 1000
            floor_per_1k = floor["cpu"] / max(1, floor["events"]) * 1000
            return FootprintResult(pods=pods, rss=rss, control_cpu_per_1k=per_1k,
                                   floor_cpu_per_1k=floor_per_1k, events=n,
                                   processed=processed, ready_s=ready)


class _ParsingStream(_Stream):
    """A stream that also parses every event line with orjson, as any watcher must."""

    __slots__ = ("pending",)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.pending = b""

    def _data(self, data: bytes) -> None:
        import orjson
        super()._data(data)
        *whole, self.pending = (self.pending + data).split(b"\n")
        for line in whole:
            orjson.loads(line)


def _bare_watch_parse(port: int, token: str, node: str, rv: str, expect: int, out) -> None:
    """Child process: read the node's watch raw and orjson.loads every event line."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"GET /api/v1/pods?watch=1&resourceVersion={rv}&fieldSelector=spec.nodeName"
                 f"%3D{node} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
                 .encode())
    sock.settimeout(60)
    s = _ParsingStream(sock)
    cpu = 0.0
    try:
        while s.events < expect:
            data = sock.recv(1 << 16)
            if not data:
                break
            c0 = time.process_time()
            s.feed(data)
            cpu += time.process_time() - c0
    except OSError:
        pass
    out.send({"cpu": cpu, "events": s.events})
    sock.close()


def _drive_events(c, ips: list[str], *, roles: int, events: int) -> int:
    """Replace pods on the agent's node (4 events each, IP reused); events generated."""
    rng = random.Random(5)
    n = 0
    while n < events:
        ip = ips[rng.randrange(len(ips))]
        old, _ = c.pods[ip]
        c.api.pods.delete("bench", old)
        role = f"bench-role-{rng.randrange(roles)}"
        name = c.add_pod("", role, phase="Pending")
        c.api.pods.set_ips("bench", name, [ip])
        c.api.pods.set_phase("bench", name, "Running")
        c.pods[ip] = (name, role)
        n += 4
    return n


def _wait_agent_view(c, a, ips: list[str], *, timeout: float) -> bool:
    """Until every pod IP's listing names the pod's current role (the agent caught up)."""
    deadline = time.monotonic() + timeout
    pending = list(ips)
    while pending and time.monotonic() < deadline:
        still = []
        for ip in pending:
            want = c.pods[ip][1].encode()
            try:
                conn = socket.create_connection(("127.0.0.1", a.port), source_address=(ip, 0),
                                                timeout=2)
                conn.sendall(b"GET /latest/meta-data/iam/security-credentials/ HTTP/1.1\r\n"
                             b"Host: x\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                conn.close()
            except OSError:
                still.append(ip)
                continue
            if not data.startswith(b"HTTP/1.1 200") or data.partition(b"\r\n\r\n")[2] != want:
                still.append(ip)
        pending = still
        if pending:
            time.sleep(0.05)
    return not pending


# ---- command line ----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        r = watch_fanout(nodes=20, pods_per_node=110, replace_fraction=0.1, wide_sample=2)
    else:
        r = watch_fanout()
    print(json.dumps(r.__dict__, indent=2, default=str))
    s = sts_calls_per_hour(hours=1.0 if args.quick else 6.0, step=120 if args.quick else 60)
    print(json.dumps(s.__dict__, indent=2, default=str))
    print(json.dumps(floor_rss(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
