"""docs/kube2iam-chart-values.md: every default of kiamfast's chart that differs from kube2iam's
charts, and why, generated from the charts themselves.

    python tests/deploy/kube2iam_values_table.py          # rewrites the page
    python tests/deploy/kube2iam_values_table.py --check  # exit 1 if the page is stale

Two tables. *Values*: every value of kube2iam-chart (its values.yaml, from kube2iam's source,
``$KUBE2IAM_SRC``) and of the kube2iam chart 3.2.0 (the stand-in's values.yaml,
tests/deploy/kube2iam-chart-3.2.0/) whose default kiamfast's values.yaml gives another default:
what a user gets for a value their file leaves out. *Rendered*: kube2iam-chart rendered by the
real helm with a values file holding every one of its defaults, and kiamfast's chart rendered
with that same file and ``kube2iamChart=kube2iam-chart``; each field of the DaemonSet, the
metrics Service and the ClusterRole that still differs is a row: what the same values render
differently. Every row needs its reason in REASONS (and every reason a row):
tests/deploy/test_kube2iam_values_table.py checks both and that the page is current.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PAGE = REPO / "docs" / "kube2iam-chart-values.md"
KIAMFAST = REPO / "deploy" / "chart" / "kiamfast"
KUBE2IAM_SRC = Path(os.environ.get("KUBE2IAM_SRC") or REPO.parent / "shared/peers/kube2iam")
KUBE2IAM_CHART = KUBE2IAM_SRC / "charts" / "kube2iam"
OLD_CHART = HERE / "kube2iam-chart-3.2.0"
RELEASE = "kube2iam"
ABSENT = object()

# Why each difference is there. Keys: a value's path (table "Values"), or a rendered field
# (table "Rendered": daemonset.*, pod.*, container.*, service.*, clusterRole.*).
REASONS = {
    # ---- values ----
    "image.repository": "`\"\"` is kiamfast's image; kube2iam's `jtblin/kube2iam` given here "
                        "is replaced by kiamfast's (the notes say so), a mirror of it refused",
    "image.tag": "`\"\"` is this chart's version; with `kube2iamChart` a tag without its "
                 "repository is refused: kube2iam's versions and kiamfast's overlap, so the "
                 "chart cannot tell which one a tag means",
    "lifecycle.preStop.exec.command": "kube2iam-chart's hook deletes the DNAT rule on every "
                                      "stop, so pods reach the node's own role until the next "
                                      "agent starts; kiamfast keeps the rule (fail closed). "
                                      "Given explicitly it is rendered, and the notes warn",
    "livenessProbe.initialDelaySeconds": "kiamfast is serving in about a second; its /healthz "
                                         "turns 500 only after the metadata check or the "
                                         "runtime link failed for a while, so a quicker first "
                                         "probe with more failures allowed restarts it only "
                                         "when a restart helps",
    "livenessProbe.periodSeconds": "see livenessProbe.initialDelaySeconds",
    "livenessProbe.failureThreshold": "see livenessProbe.initialDelaySeconds",
    "readinessProbe.periodSeconds": "/readyz turns ready once the DNAT rule is in and the "
                                    "node's pods and credentials are loaded; probing every "
                                    "2 s lets a rolling update move on sooner",
    "priorityClassName": "every pod's credentials on the node depend on the agent: it must "
                         "not be the pod the scheduler evicts or leaves pending",
    "rbac.create": "kiamfast also patches its own Node (the startup taint) and lists nodes "
                   "(the STS budget): its own ServiceAccount and ClusterRole carry exactly "
                   "that; with `false` the notes say what to grant",
    "updateStrategy": "kiamfast rolls the nodes itself: on each node the new pod starts "
                      "beside the old one and takes the node over without a refused call "
                      "(the surge handover); an explicit `OnDelete` is kept and the notes say "
                      "how to roll the nodes",
    "maxUnavailable": "0 with kiamfast's `maxSurge` (10%): the surge handover, no node without "
                      "an agent; a values file's own number other than 0 keeps kube2iam's "
                      "meaning (old pod first, a few seconds of refused calls) and the notes "
                      "say so",
    "tolerations": "an agent missing from a tainted node leaves that node's pods without "
                   "credentials; kiamfast tolerates every NoSchedule and NoExecute taint "
                   "(and its own startup taint); an explicit list is kept",
    # ---- rendered with the same values ----
    "container.image": "kiamfast's image replaces kube2iam's (image.repository above)",
    "container.args": "kiamfast's own flags after kube2iam's (workers, real-time workers, "
                      "startup taint, "
                      "runtime socket, table and token key in the node directory, the "
                      "handover socket and second port, the ready file, the socket keeper, "
                      "the DNAT rule kept in place), and `--host-ip` also without iptables",
    "container.env.HOST_IP": "the node's address either way (host network); kiamfast names "
                             "it by status.hostIP",
    "container.ports": "none declared: with host networking a declared port is a hostPort, "
                       "and the scheduler would keep the surge pod Pending beside the old "
                       "one (kubernetes#106417); the metrics Service targets it by number",
    "container.readinessProbe.exec.command": "the pod's own ready file, there exactly while "
                                             "its own control process is ready (the DNAT rule "
                                             "in, the node's pods and credentials loaded): "
                                             "during a handover two pods serve one port, and "
                                             "an HTTP probe cannot tell which one answered; "
                                             "/healthz is liveness",
    "container.readinessProbe.httpGet.path": "see container.readinessProbe.exec.command",
    "container.readinessProbe.httpGet.port": "see container.readinessProbe.exec.command",
    "container.readinessProbe.httpGet.scheme": "see container.readinessProbe.exec.command",
    "container.resources": "`{}` means kiamfast's default, not none: small requests (20m CPU, "
                           "64Mi), so a surge pod fits beside the old one without preempting "
                           "a workload, and a memory limit from the measured RSS (2 x (128Mi "
                           "+ 32Mi per worker): the shared table lives in the pod's memory); "
                           "no CPU limit",
    "container.securityContext": "NET_ADMIN and NET_RAW as root instead of privileged (and "
                                 "with iptables off too: kube2iam rendered none then), "
                                 "SYS_NICE for the real-time workers (realtimeWorkers)",
    "container.volumeMounts": "the node directory with the credential table and token key, "
                              "/tmp, the xtables lock shared with kube-proxy, the pod's own "
                              "directory (ready file, socket keeper), the container "
                              "runtime's socket directory (read-only)",
    "pod.containers": "the socket keeper beside the agent: it holds the listening sockets "
                      "while the agent's container restarts, so pods' calls wait instead of "
                      "being refused",
    "pod.volumes": "see container.volumeMounts",
    "pod.dnsPolicy": "the agent needs no cluster DNS, and the node's resolver works before "
                     "CoreDNS can run on a still-tainted node",
    "pod.terminationGracePeriodSeconds": "said explicitly (30 s, the API's default): the "
                                         "agent stops cleanly within it",
    "pod.tolerations": "kiamfast's startup taint is always tolerated: the agent removes it",
    "clusterRole.rules": "get and patch its own Node (startup taint), list nodes (STS "
                         "budget), besides kube2iam's pods and namespaces",
}


def helm_binary() -> str:
    build = (REPO / "tests" / "tools" / "build_helm.sh").read_text()
    version = next(line.split("=", 1)[1] for line in build.splitlines()
                   if line.startswith("HELM_VERSION="))
    tools = Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")
    return str(tools / f"helm-{version}" / "helm")


def render(chart: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(values, f)
        f.flush()
        env = dict(os.environ, KUBECONFIG=os.devnull)
        result = subprocess.run([helm_binary(), "template", RELEASE, str(chart), "--namespace",
                                 "kube-system", "-f", f.name], capture_output=True, text=True,
                                env=env, timeout=60)
    if result.returncode:
        raise RuntimeError(result.stderr)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """path -> value of every leaf (an empty map or list is a leaf)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def lookup(tree: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return ABSENT
        tree = tree[part]
    return tree


def show(value: Any) -> str:
    if value is ABSENT:
        return "—"
    text = json.dumps(value, separators=(", ", ": "), sort_keys=True)
    text = (text if len(text) <= 90 else text[:87] + "…").replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def value_rows() -> list[tuple[str, str, str, str]]:
    new = yaml.safe_load((KUBE2IAM_CHART / "values.yaml").read_text())
    old = yaml.safe_load((OLD_CHART / "values.yaml").read_text())
    ours = yaml.safe_load((KIAMFAST / "values.yaml").read_text())
    rows = []
    for path in sorted(set(leaves(new)) | set(leaves(old))):
        theirs = [v for v in (lookup(new, path), lookup(old, path)) if v is not ABSENT]
        mine = lookup(ours, path)
        if any(json.dumps(t, sort_keys=True) != json.dumps(mine, sort_keys=True, default=str)
               for t in theirs):
            rows.append((path, show(lookup(new, path)), show(lookup(old, path)), show(mine)))
    return rows


def _by_name(items: list[Any]) -> Any:
    """A list of named maps as a map by name (env, volumes, mounts), else the list."""
    if items and all(isinstance(i, dict) and "name" in i for i in items):
        return {i["name"]: {k: v for k, v in i.items() if k != "name"} for i in items}
    return items


def fields(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rendered fields the table compares, by row key."""
    out: dict[str, Any] = {}
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    for key, value in ds["spec"].items():
        if key not in ("template", "selector"):
            out[f"daemonset.{key}"] = value
    pod = ds["spec"]["template"]["spec"]
    for key, value in pod.items():
        if key != "containers":
            out[f"pod.{key}"] = value
    out["pod.containers"] = [c["name"] for c in pod["containers"]]
    container = pod["containers"][0]   # the agent's (kiamfast's socket keeper is beside it)
    for key, value in container.items():
        if key == "env":
            for name, var in _by_name(value).items():
                out[f"container.env.{name}"] = var
        elif key == "readinessProbe":
            for path, leaf in leaves(value).items():
                out[f"container.readinessProbe.{path}"] = leaf
        else:
            out[f"container.{key}"] = value
    for obj in objs:
        if obj["kind"] == "Service":
            out["service.spec"] = obj["spec"]
        if obj["kind"] == "ClusterRole":
            out["clusterRole.rules"] = obj["rules"]
    return out


def rendered_rows() -> list[tuple[str, str, str]]:
    values = yaml.safe_load((KUBE2IAM_CHART / "values.yaml").read_text())
    values["rbac"]["create"] = True
    values["prometheus"]["service"]["enabled"] = True
    theirs = fields(render(KUBE2IAM_CHART, values))
    ours = fields(render(KIAMFAST, {**values, "kube2iamChart": "kube2iam-chart"}))
    rows = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key, ABSENT), ours.get(key, ABSENT)
        if json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True,
                                                                        default=str):
            if isinstance(a, list) and isinstance(b, list) and \
                    all(isinstance(x, str) for x in a + b):
                added = [x for x in b if x not in a]
                dropped = [x for x in a if x not in b]
                rows.append((key, show(dropped) if dropped else "", "adds " + show(added)))
            else:
                rows.append((key, show(a), show(b)))
    return rows


def build() -> str:
    values, rendered = value_rows(), rendered_rows()
    lines = [
        "# kube2iam's chart values in kiamfast's chart: the defaults that differ",
        "",
        "Generated by `tests/deploy/kube2iam_values_table.py` from kube2iam-chart (kube2iam's",
        "source, commit 4c4a2b4), the kube2iam chart 3.2.0's defaults",
        "(`tests/deploy/kube2iam-chart-3.2.0/values.yaml`) and `deploy/chart/kiamfast`; a test",
        "regenerates it. Every value means what it meant in kube2iam's charts or the render",
        "fails with the reason (docs/switching-from-kube2iam.md). A value your file sets is used as you set",
        "it; one it leaves out gets kiamfast's default:",
        "",
        "| Value | kube2iam-chart | kube2iam 3.2.0 | kiamfast | Why |",
        "| --- | --- | --- | --- | --- |",
        *(f"| `{p}` | {a} | {b} | {c} | {REASONS.get(p, '**no reason yet**')} |"
          for p, a, b, c in values),
        "",
        "The kube2iam chart 2.x had `probe` (true/false, or from 2.5.1 a map of `enabled` and",
        "the timings) for the liveness probe, at kube2iam's timings (30 s, every 5 s, 3",
        "failures): kiamfast reads it so. Its 2.x had no readiness probe: kiamfast's is",
        "`/readyz` (below).",
        "",
        "With `kube2iamChart` the DaemonSet, its selector, its container's name (`kube2iam`),",
        "the metrics Service (name and kind: a cluster IP), the ServiceAccount, ClusterRole,",
        "binding, Secret and ServiceMonitor keep that chart's names. What the same values (a",
        "file holding every kube2iam-chart default, with `rbac.create` and",
        "`prometheus.service.enabled` on) render differently:",
        "",
        "| Rendered | kube2iam-chart | kiamfast | Why |",
        "| --- | --- | --- | --- |",
        *(f"| `{k}` | {a} | {b} | {REASONS.get(k, '**no reason yet**')} |"
          for k, a, b in rendered),
        "",
    ]
    return "\n".join(lines)


def rows() -> list[str]:
    return [r[0] for r in value_rows()] + [r[0] for r in rendered_rows()]


def main(argv: list[str]) -> int:
    text = build()
    if "--check" in argv:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is stale: run python {Path(__file__).relative_to(REPO)}")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
