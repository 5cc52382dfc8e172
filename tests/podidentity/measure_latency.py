"""Figures for the container-credentials front end (not a test: `python3 tests/podidentity/
measure_latency.py`, with KIAMFAST_TOOLS set as for the tests).

Against the real kube-apiserver and the whole agent on loopback, one new connection per
request, as an SDK's refresh makes:

* first call of a token (paced under the per-address review budget): the TokenReview
  plus the answer (the pod's credentials already
  prefetched, as they are once the watch has delivered the pod);
* cached call: the same token again (no review);
* both again while other clients flood the listener with tokens that are refused without a
  review (not JWTs), to see what a hostile pod costs the others.
"""
from __future__ import annotations

import http.client
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "k8s")]

import kube  # noqa: E402
from agent_process import Agent, free_port  # noqa: E402
from conftest import RealCluster, agent_kubeconfig  # noqa: E402
from podid import create_pod, create_service_account, pod_token  # noqa: E402


def ask(port: int, token: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v1/credentials", headers={"Authorization": token})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def timed(port: int, token: str) -> float:
    start = time.perf_counter()
    status = ask(port, token)
    elapsed = time.perf_counter() - start
    assert status == 200, status
    return elapsed * 1000


def summary(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return (f"{name}: n={len(ms)} p50={pick(0.5):.2f} ms p90={pick(0.9):.2f} ms "
            f"max={ms[-1]:.2f} ms")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0    # utime + stime, in clock ticks


def flood(port: int, stop: threading.Event, counts: list[int]) -> None:
    while not stop.is_set():
        try:
            ask(port, "garbage-" + secrets.token_hex(8))
            counts[0] += 1
        except OSError:
            pass


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="podid-measure-"))
    with kube.running_cluster(work / "kube") as cluster:
        peers = RealCluster(agent_kubeconfig(cluster))
        admin = cluster.admin
        admin.create_node("n1")
        admin.create_namespace("ns")
        create_service_account(admin, "ns", "app")
        port = free_port()
        agent = Agent(peers, work / "agent", extra=[
            "--node=n1", f"--container-credentials-addr=127.0.0.1:{port}"])
        try:
            agent.wait_ready()
            uid = create_pod(admin, "ns", "app", node="n1", sa="app", ip="10.250.0.1",
                             role="role-a")
            token = pod_token(admin, "ns", "app", "app", uid)
            deadline = time.monotonic() + 15
            while ask(port, token) != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            control = agent.children("kiamfast.control")[0]
            for label in ("idle", "flooded"):
                stop, counts = threading.Event(), [0]
                threads = [threading.Thread(target=flood, args=(port, stop, counts))
                           for _ in range(4 if label == "flooded" else 0)]
                for t in threads:
                    t.start()
                began, cpu = time.monotonic(), cpu_seconds(control)
                fresh = [pod_token(admin, "ns", "app", "app", uid) for _ in range(30)]
                first = []
                for t in fresh:      # paced under the address's review budget (2/s)
                    first.append(timed(port, t))
                    time.sleep(0.5)
                cached = [timed(port, token) for _ in range(300)]
                stop.set()
                for t in threads:
                    t.join()
                wall = time.monotonic() - began
                share = 100 * (cpu_seconds(control) - cpu) / wall
                print(f"{label}: control process CPU {share:.0f} % over {wall:.1f} s")
                print(summary(f"{label} first call (TokenReview)", first))
                print(summary(f"{label} cached call", cached))
                if threads:
                    print(f"flood: {counts[0] / wall:.0f} refused "
                          f"requests/s from 4 clients")
        finally:
            agent.stop()
            peers.stop()


if __name__ == "__main__":
    main()
