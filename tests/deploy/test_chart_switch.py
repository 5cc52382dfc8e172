"""The switch from kube2iam's charts, rendered: ``helm upgrade <their release> <kiamfast's chart>
-f <their values> --set kube2iamChart=<their chart>`` must update their objects in place.

A DaemonSet's selector is immutable and a Service's clusterIP too; an object of another name
is a new object. So for both kube2iam charts and several release names, kiamfast's render
must name the DaemonSet, its selector, its pods' labels, its container, the metrics Service
(and its kind: a cluster IP, as theirs), the ServiceAccount, ClusterRole and binding, the
Secret and the ServiceMonitor exactly as theirs. Theirs is rendered by the real helm from
kube2iam-chart itself (``$KUBE2IAM_SRC``, the read-only copy beside the clone, as
tests/tools/build_kube2iam.sh builds from) and, for the ``kube2iam`` chart (2.1.0 to 3.2.0),
from the stand-in ``kube2iam-chart-3.2.0/`` (its README says what it reproduces and how that
was checked against every published version). ``helm template`` only: detection must work
without a cluster (Argo CD and Flux render that way), so the chart decides from values alone.

Also here: the kube2iam values that mean something else after a switch (refused with the
reason), the 2.x ``probe``, ``global.imagePullSecrets``, an explicit ``OnDelete``, and
deploy/overlays/kube2iam (the same switch for kube2iam's plain manifests).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from kustomize_lite import render as kustomize
from test_chart import (CHART, NAMESPACE, VALUES, container, helm, notes, of_kind, one,
                        pod_spec, render, render_error, values_file)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KUBE2IAM_SRC = Path(os.environ.get("KUBE2IAM_SRC") or REPO.parent / "shared/peers/kube2iam")
CHARTS = {
    "kube2iam": HERE / "kube2iam-chart-3.2.0",        # the stand-in (test data)
    "kube2iam-chart": KUBE2IAM_SRC / "charts" / "kube2iam",
}
RELEASES = ["kube2iam", "kube2iam-prod", "iam", "kube2iam-chart"]
# The objects an in-place upgrade must find under the same name (and kind).
KEPT = ("DaemonSet", "Service", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
        "Secret", "ServiceMonitor")
# What kube2iam users' values set that decides names and objects (plus their own files).
USER_VALUES = {
    "defaults": {},
    "rbac-metrics": {"rbac": {"create": True}, "prometheus": {"service": {"enabled": True}}},
    "monitor-override": {
        "nameOverride": "iam-agent", "rbac": {"create": True},
        "prometheus": {"metricsPort": 9543, "serviceMonitor": {"enabled": True}},
        "aws": {"access_key": "AKIAEXAMPLE", "secret_key": "example"}},
}


def kube2iam_chart(name: str) -> Path:
    chart = CHARTS[name]
    if not (chart / "Chart.yaml").is_file():
        pytest.skip(f"needs kube2iam's source for kube2iam-chart: set KUBE2IAM_SRC ({chart})")
    return chart


def theirs(chart: str, release: str, values: Path) -> list[dict]:
    return render(values, release=release, chart=kube2iam_chart(chart))


def ours(chart: str, release: str, values: Path, tmp_path: Path) -> list[dict]:
    return render(values, values_file(tmp_path, {"kube2iamChart": chart}), release=release)


def names(objs: list[dict]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs if o["kind"] in KEPT}


@pytest.mark.parametrize("values", USER_VALUES)
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("chart", CHARTS)
def test_the_switch_keeps_every_object_name_selector_and_service_kind(tmp_path, chart, release,
                                                                      values):
    user = values_file(tmp_path, USER_VALUES[values])
    old, new = theirs(chart, release, user), ours(chart, release, user, tmp_path)
    # Every object theirs made is one of ours by kind and name: updated in place, never
    # orphaned beside a new one (ours may add objects, e.g. RBAC kube2iam left to the user).
    assert names(old) <= names(new), names(old) - names(new)
    assert len(of_kind(new, "DaemonSet")) == 1
    old_ds, new_ds = one(old, "DaemonSet"), one(new, "DaemonSet")
    selector = old_ds["spec"]["selector"]["matchLabels"]
    assert new_ds["spec"]["selector"]["matchLabels"] == selector   # immutable
    assert selector.items() <= new_ds["spec"]["template"]["metadata"]["labels"].items()
    # The agent's container keeps theirs; the socket keeper is a container beside it.
    assert [c["name"] for c in pod_spec(new)["containers"]] == \
        [c["name"] for c in pod_spec(old)["containers"]] + ["socket-keeper"] == \
        ["kube2iam", "socket-keeper"]
    if USER_VALUES[values].get("rbac", {}).get("create"):
        assert pod_spec(new)["serviceAccountName"] == pod_spec(old)["serviceAccountName"]
    for service in of_kind(old, "Service"):
        mine = next(s for s in of_kind(new, "Service")
                    if s["metadata"]["name"] == service["metadata"]["name"])
        # A ClusterIP Service both: clusterIP cannot change, the API server would refuse.
        assert "clusterIP" not in service["spec"] and "clusterIP" not in mine["spec"]
        assert service["spec"].get("type", "ClusterIP") == mine["spec"].get("type", "ClusterIP")
        assert mine["spec"]["selector"] == service["spec"]["selector"] == selector
        # Port names too: a scrape config of the user's may name kube2iam's.
        assert [(p["name"], p["port"]) for p in mine["spec"]["ports"]] == \
            [(p["name"], p["port"]) for p in service["spec"]["ports"]]
    for monitor in of_kind(new, "ServiceMonitor"):
        service = one(new, "Service")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= \
            service["metadata"]["labels"].items()
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= \
            {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("chart", CHARTS)
def test_without_kube2iam_chart_the_names_are_kiamfasts(tmp_path, chart, release):
    # Why the value exists: kiamfast's own names (its chart name, helm's "contains" rule)
    # are never kube2iam-chart's, and the kube2iam chart's only for one release name.
    user = values_file(tmp_path, USER_VALUES["rbac-metrics"])
    old, new = theirs(chart, release, user), render(user, release=release)
    assert one(new, "DaemonSet")["spec"]["selector"] != one(old, "DaemonSet")["spec"]["selector"]
    assert one(new, "Service")["spec"]["clusterIP"] == "None"   # headless, kiamfast's own


def test_a_users_own_values_files_switch_in_place(tmp_path):
    for name in sorted(p.name for p in VALUES.glob("*.yaml")):
        for chart in CHARTS:
            old = theirs(chart, "kube2iam", VALUES / name)
            new = ours(chart, "kube2iam", VALUES / name, tmp_path)
            assert names(old) <= names(new), (name, chart, names(old) - names(new))
            assert one(new, "DaemonSet")["spec"]["selector"] == \
                one(old, "DaemonSet")["spec"]["selector"], (name, chart)


# ---- values that would mean something else after a switch ----------------------------------

REFUSED = [
    ({"kube2iamChart": "stable/kube2iam"}, "kube2iamChart stable/kube2iam: the chart your "
                                           "kube2iam release was installed with, kube2iam or "
                                           "kube2iam-chart"),
    ({"kube2iamChart": "kube2iam", "fullnameOverride": "iam"},
     "fullnameOverride iam: kube2iam's charts have no such value"),
    ({"kube2iamChart": "kube2iam-chart", "image": {"tag": "0.11.1"}},
     "image.tag 0.11.1 without image.repository: in kube2iam's chart that ran "
     "jtblin/kube2iam:0.11.1"),
    ({"probe": "yes"}, "at '/probe': 'oneOf' failed, none matched"),
    # (values.schema.json's: the 2.x probe is true, false, or a map of enabled and timings)
    ({"probe": {"path": "/healthz"}}, "additional properties 'path' not allowed"),
]


@pytest.mark.parametrize("values,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_a_value_the_switch_cannot_mean_fails_the_render(tmp_path, values, message):
    assert message in render_error(tmp_path, values)


def test_an_image_tag_with_its_repository_or_without_a_switch_renders(tmp_path):
    pinned = {"kube2iamChart": "kube2iam",
              "image": {"repository": "ghcr.io/kiamfast/kiamfast", "tag": "0.2.0"}}
    assert container(render(values_file(tmp_path, pinned)))["image"] == \
        "ghcr.io/kiamfast/kiamfast:0.2.0"
    digest = "sha256:" + "ab" * 32
    by_digest = {"kube2iamChart": "kube2iam", "image": {"tag": "0.11.1", "digest": digest}}
    assert container(render(values_file(tmp_path, by_digest)))["image"] == \
        f"ghcr.io/kiamfast/kiamfast@{digest}"
    # Without the switch a tag alone is kiamfast's own pin.
    assert container(render(values_file(tmp_path, {"image": {"tag": "0.2.0"}})))["image"] == \
        "ghcr.io/kiamfast/kiamfast:0.2.0"
    # kube2iam's repository with its tag: replaced by kiamfast's image, as before.
    kube2iam = {"kube2iamChart": "kube2iam",
                "image": {"repository": "jtblin/kube2iam", "tag": "0.11.1"}}
    assert container(render(values_file(tmp_path, kube2iam)))["image"] == \
        "ghcr.io/kiamfast/kiamfast:0.1.0"


LIVENESS_2X = {"httpGet": {"path": "/healthz", "port": 8181, "scheme": "HTTP"},
               "initialDelaySeconds": 30, "periodSeconds": 5, "successThreshold": 1,
               "failureThreshold": 3, "timeoutSeconds": 1}


def test_the_2x_probe_switch_means_the_liveness_probe(tmp_path):
    # kube2iam chart 2.1.0-2.5.0: probe: true|false, at fixed timings.
    assert container(render(values_file(tmp_path, {"probe": True})))["livenessProbe"] == \
        LIVENESS_2X
    assert "livenessProbe" not in container(render(values_file(tmp_path, {"probe": False})))
    # 2.5.1-2.6.0: a map; keys left out keep that chart's defaults.
    probe = container(render(values_file(tmp_path, {"probe": {"periodSeconds": 15}})))
    assert probe["livenessProbe"] == {**LIVENESS_2X, "periodSeconds": 15}
    assert "livenessProbe" not in container(render(values_file(
        tmp_path, {"probe": {"enabled": False, "periodSeconds": 15}})))
    # Their 2.x had no readiness probe: kiamfast's own default stays (docs' table says why).
    assert probe["readinessProbe"]["exec"] == {"command": ["test", "-f",
                                                           "/run/kiamfast-pod/ready"]}


def test_global_image_pull_secrets_win_as_in_kube2iams_charts(tmp_path):
    both = {"global": {"imagePullSecrets": ["global-creds"]},
            "image": {"pullSecrets": ["image-creds"]}}
    assert pod_spec(render(values_file(tmp_path, both)))["imagePullSecrets"] == \
        [{"name": "global-creds"}]
    only_image = {"image": {"pullSecrets": ["image-creds"]}}
    assert pod_spec(render(values_file(tmp_path, only_image)))["imagePullSecrets"] == \
        [{"name": "image-creds"}]
    assert "imagePullSecrets" not in pod_spec(render())


def test_an_explicit_on_delete_stays_and_the_notes_say_how_to_roll(tmp_path):
    switch = values_file(tmp_path, {"kube2iamChart": "kube2iam-chart"})
    explicit = values_file(tmp_path, {"updateStrategy": "OnDelete"})
    ds = one(render(explicit, switch), "DaemonSet")
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    (tmp_path / "explicit").mkdir()
    text = notes(tmp_path / "explicit", explicit, switch)
    assert "updateStrategy is OnDelete" in text
    assert ("kubectl --namespace kube-system delete pod --field-selector spec.nodeName=<node> "
            "-l app.kubernetes.io/instance=kube2iam,app.kubernetes.io/name=kube2iam-chart"
            ) in text
    # Left out (a values file without it): kiamfast's RollingUpdate, no note.
    assert one(render(switch), "DaemonSet")["spec"]["updateStrategy"]["type"] == \
        "RollingUpdate"
    (tmp_path / "left-out").mkdir()
    assert "updateStrategy is OnDelete" not in notes(tmp_path / "left-out", switch)


def test_the_lookup_guard_is_silent_without_a_cluster():
    # `helm template` (GitOps) sees no cluster: the guard against a second DaemonSet only
    # acts in `helm upgrade` (tests/k8s/test_chart_switch.py); the render is unchanged.
    result = helm("template", "kube2iam", str(CHART), "--namespace", NAMESPACE,
                  "--set", "kube2iamChart=kube2iam")
    assert result.returncode == 0, result.stderr


# ---- plain manifests copied from kube2iam's README or its kustomize base -------------------

def kube2iam_source(path: str) -> Path:
    if not (KUBE2IAM_SRC / path).exists():
        pytest.skip(f"needs kube2iam's source: set KUBE2IAM_SRC ({KUBE2IAM_SRC})")
    return KUBE2IAM_SRC / path


def kustomize_daemonsets() -> list[dict]:
    """kube2iam's kustomize/base (kube-system, the recommended name label)."""
    return of_kind(kustomize(kube2iam_source("kustomize/base")), "DaemonSet")


def readme_daemonsets() -> list[dict]:
    """Every DaemonSet of kube2iam's README (they select `name: kube2iam`)."""
    text = kube2iam_source("README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    docs = [d for b in blocks for d in yaml.safe_load_all(b) if isinstance(d, dict)]
    return of_kind(docs, "DaemonSet")


OVERLAYS = {"deploy/overlays/kube2iam": kustomize_daemonsets,
            "deploy/overlays/kube2iam-name-label": readme_daemonsets}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlays_update_kube2iams_plain_manifests_in_place(overlay):
    new = kustomize(REPO / overlay)
    ds = one(new, "DaemonSet")
    theirs_all = OVERLAYS[overlay]()
    assert theirs_all
    for theirs_ds in theirs_all:
        assert ds["metadata"]["name"] == theirs_ds["metadata"]["name"] == "kube2iam"
        assert ds["metadata"]["namespace"] == theirs_ds["metadata"].get("namespace",
                                                                          "kube-system")
        assert ds["spec"]["selector"] == theirs_ds["spec"]["selector"]   # immutable
        assert [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]] == \
            [c["name"] for c in theirs_ds["spec"]["template"]["spec"]["containers"]] + \
            ["socket-keeper"]
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "kube2iam"
    # Their RBAC (kustomize/base's; the README's RBAC section names the same), theirs by
    # kind, name and namespace: updated by `kubectl apply -k`, nothing left beside.
    kept = {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in new}
    for obj in kustomize(kube2iam_source("kustomize/base")):
        assert (obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace")) in kept
    binding = one(new, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kube2iam",
                                    "namespace": "kube-system"}]
    assert binding["roleRef"]["name"] == one(new, "ClusterRole")["metadata"]["name"]


def test_the_overlay_is_the_base_but_for_kube2iams_names():
    base, new = kustomize(REPO / "deploy" / "base"), kustomize(REPO / "deploy/overlays/kube2iam")
    b, n = one(base, "DaemonSet"), one(new, "DaemonSet")
    b_pod, n_pod = b["spec"]["template"]["spec"], n["spec"]["template"]["spec"]
    assert {k: v for k, v in n_pod.items() if k not in ("containers", "serviceAccountName")} \
        == {k: v for k, v in b_pod.items() if k not in ("containers", "serviceAccountName")}
    assert {**n_pod["containers"][0], "name": "kiamfast"} == b_pod["containers"][0]
    # The same rules, the one naming the agent's own DaemonSet naming kube2iam's.
    renamed = [{**r, "resourceNames": ["kiamfast"]} if r.get("resourceNames") == ["kube2iam"]
               else r for r in one(new, "ClusterRole")["rules"]]
    assert renamed == one(base, "ClusterRole")["rules"]
    assert ["kube2iam"] in [r.get("resourceNames") for r in one(new, "ClusterRole")["rules"]]
