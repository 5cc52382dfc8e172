"""Random claim/release/write sequences against a dict model: the table equals the model
after every step."""

import time

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kiamfast import table as T

IPS = [f"10.0.0.{i}" for i in range(12)] + [f"fd00::{i:x}" for i in range(1, 6)]
UIDS = [f"pod-{i}" for i in range(8)]
SLOTS = 4
FAR = time.time() + 3600


class TableModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.TemporaryDirectory()
        # 32 slots hold 24 addresses: the 17 addresses used here plus tombstone churn.
        self.t = T.Table.create(self.dir.name + "/t", ip_capacity=32, cred_capacity=SLOTS,
                                value_size=1024, aux_count=0, max_workers=1)
        self.t.set_status(synced=True)   # unknown addresses are plain misses
        self.ips = {}     # ip -> (uid, state, slot)
        self.creds = {}   # slot -> (state, parts)
        self.generation = self.t.generation

    def teardown(self):
        self.t.close()
        self.dir.cleanup()

    @rule(ip=st.sampled_from(IPS), uid=st.sampled_from(UIDS),
          state=st.sampled_from([T.POD_ROLE, T.POD_NO_ROLE, T.POD_DENIED]),
          slot=st.integers(0, SLOTS - 1))
    def claim(self, ip, uid, state, slot):
        self.t.claim_ip(ip, uid, state, slot)
        # a denied address may name the slot of a pod served by token only
        self.ips[ip] = (uid, state, slot if state in (T.POD_ROLE, T.POD_DENIED) else -1)

    @rule(ip=st.sampled_from(IPS), uid=st.sampled_from(UIDS))
    def release(self, ip, uid):
        released = self.t.release_ip(ip, uid)
        owner = self.ips.get(ip)
        assert released == (owner is not None and owner[0] == uid)
        if released:
            del self.ips[ip]

    @rule(slot=st.integers(0, SLOTS - 1), payload=st.binary(max_size=120),
          state=st.sampled_from([T.CRED_PENDING, T.CRED_READY, T.CRED_ERROR]))
    def write(self, slot, payload, state):
        parts = [b"name%d" % slot, b"L" + payload, b"D" + payload, b"E", b"I"]
        self.t.write_cred(slot, parts, serve_until=FAR, state=state)
        self.creds[slot] = (state, parts)

    @precondition(lambda self: self.creds)
    @rule(data=st.data())
    def clear(self, data):
        slot = data.draw(st.sampled_from(sorted(self.creds)))
        self.t.clear_cred(slot)
        del self.creds[slot]

    @invariant()
    def table_equals_model(self):
        g = self.t.generation
        assert g >= self.generation
        self.generation = g
        live = {s["ip"]: (s["pod_uid"], s["pod_state"], s["cred_slot"]) for s in self.t.snapshot()}
        assert live == {T.key_ip(T.ip_key(ip)): v for ip, v in self.ips.items()}
        out = bytearray(1024)
        for ip in IPS:
            status, n, uid, slot = self.t.read(ip, T.PART_DOCUMENT, out)
            owner = self.ips.get(ip)
            if owner is None:
                assert status == T.MISS
                continue
            assert uid == owner[0]
            if owner[1] == T.POD_NO_ROLE:
                assert status == T.NO_ROLE
            elif owner[1] == T.POD_DENIED:
                assert status == T.DENIED
            else:
                state, parts = self.creds.get(owner[2], (T.CRED_EMPTY, None))
                expected = {T.CRED_READY: T.READY, T.CRED_ERROR: T.ERROR}.get(state, T.PENDING)
                assert status == expected
                if status == T.READY:
                    assert bytes(out[:n]) == parts[T.PART_DOCUMENT]


TestTableModel = TableModel.TestCase
TestTableModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
