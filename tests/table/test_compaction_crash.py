"""A writer SIGKILLed at any step of an index compaction (or of the repair of one) leaves no
reader a wrong answer, and the next writer's repair loses nothing: every address it held is
found exactly once, with the same pod and credential slot, and no release can expose a stale
copy.  tests/table/test_table_torture.py kills writers at random; this kills at every step."""

import multiprocessing as mp
import shutil
import signal
import struct
import time

import pytest

from kiamfast import _table
from kiamfast import table as T

FAR = time.time() + 3600
CAPACITY = 64                     # compacts when live + tombstones reach 48
NEWCOMER = "10.3.9.9"             # the claim that triggers the compaction


def ip(i):
    return f"10.3.0.{i}"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A table whose next new claim compacts: 36 live addresses between 12 tombstones,
    scattered over the probe chains; returns (path, {ip: (uid, pod_state, cred_slot)})."""
    path = str(tmp_path_factory.mktemp("compaction") / "template")
    t = T.Table.create(path, ip_capacity=CAPACITY, cred_capacity=8, value_size=1024,
                       aux_count=0, max_workers=1)
    t.set_status(synced=True)     # an unknown address is a plain MISS unless the index is busy
    for slot in range(8):
        t.write_cred(slot, [b"role-%d" % slot, b"L", b"doc-%d" % slot], serve_until=FAR)
    owners = {}
    for i in range(48):
        if i % 5 == 4:
            t.claim_ip(ip(i), f"pod-{i}", T.POD_NO_ROLE)
            owners[ip(i)] = (f"pod-{i}", T.POD_NO_ROLE, -1)
        else:
            t.claim_ip(ip(i), f"pod-{i}", T.POD_ROLE, i % 8)
            owners[ip(i)] = (f"pod-{i}", T.POD_ROLE, i % 8)
    for i in range(0, 48, 4):
        assert t.release_ip(ip(i), f"pod-{i}")
        del owners[ip(i)]
    assert lookup(t, NEWCOMER)[0] == T.MISS
    t.close()
    return path, owners


def lookup(t, address):
    """(status, pod uid, credential slot) as a worker would see them."""
    status, _, uid, slot = t.read(address, T.PART_DOCUMENT, bytearray(1024))
    return status, uid, slot


def kill_writer_at(path, step, action):
    """Run `action(writer)` in a child that attaches as the writer and SIGKILLs itself at the
    `step`-th write of an index rebuild.  Returns whether it was killed (else it finished)."""
    proc = mp.get_context("fork").Process(target=_killed_writer, args=(path, step, action))
    proc.start()
    proc.join(60)
    assert proc.exitcode in (0, -signal.SIGKILL), proc.exitcode
    return proc.exitcode == -signal.SIGKILL


def _killed_writer(path, step, action):
    _table._crash_at_step(step)
    action(T.Table.attach(path, writer=True))


def claim_newcomer(writer):
    writer.claim_ip(NEWCOMER, "newcomer", T.POD_ROLE, 0)


def attach_only(writer):
    pass


def assert_readers_wait(path, owners):
    """While the index is half rebuilt, an address is BUSY (a 503) or answered with its own
    pod: never a MISS (404) and never another pod's identity."""
    reader = T.Table.attach(path)
    for address, (uid, state, slot) in owners.items():
        status, got_uid, got_slot = lookup(reader, address)
        assert status == T.BUSY or (got_uid, got_slot) == (uid, slot), (address, status, got_uid)
    assert lookup(reader, NEWCOMER)[0] == T.BUSY
    reader.close()


def assert_repaired(path, owners):
    """The next writer's attach finds every address once, with its pod and slot, and no
    claim + release of any address can expose a stale copy."""
    reader = T.Table.attach(path)
    writer = T.Table.attach(path, writer=True)
    held = sorted((e["ip"], e["pod_uid"], e["pod_state"], e["cred_slot"]) for e in writer.snapshot())
    assert held == sorted((a, *o) for a, o in owners.items()), "lost or duplicated addresses"
    for address, (uid, state, slot) in owners.items():
        assert writer.lookup_pod(address) == (uid, state, slot)
        status, got_uid, got_slot = lookup(reader, address)
        assert (status, got_uid, got_slot) == (T.READY if slot >= 0 else T.NO_ROLE, uid, slot)
    for address in owners:
        writer.claim_ip(address, "intruder", T.POD_NO_ROLE)
        assert writer.release_ip(address, "intruder")
        assert lookup(reader, address)[0] == T.MISS, f"{address}: a stale copy came back"
    # The live and tombstone counts are right again: exactly 48 addresses fit.
    for i in range(48):
        writer.claim_ip(f"10.4.0.{i}", f"fill-{i}", T.POD_NO_ROLE)
    with pytest.raises(T.TableFull):
        writer.claim_ip("10.4.1.1", "one-too-many", T.POD_NO_ROLE)
    writer.close()
    reader.close()


def kill_at_every_step(source, path, action, owners):
    """Run `action` on a fresh copy of `source` killed at its index write 1, 2, ... and check
    readers and the repair after each kill.  Returns the number of kills before `action` ran
    to the end (its finished table is left at `path`)."""
    kills = 0
    while True:
        shutil.copyfile(source, path)
        if not kill_writer_at(path, kills + 1, action):
            return kills
        kills += 1
        assert_readers_wait(path, owners)
        assert_repaired(path, owners)


def test_a_writer_killed_at_any_step_of_a_compaction_loses_nothing(template, tmp_path):
    source, owners = template
    path = str(tmp_path / "table")
    kills = kill_at_every_step(source, path, claim_newcomer, owners)
    assert kills > 3 * 12, f"the compaction ended after {kills} writes"
    finished = T.Table.attach(path)
    assert lookup(finished, NEWCOMER) == (T.READY, "newcomer", 0)


@pytest.mark.parametrize("compaction_step", [2, 20, 40, 50])
def test_a_writer_killed_while_repairing_a_killed_compaction_loses_nothing(
        template, tmp_path, compaction_step):
    source, owners = template
    crashed = str(tmp_path / "crashed")
    shutil.copyfile(source, crashed)
    assert kill_writer_at(crashed, compaction_step, claim_newcomer)
    path = str(tmp_path / "table")
    assert kill_at_every_step(crashed, path, attach_only, owners) > 0, "the repair was never killed"
    assert_repaired(path, owners)


# ---- a table an older kiamfast left damaged ------------------------------------------------------
# Before compaction was crash-safe, a writer killed mid-compaction lost entries and left holes
# in probe chains, and the next writer's attach only made index_seq even.  A claim for an
# address behind a hole then made a second live copy of it in front of the stale one.

def _mix64(x):
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def home_slot(address):
    """Where a probe for `address` starts (ext/_table.pyx key_hash)."""
    k0, k1 = struct.unpack("<QQ", T.ip_key(address))
    return _mix64(k0 ^ _mix64(k1)) & (CAPACITY - 1)


def punch_hole(path, index):
    """Empty IP slot `index` in the file, as the old compaction killed midway left it."""
    import mmap
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        ip_offset, = struct.unpack_from("<Q", m, 40)
        struct.pack_into("<I", m, ip_offset + 128 * index + 24, 0)   # used = EMPTY
        m.flush()
        m.close()


def slot_of(path, address):
    import mmap
    key = T.ip_key(address)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        ip_offset, = struct.unpack_from("<Q", m, 40)
        for i in range(CAPACITY):
            at = ip_offset + 128 * i
            if m[at + 8:at + 24] == key and struct.unpack_from("<I", m, at + 24)[0] == 1:
                m.close()
                return i
        m.close()
    raise AssertionError(f"{address} is in no slot")


def test_a_stale_copy_an_older_writer_left_behind_a_hole_is_dropped_at_attach(template, tmp_path):
    source, owners = template
    path = str(tmp_path / "table")
    shutil.copyfile(source, path)
    old_writer = T.Table.attach(path, writer=True)
    claim_newcomer(old_writer)                         # compacts now, not on the claim below
    owners = {**owners, NEWCOMER: ("newcomer", T.POD_ROLE, 0)}
    # An address that does not sit in its home slot, and the address that sits there.
    displaced = next(a for a in owners if slot_of(path, a) != home_slot(a)
                     and any(slot_of(path, b) == home_slot(a) for b in owners))
    in_the_way = next(a for a in owners if slot_of(path, a) == home_slot(displaced))
    punch_hole(path, home_slot(displaced))            # the older writer's lost compaction
    assert lookup(old_writer, displaced)[0] == T.MISS
    old_writer.claim_ip(displaced, "new-owner", T.POD_NO_ROLE)      # a second live copy
    old_writer.close()
    reader = T.Table.attach(path)
    before = {a: lookup(reader, a) for a in owners}
    writer = T.Table.attach(path, writer=True)          # this kiamfast adopts the table
    assert {a: lookup(reader, a) for a in owners} == before, "an answer changed at attach"
    assert lookup(reader, displaced) == (T.NO_ROLE, "new-owner", -1)
    assert writer.release_ip(displaced, "new-owner")
    assert lookup(reader, displaced)[0] == T.MISS, "the stale owner came back"
    assert sorted(e["ip"] for e in writer.snapshot()) == sorted(set(owners) - {in_the_way, displaced})
