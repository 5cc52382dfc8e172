"""Hot path: the full agent under load against the Python and the C ceilings, same run.

What it measures. The agent (``python -m kiamfast``, its pods in the API emulator, its
credentials from moto's STS, its passthrough upstream a fast nginx) serving 256 pods
(127.0.x.y source addresses, 40 roles) three kinds of request, the way SDKs send them
(bench/loadgen.py builds them and generates the load):

* ``GET .../security-credentials/<role>`` with an IMDSv2 token (cached credentials),
* ``PUT /latest/api/token``,
* ``GET /latest/meta-data/instance-id`` (the passthrough to the metadata service),

each against two servers answering the same request with the same bytes:

* the **Python ceiling**: ``bench/baseline_server.py`` (uvloop + httptools, no routing, no
  lookup, the agent's exact response bytes);
* the **C ceiling**: nginx, one worker, the same body (its own headers).

Runs: closed loop at 1 connection (rotating over the 256 addresses: pure per-request
latency) and at 256 connections (one per address: throughput), in interleaved rounds so a
ratio compares runs seconds apart; a paced run (fixed total rate, well below saturation)
for the latency distribution under load; and ``wrk`` (C, one source address: 127.0.0.1 is
one more pod) as a saturation cross-check of the Python load generator, whose own ceiling
is reported as its throughput against nginx.

Server cost is also read from /proc as CPU microseconds per request, which stays meaningful
when the load generator (Python, sharing two cores) and not the server is the bottleneck.
Targets (issue): >= 0.85x the Python ceiling, p99 < 2 ms.

``--target worker`` measures one server worker alone instead, over a table the benchmark
fills with what the control process would render (bench_agent.worker_only): the hot path
without the supervisor and the control process. bench/instructions.py counts the user-space
instructions of the same requests.

    python bench/agent_load.py [--quick] [--target agent|worker]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

from benchutil import cpu_seconds, median, pod_addresses, summarize_us
from loadgen import (INSTANCE_ID, TOKEN_PUT, WRK_GET, WRK_PUT, LoadResult, Spec,
                     credentials_path, metadata_get, run_load, run_wrk)

from kiamfast.testing.net import one_request, split_response

KINDS = ("get", "put", "pass")
KIND_NAMES = {"get": "credential GET (token, cached)", "put": "token PUT",
              "pass": "passthrough GET instance-id"}
SERVERS = ("nginx", "python", "agent")
SERVER_NAMES = {"nginx": "nginx (C ceiling)", "python": "uvloop+httptools (Python ceiling)",
                "agent": "kiamfast agent"}
ROLES = 40
# What the agent's own answers carry beyond their bodies (the ceilings send other headers).
AGENT_HEADERS = (b"Server: EC2ws",)
TTL_HEADER = b"X-Aws-Ec2-Metadata-Token-Ttl-Seconds: 21600"


def one_shot(port: int, source: str, request: bytes, *, timeout: float = 5.0) -> bytes:
    """One request from ``source`` on its own connection (Connection: close); the response."""
    return one_request(port, request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n",
                                             1), source=source, timeout=timeout)


def keep_alive(resp: bytes) -> bytes:
    """A response as a keep-alive answer (the baseline must not close the connection)."""
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass
class Options:
    pods: int = 256
    connections: tuple[int, ...] = (1, 256)
    rounds: int = 5
    duration: float = 2.0
    warmup: float = 0.5
    paced_rate: float = 2000.0
    paced_duration: float = 4.0
    per_conn: int = 100
    wrk: bool = True
    pin: bool = True
    target: str = "agent"            # or "worker": one server worker alone (module docstring)
    load_processes: int = 0          # 0: one per CPU left to the load generator
    kinds: tuple[str, ...] = KINDS


@dataclass
class Run:
    rps: float
    errors: int
    count: int
    server_cpu_us: float             # server CPU per request (worker(s) for the agent)
    server_util: float               # server CPU seconds / wall seconds
    client_util: float
    lat: dict
    bad: list


@dataclass
class HotPathResult:
    mode: str                        # "full agent" or "one worker"
    options: dict
    closed: dict = field(default_factory=dict)   # (server, kind, conns) -> [Run per round]
    paced: dict = field(default_factory=dict)    # (server, kind) -> Run
    wrk: dict = field(default_factory=dict)      # (server, kind) -> dict
    latencies: dict = field(default_factory=dict)  # name -> np.ndarray (us)
    agent_total_cpu_us: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)


def _cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def _measure(port: int, specs: list[Spec], pids: list[int], *, connections: int,
             processes: int, duration: float, warmup: float, rate: float, per_conn: int,
             cpus: list[int] | None, extra_pids: list[int] | None = None) -> tuple[Run, LoadResult,
                                                                                 float]:
    c0 = [0.0, 0.0]

    def start() -> None:
        c0[0] = _cpu(pids)
        c0[1] = _cpu(extra_pids or [])
    r = run_load(port, specs, connections=connections, processes=processes, duration=duration,
                 warmup=warmup, rate=rate, per_conn=per_conn, cpus=cpus, on_start=start)
    used = _cpu(pids) - c0[0]
    extra = _cpu(extra_pids or []) - c0[1]
    run = Run(rps=r.rps, errors=r.errors, count=r.count,
              server_cpu_us=used / r.count * 1e6 if r.count else float("nan"),
              server_util=used / r.elapsed if r.elapsed else 0.0,
              client_util=r.client_cpu / r.elapsed if r.elapsed else 0.0,
              lat=summarize_us(r.latencies_us), bad=r.bad)
    return run, r, (extra / r.count * 1e6 if r.count and extra_pids else float("nan"))


def run(opts: Options, *, log=print) -> HotPathResult:
    import bench_agent as ba
    import bench_servers as bs

    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = {cpus[0]} if opts.pin and len(cpus) > 1 else None
    load_cpus = cpus[1:] if server_cpus else None
    processes = opts.load_processes or max(1, len(load_cpus or cpus))
    ips = pod_addresses(opts.pods)
    wrk_ip = "127.0.0.1"
    full = opts.target == "agent"
    res = HotPathResult(mode="full agent (python -m kiamfast)" if full
                        else "one server worker over a table the benchmark filled",
                        options=dict(opts.__dict__, load_processes=processes,
                                     server_cpus=sorted(server_cpus or []),
                                     load_cpus=load_cpus))
    with _target(full, ips + [wrk_ip], server_cpus) as (agent, keys_of):
        # Each pod's token, and the exact bytes it must get (checked against STS's records).
        tokens, docs, roles = {}, {}, {}
        for i, ip in enumerate(ips + [wrk_ip]):
            role = ba.role_name(i % ROLES)
            status, _, token = split_response(one_shot(agent.port, ip, TOKEN_PUT))
            assert status == 200 and len(token) > 20, (ip, status, token)
            tokens[ip] = token
            status, _, body = split_response(one_shot(
                agent.port, ip, metadata_get(credentials_path(role), token)))
            assert status == 200, (ip, status, body[:200])
            docs[ip] = body
            roles[ip] = role
        keys = keys_of()
        wrong = [ip for ip in docs if keys.get(json.loads(docs[ip])["AccessKeyId"]) != roles[ip]]
        res.checks["pods"] = len(docs)
        res.checks["documents naming another role"] = len(wrong)
        base_ip = ips[0]
        full_get = keep_alive(one_shot(agent.port, base_ip, metadata_get(
            credentials_path(roles[base_ip]), tokens[base_ip])))
        full_put = keep_alive(one_shot(agent.port, base_ip, TOKEN_PUT))
        full_pass = keep_alive(one_shot(agent.port, base_ip, metadata_get(INSTANCE_ID,
                                                                         tokens[base_ip])))
        assert split_response(full_pass)[0] == 200, full_pass[:300]
        inst = split_response(full_pass)[2]
        res.checks["passthrough body"] = inst.decode(errors="replace")
        agent_specs = {
            "get": [Spec(ip, metadata_get(credentials_path(roles[ip]), tokens[ip]), 200,
                         docs[ip], headers=AGENT_HEADERS) for ip in ips],
            "put": [Spec(ip, TOKEN_PUT, 200, length=len(tokens[ip]),
                         headers=(TTL_HEADER, *AGENT_HEADERS)) for ip in ips],
            "pass": [Spec(ip, metadata_get(INSTANCE_ID, tokens[ip]), 200, inst) for ip in ips],
        }
        base_body = {"get": docs[base_ip], "put": split_response(full_put)[2], "pass": inst}
        with bs.nginx(docs[base_ip]) as ng, \
                bs.python_baseline(full_get) as py_get, \
                bs.python_baseline(full_put) as py_put, \
                bs.python_baseline(full_pass) as py_pass:
            ng_pid = bs.nginx_worker_pid(ng)
            from benchutil import set_affinity
            set_affinity([ng.pid, ng_pid, py_get.pid, py_put.pid, py_pass.pid], server_cpus)
            worker_pids = agent.processes()["worker"]
            other_agent = [p for p in agent.all_pids() if p not in worker_pids]
            nginx_token = bs.TOKEN.encode()
            plan = {}
            for kind in opts.kinds:
                same = agent_specs[kind]
                plan[("agent", kind)] = (agent.port, same, worker_pids)
                body_py = base_body[kind] if kind != "put" else split_response(full_put)[2]
                plan[("python", kind)] = (
                    {"get": py_get, "put": py_put, "pass": py_pass}[kind].port,
                    [Spec(s.source, s.request, 200, body_py) for s in same],
                    [{"get": py_get, "put": py_put, "pass": py_pass}[kind].pid])
                body_ng = {"get": docs[base_ip], "put": nginx_token,
                           "pass": bs.INSTANCE_ID.encode()}[kind]
                plan[("nginx", kind)] = (ng.port, [Spec(s.source, s.request, 200, body_ng)
                                                    for s in same], [ng_pid])
            common = dict(processes=processes, duration=opts.duration, warmup=opts.warmup,
                          per_conn=opts.per_conn, cpus=load_cpus)
            for rnd in range(opts.rounds):
                for conns in opts.connections:
                    for kind in opts.kinds:
                        for server in SERVERS:
                            port, specs, pids = plan[(server, kind)]
                            r, raw, extra = _measure(
                                port, specs, pids, connections=conns, rate=0.0,
                                extra_pids=other_agent if server == "agent" else None,
                                **common)
                            res.closed.setdefault((server, kind, conns), []).append(r)
                            if server == "agent":
                                res.agent_total_cpu_us.setdefault((kind, conns), []).append(
                                    r.server_cpu_us + (extra if extra == extra else 0.0))
                            if conns == 1:
                                key = f"c1/{kind}/{server}"
                                prev = res.latencies.get(key)
                                res.latencies[key] = raw.latencies_us if prev is None else \
                                    np.concatenate([prev, raw.latencies_us])
                log(f"  hot path round {rnd + 1}/{opts.rounds} done")
            if opts.paced_rate:
                for kind in opts.kinds:
                    for server in SERVERS:
                        port, specs, pids = plan[(server, kind)]
                        r, raw, _ = _measure(port, specs, pids,
                                             connections=max(opts.connections),
                                             rate=opts.paced_rate,
                                             **dict(common, duration=opts.paced_duration))
                        res.paced[(server, kind)] = r
                        res.latencies[f"paced/{kind}/{server}"] = raw.latencies_us
                log("  hot path paced runs done")
            if opts.wrk and shutil.which("wrk"):
                res.wrk = _wrk_runs(opts, plan, agent, tokens[wrk_ip], roles[wrk_ip], ng,
                                    py_get, py_put, load_cpus, worker_pids, ng_pid)
                log("  hot path wrk runs done")
    return res


def _wrk_runs(opts: Options, plan, agent, token: bytes, role: str, ng, py_get, py_put,
              load_cpus, worker_pids, ng_pid) -> dict:
    """wrk -t1 from 127.0.0.1 (one pod): GET and PUT, per server, interleaved rounds."""
    get = WRK_GET.format(path=credentials_path(role).decode(), token=token.decode())
    put = WRK_PUT
    scripts = {("nginx", "get"): (ng.port, get, ng_pid),
               ("python", "get"): (py_get.port, get, py_get.pid),
               ("agent", "get"): (agent.port, get, worker_pids[0]),
               ("nginx", "put"): (ng.port, put, ng_pid),
               ("python", "put"): (py_put.port, put, py_put.pid),
               ("agent", "put"): (agent.port, put, worker_pids[0])}
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="kiamfast-bench-wrk-") as tmp:
        for _ in range(opts.rounds):
            for key, (port, script, pid) in scripts.items():
                r = run_wrk(port, script, connections=64, duration=opts.duration,
                            cpus=load_cpus, server_pid=pid, tmp=tmp)
                out.setdefault(key, []).append(r)
    return out


class _target:
    """The agent with its pods (full) or one worker alone; yields (agent, keys_of)."""

    def __init__(self, full: bool, ips: list[str], cpus: set[int] | None) -> None:
        self.full, self.ips, self.cpus = full, ips, cpus
        self._stack = None

    def __enter__(self):
        import contextlib

        import bench_agent as ba
        import bench_servers as bs
        self._stack = contextlib.ExitStack()
        st = self._stack
        try:
            if self.full:
                c = st.enter_context(ba.cluster())
                for i, ip in enumerate(self.ips):
                    c.add_pod(ip, ba.role_name(i % ROLES))
                a = st.enter_context(ba.agent(c, cpus=self.cpus, sts_qps=100, sts_burst=100))
                a.wait_ready(120)
                return a, c.access_keys
            ng = st.enter_context(bs.nginx(b"upstream\n"))
            a = st.enter_context(ba.worker_only(self.ips, roles=ROLES, imds_port=ng.port,
                                                cpus=self.cpus))
            return a, lambda: a.keys
        except BaseException:
            st.close()
            raise

    def __exit__(self, *exc):
        self._stack.close()


# ---- summaries -------------------------------------------------------------------------------

def summarize(res: HotPathResult) -> dict:
    """Per (kind, conns): medians over rounds, and per-round ratios to both ceilings."""
    out: dict = {}
    conns_list = sorted({k[2] for k in res.closed})
    kinds = [k for k in KINDS if any(key[1] == k for key in res.closed)]
    for kind in kinds:
        for conns in conns_list:
            runs = {s: res.closed.get((s, kind, conns), []) for s in SERVERS}
            if not all(runs.values()):
                continue
            row: dict = {}
            for s in SERVERS:
                rs = runs[s]
                row[s] = {"rps": median([r.rps for r in rs]),
                          "cpu_us": median([r.server_cpu_us for r in rs]),
                          "util": median([r.server_util for r in rs]),
                          "client_util": median([r.client_util for r in rs]),
                          "p50": median([r.lat["p50"] for r in rs]),
                          "p99": median([r.lat["p99"] for r in rs]),
                          "errors": sum(r.errors for r in rs),
                          "count": sum(r.count for r in rs),
                          "bad": [b for r in rs for b in r.bad][:2]}
            a, p, n = runs["agent"], runs["python"], runs["nginx"]
            row["ratio_python"] = median([x.rps / y.rps for x, y in zip(a, p) if y.rps])
            row["ratio_nginx"] = median([x.rps / y.rps for x, y in zip(a, n) if y.rps])
            row["cpu_ratio_python"] = median([y.server_cpu_us / x.server_cpu_us
                                              for x, y in zip(a, p) if x.server_cpu_us])
            row["cpu_ratio_nginx"] = median([y.server_cpu_us / x.server_cpu_us
                                             for x, y in zip(a, n) if x.server_cpu_us])
            row["agent_total_cpu_us"] = median(res.agent_total_cpu_us.get((kind, conns), []))
            out[(kind, conns)] = row
    return out


def markdown(res: HotPathResult) -> str:
    o = res.options
    s = summarize(res)
    lines = [f"Target: **{res.mode}**, {o['pods']} pods (127.0.x.y source addresses), "
             f"{ROLES} roles. Servers pinned to CPU {o['server_cpus'] or 'none'}, load "
             f"generator ({o['load_processes']} process(es)) on CPUs {o['load_cpus'] or 'all'}. "
             f"Closed loop: median of {o['rounds']} interleaved rounds of {o['duration']:g} s; "
             "ratios are computed per round (agent vs the ceiling measured seconds apart), then "
             "the median is taken.", ""]
    lines += ["| request | conns | agent req/s | × Python ceiling | × nginx | "
              "agent worker CPU µs/req | all agent processes | CPU efficiency × Python | "
              "× nginx | agent p50 / p99 ms | errors |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (kind, conns), row in s.items():
        a = row["agent"]
        lines.append(
            f"| {KIND_NAMES[kind]} | {conns} | {a['rps']:,.0f} | {row['ratio_python']:.2f} | "
            f"{row['ratio_nginx']:.2f} | {a['cpu_us']:.1f} | {row['agent_total_cpu_us']:.1f} | "
            f"{row['cpu_ratio_python']:.2f} | "
            f"{row['cpu_ratio_nginx']:.2f} | {a['p50']:.3f} / {a['p99']:.3f} | "
            f"{sum(row[x]['errors'] for x in SERVERS)} |")
    lines += ["", "CPU efficiency = the ceiling's server CPU per request / the agent worker's "
              "(1.00 = as cheap). The Python load generator costs about as much CPU per request "
              "as the Python ceiling itself (both pay the loopback TCP path), so with one core "
              "each it can be the bottleneck against the fastest servers and the req/s ratio "
              "then flatters the agent; CPU per request does not depend on who saturates "
              "first, and wrk (below) saturates the servers from one address. \"All agent "
              "processes\" adds the supervisor's and control process' CPU in the same window.",
              ""]
    lines += ["All servers, medians:", "",
              "| request | conns | server | req/s | server CPU µs/req | server CPU use | "
              "load-gen CPU use | p50 ms | p99 ms | responses | wrong |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (kind, conns), row in s.items():
        for srv in SERVERS:
            r = row[srv]
            lines.append(f"| {KIND_NAMES[kind]} | {conns} | {SERVER_NAMES[srv]} | "
                         f"{r['rps']:,.0f} | {r['cpu_us']:.1f} | {r['util']:.0%} | "
                         f"{r['client_util']:.0%} | {r['p50']:.3f} | {r['p99']:.3f} | "
                         f"{r['count']:,} | {r['errors']} |")
    if res.paced:
        lines += ["", f"Paced: {o['paced_rate']:,.0f} requests/s in total over "
                  f"{max(o['connections'])} connections ({o['paced_duration']:g} s; latency "
                  "counted from when a request was due, so a stall is not hidden):", "",
                  "| request | server | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | "
                  "responses | wrong |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for (srv, kind), r in sorted(res.paced.items(), key=lambda kv: (
                KINDS.index(kv[0][1]), SERVERS.index(kv[0][0]))):
            L = r.lat
            lines.append(f"| {KIND_NAMES[kind]} | {SERVER_NAMES[srv]} | {L['p50']:.3f} | "
                         f"{L['p90']:.3f} | {L['p99']:.3f} | {L['p999']:.3f} | "
                         f"{L['max']:.2f} | {r.count:,} | {r.errors} |")
    if res.wrk:
        lines += ["", "wrk -t1 -c64 from 127.0.0.1 (C load generator, one pod address); "
                  "req/s and CPU are medians over the rounds, ratios are medians of the "
                  "per-round ratios (so they need not equal the ratio of the medians):", "",
                  "| request | server | req/s | × Python ceiling | server CPU µs/req | "
                  "CPU efficiency × Python | p50 ms | p99 ms | errors |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for kind in ("get", "put"):
            base = res.wrk.get(("python", kind))
            for srv in SERVERS:
                rs = res.wrk.get((srv, kind))
                if not rs:
                    continue
                ratio = median([x["rps"] / y["rps"] for x, y in zip(rs, base) if y["rps"]])
                eff = median([y["cpu_us_per_req"] / x["cpu_us_per_req"]
                              for x, y in zip(rs, base) if x["cpu_us_per_req"]])
                lines.append(f"| {KIND_NAMES[kind]} | {SERVER_NAMES[srv]} | "
                             f"{median([r['rps'] for r in rs]):,.0f} | {ratio:.2f} | "
                             f"{median([r['cpu_us_per_req'] for r in rs]):.1f} | {eff:.2f} | "
                             f"{median([r['p50_ms'] for r in rs]):.3f} | "
                             f"{median([r['p99_ms'] for r in rs]):.3f} | "
                             f"{sum(r['errors'] + r['non2xx'] for r in rs)} |")
        ng = res.wrk.get(("nginx", "get"))
        top = max(s.get(("get", c), {}).get("nginx", {}).get("rps", 0.0)
                  for c in res.options["connections"])
        if ng and top:
            util = max(s.get(("get", c), {}).get("nginx", {}).get("util", 0.0)
                       for c in res.options["connections"])
            lines += ["", f"Load generator ceiling: the Python load generator drove nginx at "
                      f"{top:,.0f} req/s (nginx's worker using {util:.0%} of a core), wrk at "
                      f"{median([r['rps'] for r in ng]):,.0f} req/s "
                      f"({top / median([r['rps'] for r in ng]):.2f}× wrk). A server below "
                      "~90 % of its core was not saturated by anyone: on a shared machine the "
                      "other tenants' processes take the rest, which is why the CPU-per-request "
                      "ratios are the figures to trust."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--target", choices=("agent", "worker"), default="agent")
    args = ap.parse_args(argv)
    opts = Options(rounds=1, duration=1.5, paced_duration=2.0, wrk=False,
                   target=args.target) if args.quick else Options(target=args.target)
    res = run(opts)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
