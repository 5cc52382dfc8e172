"""The CRI runtime v1 messages the agent sends and reads, to and from protobuf wire bytes.

Names, field numbers and types are those of k8s.io/cri-api v0.34.2,
pkg/apis/runtime/v1/api.proto (package runtime.v1, proto3); only the fields the agent uses
are declared, every other field is skipped by its wire type (proto3 ignores unknown fields).

What a runtime sends is untrusted input: a truncated field, a varint over 10 bytes, a
known field with another wire type than its declaration (upb would keep it as an unknown
field; here it is refused), a group, field number 0 or a string that is not UTF-8 raise
`DecodeError`. As in protobuf: a scalar given twice keeps the last value, a message given
twice is merged (its pieces are decoded as one), a map key given twice keeps the last
value, and an absent message field reads as the empty message.

Messages are frozen dataclasses; a message field set to None is absent (proto3 presence:
`PodSandboxFilter(state=PodSandboxStateValue(state=SANDBOX_READY))` is sent even though
SANDBOX_READY is 0, which is how the filter asks for READY sandboxes only).
"""
from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, ClassVar

# enum PodSandboxState
SANDBOX_READY = 0
SANDBOX_NOTREADY = 1
# enum NamespaceMode
POD, CONTAINER, NODE, TARGET = 0, 1, 2, 3

VARINT, I64, LEN, I32 = 0, 1, 2, 5      # the wire types (3 and 4, groups, are refused)
_MASK64 = (1 << 64) - 1


class DecodeError(ValueError):
    """The bytes are not a valid encoding of the message asked for."""


# -- field kinds: how one declared field is read and written ---------------------------

@dataclass(frozen=True, slots=True)
class _Kind:
    wire: int
    # what is sent for a value: the wire values of its occurrences (none for a default)
    write: Callable[[Any], list[Any]]
    # a scalar: one occurrence's value -> Python value (the last occurrence wins)
    read: Callable[[Any], Any] | None = None
    # a message, repeated or map field: all occurrences' bytes -> Python value
    finish: Callable[[list[bytes]], Any] | None = None


def _signed(bits: int) -> Callable[[int], int]:
    half, whole = 1 << (bits - 1), 1 << bits

    def read(value: int) -> int:
        value &= whole - 1
        return value - whole if value >= half else value
    return read


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"string field is not UTF-8: {exc}") from None


STRING = _Kind(LEN, lambda v: [v.encode()] if v else [], read=_text)
BOOL = _Kind(VARINT, lambda v: [1] if v else [], read=bool)
INT32 = _Kind(VARINT, lambda v: [v & _MASK64] if v else [], read=_signed(32))   # enums too
INT64 = _Kind(VARINT, lambda v: [v & _MASK64] if v else [], read=_signed(64))
UINT32 = _Kind(VARINT, lambda v: [v] if v else [], read=lambda v: v & 0xFFFFFFFF)


def _message(cls: type) -> _Kind:
    """A singular message field: its pieces merged, as protobuf does; absent: cls()."""
    return _Kind(LEN, lambda v: [] if v is None else [encode(v)],
                 finish=lambda pieces: decode(cls, b"".join(pieces)))


def _repeated(cls: type) -> _Kind:
    return _Kind(LEN, lambda v: [encode(item) for item in v],
                 finish=lambda pieces: tuple(decode(cls, piece) for piece in pieces))


def _map_entries(pieces: list[bytes]) -> dict[str, str]:
    """map<string, string>: each piece an entry {key = 1; value = 2}, either absent meaning
    "". An entry holding any other field is left out of the map, as upb does (it keeps such
    an entry among the message's unknown fields)."""
    entries: dict[str, str] = {}
    for piece in pieces:
        entry = ["", ""]
        found, others = _fields(piece, (1, 2))
        for number, wire, value in found:
            if wire != LEN:
                raise DecodeError(f"map entry field {number}: wire type {wire}, declared 2")
            entry[number - 1] = _text(value)
        if not others:
            entries[entry[0]] = entry[1]
    return entries


STRING_MAP = _Kind(LEN, lambda v: [encode(_MapEntry(key=k, value=x)) for k, x in v.items()],
                   finish=_map_entries)


# -- the wire format ---------------------------------------------------------------------

def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while shift < 70:
        if pos >= len(data):
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
    raise DecodeError("varint longer than 10 bytes")


def _fields(data: bytes, wanted: Container[int]) -> tuple[list[tuple[int, int, Any]], bool]:
    """The (field number, wire type, value) of each field whose number is `wanted`, in
    order (a value is an int, or bytes for LEN), and whether any other field was there.
    Every field is checked; the others are skipped without being copied. One loop with
    the one-byte cases inline: this is the hot path of a poll."""
    found: list[tuple[int, int, Any]] = []
    others = False
    pos, end = 0, len(data)
    while pos < end:
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0 or number > 0x1FFFFFFF:
            raise DecodeError(f"invalid field number {number}")
        keep = number in wanted
        if wire == LEN:
            size = data[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _varint(data, pos)
            if size > end - pos:
                raise DecodeError(f"field {number}: {size} bytes announced, {end - pos} left")
            value: Any = data[pos:pos + size] if keep else None
            pos += size
        elif wire == VARINT:
            value, pos = _varint(data, pos)
        elif wire == I64 or wire == I32:
            size = 8 if wire == I64 else 4
            if size > end - pos:
                raise DecodeError(f"field {number}: truncated fixed{size * 8}")
            value, pos = int.from_bytes(data[pos:pos + size], "little"), pos + size
        else:
            raise DecodeError(f"field {number}: wire type {wire} (groups are not proto3)")
        if keep:
            found.append((number, wire, value))
        else:
            others = True
    return found, others


def _encode_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def decode(cls: type, data: bytes) -> Any:
    """The message `cls` from its wire bytes, or DecodeError."""
    schema: dict[int, tuple[str, _Kind]] = cls._schema
    values: dict[str, Any] = {}
    pieces: dict[str, list[bytes]] = {}
    for number, wire, value in _fields(data, schema)[0]:   # the others are skipped
        name, kind = schema[number]
        if wire != kind.wire:
            raise DecodeError(f"{cls.__name__}.{name} (field {number}): wire type {wire}, "
                              f"declared {kind.wire}")
        if kind.read is not None:
            values[name] = kind.read(value)
        else:
            pieces.setdefault(name, []).append(value)
    for name, kind in schema.values():
        if kind.finish is not None:
            values[name] = kind.finish(pieces.get(name, []))
    return cls(**values)


def encode(message: Any) -> bytes:
    """The wire bytes of a message: fields in number order, defaults and None left out."""
    out = bytearray()
    for number, (name, kind) in sorted(message._schema.items()):
        for value in kind.write(getattr(message, name)):
            _encode_varint(out, number << 3 | kind.wire)
            if kind.wire == LEN:
                _encode_varint(out, len(value))
                out += value
            else:
                _encode_varint(out, value)
    return bytes(out)


def _declare(**spec: tuple[int, _Kind]) -> dict[int, tuple[str, _Kind]]:
    return {number: (name, kind) for name, (number, kind) in spec.items()}


# -- the messages ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _MapEntry:                     # map<string, string>: repeated {key = 1; value = 2}
    key: str = ""
    value: str = ""
    _schema: ClassVar = _declare(key=(1, STRING), value=(2, STRING))


@dataclass(frozen=True, slots=True)
class VersionRequest:
    version: str = ""
    _schema: ClassVar = _declare(version=(1, STRING))


@dataclass(frozen=True, slots=True)
class VersionResponse:
    version: str = ""
    runtime_name: str = ""
    runtime_version: str = ""
    runtime_api_version: str = ""
    _schema: ClassVar = _declare(version=(1, STRING), runtime_name=(2, STRING),
                                runtime_version=(3, STRING), runtime_api_version=(4, STRING))


@dataclass(frozen=True, slots=True)
class PodSandboxStateValue:
    state: int = SANDBOX_READY
    _schema: ClassVar = _declare(state=(1, INT32))


@dataclass(frozen=True, slots=True)
class PodSandboxFilter:
    id: str = ""
    state: PodSandboxStateValue | None = None
    label_selector: dict[str, str] = field(default_factory=dict)
    _schema: ClassVar = _declare(id=(1, STRING), state=(2, _message(PodSandboxStateValue)),
                                 label_selector=(3, STRING_MAP))


@dataclass(frozen=True, slots=True)
class ListPodSandboxRequest:
    filter: PodSandboxFilter | None = None
    _schema: ClassVar = _declare(filter=(1, _message(PodSandboxFilter)))


@dataclass(frozen=True, slots=True)
class PodSandboxMetadata:
    name: str = ""
    uid: str = ""
    namespace: str = ""
    attempt: int = 0
    _schema: ClassVar = _declare(name=(1, STRING), uid=(2, STRING), namespace=(3, STRING),
                                 attempt=(4, UINT32))


@dataclass(frozen=True, slots=True)
class PodSandbox:
    id: str = ""
    metadata: PodSandboxMetadata | None = None
    state: int = SANDBOX_READY
    created_at: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    runtime_handler: str = ""
    _schema: ClassVar = _declare(id=(1, STRING), metadata=(2, _message(PodSandboxMetadata)),
                                 state=(3, INT32), created_at=(4, INT64),
                                 labels=(5, STRING_MAP), annotations=(6, STRING_MAP),
                                 runtime_handler=(7, STRING))


@dataclass(frozen=True, slots=True)
class ListPodSandboxResponse:
    items: tuple[PodSandbox, ...] = ()
    _schema: ClassVar = _declare(items=(1, _repeated(PodSandbox)))


@dataclass(frozen=True, slots=True)
class PodSandboxRef:
    """A PodSandbox read for its id and state only: all a poll needs from the list (the
    rest, labels and annotations most of all, is skipped, not decoded: a poll of 110
    sandboxes decodes in a tenth of the time)."""
    id: str = ""
    state: int = SANDBOX_READY
    _schema: ClassVar = _declare(id=(1, STRING), state=(3, INT32))


@dataclass(frozen=True, slots=True)
class ListPodSandboxRefs:
    """A ListPodSandboxResponse whose items are read as PodSandboxRefs."""
    items: tuple[PodSandboxRef, ...] = ()
    _schema: ClassVar = _declare(items=(1, _repeated(PodSandboxRef)))


@dataclass(frozen=True, slots=True)
class PodSandboxStatusRequest:
    pod_sandbox_id: str = ""
    verbose: bool = False
    _schema: ClassVar = _declare(pod_sandbox_id=(1, STRING), verbose=(2, BOOL))


@dataclass(frozen=True, slots=True)
class PodIP:
    ip: str = ""
    _schema: ClassVar = _declare(ip=(1, STRING))


@dataclass(frozen=True, slots=True)
class PodSandboxNetworkStatus:
    ip: str = ""
    additional_ips: tuple[PodIP, ...] = ()
    _schema: ClassVar = _declare(ip=(1, STRING), additional_ips=(2, _repeated(PodIP)))


@dataclass(frozen=True, slots=True)
class NamespaceOption:                # only the network mode (host network: NODE)
    network: int = POD
    _schema: ClassVar = _declare(network=(1, INT32))


@dataclass(frozen=True, slots=True)
class Namespace:
    options: NamespaceOption | None = None
    _schema: ClassVar = _declare(options=(2, _message(NamespaceOption)))


@dataclass(frozen=True, slots=True)
class LinuxPodSandboxStatus:
    namespaces: Namespace | None = None
    _schema: ClassVar = _declare(namespaces=(1, _message(Namespace)))


@dataclass(frozen=True, slots=True)
class PodSandboxStatus:
    id: str = ""
    metadata: PodSandboxMetadata | None = None
    state: int = SANDBOX_READY
    created_at: int = 0
    network: PodSandboxNetworkStatus | None = None
    linux: LinuxPodSandboxStatus | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    runtime_handler: str = ""
    _schema: ClassVar = _declare(id=(1, STRING), metadata=(2, _message(PodSandboxMetadata)),
                                 state=(3, INT32), created_at=(4, INT64),
                                 network=(5, _message(PodSandboxNetworkStatus)),
                                 linux=(6, _message(LinuxPodSandboxStatus)),
                                 labels=(7, STRING_MAP), annotations=(8, STRING_MAP),
                                 runtime_handler=(9, STRING))


@dataclass(frozen=True, slots=True)
class PodSandboxStatusResponse:       # containers_statuses (3) and timestamp (4) are not read
    status: PodSandboxStatus | None = None
    info: dict[str, str] = field(default_factory=dict)   # verbose only
    _schema: ClassVar = _declare(status=(1, _message(PodSandboxStatus)), info=(2, STRING_MAP))
