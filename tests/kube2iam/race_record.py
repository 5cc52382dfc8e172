"""Measuring the pod-address races on kube2iam and kiamfast alike: whose identity each answer
carried, when the first right one came, and the record of the numbers.

An answer's identity is judged by STS: a credential document is the pod's own only if STS
issued its key for the pod's role; a listing naming another role, or a key STS issued for
another role (or the node's key from the metadata service), is another identity.

The numbers of a run are printed as JSON lines (``RACE {...}``) and, when
``KUBE2IAM_RACES_RECORD`` names a file, written there at the end of the module
(docs/kube2iam-races.json is such a run; docs/performance.md's race table quotes it).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

from e2e_cluster import NODE_ACCESS_KEY_PREFIX, Pod
from imds_probe import Sample

SDK_TIMEOUT = 1.0     # botocore's metadata timeout: one attempt of 1 s per request
RECORD_ENV = "KUBE2IAM_RACES_RECORD"


def identity(pod: Pod, sample: Sample) -> str:
    """"own", "none" (an error, no identity), "node", or the other role it named."""
    if sample.access_key:
        if sample.access_key.startswith(NODE_ACCESS_KEY_PREFIX):
            return "node"
        role = pod.node.sts.role_of(sample.access_key)
        return "own" if role == pod.role else f"role {role}"
    if sample.stage == "document" and sample.role != pod.role:
        return f"role {sample.role}"   # the listing named another pod's role
    return "none"


def outcome(pod: Pod, sample: Sample) -> str:
    """What a client saw, in words: ``200 own``, ``404 at listing``, ``no answer in 1 s``."""
    if sample.status == 0:
        return f"no answer in {SDK_TIMEOUT:g} s ({sample.stage})"
    who = identity(pod, sample)
    if who == "none":
        return f"{sample.status} at {sample.stage}"
    return f"{sample.status}, {'its own role' if who == 'own' else who + ', not its own'}"


def wrong(pod: Pod, samples: list[Sample]) -> list[Sample]:
    """The answers that carried an identity other than the pod's own."""
    return [s for s in samples if identity(pod, s) not in ("own", "none")]


def fetch(pod: Pod) -> Sample:
    """One botocore-style fetch from ``pod`` with botocore's timeout."""
    return pod.fetch(timeout=SDK_TIMEOUT)


def fetch_until_own(pod: Pod, *, since: float, timeout: float = 20.0,
                    interval: float = 0.02) -> tuple[list[Sample], float | None]:
    """Fetch until the pod's own credentials come; the samples and the seconds from
    ``since`` (time.monotonic()) to the end of the first right answer (None: never)."""
    samples: list[Sample] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sample = fetch(pod)
        samples.append(sample)
        if identity(pod, sample) == "own":
            return samples, round(time.monotonic() - since, 3)
        time.sleep(interval)
    return samples, None


def spread(values: list[float | None]) -> dict:
    """Median and max of the measured values, and how many never came (None)."""
    got = [v for v in values if v is not None]
    return {"n": len(values), "never": len(values) - len(got),
            "median": round(statistics.median(got), 3) if got else None,
            "max": round(max(got), 3) if got else None}


class RaceRecord:
    """agent -> case -> numbers, for one test module; printed as ``<label> {...}`` lines and
    merged into the file ``env`` names, if it names one."""

    def __init__(self, label: str = "RACE", env: str = RECORD_ENV) -> None:
        self.label, self.env = label, env
        self.cases: dict[str, dict[str, dict]] = {}

    def add(self, agent: str, case: str, numbers: dict) -> None:
        self.cases.setdefault(agent, {})[case] = numbers
        print(f"{self.label} " + json.dumps({"agent": agent, "case": case, **numbers}))

    def write_if_asked(self) -> None:
        path = os.environ.get(self.env)
        if not path or not self.cases:
            return
        target = Path(path)
        old = json.loads(target.read_text()) if target.is_file() else {}
        for agent, cases in self.cases.items():
            old.setdefault(agent, {}).update(cases)
        target.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")


def module_record(label: str = "RACE", env: str = RECORD_ENV):
    """A test module's RaceRecord, and the autouse module fixture (assign it to a module
    name) that writes it when the module's tests are done."""
    record = RaceRecord(label, env)

    @pytest.fixture(scope="module", autouse=True)
    def write_record():
        yield record
        record.write_if_asked()
    return record, write_record
