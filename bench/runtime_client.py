"""What one CRI client costs the control process: import, memory, threads, poll latency and
CPU per poll, against a real containerd with ``sandboxes`` READY sandboxes (110: the
kubelet's default maximum).

The client runs in a child process of its own (this process holds the harness's gRPC
channel to create the sandboxes), which imports `kiamfast.control.cri.poller` from the
checkout given with ``--tree NAME=PATH`` (default: this checkout), so two versions of the
client can be compared in one run, each round alternating between them:

* import: seconds to import the client module, and the child's peak RSS after it;
* first poll: ListPodSandbox plus one PodSandboxStatus per sandbox (8 at once);
* steady polls: ListPodSandbox only (every status is cached), p50 and p90 of ``polls``;
* CPU per steady poll (the child process's CPU time over all of them, every thread), and the
  threads of the child once it has polled (``/proc/self/task``).

    python bench/runtime_client.py [--sandboxes N] [--polls N] [--rounds N]
        [--runtime containerd|fault] [--tree NAME=PATH ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid

from benchutil import ROOT

import cri_node  # noqa: E402  (benchutil put the repo on sys.path)

_CHILD = r"""
import json, os, sys, time

def hwm_kib():   # the peak RSS of this process image (ru_maxrss keeps the forking parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
endpoint, polls = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
from kiamfast.control.cri import client as cri_client
imported = time.perf_counter() - t0
rss_import = hwm_kib()
client = cri_client.RuntimeClient(endpoint, timeout=10.0)
t0 = time.perf_counter()
view = client.poll()
first = time.perf_counter() - t0
times = []
cpu0 = time.process_time()
for _ in range(polls):
    t0 = time.perf_counter()
    client.poll()
    times.append(time.perf_counter() - t0)
cpu = time.process_time() - cpu0
print(json.dumps({"module": cri_client.__file__, "import_s": imported,
                  "rss_import_kib": rss_import, "first_poll_s": first,
                  "owners": len(view.owners), "steady_s": times, "cpu_per_poll_s": cpu / polls,
                  "threads": len(os.listdir("/proc/self/task")),
                  "rss_end_kib": hwm_kib()}))
client.close()
"""


def measure(tree: str, endpoint: str, polls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", _CHILD, endpoint, str(polls)], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout)
    if not result["module"].startswith(os.path.realpath(tree)):
        raise RuntimeError(f"imported {result['module']}, not from {tree}")
    return result


def summarize(runs: list[dict]) -> dict:
    steady = sorted(t for r in runs for t in r["steady_s"])
    med = lambda key: statistics.median(r[key] for r in runs)   # noqa: E731
    return {"import_ms": med("import_s") * 1e3, "rss_import_mib": med("rss_import_kib") / 1024,
            "rss_end_mib": med("rss_end_kib") / 1024, "first_poll_ms": med("first_poll_s") * 1e3,
            "steady_p50_ms": steady[len(steady) // 2] * 1e3,
            "steady_p90_ms": steady[int(len(steady) * 0.9)] * 1e3,
            "cpu_per_poll_ms": med("cpu_per_poll_s") * 1e3, "threads": med("threads"),
            "owners": runs[0]["owners"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=110)
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runtime", choices=("containerd", "fault"), default="containerd")
    ap.add_argument("--tree", action="append", default=[],
                    help="NAME=PATH of a checkout whose client is measured (repeatable)")
    args = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    node = cri_node.make_node(args.runtime, args.sandboxes)
    sandboxes = []
    try:
        for i in range(args.sandboxes):
            sandboxes.append(node.run_sandbox(i, name=f"bench-{i}", uid=uuid.uuid4().hex,
                                              annotations={"iam.amazonaws.com/role": f"r{i}"}))
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(measure(tree, node.endpoint, args.polls))
    finally:
        for sandbox in sandboxes:
            node.remove_sandbox(sandbox)
        node.close()
    print(f"{node.kind}; {args.sandboxes} READY sandboxes; medians of {args.rounds} child "
          f"processes, {args.polls} steady polls each\n")
    print("| client | import (ms) | peak RSS after import (MiB) | first poll (ms) | steady "
          "poll p50 / p90 (ms) | CPU per steady poll (ms) | threads | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, results in runs.items():
        s = summarize(results)
        assert s["owners"] >= args.sandboxes, s   # every sandbox seen
        print(f"| {name} | {s['import_ms']:.0f} | {s['rss_import_mib']:.1f} | "
              f"{s['first_poll_ms']:.1f} | {s['steady_p50_ms']:.2f} / {s['steady_p90_ms']:.2f}"
              f" | {s['cpu_per_poll_ms']:.2f} | {s['threads']:.0f} | {s['rss_end_mib']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
