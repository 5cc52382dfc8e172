"""PATCH bodies for the API server emulator: JSON merge patch (RFC 7386), strategic merge
patch (reduced to core/v1 Pods, Nodes and Namespaces) and JSON patch (RFC 6902).

kiamfast removes its node's startup taint with a PATCH; the emulator must apply the three
content types the way the real API server does for that object, reject what it rejects
(a failed ``test`` op is 422 and changes nothing) and never modify the stored object in
place: every function here works on a copy.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

from kiamfast.testing.apiserver_objects import ApiError

__all__ = ["PatchError", "apply_patch", "json_patch", "merge_patch", "strategic_merge_patch"]


class PatchError(ApiError):
    """A patch that cannot be applied (422 Invalid, like the real server)."""

    def __init__(self, message: str) -> None:
        super().__init__(422, message, reason="Invalid")


# Strategic-merge-patch merge keys of the core/v1 lists the emulator's objects carry.
# Lists not named here (spec.taints, for one: +listType=atomic) are replaced whole.
_SMP_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "conditions": "type",
    "addresses": "type",
    "podIPs": "ip",
    "hostIPs": "ip",
    "ownerReferences": "uid",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


_DELETE = object()


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch, reduced to what core/v1 Pods, Nodes and Namespaces need.

    Maps merge like RFC 7386; lists with a known merge key merge element-wise (with
    ``$patch: delete`` on an element); other lists are replaced; ``$patch: replace`` and
    ``$deleteFromPrimitiveList/<field>`` are honoured; other directives are ignored.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return _DELETE
    if directive == "replace":
        return _strip_directives(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in _SMP_MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_keyed_list(result[key], value, _SMP_MERGE_KEYS[key])
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = _strip_directives(copy.deepcopy(value))
    return result


def _merge_keyed_list(orig: list, patch: list, merge_key: str) -> list:
    out = copy.deepcopy(orig)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            if isinstance(item, dict) and item.get("$patch") == "replace":
                return []
            out.append(_strip_directives(copy.deepcopy(item)))
            continue
        idx = next((i for i, cur in enumerate(out)
                    if isinstance(cur, dict) and cur.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                del out[idx]
        elif idx is not None:
            out[idx] = strategic_merge_patch(out[idx], item)
        else:
            out.append(_strip_directives(copy.deepcopy(item)))
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer: {path!r}")
    return [tok.replace("~1", "/").replace("~0", "~") for tok in path[1:].split("/")]


def _index(container: list, token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token[0] == "0"):
        raise PatchError(f"invalid array index: {token!r}")
    idx = int(token)
    limit = len(container) if allow_end else len(container) - 1
    if idx > limit:
        raise PatchError(f"array index out of range: {idx}")
    return idx


def _walk(doc: Any, tokens: list[str], path: str) -> Any:
    cur = doc
    for tok in tokens:
        if isinstance(cur, dict):
            if tok not in cur:
                raise PatchError(f"path not found: {path}")
            cur = cur[tok]
        elif isinstance(cur, list):
            cur = cur[_index(cur, tok, allow_end=False)]
        else:
            raise PatchError(f"path not found: {path}")
    return cur


def _jp_get(doc: Any, path: str) -> Any:
    return _walk(doc, _pointer(path), path)


def _jp_add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _walk(doc, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise PatchError(f"cannot add to non-container at {path}")
    return doc


def _jp_remove(doc: Any, path: str) -> tuple[Any, Any]:
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _walk(doc, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"unable to remove nonexistent key: {last}: missing value")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, allow_end=False))
    raise PatchError(f"cannot remove from non-container at {path}")


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy, test."""
    if not isinstance(ops, list):
        raise ApiError(400, "json patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid json patch operation: {op!r}")
        name, path = op["op"], op["path"]
        if name in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"missing value for {name} operation at {path}")
        if name == "add":
            doc = _jp_add(doc, path, copy.deepcopy(op["value"]))
        elif name == "remove":
            doc, _ = _jp_remove(doc, path)
        elif name == "replace":
            doc, _ = _jp_remove(doc, path)
            doc = _jp_add(doc, path, copy.deepcopy(op["value"]))
        elif name == "move":
            doc, value = _jp_remove(doc, op.get("from", ""))
            doc = _jp_add(doc, path, value)
        elif name == "copy":
            doc = _jp_add(doc, path, copy.deepcopy(_jp_get(doc, op.get("from", ""))))
        elif name == "test":
            if _jp_get(doc, path) != op["value"]:
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"unexpected json patch operation: {name!r}")
    return doc


PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/json-patch+json": "json",
    "application/apply-patch+yaml": "apply",
}


def apply_patch(obj: dict, content_type: str, body: bytes) -> dict:
    """Apply a PATCH body of ``content_type`` to a copy of ``obj`` and return the copy."""
    ptype = PATCH_TYPES.get(content_type.split(";", 1)[0].strip().lower())
    if ptype is None or ptype == "apply":
        raise ApiError(415, f"the body of the request was in an unknown format - accepted "
                            f"media types include: {', '.join(sorted(k for k in PATCH_TYPES if 'apply' not in k))}")
    try:
        patch = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"error decoding patch: {exc}") from None
    if ptype == "json":
        return json_patch(obj, patch)
    if not isinstance(patch, dict):
        raise ApiError(400, "patch body must be a JSON object")
    if ptype == "merge":
        return merge_patch(obj, patch)
    result = strategic_merge_patch(obj, patch)
    if result is _DELETE:
        raise PatchError("cannot delete the whole object with a patch")
    return result
