"""A small kustomize, enough to render deploy/ without the kustomize binary.

Supports what our kustomizations use: ``resources`` (files and directories holding a
kustomization), ``labels`` (pairs added to metadata.labels), ``namespace``, ``images``
(newName / newTag / digest) and ``patches`` with an inline JSON 6902 patch and a target
(kind, name, group, version). Anything else raises, so a kustomization using a feature this
renderer does not know fails the tests instead of being rendered wrongly.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "labels", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "Namespace", "PriorityClass",
                  "CustomResourceDefinition"}


class KustomizeError(Exception):
    pass


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize <directory>`` would print, in resource order."""
    directory = Path(directory)
    path = directory / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text())
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{path}: not a Kustomization")
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        target = (directory / resource).resolve()
        if target.is_dir():
            objects.extend(render(target))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(target.read_text()) if doc)
    for entry in spec.get("labels", []):
        if set(entry) - {"pairs", "includeSelectors", "includeTemplates"} or \
                entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise KustomizeError(f"{path}: only plain label pairs are supported")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    for patch in spec.get("patches", []):
        if set(patch) - {"target", "patch"}:
            raise KustomizeError(f"{path}: only inline patches with a target are supported")
        ops = yaml.safe_load(patch["patch"])
        if not isinstance(ops, list):
            raise KustomizeError(f"{path}: only JSON 6902 patches are supported")
        matched = [o for o in objects if _matches(o, patch["target"])]
        if not matched:
            raise KustomizeError(f"{path}: patch target {patch['target']} matches nothing")
        for obj in matched:
            apply_json_patch(obj, ops)
    return objects


def _matches(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return all([
        target.get("kind", obj["kind"]) == obj["kind"],
        target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"],
        target.get("group", group) == group,
        target.get("version", version) == version,
    ])


def _set_image(obj: dict[str, Any], image: dict[str, str]) -> None:
    pod = (obj.get("spec") or {}).get("template", {}).get("spec")
    if not pod:
        return
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        ref = container["image"]
        name, tag = ref.rsplit(":", 1) if ":" in ref.rsplit("/", 1)[-1] else (ref, None)
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{name}@{image['digest']}"
        else:
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_json_patch(obj: Any, ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add / replace / remove / test, in place."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if kind == "add":
            value = copy.deepcopy(op["value"])
            if isinstance(node, list):
                if last == "-":
                    node.append(value)
                else:
                    node.insert(int(last), value)
            else:
                node[last] = value
        elif kind == "replace":
            key = int(last) if isinstance(node, list) else last
            if isinstance(node, dict) and key not in node:
                raise KustomizeError(f"replace of missing {op['path']}")
            node[key] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[int(last) if isinstance(node, list) else last]
        elif kind == "test":
            if node[int(last) if isinstance(node, list) else last] != op["value"]:
                raise KustomizeError(f"test failed at {op['path']}")
        else:
            raise KustomizeError(f"unsupported op {kind}")
