"""The manifests in deploy/ are what a user applies; check them the way a cluster would.

Every rendered object is validated against the Kubernetes 1.30 OpenAPI schema in strict mode
(unknown fields are errors), the DaemonSet's args are parsed by our own CLI parser after the
kubelet's ``$(VAR)`` expansion, the DaemonSet tolerates the startup taint the agent removes,
and the ClusterRole grants every call the agent makes.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
from kustomize_lite import apply_json_patch, render

from kiamfast.cli import parse_args
from kiamfast.config import FLAGS_BY_NAME

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = ["deploy/base", "deploy/overlays/eks", "deploy/overlays/kube2iam",
                  "deploy/overlays/kube2iam-name-label"]

# What the downward API would give a pod on a typical EKS node.
FIELD_VALUES = {
    "status.hostIP": "10.0.1.23",
    "status.hostIPs": "10.0.1.23,2600:1f18:abcd::17",
    "spec.nodeName": "ip-10-0-1-23.ec2.internal",
    "metadata.namespace": "kube-system",
    "metadata.name": "kiamfast-x7k2p",
}

# (apiGroup, resource, verb) of every Kubernetes call the agent makes.
AGENT_CALLS = [
    ("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "get"),
    ("", "namespaces", "list"), ("", "namespaces", "watch"), ("", "namespaces", "get"),
    ("", "nodes", "get"), ("", "nodes", "patch"),  # the startup taint
    ("", "nodes", "watch"),                        # ... removed again if put back
    ("", "nodes", "list"),                         # the fleet's node count, the node watch
    # its own DaemonSet, by name (its deletion is an uninstall), read from its own pod
    ("apps", "daemonsets", "get"), ("apps", "daemonsets", "list"),
    ("apps", "daemonsets", "watch"),
]
# Made only where the agent installs iptables rules (there are none to remove otherwise).
UNINSTALL_CALLS = {call for call in AGENT_CALLS if call[1] == "daemonsets"}


def daemonset_rule_names(role: dict) -> list[str]:
    """The DaemonSet names the role's daemonsets rule grants (only named ones)."""
    (rule,) = [r for r in role["rules"] if "daemonsets" in r["resources"]]
    return rule["resourceNames"]


def objects(kustomization: str) -> list[dict]:
    return render(REPO / kustomization)


def one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def container_env(container: dict) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of args ($$ escapes; unknown names stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_manifest_is_valid_kubernetes_1_30(kustomization):
    objs = objects(kustomization)
    assert {o["kind"] for o in objs} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                         "DaemonSet"}
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_strict_validation_catches_a_typo():
    ds = one(objects("deploy/base"), "DaemonSet")
    apply_json_patch(ds, [{"op": "add", "path": "/spec/template/spec/hostNetwrok",
                           "value": True}])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, "1.30", strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_daemonset_args_parse_with_our_parser(kustomization):
    ds = one(objects(kustomization), "DaemonSet")
    container = ds["spec"]["template"]["spec"]["containers"][0]
    env = container_env(container)
    args = [expand(a, env) for a in container["args"]]
    assert not any("$(" in a for a in args), args
    # The container environment is what the agent sees too (HOST_IP, NODE_NAME fallbacks).
    cfg = parse_args(args, environ=env)
    assert cfg.iptables is True
    assert cfg.host_ip == "10.0.1.23"
    assert cfg.node == "ip-10-0-1-23.ec2.internal"
    assert cfg.host_interface == "eni+"
    assert cfg.base_role_arn.startswith("arn:aws:iam::") and cfg.base_role_arn.endswith("/")
    # The same args without the env fallbacks still parse (kube2iam-style explicit args).
    assert parse_args(args, environ={}).node == cfg.node

    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert container["image"] == "ghcr.io/kiamfast/kiamfast:0.1.0"
    # No declared ports: a hostPort would keep the surge pod Pending beside the old one.
    assert "ports" not in container
    assert container["readinessProbe"]["exec"] == {"command": ["test", "-f", cfg.ready_file]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": cfg.app_port,
                                                     "scheme": "HTTP"}
    # Small requests (a surge pod beside the old one), the limit from the benchmarks' RSS
    # (control ~96 MiB + worker ~27 MiB, and the table).
    assert container["resources"] == {"requests": {"cpu": "20m", "memory": "64Mi"},
                                      "limits": {"memory": "320Mi"}}
    # The surge handover, with the socket keeper beside the agent.
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": "10%", "maxUnavailable": 0}}
    assert cfg.handover_socket == "/run/kiamfast/handover.sock"
    keeper = pod["containers"][1]
    assert keeper["command"] == ["python", "-m", "kiamfast.socket_keeper"]
    assert keeper["args"] == ["--socket", cfg.socket_keeper]
    assert cfg.iptables_backstop is True and cfg.iptables_check_interval == 10.0
    # An uninstall (its DaemonSet deleted) removes the rules; the pod's name says whose.
    assert cfg.iptables_remove_on_uninstall is True
    assert (cfg.pod_name, cfg.pod_namespace) == ("kiamfast-x7k2p", "kube-system")
    caps = container["securityContext"]["capabilities"]["add"]
    assert container["securityContext"].get("privileged") or "NET_ADMIN" in caps

    # The table and the token key are in a node directory (a restarted or upgraded agent
    # adopts them); the runtime's socket directory is mounted, not the socket file.
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    state = mounts["/run/kiamfast"]
    assert volumes[state["name"]]["hostPath"] == {"path": "/run/kiamfast",
                                                  "type": "DirectoryOrCreate"}
    assert not state.get("readOnly")
    assert (cfg.table_path, cfg.token_key_file) == ("/run/kiamfast/table",
                                                    "/run/kiamfast/token-key")
    assert cfg.cri_endpoint == "unix:///run/containerd/containerd.sock"
    runtime_dir = mounts["/run/containerd"]
    assert volumes[runtime_dir["name"]]["hostPath"] == {"path": "/run/containerd",
                                                        "type": "Directory"}
    assert runtime_dir["readOnly"] is True
    assert runtime_dir["mountPropagation"] == "HostToContainer"
    assert not any(v.get("hostPath", {}).get("type") == "Socket" for v in pod["volumes"])


def test_eks_overlay_changes_only_what_it_says():
    base = one(objects("deploy/base"), "DaemonSet")
    eks = one(objects("deploy/overlays/eks"), "DaemonSet")
    base_args = base["spec"]["template"]["spec"]["containers"][0]["args"]
    eks_c = eks["spec"]["template"]["spec"]["containers"][0]
    placeholder = base_args.index("--base-role-arn=arn:aws:iam::123456789012:role/")
    expected = list(base_args)
    expected[placeholder] = "--base-role-arn=arn:aws:iam::111122223333:role/"
    assert eks_c["args"][:len(base_args)] == expected
    cfg = parse_args([expand(a, container_env(eks_c)) for a in eks_c["args"]], environ={})
    assert cfg.sts_region == "us-east-1"
    assert cfg.imdsv2 == "required"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_daemonset_tolerates_the_startup_taint(kustomization):
    ds = one(objects(kustomization), "DaemonSet")
    tolerations = ds["spec"]["template"]["spec"]["tolerations"]
    taint_key = FLAGS_BY_NAME["node-startup-taint"].default

    def tolerated(key: str, effect: str) -> bool:
        for t in tolerations:
            key_ok = t.get("key") in (None, "", key) if t.get("operator") == "Exists" else (
                t.get("key") == key)
            if key_ok and t.get("effect") in (None, "", effect):
                return True
        return False

    for effect in ("NoSchedule", "NoExecute"):
        assert tolerated(taint_key, effect), effect
        assert tolerated("node.kubernetes.io/not-ready", effect)
        assert tolerated("node.kubernetes.io/unreachable", effect)
    assert any(t.get("key") == taint_key for t in tolerations), "explicit toleration"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rbac_covers_every_call_the_agent_makes(kustomization):
    objs = objects(kustomization)
    role = one(objs, "ClusterRole")
    binding = one(objs, "ClusterRoleBinding")
    sa = one(objs, "ServiceAccount")
    ds = one(objs, "DaemonSet")

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in r.get("apiGroups", []) and
                   (resource in r["resources"] or "*" in r["resources"]) and
                   (verb in r["verbs"] or "*" in r["verbs"]) for r in role["rules"])

    for call in AGENT_CALLS:
        assert allowed(*call), call
    # Only its own DaemonSet, whatever the overlay names it.
    assert daemonset_rule_names(role) == [ds["metadata"]["name"]]
    # Least privilege: nothing that writes pods or reads secrets.
    assert not allowed("", "secrets", "get")
    assert not allowed("", "pods", "delete")
    assert not allowed("", "nodes", "delete")
    # The kubelet is not asked (no nodes/proxy: it would reach every kubelet API).
    assert not allowed("", "nodes/proxy", "get")

    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert {"kind": "ServiceAccount", "name": sa["metadata"]["name"],
            "namespace": sa["metadata"]["namespace"]} in binding["subjects"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert ds["metadata"]["namespace"] == sa["metadata"]["namespace"]

