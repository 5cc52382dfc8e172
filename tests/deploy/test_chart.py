"""The Helm chart, rendered by the real helm, checked the way a kube2iam user swapping charts
would check it.

A kube2iam user runs ``helm upgrade <release> deploy/chart/kiamfast -f <their kube2iam
values>``. So the chart is rendered (``helm template``) with kube2iam's own default values and
with typical kube2iam user values files (tests/deploy/kube2iam-values/), and for each the
rendered DaemonSet must carry the user's flags as ``--flag=value``, kiamfast's own parser must
accept every argument (after the kubelet's ``$(VAR)`` expansion), and env, probes, mounts,
tolerations and RBAC must be what those values meant. Every manifest passes strict
Kubernetes schema validation and ``helm lint --strict``; a value kiamfast cannot mean the way
kube2iam's chart did fails the render with a message saying why. Finally deploy/base (the
kustomize install) must be exactly what the chart renders with the base's settings.

helm itself is built from its source by tests/tools/build_helm.sh into the tools cache.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kustomize_lite import render as kustomize
from test_deploy_manifests import AGENT_CALLS, FIELD_VALUES, daemonset_rule_names, expand

from kiamfast.cli import parse_args
from kiamfast.config import FLAGS, FLAGS_BY_NAME

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "chart" / "kiamfast"
VALUES = Path(__file__).resolve().parent / "kube2iam-values"
BUILD_HELM = REPO / "tests" / "tools" / "build_helm.sh"
NAMESPACE = "kube-system"
TAINT = FLAGS_BY_NAME["node-startup-taint"].default
SCHEMA_VERSION = "1.30"  # the oldest Kubernetes the manifests must be valid for
NEWEST_VERSION = "1.34"  # what this helm release renders for (its client libraries)
CRDS = {"ServiceMonitor"}  # no schema in kubernetes-validate: checked field by field below
READY_FILE_PROBE = {"command": ["test", "-f", "/run/kiamfast-pod/ready"]}


def helm_binary() -> str:
    version = re.search(r"^HELM_VERSION=(\S+)$", BUILD_HELM.read_text(), re.M).group(1)
    tools = Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")
    path = tools / f"helm-{version}" / "helm"
    if not path.exists():
        pytest.skip(f"needs helm {version}: run tests/tools/build_helm.sh")
    return str(path)


def helm(*args: str) -> subprocess.CompletedProcess:
    # No cluster is ever contacted: `helm template` and `helm lint` are client-only.
    env = dict(os.environ, KUBECONFIG=os.devnull, HELM_CACHE_HOME="/tmp/kiamfast-helm-cache",
               HELM_CONFIG_HOME="/tmp/kiamfast-helm-config",
               HELM_DATA_HOME="/tmp/kiamfast-helm-data")
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def values_file(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def template_args(files: list[Path], *, release: str, chart: Path = CHART) -> list[str]:
    args = ["template", release, str(chart), "--namespace", NAMESPACE]
    for f in files:
        args += ["-f", str(f)]
    return args


def render(*files: Path, release: str = "kube2iam", chart: Path = CHART) -> list[dict]:
    result = helm(*template_args(list(files), release=release, chart=chart))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_error(tmp_path: Path, values: dict) -> str:
    result = helm(*template_args([values_file(tmp_path, values)], release="kube2iam"))
    assert result.returncode != 0, f"rendered although it should not:\n{result.stdout}"
    return result.stderr


def notes(tmp_path: Path, *files: Path) -> str:
    """NOTES.txt as `helm install` would print it (`helm template` prints no notes, so a copy
    of the chart renders the same notes template into a ConfigMap)."""
    chart = tmp_path / "chart-with-notes"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-under-test\n"
        'data:\n  notes: {{ include "kiamfast.notes" . | quote }}\n')
    objs = render(*files, chart=chart)
    return next(o for o in objs if o["kind"] == "ConfigMap")["data"]["notes"]


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    found = of_kind(objs, kind)
    assert len(found) == 1, (kind, [o["kind"] for o in objs])
    return found[0]


def pod_spec(objs: list[dict]) -> dict:
    return one(objs, "DaemonSet")["spec"]["template"]["spec"]


def container(objs: list[dict]) -> dict:
    return pod_spec(objs)["containers"][0]


def env_of(c: dict) -> dict[str, object]:
    """Env as the container sees it: downward-API fields filled in, secret refs kept as refs."""
    env: dict[str, object] = {}
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = item["valueFrom"]
    return env


def agent_config(objs: list[dict]):
    """The Config kiamfast builds from the rendered args and env, as on a node."""
    c = container(objs)
    env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
    args = [expand(a, env) for a in c["args"]]
    assert not any("$(" in a for a in args), args
    return parse_args(args, environ=env), args


def user_values(name: str) -> dict:
    return yaml.safe_load((VALUES / name).read_text())


def expected_arg(flag: str, value: object) -> str:
    if value is None or value == "":
        return f"--{flag}"
    return f"--{flag}={str(value).lower() if isinstance(value, bool) else value}"


MATRIX = sorted(p.name for p in VALUES.glob("*.yaml"))


# ---- every render: valid, linted, accepted by kiamfast's parser -----------------------------

@pytest.mark.parametrize("name", [None, *MATRIX])
def test_every_manifest_passes_strict_validation(name):
    objs = render(*([VALUES / name] if name else []))
    assert {"DaemonSet"} <= {o["kind"] for o in objs}
    for obj in objs:
        if obj["kind"] not in CRDS:
            for version in (SCHEMA_VERSION, NEWEST_VERSION):
                kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", [None, *MATRIX])
def test_helm_lint_strict_passes(name):
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                  *(["-f", str(VALUES / name)] if name else []))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("name", MATRIX)
def test_user_flags_render_as_flag_equals_value_and_parse(name):
    values = user_values(name)
    objs = render(VALUES / name)
    cfg, args = agent_config(objs)
    for flag, value in (values.get("extraArgs") or {}).items():
        assert expected_arg(flag, value) in args, (flag, args)
    host = values.get("host", {})
    assert cfg.host_interface == host.get("interface", "docker0")
    assert cfg.iptables is host.get("iptables", False)
    assert cfg.app_port == host.get("port", 8181)
    assert cfg.metrics_port == values.get("prometheus", {}).get("metricsPort", cfg.app_port)
    assert cfg.host_ip == FIELD_VALUES["status.hostIP"]
    assert cfg.node == FIELD_VALUES["spec.nodeName"]
    assert cfg.verbose is bool(values.get("verbose"))
    assert cfg.node_startup_taint == TAINT
    assert cfg.workers == 1


def test_the_real_entry_point_accepts_the_rendered_args():
    cfg, args = agent_config(render(VALUES / "eks.yaml"))
    result = subprocess.run([sys.executable, "-m", "kiamfast", *args, "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Version: ")


# ---- kube2iam's own defaults, unchanged ----------------------------------------------------

def test_kube2iam_default_values_mean_what_they_meant(tmp_path):
    objs = render(VALUES / "default.yaml")
    ds = one(objs, "DaemonSet")
    spec, c = pod_spec(objs), container(objs)
    # rbac.create: false -> the namespace's "default" ServiceAccount, no RBAC objects.
    assert spec["serviceAccountName"] == "default"
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ServiceAccount")
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert "priorityClassName" not in spec
    # tolerations: [] -> only kiamfast's startup taint is tolerated.
    assert spec["tolerations"] == [{"key": TAINT, "operator": "Exists"}]
    # kube2iam's image is swapped for kiamfast's: the point of the exercise.
    assert c["image"] == "ghcr.io/kiamfast/kiamfast:0.1.0"
    assert c["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": 8181, "scheme": "HTTP"},
        "initialDelaySeconds": 30, "periodSeconds": 5, "successThreshold": 1,
        "failureThreshold": 3, "timeoutSeconds": 1}
    # The readiness probe keeps kube2iam's timing but is the pod's own ready file.
    assert c["readinessProbe"]["exec"] == READY_FILE_PROBE
    assert c["readinessProbe"]["periodSeconds"] == 5
    # The preStop hook is the user's (kube2iam's default): kept, and warned about.
    assert c["lifecycle"] == user_values("default.yaml")["lifecycle"]
    # resources: {} -> kiamfast's default (small requests, the limit from the measured
    # RSS), without a CPU limit.
    assert c["resources"] == {"requests": {"cpu": "20m", "memory": "64Mi"},
                              "limits": {"memory": "320Mi"}}
    cfg, _ = agent_config(objs)
    assert cfg.iptables is False and cfg.host_interface == "docker0"
    text = notes(tmp_path, VALUES / "default.yaml")
    assert "lifecycle.preStop deletes the metadata DNAT rule" in text
    assert 'rbac.create is false: the ServiceAccount "default" needs' in text
    assert "image.repository jtblin/kube2iam is kube2iam's image" in text
    # ... whose replacement is the chart's default, which nobody publishes yet.
    assert "ghcr.io/kiamfast/kiamfast:0.1.0 is not published" in text
    assert "deploy/release.sh" in text
    assert "host.iptables is false" in text
    assert "upgrade that release with kube2iamChart set instead" in text
    assert "updateStrategy is OnDelete" in text   # kept, as the values say: how to roll


# ---- the typical kube2iam user values ------------------------------------------------------

def test_eks_values(tmp_path):
    objs = render(VALUES / "eks.yaml")
    spec, c = pod_spec(objs), container(objs)
    cfg, _ = agent_config(objs)
    assert cfg.host_interface == "eni+" and cfg.iptables is True
    assert cfg.base_role_arn == "arn:aws:iam::111122223333:role/"
    assert cfg.namespace_restrictions is True
    assert env_of(c)["AWS_DEFAULT_REGION"] == "eu-west-1"
    # Their maxUnavailable keeps kube2iam's meaning: no surge (the API takes one non-zero).
    assert one(objs, "DaemonSet")["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "10%"}}
    assert "maxUnavailable is 10%" in notes(tmp_path, VALUES / "eks.yaml")
    assert c["resources"] == {"requests": {"cpu": "20m", "memory": "200Mi"}}
    assert one(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"] == {
        "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
        "kubectl.kubernetes.io/default-container": "kiamfast"}
    # The chart's own tolerations stay when the user gave none.
    assert {"operator": "Exists", "effect": "NoExecute"} in spec["tolerations"]
    assert spec["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]


def test_calico_values_with_an_existing_secret():
    objs = render(VALUES / "calico.yaml")
    ds, spec, c = one(objs, "DaemonSet"), pod_spec(objs), container(objs)
    cfg, _ = agent_config(objs)
    assert cfg.host_interface == "cali+"
    assert cfg.namespace_restriction_format == "regexp"
    assert cfg.log_format == "json" and cfg.effective_log_level == "debug"
    assert cfg.iam_role_session_ttl == 30 * 60
    env = env_of(c)
    for var, key in (("AWS_ACCESS_KEY_ID", "aws_access_key_id"),
                     ("AWS_SECRET_ACCESS_KEY", "aws_secret_access_key")):
        assert env[var] == {"secretKeyRef": {"name": "kube2iam-aws-keys", "key": key}}
    assert not of_kind(objs, "Secret")  # the user's Secret, not ours
    assert spec["tolerations"] == [
        {"key": TAINT, "operator": "Exists"},
        {"key": "dedicated", "operator": "Equal", "value": "ingress", "effect": "NoSchedule"}]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert "readinessProbe" not in c
    assert (c["livenessProbe"]["initialDelaySeconds"], c["livenessProbe"]["periodSeconds"]) \
        == (5, 15)
    assert ds["spec"]["template"]["metadata"]["labels"]["team"] == "platform"
    assert "team" not in ds["spec"]["selector"]["matchLabels"]  # the selector is immutable


def test_values_without_iptables_and_an_existing_service_account(tmp_path):
    objs = render(VALUES / "no-iptables.yaml")
    spec, c = pod_spec(objs), container(objs)
    cfg, _ = agent_config(objs)
    assert cfg.iptables is False and cfg.debug is True
    assert cfg.default_role == "arn:aws:iam::777788889999:role/fallback"
    assert spec["serviceAccountName"] == "kube2iam"
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
    assert "ports" not in c   # no hostPort: a surge pod must fit beside the old one
    assert cfg.app_port == c["livenessProbe"]["httpGet"]["port"] == 8282
    assert c["readinessProbe"]["exec"] == READY_FILE_PROBE
    assert spec["affinity"] == user_values("no-iptables.yaml")["affinity"]
    text = notes(tmp_path, VALUES / "no-iptables.yaml")
    assert "host.iptables is false" in text
    assert 'ServiceAccount "kube2iam" needs' in text


def test_service_monitor_values_find_the_agents(tmp_path):
    objs = render(VALUES / "servicemonitor.yaml")
    c = container(objs)
    cfg, _ = agent_config(objs)
    assert cfg.metrics_port == 9543
    assert "ports" not in c   # no hostPort: the Service targets the port by number
    service = one(objs, "Service")
    monitor = one(objs, "ServiceMonitor")
    ds = one(objs, "DaemonSet")
    # The Service selects the agent pods and exposes their metrics port.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9543, "targetPort": 9543,
                                         "protocol": "TCP"}]
    assert service["metadata"]["annotations"]["prometheus.io/port"] == "9543"
    # The ServiceMonitor (prometheus-operator's CRD, so checked here field by field) selects
    # that Service in its namespace, by a port name the Service has, where the user wanted it.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "30s"}]
    assert set(monitor["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    text = notes(tmp_path, VALUES / "servicemonitor.yaml")
    assert "podSecurityPolicy.* is ignored" in text


def test_aws_keys_become_a_secret_and_env():
    objs = render(VALUES / "aws-keys.yaml")
    values = user_values("aws-keys.yaml")
    spec, c = pod_spec(objs), container(objs)
    secret = one(objs, "Secret")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {"aws_access_key_id": values["aws"]["access_key"],
                    "aws_secret_access_key": values["aws"]["secret_key"]}
    env = env_of(c)
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": secret["metadata"]["name"],
                                                         "key": "aws_access_key_id"}}
    assert env["AWS_DEFAULT_REGION"] == "us-west-2"
    assert env["HTTPS_PROXY"] == "http://proxy.internal:3128"
    assert env["NO_PROXY"] == "169.254.169.254,10.0.0.0/8"
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert c["image"] == "ghcr.io/kiamfast/kiamfast:0.1.0"


# ---- what cannot mean the same fails, and says why -------------------------------------------

REFUSED = [
    ({"extraArgs": {"debug": False}}, "extraArgs.debug: false: kube2iam's chart renders this "
                                      "as a bare --debug, which switches a boolean ON"),
    ({"extraArgs": {"iam-role-error-ttl": 0}}, "extraArgs.iam-role-error-ttl: 0"),
    ({"extraArgs": {"workers": 4}}, "extraArgs.workers: the chart sets --workers from its own "
                                    "value (workers)"),
    ({"extraArgs": {"defualt-role": "app"}}, "extraArgs.defualt-role: kiamfast has no flag "
                                             "--defualt-role"),
    ({"extraArgs": {"default-role": ""}}, "extraArgs.default-role: empty: a bare "
                                          "--default-role takes the next argument"),
    ({"extraArgs": {"version": ""}}, "extraArgs.version: kiamfast has no flag --version for a "
                                     "running agent"),
    # Names and types are values.schema.json's: helm says which key, before any template.
    ({"hostNetwrok": False}, "at '': additional properties 'hostNetwrok' not allowed"),
    ({"resources": {"limits": {"memory": "128Mi"}}},
     "resources.limits.memory 128Mi: kiamfast needs at least 160Mi with 1 worker(s)"),
    ({"resources": {"limits": {"memory": "300Mi"}}, "workers": 8},
     "resources.limits.memory 300Mi: kiamfast needs at least 384Mi with 8 worker(s)"),
    ({"aws": {"access_key": "AKIAONLYHALF"}}, "aws.access_key and aws.secret_key: set both"),
    ({"image": {"repository": "123456789012.dkr.ecr.us-east-1.amazonaws.com/kube2iam"}},
     "looks like a mirror of kube2iam's image"),
    ({"host": {"iptables": True, "ip": ""}}, "host.iptables: the DNAT rule needs host.ip"),
    ({"workers": 0}, "workers: 0: a number of worker processes from 1 to 64"),
    ({"updateStrategy": "Recreate"}, "updateStrategy Recreate: a DaemonSet updates by"),
    ({"cri": {"socketPath": "run/containerd.sock"}}, "cri.socketPath \"run/containerd.sock\""),
    ({"cri": {"socketPath": "/containerd.sock"}}, "the chart mounts the socket's directory, "
                                                  "and / is the whole node"),
    ({"stateDir": "run/kiamfast"}, "stateDir \"run/kiamfast\": an absolute directory"),
    ({"stateDir": "/"}, "stateDir \"/\": an absolute directory on the node, not /"),
    ({"extraArgs": {"table-path": "/dev/shm/t"}}, "extraArgs.table-path: the chart sets "
                                                  "--table-path from its own value (stateDir)"),
    ({"extraArgs": {"token-key-file": "/k"}}, "extraArgs.token-key-file: the chart sets "
                                              "--token-key-file from its own value (stateDir)"),
]


@pytest.mark.parametrize("values,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_a_value_that_cannot_mean_the_same_fails_the_render(tmp_path, values, message):
    assert message in render_error(tmp_path, values)


def test_accepted_values_next_to_the_refused_ones_render(tmp_path):
    # The neighbours of the refused values above render, so the refusals are specific.
    cfg, args = agent_config(render(values_file(tmp_path, {
        "extraArgs": {"debug": True, "iam-role-error-ttl": "0s", "log-level": "warn"},
        "resources": {"limits": {"memory": "1Gi"}}, "workers": 2,
        "image": {"repository": "123456789012.dkr.ecr.us-east-1.amazonaws.com/kiamfast",
                  "tag": "0.1.0"}})))
    assert cfg.debug is True and cfg.iam_role_error_ttl == 0 and cfg.log_level == "warn"
    assert cfg.workers == 2
    assert "--debug=true" in args


def test_the_chart_knows_exactly_the_cli_flags():
    # The chart refuses unknown extraArgs and bare non-boolean ones from these two lists.
    helpers = (CHART / "templates" / "_validate.tpl").read_text()

    def listed(name: str) -> set[str]:
        body = re.search(r'define "kiamfast\.%s" -}}\n(.*?)\n{{- end' % name, helpers, re.S)
        return set(body.group(1).split())

    assert listed("boolFlags") == {f.name for f in FLAGS if f.kind == "bool"} - {"version"}
    assert listed("valueFlags") == {f.name for f in FLAGS if f.kind != "bool"}


# ---- kiamfast's own values ------------------------------------------------------------------

def test_container_runtime_socket_directory_is_mounted_read_only_at_its_own_path(tmp_path):
    """The socket's directory, not the socket: a restarted runtime replaces the socket file,
    and a mount of the file would keep the dead one (ECONNREFUSED until the agent's
    container restarts)."""
    for values, socket, directory in (
            ({}, "/run/containerd/containerd.sock", "/run/containerd"),
            ({"cri": {"socketPath": "/var/run/crio/crio.sock"}}, "/var/run/crio/crio.sock",
             "/var/run/crio")):
        objs = render(values_file(tmp_path, values))
        spec, c = pod_spec(objs), container(objs)
        cfg, _ = agent_config(objs)
        assert cfg.cri_endpoint == f"unix://{socket}"   # inside the mounted directory
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == directory)
        assert mount["readOnly"] is True
        assert mount["mountPropagation"] == "HostToContainer"   # unmounts reach the copy
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["hostPath"] == {"path": directory, "type": "Directory"}
        assert not any(m["mountPath"] == socket for m in c["volumeMounts"])
        assert not any(v.get("hostPath", {}).get("type") == "Socket" for v in spec["volumes"])


def test_the_pods_network_namespaces_are_mounted_and_the_kernel_may_be_heard(tmp_path):
    """--address-proof=netns: the agent opens each sandbox's namespace at the path the
    runtime reports (mounted read-only at that path; HostToContainer: each is mounted after
    the agent started) and hears the kernel's address notifications (NET_BROADCAST)."""
    for values, directory in (({}, "/var/run/netns"),
                              ({"cri": {"netnsDir": "/run/crio-ns/netns"}},
                               "/run/crio-ns/netns")):
        objs = render(values_file(tmp_path, values))
        spec, c = pod_spec(objs), container(objs)
        cfg, _ = agent_config(objs)
        assert cfg.address_proof == "netns"
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == directory)
        assert mount["readOnly"] is True and mount["mountPropagation"] == "HostToContainer"
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["hostPath"] == {"path": directory, "type": "DirectoryOrCreate"}
        assert "NET_BROADCAST" in c["securityContext"]["capabilities"]["add"]


def test_container_runtime_disabled_means_no_mount_and_none(tmp_path):
    objs = render(values_file(tmp_path, {"cri": {"enabled": False}}))
    spec, c = pod_spec(objs), container(objs)
    cfg, args = agent_config(objs)
    assert "--cri-endpoint=none" in args
    assert cfg.cri_endpoint in ("none", "")
    assert not any("hostPath" in v and v["hostPath"]["type"] == "Socket"
                   for v in spec["volumes"])
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/run/kiamfast", "/tmp",
                                                           "/run/xtables.lock",
                                                           "/run/kiamfast-pod"}
    assert "NET_BROADCAST" not in c["securityContext"]["capabilities"]["add"]


def test_table_and_token_key_are_in_a_node_directory_a_new_pod_finds(tmp_path):
    """A restarted container or the new pod of an upgrade adopts the table and the token
    key only if they outlive the pod: a hostPath, at the same path inside."""
    for values, directory in (({}, "/run/kiamfast"), ({"stateDir": "/var/run/iam"},
                                                      "/var/run/iam")):
        objs = render(values_file(tmp_path, values))
        spec, c = pod_spec(objs), container(objs)
        cfg, _ = agent_config(objs)
        assert cfg.table_path == f"{directory}/table"
        assert cfg.token_key_file == f"{directory}/token-key"
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == directory)
        assert not mount.get("readOnly")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["hostPath"] == {"path": directory, "type": "DirectoryOrCreate"}


def test_workers_set_the_flag_and_size_the_memory(tmp_path):
    objs = render(values_file(tmp_path, {"workers": 3}))
    cfg, _ = agent_config(objs)
    assert cfg.workers == 3
    assert container(objs)["resources"] == {"requests": {"cpu": "20m", "memory": "64Mi"},
                                            "limits": {"memory": "448Mi"}}


def test_privileged_as_kube2iam_ran_it_stays_a_valid_container(tmp_path):
    objs = render(values_file(tmp_path, {"securityContext": {"privileged": True}}))
    security = container(objs)["securityContext"]
    assert security["privileged"] is True and "allowPrivilegeEscalation" not in security
    kubernetes_validate.validate(one(objs, "DaemonSet"), SCHEMA_VERSION, strict=True)


def test_startup_taint_key_sets_flag_and_toleration_together(tmp_path):
    objs = render(values_file(tmp_path, {"startupTaint": {"key": "example.com/no-iam-yet"},
                                         "tolerations": []}))
    cfg, _ = agent_config(objs)
    assert cfg.node_startup_taint == "example.com/no-iam-yet"
    assert pod_spec(objs)["tolerations"] == [{"key": "example.com/no-iam-yet",
                                              "operator": "Exists"}]
    objs = render(values_file(tmp_path, {"startupTaint": {"key": ""}, "tolerations": []}))
    assert agent_config(objs)[0].node_startup_taint == ""
    assert "tolerations" not in pod_spec(objs)


def test_readiness_probe_is_the_pods_own_ready_file_with_the_values_timings(tmp_path):
    objs = render()
    probe = container(objs)["readinessProbe"]
    assert probe["exec"] == READY_FILE_PROBE
    assert agent_config(objs)[0].ready_file == READY_FILE_PROBE["command"][-1]
    probe = container(render(values_file(tmp_path, {"readinessProbe": {
        "periodSeconds": 7, "failureThreshold": 9}})))["readinessProbe"]
    assert (probe["exec"], probe["periodSeconds"], probe["failureThreshold"]) == \
        (READY_FILE_PROBE, 7, 9)


def test_rbac_grants_every_call_the_agent_makes_and_nothing_more(tmp_path):
    objs = render(values_file(tmp_path, {"host": {"iptables": True}}))
    role = one(objs, "ClusterRole")
    binding = one(objs, "ClusterRoleBinding")
    sa = one(objs, "ServiceAccount")

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and
                   verb in r["verbs"] for r in role["rules"])

    for call in AGENT_CALLS:
        assert allowed(*call), call
    granted = {(g, res, v) for r in role["rules"] for g in r["apiGroups"]
               for res in r["resources"] for v in r["verbs"]}
    assert granted == set(AGENT_CALLS)  # no nodes/proxy, no secrets, no writes to pods
    assert daemonset_rule_names(role) == [one(objs, "DaemonSet")["metadata"]["name"]]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    assert pod_spec(objs)["serviceAccountName"] == sa["metadata"]["name"]


def test_in_place_upgrade_of_a_kube2iam_release_keeps_name_and_selector(tmp_path):
    # The kube2iam chart names its DaemonSet after the release and selects on these two
    # labels; a DaemonSet's selector cannot change, so kube2iamChart=kube2iam keeps both
    # (tests/deploy/test_chart_switch.py: both charts, several release names).
    switch = values_file(tmp_path, {"kube2iamChart": "kube2iam"})
    ds = one(render(VALUES / "default.yaml", switch, release="kube2iam"), "DaemonSet")
    assert ds["metadata"]["name"] == "kube2iam"
    assert ds["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kube2iam",
                                                     "app.kubernetes.io/instance": "kube2iam"}
    assert "a new release beside kube2iam" not in notes(tmp_path, VALUES / "default.yaml", switch)


# ---- the kustomize base is the chart ------------------------------------------------------

def test_kustomize_base_is_what_the_chart_renders():
    chart = render(CHART / "ci" / "base-values.yaml", release="kiamfast")
    base = kustomize(REPO / "deploy" / "base")
    assert sorted(o["kind"] for o in chart) == sorted(o["kind"] for o in base)
    for kind in ("DaemonSet", "ClusterRole", "ClusterRoleBinding", "ServiceAccount"):
        c, b = one(chart, kind), one(base, kind)
        assert c["metadata"]["name"] == b["metadata"]["name"], kind
        assert c["metadata"].get("namespace") == b["metadata"].get("namespace"), kind
        assert b["metadata"]["labels"].items() <= c["metadata"]["labels"].items(), kind
    c_ds, b_ds = one(chart, "DaemonSet"), one(base, "DaemonSet")
    # The whole pod spec: args (in order), env, probes, volumes, mounts, tolerations, ...
    assert c_ds["spec"]["template"]["spec"] == b_ds["spec"]["template"]["spec"]
    assert c_ds["spec"]["updateStrategy"] == b_ds["spec"]["updateStrategy"]
    assert one(chart, "ClusterRole")["rules"] == one(base, "ClusterRole")["rules"]
    for key in ("roleRef", "subjects"):
        assert one(chart, "ClusterRoleBinding")[key] == one(base, "ClusterRoleBinding")[key]


def test_the_notes_say_to_publish_the_image_only_while_it_is_the_unpublished_default(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mirror = values_file(tmp_path, {"image": {"repository": "registry.example.com/kiamfast"}})
    assert "is not published" not in notes(tmp_path / "a", mirror)
    assert "is not published" in notes(tmp_path / "b", values_file(tmp_path, {}))
