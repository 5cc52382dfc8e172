"""The sandboxes the last runtime view held, kept beside the table (``<table>.sandboxes``) so
that a restarted control process asks the runtime only for the sandboxes it has not seen.

A restart's first poll is what lets the workers answer the adopted owners again (the
freshness rule: a poll begun after the connection).  Without this file that poll sends a
``PodSandboxStatus`` for every READY sandbox of the node, because only the status carries
a sandbox's addresses; with it, one ``ListPodSandbox`` and a status for the new ones.

Why a saved entry may stand in for a status: everything in it is fixed when the sandbox is
created and never changes while its id is listed (the addresses CNI gave it, the kubelet's
labels and the annotations copied from the pod, its network namespace's path), and a sandbox
id is never reused.  The
poll that reads the file still asks the runtime which ids are READY now: an entry whose id
is no longer listed is dropped, so a saved entry can never keep an owner the runtime no
longer shows (docs/architecture.md, "A restarted or upgraded agent adopts the table").  A
file that does not parse, names another endpoint or another format is ignored (one line):
the poll then asks for every status, as without it.

Bounded: an entry whose annotations are larger than ``MAX_ENTRY`` bytes (a pod may carry
256 KiB of them) is left out, and so is everything past ``MAX_FILE`` bytes: the file is on
the table's tmpfs, charged to the agent's memory.  Those sandboxes are asked for again.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from types import MappingProxyType

import orjson

from kiamfast.control.cri.client import Sandbox
from kiamfast.table import files_beside

log = logging.getLogger("kiamfast.runtime")

FORMAT = 2             # 2: with each sandbox's network namespace
MAX_ENTRY = 16 * 1024
MAX_FILE = 2 * 1024 * 1024


def path_for(table_path: str) -> str:
    return files_beside(table_path)[1]


def load(path: str, endpoint: str) -> tuple[Sandbox, ...]:
    """The entries saved for ``endpoint``, or none."""
    try:
        with open(path, "rb") as f:
            saved = orjson.loads(f.read(MAX_FILE + 1))
        if saved.get("format") != FORMAT or saved.get("endpoint") != endpoint:
            return ()
        return tuple(Sandbox(id=e["id"], pod_uid=e["pod_uid"], name=e["name"],
                             namespace=e["namespace"], ips=tuple(e["ips"]),
                             annotations=MappingProxyType(dict(e["annotations"])),
                             created_ns=int(e["created_ns"]), netns=str(e.get("netns", "")))
                     for e in saved["sandboxes"])
    except FileNotFoundError:
        return ()
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.info("ignoring %s (%s: %s): the first poll asks for every sandbox's status",
                 path, type(exc).__name__, exc)
        return ()


def save(path: str, endpoint: str, sandboxes: Iterable[Sandbox]) -> None:
    """Replace the file with these entries (written aside, then renamed: a reader never sees
    half of it).  Never raises: a file not written only costs a restart its status calls."""
    entries, size = [], 0
    for s in sandboxes:
        entry = orjson.dumps({"id": s.id, "pod_uid": s.pod_uid, "name": s.name,
                              "namespace": s.namespace, "ips": s.ips,
                              "annotations": dict(s.annotations), "created_ns": s.created_ns,
                              "netns": s.netns})
        if len(entry) > MAX_ENTRY or size + len(entry) > MAX_FILE - 256:
            continue
        entries.append(entry)
        size += len(entry) + 1
    head = orjson.dumps({"format": FORMAT, "endpoint": endpoint})[:-1]
    body = head + b',"sandboxes":[' + b",".join(entries) + b"]}"
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("cannot save %s: %s", path, exc)
