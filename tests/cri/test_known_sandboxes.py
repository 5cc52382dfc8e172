"""The sandboxes a control process saw, kept beside the table for the next one
(kiamfast/control/cri/kept_sandboxes.py): a restart's first poll asks the runtime for the status of
new sandboxes only, and a saved entry never keeps an owner the runtime no longer lists.

Against the CRI fault double (the real runtime.v1 protocol on a unix socket), which counts
the calls it answers.
"""
from __future__ import annotations

import logging
import os

from kiamfast.control.cri import kept_sandboxes as known
from kiamfast.control.cri.client import RuntimeClient
from kiamfast.testing.cri_fault import fake_sandbox

ROLE = "iam.amazonaws.com/role"


def kept(cri_fault, client, path, *sandboxes):
    """The runtime holds ``sandboxes``; a control process polls it and keeps what it saw."""
    cri_fault.put(*sandboxes)
    view = client.poll()
    known.save(path, cri_fault.endpoint, view.sandboxes)
    return view


def first_view_after_restart(cri_fault, path):
    """The first poll of a new process's client, made as the control process makes it."""
    client = RuntimeClient(cri_fault.endpoint, timeout=0.5,
                           known=known.load(path, cri_fault.endpoint))
    try:
        return client.poll()
    finally:
        client.close()


def test_a_restarted_client_asks_only_for_the_sandboxes_it_has_not_seen(cri_fault, client,
                                                                       tmp_path):
    path = str(tmp_path / "table.sandboxes")
    pods = [fake_sandbox(name=f"p{i}", ip=f"10.0.0.{i}", annotations={ROLE: f"r{i}"})
            for i in range(1, 6)]
    before = kept(cri_fault, client, path, *pods)
    assert cri_fault.calls["PodSandboxStatus"] == 5
    newcomer = fake_sandbox(name="new", ip="10.0.0.9", annotations={ROLE: "new"})
    cri_fault.put(newcomer)
    view = first_view_after_restart(cri_fault, path)
    assert cri_fault.calls["PodSandboxStatus"] == 6           # the newcomer's only
    assert set(view.owners) == {*before.owners, "10.0.0.9"}
    for ip, owner in before.owners.items():                   # the same facts as a status
        assert view.owners[ip] == owner and view.owners[ip].annotations == owner.annotations


def test_a_saved_sandbox_the_runtime_no_longer_lists_owns_nothing(cri_fault, client,
                                                                  tmp_path):
    # While no agent ran, pod "old" went and "arriving" got its address: the saved entry
    # for "old" must not answer for that address.
    path = str(tmp_path / "table.sandboxes")
    old = fake_sandbox(name="old", ip="10.0.0.7", annotations={ROLE: "old-role"})
    stays = fake_sandbox(name="stays", ip="10.0.0.8")
    kept(cri_fault, client, path, old, stays)
    cri_fault.remove(old.id)
    arriving = fake_sandbox(name="arriving", ip="10.0.0.7", annotations={ROLE: "new-role"})
    cri_fault.put(arriving)
    view = first_view_after_restart(cri_fault, path)
    assert view.owners["10.0.0.7"].pod_uid == arriving.uid
    assert view.owners["10.0.0.7"].annotations[ROLE] == "new-role"
    assert view.owners["10.0.0.8"].pod_uid == stays.uid
    assert not view.conflicts


def test_a_stopped_sandbox_that_is_still_listed_as_notready_owns_nothing(cri_fault, client,
                                                                        tmp_path):
    path = str(tmp_path / "table.sandboxes")
    gone = fake_sandbox(name="gone", ip="10.0.0.5")
    kept(cri_fault, client, path, gone)
    cri_fault.stop_sandbox(gone.id)
    assert first_view_after_restart(cri_fault, path).owners == {}


def test_a_file_of_another_endpoint_format_or_damaged_is_not_used(cri_fault, client, tmp_path,
                                                                   caplog):
    caplog.set_level(logging.INFO, logger="kiamfast.runtime")
    path = str(tmp_path / "table.sandboxes")
    cri_fault.put(fake_sandbox(name="a", ip="10.0.0.1"))
    sandboxes = client.poll().sandboxes
    known.save(path, "unix:///run/other.sock", sandboxes)
    assert known.load(path, cri_fault.endpoint) == ()
    known.save(path, cri_fault.endpoint, sandboxes)
    assert known.load(path, cri_fault.endpoint) == sandboxes
    with open(path, "r+b") as f:
        f.write(b'{"format": 99')
    assert known.load(path, cri_fault.endpoint) == ()
    assert "ignoring" in caplog.text and path in caplog.text
    os.unlink(path)
    assert known.load(path, cri_fault.endpoint) == ()


def test_huge_annotations_are_not_kept_and_that_sandbox_is_asked_again(cri_fault, client,
                                                                       tmp_path):
    path = str(tmp_path / "table.sandboxes")
    big = fake_sandbox(name="big", ip="10.0.0.2", annotations={"x": "y" * known.MAX_ENTRY})
    small = fake_sandbox(name="small", ip="10.0.0.3")
    kept(cri_fault, client, path, big, small)
    assert os.path.getsize(path) < known.MAX_ENTRY
    assert [s.id for s in known.load(path, cri_fault.endpoint)] == [small.id]
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert set(first_view_after_restart(cri_fault, path).owners) == {"10.0.0.2", "10.0.0.3"}
    assert cri_fault.calls["PodSandboxStatus"] == 3           # both, then the big one again
