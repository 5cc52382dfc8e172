"""Unit tests of every table operation and error, as the control process and workers use them."""

import os
import time

import pytest

from kiamfast import table as T

FAR = time.time() + 3600


def parts(name=b"app", doc=b'{"Code":"Success"}'):
    return [name + b"\nrole/" + name, b"LISTING " + name, doc, b"EXT " + doc, b"INFO " + name]


@pytest.fixture
def tbl(tmp_path):
    t = T.Table.create(str(tmp_path / "table"), ip_capacity=64, cred_capacity=8, value_size=8192,
                       aux_count=2, aux_size=4096, max_workers=4)
    t.set_status(synced=True)     # a synced agent: unknown addresses are plain misses
    yield t
    t.close()


def lookup(t, ip, part=T.PART_DOCUMENT, match=None):
    out = bytearray(16384)
    status, n = t.lookup(T.ip_key(ip), part, out, match)
    return T.STATUS_NAMES[status], bytes(out[:n])


def test_ip_key_maps_ipv4_into_ipv6_space():
    assert T.ip_key("10.1.2.3") == T.ip_key("::ffff:10.1.2.3")
    assert len(T.ip_key("fd00::1")) == 16
    assert T.key_ip(T.ip_key("10.1.2.3")) == "10.1.2.3"
    assert T.key_ip(T.ip_key("fd00::1")) == "fd00::1"


@pytest.mark.parametrize("bad", ["", "10.0.0", "10.0.0.256", "not-an-ip", "fd00:::1"])
def test_ip_key_rejects_bad_addresses(bad):
    with pytest.raises(ValueError):
        T.ip_key(bad)


def test_claimed_ip_serves_its_credentials(tbl):
    tbl.write_cred(3, parts(), serve_until=FAR)
    tbl.claim_ip("10.0.0.7", "pod-a", T.POD_ROLE, 3)
    assert lookup(tbl, "10.0.0.7") == ("READY", b'{"Code":"Success"}')
    assert lookup(tbl, "10.0.0.7", T.PART_LISTING) == ("READY", b"LISTING app")
    assert tbl.lookup_pod("10.0.0.7") == ("pod-a", T.POD_ROLE, 3)


def test_ipv6_pods_are_served(tbl):
    tbl.write_cred(0, parts(b"v6"), serve_until=FAR)
    tbl.claim_ip("fd00:10::5", "pod-6", T.POD_ROLE, 0)
    assert lookup(tbl, "fd00:10::5", T.PART_LISTING) == ("READY", b"LISTING v6")
    assert lookup(tbl, "fd00:10::6")[0] == "MISS"


def test_unknown_ip_is_a_miss(tbl):
    assert lookup(tbl, "10.0.0.8") == ("MISS", b"")


def test_match_accepts_only_listed_names(tbl):
    tbl.write_cred(1, parts(b"app"), serve_until=FAR)
    tbl.claim_ip("10.0.0.1", "pod-a", T.POD_ROLE, 1)
    assert lookup(tbl, "10.0.0.1", match=b"app")[0] == "READY"
    assert lookup(tbl, "10.0.0.1", match=b"role/app")[0] == "READY"
    for wrong in (b"ap", b"apps", b"role/", b"", b"app\nrole/app", b"other"):
        assert lookup(tbl, "10.0.0.1", match=wrong)[0] == "MISMATCH", wrong


def test_pod_states_without_credentials(tbl):
    tbl.claim_ip("10.0.0.2", "pod-n", T.POD_NO_ROLE)
    tbl.claim_ip("10.0.0.3", "pod-d", T.POD_DENIED)
    assert lookup(tbl, "10.0.0.2")[0] == "NO_ROLE"
    assert lookup(tbl, "10.0.0.3")[0] == "DENIED"


def test_credential_states(tbl):
    tbl.claim_ip("10.0.0.4", "pod-p", T.POD_ROLE, 2)
    assert lookup(tbl, "10.0.0.4")[0] == "PENDING"        # never written
    tbl.write_cred(2, [], serve_until=0, state=T.CRED_PENDING)
    assert lookup(tbl, "10.0.0.4")[0] == "PENDING"
    tbl.write_cred(2, parts(), serve_until=FAR)
    assert lookup(tbl, "10.0.0.4")[0] == "READY"
    tbl.set_cred_state(2, T.CRED_ERROR)
    assert lookup(tbl, "10.0.0.4")[0] == "ERROR"
    tbl.set_cred_state(2, T.CRED_READY, serve_until=time.time() - 1)
    assert lookup(tbl, "10.0.0.4")[0] == "EXPIRED"
    tbl.clear_cred(2)
    assert lookup(tbl, "10.0.0.4")[0] == "PENDING"


def test_claim_moves_an_ip_to_the_new_pod_in_one_write(tbl):
    tbl.write_cred(0, parts(b"old"), serve_until=FAR)
    tbl.write_cred(1, parts(b"new"), serve_until=FAR)
    tbl.claim_ip("10.0.0.9", "pod-old", T.POD_ROLE, 0)
    g = tbl.generation
    tbl.claim_ip("10.0.0.9", "pod-new", T.POD_ROLE, 1)
    assert tbl.generation == g + 1
    assert lookup(tbl, "10.0.0.9", T.PART_LISTING) == ("READY", b"LISTING new")


def test_late_delete_of_old_pod_keeps_new_owner(tbl):
    tbl.write_cred(1, parts(b"new"), serve_until=FAR)
    tbl.claim_ip("10.0.0.9", "pod-old", T.POD_NO_ROLE)
    tbl.claim_ip("10.0.0.9", "pod-new", T.POD_ROLE, 1)
    assert tbl.release_ip("10.0.0.9", "pod-old") is False
    assert tbl.lookup_pod("10.0.0.9") == ("pod-new", T.POD_ROLE, 1)
    assert tbl.release_ip("10.0.0.9", "pod-new") is True
    assert tbl.lookup_pod("10.0.0.9") is None
    assert tbl.release_ip("10.0.0.9", "pod-new") is False


def test_generation_bumps_on_every_committed_change(tbl):
    g = tbl.generation
    tbl.claim_ip("10.0.0.1", "a", T.POD_NO_ROLE)
    tbl.write_cred(0, parts(), serve_until=FAR)
    tbl.set_cred_state(0, T.CRED_ERROR)
    tbl.release_ip("10.0.0.1", "a")
    tbl.set_status(synced=True)
    assert tbl.generation == g + 5
    assert tbl.release_ip("10.0.0.1", "a") is False      # no change, no bump
    assert tbl.generation == g + 5


def test_status_words(tbl):
    tbl.set_status(synced=False)
    assert (tbl.synced, tbl.ready, tbl.pending_pods, tbl.runtime_mode) == (False, False, 0, False)
    tbl.set_status(synced=True, ready=True, pending_pods=3, runtime_mode=True)
    r = T.Table.attach(tbl.path)
    assert (r.synced, r.ready, r.pending_pods, r.runtime_mode) == (True, True, 3, True)


def test_unknown_address_is_unsure_until_synced_and_no_pod_waits(tbl):
    out = bytearray(1024)
    key = T.ip_key("10.0.0.77")
    tbl.set_status(synced=False)
    assert tbl.lookup(key, T.PART_LISTING, out)[0] == T.UNSURE       # not synced
    tbl.set_status(synced=True, pending_pods=1)
    assert tbl.lookup(key, T.PART_LISTING, out)[0] == T.UNSURE       # a pod waits for its IP
    tbl.set_status(pending_pods=0)
    assert tbl.lookup(key, T.PART_LISTING, out)[0] == T.MISS


def test_runtime_mode_answers_only_connections_older_than_the_applied_poll(tbl):
    out = bytearray(1024)
    tbl.write_cred(2, parts(b"a"), serve_until=FAR)
    tbl.claim_ip("10.0.0.8", "uid-a", T.POD_ROLE, 2)
    tbl.set_status(runtime_mode=True)
    tbl.set_verified(1_000)
    key = T.ip_key("10.0.0.8")
    assert tbl.lookup(key, T.PART_LISTING, out, accepted_ns=999)[0] == T.READY
    assert tbl.lookup(key, T.PART_LISTING, out, accepted_ns=1_000)[0] == T.READY
    assert tbl.lookup(key, T.PART_LISTING, out, accepted_ns=1_001)[0] == T.UNVERIFIED
    # Unknown addresses too: a miss is only definitive after a poll newer than the caller.
    assert tbl.lookup(T.ip_key("10.0.0.9"), T.PART_LISTING, out,
                      accepted_ns=1_001)[0] == T.UNVERIFIED
    assert tbl.lookup(T.ip_key("10.0.0.9"), T.PART_LISTING, out, accepted_ns=5)[0] == T.MISS
    tbl.set_verified(500)                                      # never moves backwards
    assert tbl.verified_ns == 1_000
    # A failed attempt after the connection: the fallback's slots answer (an unknown address
    # then follows the API's caution: it is unsure while pods wait for their addresses).
    tbl.set_failed(2_000)
    assert tbl.lookup(key, T.PART_LISTING, out, accepted_ns=1_500)[0] == T.READY
    assert tbl.lookup(key, T.PART_LISTING, out, accepted_ns=2_001)[0] == T.UNVERIFIED
    tbl.set_status(pending_pods=1)
    assert tbl.lookup(T.ip_key("10.0.0.9"), T.PART_LISTING, out,
                      accepted_ns=1_500)[0] == T.UNSURE
    tbl.set_failed(10)
    assert tbl.failed_ns == 2_000


def test_undecided_owner_is_neither_served_nor_a_miss(tbl):
    tbl.set_status(synced=True)
    tbl.claim_ip("10.0.0.4", "uid-u", T.POD_UNDECIDED)
    assert tbl.lookup(T.ip_key("10.0.0.4"), T.PART_LISTING, bytearray(64))[0] == T.UNDECIDED


def test_layout_is_read_once_at_attach(tbl, tmp_path):
    """A header corrupted after attach cannot redirect a reader to another slot's bytes."""
    tbl.write_cred(0, parts(b"pod-a"), serve_until=FAR)
    tbl.write_cred(1, parts(b"pod-b"), serve_until=FAR)
    tbl.claim_ip("10.0.0.1", "uid-a", T.POD_ROLE, 0)
    tbl.set_status(synced=True)
    reader = T.Table.attach(tbl.path)
    value_size = reader.layout["value_size"]
    with open(tbl.path, "r+b") as f:          # value_size lives at byte 20 of the header
        f.seek(20)
        f.write((value_size * 3).to_bytes(4, "little"))
    out = bytearray(4096)
    status, n = reader.lookup(T.ip_key("10.0.0.1"), T.PART_LISTING, out)
    assert (status, bytes(out[:n])) == (T.READY, b"LISTING pod-a")
    with pytest.raises(T.TableLayoutError):
        T.Table.attach(tbl.path)


def test_create_never_follows_a_planted_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "table"
    os.symlink(victim, path)
    t = T.Table.create(str(path), ip_capacity=64, cred_capacity=4, value_size=1024,
                       aux_count=1, aux_size=64, max_workers=2)
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    t.close()


def test_churn_past_capacity_compacts_tombstones(tbl):
    # 64 slots hold 48 live addresses; churn through far more than that.
    for i in range(2000):
        tbl.claim_ip(f"10.1.{i // 250}.{i % 250}", f"pod-{i}", T.POD_NO_ROLE)
        if i >= 40:
            j = i - 40
            assert tbl.release_ip(f"10.1.{j // 250}.{j % 250}", f"pod-{j}")
    live = {s["ip"] for s in tbl.snapshot()}
    assert len(live) == 40
    for i in range(1960, 2000):
        assert lookup(tbl, f"10.1.{i // 250}.{i % 250}")[0] == "NO_ROLE"


def test_full_table_is_a_clear_error_and_loses_nothing(tbl):
    for i in range(48):
        tbl.claim_ip(f"10.2.0.{i}", f"p{i}", T.POD_NO_ROLE)
    with pytest.raises(T.TableFull):
        tbl.claim_ip("10.2.1.1", "late", T.POD_NO_ROLE)
    tbl.claim_ip("10.2.0.5", "moved", T.POD_NO_ROLE)          # re-claims still work
    assert len(tbl.snapshot()) == 48
    assert tbl.lookup_pod("10.2.0.5")[0] == "moved"


def test_oversized_value_is_rejected_and_old_value_kept(tbl):
    tbl.write_cred(0, parts(), serve_until=FAR)
    tbl.claim_ip("10.0.0.1", "a", T.POD_ROLE, 0)
    with pytest.raises(T.ValueTooLarge):
        tbl.write_cred(0, [b"x" * 9000], serve_until=FAR)
    assert lookup(tbl, "10.0.0.1") == ("READY", b'{"Code":"Success"}')


def test_out_buffer_too_small(tbl):
    tbl.write_cred(0, parts(doc=b"y" * 500), serve_until=FAR)
    tbl.claim_ip("10.0.0.1", "a", T.POD_ROLE, 0)
    status, _ = tbl.lookup(T.ip_key("10.0.0.1"), T.PART_DOCUMENT, bytearray(100))
    assert status == T.TOO_SMALL


@pytest.mark.parametrize("call", [
    lambda t: t.claim_ip("10.0.0.1", "a", T.POD_ROLE, 8),
    lambda t: t.claim_ip("10.0.0.1", "a", T.POD_ROLE, -1),
    lambda t: t.claim_ip("10.0.0.1", "", T.POD_NO_ROLE),
    lambda t: t.claim_ip("10.0.0.1", "u" * 65, T.POD_NO_ROLE),
    lambda t: t.claim_ip("10.0.0.1", "a", 42),
    lambda t: t.claim_ip("bogus", "a", T.POD_NO_ROLE),
    lambda t: t.write_cred(8, [], serve_until=0),
    lambda t: t.write_cred(0, ["text"], serve_until=0),
    lambda t: t.write_cred(0, [b""] * 9, serve_until=0),
    lambda t: t.write_aux(2, b""),
])
def test_bad_writer_calls_raise_and_change_nothing(tbl, call):
    g = tbl.generation
    with pytest.raises((ValueError, IndexError, TypeError)):
        call(tbl)
    assert tbl.generation == g
    assert tbl.snapshot() == []


def test_readers_cannot_write(tbl):
    r = T.Table.attach(tbl.path)
    with pytest.raises(T.TableError):
        r.claim_ip("10.0.0.1", "a", T.POD_NO_ROLE)


def test_aux_blobs(tbl):
    assert tbl.read_aux(0) == b""
    tbl.write_aux(0, b"# HELP x\nx 1\n")
    assert T.Table.attach(tbl.path).read_aux(0) == b"# HELP x\nx 1\n"
    with pytest.raises(T.ValueTooLarge):
        tbl.write_aux(1, b"z" * 5000)


def test_worker_counters_are_summed_across_rows(tbl):
    r1, r2 = T.Table.attach(tbl.path), T.Table.attach(tbl.path)
    r1.counter_add(0, 5, 3)
    r2.counter_add(1, 5)
    assert tbl.counters_sum()[5] == 4
    with pytest.raises(IndexError):
        r1.counter_add(4, 0)


def test_attach_rejects_what_is_not_a_table(tmp_path):
    with pytest.raises(T.TableLayoutError, match="no table"):
        T.Table.attach(str(tmp_path / "missing"))
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x00" * 8192)
    with pytest.raises(T.TableLayoutError, match="bad magic"):
        T.Table.attach(str(junk))
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"abc")
    with pytest.raises(T.TableLayoutError, match="too small"):
        T.Table.attach(str(tiny))


def test_attach_rejects_another_layout_version(tbl, tmp_path):
    raw = bytearray(open(tbl.path, "rb").read())
    raw[8:12] = (T.LAYOUT_VERSION + 1).to_bytes(4, "little")
    other = tmp_path / "other"
    other.write_bytes(bytes(raw))
    with pytest.raises(T.TableLayoutError, match="layout"):
        T.Table.attach(str(other))


def test_attach_rejects_truncated_file(tbl, tmp_path):
    raw = open(tbl.path, "rb").read()
    cut = tmp_path / "cut"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(T.TableLayoutError, match="truncated"):
        T.Table.attach(str(cut))


def test_create_validates_capacities(tmp_path):
    with pytest.raises(ValueError):
        T.Table.create(str(tmp_path / "t"), ip_capacity=100)
    with pytest.raises(ValueError):
        T.Table.create(str(tmp_path / "t"), value_size=10)


def test_closed_table_raises(tbl):
    tbl.close()
    with pytest.raises(T.TableError):
        tbl.generation
    with pytest.raises(T.TableError):
        tbl.lookup(T.ip_key("10.0.0.1"), 0, bytearray(10))


def test_creation_is_atomic_rename(tmp_path):
    path = str(tmp_path / "t")
    T.Table.create(path, ip_capacity=8, cred_capacity=1)
    assert [p for p in os.listdir(tmp_path)] == ["t"]


def test_writer_identity_and_heartbeat_are_visible_to_readers(tbl):
    r = T.Table.attach(tbl.path)
    assert r.writer_pid == os.getpid()
    assert r.heartbeat_age is None                 # never beaten
    tbl.heartbeat()
    assert 0 <= r.heartbeat_age < 5
