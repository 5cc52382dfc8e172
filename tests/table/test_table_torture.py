"""One writer process churns the table while reader processes verify every snapshot; then the
writer is killed with SIGKILL mid-churn and a new writer repairs the table and carries on."""

import hashlib
import multiprocessing as mp
import os
import signal
import time

import pytest

from kiamfast import table as T

N_IPS = 64
N_SLOTS = 16
FAR = 4_000_000_000.0


def document(slot, version):
    """A credential part whose bytes prove their own integrity and name their slot."""
    body = (b"slot=%d;ver=%d;" % (slot, version)) + bytes([version % 251]) * (100 + (version * 37) % 3000)
    return body + hashlib.sha256(body).hexdigest().encode()


def check_document(raw):
    body, digest = raw[:-64], raw[-64:]
    assert hashlib.sha256(body).hexdigest().encode() == digest, "torn credential bytes"
    return int(body.split(b";")[0].split(b"=")[1])


def writer(path, seed, attach, stop_at):
    import random
    rnd = random.Random(seed)
    t = T.Table.attach(path, writer=True) if attach else T.Table.attach(path, writer=True)
    version = seed * 1_000_000
    owners = {}
    while time.monotonic() < stop_at:
        version += 1
        op = rnd.random()
        ip = f"10.9.{rnd.randrange(N_IPS) // 250}.{rnd.randrange(N_IPS)}"
        if op < 0.45:
            slot = rnd.randrange(N_SLOTS)
            uid = f"pod-{slot}-{version}"           # a pod's UID names its credential slot
            t.claim_ip(ip, uid, T.POD_ROLE, slot)
            owners[ip] = uid
        elif op < 0.6:
            # a stale release (the pod that owned it before), must never remove the owner
            t.release_ip(ip, f"pod-0-{version - 1}")
        elif op < 0.7 and ip in owners:
            t.release_ip(ip, owners.pop(ip))
        else:
            slot = rnd.randrange(N_SLOTS)
            t.write_cred(slot, [b"name", b"listing", document(slot, version)], serve_until=FAR)
        t.heartbeat()


def reader(path, stop_at, results):
    t = T.Table.attach(path)
    out = bytearray(8192)
    keys = [T.ip_key(f"10.9.0.{i}") for i in range(N_IPS)]
    reads = verified = busy = 0
    last_gen = 0
    try:
        while time.monotonic() < stop_at:
            for key in keys:
                g = t.generation
                assert g >= last_gen, "generation went back"
                last_gen = g
                status, n, uid, slot = t.read(key, T.PART_DOCUMENT, out)
                reads += 1
                if status == T.BUSY:
                    busy += 1
                elif status == T.READY:
                    doc_slot = check_document(bytes(out[:n]))
                    assert doc_slot == slot, "credential bytes of another slot"
                    assert uid.startswith(f"pod-{slot}-"), f"pod {uid} served slot {slot}"
                    verified += 1
                else:
                    assert status in (T.MISS, T.PENDING), T.STATUS_NAMES[status]
        results.put(("ok", reads, verified, busy))
    except AssertionError as e:
        results.put(("fail", str(e), reads, verified))


@pytest.mark.slow
def test_readers_never_see_torn_or_foreign_data_and_survive_writer_kill(tmp_path):
    path = str(tmp_path / "table")
    T.Table.create(path, ip_capacity=128, cred_capacity=N_SLOTS, value_size=4096,
                   aux_count=0).set_status(synced=True)
    ctx = mp.get_context("fork")
    start = time.monotonic()
    results = ctx.Queue()
    stop_readers = start + 6.0
    readers = [ctx.Process(target=reader, args=(path, stop_readers, results)) for _ in range(2)]
    for r in readers:
        r.start()
    w1 = ctx.Process(target=writer, args=(path, 1, False, start + 60))
    w1.start()
    time.sleep(2.0)
    os.kill(w1.pid, signal.SIGKILL)                    # mid-churn, possibly mid-write
    w1.join()
    time.sleep(0.5)                                    # readers keep answering meanwhile
    w2 = ctx.Process(target=writer, args=(path, 2, True, start + 5.0))
    w2.start()
    w2.join(30)
    assert w2.exitcode == 0
    outcomes = [results.get(timeout=30) for _ in readers]
    for r in readers:
        r.join(10)
    for outcome in outcomes:
        assert outcome[0] == "ok", outcome
        _, reads, verified, busy = outcome
        assert verified > 1000, outcome
    print("torture outcomes", outcomes)
    # After repair every slot is consistent and readable.
    t = T.Table.attach(path)
    out = bytearray(8192)
    for i in range(N_IPS):
        status, n, uid, slot = t.read(f"10.9.0.{i}", T.PART_DOCUMENT, out)
        assert status != T.BUSY


def test_writer_killed_mid_write_is_repaired_by_the_next_writer(tmp_path):
    """Leave a slot odd, as a writer SIGKILLed between its two sequence stores would."""
    path = str(tmp_path / "table")
    t = T.Table.create(path, ip_capacity=8, cred_capacity=2, value_size=1024, aux_count=1,
                       aux_size=64)
    t.set_status(synced=True)
    t.write_cred(0, [b"n", b"l", document(0, 1)], serve_until=FAR)
    t.claim_ip("10.9.0.1", "pod-0-1", T.POD_ROLE, 0)
    t.close()
    layout_offsets(path, make_odd=True)
    r = T.Table.attach(path)
    out = bytearray(8192)
    assert r.lookup(T.ip_key("10.9.0.1"), T.PART_DOCUMENT, out)[0] == T.BUSY   # bounded, no hang
    w = T.Table.attach(path, writer=True)
    assert w.repaired >= 2
    assert r.lookup(T.ip_key("10.9.0.1"), T.PART_DOCUMENT, out)[0] in (T.MISS, T.PENDING)
    w.write_cred(0, [b"n", b"l", document(0, 2)], serve_until=FAR)
    w.claim_ip("10.9.0.1", "pod-0-2", T.POD_ROLE, 0)
    status, n = r.lookup(T.ip_key("10.9.0.1"), T.PART_DOCUMENT, out)
    assert status == T.READY and check_document(bytes(out[:n])) == 0


def layout_offsets(path, make_odd):
    """Flip every used seqlock of the file to odd (what a crash mid-write leaves)."""
    import mmap
    import struct
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        (ip_cap, cred_cap, value_size) = struct.unpack_from("<III", m, 12)
        ip_off, cred_off = struct.unpack_from("<QQ", m, 40)
        for i in range(ip_cap):
            at = ip_off + 128 * i
            seq, = struct.unpack_from("<Q", m, at)
            if seq:
                struct.pack_into("<Q", m, at, seq + 1)
        seq, = struct.unpack_from("<Q", m, cred_off)
        struct.pack_into("<Q", m, cred_off, seq + 1)
        m.flush()
        m.close()
