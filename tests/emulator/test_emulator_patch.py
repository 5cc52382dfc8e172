"""PATCH semantics and field selectors of the emulator, checked on plain objects (the HTTP
path is covered in test_emulator_rest.py)."""

from __future__ import annotations

import pytest

from kiamfast.testing.apiserver_objects import ApiError, FieldSelector, make_pod
from kiamfast.testing.apiserver_patch import (
    PatchError,
    apply_patch,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)

NODE = {
    "metadata": {"name": "n", "labels": {"a": "1", "b/c": "2"}},
    "spec": {"taints": [{"key": "x", "effect": "NoSchedule"},
                        {"key": "y", "effect": "NoExecute"}]},
    "status": {"conditions": [{"type": "Ready", "status": "True"},
                              {"type": "DiskPressure", "status": "False"}]},
}


def test_merge_patch_rfc7386():
    out = merge_patch(NODE, {"metadata": {"labels": {"a": None, "z": "9"}},
                             "spec": {"taints": [{"key": "q", "effect": "NoSchedule"}]}})
    assert out["metadata"]["labels"] == {"b/c": "2", "z": "9"}
    assert out["spec"]["taints"] == [{"key": "q", "effect": "NoSchedule"}]
    assert NODE["metadata"]["labels"] == {"a": "1", "b/c": "2"}       # input untouched


def test_strategic_merge_patch_merges_keyed_lists_and_replaces_taints():
    out = strategic_merge_patch(NODE, {
        "spec": {"taints": [{"key": "y", "effect": "NoExecute"}]},
        "status": {"conditions": [{"type": "Ready", "status": "False"},
                                  {"type": "DiskPressure", "$patch": "delete"}]},
    })
    assert out["spec"]["taints"] == [{"key": "y", "effect": "NoExecute"}]
    assert out["status"]["conditions"] == [{"type": "Ready", "status": "False"}]
    out = strategic_merge_patch(NODE, {"metadata": {"$deleteFromPrimitiveList/f": ["x"]},
                                       "spec": {"$patch": "replace", "podCIDR": "10.0.0.0/24"}})
    assert out["spec"] == {"podCIDR": "10.0.0.0/24"}


def test_json_patch_operations():
    out = json_patch(NODE, [
        {"op": "test", "path": "/metadata/labels/b~1c", "value": "2"},
        {"op": "remove", "path": "/spec/taints/0"},
        {"op": "add", "path": "/spec/taints/-", "value": {"key": "z", "effect": "NoSchedule"}},
        {"op": "add", "path": "/spec/taints/0", "value": {"key": "w", "effect": "NoSchedule"}},
        {"op": "replace", "path": "/metadata/labels/a", "value": "3"},
        {"op": "copy", "from": "/metadata/labels/a", "path": "/metadata/labels/c"},
        {"op": "move", "from": "/metadata/labels/b~1c", "path": "/metadata/labels/d"},
    ])
    assert [t["key"] for t in out["spec"]["taints"]] == ["w", "y", "z"]
    assert out["metadata"]["labels"] == {"a": "3", "c": "3", "d": "2"}
    assert len(NODE["spec"]["taints"]) == 2


@pytest.mark.parametrize("ops", [
    [{"op": "remove", "path": "/spec/taints/5"}],
    [{"op": "remove", "path": "/spec/nothing"}],
    [{"op": "replace", "path": "/spec/nothing", "value": 1}],
    [{"op": "test", "path": "/metadata/name", "value": "other"}],
    [{"op": "add", "path": "/missing/deeper", "value": 1}],
    [{"op": "frobnicate", "path": "/spec"}],
])
def test_json_patch_errors_are_422(ops):
    with pytest.raises(PatchError) as exc:
        json_patch(NODE, ops)
    assert exc.value.code == 422


def test_apply_patch_content_types():
    assert apply_patch(NODE, "application/merge-patch+json; charset=utf-8",
                       b'{"spec":{"taints":null}}')["spec"] == {}
    with pytest.raises(ApiError) as exc:
        apply_patch(NODE, "application/apply-patch+yaml", b"{}")
    assert exc.value.code == 415
    with pytest.raises(ApiError) as exc:
        apply_patch(NODE, "application/merge-patch+json", b"{not json")
    assert exc.value.code == 400


def test_field_selector_parsing_and_matching():
    pod = make_pod("ns", "p", uid="u", node="node-a", annotations=None, ips=["10.0.0.1"],
                   phase="Running", host_network=False, host_ip="172.31.0.1")
    assert FieldSelector("Pod", "spec.nodeName=node-a").node == "node-a"
    assert FieldSelector("Pod", "spec.nodeName!=node-a").node is None
    assert FieldSelector("Pod", "spec.nodeName=node-a,status.podIP==10.0.0.1").matches(pod)
    assert not FieldSelector("Pod", "status.phase!=Running").matches(pod)
    assert FieldSelector("Pod", "spec.hostNetwork=false").matches(pod)
    assert FieldSelector("Pod", None, namespace="ns").matches(pod)
    assert not FieldSelector("Pod", None, namespace="other").matches(pod)
    assert not FieldSelector("Pod", "")
    with pytest.raises(ApiError) as exc:
        FieldSelector("Pod", "spec.containers=x")
    assert exc.value.code == 400
    with pytest.raises(ApiError):
        FieldSelector("Node", "spec.nodeName=x")
    with pytest.raises(ApiError):
        FieldSelector("Pod", "no-operator")
