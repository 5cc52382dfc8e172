"""The hand-written CRI codec (kiamfast/control/cri/messages.py) against the generated stubs.

The stubs (PyPI container-runtime-interface-api, generated from the same api.proto) are
the reference: what they encode, the codec decodes to the same values, and what the codec
encodes, they parse back to the same values; requests are byte for byte the stubs'. The
input is untrusted, so every truncation and random corruption of a real answer is either
refused with `DecodeError` or decoded to what the stubs decode, never another exception.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
from cri_api.v1 import api_pb2 as pb
from google.protobuf.message import DecodeError as PbDecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kiamfast.control.cri import messages as m

# -- comparing a stub message with a codec message --------------------------------------


def plain(mine):
    """A codec message as nested dicts, tuples and scalars."""
    if dataclasses.is_dataclass(mine):
        return {f.name: plain(getattr(mine, f.name)) for f in dataclasses.fields(mine)}
    if isinstance(mine, tuple):
        return tuple(plain(item) for item in mine)
    return mine


def stub_view(stub, mine):
    """The stub message's values of the fields the codec declares, shaped like plain(mine)."""
    if dataclasses.is_dataclass(mine):
        return {f.name: stub_view(getattr(stub, f.name), getattr(mine, f.name))
                for f in dataclasses.fields(mine)}
    if isinstance(mine, tuple):
        if len(stub) != len(mine):
            return ("length", len(stub))
        return tuple(stub_view(s, item) for s, item in zip(stub, mine))
    if isinstance(mine, dict):
        return dict(stub)
    return stub


def assert_same(stub, mine):
    assert stub_view(stub, mine) == plain(mine)


# -- messages as the stubs build them ---------------------------------------------------

text = st.text(max_size=40)   # any unicode, empty included
labels = st.dictionaries(text, text, max_size=6)
int64 = st.integers(-2**63, 2**63 - 1)
enum = st.sampled_from([0, 1, 2, 3, 7, -1, 2**31 - 1, -2**31])   # known, unknown, negative


@st.composite
def metadata(draw):
    return pb.PodSandboxMetadata(name=draw(text), uid=draw(text), namespace=draw(text),
                                 attempt=draw(st.integers(0, 2**32 - 1)))


@st.composite
def pod_sandbox(draw):
    item = pb.PodSandbox(id=draw(text), state=draw(enum), created_at=draw(int64),
                         labels=draw(labels), annotations=draw(labels),
                         runtime_handler=draw(text))
    if draw(st.booleans()):
        item.metadata.CopyFrom(draw(metadata()))
    return item


@st.composite
def sandbox_status(draw):
    status = pb.PodSandboxStatus(
        id=draw(text), state=draw(enum), created_at=draw(int64), labels=draw(labels),
        annotations=draw(labels), runtime_handler=draw(text))
    if draw(st.booleans()):
        status.metadata.CopyFrom(draw(metadata()))
    if draw(st.booleans()):
        status.network.ip = draw(text)
        status.network.additional_ips.extend(pb.PodIP(ip=ip) for ip in draw(st.lists(text,
                                                                                    max_size=3)))
    if draw(st.booleans()):
        options = status.linux.namespaces.options
        options.network, options.pid, options.ipc = draw(enum), draw(enum), draw(enum)
        options.target_id = draw(text)            # undeclared: skipped
    return status


@st.composite
def status_response(draw):
    answer = pb.PodSandboxStatusResponse(status=draw(sandbox_status()), info=draw(labels),
                                         timestamp=draw(int64))   # info, timestamp: skipped
    for _ in range(draw(st.integers(0, 2))):
        answer.containers_statuses.add(id=draw(text), image_ref=draw(text))
    return answer


list_response = st.lists(pod_sandbox(), max_size=5).map(
    lambda items: pb.ListPodSandboxResponse(items=items))


def rich_status_response() -> pb.PodSandboxStatusResponse:
    answer = pb.PodSandboxStatusResponse(
        status=pb.PodSandboxStatus(
            id="a" * 64, state=pb.SANDBOX_READY, created_at=1_700_000_000_123_456_789,
            metadata=pb.PodSandboxMetadata(name="web-0", uid="u-1", namespace="shop",
                                           attempt=3),
            network=pb.PodSandboxNetworkStatus(ip="10.88.0.7",
                                               additional_ips=[pb.PodIP(ip="fd00:88::7")]),
            linux=pb.LinuxPodSandboxStatus(namespaces=pb.Namespace(
                options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER))),
            labels={"io.kubernetes.pod.uid": "u-1", "io.kubernetes.pod.name": "web-0"},
            annotations={"iam.amazonaws.com/role": "arn:aws:iam::1:role/wé b"},
            runtime_handler="runc"),
        info={"info": '{"pid": 42}'}, timestamp=7)
    answer.containers_statuses.add(id="c1", image_ref="sha256:00")
    return answer


# -- requests: byte for byte what the stubs send ----------------------------------------

@pytest.mark.parametrize("mine, stub", [
    (m.VersionRequest(version="v1"), pb.VersionRequest(version="v1")),
    (m.VersionRequest(), pb.VersionRequest()),
    (m.ListPodSandboxRequest(filter=m.PodSandboxFilter(
        state=m.PodSandboxStateValue(state=m.SANDBOX_READY))),
     pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(
         state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY)))),
    (m.ListPodSandboxRequest(filter=m.PodSandboxFilter(
        id="abc", state=m.PodSandboxStateValue(state=m.SANDBOX_NOTREADY),
        label_selector={"app": "web"})),
     pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(
         id="abc", state=pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY),
         label_selector={"app": "web"}))),
    (m.ListPodSandboxRequest(filter=m.PodSandboxFilter()),
     pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter())),
    (m.ListPodSandboxRequest(), pb.ListPodSandboxRequest()),
    (m.PodSandboxStatusRequest(pod_sandbox_id="f" * 64),
     pb.PodSandboxStatusRequest(pod_sandbox_id="f" * 64)),
    (m.PodSandboxStatusRequest(pod_sandbox_id="x", verbose=True),
     pb.PodSandboxStatusRequest(pod_sandbox_id="x", verbose=True)),
], ids=["version", "version-empty", "list-ready", "list-full", "list-empty-filter",
        "list-no-filter", "status", "status-verbose"])
def test_requests_are_the_stubs_bytes(mine, stub):
    assert m.encode(mine) == stub.SerializeToString(deterministic=True)


def test_the_ready_filter_is_sent_although_ready_is_zero():
    """READY is enum value 0: only the filter's presence says "READY only"."""
    sent = pb.ListPodSandboxRequest.FromString(m.encode(m.ListPodSandboxRequest(
        filter=m.PodSandboxFilter(state=m.PodSandboxStateValue(state=m.SANDBOX_READY)))))
    assert sent.filter.HasField("state") and sent.filter.state.state == pb.SANDBOX_READY


# -- answers: the stubs' values, and back ------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(answer=list_response)
def test_list_answers_decode_to_the_stubs_values_and_back(answer):
    mine = m.decode(m.ListPodSandboxResponse, answer.SerializeToString())
    assert_same(answer, mine)
    assert_same(pb.ListPodSandboxResponse.FromString(m.encode(mine)), mine)


@settings(max_examples=150, deadline=None)
@given(answer=status_response())
def test_status_answers_decode_to_the_stubs_values_and_back(answer):
    mine = m.decode(m.PodSandboxStatusResponse, answer.SerializeToString())
    assert_same(answer, mine)
    assert_same(pb.PodSandboxStatusResponse.FromString(m.encode(mine)), mine)


@settings(max_examples=50, deadline=None)
@given(answer=st.builds(pb.VersionResponse, version=text, runtime_name=text,
                        runtime_version=text, runtime_api_version=text))
def test_version_answers_decode_to_the_stubs_values(answer):
    assert_same(answer, m.decode(m.VersionResponse, answer.SerializeToString()))


@settings(max_examples=100, deadline=None)
@given(answer=list_response)
def test_a_list_read_for_ids_and_states_gives_the_stubs_ids_and_states(answer):
    refs = m.decode(m.ListPodSandboxRefs, answer.SerializeToString()).items
    assert [(r.id, r.state) for r in refs] == [(i.id, i.state) for i in answer.items]


def test_a_real_looking_status_reads_as_the_agent_reads_it():
    status = m.decode(m.PodSandboxStatusResponse, rich_status_response().SerializeToString()).status
    assert (status.id, status.state, status.created_at) == ("a" * 64, 0, 1_700_000_000_123_456_789)
    assert status.metadata == m.PodSandboxMetadata(name="web-0", uid="u-1", namespace="shop",
                                                   attempt=3)
    assert status.network.ip == "10.88.0.7"
    assert [x.ip for x in status.network.additional_ips] == ["fd00:88::7"]
    assert status.linux.namespaces.options.network == m.NODE
    assert status.annotations == {"iam.amazonaws.com/role": "arn:aws:iam::1:role/wé b"}


def test_absent_and_empty_fields_read_as_the_stubs_defaults():
    for cls, stub_cls in ((m.PodSandboxStatusResponse, pb.PodSandboxStatusResponse),
                          (m.ListPodSandboxResponse, pb.ListPodSandboxResponse),
                          (m.VersionResponse, pb.VersionResponse)):
        mine = m.decode(cls, b"")
        assert_same(stub_cls(), mine)
    status = m.decode(m.PodSandboxStatusResponse, b"").status
    # an absent message reads as the empty one, as with the stubs: no None on the way
    assert status.linux.namespaces.options.network == m.POD and status.network.ip == ""
    assert status.labels == {} and status.network.additional_ips == ()


def test_a_map_entry_without_key_or_value_reads_as_empty_strings():
    # labels = 7: an entry with only a value, one with only a key, one empty
    entries = [b"\x12\x01v", b"\x0a\x01k", b""]
    data = b"".join(b"\x3a" + bytes([len(e)]) + e for e in entries)
    stub = pb.PodSandboxStatus.FromString(data)
    mine = m.decode(m.PodSandboxStatus, data)
    assert mine.labels == dict(stub.labels) == {"": "", "k": ""}


def test_a_map_entry_with_another_field_is_left_out_as_upb_does():
    # labels = 7: {key "k", value "v"} and {key "odd", field 8 = 25, value "x"}
    entries = [b"\x0a\x01k\x12\x01v", b"\x0a\x03odd\x40\x19\x12\x01x"]
    data = b"".join(b"\x3a" + bytes([len(e)]) + e for e in entries)
    stub = pb.PodSandboxStatus.FromString(data)
    mine = m.decode(m.PodSandboxStatus, data)
    assert mine.labels == dict(stub.labels) == {"k": "v"}


def test_repeated_fields_keep_the_last_scalar_merge_messages_and_the_last_map_key():
    first = pb.PodSandboxStatus(id="old", labels={"a": "1", "b": "2"},
                                metadata=pb.PodSandboxMetadata(name="n", uid="u1"))
    second = pb.PodSandboxStatus(id="new", labels={"a": "3"},
                                 metadata=pb.PodSandboxMetadata(uid="u2", attempt=2))
    data = first.SerializeToString() + second.SerializeToString()
    stub, mine = pb.PodSandboxStatus.FromString(data), m.decode(m.PodSandboxStatus, data)
    assert_same(stub, mine)
    assert mine.id == "new" and mine.labels == {"a": "3", "b": "2"}
    assert mine.metadata == m.PodSandboxMetadata(name="n", uid="u2", attempt=2)


@pytest.mark.parametrize("unknown", [
    b"\xc0\x3e\x05",                       # field 1000, varint
    b"\xc1\x3e" + b"\x01" * 8,             # field 1000, fixed64
    b"\xc2\x3e\x03abc",                    # field 1000, length-delimited
    b"\xc5\x3e" + b"\x01" * 4,             # field 1000, fixed32
    b"\xf8\xff\xff\xff\x0f\x00",           # the largest field number, varint
], ids=["varint", "fixed64", "bytes", "fixed32", "max-field-number"])
def test_unknown_fields_of_every_wire_type_are_skipped(unknown):
    answer = rich_status_response()
    data = answer.SerializeToString()
    inner = answer.status.SerializeToString() + unknown
    # unknown fields at the top and inside the status message
    for mutated in (unknown + data + unknown,
                    b"\x0a" + _varint(len(inner)) + inner):
        stub = pb.PodSandboxStatusResponse.FromString(mutated)
        mine = m.decode(m.PodSandboxStatusResponse, mutated)
        assert_same(stub, mine)
        assert mine.status.labels["io.kubernetes.pod.uid"] == "u-1"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


# -- untrusted input ---------------------------------------------------------------------

@pytest.mark.parametrize("data, why", [
    (b"\x0a\x05abc", "announced"),               # status: 5 bytes announced, 3 there
    (b"\x0a", "truncated varint"),               # a length missing
    (b"\x0a" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
    (b"\x08\x01", "wire type 0, declared 2"),    # status as a varint
    (b"\x0b\x0c", "groups"),                     # field 1 as a group
    (b"\x02\x00", "field number 0"),
    (b"\x0a\x03\x0a\x01\xff", "UTF-8"),          # status.id is not UTF-8
    (b"\x0a\x01\x18", "truncated varint"),       # status.state cut
    (b"\x0a\x03\x3a\x01\x0a", "truncated varint"),  # a label entry cut inside
    (b"\x0a\x04\x3a\x02\x08\x01", "wire type 0"),   # a label key as a varint
    (b"\xc1\x3e\x01", "truncated fixed64"),
], ids=["short-field", "no-length", "long-varint", "wrong-wire-type", "group",
        "field-zero", "bad-utf8", "cut-varint", "cut-map-entry", "map-key-wire-type",
        "cut-fixed64"])
def test_malformed_answers_are_decode_errors(data, why):
    with pytest.raises(m.DecodeError, match=why):
        m.decode(m.PodSandboxStatusResponse, data)


def test_every_truncation_of_an_answer_is_refused_or_read_as_the_stubs_read_it():
    items = [pb.PodSandbox(id=f"{i:064x}", state=i % 2, created_at=-i,
                           metadata=pb.PodSandboxMetadata(name=f"p{i}", uid=f"u{i}"),
                           labels={"k": "v" * i}, annotations={"é": "ü"})
             for i in range(3)]
    for answer, stub_cls, cls in (
            (pb.ListPodSandboxResponse(items=items), pb.ListPodSandboxResponse,
             m.ListPodSandboxResponse),
            (pb.ListPodSandboxResponse(items=items), pb.ListPodSandboxResponse,
             m.ListPodSandboxRefs),
            (rich_status_response(), pb.PodSandboxStatusResponse,
             m.PodSandboxStatusResponse)):
        data = answer.SerializeToString()
        refused = 0
        for cut in range(len(data)):
            try:
                stub = stub_cls.FromString(data[:cut])
            except PbDecodeError:
                with pytest.raises(m.DecodeError):
                    m.decode(cls, data[:cut])
                refused += 1
            else:
                assert_same(stub, m.decode(cls, data[:cut]))
        assert refused > len(data) // 2   # most cuts fall inside a field


def test_random_corruption_is_a_decode_error_or_the_stubs_reading():
    rng = random.Random(31)
    data = rich_status_response().SerializeToString()
    decoded = 0
    for _ in range(3000):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            mine = m.decode(m.PodSandboxStatusResponse, bytes(mutated))
        except m.DecodeError:
            continue
        decoded += 1
        try:
            stub = pb.PodSandboxStatusResponse.FromString(bytes(mutated))
        except PbDecodeError:
            continue   # e.g. bad UTF-8 in a field the agent does not read: upb checks it
        assert_same(stub, mine)
    assert decoded > 100
