"""What the kernel's proof of address ownership costs the control process
(kiamfast/control/netns/watch.py): ``pods`` network namespaces with a veth each, in a node
namespace of their own, the watch opened there.

Reported (median and p90 over ``--rounds``): opening the watch (subscribe, dump the node's
addresses and every nsid's); resolving every sandbox's namespace from its path the first
time (open, nsid, address dump: what a restart's first poll pays); one pod starting (its
namespace made, an address added: the notifications, then the refresh that reads them and
resolves its sandbox); a refresh with nothing changed (each quiet poll, each failed
attempt); one pass of ``addresses_of`` over every sandbox (what the model does after a
change).  Needs root.  ``python bench/netns_watch.py --pods 250``.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kiamfast.control.netns.watch import NetnsWatch  # noqa: E402

CLONE_NEWNET = 0x40000000


def ip_batch(lines: list[str]) -> None:
    for line in lines:
        subprocess.run(["ip", *line.split()], check=True, capture_output=True)


def ms(samples: list[float]) -> str:
    samples = sorted(samples)
    p90 = samples[min(len(samples) - 1, int(len(samples) * 0.9))]
    return f"{statistics.median(samples) * 1e3:.3f} ms (p90 {p90 * 1e3:.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=250)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    tag = f"{os.getpid()}"
    node = f"kfb-node-{tag}"
    names = [f"kfb-{tag}-{i}" for i in range(args.pods + args.rounds)]
    subprocess.run(["ip", "netns", "add", node], check=True)
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        fd = os.open(f"/var/run/netns/{node}", os.O_RDONLY)
        assert libc.setns(fd, CLONE_NEWNET) == 0
        os.close(fd)

        def make(i: int) -> list[str]:
            a, b = divmod(i, 250)
            return [f"netns add {names[i]}",
                    f"link add kfb{i} type veth peer name eth0 netns {names[i]}",
                    f"-n {names[i]} link set eth0 up",
                    f"-n {names[i]} addr add 10.{a}.{b}.2/32 dev eth0",
                    f"-n {names[i]} addr add fd00:{a:x}::{b + 2:x}/128 dev eth0 nodad"]

        ip_batch([line for i in range(args.pods) for line in make(i)])
        sandboxes = [SimpleNamespace(id=f"sb{i}", netns=f"/var/run/netns/{names[i]}")
                     for i in range(args.pods)]
        opens, resolves, starts, idles, passes = [], [], [], [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            watch = NetnsWatch()
            watch.open()
            t1 = time.perf_counter()
            watch.track(sandboxes)
            t2 = time.perf_counter()
            opens.append(t1 - t0)
            resolves.append(t2 - t1)
            for _ in range(5):
                t = time.perf_counter()
                watch.refresh()
                idles.append(time.perf_counter() - t)
                t = time.perf_counter()
                held = [watch.addresses_of(s) for s in sandboxes]
                passes.append(time.perf_counter() - t)
                assert all(h and len(h) == 2 for h in held), held[:3]
            i = args.pods + r
            ip_batch(make(i))
            new = SimpleNamespace(id=f"sb{i}", netns=f"/var/run/netns/{names[i]}")
            t = time.perf_counter()
            watch.refresh()
            watch.track([*sandboxes, new])
            starts.append(time.perf_counter() - t)
            assert watch.addresses_of(new) and len(watch.addresses_of(new)) == 2
            watch.close()
        print(f"# netns watch, {args.pods} pods (2 addresses each), {args.rounds} rounds")
        print(f"| open (subscribe, dumps) | {ms(opens)} |")
        print(f"| resolve every sandbox the first time | {ms(resolves)} |")
        print(f"| a pod started: notifications read, its sandbox resolved | {ms(starts)} |")
        print(f"| refresh with nothing changed | {ms(idles)} |")
        print(f"| addresses_of over every sandbox | {ms(passes)} |")
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        subprocess.run(["ip", "netns", "del", node], capture_output=True)
        ip_batch([f"netns del {n}" for n in names if os.path.exists(f"/var/run/netns/{n}")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
