"""The pod watch's cost: event-to-table latency, sync time, control-side memory.

The watcher (model, real table, kubelet client) runs in a child process against the API
server emulator in this process; this process changes pods, reads the shared table as a
worker would, and measures:

1. **Event-to-table latency**: from the emulator change to the address visible in the table
   (read side spinning on the table).  Baseline in the same run: a raw watch consumer
   (urllib3 stream + orjson, nothing else) in this process seeing the same event.  The
   ratio is what the watcher, the ownership model and the table write add on top of
   getting the event at all.
2. **Sync time** for 110 and 250 pods on the node (40 roles): from the watcher's start to
   `synced` (lists applied, credentials acquired, table written).  Baseline: one raw LIST of
   the same pods parsed with orjson.
3. **Control-side RSS**: the child's resident memory after sync, and what the watch adds
   over the same process with the imports done but nothing started.

``python bench/watch_cost.py`` prints the markdown tables; tests/bench/test_bench_watch.py
runs a small version and checks correctness only, never timing.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NODE = "bench-node"
ROLE_KEY = "iam.amazonaws.com/role"
BASE = "arn:aws:iam::123456789012:role/"


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# ---- the child: the control side ---------------------------------------------------------------

def child_main(url: str, token: str, table_path: str) -> None:
    import asyncio
    import importlib

    from kiamfast import table as tablemod
    from kiamfast.control.mappings.model import NodeModel
    from kiamfast.control.k8s.source import ApiSource
    from kiamfast.control.mappings.policy import RolePolicy

    class Sink:   # stands in for the credential manager: one slot per role
        def __init__(self):
            self.slots = {}

        def acquire(self, uid, req):
            return self.slots.setdefault(req.role_arn, len(self.slots))

        def release(self, uid):
            pass

        def role_of_slot(self, slot):
            return None

    rss_base = _rss_kb()
    importlib.import_module("kiamfast.kube.client")  # the client's own cost, measured apart
    rss_imports = _rss_kb()
    table = tablemod.Table.attach(table_path, writer=True)

    async def main():
        model = NodeModel(policy=RolePolicy(base_role_arn=BASE), table=table, sink=Sink())
        watcher = ApiSource.connect(api_server=url, api_token=token, model=model, node=NODE)
        task = asyncio.create_task(watcher.run())
        await watcher.wait_synced(60)
        print(json.dumps({"synced": watcher.sync_seconds, "pods": len(model.pods),
                          "rss_base_kb": rss_base, "rss_imports_kb": rss_imports,
                          "rss_kb": _rss_kb()}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)   # until the parent closes stdin
        print(json.dumps({"rss_end_kb": _rss_kb(), "pods_end": len(model.pods),
                          "synced_end": watcher.synced.is_set(), "stats": watcher.stats()},
                         default=str), flush=True)
        await watcher.stop()
        await task

    asyncio.run(main())


# ---- the parent: emulator, read side, baselines -------------------------------------------------

class RawWatch(threading.Thread):
    """Baseline: the cheapest possible consumer of the same watch stream."""

    def __init__(self, url: str, token: str, rv: str):
        super().__init__(daemon=True)
        import urllib3
        self.http = urllib3.PoolManager()
        self.url = (f"{url}/api/v1/pods?watch=1&allowWatchBookmarks=true&resourceVersion={rv}"
                    f"&fieldSelector=spec.nodeName%3D{NODE}")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.seen: dict[str, float] = {}
        self.resp = None

    def run(self):
        import orjson
        self.resp = self.http.request("GET", self.url, headers=self.headers,
                                      preload_content=False)
        buf = b""
        try:
            for chunk in self.resp.stream(65536):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line:
                        continue
                    ev = orjson.loads(line)
                    st = (ev.get("object") or {}).get("status") or {}
                    if st.get("podIP"):
                        name = ev["object"]["metadata"]["name"]
                        self.seen.setdefault(name, time.perf_counter())
        except Exception:  # noqa: BLE001 - ends when the parent shuts the stream
            pass


def raw_list_seconds(url: str, token: str) -> float:
    import orjson
    import urllib3
    http = urllib3.PoolManager()
    t0 = time.perf_counter()
    r = http.request("GET", f"{url}/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE}",
                     headers={"Authorization": f"Bearer {token}"})
    assert len(orjson.loads(r.data)["items"]) > 0
    return time.perf_counter() - t0


def measure(n_pods: int, *, samples: int = 100) -> dict:
    from kiamfast import table as tablemod
    from kiamfast.testing.apiserver import ApiServer

    srv = ApiServer(token="bench-token", bookmark_interval=1.0).start()
    srv.nodes.add(NODE)
    fd, table_path = tempfile.mkstemp(prefix="kiamfast-bench-watch-",
                                      dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    table = tablemod.Table.create(table_path, ip_capacity=4096, cred_capacity=64,
                                  value_size=1024, aux_count=1, aux_size=1024, max_workers=1)
    proc = None
    try:
        for i in range(n_pods):
            srv.pods.create("default", f"pod-{i}", node=NODE, phase="Running",
                            ips=[f"10.50.{i // 250}.{i % 250}"],
                            annotations={ROLE_KEY: f"role-{i % 40}"})
        for i in range(samples):
            srv.pods.create("default", f"late-{i}", node=NODE, annotations={ROLE_KEY: "late"})
        list_s = raw_list_seconds(srv.url, srv.token)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", srv.url, srv.token, table_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        first = json.loads(proc.stdout.readline())
        raw = RawWatch(srv.url, srv.token, srv.resource_version)
        raw.start()
        srv.traffic.wait_watches(2, node=NODE, timeout=5)
        reader = tablemod.Table.attach(table_path, writer=False)
        table_lat, raw_lat = [], []
        for i in range(samples):
            ip = f"10.60.{i // 250}.{i % 250}"
            key = tablemod.ip_key(ip)
            t0 = time.perf_counter()
            srv.pods.set_ips("default", f"late-{i}", [ip])
            deadline = t0 + 5
            while reader.lookup_pod(key) is None:
                if time.perf_counter() > deadline:
                    raise AssertionError(f"{ip} never reached the table")
                time.sleep(0.00005)
            table_lat.append(time.perf_counter() - t0)
            end = time.perf_counter() + 1
            while f"late-{i}" not in raw.seen and time.perf_counter() < end:
                time.sleep(0.0001)
            raw_lat.append(raw.seen.get(f"late-{i}", t0) - t0)
            time.sleep(0.002)
        proc.stdin.close()
        last = json.loads(proc.stdout.readline())
        proc.wait(10)
        reader.close()
        if raw.resp is not None:
            raw.resp.shutdown()
        return {"pods": n_pods, "sync_s": first["synced"], "list_s": list_s,
                "rss_kb": first["rss_kb"], "rss_imports_kb": first["rss_imports_kb"],
                "rss_base_kb": first["rss_base_kb"],
                "rss_end_kb": last["rss_end_kb"], "table_lat": table_lat, "raw_lat": raw_lat,
                "stats": last["stats"], "pods_end": last["pods_end"],
                "synced_end": last["synced_end"]}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        table.close()
        os.unlink(table_path)
        srv.stop()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(results: list[dict]) -> str:
    out = ["### Event-to-table latency (emulator change -> address visible in the table)", "",
           "| pods | p50 table | p99 table | p50 raw watch | p50 ratio |",
           "|---:|---:|---:|---:|---:|"]
    for r in results:
        t50, r50 = statistics.median(r["table_lat"]), statistics.median(r["raw_lat"])
        out.append(f"| {r['pods']} | {t50 * 1e3:.2f} ms | {_pct(r['table_lat'], 0.99) * 1e3:.2f} ms"
                   f" | {r50 * 1e3:.2f} ms | {t50 / r50 if r50 > 0 else float('nan'):.2f} |")
    out += ["", "### Sync time (watcher start -> synced) and control-side memory", "",
            "| pods | sync | raw LIST + parse | ratio | RSS after sync | kubernetes import |"
            " watch + model state |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        out.append(f"| {r['pods']} | {r['sync_s'] * 1e3:.1f} ms | {r['list_s'] * 1e3:.1f} ms | "
                   f"{r['sync_s'] / r['list_s']:.1f} | {r['rss_kb'] / 1024:.1f} MiB | "
                   f"{(r['rss_imports_kb'] - r['rss_base_kb']) / 1024:.1f} MiB | "
                   f"{(r['rss_kb'] - r['rss_imports_kb']) / 1024:.1f} MiB |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(*sys.argv[2:5])
    else:
        print(report([measure(110, samples=200), measure(250, samples=200)]))
