"""A new pod's first credential call through the runtime path, and what the runtime path
costs established pods.

First call: the API server never hears of the new pod's address here (the hard case: the
agent can only learn it from the runtime). Each of ``pods`` new pods follows the kubelet's
order: the pod is created in the API first (the agent prefetches its credentials from the
watch; its role is one already in use, so STS is not in the measurement), then its sandbox
is started; the clock starts when RunPodSandbox returns (the sandbox is READY) and stops
when the first answer is in: the listing (``GET .../security-credentials/`` on a fresh
connection from the sandbox's address), then the document on the same connection (what an
SDK needs). The agent answers only after a runtime poll begun after the connection was
accepted, so this is the on-demand poll's cost plus the request's. Then the sandbox is
removed and the pod's end published. Target: p99 < 10 ms. Baseline, in the same loop: the
same fresh connection and two requests from an established pod to an API-only agent (no
poll), so the difference is what the runtime path adds.

Hot path: ``established`` pods whose addresses the API knows; each has bench/churn_clients.py's
client (keep-alive, one request at a time, listing and document alternately) from its own
sandbox, against two agents on the same node, one with ``--cri-endpoint`` and one with
``--cri-endpoint=none``, measured in alternating rounds of the same length. Reported as
ratios (with / without) of throughput and of p50 and p99 latency; target ~1.0 (a request
on an established connection is one table lookup either way).

The runtime is a real containerd when root and containerd are there, else the CRI fault
double (bench/cri_node.py provides both).

    python bench/runtime_first_call.py [--quick] [--pods N] [--runtime auto|containerd|fault]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import bench_agent as ba
import churn_clients
import cri_node
from benchutil import summarize_us

LISTING = b"/latest/meta-data/iam/security-credentials/"


def _request(sock: socket.socket, path: bytes) -> tuple[int, bytes]:
    sock.sendall(b"GET %s HTTP/1.1\r\nHost: 169.254.169.254\r\nUser-Agent: first-call\r\n\r\n"
                 % path)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the answer")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside the answer")
        body += chunk
    return int(head[9:12]), body


def connect_from(node, sandbox: cri_node.Sandbox, *, port: int) -> socket.socket:
    """A TCP connection to the agent whose source is the sandbox's address: the socket is
    made inside the sandbox's network namespace (a client in the pod)."""
    with cri_node.inside_netns(sandbox.netns) if sandbox.netns else contextlib.nullcontext():
        sock = socket.socket()
    sock.settimeout(5)
    sock.bind((sandbox.ip, 0))
    sock.connect((node.agent_host, port))
    return sock


@dataclass
class FirstCalls:
    listing_ms: np.ndarray
    document_ms: np.ndarray
    wrong: int          # listing or document for another role
    failed: int         # answers other than 200
    samples: list[str] = field(default_factory=list)
    # the same fresh connection from an established pod to the API-only agent (no poll)
    baseline_listing_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    baseline_document_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))


def timed_call(node, sandbox: cri_node.Sandbox, *,
               port: int) -> tuple[int, bytes, bytes, float, float]:
    """A fresh connection from the sandbox, the listing, then the document: (status, listing
    body, document, ms to the listing, ms to the document), timed from before the connect."""
    t0 = time.perf_counter()
    with connect_from(node, sandbox, port=port) as sock:
        status, body = _request(sock, LISTING)
        t1 = time.perf_counter()
        doc = b""
        if status == 200:
            status, doc = _request(sock, LISTING + body)
        t2 = time.perf_counter()
    return status, body, doc, (t1 - t0) * 1e3, (t2 - t0) * 1e3


def _access_key(doc: bytes) -> str:
    return doc.split(b'"AccessKeyId"', 1)[1].split(b'"')[1].decode()


def first_calls(c: ba.Cluster, node, *, port: int, baseline_port: int, slot: int, pods: int,
                established: list[cri_node.Pod], role_names: list[bytes]) -> FirstCalls:
    listing, document, base_listing, base_document, keys, samples = [], [], [], [], [], []
    wrong = failed = 0
    for k in range(pods):
        role = role_names[k % len(role_names)]
        name, uid = cri_node.new_api_pod(c, role)
        time.sleep(0.05)   # the kubelet starts the sandbox after the pod reached it
        sb = cri_node.sandbox_for(node, slot, name=name, uid=uid, role=role)
        try:   # the sandbox is READY: RunPodSandbox has returned
            status, body, doc, t_listing, t_document = timed_call(node, sb, port=port)
        finally:
            node.remove_sandbox(sb)
            c.api.pods.set_phase(cri_node.NAMESPACE, name, "Failed")
            c.api.pods.delete(cri_node.NAMESPACE, name)
        if status == 200:
            listing.append(t_listing)
            document.append(t_document)
            wrong += body != role
            keys.append((role.decode(), _access_key(doc)))
        else:
            failed += 1
            if len(samples) < 5:
                samples.append(f"{name} at {sb.ip}: {status} {body[:80]!r}")
        old = established[k % len(established)]
        status, body, doc, t_listing, t_document = timed_call(node, old.sandbox,
                                                              port=baseline_port)
        if status == 200 and body == role_names[old.role]:
            base_listing.append(t_listing)
            base_document.append(t_document)
    keymap = c.access_keys()
    wrong += sum(keymap.get(akid) != role for role, akid in keys)
    return FirstCalls(listing_ms=np.array(listing), document_ms=np.array(document),
                      wrong=wrong, failed=failed, samples=samples,
                      baseline_listing_ms=np.array(base_listing),
                      baseline_document_ms=np.array(base_document))


@dataclass
class HotRound:
    agent: str
    requests_per_s: float
    tally: churn_clients.Tally


def hot_round(*, agent: str, port: int, node, pods: list[cri_node.Pod], role_names: list[bytes],
              seconds: float) -> tuple[str, list[dict]]:
    sh = churn_clients.Shared.create(len(pods))
    for i, pod in enumerate(pods):
        sh.role[i], sh.prev[i], sh.gen[i], sh.want[i] = pod.role, -1, 1, 1
    clients = [churn_clients.start_client(port=port, slot=i, sandbox=pod.sandbox,
                               agent_host=node.agent_host, role_names=role_names, sh=sh)
               for i, pod in enumerate(pods)]
    time.sleep(seconds)
    results, lost = churn_clients.collect(clients)
    if lost:
        raise RuntimeError(f"{lost} of {len(clients)} hot-path clients died without a report")
    return agent, results


@dataclass
class FirstCallResult:
    runtime: str
    established: int
    first: FirstCalls
    rounds: list[HotRound]

    def hot(self, agent: str) -> dict[str, float]:
        rs = [r for r in self.rounds if r.agent == agent]
        lat = np.concatenate([r.tally.latencies_us for r in rs]) if rs else np.zeros(0)
        s = summarize_us(lat)
        return {"rps": float(np.median([r.requests_per_s for r in rs])) if rs else float("nan"),
                "p50": s["p50"], "p99": s["p99"], "requests": sum(r.tally.requests for r in rs),
                "wrong": sum(r.tally.wrong for r in rs),
                "not_200": sum(r.tally.not_200 for r in rs)}


def run(*, runtime: str = "auto", pods: int = 200, established: int = 8, roles: int = 4,
        rounds: int = 3, round_seconds: float = 8.0, log=print) -> FirstCallResult:
    role_names = [ba.role_name(r).encode() for r in range(roles)]
    node = cri_node.make_node(runtime, established + 1)
    try:
        with ba.cluster() as c:
            pods_ = []
            try:
                pods_ = cri_node.populate(c, node, role_names=role_names, slots=established)
                flags = node.agent_flags
                with ba.agent(c, sts_qps=100, sts_burst=100,
                              extra=[f"--cri-endpoint={node.endpoint}", *flags]) as with_rt, \
                        ba.agent(c, sts_qps=100, sts_burst=100,
                                 extra=["--cri-endpoint=none", *flags]) as without:
                    with_rt.wait_ready(120)
                    without.wait_ready(120)
                    log(f"  first calls of {pods} new pods ({node.kind})")
                    first = first_calls(c, node, port=with_rt.port,
                                        baseline_port=without.port, slot=established,
                                        pods=pods, established=pods_, role_names=role_names)
                    raw = []
                    for n in range(rounds):
                        log(f"  hot path round {n + 1}/{rounds}")
                        raw.append(hot_round(agent="with", port=with_rt.port, node=node,
                                             pods=pods_, role_names=role_names,
                                             seconds=round_seconds))
                        raw.append(hot_round(agent="without", port=without.port, node=node,
                                             pods=pods_, role_names=role_names,
                                             seconds=round_seconds))
                    keymap = c.access_keys()
            finally:
                cri_node.remove_pods(node, pods_)
    finally:
        node.close()
    hot = []
    for agent, results in raw:
        t = churn_clients.tally(results, role_names=role_names, keymap=keymap)
        per_client = t.seconds / max(len(results), 1)
        hot.append(HotRound(agent=agent, requests_per_s=t.requests / max(per_client, 1e-9),
                            tally=t))
    return FirstCallResult(runtime=node.kind, established=established, first=first, rounds=hot)


def _ms(xs: np.ndarray) -> str:
    if xs.size == 0:
        return "no successful call"
    p = np.percentile(xs, [50, 99])
    return f"p50 {p[0]:.2f} ms, p99 {p[1]:.2f} ms, max {xs.max():.2f} ms"


def markdown(r: FirstCallResult) -> str:
    f = r.first
    w, wo = r.hot("with"), r.hot("without")
    lines = [
        f"Runtime: **{r.runtime}**.", "",
        f"First call of {f.listing_ms.size + f.failed} new pods whose address the API "
        "server never heard of, from sandbox READY (RunPodSandbox returned) to:", "",
        f"- the listing on a fresh connection: {_ms(f.listing_ms)}",
        f"- the credentials document after it: {_ms(f.document_ms)}",
        "- baseline in the same run, the same fresh connection from an established pod to "
        f"the API-only agent (no runtime poll): listing {_ms(f.baseline_listing_ms)}; "
        f"document {_ms(f.baseline_document_ms)}",
        f"- wrong role: **{f.wrong}**; not 200: {f.failed}"
        + (f" (e.g. `{f.samples[0]}`)" if f.samples else ""), "",
        f"Hot path, {r.established} established pods, keep-alive, alternating rounds "
        f"({len(r.rounds) // 2} each):", "",
        "| agent | requests/s (median round) | p50 | p99 | requests | wrong | not 200 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| --cri-endpoint | {w['rps']:,.0f} | {w['p50']:.3f} ms | {w['p99']:.3f} ms | "
        f"{w['requests']:,} | {w['wrong']} | {w['not_200']} |",
        f"| --cri-endpoint=none | {wo['rps']:,.0f} | {wo['p50']:.3f} ms | {wo['p99']:.3f} ms | "
        f"{wo['requests']:,} | {wo['wrong']} | {wo['not_200']} |",
        f"| **ratio** (with / without) | **{w['rps'] / wo['rps']:.2f}** | "
        f"{w['p50'] / wo['p50']:.2f} | {w['p99'] / wo['p99']:.2f} | | | |"]
    return "\n".join(lines)


def headline(r: FirstCallResult) -> list[tuple[str, str, str, str]]:
    """(what, value, target, verdict) rows for bench/report.py's summary table."""
    f, w, wo = r.first, r.hot("with"), r.hot("without")
    p99 = float(np.percentile(f.document_ms, 99)) if f.document_ms.size else float("nan")
    return [(f"first call after sandbox READY, {f.document_ms.size} pods: p99 to the "
             "credentials", f"{p99:.2f} ms", "< 10 ms",
             "✅" if p99 < 10 and not f.failed and not f.wrong else "❌"),
            ("hot path with / without --cri-endpoint: throughput; p50",
             f"{w['rps'] / wo['rps']:.2f}×; {w['p50'] / wo['p50']:.2f}×", "≈ 1.0", "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pods", type=int)
    ap.add_argument("--runtime", choices=("auto", "containerd", "fault"), default="auto")
    args = ap.parse_args(argv)
    r = run(runtime=args.runtime, pods=args.pods or (30 if args.quick else 200),
            rounds=1 if args.quick else 3, round_seconds=3.0 if args.quick else 8.0)
    print(markdown(r))
    return 1 if r.first.wrong or r.first.failed else 0


if __name__ == "__main__":
    sys.exit(main())
