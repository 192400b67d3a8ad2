"""Fuzzing `decode`: whatever arrives, it returns a valid message or raises ProtocolError — never
another exception — and every valid message round-trips exactly."""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from hypothesis import strategies as st

from common.protocol import (
    CONTROL_COMMANDS, INT64_MAX, MESSAGE_TYPES, PROTOCOL_VERSION, Ack, Announce, Commit, Control, EpochEnd,
    Fenced, Hello, Message, Ping, Pong, ProtocolError, Reply, RingInfo, Welcome, decode, plan_id,
)
from common.seqset import SeqSet

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_protocol_error(frame: bytes) -> Message | None:
    """The property under test: only ProtocolError escapes; what decodes is valid and stable."""
    try:
        msg = decode(frame)
    except ProtocolError as e:
        assert e.code and str(e)
        return None
    assert isinstance(msg, Message)
    again = decode(msg.encode())
    assert type(again) is type(msg) and again.encode() == msg.encode()
    return msg


# ---- arbitrary input ------------------------------------------------------------------------------

# Edges of every msgpack int encoding, plus the range just outside int64 that msgpack still carries.
edge_ints = st.sampled_from([0, 1, -1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32, INT64_MAX, 2**63,
                             2**64 - 1, -(2**63), -(2**31) - 1])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), edge_ints,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20),
)
structures = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=6), st.dictionaries(st.text(max_size=8), kids, max_size=6)),
    max_leaves=40,
)
small_structures = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=8,
)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_protocol_error(frame: bytes) -> None:
    _decode_or_protocol_error(frame)


@FUZZ
@given(structures)
def test_random_msgpack_structures_only_raise_protocol_error(obj: Any) -> None:
    _decode_or_protocol_error(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.data())
def test_random_values_under_a_valid_header_only_raise_protocol_error(kind: str, data: st.DataObject) -> None:
    # The right header and exactly the right keys get past the cheap checks, so the field
    # validators themselves see the random values.
    names = [f.name for f in dataclasses.fields(MESSAGE_TYPES[kind])]
    fields = {name: data.draw(small_structures, label=name) for name in names}
    _decode_or_protocol_error(msgpack.packb({"v": PROTOCOL_VERSION, "type": kind, **fields}, use_bin_type=True))


# ---- valid messages -------------------------------------------------------------------------------

u63 = st.integers(0, INT64_MAX)
i64 = st.integers(-(2**63), INT64_MAX)
small = st.integers(0, 1000)
finite = st.floats(allow_nan=False, allow_infinity=False)
key = st.text(min_size=1, max_size=12)


@st.composite
def seq_sets(draw: Any) -> SeqSet:
    s = SeqSet()
    for a, n in draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 1000)), max_size=8)):
        s.add_range(a, a + n)
    if draw(st.booleans()):
        s.add(INT64_MAX)  # the largest member the wire carries
    return s


rings = st.builds(RingInfo, worker=st.integers(0, 1023), path=st.text(min_size=1, max_size=40),
                  slot_count=st.integers(1, 1 << 16), slot_size=st.integers(1, INT64_MAX), producer_epoch=u63)
target_values = st.one_of(i64, finite, st.text(max_size=30), st.lists(i64, max_size=8))
json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), i64, finite, st.text(max_size=20)),
    lambda kids: st.one_of(st.lists(kids, max_size=5), st.dictionaries(st.text(max_size=8), kids, max_size=5)),
    max_leaves=30,
)


session_secrets = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)


@st.composite
def hellos(draw: Any) -> Hello:
    world = draw(st.integers(1, 1 << 16))
    rank = draw(st.one_of(st.just(0), st.integers(0, world - 1)))
    return Hello(rid=draw(u63), job=draw(st.text(min_size=1, max_size=40)), secret=draw(session_secrets), rank=rank,
                 world=world, pid=draw(st.integers(1, INT64_MAX)),
                 start_time=draw(u63), have=draw(seq_sets()), epochs=draw(st.integers(1, 4096)),
                 credit=draw(st.integers(1, 1024)), heldout=draw(st.booleans()) if rank == 0 else False,
                 plan=draw(st.one_of(st.just(""), st.text(alphabet="0123456789abcdef", min_size=16, max_size=16))),
                 ranks_here=draw(st.integers(0, world)))


@st.composite
def welcomes(draw: Any) -> Welcome:
    ring_list = draw(st.lists(rings, max_size=5, unique_by=lambda r: r.worker))
    return Welcome(rid=draw(u63), consumer_epoch=draw(u63), rings=ring_list,
                   target=draw(st.dictionaries(key, target_values, max_size=10)),
                   epoch_sizes=draw(st.lists(u63, max_size=8)), ready=draw(st.lists(u63, max_size=20)),
                   heldout_batches=draw(st.integers(0, 1 << 12)), plan=draw(plans()))


@st.composite
def plans(draw: Any) -> dict[str, Any]:
    parts = draw(st.dictionaries(key.filter(lambda k: k != "id"), st.one_of(st.text(max_size=40), u63),
                                 min_size=1, max_size=12))
    return {**parts, "id": plan_id(parts)}


@st.composite
def replies(draw: Any) -> Reply:
    if draw(st.booleans()):
        return Reply.success(draw(u63), draw(st.dictionaries(st.text(max_size=8), json_like, max_size=5)))
    return Reply.failure(draw(u63), draw(st.text(min_size=1, max_size=50)))


MESSAGE_STRATEGIES = (
    hellos(), welcomes(), replies(),
    st.builds(Announce, consumer_epoch=u63, worker=st.integers(0, 1023), slot=st.integers(0, 65535), pub_seq=u63,
              seq=u63, epoch=u63, heldout=st.just(False)),
    st.builds(Announce, consumer_epoch=u63, worker=st.integers(0, 1023), slot=st.integers(0, 65535), pub_seq=u63,
              seq=st.integers(0, (1 << 12) - 1), epoch=st.just(0), heldout=st.just(True)),
    st.builds(Ack, consumer_epoch=u63, secret=session_secrets, worker=st.integers(0, 1023),
              slot=st.integers(0, 65535), pub_seq=u63, seq=u63, corrupt=st.booleans()),
    st.builds(EpochEnd, consumer_epoch=u63, epoch=u63),
    st.builds(Commit, rid=u63, consumer_epoch=u63, secret=session_secrets, have=seq_sets(), step=u63),
    st.builds(Ping, rid=u63, t=finite), st.builds(Pong, rid=u63, t=finite),
    st.builds(Control, rid=u63, cmd=st.sampled_from(CONTROL_COMMANDS),
              args=st.dictionaries(key, st.one_of(st.text(max_size=30), i64, finite, st.booleans()), max_size=6)),
    st.builds(Fenced, consumer_epoch=u63, reason=st.text(max_size=60)),
)
messages = st.one_of(*MESSAGE_STRATEGIES)


def test_fuzz_covers_every_message_type() -> None:
    """Every message type has a strategy in `messages` (one example drawn from each: a random
    sample of the union could miss one by chance). Only the type is read: the example is not
    shrunk (shrinking them all to minimal ones took ~8 s of CPU)."""
    first = settings(database=None, phases=[Phase.generate])
    seen = {find(strategy, lambda _: True, settings=first).TYPE for strategy in MESSAGE_STRATEGIES}
    assert seen == set(MESSAGE_TYPES)


@FUZZ
@given(messages)
def test_valid_messages_round_trip_exactly(msg: Message) -> None:
    frame = msg.encode()
    back = decode(frame)
    assert back == msg and back.encode() == frame


# ---- mutations of valid messages ------------------------------------------------------------------

def _body(msg: Message) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": msg.TYPE, **msg.to_wire()}


@FUZZ
@given(messages, st.data())
def test_dropping_a_key_is_always_rejected(msg: Message, data: st.DataObject) -> None:
    body = _body(msg)
    del body[data.draw(st.sampled_from(sorted(body)))]
    assert _decode_or_protocol_error(msgpack.packb(body, use_bin_type=True)) is None


@FUZZ
@given(messages, st.text(max_size=10), structures)
def test_adding_a_key_is_always_rejected(msg: Message, name: str, value: Any) -> None:
    body = _body(msg)
    assume(name not in body)
    body[name] = value
    assert _decode_or_protocol_error(msgpack.packb(body, use_bin_type=True)) is None


@FUZZ
@given(messages, st.data(), structures)
def test_replacing_a_field_only_raises_protocol_error(msg: Message, data: st.DataObject, value: Any) -> None:
    body = _body(msg)
    body[data.draw(st.sampled_from(sorted(body)))] = value
    _decode_or_protocol_error(msgpack.packb(body, use_bin_type=True))


@FUZZ
@given(messages, st.data(), st.sampled_from(["str", "float", "bool", "huge", "negative", "nested", "bin"]))
def test_changing_a_fields_type_is_rejected(msg: Message, data: st.DataObject, how: str) -> None:
    body = _body(msg)
    name = data.draw(st.sampled_from(sorted(msg.to_wire())))
    old = body[name]
    new = {"str": str(old), "float": 0.5, "bool": True, "huge": 2**64 - 1, "negative": -(2**63),
           "nested": [[[[old]]]], "bin": b"\x00"}[how]
    body[name] = new
    decoded = _decode_or_protocol_error(msgpack.packb(body, use_bin_type=True))
    if type(new) is not type(old):
        assert decoded is None
    elif decoded is not None:  # e.g. 0.5 in a float field: legal, and must arrive unchanged
        assert decoded.to_wire()[name] == new


@FUZZ
@given(messages, st.data())
def test_corrupted_frames_only_raise_protocol_error(msg: Message, data: st.DataObject) -> None:
    frame = bytearray(msg.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    _decode_or_protocol_error(bytes(frame[:cut]) if data.draw(st.booleans()) else bytes(frame))


@settings(max_examples=50, deadline=None)
@given(st.integers(17, 3000))
def test_deep_nesting_is_rejected_without_recursion_errors(depth: int) -> None:
    nested: Any = 1
    for _ in range(min(depth, 500)):  # msgpack itself refuses to pack much deeper
        nested = [nested]
    frame = msgpack.packb(_body(Reply.success(1, {})) | {"result": {"x": nested}})
    assert _decode_or_protocol_error(frame) is None
    raw = b"\x91" * depth + b"\xc0"  # hand-built, deeper than any packer would go
    assert _decode_or_protocol_error(raw) is None
