"""What the route watch (kiamfast/control/cri/routes.py) costs the control process on a node
with ``pods`` pods routed as the CNI ``ptp`` plugin routes them (a veth per pod, the peer in
the pod's namespace, the gateway address and a /32 host route on the host end; IPv6
link-local routes as the kernel adds them), in a host namespace of its own (root).

Measured: ``open`` (subscribe and the first dumps of links, routes and rules), a
``refresh`` after one pod started (its notifications read, then links and routes dumped
again: what the control process does before each runtime view that follows a change), the
same ``refresh`` with nothing changed (each view of a quiet node, and each failed attempt
of an outage), and one pass of ``path_kept`` over every pod address (what the ownership
model asks after each change during an outage).  Medians and p90 over ``rounds``.

    python bench/host_routes.py [--pods 250] [--rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import statistics
import subprocess
import threading
import time

from kiamfast.control.cri.routes import RouteWatch

_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(name: str, fn):
    box = {}

    def body():
        fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            if _libc.setns(fd, 0x40000000) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            box["v"] = fn()
        finally:
            os.close(fd)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return box["v"]


def ip_batch(netns: str, lines: list[str]) -> None:
    subprocess.run(["ip", "-n", netns, "-batch", "-"], input="\n".join(lines) + "\n",
                   text=True, check=True)


def address(n: int) -> str:
    return f"10.9.{n // 200}.{n % 200 + 1}"


def pod_lines(n: int, netns: str) -> list[str]:
    return [f"link add kfv{n} type veth peer name eth0 netns {netns}",
            f"addr add 10.9.255.1/32 dev kfv{n}",            # ptp's gateway, on every end
            f"link set kfv{n} up",
            f"route add {address(n)}/32 dev kfv{n} scope host"]


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=250)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    tag = f"kf-rtb-{os.getpid()}-{secrets.token_hex(2)}"
    host, pods = f"{tag}-h", [f"{tag}-{n}" for n in range(args.pods + args.rounds)]
    made = []
    try:
        for name in [host, *pods]:
            subprocess.run(["ip", "netns", "add", name], check=True)
            made.append(name)
        ip_batch(host, [line for n in range(args.pods) for line in pod_lines(n, pods[n])])
        for name in pods[:args.pods]:                       # the pods' ends up: carrier
            ip_batch(name, ["link set eth0 up"])
        time.sleep(1.0)                                     # IPv6 link-local settles
        opens, idle, after_start, asks = [], [], [], []
        for r in range(args.rounds):
            w = RouteWatch()
            t0 = time.perf_counter()
            assert in_netns(host, w.open)
            opens.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            w.refresh()
            idle.append(time.perf_counter() - t0)
            n = args.pods + r                               # one more pod starts
            ip_batch(host, pod_lines(n, pods[n]))
            ip_batch(pods[n], ["link set eth0 up"])
            t0 = time.perf_counter()
            w.refresh()
            after_start.append(time.perf_counter() - t0)
            since = time.monotonic_ns()
            t0 = time.perf_counter()
            kept = [w.path_kept(address(i), since) for i in range(args.pods)]
            asks.append(time.perf_counter() - t0)
            assert kept == [True] * args.pods, kept
            w.close()
        routes = sum(len(subprocess.run(["ip", "-n", host, *family, "-o", "route", "show",
                                         "table", "all"], capture_output=True,
                                        text=True).stdout.splitlines())
                     for family in (["-4"], ["-6"]))
        print(f"{args.pods} pods ({routes} IPv4 and IPv6 routes in all tables), "
              f"{args.rounds} rounds")
        for what, values in (("open (subscribe + first dumps)", opens),
                             ("refresh, nothing changed", idle),
                             ("refresh after one pod started", after_start),
                             (f"path_kept x {args.pods}", asks)):
            print(f"  {what:34s} median {statistics.median(values) * 1e3:7.2f} ms"
                  f"   p90 {pct(values, 0.9) * 1e3:7.2f} ms")
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


if __name__ == "__main__":
    main()
