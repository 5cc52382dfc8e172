"""How late the API learns a pod's address on a real node, and what a new pod's first SDK
call gets with the runtime view on and off (issue 13, tier 2).

Everything is real: the kube-apiserver and etcd of tests/k8s, a kubelet driving containerd
(tests/k8s/kubelet.py), pods whose app container is the AWS SDK for Go v2 (its default chain
ends at 169.254.169.254), the agent as the DaemonSet runs it (tests/k8s/kubelet_node.py).
Pods are created through the API with ``nodeName`` set, ``batch`` at a time, each with a
role of its own (so the agent's prefetch from the watch races the app's first call).

Per pod, on one clock (the machine's wall clock, which containerd, the Go client and the
test share):

* **podIP delay**: from the app container's start (containerd's ``started_at``) to the
  moment a watch on the API first shows ``status.podIP``: how long an agent that knows
  addresses only from the API is blind to a running pod;
* **first call**: what the app's first credential fetch got (its own role, checked by STS
  GetCallerIdentity and moto's record of the key; an error; or a wrong identity) and how
  long the SDK took, once with the agent's runtime view (``--cri-endpoint``, the default)
  and once with ``--cri-endpoint=none`` (addresses from the API only, as kube2iam).

Two kubelets, one after the other: an idle one with its defaults, and one whose API client
is throttled (``--kube-api-qps=2``), which is what makes real nodes report addresses seconds
late (../shared/reference/cri.md).

    sudo python bench/kubelet_timing.py [--pods 50] [--batch 10]

Needs root and the binaries of tests/k8s/build.sh, tests/cri/setup.sh, tests/sdk/build.sh.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("tests", "tests/k8s", "tests/e2e", "tests/cri"):
    sys.path.insert(0, str(ROOT / sub))

import kube  # noqa: E402
from kubelet_node import KubeletNode, PodIpWatch, go_time, missing_reason  # noqa: E402

# scenario -> the kubelet's extra flags. "throttled": the kubelet's API client limited to 2
# requests/s (its default is 50 since 1.27, 5 before): status updates queue behind each
# other, as on a node whose kubelet shares a busy API server's priority level.
SCENARIOS = {"idle": [], "throttled (--kube-api-qps=2)": ["--kube-api-qps=2",
                                                           "--kube-api-burst=2"]}
# mode -> (agent flags, tag of its pods' names and roles)
MODES = {"runtime view": ([], "rt"),
         "API only (--cri-endpoint=none)": (["--cri-endpoint=none"], "api")}


@dataclass
class PodTiming:
    started: float          # app container started (containerd), epoch seconds
    ip_in_api: float        # the API first showed status.podIP
    first_call: float       # the app's first credential fetch began
    outcome: str            # "own role", "error: ...", "WRONG: ..."
    sdk_seconds: float      # how long the SDK took to hand out credentials (or fail)


@dataclass
class ModeResult:
    scenario: str
    mode: str
    pods: list[PodTiming] = field(default_factory=list)

    @property
    def own(self) -> int:
        return sum(p.outcome == "own role" for p in self.pods)

    @property
    def wrong(self) -> int:
        return sum(p.outcome.startswith("WRONG") for p in self.pods)

    @property
    def errors(self) -> int:
        return len(self.pods) - self.own - self.wrong

    def delays_ms(self) -> list[float]:
        return [(p.ip_in_api - p.started) * 1e3 for p in self.pods]

    def before_api(self) -> int:
        return sum(p.first_call < p.ip_in_api for p in self.pods)


def _outcome(node: KubeletNode, pod, first: dict) -> str:
    key = first.get("AccessKeyId")
    if not key:
        return f"error: {first.get('error', '?')[:120]}"
    issued_for = node.sts.role_of(key)
    if issued_for != pod.role or f":assumed-role/{pod.role}/" not in first.get("Arn", ""):
        return f"WRONG: key for {issued_for!r}, STS says {first.get('Arn')!r}"
    return "own role"


def run_mode(node: KubeletNode, scenario: str, mode: str, *, pods: int, batch: int,
             log=print) -> ModeResult:
    flags, tag = MODES[mode]
    result = ModeResult(scenario, mode)
    agent = node.start_agent(extra_args=flags)
    try:
        made = 0
        with PodIpWatch(node) as ips:
            while made < pods:
                group = [node.create_pod(f"{tag}-{made + i}", role=f"{tag}-{made + i}")
                         for i in range(min(batch, pods - made))]
                made += len(group)
                for pod in group:
                    doc = pod.result(timeout=120)
                    first = doc["rounds"][0]
                    deadline = time.monotonic() + 10
                    while pod.uid not in ips.seen and time.monotonic() < deadline:
                        time.sleep(0.05)
                    result.pods.append(PodTiming(
                        started=node.container_started(pod),
                        ip_in_api=ips.seen.get(pod.uid, float("nan")),
                        first_call=go_time(first["at"]), outcome=_outcome(node, pod, first),
                        sdk_seconds=first.get("seconds", float("nan"))))
                for pod in group:
                    node.delete_pod(pod)
                log(f"  {scenario}, {mode}: {made}/{pods} pods")
    finally:
        agent.stop()
    return result


def run(*, pods: int = 50, batch: int = 10, scenarios: tuple[str, ...] = tuple(SCENARIOS),
        log=print) -> list[ModeResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="kf-kubelet-bench-") as tmp:
        with kube.running_cluster(Path(tmp) / "kube") as cluster:
            for n, scenario in enumerate(scenarios):
                node = KubeletNode(Path(tmp) / f"node-{n}", cluster, taint=False,
                                   kubelet_args=SCENARIOS[scenario])
                try:
                    results += [run_mode(node, scenario, mode, pods=pods, batch=batch,
                                         log=log) for mode in MODES]
                finally:
                    node.close()
    return results


def _q(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def markdown(results: list[ModeResult]) -> str:
    lines = ["| kubelet | container start → podIP in the API: median / p90 / max | agent | "
             "pods | first call: own role | error | wrong identity | asked before the API "
             "had the address | SDK time p50 / max |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        delays = [d for other in results if other.scenario == r.scenario
                  for d in other.delays_ms()]
        sdk = [p.sdk_seconds * 1e3 for p in r.pods]
        lines.append(
            f"| {r.scenario} | {statistics.median(delays):,.0f} / {_q(delays, 0.9):,.0f} / "
            f"{max(delays):,.0f} ms | {r.mode} | {len(r.pods)} | {r.own} | {r.errors} | "
            f"{r.wrong} | {r.before_api()} | {statistics.median(sdk):,.0f} / "
            f"{max(sdk):,.0f} ms |")
    errors = sorted({p.outcome for r in results for p in r.pods if p.outcome.startswith("error")})
    if errors:
        lines += ["", "Errors seen: " + "; ".join(f"`{e}`" for e in errors[:3])]
    return "\n".join(lines)


def headline(results: list[ModeResult]) -> list[tuple[str, str, str, str]]:
    rows = []
    for scenario in dict.fromkeys(r.scenario for r in results):
        mine = [r for r in results if r.scenario == scenario]
        delays = [d for r in mine for d in r.delays_ms()]
        rows.append((f"real kubelet, {scenario}: container start → podIP in the API "
                     "(median / max)", f"{statistics.median(delays):,.0f} / "
                     f"{max(delays):,.0f} ms", "measured", "ℹ️"))
        for r in mine:
            want = "all" if r.mode == "runtime view" else "measured"
            ok = r.own == len(r.pods) or r.mode != "runtime view"
            rows.append((f"real kubelet, {scenario}: first SDK call with its own role, "
                         f"{r.mode}", f"{r.own}/{len(r.pods)}", want, "✅" if ok else "❌"))
    wrong = sum(r.wrong for r in results)
    rows.append(("real kubelet: wrong identities", str(wrong), "0", "✅" if not wrong else "❌"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the per-pod figures here")
    args = parser.parse_args()
    reason = missing_reason()
    if reason:
        sys.exit(f"kubelet_timing: {reason}")
    results = run(pods=args.pods, batch=args.batch)
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps([{"scenario": r.scenario, "mode": r.mode,
                                          "pods": [asdict(p) for p in r.pods]}
                                         for r in results], indent=1))


if __name__ == "__main__":
    main()
