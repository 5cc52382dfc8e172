"""Node start: time from ``python -m kiamfast`` to ready (``/readyz`` 200: synced, every pod's
credentials fetched), for 110 and 250 pods with 40 roles and 100 ms of STS latency.

Baselines, measured in the same run:

* the **empty node** (0 pods): interpreter start, imports, table, workers listening, the
  first list: what every start costs before any credential exists;
* the **STS bound**: the least time 40 AssumeRole calls of 100 ms can take under the
  agent's limits (``max(ceil(40 / in-flight) x 100 ms, (40 - burst) / qps + 100 ms)``,
  ``bench/prefetch.py``'s ``ideal_prefetch``), for the default limits (5/s, burst
  20, 8 in flight: the rate limit dominates) and relaxed ones (100/s, burst 40).

So ``ready - empty node`` is what prefetching costs, and its ratio to the STS bound is the
agent's own overhead on it. Correctness: when ``/readyz`` first answers 200, every pod's
listing and document must already be served from the table (200, its own role, at once).

    python bench/node_start.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import dataclass, field

from benchutil import median, pod_addresses

ROLES = 40
LATENCY = 0.1
LIMITS = {"default (5/s, burst 20)": (None, None, 5.0, 20),
          "relaxed (100/s, burst 40)": (100.0, 40, 100.0, 40)}
MAX_INFLIGHT = 8   # the credential manager's default


@dataclass
class StartRun:
    pods: int
    limits: str
    listen_s: float
    ready_s: float
    sts_calls: int
    served_at_ready: int         # pods whose listing + document were right at once
    wrong_at_ready: int
    sts_bound_s: float
    first_call_s: float = float("nan")   # first AssumeRole arrived at STS (from start)
    last_answer_s: float = float("nan")  # last AssumeRole arrived + the injected latency
    bare_s: float = float("nan")         # the same calls from a bare thread pool (baseline)


@dataclass
class NodeStartResult:
    runs: list[StartRun] = field(default_factory=list)
    reps: int = 1


def ideal(roles: int, limits: str) -> float:
    import prefetch as pf
    _, _, qps, burst = LIMITS[limits]
    return pf.ideal_prefetch(roles, latency=LATENCY, concurrency=MAX_INFLIGHT, qps=qps,
                             burst=burst)


def _fetch(port: int, ip: str, path: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), source_address=(ip, 0),
                                  timeout=2) as s:
        s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def check_served(port: int, pods: dict[str, str], keys: dict[str, str]) -> tuple[int, int]:
    """(pods served right at once, pods served a wrong role) right after ready."""
    good = wrong = 0
    for ip, role in pods.items():
        st, body = _fetch(port, ip, b"/latest/meta-data/iam/security-credentials/")
        if st != 200:
            continue
        if body.decode() != role:
            wrong += 1
            continue
        st, body = _fetch(port, ip, b"/latest/meta-data/iam/security-credentials/" +
                          role.encode())
        if st != 200:
            continue
        if keys.get(json.loads(body).get("AccessKeyId", "")) == role:
            good += 1
        else:
            wrong += 1
    return good, wrong


def run(*, pod_counts=(0, 110, 250), reps: int = 3, limits=tuple(LIMITS),
        log=print) -> NodeStartResult:
    import bench_agent as ba

    if not ba.full_agent_available():
        raise RuntimeError("needs the full agent (kiamfast.control.process is not there yet)")
    res = NodeStartResult(reps=reps)
    for lim in limits:
        flag_qps, flag_burst, _, _ = LIMITS[lim]
        for n in pod_counts:
            for rep in range(reps):
                first_rep = rep == 0
                # A fresh cluster per start: nothing cached anywhere (STS proxy counts too).
                with ba.cluster(sts_latency=LATENCY) as c:
                    pods = {}
                    for i, ip in enumerate(pod_addresses(n)):
                        role = ba.role_name(i % ROLES)
                        c.add_pod(ip, role)
                        pods[ip] = role
                    with ba.agent(c, sts_qps=flag_qps, sts_burst=flag_burst) as a:
                        listen = _wait_listen(a)
                        ready = a.wait_ready(120, poll=0.002)
                        good, wrong = check_served(a.port, pods, c.access_keys())
                        recs = c.proxy.assume_role_calls()
                        calls = len(recs)
                        first = min((r.at for r in recs), default=float("nan")) - a.started
                        last = max((r.at for r in recs), default=float("nan")) - a.started \
                            + LATENCY
                    bare = bare_pool(c, len(set(pods.values()))) if pods and first_rep \
                        else float("nan")
                res.runs.append(StartRun(pods=n, limits=lim, listen_s=listen, ready_s=ready,
                                         sts_calls=calls, served_at_ready=good,
                                         wrong_at_ready=wrong,
                                         sts_bound_s=ideal(len(set(pods.values())), lim)
                                         if pods else 0.0, first_call_s=first,
                                         last_answer_s=last, bare_s=bare))
            log(f"  node start: {lim}, {n} pods done")
    return res


def bare_pool(c, calls: int) -> float:
    """Seconds ``calls`` AssumeRole calls take from a bare pool of MAX_INFLIGHT threads
    through the same proxy (botocore + moto + latency, no manager, no rate limit)."""
    import prefetch as pf
    from kiamfast.control.iam.sts import StsClient
    sts = StsClient(endpoint_url=c.proxy.url, max_attempts=1, max_pool_connections=16)
    try:
        return pf.bare_client(sts, calls, concurrency=MAX_INFLIGHT)
    finally:
        sts.close()


def _wait_listen(a) -> float:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if a.proc.poll() is not None:
            raise RuntimeError(f"agent exited: {a.log_tail()}")
        try:
            socket.create_connection(("127.0.0.1", a.port), timeout=0.2).close()
            return time.monotonic() - a.started
        except OSError:
            time.sleep(0.002)
    raise RuntimeError("agent never listened")


def summarize(res: NodeStartResult) -> list[dict]:
    rows = []
    groups: dict[tuple[str, int], list[StartRun]] = {}
    for r in res.runs:
        groups.setdefault((r.limits, r.pods), []).append(r)
    for (lim, n), rs in groups.items():
        empty = groups.get((lim, 0))
        base = median([r.ready_s for r in empty]) if empty else float("nan")
        ready = median([r.ready_s for r in rs])
        bound = median([r.sts_bound_s for r in rs])
        window = median([r.last_answer_s - r.first_call_s for r in rs])
        bare = median([r.bare_s for r in rs])
        floor = max(bound, bare) if bare == bare else bound
        rows.append({"limits": lim, "pods": n, "listen": median([r.listen_s for r in rs]),
                     "first_call": median([r.first_call_s for r in rs]),
                     "last_answer": median([r.last_answer_s for r in rs]),
                     "window": window,
                     "bare": bare, "floor": floor,
                     "window_ratio": window / floor if n and floor else float("nan"),
                     "after_last": median([r.ready_s - r.last_answer_s for r in rs]),
                     "ready": ready, "ready_min": min(r.ready_s for r in rs),
                     "ready_max": max(r.ready_s for r in rs), "empty": base,
                     "prefetch": ready - base if n else 0.0, "bound": bound,
                     "ratio": (ready - base) / bound if n and bound else float("nan"),
                     "calls": median([r.sts_calls for r in rs]),
                     "served": min(r.served_at_ready for r in rs),
                     "wrong": sum(r.wrong_at_ready for r in rs), "reps": len(rs)})
    return rows


def markdown(res: NodeStartResult) -> str:
    lines = [f"{ROLES} roles (pods round-robin), STS latency {LATENCY * 1e3:.0f} ms (fault "
             f"proxy in front of moto), median of {res.reps} start(s), each on a fresh "
             "cluster; all times in seconds from process start. Baselines in the same run: "
             "the **empty node**'s time to ready (the fixed cost of a start), and the **STS "
             "bound**, the least time 40 calls of 100 ms take under the rate limit and 8 in "
             "flight, and the same 40 calls timed from a **bare pool** of 8 threads (botocore, "
             "the proxy and moto on this machine, no rate limit). *STS window* = first "
             "AssumeRole sent to last answered (from the STS proxy's records); it is compared "
             "with the larger of bound and bare pool.", "",
             "| STS limits | pods | listening | first STS call | last STS answer | **ready** "
             "(min–max) | ready, empty node | STS window | STS bound | bare pool | window ÷ "
             "max(bound, bare) | ready − last answer | AssumeRole calls | pods served at ready "
             "| wrong |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summarize(res):
        if r["pods"]:
            sts = (f"{r['first_call']:.2f} | {r['last_answer']:.2f} | ")
            win = (f"{r['window']:.2f} | {r['bound']:.2f} | {r['bare']:.2f} | "
                   f"{r['window_ratio']:.2f} | "
                   f"{r['after_last']:.3f} | ")
        else:
            sts, win = "— | — | ", "— | — | — | — | — | "
        lines.append(
            f"| {r['limits']} | {r['pods']} | {r['listen']:.2f} | {sts}**{r['ready']:.2f}** "
            f"({r['ready_min']:.2f}–{r['ready_max']:.2f}) | {r['empty']:.2f} | {win}"
            f"{r['calls']:.0f} | {r['served']}/{r['pods']} | {r['wrong']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run(reps=1) if args.quick else run()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
