"""A load generator for metadata servers: many source addresses, per-request latency, checked
answers.

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
saturated means the figure is the load generator's, not the server's.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from benchutil import set_affinity


@dataclass(frozen=True)
class Spec:
    """What one pod sends and must get back."""
    source: str                 # source address of the connection (the pod's IP)
    request: bytes              # one complete HTTP/1.1 request
    status: int = 200           # expected status code
    body: bytes | None = None   # expected body; None: any body


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
                     "status_line", "body", "request")

        def __init__(self, spec: Spec, done: asyncio.Future) -> None:
            self.spec = spec
            self.request = spec.request
            self.status_line = b"HTTP/1.1 %d " % spec.status
            self.body = spec.body
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
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    break
                j = buf.find(b"Content-Length:", 0, i)
                if j < 0:
                    j = buf.lower().find(_CL, 0, i)
                if j < 0:
                    n = i + 4
                else:
                    k = buf.find(b"\r\n", j)
                    n = i + 4 + int(buf[j + 15:k])
                if len(buf) < n:
                    break
                t = perf_ns()
                ok = buf.startswith(self.status_line) and (
                    self.body is None or buf[i + 4:n] == self.body)
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
