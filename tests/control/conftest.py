"""Fixtures for the pod-watch tests: a real table file, a credential-sink double, a clock."""
from __future__ import annotations

from typing import Any

import pytest
from control_support import BASE, Clock, SlotSink

from kiamfast import table as tablemod
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.mappings.policy import RolePolicy


@pytest.fixture
def table_path(tmp_path):
    return str(tmp_path / "kiamfast-table")


@pytest.fixture
def table(table_path):
    t = tablemod.Table.create(table_path, ip_capacity=1024, cred_capacity=64, value_size=1024,
                              aux_count=1, aux_size=1024, max_workers=2)
    yield t
    t.close()


@pytest.fixture
def sink():
    return SlotSink()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def make_model(table, sink, clock):
    def make(*, proof: Any = None, **policy_kw: Any) -> NodeModel:
        """``proof``: the kernel's word (control_support.Kernel); None: a READY sandbox is
        taken at its word (--address-proof=runtime)."""
        notes: list[int] = []
        policy_kw.setdefault("base_role_arn", BASE)
        m = NodeModel(policy=RolePolicy(**policy_kw), table=table, sink=sink,
                      notify=lambda: notes.append(1), clock=clock, proof=proof)
        m.notes = notes  # type: ignore[attr-defined]
        return m
    return make
