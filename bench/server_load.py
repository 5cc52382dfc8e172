"""Load benchmark of the metadata server worker against a no-work baseline, same run.

What it measures: the cached credential GET (with an IMDSv2 token, as botocore sends it)
and the token PUT, at 64 concurrent keep-alive connections whose source addresses rotate
over 256 loopback "pod" addresses (127.0.x.y, each with its own table entry and token),
against one kiamfast worker process; and the same load against bench/baseline_server.py,
a uvloop + httptools server answering fixed bytes with no routing and no lookup. Reported:
requests/s, the ratio to the baseline, client-side p50/p99 latency, and the server's CPU
time per request (from /proc), which stays meaningful when the load generator, not the
server, is the bottleneck (two cores shared by server and client).

The load generator is this file (wrk cannot bind many source addresses): one or more
processes, each a uvloop client running closed-loop connections, one request in flight per
connection, every response checked for status and length and every 16th compared in full.

    python bench/server_load.py [--duration 5] [--connections 64] [--pods 256]

prints a markdown table. ``bench/test_server_load.py`` (collected by pytest) runs a short
version that asserts only correctness (every response 200 with the right bytes); timings
are never asserted (machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TTL_PREFIX = b"X-Aws-Ec2-Metadata-Token-Ttl-Seconds:"
TOKEN_KEY = b"bench-token-key-0123456789abcdef"
ROLES = 16


def pod_addresses(n: int) -> list[str]:
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def cpu_seconds(pid: int) -> float:
    from benchutil import cpu_seconds as precise   # ns, not /proc's 10 ms ticks
    return precise(pid)


# ---- the table the worker serves --------------------------------------------------------------

def build_table(path: str, pods: list[str]) -> dict[str, bytes]:
    """Fill a table for `pods` (ROLES roles round-robin); the document each pod must get."""
    from kiamfast import table
    from kiamfast.control.iam import render

    t = table.Table.create(path, ip_capacity=4096, cred_capacity=64, value_size=16384,
                           aux_count=4, aux_size=1 << 16, max_workers=8)
    now = time.time()
    docs = []
    for r in range(ROLES):
        parts = render.render_credentials(
            role_arn=f"arn:aws:iam::123456789012:role/bench-role-{r}",
            access_key_id=f"ASIABENCH{r:011d}", secret_access_key="s" * 40,
            session_token="FwoGZXIvYXdzE" + "x" * 600, expiration=now + 3600,
            last_updated=now)
        t.write_cred(r, parts, serve_until=now + 3000)
        docs.append(parts[table.PART_DOCUMENT])
    expected = {}
    for i, ip in enumerate(pods):
        t.claim_ip(ip, f"pod-{i}", table.POD_ROLE, i % ROLES)
        expected[ip] = docs[i % ROLES]
    t.set_status(synced=True, ready=True)
    t.close()
    return expected


def role_of(i: int) -> str:
    return f"bench-role-{i % ROLES}"


# ---- servers ----------------------------------------------------------------------------------

def start_worker(table_path: str, port: int) -> subprocess.Popen:
    from kiamfast.server.settings import WorkerSettings

    settings = WorkerSettings(app_port=port, metadata_addr="127.0.0.1:9", token_key=TOKEN_KEY)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiamfast.server.worker", "--table", table_path,
         "--settings-json", settings.to_json(), "--log-level", "warning"], env=env)
    wait_port(port, proc)
    return proc


def start_baseline(port: int, response: bytes, tmp: str) -> subprocess.Popen:
    resp_file = os.path.join(tmp, "baseline-response.bin")
    with open(resp_file, "wb") as f:
        f.write(response)
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "baseline_server.py"),
                             "--port", str(port), "--response-file", resp_file])
    wait_port(port, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- the load generator -----------------------------------------------------------------------

def get_request(role: str, token: bytes) -> bytes:
    return (b"GET /latest/meta-data/iam/security-credentials/%s HTTP/1.1\r\n"
            b"Host: 169.254.169.254\r\nUser-Agent: bench\r\nAccept-Encoding: identity\r\n"
            b"X-aws-ec2-metadata-token: %s\r\n\r\n" % (role.encode(), token))


PUT_REQUEST = (b"PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\n"
               b"User-Agent: bench\r\nAccept-Encoding: identity\r\nContent-Length: 0\r\n"
               b"X-aws-ec2-metadata-token-ttl-seconds: 21600\r\n\r\n")


def strip_ttl(resp: bytes) -> bytes:
    return b"\r\n".join(line for line in resp.split(b"\r\n") if not line.startswith(TTL_PREFIX))


def check(kind: str, resp: bytes, expected: bytes | None) -> bool:
    if kind == "put":
        head, _, body = resp.partition(b"\r\n\r\n")
        return (head.startswith(b"HTTP/1.1 200 ") and b"\r\n" + TTL_PREFIX + b" 21600" in head
                and len(body) == 44 and b"Server: EC2ws" in head)
    assert expected is not None
    return strip_ttl(resp) == expected


def fetch_token(ip: str, port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), source_address=(ip, 0)) as s:
        s.sendall(PUT_REQUEST.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.partition(b"\r\n\r\n")[2]


def client_main(port: int, specs: list[tuple[str, bytes, bytes | None]], slots: int, kind: str,
                warmup: float, duration: float, per_conn: int, full_check_every: int,
                interval: float, cpu: int | None, conn: mp.connection.Connection) -> None:
    """One load-generator process: `slots` connections (uvloop), closed loop when
    `interval` is 0, else each connection sends one request every `interval` seconds."""
    import asyncio

    import uvloop

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    stats = {"count": 0, "errors": 0, "bad": []}
    latencies: list[float] = []
    perf = time.perf_counter

    class Client(asyncio.Protocol):
        def __init__(self, request: bytes, expected: bytes | None, done: asyncio.Future):
            self.request = request
            self.expected = expected
            self.done = done
            self.buf = bytearray()
            self.left = per_conn
            self.t0 = 0.0
            self.n = 0

        def connection_made(self, transport):
            self.transport = transport
            self.loop = asyncio.get_running_loop()
            self.send()

        def send(self):
            self.t0 = perf()
            self.transport.write(self.request)

        def send_paced(self):
            # The next request is due `interval` after the previous one was sent. libuv
            # timers have 1 ms granularity, so latency runs from the actual send.
            due = self.t0 + interval
            now = perf()
            if due <= now:
                self.send()
            else:
                self.loop.call_later(due - now, self._send_later)

        def _send_later(self):
            if not self.transport.is_closing():
                self.send()

        def data_received(self, data):
            buf = self.buf
            buf += data
            while True:
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    return
                j = buf.find(b"Content-Length: ", 0, i)
                k = buf.find(b"\r\n", j)
                n = i + 4 + int(buf[j + 16:k])
                if len(buf) < n:
                    return
                resp = bytes(buf[:n])
                del buf[:n]
                t = perf()
                if recording[0]:
                    latencies.append(t - self.t0)
                    stats["count"] += 1
                self.n += 1
                ok = resp.startswith(b"HTTP/1.1 200 ")
                if ok and self.n % full_check_every == 0:
                    ok = check(kind, resp, self.expected)
                if not ok:
                    stats["errors"] += 1
                    if len(stats["bad"]) < 3:
                        stats["bad"].append(resp[:400].decode("latin-1"))
                self.left -= 1
                if running[0] and self.left > 0:
                    if interval:
                        self.send_paced()
                    else:
                        self.send()
                else:
                    self.transport.close()

        def connection_lost(self, exc):
            if not self.done.done():
                self.done.set_result(None)

    running = [True]
    recording = [False]

    async def one_slot(index: int):
        # Rotate this connection slot over the addresses assigned to it.
        mine = specs[index::slots]
        k = 0
        loop = asyncio.get_running_loop()
        while running[0]:
            ip, request, expected = mine[k % len(mine)]
            k += 1
            done = loop.create_future()
            try:
                await loop.create_connection(lambda: Client(request, expected, done),
                                             "127.0.0.1", port, local_addr=(ip, 0))
            except OSError:
                stats["errors"] += 1
                await asyncio.sleep(0.01)
                continue
            await done

    async def main():
        tasks = [asyncio.ensure_future(one_slot(i)) for i in range(slots)]
        await asyncio.sleep(warmup)
        recording[0] = True
        t0 = perf()
        await asyncio.sleep(duration)
        recording[0] = False
        elapsed = perf() - t0
        running[0] = False
        await asyncio.wait(tasks, timeout=5)
        return elapsed

    elapsed = uvloop.run(main())
    conn.send({"count": stats["count"], "errors": stats["errors"], "bad": stats["bad"],
               "elapsed": elapsed, "latencies": latencies})


def run_load(port: int, specs: list[tuple[str, bytes, bytes | None]], *, kind: str,
             connections: int, processes: int, warmup: float, duration: float,
             per_conn: int, full_check_every: int, server_pid: int, rate: float = 0.0,
             client_cpus: list[int] | None = None) -> dict:
    """Drive `connections` connections over `specs` from `processes` processes: closed loop,
    or `rate` requests/s in total when given."""
    ctx = mp.get_context("fork")
    per_proc = [connections // processes + (1 if i < connections % processes else 0)
                for i in range(processes)]
    pipes, procs = [], []
    offset = 0
    for i, slots in enumerate(per_proc):
        mine = [s for j, s in enumerate(specs) if j % connections in range(offset, offset + slots)]
        offset += slots
        parent, child = ctx.Pipe(duplex=False)
        interval = connections / rate if rate else 0.0
        cpu = client_cpus[i % len(client_cpus)] if client_cpus else None
        p = ctx.Process(target=client_main, args=(port, mine, slots, kind, warmup, duration,
                                                  per_conn, full_check_every, interval, cpu,
                                                  child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    time.sleep(warmup)
    cpu0 = cpu_seconds(server_pid)
    results = [p.recv() for p in pipes]
    cpu1 = cpu_seconds(server_pid)
    for p in procs:
        p.join()
    count = sum(r["count"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    lat = sorted(x for r in results for x in r["latencies"])
    q = statistics.quantiles(lat, n=100) if len(lat) >= 100 else [float("nan")] * 99
    return {
        "rps": count / elapsed if elapsed else 0.0,
        "count": count,
        "errors": sum(r["errors"] for r in results),
        "bad": [b for r in results for b in r["bad"]],
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "cpu_us_per_req": (cpu1 - cpu0) / count * 1e6 if count else float("nan"),
    }


# ---- the benchmark ----------------------------------------------------------------------------

# ---- wrk (C load generator, one source address): the saturation check ----------------------

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


def _children_cpu() -> float:
    """CPU seconds of the children this process has waited for (wrk, once it is done)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ---- callgrind: user-space instructions per request, deterministic --------------------------

class _NullTransport:
    """Stands in for the socket: the same cost for both servers."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def get_extra_info(self, name: str):
        return (self.peer, 40000, 0, 0) if name == "peername" else None

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _instruction_loop(scenario: str, n: int, table_path: str) -> None:
    """Feed `n` requests straight into one protocol instance (run under callgrind)."""
    import asyncio

    from kiamfast import table
    from kiamfast._server import Core
    from kiamfast.server.settings import WorkerSettings

    from baseline_server import FixedResponseProtocol

    t = table.Table.attach(table_path)
    ip = "::ffff:127.0.1.1"
    if scenario == "baseline":
        proto = FixedResponseProtocol(b"x" * 1300)
        request = get_request(role_of(0), b"x" * 44)
    else:
        core = Core(WorkerSettings(token_key=TOKEN_KEY, metadata_addr="127.0.0.1:9"), t,
                    loop=asyncio.new_event_loop())
        proto = core.protocol()
        from kiamfast.server.tokens import TokenSigner
        token = TokenSigner(TOKEN_KEY).issue(table.ip_key(ip), 21600, int(time.time()))
        request = get_request(role_of(0), token) if scenario == "get" else PUT_REQUEST
    proto.connection_made(_NullTransport(ip))
    feed = proto.data_received
    for _ in range(n):
        feed(request)


def run_callgrind(table_path: str) -> dict[str, float] | None:
    """Instructions per request of each scenario's user-space path (None without valgrind)."""
    if not shutil.which("valgrind"):
        return None
    py = os.path.realpath(sys.executable)
    counts: dict[str, float] = {}
    for scenario in SCENARIOS:
        totals = []
        for n in (1000, 6000):
            proc = subprocess.run(
                ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", py,
                 __file__, "--instructions-loop", scenario, str(n), table_path],
                capture_output=True, text=True, timeout=600,
                env=dict(os.environ, PYTHONPATH=str(ROOT)))
            found = [line for line in proc.stderr.splitlines() if "Collected :" in line]
            if proc.returncode != 0 or not found:
                return None
            totals.append(int(found[-1].rsplit(":", 1)[1]))
        counts[scenario] = (totals[1] - totals[0]) / 5000
    return counts


@dataclass
class Options:
    duration: float = 5.0
    warmup: float = 1.0
    connections: int = 64
    pods: int = 256
    processes: int = 1
    rounds: int = 3
    per_conn: int = 200
    full_check_every: int = 16
    rate: float = 5000.0  # paced run (latency below saturation); 0 skips it
    pin: bool = False  # server on CPU 0, load generator on the others
    wrk: bool = True  # also saturate with wrk (one source address) when it is installed
    callgrind: bool = True  # also count user-space instructions per request with valgrind


SCENARIOS = ("baseline", "get", "put")
NAMES = {"baseline": "baseline (fixed bytes, no work)",
         "get": "kiamfast credential GET (with token)", "put": "kiamfast token PUT"}


def run_benchmark(opts: Options) -> dict[str, dict]:
    """Rounds of [baseline, get, put] closed-loop runs, then one paced run of each."""
    pods = pod_addresses(opts.pods)
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = {cpus[0]} if opts.pin and len(cpus) > 1 else None
    client_cpus = cpus[1:] if server_cpu else None
    with tempfile.TemporaryDirectory(prefix="kiamfast-bench-") as tmp:
        table_path = os.path.join(tmp, "table")
        # 127.0.0.1 is one more pod (role 0, as 256 % 16 == 0): wrk's only address.
        expected = build_table(table_path, pods + ["127.0.0.1"])
        assert role_of(len(pods)) == role_of(0) or len(pods) % ROLES
        kf_port, base_port = free_port(), free_port()
        worker = start_worker(table_path, kf_port)
        try:
            get_specs = []
            for i, ip in enumerate(pods):
                token = fetch_token(ip, kf_port)
                get_specs.append((ip, get_request(role_of(i), token), expected[ip]))
            put_specs = [(ip, PUT_REQUEST, None) for ip in pods]
            baseline_resp = expected[pods[0]]
            baseline = start_baseline(base_port, baseline_resp, tmp)
            base_specs = [(ip, get_request(role_of(0), b"x" * 44), baseline_resp)
                          for ip in pods]
            if server_cpu:
                os.sched_setaffinity(worker.pid, server_cpu)
                os.sched_setaffinity(baseline.pid, server_cpu)
            plan = {"baseline": (base_port, base_specs, "get", baseline.pid),
                    "get": (kf_port, get_specs, "get", worker.pid),
                    "put": (kf_port, put_specs, "put", worker.pid)}
            try:
                common = dict(connections=opts.connections, processes=opts.processes,
                              warmup=opts.warmup, duration=opts.duration,
                              per_conn=opts.per_conn, full_check_every=opts.full_check_every,
                              client_cpus=client_cpus)
                runs: dict[str, list[dict]] = {k: [] for k in SCENARIOS}
                for _ in range(opts.rounds):
                    for key in SCENARIOS:
                        port, specs, kind, pid = plan[key]
                        runs[key].append(run_load(port, specs, kind=kind, server_pid=pid,
                                                  **common))
                wrk = {}
                if opts.wrk and shutil.which("wrk"):
                    tok = fetch_token("127.0.0.1", kf_port).decode()
                    scripts = {
                        "baseline": (base_port, WRK_GET.format(
                            path=f"/latest/meta-data/iam/security-credentials/{role_of(0)}",
                            token="x" * 44), baseline.pid),
                        "get": (kf_port, WRK_GET.format(
                            path=f"/latest/meta-data/iam/security-credentials/{role_of(0)}",
                            token=tok), worker.pid),
                        "put": (kf_port, WRK_PUT, worker.pid),
                    }
                    wrk_runs: dict[str, list[dict]] = {k: [] for k in SCENARIOS}
                    for _ in range(opts.rounds):
                        for key in SCENARIOS:
                            port, script, pid = scripts[key]
                            wrk_runs[key].append(run_wrk(
                                port, script, connections=opts.connections,
                                duration=opts.duration, cpus=client_cpus, server_pid=pid,
                                tmp=tmp))
                    for key in SCENARIOS:
                        rs = wrk_runs[key]
                        wrk[key] = {
                            "rps": statistics.median(r["rps"] for r in rs),
                            "ratio": statistics.median(
                                r["rps"] / b["rps"] for r, b in zip(rs, wrk_runs["baseline"])),
                            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                            "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                            "cpu_us_per_req": statistics.median(r["cpu_us_per_req"] for r in rs),
                            "errors": sum(r["errors"] + r["non2xx"] for r in rs),
                        }
                paced = {}
                if opts.rate:
                    for key in SCENARIOS:
                        port, specs, kind, pid = plan[key]
                        paced[key] = run_load(port, specs, kind=kind, server_pid=pid,
                                              rate=opts.rate, **common)
            finally:
                stop(baseline)
        finally:
            stop(worker)
        instructions = run_callgrind(table_path) if opts.callgrind else None
    out: dict[str, dict] = {}
    for key in SCENARIOS:
        rs = runs[key]
        ratios = [r["rps"] / b["rps"] for r, b in zip(rs, runs["baseline"])]
        cpu_ratios = [b["cpu_us_per_req"] / r["cpu_us_per_req"]
                      for r, b in zip(rs, runs["baseline"])]
        out[key] = {
            "rps": statistics.median(r["rps"] for r in rs),
            "ratio": statistics.median(ratios),
            "cpu_us_per_req": statistics.median(r["cpu_us_per_req"] for r in rs),
            "cpu_ratio": statistics.median(cpu_ratios),
            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms": statistics.median(r["p99_ms"] for r in rs),
            "errors": sum(r["errors"] for r in rs) + (paced[key]["errors"] if paced else 0),
            "bad": [b for r in rs for b in r["bad"]],
            "count": sum(r["count"] for r in rs),
            "rounds_rps": [round(r["rps"]) for r in rs],
            "paced": ({k: v for k, v in paced[key].items() if k != "bad"} if paced else None),
            "wrk": wrk.get(key),
            "instructions": instructions[key] if instructions else None,
        }
    return out


def markdown(results: dict[str, dict], opts: Options) -> str:
    lines = [
        f"Server load: {opts.connections} keep-alive connections rotating over {opts.pods} pod "
        f"addresses (127.0.x.y), {opts.processes} load process(es), {os.cpu_count()} CPUs"
        f"{', server pinned to one CPU' if opts.pin else ''}; closed loop: median of "
        f"{opts.rounds} interleaved rounds of {opts.duration:g} s",
        "",
        "| scenario | req/s | ratio to baseline | p50 ms | p99 ms | server CPU us/req "
        "| CPU ratio | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in SCENARIOS:
        r = results[key]
        lines.append(
            f"| {NAMES[key]} | {r['rps']:,.0f} | {r['ratio']:.2f} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} | {r['cpu_us_per_req']:.1f} | {r['cpu_ratio']:.2f} | "
            f"{r['errors']} |")
    lines += ["", "CPU ratio = baseline server CPU per request / this server's (1.00: as cheap "
              "as the baseline). Closed-loop latency is mostly queueing: about "
              "connections / throughput."]
    if results["baseline"]["wrk"]:
        lines += ["", f"wrk -t1 -c{opts.connections} from 127.0.0.1 (a C load generator that "
                  "saturates the server; one pod address), median of "
                  f"{opts.rounds} interleaved rounds:", "",
                  "| scenario | req/s | ratio to baseline | p50 ms | p99 ms | server CPU us/req "
                  "| errors |", "|---|---:|---:|---:|---:|---:|---:|"]
        for key in SCENARIOS:
            w = results[key]["wrk"]
            lines.append(f"| {NAMES[key]} | {w['rps']:,.0f} | {w['ratio']:.2f} | "
                         f"{w['p50_ms']:.2f} | {w['p99_ms']:.2f} | {w['cpu_us_per_req']:.1f} | "
                         f"{w['errors']} |")
    if results["baseline"]["instructions"]:
        base_i = results["baseline"]["instructions"]
        lines += ["", "User-space instructions per request (callgrind, deterministic: parse, "
                  "route, token, table lookup, response; the kernel's TCP work, about two "
                  "thirds of the CPU under load, is the same for both and not counted):", "",
                  "| scenario | instructions/request | ratio to baseline |", "|---|---:|---:|"]
        for key in SCENARIOS:
            i = results[key]["instructions"]
            lines.append(f"| {NAMES[key]} | {i:,.0f} | {base_i / i:.2f} |")
    if results["baseline"]["paced"]:
        lines += ["", f"Paced at {opts.rate:,.0f} req/s in total (below saturation):", "",
                  "| scenario | req/s | p50 ms | p99 ms | server CPU us/req | errors |",
                  "|---|---:|---:|---:|---:|---:|"]
        for key in SCENARIOS:
            p = results[key]["paced"]
            lines.append(f"| {NAMES[key]} | {p['rps']:,.0f} | {p['p50_ms']:.2f} | "
                         f"{p['p99_ms']:.2f} | {p['cpu_us_per_req']:.1f} | {p['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kiamfast server load benchmark")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--pods", type=int, default=256)
    p.add_argument("--processes", type=int, default=1, help="load-generator processes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=5000.0,
                   help="total req/s of the paced latency run (0: skip it)")
    p.add_argument("--pin", action="store_true",
                   help="pin the server to the first CPU and the load to the others")
    p.add_argument("--no-wrk", action="store_true", help="skip the wrk saturation runs")
    p.add_argument("--no-callgrind", action="store_true",
                   help="skip counting instructions with valgrind")
    p.add_argument("--instructions-loop", nargs=3, metavar=("SCENARIO", "N", "TABLE"),
                   help=argparse.SUPPRESS)
    p.add_argument("--per-conn", type=int, default=200,
                   help="requests per connection before it reconnects from the next address")
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args(argv)
    if args.instructions_loop:
        scenario, n, table_path = args.instructions_loop
        _instruction_loop(scenario, int(n), table_path)
        return 0
    opts = Options(duration=args.duration, warmup=args.warmup, connections=args.connections,
                   pods=args.pods, processes=args.processes, rounds=args.rounds,
                   per_conn=args.per_conn, rate=args.rate, pin=args.pin,
                   wrk=not args.no_wrk, callgrind=not args.no_callgrind)
    results = run_benchmark(opts)
    print(markdown(results, opts))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
