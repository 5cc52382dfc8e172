"""kiamfast.kube against the ``kubernetes`` package: what the control process pays to
import its API client, and to list and watch a node's pods on a real kube-apiserver.

Each figure is one fresh process (``python -c``), measured from inside (import time with
perf_counter, peak RSS from VmHWM) and from outside (wall time to exit). Runs of the
variants are interleaved, ``--runs`` of each, and the median is reported; the machine is
shared, so read the ratios, not the absolute times.

* ``bare``: the interpreter alone; ``asyncio+ssl+orjson``: the floor of any asyncio TLS
  client that parses JSON.
* ``kiamfast.kube``: ``import kiamfast.kube.client, kiamfast.kube.config``.
* ``kubernetes``: ``from kubernetes import client, config`` (what control/pods.py imports).
* ``list+watch``: load the kubeconfig (the agent's ServiceAccount token, the test CA), LIST
  the node's pods by field selector (250 pods), then WATCH from resourceVersion 0 and read
  until 250 ADDED events arrived; each line parsed with orjson, both ways, as pods.py does.

    python bench/kube_client.py [--runs 7] [--pods 250]

Needs the kube-apiserver and etcd of ``bash tests/k8s/build.sh``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchutil import ROOT, child_env, median

sys.path.insert(0, str(ROOT / "tests" / "k8s"))

PROBE = textwrap.dedent("""\
    import sys, time, json
    started = time.perf_counter()
    {imports}
    imported = time.perf_counter() - started
    out = {{"import_s": imported}}
    {work}
    # VmHWM: this process's own peak (ru_maxrss can carry the parent's over fork + exec).
    out["peak_rss_kib"] = next(int(l.split()[1]) for l in open("/proc/self/status")
                               if l.startswith("VmHWM:"))
    print(json.dumps(out))
    """)

KUBE_WORK = textwrap.dedent("""\
    import asyncio, orjson
    async def main():
        client = Client(load_config(kubeconfig=sys.argv[1], environ={}))
        t = time.perf_counter()
        body = (await client.request("GET", "/api/v1/pods", params={
            "fieldSelector": "spec.nodeName=" + sys.argv[2]})).json()
        out["list_s"] = time.perf_counter() - t
        out["listed"] = len(body["items"])
        t = time.perf_counter()
        seen = 0
        async with client.stream("/api/v1/pods", params={
                "watch": True, "resourceVersion": "0", "allowWatchBookmarks": True,
                "fieldSelector": "spec.nodeName=" + sys.argv[2]}) as s:
            async for line in s.lines():
                if orjson.loads(line)["type"] == "ADDED":
                    seen += 1
                    if seen == out["listed"]:
                        break
        out["watch_s"] = time.perf_counter() - t
        await client.close()
    asyncio.run(main())
    """)

KUBERNETES_WORK = textwrap.dedent("""\
    import orjson
    cfg = client.Configuration()
    config.load_kube_config(config_file=sys.argv[1], client_configuration=cfg)
    core = client.CoreV1Api(client.ApiClient(cfg))
    t = time.perf_counter()
    resp = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=" + sys.argv[2],
                                            _preload_content=False)
    body = orjson.loads(resp.data)
    resp.release_conn()
    out["list_s"] = time.perf_counter() - t
    out["listed"] = len(body["items"])
    t = time.perf_counter()
    resp = core.list_pod_for_all_namespaces(
        field_selector="spec.nodeName=" + sys.argv[2], watch=True, resource_version="0",
        allow_watch_bookmarks=True, _preload_content=False)
    seen, buf = 0, b""
    for chunk in resp.stream(65536):
        buf += chunk
        *lines, buf = buf.split(b"\\n")
        for line in lines:
            if line.strip() and orjson.loads(line)["type"] == "ADDED":
                seen += 1
        if seen >= out["listed"]:
            break
    resp.close()
    out["watch_s"] = time.perf_counter() - t
    """)

KUBE_IMPORTS = "from kiamfast.kube.client import Client\nfrom kiamfast.kube.config import load_config"
KUBERNETES_IMPORTS = "from kubernetes import client, config"

VARIANTS = {
    "bare": ("pass", ""),
    "asyncio+ssl+orjson": ("import asyncio, ssl, orjson", ""),
    "kiamfast.kube": (KUBE_IMPORTS, ""),
    "kubernetes": (KUBERNETES_IMPORTS, ""),
    "kiamfast.kube list+watch": (KUBE_IMPORTS, KUBE_WORK),
    "kubernetes list+watch": (KUBERNETES_IMPORTS, KUBERNETES_WORK),
}


def probe(name: str, args: list[str]) -> dict:
    imports, work = VARIANTS[name]
    code = PROBE.format(imports=imports, work=work)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *args], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--pods", type=int, default=250)
    opts = ap.parse_args()
    import kube
    reason = kube.missing_binaries()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with kube.running_cluster(Path(tempfile.mkdtemp(prefix="kiamfast-kube-bench-"))) as cluster:
        node, ns = "bench-node", "bench"
        cluster.admin.create_node(node)
        cluster.admin.create_namespace(ns)
        for i in range(opts.pods):
            cluster.admin.create_pod(ns, f"pod-{i}", node=node)
        args = [str(cluster.agent_kubeconfig), node]
        for _ in range(opts.runs):
            for name in VARIANTS:
                results[name].append(probe(name, args))
    print(f"{'variant':28s} {'import ms':>10s} {'peak MiB':>9s} {'list ms':>8s} "
          f"{'watch ms':>9s} {'process ms':>11s}   (median of {opts.runs}, {opts.pods} pods)")
    for name, runs in results.items():
        def med(key: str, scale: float) -> str:
            values = [r[key] for r in runs if key in r]
            return f"{median(values) * scale:.1f}" if values else "-"
        if any("listed" in r and r["listed"] != opts.pods for r in runs):
            raise RuntimeError(f"{name} listed {[r.get('listed') for r in runs]}")
        print(f"{name:28s} {med('import_s', 1000):>10s} {med('peak_rss_kib', 1 / 1024):>9s} "
              f"{med('list_s', 1000):>8s} {med('watch_s', 1000):>9s} {med('wall_s', 1000):>11s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
