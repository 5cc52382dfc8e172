"""What a test needs to install kube2iam's own chart on a kubelet node (the switch from
kube2iam: test_chart_switch_from_kube2iam.py, test_chart_upgrade_and_rollback.py).

* :func:`control_plane`: the chart tier's control plane (chart_cluster) allowing privileged
  containers, as kube2iam's charts run it privileged with ``host.iptables``;
* :func:`node`: a node without the startup taint (kube2iam's pods do not tolerate it) with
  kiamfast's image and the one running the real kube2iam (kube2iam_image.py) imported, and
  an EC2 DescribeRegions answering an empty list on the node's loopback (kube2iam asks it at
  start; tests/kube2iam does the same);
* :func:`kube2iam_values` (a kube2iam user's values file, kube2iam's value names only) and
  :func:`node_particulars` (kiamfast's own values a test node needs beside it);
* :func:`uninstall`: a release gone at a module's end, whatever it runs.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import kube
import pytest
import yaml
from chart_cluster import (IMAGE_REPO, NAMESPACE, ChartControlPlane, ChartNode, chart_node,
                           helm_binary, missing_reason, state_dir)
from kube2iam_image import NAME as KUBE2IAM_IMAGE
from kube2iam_image import kube2iam_image

from e2e_cluster import BASE_ARN
from netns import call_in_netns

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kube2iam"))
from kube2iam_harness import NoRegionsEc2  # noqa: E402

# kube2iam's source, as tests/run finds it for tests/tools/build_kube2iam.sh.
KUBE2IAM_SRC = Path(os.environ.get("KUBE2IAM_SRC") or kube.REPO.parent / "shared/peers/kube2iam")
THEIR_CHART = KUBE2IAM_SRC / "charts" / "kube2iam"


@contextlib.contextmanager
def control_plane(cluster: kube.Cluster, directory: Path) -> Iterator[ChartControlPlane]:
    """Skips, naming what is missing, without the chart tier's tools or kube2iam's source."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    if not (THEIR_CHART / "Chart.yaml").is_file():
        pytest.skip(f"needs kube2iam's source (KUBE2IAM_SRC): {THEIR_CHART}")
    plane = ChartControlPlane(cluster, directory, apiserver_args=("--allow-privileged=true",))
    try:
        yield plane
    finally:
        plane.stop()


@contextlib.contextmanager
def node(cluster: kube.Cluster, directory: Path) -> Iterator[ChartNode]:
    with chart_node(cluster, directory, taint=False) as n:
        n.containerd.import_image(kube2iam_image(n.image_archive))
        n.ec2 = call_in_netns(n.net.ns, lambda: NoRegionsEc2().start())
        try:
            yield n
        finally:
            n.ec2.stop()


def kube2iam_values(node: ChartNode) -> Path:
    """A kube2iam user's values file (kube2iam's value names only) for this node."""
    values = {
        "host": {"iptables": True, "interface": node.host_interface},
        "extraArgs": {"base-role-arn": BASE_ARN},
        "rbac": {"create": True},
        "prometheus": {"service": {"enabled": True}},
        "aws": {"access_key": "testing", "secret_key": "testing", "region": "us-east-1"},
        "image": {"repository": KUBE2IAM_IMAGE.rsplit(":", 1)[0], "tag": "test",
                  "pullPolicy": "Never"},
        "extraEnv": {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                     "KUBERNETES_SERVICE_PORT": str(node.api_proxy.port),
                     "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": node.sts.endpoint,
                     "AWS_ENDPOINT_URL_EC2": node.ec2.url},
    }
    path = node.workdir / "kube2iam-values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def node_particulars(node: ChartNode) -> Path:
    """What differs on a test node for kiamfast (its image is not published; the test's
    containerd and state directory): kiamfast's own values, given beside the user's file."""
    path = node.workdir / "kiamfast-node.yaml"
    path.write_text(yaml.safe_dump({
        "image": {"repository": IMAGE_REPO, "tag": "test", "pullPolicy": "Never"},
        "cri": {"socketPath": str(node.containerd.socket)},
        "stateDir": str(state_dir(node))}))
    return path


def uninstall(control: ChartControlPlane, release: str) -> None:
    """``helm uninstall --wait`` of ``release`` if it is installed (a module's teardown: the
    session's etcd outlives the module, and the next module's controllers would run a
    DaemonSet left there on their own node)."""
    home = control.dir / "helm"
    env = dict(os.environ, KUBECONFIG=str(control.kubeconfig),
               HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"))
    result = subprocess.run([str(helm_binary()), "uninstall", release, "--namespace",
                             NAMESPACE, "--wait"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0 or "not found" in result.stderr, result.stderr
