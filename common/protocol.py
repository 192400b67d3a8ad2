"""The wire protocol between the target server, trainer ranks and `dfpipe ctl`.

Every ZeroMQ payload is one msgpack map:

    {"v": PROTOCOL_VERSION, "type": "<name>", <field>: <value>, ...}      exactly these keys

Messages are frozen dataclasses; `encode()` produces the frame and `decode(frame)` is the only way
in. Both directions validate every field, so a message that breaks the contract is refused where
it is built (a bug in the sender, raised at once) and where it arrives (a bug, a version skew or
garbage from a peer). `decode` raises `ProtocolError` and nothing else, whatever the input; the
receiver logs, counts (by `ProtocolError.code`) and drops.

Who sends what (R = trainer rank, S = target server, C = `dfpipe ctl` or any one-shot client):

    R -> S   hello      rid, job, secret, rank, world, pid, start_time, have, epochs, credit, heldout, plan
    S -> R   welcome    rid, consumer_epoch, rings[], target{}, epoch_sizes[], ready[], heldout_batches, plan{}
    S -> R   announce   consumer_epoch, worker, slot, pub_seq, seq, epoch, heldout
    R -> S   ack        consumer_epoch, secret, worker, slot, pub_seq, seq, corrupt
    S -> R   epoch_end  consumer_epoch, epoch
    R0 -> S  commit     rid, consumer_epoch, secret, have, step
    S -> R   fenced     consumer_epoch, reason
    any      ping/pong  rid, t
    C -> S|R control    rid, cmd, args{}         answered by   reply  rid, ok, result{}, error

Requests carry a `rid` (from `next_rid()`); the answer repeats it, so a client matches replies
and ignores stale ones. ZeroMQ is only the doorbell: the shared-memory slot headers are the truth,
so a lost ANNOUNCE or ACK costs latency (both sides re-scan on a timer), never data.

Session membership: trainer rank 0 draws a random `secret` per trainer process group and every
rank sends it in HELLO, ACK and COMMIT. The session is created with the secret of its first HELLO;
a message with another secret never joins, widens, acks into, commits to or ends that session,
whatever `job` it names (the job is shown in status, the secret never is: `secret_tag` is the
short hash logs may show).

Held-out batches (eval during training) travel like training batches but are never trained on:
rank 0 sets `hello.heldout`, the WELCOME says how many exist, and each one arrives as an ANNOUNCE
with `heldout` set, whose `seq` is the held-out index in [0, heldout_batches) (epoch 0), not a batch
seq; the rank acks it like any other slot.

The data plan: `have` means something only under the plan it was trained from (which documents
batch seq s holds). The server sends its plan in WELCOME (components named by the setting they
come from, plus `id`, the fingerprint of them all: `plan_id`); the trainer stores it in every
checkpoint and sends the checkpoint's plan id in HELLO ("" = no checkpoint, or one from before
plans were fingerprinted). A HELLO naming another plan is refused without touching any session,
and the refusal's `result["plan"]` carries the server's plan, so the trainer can say what changed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import json
import math
import os
import reprlib
import secrets
import threading
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import msgpack

from common.errors import ProtocolError
from common.seqset import SeqSet

PROTOCOL_VERSION = 6             # 2: hello.heldout, welcome.heldout_batches, announce.heldout
                                 # 3: hello/ack/commit.secret
                                 # 4: hello.plan, welcome.plan
                                 # 5: ack.corrupt
                                 # 6: hello.ranks_here
MAX_MESSAGE_BYTES = 1 << 20      # default frame limit (ServiceConfig.max_message_bytes)
INT64_MAX = (1 << 63) - 1

CONTROL_COMMANDS = ("status", "pause", "resume", "drain", "shutdown", "checkpoint")

# Structural limits. Generous for real traffic, small enough that a hostile frame cannot make a
# receiver build a huge object graph or recurse deeply.
MAX_WORKERS = 1024               # target workers (rings) per server
MAX_SLOTS = 1 << 16              # slots per ring
MAX_WORLD = 1 << 16              # trainer ranks
MAX_CREDIT = 1024                # slots a rank may hold at once
MAX_HAVE_RANGES = 1 << 16        # runs in a have set
MAX_PATH_LEN = 4096
MAX_REASON_LEN = 4096
MAX_KEY_LEN = 64
MAX_JOB_LEN = 128
SECRET_BYTES = 16                # a session secret: 128 random bits, as 32 lowercase hex digits
MAX_READY = 1 << 16              # seqs in WELCOME.ready (<= workers * slots)
MAX_EPOCHS = 1 << 12
MAX_HELDOUT = 1 << 12            # held-out batches per session
MAX_TARGET_ENTRIES = 64
MAX_TARGET_LIST = 4096
MAX_PLAN_ENTRIES = 32
PLAN_ID_LEN = 16                 # hex digits of a plan fingerprint (64 bits)
MAX_ARGS = 32
MAX_ARG_STR = 1024
MAX_RESULT_DEPTH = 16
MAX_RESULT_NODES = 1 << 16
MAX_RESULT_STR = 1 << 16

_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40
_short.maxlist = 4
_short.maxdict = 4


def _field_error(where: str, why: str, value: Any = dataclasses.MISSING) -> ProtocolError:
    shown = "" if value is dataclasses.MISSING else f", got {type(value).__name__} {_short.repr(value)}"
    return ProtocolError("field", f"{where}: {why}{shown}")


# ---- field codecs ---------------------------------------------------------------------------------
# A codec validates one field: `check` a Python value (sender side and after decoding), `to_wire`
# turns it into msgpack-able data, `from_wire` validates data from a peer and converts it back.
# For plain scalars the Python value is the wire value.

T = TypeVar("T")


class Codec(Generic[T]):
    def normalize(self, value: Any) -> Any:
        """Sender side, before `check`: the value as the message will hold it."""
        return value

    def check(self, value: Any, where: str) -> None:
        raise NotImplementedError

    def to_wire(self, value: T) -> Any:
        return value

    def from_wire(self, obj: Any, where: str) -> T:
        self.check(obj, where)
        return obj


class IntCodec(Codec[int]):
    """An exact int (bool is not an int) in [lo, hi]."""

    def __init__(self, lo: int = 0, hi: int = INT64_MAX) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: Any, where: str) -> None:
        if type(value) is not int:
            raise _field_error(where, "expected int", value)
        if not self.lo <= value <= self.hi:
            raise _field_error(where, f"out of range [{self.lo}, {self.hi}]", value)


class FloatCodec(Codec[float]):
    """An exact float (msgpack float64), finite unless allowed otherwise."""

    def __init__(self, finite: bool = True) -> None:
        self.finite = finite

    def check(self, value: Any, where: str) -> None:
        if type(value) is not float:
            raise _field_error(where, "expected float", value)
        if self.finite and not math.isfinite(value):
            raise _field_error(where, "must be finite", value)


class BoolCodec(Codec[bool]):
    def check(self, value: Any, where: str) -> None:
        if type(value) is not bool:
            raise _field_error(where, "expected bool", value)


class StrCodec(Codec[str]):
    """A str of at most `max_len` characters, optionally non-empty or one of `choices`."""

    def __init__(self, max_len: int, non_empty: bool = False, choices: tuple[str, ...] = ()) -> None:
        self.max_len, self.non_empty, self.choices = max_len, non_empty, choices

    def check(self, value: Any, where: str) -> None:
        if type(value) is not str:
            raise _field_error(where, "expected str", value)
        if len(value) > self.max_len:
            raise _field_error(where, f"longer than {self.max_len} characters ({len(value)})")
        if self.non_empty and not value:
            raise _field_error(where, "must not be empty")
        if self.choices and value not in self.choices:
            raise _field_error(where, f"must be one of {', '.join(self.choices)}", value)


class ListCodec(Codec[list]):
    """A list of at most `max_len` items, each checked by `item`."""

    def __init__(self, item: Codec[Any], max_len: int) -> None:
        self.item, self.max_len = item, max_len

    def _len(self, value: Any, where: str) -> None:
        if type(value) is not list:
            raise _field_error(where, "expected list", value)
        if len(value) > self.max_len:
            raise _field_error(where, f"more than {self.max_len} items ({len(value)})")

    def check(self, value: Any, where: str) -> None:
        self._len(value, where)
        for i, v in enumerate(value):
            self.item.check(v, f"{where}[{i}]")

    def to_wire(self, value: list) -> Any:
        return [self.item.to_wire(v) for v in value]

    def from_wire(self, obj: Any, where: str) -> list:
        self._len(obj, where)
        return [self.item.from_wire(v, f"{where}[{i}]") for i, v in enumerate(obj)]


class SeqSetCodec(Codec["SeqSet"]):
    def __init__(self, max_ranges: int) -> None:
        self.max_ranges = max_ranges

    def normalize(self, value: Any) -> Any:
        # A snapshot: the caller keeps changing its own set after building the message.
        return value.copy() if isinstance(value, SeqSet) else value

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, SeqSet):
            raise _field_error(where, "expected SeqSet", value)
        if value.num_ranges > self.max_ranges:
            raise _field_error(where, f"more than {self.max_ranges} ranges ({value.num_ranges})")

    def to_wire(self, value: "SeqSet") -> Any:
        return value.to_wire()

    def from_wire(self, obj: Any, where: str) -> "SeqSet":
        try:
            return SeqSet.from_wire(obj, max_ranges=self.max_ranges)
        except ProtocolError as e:
            raise ProtocolError("field", f"{where}: {e}") from None


_HEX_DIGITS = frozenset("0123456789abcdef")


class SecretCodec(Codec[str]):
    """A session secret: exactly 2 * SECRET_BYTES lowercase hex digits (see `new_session_secret`).
    Errors never show the value: a secret that is only malformed is still someone's secret."""

    def check(self, value: Any, where: str) -> None:
        if type(value) is not str:
            raise _field_error(where, f"expected str, got {type(value).__name__}")
        if len(value) != 2 * SECRET_BYTES or not set(value) <= _HEX_DIGITS:
            raise _field_error(where, f"expected {2 * SECRET_BYTES} lowercase hex digits")


def new_session_secret() -> str:
    """A fresh secret for one trainer process group (rank 0 draws it, the others receive it)."""
    return secrets.token_hex(SECRET_BYTES)


def secret_tag(secret: str) -> str:
    """A short hash of a secret, safe for logs and status: tells sessions apart, reveals nothing."""
    return hashlib.sha256(secret.encode()).hexdigest()[:8]


def same_secret(a: str, b: str) -> bool:
    """Constant-time comparison: how long a refusal takes says nothing about the secret."""
    return hmac.compare_digest(a.encode(), b.encode())


class PlanIdCodec(Codec[str]):
    """A plan fingerprint (`plan_id`): PLAN_ID_LEN lowercase hex digits, or "" when `allow_empty`."""

    def __init__(self, allow_empty: bool) -> None:
        self.allow_empty = allow_empty

    def check(self, value: Any, where: str) -> None:
        if type(value) is not str:
            raise _field_error(where, "expected str", value)
        if value == "" and self.allow_empty:
            return
        if len(value) != PLAN_ID_LEN or not set(value) <= _HEX_DIGITS:
            raise _field_error(where, f"expected {PLAN_ID_LEN} lowercase hex digits"
                               + (" or \"\"" if self.allow_empty else ""), value)


def plan_id(components: Mapping[str, Any]) -> str:
    """The fingerprint of a data plan: a hash of its components (every entry but `id`), the same
    in every process and on every host (canonical JSON, sorted keys)."""
    body = {k: v for k, v in components.items() if k != "id"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:PLAN_ID_LEN]


class FlatDictCodec(Codec[dict]):
    """{str: scalar | list[int]} with bounded keys, entries, strings and lists.

    `kinds` names what a value may be: "int", "float", "str", "bool", "int_list".
    """

    def __init__(self, kinds: tuple[str, ...], max_entries: int, max_str: int, max_list: int = 0) -> None:
        self.max_entries, self.max_str = max_entries, max_str
        self.kinds = kinds
        self.scalar: dict[type, Codec[Any]] = {}
        if "int" in kinds:
            self.scalar[int] = IntCodec(-INT64_MAX - 1, INT64_MAX)
        if "float" in kinds:
            self.scalar[float] = FloatCodec()
        if "str" in kinds:
            self.scalar[str] = StrCodec(max_str)
        if "bool" in kinds:
            self.scalar[bool] = BoolCodec()
        if "int_list" in kinds:
            self.scalar[list] = ListCodec(IntCodec(-INT64_MAX - 1, INT64_MAX), max_list)

    def check(self, value: Any, where: str) -> None:
        if type(value) is not dict:
            raise _field_error(where, "expected map", value)
        if len(value) > self.max_entries:
            raise _field_error(where, f"more than {self.max_entries} entries ({len(value)})")
        for key, v in value.items():
            if type(key) is not str or not 0 < len(key) <= MAX_KEY_LEN:
                raise _field_error(where, f"keys must be str of 1..{MAX_KEY_LEN} characters", key)
            codec = self.scalar.get(type(v))
            if codec is None:
                raise _field_error(f"{where}.{key}", f"value must be one of {'|'.join(self.kinds)}", v)
            codec.check(v, f"{where}.{key}")


class PlanCodec(FlatDictCodec):
    """A data plan: {setting: str | int} with at least one component and an `id` that is the
    `plan_id` of the rest (a plan whose fingerprint does not match its parts is refused)."""

    def __init__(self) -> None:
        super().__init__(("int", "str"), MAX_PLAN_ENTRIES, MAX_PATH_LEN)

    def check(self, value: Any, where: str) -> None:
        super().check(value, where)
        if len(value) < 2 or "id" not in value:
            raise _field_error(where, "needs an 'id' and at least one component", sorted(value))
        PlanIdCodec(allow_empty=False).check(value["id"], f"{where}.id")
        if value["id"] != plan_id(value):
            raise _field_error(f"{where}.id", "is not the fingerprint of the plan's components", value["id"])


def check_plan(value: Any, where: str = "plan") -> dict[str, str | int]:
    """`value` as a valid data plan (e.g. from a refusal's JSON result), or ProtocolError."""
    PlanCodec().check(value, where)
    return dict(value)


class JsonCodec(Codec[dict]):
    """A JSON-like map (dict/list/str/int/float/bool/None), bounded in depth, node count and
    string length. Floats may be NaN/inf: a status reply must be able to report a NaN loss.

    On the sender side, status dicts are built from whatever the service has at hand, so
    `normalize` turns dict/list/str/int/float subclasses (Counter, IntEnum, ...), tuples and
    0-d numpy/torch scalars into plain values first; anything else is still refused by `check`."""

    def normalize(self, value: Any, depth: int = 0) -> Any:
        if value is None or type(value) in (bool, int, float, str) or depth > MAX_RESULT_DEPTH:
            return value
        if isinstance(value, Mapping):
            return {(str(k) if isinstance(k, str) else k): self.normalize(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.normalize(v, depth + 1) for v in value]
        for plain in (bool, int, float, str):
            if isinstance(value, plain):
                return plain(value)
        if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy / torch scalar
            item = value.item()
            return item if type(item) in (bool, int, float) else value
        return value

    def check(self, value: Any, where: str) -> None:
        if type(value) is not dict:
            raise _field_error(where, "expected map", value)
        budget = [MAX_RESULT_NODES]
        self._walk(value, where, 0, budget)

    def _walk(self, value: Any, where: str, depth: int, budget: list[int]) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise _field_error(where, f"more than {MAX_RESULT_NODES} values in total")
        tp = type(value)
        if value is None or tp is bool or tp is float:
            return
        if tp is int:
            if not -INT64_MAX - 1 <= value <= INT64_MAX:
                raise _field_error(where, "int outside int64", value)
            return
        if tp is str:
            if len(value) > MAX_RESULT_STR:
                raise _field_error(where, f"string longer than {MAX_RESULT_STR}")
            return
        if tp is not dict and tp is not list:
            raise _field_error(where, "expected dict/list/str/int/float/bool/None", value)
        if depth >= MAX_RESULT_DEPTH:
            raise _field_error(where, f"nested deeper than {MAX_RESULT_DEPTH}")
        if tp is list:
            for i, v in enumerate(value):
                self._walk(v, f"{where}[{i}]", depth + 1, budget)
            return
        for k, v in value.items():
            if type(k) is not str or len(k) > MAX_RESULT_STR:
                raise _field_error(where, "keys must be str", k)
            self._walk(v, f"{where}.{k[:40]}", depth + 1, budget)


class StructCodec(Codec[Any]):
    """A nested struct (e.g. RingInfo) travelling as a map with exactly its field names."""

    def __init__(self, cls: type["_Struct"]) -> None:
        self.cls = cls

    def check(self, value: Any, where: str) -> None:
        if type(value) is not self.cls:
            raise _field_error(where, f"expected {self.cls.__name__}", value)

    def to_wire(self, value: Any) -> Any:
        return value.to_wire()

    def from_wire(self, obj: Any, where: str) -> Any:
        return self.cls.from_wire(obj, where)


# ---- messages -------------------------------------------------------------------------------------

def wire(codec: Codec[Any], default: Any = dataclasses.MISSING) -> Any:
    """Declare a message field together with the codec that validates it (a secret is left out of
    the message's repr, so logging a message never logs it). `default` only spares the sender the
    argument: on the wire every field is always present."""
    return dataclasses.field(metadata={"codec": codec}, repr=not isinstance(codec, SecretCodec), default=default)


class _Struct:
    """Base of frozen dataclasses whose fields are declared with `wire(codec)`.

    Construction validates every field (so an invalid message cannot exist), then `_check_fields`
    runs the cross-field rules. Each codec may first normalize its value (see SeqSetCodec,
    JsonCodec).
    """

    _codecs: ClassVar[dict[str, Codec[Any]]]
    _name: ClassVar[str]

    def __post_init__(self) -> None:
        for name, codec in self._codecs.items():
            value = codec.normalize(getattr(self, name))
            codec.check(value, f"{self._name}.{name}")
            object.__setattr__(self, name, value)
        self._check_fields()

    def _check_fields(self) -> None:
        """Cross-field rules; subclasses override."""

    def to_wire(self) -> dict[str, Any]:
        return {name: codec.to_wire(getattr(self, name)) for name, codec in self._codecs.items()}

    @classmethod
    def from_wire(cls, obj: Any, where: str | None = None, skip: tuple[str, ...] = ()) -> Any:
        where = where or cls._name
        if type(obj) is not dict:
            raise _field_error(where, "expected map", obj)
        keys = set(obj) - set(skip)
        if keys != cls._codecs.keys():
            missing = sorted(cls._codecs.keys() - keys)
            unknown = sorted(map(str, keys - cls._codecs.keys()))
            raise ProtocolError("keys", f"{where}: missing keys {missing}, unknown keys {unknown[:8]}")
        values = {name: codec.from_wire(obj[name], f"{where}.{name}") for name, codec in cls._codecs.items()}
        return cls(**values)


def _struct(name: str) -> Any:
    def wrap(cls: type) -> type:
        cls = dataclasses.dataclass(frozen=True)(cls)
        codecs = {}
        for f in dataclasses.fields(cls):
            if "codec" not in f.metadata:
                raise TypeError(f"{cls.__name__}.{f.name}: declare it with wire(codec)")
            codecs[f.name] = f.metadata["codec"]
        cls._codecs = codecs
        cls._name = name
        return cls
    return wrap


_MESSAGE_TYPES: dict[str, type["Message"]] = {}
_HEADER_KEYS = ("v", "type")


def message(name: str) -> Any:
    """Class decorator: a frozen dataclass registered as wire type `name`."""
    def wrap(cls: type) -> type:
        if name in _MESSAGE_TYPES:
            raise TypeError(f"message type {name!r} registered twice")
        cls = _struct(name)(cls)
        if set(_HEADER_KEYS) & cls._codecs.keys():
            raise TypeError(f"{cls.__name__}: field names {_HEADER_KEYS} are reserved")
        cls.TYPE = name
        _MESSAGE_TYPES[name] = cls
        return cls
    return wrap


class Message(_Struct):
    """Base of every top-level message; `TYPE` is its wire name."""

    TYPE: ClassVar[str]

    def encode(self, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
        """The msgpack frame. ProtocolError if it exceeds `max_bytes` (the peer would drop it)."""
        body = {"v": PROTOCOL_VERSION, "type": self.TYPE, **self.to_wire()}
        frame = msgpack.packb(body, use_bin_type=True)
        if len(frame) > max_bytes:
            raise ProtocolError("too_large", f"{self.TYPE}: {len(frame)} bytes, limit {max_bytes}")
        return frame


# Field codecs shared by several messages. Names say what a field means, not only its type.
RID = IntCodec(0, INT64_MAX)
UINT = IntCodec(0, INT64_MAX)
SEQ = IntCodec(0, INT64_MAX)
EPOCH = IntCodec(0, INT64_MAX)
WORKER = IntCodec(0, MAX_WORKERS - 1)
SLOT = IntCodec(0, MAX_SLOTS - 1)
TIME = FloatCodec()
HAVE = SeqSetCodec(MAX_HAVE_RANGES)
SECRET = SecretCodec()
REASON = StrCodec(MAX_REASON_LEN)


@_struct("ring")
class RingInfo(_Struct):
    """One target worker's ring file, as a trainer rank needs it to attach."""

    worker: int = wire(WORKER)
    path: str = wire(StrCodec(MAX_PATH_LEN, non_empty=True))
    slot_count: int = wire(IntCodec(1, MAX_SLOTS))
    slot_size: int = wire(IntCodec(1, INT64_MAX))
    producer_epoch: int = wire(EPOCH)


@message("hello")
class Hello(Message):
    """Trainer rank -> server: start (or resume) a session. `job` names the trainer process group
    (the same on every rank, new on every restart), so the server tells a late rank of the running
    session from a new trainer; `secret` proves the rank belongs to that group; `have` = batch seqs
    already in the trainer's model state; `credit` = how many slots this rank may hold un-acked;
    `heldout` = send this rank the held-out batches (rank 0 only, once per session); `ranks_here` =
    how many of the group's ranks say HELLO to this server (one host's, with cluster.num_hosts > 1;
    0: all `world`): a new session is announced to once that many have."""

    rid: int = wire(RID)
    job: str = wire(StrCodec(MAX_JOB_LEN, non_empty=True))
    secret: str = wire(SECRET)
    rank: int = wire(IntCodec(0, MAX_WORLD - 1))
    world: int = wire(IntCodec(1, MAX_WORLD))
    pid: int = wire(IntCodec(1, INT64_MAX))
    start_time: int = wire(UINT)
    have: SeqSet = wire(HAVE)
    epochs: int = wire(IntCodec(1, MAX_EPOCHS))
    credit: int = wire(IntCodec(1, MAX_CREDIT))
    heldout: bool = wire(BoolCodec())
    plan: str = wire(PlanIdCodec(allow_empty=True), default="")
    ranks_here: int = wire(IntCodec(0, MAX_WORLD), default=0)

    def _check_fields(self) -> None:
        if self.rank >= self.world:
            raise _field_error("hello.rank", f"must be < world ({self.world})", self.rank)
        if self.ranks_here > self.world:
            raise _field_error("hello.ranks_here", f"must be <= world ({self.world})", self.ranks_here)
        if self.heldout and self.rank != 0:
            raise _field_error("hello.heldout", f"only rank 0 asks for held-out batches (rank {self.rank})",
                               self.heldout)


@message("welcome")
class Welcome(Message):
    """Server -> rank: the session's consumer epoch, the rings to attach, the target's shape,
    the batch count of every epoch, the batch seqs READY in slots right now (a snapshot), and how
    many held-out batches the server has (0: none; a rank that asked gets each one once)."""

    rid: int = wire(RID)
    consumer_epoch: int = wire(EPOCH)
    rings: list[RingInfo] = wire(ListCodec(StructCodec(RingInfo), MAX_WORKERS))
    target: dict[str, int | float | str | list[int]] = wire(
        FlatDictCodec(("int", "float", "str", "int_list"), MAX_TARGET_ENTRIES, MAX_PATH_LEN, MAX_TARGET_LIST))
    epoch_sizes: list[int] = wire(ListCodec(UINT, MAX_EPOCHS))
    ready: list[int] = wire(ListCodec(SEQ, MAX_READY))
    heldout_batches: int = wire(IntCodec(0, MAX_HELDOUT))
    plan: dict[str, str | int] = wire(PlanCodec())

    def _check_fields(self) -> None:
        workers = [r.worker for r in self.rings]
        if len(set(workers)) != len(workers):
            raise _field_error("welcome.rings", "worker ids repeat", workers)


@message("announce")
class Announce(Message):
    """Server -> rank: batch `seq` of `epoch` is READY in (worker, slot) as publication `pub_seq`.

    heldout: the slot holds held-out batch number `seq` (epoch 0): evaluate it, never train on it."""

    consumer_epoch: int = wire(EPOCH)
    worker: int = wire(WORKER)
    slot: int = wire(SLOT)
    pub_seq: int = wire(SEQ)
    seq: int = wire(SEQ)
    epoch: int = wire(EPOCH)
    heldout: bool = wire(BoolCodec())

    def _check_fields(self) -> None:
        if self.heldout and self.seq >= MAX_HELDOUT:
            raise _field_error("announce.seq", f"a held-out index must be < {MAX_HELDOUT}", self.seq)
        if self.heldout and self.epoch != 0:
            raise _field_error("announce.epoch", "must be 0 for a held-out batch", self.epoch)


@message("epoch_end")
class EpochEnd(Message):
    """Server -> rank: no more batches of `epoch` will be announced to you."""

    consumer_epoch: int = wire(EPOCH)
    epoch: int = wire(EPOCH)


@message("ack")
class Ack(Message):
    """Rank -> server: the slot's data is on the rank's device (the ring's ack word is already
    written; this message only wakes the producer sooner). `seq` repeats the announcement's.

    corrupt: the slot's payload failed its checksum on the rank, which did not train it and
    wrote no ack word: the server frees the slot and computes the batch again."""

    consumer_epoch: int = wire(EPOCH)
    secret: str = wire(SECRET)
    worker: int = wire(WORKER)
    slot: int = wire(SLOT)
    pub_seq: int = wire(SEQ)
    seq: int = wire(SEQ)
    corrupt: bool = wire(BoolCodec(), default=False)


@message("commit")
class Commit(Message):
    """Trainer rank 0 -> server after a checkpoint: `have` is what the saved state holds."""

    rid: int = wire(RID)
    consumer_epoch: int = wire(EPOCH)
    secret: str = wire(SECRET)
    have: SeqSet = wire(HAVE)
    step: int = wire(UINT)


@message("ping")
class Ping(Message):
    rid: int = wire(RID)
    t: float = wire(TIME)


@message("pong")
class Pong(Message):
    """Answer to a Ping: same rid; `t` is the ping's t echoed (round-trip time at the pinger)."""

    rid: int = wire(RID)
    t: float = wire(TIME)


@message("control")
class Control(Message):
    """A control request (`dfpipe ctl`): cmd in CONTROL_COMMANDS, small scalar args."""

    rid: int = wire(RID)
    cmd: str = wire(StrCodec(MAX_KEY_LEN, choices=CONTROL_COMMANDS))
    args: dict[str, str | int | float | bool] = wire(
        FlatDictCodec(("str", "int", "float", "bool"), MAX_ARGS, MAX_ARG_STR))


@message("reply")
class Reply(Message):
    """Answer to a Control (or any rid-carrying request that has no dedicated answer).

    ok=True carries `result` and error == ""; ok=False carries a non-empty `error`."""

    rid: int = wire(RID)
    ok: bool = wire(BoolCodec())
    result: dict[str, Any] = wire(JsonCodec())
    error: str = wire(REASON)

    def _check_fields(self) -> None:
        if self.ok == bool(self.error):
            raise _field_error("reply.error", "must be empty when ok and non-empty otherwise", self.error)

    @classmethod
    def success(cls, rid: int, result: dict[str, Any] | None = None) -> "Reply":
        return cls(rid=rid, ok=True, result=result or {}, error="")

    @classmethod
    def failure(cls, rid: int, error: str) -> "Reply":
        return cls(rid=rid, ok=False, result={}, error=error)


@message("fenced")
class Fenced(Message):
    """Server -> rank: your session is over (the consumer epoch moved on); send a new HELLO."""

    consumer_epoch: int = wire(EPOCH)
    reason: str = wire(REASON)


MESSAGE_TYPES: Mapping[str, type[Message]] = _MESSAGE_TYPES


# ---- decoding -------------------------------------------------------------------------------------

def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("not_msgpack", f"msgpack extension type {code} is not part of the protocol")


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("keys", "a map repeats a key")
    return out


def decode(frame: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Validate and decode one frame. Raises ProtocolError (only) for anything not a valid message."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("framing", f"expected bytes, got {type(frame).__name__}")
    size = memoryview(frame).nbytes
    if size > max_bytes:  # before unpacking: never build objects for an oversized frame
        raise ProtocolError("too_large", f"frame of {size} bytes, limit {max_bytes}")
    try:
        body = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, use_list=True, timestamp=0, ext_hook=_no_ext,
            object_pairs_hook=_unique_keys, max_str_len=size, max_bin_len=size,
            max_array_len=size, max_map_len=size, max_ext_len=size)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several types (and hooks may too): all mean "not msgpack"
        detail = f"{type(e).__name__}: {_short.repr(str(e))}"
        raise ProtocolError("not_msgpack", f"not a msgpack message: {detail}") from None
    if type(body) is not dict:
        raise ProtocolError("not_a_map", f"expected a msgpack map, got {type(body).__name__}")
    version = body.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version", f"protocol version {_short.repr(version)}, this side speaks {PROTOCOL_VERSION} "
                       "(are both services from the same dfpipe release?)")
    name = body.get("type")
    cls = _MESSAGE_TYPES.get(name) if type(name) is str else None
    if cls is None:
        raise ProtocolError("type", f"unknown message type {_short.repr(name)}")
    try:
        return cls.from_wire(body, skip=_HEADER_KEYS)
    except ProtocolError:
        raise
    except Exception as e:  # a validator bug must still not escape as another type
        raise ProtocolError("field", f"{name}: {type(e).__name__}: {_short.repr(str(e))}") from None


# ---- request ids ----------------------------------------------------------------------------------

_rid_lock = threading.Lock()
_rid_counter: Any = None


def _reset_rids() -> None:
    # A random start: a restarted client (or a forked child) does not reuse the rids of the
    # process before it, so a server that remembers recent rids cannot confuse the two.
    global _rid_counter
    _rid_counter = itertools.count(1 + secrets.randbits(48))


def next_rid() -> int:
    """A request id, strictly increasing within this process."""
    with _rid_lock:
        return next(_rid_counter)


_reset_rids()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_rids)

