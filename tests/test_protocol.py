"""The wire protocol: every message round-trips, and every way a field can be wrong is refused."""
from __future__ import annotations

import collections
import dataclasses
import enum
import math
import threading
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

import common.protocol as protocol
from common.protocol import (
    CONTROL_COMMANDS, MESSAGE_TYPES, PROTOCOL_VERSION, Ack, Announce, Commit, Control, EpochEnd, Fenced,
    Hello, Message, Ping, Pong, ProtocolError, Reply, RingInfo, Welcome, decode, next_rid, plan_id,
)
from common.seqset import SeqSet

SECRET = "0123456789abcdef0123456789abcdef"
RING = RingInfo(worker=0, path="/dev/shm/dfpipe.w0.17", slot_count=6, slot_size=64 << 20, producer_epoch=17)
PLAN_PARTS = {"data.seed": 0, "data.token_budget": 4096, "data.train_path": "9f86d081884c7d65"}
PLAN = {**PLAN_PARTS, "id": plan_id(PLAN_PARTS)}
SAMPLES: dict[str, Message] = {
    "hello": Hello(rid=7, job="3f2a9c1b0d4e-4242", secret=SECRET, rank=1, world=2, pid=4242, start_time=123456,
                   have=SeqSet.from_ranges([(0, 90), (95, 97)]),
                   epochs=6, credit=2, heldout=False, plan="0123456789abcdef"),
    "welcome": Welcome(rid=7, consumer_epoch=3,
                       rings=[RING, dataclasses.replace(RING, worker=1, path="/dev/shm/dfpipe.w1.17")],
                       target={"hidden_size": 64, "num_layers": 4, "layer_ids": [1, 2], "vocab_size": 1000,
                               "model": "/models/tiny", "dtype": "fp32", "mask_token_id": 999, "eps": 1e-6},
                       epoch_sizes=[100, 100, 101], ready=[90, 91], heldout_batches=4, plan=PLAN),
    "announce": Announce(consumer_epoch=3, worker=1, slot=5, pub_seq=1000, seq=150, epoch=1, heldout=False),
    "epoch_end": EpochEnd(consumer_epoch=3, epoch=0),
    "ack": Ack(consumer_epoch=3, secret=SECRET, worker=1, slot=5, pub_seq=1000, seq=150),
    "commit": Commit(rid=8, consumer_epoch=3, secret=SECRET, have=SeqSet.from_ranges([(0, 120)]), step=200),
    "ping": Ping(rid=9, t=1712.5),
    "pong": Pong(rid=9, t=1712.5),
    "control": Control(rid=10, cmd="pause", args={"reason": "maintenance", "timeout_s": 2.5, "force": True, "n": 3}),
    "reply": Reply.success(10, {"state": "paused", "slots": {"free": 3, "ready": [1, 2]}, "loss": None}),
    "fenced": Fenced(consumer_epoch=3, reason="no pong for 10.0 s"),
}


def _wire(msg: Message, **changes: Any) -> dict[str, Any]:
    body = {"v": PROTOCOL_VERSION, "type": msg.TYPE, **msg.to_wire()}
    body.update(changes)
    return body


def _pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def test_every_message_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_message_round_trips(name: str) -> None:
    msg = SAMPLES[name]
    frame = msg.encode()
    back = decode(frame)
    assert type(back) is type(msg) and back == msg
    assert back.encode() == frame


def test_reply_failure_round_trips_and_nan_results_survive() -> None:
    assert decode(Reply.failure(3, "unknown worker").encode()) == Reply.failure(3, "unknown worker")
    back = decode(Reply.success(4, {"loss": math.nan}).encode())
    assert math.isnan(back.result["loss"])


def test_status_built_from_service_types_becomes_plain_json() -> None:
    class State(enum.IntEnum):
        SERVING = 2

    status = {"counters": collections.Counter(acked=3), "pair": (1, 2), "state": State.SERVING,
              "acc": np.float32(0.5), "n": np.int64(7), "loss": torch.tensor(1.25), "ok": np.bool_(True)}
    reply = Reply.success(1, status)
    assert reply.result == {"counters": {"acked": 3}, "pair": [1, 2], "state": 2, "acc": 0.5, "n": 7, "loss": 1.25,
                            "ok": True}
    assert decode(reply.encode()) == reply
    with pytest.raises(ProtocolError, match="reply.result.t"):
        Reply.success(1, {"t": torch.zeros(3)})  # not a scalar: refused, not guessed


def test_message_snapshots_the_callers_seqset() -> None:
    have = SeqSet([1, 2])
    msg = Commit(rid=1, consumer_epoch=0, secret=SECRET, have=have, step=1)
    have.add(50)
    assert 50 not in msg.have and decode(msg.encode()).have == SeqSet([1, 2])


@pytest.mark.parametrize("bad", ["", "ab" * 15, "ab" * 17, "AB" * 16, "zz" * 16, "ab" * 15 + "a ", 17, None])
def test_a_session_secret_is_32_lowercase_hex_digits_and_never_shown(bad: Any) -> None:
    body = {"v": PROTOCOL_VERSION, "type": "ack", **SAMPLES["ack"].to_wire(), "secret": bad}
    with pytest.raises(ProtocolError) as e:
        decode(msgpack.packb(body, use_bin_type=True))
    assert e.value.code == "field" and "ack.secret" in str(e.value)
    assert not isinstance(bad, str) or not bad or bad not in str(e.value), "an error never echoes a secret"
    fresh = {protocol.new_session_secret() for _ in range(3)}
    assert len(fresh) == 3 and all(len(x) == 32 for x in fresh)
    for kind in ("hello", "ack", "commit"):
        assert SECRET not in repr(SAMPLES[kind]), f"{kind}: logging a message must not log its secret"
    assert protocol.secret_tag(SECRET) not in SECRET and len(protocol.secret_tag(SECRET)) == 8


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION),
                                     float(PROTOCOL_VERSION), True, None])
def test_other_protocol_version_is_rejected(version: Any) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(_pack(_wire(SAMPLES["ping"], v=version)))
    assert e.value.code == "version"


def test_missing_version_is_rejected() -> None:
    body = _wire(SAMPLES["ping"])
    del body["v"]
    with pytest.raises(ProtocolError, match="version"):
        decode(_pack(body))


@pytest.mark.parametrize("kind", ["nope", "", 3, None, "Ping"])
def test_unknown_message_type_is_rejected(kind: Any) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(_pack(_wire(SAMPLES["ping"], type=kind)))
    assert e.value.code == "type"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_missing_or_unknown_key_is_rejected(name: str) -> None:
    body = _wire(SAMPLES[name])
    first_field = next(iter(SAMPLES[name].to_wire()))
    missing = dict(body)
    del missing[first_field]
    for bad in (missing, {**body, "extra": 1}):
        with pytest.raises(ProtocolError) as e:
            decode(_pack(bad))
        assert e.value.code == "keys"


def _field_names() -> list[tuple[str, str]]:
    return [(name, f) for name, msg in sorted(SAMPLES.items()) for f in msg.to_wire()]


@pytest.mark.parametrize("name, field", _field_names())
def test_no_field_accepts_nil_or_bytes(name: str, field: str) -> None:
    for bad in (None, b"\x01"):
        with pytest.raises(ProtocolError) as e:
            decode(_pack(_wire(SAMPLES[name], **{field: bad})))
        assert e.value.code == "field" and field in str(e.value)


def _ring(**changes: Any) -> list[dict[str, Any]]:
    return [{**RING.to_wire(), **changes}]


# (message, field, bad wire value): each must be refused on decode, naming the field.
BAD_FIELDS = [
    ("announce", "slot", "3"), ("announce", "slot", 3.0), ("announce", "slot", True), ("announce", "slot", -1),
    ("announce", "slot", 1 << 16), ("announce", "worker", 1024), ("announce", "seq", 1 << 63),
    ("announce", "seq", (1 << 64) - 1), ("announce", "pub_seq", [1]), ("announce", "epoch", {"e": 1}),
    ("announce", "consumer_epoch", -(1 << 63)),
    ("ack", "slot", -1), ("ack", "consumer_epoch", 1.5), ("ack", "worker", False),
    ("epoch_end", "epoch", "0"),
    ("hello", "rank", 2), ("hello", "world", 0), ("hello", "pid", 0), ("hello", "start_time", -1),
    ("hello", "have", [[3, 1]]), ("hello", "have", [1, 2]), ("hello", "have", [[0, 2], [1, 3]]),
    ("hello", "have", {"a": 1}), ("hello", "job", ""), ("hello", "job", "j" * 129), ("hello", "credit", 0),
    ("hello", "epochs", 0), ("hello", "rid", -5),
    ("hello", "heldout", 1), ("hello", "heldout", "yes"), ("hello", "heldout", True),  # True: rank 1 of 2
    ("announce", "heldout", 0), ("announce", "heldout", "false"),
    ("welcome", "heldout_batches", -1), ("welcome", "heldout_batches", (1 << 12) + 1),
    ("welcome", "heldout_batches", True), ("welcome", "heldout_batches", 2.0),
    ("welcome", "rings", {"worker": 0}), ("welcome", "rings", _ring(slot_count=0)),
    ("welcome", "rings", _ring(path="")), ("welcome", "rings", _ring(path="x" * 5000)),
    ("welcome", "rings", _ring(extra=1)), ("welcome", "rings", _ring(worker="0")),
    ("welcome", "rings", _ring() + _ring()), ("welcome", "rings", [[0, "/p", 1, 1, 1]]),
    ("welcome", "target", {"nested": {"a": 1}}), ("welcome", "target", {"ids": ["a"]}),
    ("welcome", "target", {"k" * 65: 1}), ("welcome", "target", {"eps": math.nan}),
    ("welcome", "target", {"flag": True}), ("welcome", "target", {b"k": 1}), ("welcome", "target", {"": 1}),
    ("welcome", "target", [1]), ("welcome", "epoch_sizes", [-1]), ("welcome", "epoch_sizes", 3),
    ("welcome", "ready", ["1"]), ("welcome", "ready", list(range((1 << 16) + 1))),
    ("welcome", "target", {f"k{i}": i for i in range(65)}),
    ("commit", "step", -1), ("commit", "have", [[0, 1.5]]),
    ("ping", "t", math.nan), ("ping", "t", math.inf), ("ping", "t", 1), ("pong", "rid", -1),
    ("control", "cmd", "reboot"), ("control", "cmd", 7), ("control", "args", {"x": [1]}),
    ("control", "args", {"x": {"y": 1}}), ("control", "args", {"x": "y" * 2000}), ("control", "args", []),
    ("control", "args", {"x": -math.inf}), ("control", "args", {f"k{i}": i for i in range(33)}),
    ("reply", "ok", 1), ("reply", "result", []), ("reply", "result", {"x": b"raw"}),
    ("reply", "result", {"x": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}), ("reply", "result", {"x": "s" * 70000}),
    ("reply", "result", {"x": list(range(70000))}), ("reply", "error", "x" * 5000), ("reply", "error", "boom"),
    ("fenced", "reason", 5),
]


@pytest.mark.parametrize("name, field, bad", BAD_FIELDS)
def test_wrong_field_type_or_range_is_rejected(name: str, field: str, bad: Any) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(_pack(_wire(SAMPLES[name], **{field: bad})), max_bytes=1 << 22)
    assert e.value.code in ("field", "keys")  # "keys": a nested struct with a wrong key set
    assert f"{name}.{field}" in str(e.value) or (field == "error" and "reply" in str(e.value))


@pytest.mark.parametrize("name, field, bad", [c for c in BAD_FIELDS if c[1] not in ("have", "rings")])
def test_sender_cannot_build_an_invalid_message(name: str, field: str, bad: Any) -> None:
    with pytest.raises(ProtocolError):
        dataclasses.replace(SAMPLES[name], **{field: bad})


def test_reply_with_ok_false_needs_an_error() -> None:
    with pytest.raises(ProtocolError, match="reply.error"):
        Reply(rid=1, ok=False, result={}, error="")


def test_size_limit_is_enforced_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = SAMPLES["welcome"].encode()

    def must_not_unpack(*a: Any, **k: Any) -> Any:
        raise AssertionError("unpacked an oversized frame")

    monkeypatch.setattr(protocol.msgpack, "unpackb", must_not_unpack)
    with pytest.raises(ProtocolError) as e:
        decode(frame, max_bytes=len(frame) - 1)
    assert e.value.code == "too_large"


def test_encode_refuses_a_message_the_peer_would_drop() -> None:
    big = Reply.success(1, {"blob": "x" * 60000, "more": ["y" * 60000] * 3})
    with pytest.raises(ProtocolError) as e:
        big.encode(max_bytes=100_000)
    assert e.value.code == "too_large"


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x92\x01", SAMPLES["ping"].encode() + b"\x00", SAMPLES["ping"].encode()[:-1],
    b"\xdd\xff\xff\xff\xff",                      # array claiming 4 G items in 5 bytes
    b"\x91" * 5000 + b"\xc0",                     # nested 5000 deep
    _pack([1, 2]), _pack("ping"), _pack(None),
])
def test_non_message_frames_are_rejected(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(frame)


def test_repeated_key_is_rejected() -> None:
    # msgpack allows a map to repeat a key (the last would win); a forged second "slot" must not.
    body = _wire(SAMPLES["ack"])
    pairs = list(body.items()) + [("slot", 0)]
    raw = bytes([0x80 | len(pairs)]) + b"".join(_pack(k) + _pack(v) for k, v in pairs)
    with pytest.raises(ProtocolError) as e:
        decode(raw)
    assert e.value.code == "keys"


def test_extension_types_are_rejected() -> None:
    for ext in (msgpack.ExtType(5, b"abc"), msgpack.Timestamp(1, 0)):
        with pytest.raises(ProtocolError):
            decode(_pack(_wire(SAMPLES["ping"], t=ext)))


def test_non_bytes_input_is_rejected() -> None:
    with pytest.raises(ProtocolError):
        decode("not bytes")  # type: ignore[arg-type]
    assert decode(bytearray(SAMPLES["ack"].encode())) == SAMPLES["ack"]


def test_next_rid_is_strictly_increasing_across_threads() -> None:
    got: list[list[int]] = [[] for _ in range(4)]

    def take(out: list[int]) -> None:
        out.extend(next_rid() for _ in range(2000))

    threads = [threading.Thread(target=take, args=(g,)) for g in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [r for g in got for r in g]
    assert len(set(flat)) == len(flat)
    assert all(g == sorted(g) for g in got)
    assert next_rid() > max(flat)


def test_control_commands_are_the_documented_ones() -> None:
    assert CONTROL_COMMANDS == ("status", "pause", "resume", "drain", "shutdown", "checkpoint")
    for cmd in CONTROL_COMMANDS:
        assert decode(Control(rid=1, cmd=cmd, args={}).encode()).cmd == cmd


# ---- held-out batches -----------------------------------------------------------------------------

HELDOUT = Announce(consumer_epoch=3, worker=1, slot=2, pub_seq=1001, seq=3, epoch=0, heldout=True)


def test_heldout_fields_round_trip() -> None:
    hello = dataclasses.replace(SAMPLES["hello"], rank=0, heldout=True)
    for msg in (hello, HELDOUT, dataclasses.replace(SAMPLES["welcome"], heldout_batches=0)):
        back = decode(msg.encode())
        assert back == msg and back.encode() == msg.encode()
    assert decode(hello.encode()).heldout is True and decode(HELDOUT.encode()).heldout is True


def test_only_rank_0_asks_for_heldout_batches() -> None:
    with pytest.raises(ProtocolError, match="hello.heldout: only rank 0"):
        dataclasses.replace(SAMPLES["hello"], rank=1, heldout=True)
    with pytest.raises(ProtocolError, match="hello.heldout"):
        decode(_pack(_wire(SAMPLES["hello"], rank=1, heldout=True)))


@pytest.mark.parametrize("changes, where", [({"epoch": 1}, "announce.epoch"), ({"seq": 1 << 12}, "announce.seq")])
def test_a_heldout_announce_names_a_heldout_index_in_epoch_0(changes: dict[str, int], where: str) -> None:
    with pytest.raises(ProtocolError, match=where):
        dataclasses.replace(HELDOUT, **changes)
    with pytest.raises(ProtocolError, match=where) as e:
        decode(_pack(_wire(HELDOUT, **changes)))
    assert e.value.code == "field"

