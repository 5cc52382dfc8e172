"""The supervisor adopts the table a previous agent left, and only a table that is safe to.

A restarted container (liveness probe, OOM) or a new pod after an upgrade finds the table at
--table-path: its credential slots are kept (the new control process serves them again with
no STS call), but nothing that says *how fresh* an owner is survives: the status words, the
runtime-poll dates and what the old control process published are cleared before any worker
starts, and the IP slots too unless a runtime decided them and this agent asks one (its
first poll confirms or takes each).  A file that is not our own private table
of the layout this agent makes (a symlink, open permissions, another owner, another layout,
garbage) is never adopted: a fresh table replaces it.  While any process of a previous agent
that could write the table lives, a new supervisor does not touch it (the table lock).

These tests run the supervisor's set-up (`Supervisor.prepare`: bind, lock, table, token
key) without starting children; tests/supervisor/test_agent_restart.py restarts the whole
agent.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kiamfast.testing.net import free_port
from kiamfast import supervisor, table
from kiamfast.supervisor import start_errors, statefiles
from kiamfast.config import Config

POD_IP = "10.0.0.7"
PARTS = [b"role", b"listing", b"document", b"ext", b"info", b'{"key": 1}']


def config(tmp_path, **overrides) -> Config:
    port = free_port()
    settings = dict(node="n1", host_ip="10.0.0.1", app_port=port, metrics_port=port,
                    table_path=str(tmp_path / "table"), token_key_file=str(tmp_path / "key"),
                    cri_endpoint="none", iptables=False, node_startup_taint="")
    return Config(**{**settings, **overrides})


def prepared(cfg: Config) -> supervisor.Supervisor:
    sup = supervisor.Supervisor(cfg)
    sup.prepare()
    return sup


def used_table(cfg: Config) -> None:
    """A table as a running agent leaves it: an address, its credentials, fresh dates."""
    sup = prepared(cfg)
    try:
        t = sup.table
        t.write_cred(3, PARTS, serve_until=4e9)
        t.claim_ip(POD_IP, "pod-uid", table.POD_ROLE, 3)
        t.set_status(synced=True, ready=True, pending_pods=2)
        t.set_verified(2**62)
        t.set_failed(2**62)
        t.heartbeat()
        t.write_aux(table.AUX_HEALTH, b'{"hostIP": "10.0.0.1"}')
    finally:
        sup.close()


def cred_of_slot_3(t: table.Table) -> list[bytes]:
    state, serve_until, parts = t.read_cred(3)
    assert state == table.CRED_READY and serve_until == 4e9
    return parts


def test_a_previous_agents_table_is_adopted_with_only_its_credentials(tmp_path):
    cfg = config(tmp_path)
    used_table(cfg)
    inode = os.stat(cfg.table_path).st_ino
    sup = prepared(cfg)
    try:
        t = sup.table
        assert os.stat(cfg.table_path).st_ino == inode          # the same file, not a new one
        assert cred_of_slot_3(t) == PARTS                        # credentials kept
        assert t.snapshot() == []                                # no address has an owner
        assert t.lookup_pod(table.ip_key(POD_IP)) is None
        assert (t.synced, t.ready, t.pending_pods) == (False, False, 0)
        # Dates of another boot's CLOCK_MONOTONIC would let old polls count for new
        # connections: every one is forgotten.
        assert (t.verified_ns, t.failed_ns, t.heartbeat_age) == (0, 0, None)
        assert t.read_aux(table.AUX_HEALTH) == b""               # the old process's health
    finally:
        sup.close()


def runtime_table(cfg: Config) -> None:
    used_table(cfg)
    with table.Table.attach(cfg.table_path, writer=True) as t:
        t.set_status(runtime_mode=True)


def test_a_runtime_mode_table_keeps_its_addresses_for_the_first_poll_to_confirm(tmp_path):
    """Decided by a runtime, asked again by this agent: the addresses stay (so the first
    poll can confirm them before the API is asked), but with every date gone no worker
    answers one before that poll."""
    cfg = config(tmp_path, cri_endpoint="unix:///run/containerd/containerd.sock")
    runtime_table(cfg)
    sup = prepared(cfg)
    try:
        t = sup.table
        assert [(s["ip"], s["pod_uid"], s["cred_slot"]) for s in t.snapshot()] == \
            [(POD_IP, "pod-uid", 3)]
        assert t.runtime_mode
        assert (t.verified_ns, t.failed_ns, t.heartbeat_age) == (0, 0, None)
        assert (t.synced, t.ready, t.pending_pods) == (False, False, 0)
        assert cred_of_slot_3(t) == PARTS
    finally:
        sup.close()


@pytest.mark.parametrize("endpoint", ["none", ""])
def test_a_runtime_mode_table_forgets_its_addresses_when_no_runtime_is_asked(tmp_path,
                                                                            endpoint):
    """Without a runtime nothing would check an address before a worker served it."""
    cfg = config(tmp_path, cri_endpoint="unix:///run/containerd/containerd.sock")
    runtime_table(cfg)
    sup = prepared(cfg.replace(cri_endpoint=endpoint))
    try:
        assert sup.table.snapshot() == []
        assert cred_of_slot_3(sup.table) == PARTS
    finally:
        sup.close()


def not_adopted(cfg: Config, caplog, reason: str) -> None:
    """The supervisor made a fresh table at the path and logged why."""
    sup = prepared(cfg)
    try:
        assert os.path.isfile(cfg.table_path) and not os.path.islink(cfg.table_path)
        st = os.stat(cfg.table_path)
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o600)
        assert sup.table.read_cred(3)[0] == table.CRED_EMPTY
        assert sup.table.layout == table.Table.attach(cfg.table_path).layout
    finally:
        sup.close()
    assert reason in caplog.text, caplog.text


def test_a_symlink_is_not_followed(tmp_path, caplog):
    cfg = config(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    elsewhere = config(tmp_path / "elsewhere")
    used_table(elsewhere)
    before = open(elsewhere.table_path, "rb").read()
    os.symlink(elsewhere.table_path, cfg.table_path)
    not_adopted(cfg, caplog, "unusable")
    assert open(elsewhere.table_path, "rb").read() == before    # the target is untouched


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o604])
def test_a_table_open_to_others_is_not_adopted(tmp_path, caplog, mode):
    cfg = config(tmp_path)
    used_table(cfg)
    os.chmod(cfg.table_path, mode)
    not_adopted(cfg, caplog, f"has mode {mode:04o}")


@pytest.mark.root
def test_a_table_of_another_user_is_not_adopted(tmp_path, caplog):
    cfg = config(tmp_path)
    used_table(cfg)
    os.chown(cfg.table_path, 65534, 65534)
    not_adopted(cfg, caplog, "is owned by uid 65534")


def test_a_table_of_another_layout_is_not_adopted(tmp_path, caplog):
    cfg = config(tmp_path)
    table.Table.create(cfg.table_path, cred_capacity=8).close()
    not_adopted(cfg, caplog, "layout")


def test_a_file_that_is_no_table_is_not_adopted(tmp_path, caplog):
    cfg = config(tmp_path)
    used_table(cfg)
    size = os.stat(cfg.table_path).st_size
    with open(cfg.table_path, "r+b") as f:
        f.write(os.urandom(4096))
    assert os.stat(cfg.table_path).st_size == size
    not_adopted(cfg, caplog, "not a kiamfast table")


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_second_agent_waits_for_the_first_to_let_go_of_the_table(tmp_path, monkeypatch,
                                                                    caplog):
    """Two supervisors on one table (two agents on other ports, or a new one while the old
    one's control process still runs): the second touches nothing until the first is gone,
    and gives up if it never goes."""
    cfg = config(tmp_path)
    first = prepared(cfg)
    monkeypatch.setattr(statefiles, "LOCK_WAIT", 0.3)
    with pytest.raises(start_errors.CannotStart, match="held by another kiamfast") as held:
        prepared(config(tmp_path))
    assert str(held.value).startswith("--table-path=") and held.value.code == 1
    first.table.set_status(ready=True)

    second = supervisor.Supervisor(config(tmp_path))
    monkeypatch.setattr(statefiles, "LOCK_WAIT", 30)
    started = threading.Thread(target=second.prepare)
    started.start()
    try:
        wait_for(lambda: "waiting for" in caplog.text)
        assert first.table.ready          # not reset: the second has not adopted it yet
        first.close()
        started.join(30)
        assert not started.is_alive()
        assert second.table.ready is False
    finally:
        started.join(30)
        second.close()

