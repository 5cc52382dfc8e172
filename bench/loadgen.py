"""The load driver of the benchmarks: the requests an SDK sends to the metadata service, and
the two ways load is generated from them, this module's own (many source addresses,
per-request latency, checked answers: :func:`run_load`) and wrk's (C, one source address,
saturating: :func:`run_wrk`). bench/agent_load.py, kube2iam_speed.py and
container_credentials.py measure with it; a change to how load is generated goes here.

Why not wrk: an agent identifies the calling pod by the TCP source address, so a fair load
comes from hundreds of addresses (each a pod with its own table entry), and wrk binds none.
This one runs ``processes`` forked uvloop processes; each owns some connection *slots*; a
slot keeps one keep-alive connection bound to a source address (127.0.x.y: Linux routes all
of 127/8 to lo, no root needed), sends one request at a time (as an SDK does, no
pipelining), and after ``per_conn`` requests reconnects from the next address assigned to
it. Every response is checked: status code, and body bytes compared with what that pod must
get. Latency is recorded for every response in microseconds (an ``array('I')`` per process,
handed back as a numpy array), from the moment the request was written, or, in a paced run
that fell behind, from the moment it was due (no coordinated omission).

Two modes: closed loop (``rate=0``: a slot sends its next request as soon as the answer is
in: throughput) and paced (``rate`` requests/s in total, each slot sending every
``slots / rate`` seconds: latency below saturation).

It must never be the bottleneck unnoticed: callers measure its ceiling against nginx and
report the server's CPU use; a server below ~90 % of a core while the load generator is
saturated means the figure is the load generator's, not the server's. wrk is the
cross-check: it saturates a server from one address.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from benchutil import cpu_seconds, set_affinity

# ---- the requests, as botocore sends them ----------------------------------------------------

CREDENTIALS = b"/latest/meta-data/iam/security-credentials/"
INSTANCE_ID = b"/latest/meta-data/instance-id"
TOKEN_PUT = (b"PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\n"
             b"User-Agent: Boto3/1.34 md/Botocore#1.34\r\nAccept-Encoding: identity\r\n"
             b"X-aws-ec2-metadata-token-ttl-seconds: 21600\r\nContent-Length: 0\r\n\r\n")


def metadata_get(path: bytes, token: bytes) -> bytes:
    """A GET of ``path`` with an IMDSv2 token."""
    return (b"GET %s HTTP/1.1\r\nHost: 169.254.169.254\r\n"
            b"User-Agent: Boto3/1.34 md/Botocore#1.34\r\nAccept-Encoding: identity\r\n"
            b"X-aws-ec2-metadata-token: %s\r\n\r\n" % (path, token))


def credentials_path(role: str) -> bytes:
    return CREDENTIALS + role.encode()


@dataclass(frozen=True)
class Spec:
    """What one pod sends and must get back."""
    source: str                 # source address of the connection (the pod's IP)
    request: bytes              # one complete HTTP/1.1 request
    status: int = 200           # expected status code
    body: bytes | None = None   # expected body; None: any body ...
    length: int | None = None   # ... of this many bytes (None: any)
    headers: tuple[bytes, ...] = ()   # header lines the answer must carry, as sent


@dataclass
class LoadResult:
    count: int = 0              # responses received while recording
    checked: int = 0            # responses checked (warm-up included)
    errors: int = 0             # wrong status or body (warm-up included), failed connections
    elapsed: float = 0.0        # seconds of the recording window
    latencies_us: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    bad: list[str] = field(default_factory=list)
    connects: int = 0
    client_cpu: float = 0.0     # CPU seconds the load processes used while recording

    @property
    def rps(self) -> float:
        return self.count / self.elapsed if self.elapsed else 0.0


_CL = b"content-length:"


def frame(buf: bytes) -> tuple[int, int]:
    """Where the first HTTP response in ``buf`` ends: (the end of its head, its end), or
    (-1, 0) while it is not all there. Every client here reads answers with it."""
    i = buf.find(b"\r\n\r\n")
    if i < 0:
        return -1, 0
    j = buf.find(b"Content-Length:", 0, i)
    if j < 0:
        j = buf.lower().find(_CL, 0, i)
    n = i + 4 + (int(buf[j + 15:buf.find(b"\r\n", j)]) if j >= 0 else 0)
    return (i, n) if len(buf) >= n else (-1, 0)


def _client_main(host: str, port: int, slots: list[list[Spec]], warmup: float,
                 duration: float, per_conn: int, interval: float, cpu: int | None,
                 conn) -> None:
    import asyncio

    import uvloop

    set_affinity([0], {cpu} if cpu is not None else None)
    perf_ns = time.perf_counter_ns
    lat = array("I")
    rec = lat.append
    st = {"count": 0, "errors": 0, "connects": 0, "checked": 0}
    bad: list[str] = []
    recording = [False]
    running = [True]

    class Client(asyncio.Protocol):
        __slots__ = ("spec", "done", "buf", "left", "t0", "transport", "loop", "timer",
                     "status_line", "body", "length", "headers", "request")

        def __init__(self, spec: Spec, done: asyncio.Future) -> None:
            self.spec = spec
            self.request = spec.request
            self.status_line = b"HTTP/1.1 %d " % spec.status
            self.body = spec.body
            self.length = spec.length
            self.headers = tuple(b"\r\n" + h + b"\r\n" for h in spec.headers)
            self.done = done
            self.buf = b""
            self.left = per_conn
            self.t0 = 0

        def connection_made(self, transport) -> None:
            self.transport = transport
            self.loop = asyncio.get_running_loop()
            self.t0 = perf_ns()
            transport.write(self.request)

        def _send_now(self) -> None:
            if not self.transport.is_closing():
                self.t0 = perf_ns()
                self.transport.write(self.request)

        def data_received(self, data: bytes) -> None:
            buf = self.buf + data if self.buf else data
            while True:
                i, n = frame(buf)
                if i < 0:
                    break
                t = perf_ns()
                ok = buf.startswith(self.status_line) and (
                    self.body is None or buf[i + 4:n] == self.body) and (
                    self.length is None or n - i - 4 == self.length) and all(
                    buf.find(h, 0, i + 2) >= 0 for h in self.headers)
                if recording[0]:
                    rec((t - self.t0) // 1000)
                    st["count"] += 1
                st["checked"] += 1
                if not ok:
                    st["errors"] += 1
                    if len(bad) < 3:
                        bad.append(bytes(buf[:min(n, 600)]).decode("latin-1"))
                buf = buf[n:]
                self.left -= 1
                if not running[0] or self.left <= 0:
                    self.transport.close()
                    break
                if interval:
                    due = self.t0 + interval_ns
                    if due <= t:
                        self.t0 = due  # behind schedule: count the wait as latency
                        self.transport.write(self.request)
                    else:
                        self.loop.call_later((due - t) / 1e9, self._send_now)
                else:
                    self.t0 = t
                    self.transport.write(self.request)
            self.buf = buf

        def connection_lost(self, exc) -> None:
            if not self.done.done():
                self.done.set_result(None)

    interval_ns = int(interval * 1e9)

    async def one_slot(mine: list[Spec], offset: float) -> None:
        loop = asyncio.get_running_loop()
        if offset:
            await asyncio.sleep(offset)  # paced: spread the slots over one interval
        k = 0
        while running[0]:
            spec = mine[k % len(mine)]
            k += 1
            done = loop.create_future()
            try:
                await loop.create_connection(lambda: Client(spec, done), host, port,
                                             local_addr=(spec.source, 0))
                st["connects"] += 1
            except OSError as e:
                st["errors"] += 1
                if len(bad) < 3:
                    bad.append(f"connect from {spec.source}: {e}")
                await asyncio.sleep(0.01)
                continue
            await done

    async def main() -> tuple[float, float]:
        n = len(slots)
        tasks = [asyncio.ensure_future(one_slot(m, interval * i / n if interval else 0.0))
                 for i, m in enumerate(slots)]
        await asyncio.sleep(warmup)
        recording[0] = True
        c0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.sleep(duration)
        recording[0] = False
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        running[0] = False
        await asyncio.wait(tasks, timeout=3)
        return elapsed, cpu

    elapsed, cpu = uvloop.run(main())
    conn.send({"count": st["count"], "errors": st["errors"], "connects": st["connects"],
               "checked": st["checked"],
               "bad": bad, "elapsed": elapsed, "cpu": cpu, "lat": lat.tobytes()})
    conn.close()


def run_load(port: int, specs: list[Spec], *, connections: int, processes: int = 1,
             duration: float = 3.0, warmup: float = 0.5, rate: float = 0.0,
             per_conn: int = 100, cpus: list[int] | None = None,
             host: str = "127.0.0.1", on_start=None) -> LoadResult:
    """Drive ``connections`` connection slots spread over ``processes`` processes.

    Slot ``i`` cycles over ``specs[i::connections]`` (so ``connections`` >= ``len(specs)``
    means one address per slot, never rotating). ``rate`` > 0 paces the load to that many
    requests/s in total. ``cpus``: pin load process ``j`` to ``cpus[j % len(cpus)]``.
    ``on_start`` is called when the recording window opens (to sample a server's CPU).
    """
    if connections < 1 or processes < 1 or not specs:
        raise ValueError("need at least one connection, one process and one spec")
    processes = min(processes, connections)
    slot_specs = [specs[i::connections] or [specs[i % len(specs)]] for i in range(connections)]
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    interval = connections / rate if rate else 0.0
    for j in range(processes):
        mine = slot_specs[j::processes]
        parent, child = ctx.Pipe(duplex=False)
        cpu = cpus[j % len(cpus)] if cpus else None
        p = ctx.Process(target=_client_main, args=(host, port, mine, warmup, duration,
                                                   per_conn, interval, cpu, child),
                        daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    if on_start is not None:
        time.sleep(warmup)
        on_start()
    results = []
    for pipe in pipes:
        try:
            results.append(pipe.recv())
        except EOFError:
            results.append({"count": 0, "errors": 1, "connects": 0, "checked": 0,
                            "bad": ["load process died"], "elapsed": 0.0, "cpu": 0.0,
                            "lat": b""})
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    lat = np.concatenate([np.frombuffer(r["lat"], dtype=np.uint32) for r in results]) \
        if results else np.zeros(0, np.uint32)
    return LoadResult(count=sum(r["count"] for r in results),
                      checked=sum(r["checked"] for r in results),
                      errors=sum(r["errors"] for r in results),
                      elapsed=max(r["elapsed"] for r in results),
                      latencies_us=lat,
                      bad=[b for r in results for b in r["bad"]][:5],
                      connects=sum(r["connects"] for r in results),
                      client_cpu=sum(r["cpu"] for r in results))


# ---- wrk (C, one source address): the saturation check ---------------------------------------

WRK_GET = """wrk.method = "GET"
wrk.path = "{path}"
wrk.headers["X-aws-ec2-metadata-token"] = "{token}"
wrk.headers["User-Agent"] = "bench"
"""
WRK_PUT = """wrk.method = "PUT"
wrk.path = "/latest/api/token"
wrk.headers["X-aws-ec2-metadata-token-ttl-seconds"] = "21600"
wrk.headers["User-Agent"] = "bench"
"""


def _wrk_ms(text: str) -> float:
    """wrk's latency text ("804.00us", "1.21ms", "2.00s") in milliseconds."""
    for suffix, scale in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * scale
    return float(text)


def _children_cpu() -> float:
    """CPU seconds of the children this process has waited for (wrk, once it is done)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_wrk(port: int, script: str, *, connections: int, duration: float, cpus: list[int] | None,
            tmp: str, server_pid: int | None = None, server_pids: list[int] = (),
            host: str = "127.0.0.1", argv_prefix: list[str] | None = None) -> dict:
    """wrk -t1 against host:port (run under ``argv_prefix``: in a pod's network namespace);
    req/s, p50/p99 and the server's CPU per request (all of ``server_pids``)."""
    pids = [server_pid] if server_pid is not None else list(server_pids)
    path = os.path.join(tmp, f"wrk-{abs(hash(script))}.lua")
    with open(path, "w") as f:
        f.write(script)
    cmd = [*(argv_prefix or ()), "wrk", "-t1", f"-c{connections}",
           f"-d{max(1, round(duration))}s", "--latency", "-s", path, f"http://{host}:{port}/"]
    cpu0 = sum(cpu_seconds(p) for p in pids)
    child0 = _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30,
                          preexec_fn=(lambda: os.sched_setaffinity(0, set(cpus))) if cpus
                          else None)
    cpu1 = sum(cpu_seconds(p) for p in pids)
    out_client = (_children_cpu() - child0) / max(1, round(duration))
    out = {"rps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan"), "non2xx": 0,
           "errors": 0, "timeouts": 0}
    total = 0
    for line in proc.stdout.splitlines():
        parts = line.split()
        if line.startswith("Requests/sec:"):
            out["rps"] = float(parts[1])
        elif parts[:1] == ["50%"]:
            out["p50_ms"] = _wrk_ms(parts[1])
        elif parts[:1] == ["99%"]:
            out["p99_ms"] = _wrk_ms(parts[1])
        elif "requests in" in line:
            total = int(parts[0])
        elif line.strip().startswith("Non-2xx"):
            out["non2xx"] = int(parts[-1])
        elif line.strip().startswith("Socket errors"):
            out["errors"] = sum(int(x.strip(",")) for x in parts[3::2])
            out["timeouts"] = int(parts[-1])   # "... write 0, timeout N"
    out["cpu_us_per_req"] = (cpu1 - cpu0) / total * 1e6 if total else float("nan")
    out["requests"] = total
    out["client_util"] = out_client
    return out
