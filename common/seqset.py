"""A set of batch seqs stored as sorted, disjoint, half-open ranges.

The trainer's "have set" (the batch seqs whose gradients are in its model state) is almost always
a few long runs: everything below some seq, plus a handful of batches that arrived out of order.
Storing runs instead of members keeps HELLO and COMMIT small and makes "what of epoch e is still
missing" a walk over a few ranges, not over millions of seqs.

Canonical form, kept after every operation (so `==` and `to_wire` need no normalisation):

    ranges = [(a0, b0), (a1, b1), ...]     a_i < b_i  < a_{i+1}    (half-open [a, b))

    e.g. {0..99, 105, 107..109}  ->  [(0, 100), (105, 106), (107, 110)]

Touching ranges are merged: [(0, 3), (3, 5)] is stored as [(0, 5)], hence b_i < a_{i+1} strictly.
Members are non-negative and below 2**63 (they travel as msgpack int64).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

from common.errors import ProtocolError

SEQ_LIMIT = 1 << 63          # exclusive upper bound of a seq (msgpack / int64)
DEFAULT_MAX_RANGES = 1 << 16  # a wire set with more runs than this is refused


def _check_seq(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < SEQ_LIMIT:  # bool is not a seq
        raise ValueError(f"{what}: expected an int in [0, 2**63), got {value!r:.40}")
    return value


class SeqSet:
    """Set of non-negative ints as sorted disjoint half-open ranges (see module docstring)."""

    __slots__ = ("_starts", "_stops")
    __hash__ = None  # type: ignore[assignment]  # mutable

    def __init__(self, seqs: Iterable[int] = ()) -> None:
        # Two parallel sorted lists so membership is one bisect on the starts.
        self._starts: list[int] = []
        self._stops: list[int] = []
        for seq in seqs:
            self.add(seq)

    @classmethod
    def from_ranges(cls, ranges: Iterable[tuple[int, int]]) -> "SeqSet":
        """Any ranges, in any order, possibly overlapping (a local convenience; the wire is strict)."""
        out = cls()
        for a, b in ranges:
            out.add_range(a, b)
        return out

    @classmethod
    def union_of(cls, *sets: "SeqSet") -> "SeqSet":
        """A new set holding every member of `sets` (the arguments are not changed)."""
        out = sets[0].copy() if sets else cls()
        for other in sets[1:]:
            out.update(other)
        return out

    # ---- mutation -------------------------------------------------------------------------------
    def add(self, seq: int) -> None:
        _check_seq(seq, "seq")
        self.add_range(seq, seq + 1)

    def add_range(self, a: int, b: int) -> None:
        """Add every seq in [a, b); an empty range (a == b) is a no-op."""
        _check_seq(a, "range start")
        if type(b) is not int or not a <= b <= SEQ_LIMIT:
            raise ValueError(f"range stop: expected an int in [{a}, 2**63], got {b!r:.40}")
        if a == b:
            return
        # Every stored range that overlaps or touches [a, b) is absorbed into one.
        lo = bisect.bisect_left(self._stops, a)    # first range with stop >= a (touching counts)
        hi = bisect.bisect_right(self._starts, b)  # ranges [lo, hi) start at or before b
        if lo < hi:
            a = min(a, self._starts[lo])
            b = max(b, self._stops[hi - 1])
        self._starts[lo:hi] = [a]
        self._stops[lo:hi] = [b]

    def update(self, other: "SeqSet") -> None:
        """In-place union with another SeqSet."""
        for a, b in other.ranges():
            self.add_range(a, b)

    def remove_range(self, a: int, b: int) -> None:
        """Remove every member in [a, b); the runs it cuts keep their outer parts."""
        _check_seq(a, "range start")
        if type(b) is not int or not a <= b <= SEQ_LIMIT:
            raise ValueError(f"range stop: expected an int in [{a}, 2**63], got {b!r:.40}")
        lo = bisect.bisect_right(self._stops, a)   # first range ending after a
        hi = bisect.bisect_left(self._starts, b)   # ranges [lo, hi) start before b
        if a == b or lo >= hi:
            return
        starts, stops = [], []
        if self._starts[lo] < a:
            starts.append(self._starts[lo])
            stops.append(a)
        if self._stops[hi - 1] > b:
            starts.append(b)
            stops.append(self._stops[hi - 1])
        self._starts[lo:hi] = starts
        self._stops[lo:hi] = stops

    def discard(self, seq: int) -> None:
        _check_seq(seq, "seq")
        self.remove_range(seq, seq + 1)

    def difference_update(self, other: "SeqSet") -> None:
        """In-place difference: O(runs), whatever the number of members."""
        for a, b in other.ranges():
            self.remove_range(a, b)

    def pop_first(self) -> int:
        """Remove and return the smallest member (KeyError when empty, as set.pop)."""
        if not self._starts:
            raise KeyError("pop_first from an empty SeqSet")
        seq = self._starts[0]
        if self._stops[0] == seq + 1:
            del self._starts[0], self._stops[0]
        else:
            self._starts[0] = seq + 1
        return seq

    # ---- queries --------------------------------------------------------------------------------
    def __contains__(self, seq: object) -> bool:
        if type(seq) is not int:
            return False
        i = bisect.bisect_right(self._starts, seq) - 1
        return i >= 0 and seq < self._stops[i]

    @property
    def size(self) -> int:
        """How many members: an int of any size. Use this, not len(), for a set that came from a
        peer: [0, 2**63) has more members than len() can return (OverflowError past sys.maxsize)."""
        return sum(b - a for a, b in zip(self._starts, self._stops))

    def __len__(self) -> int:
        # Only for sets bounded by a plan (len() raises OverflowError past sys.maxsize): see `size`.
        return self.size

    @property
    def end(self) -> int:
        """One past the largest member (0 when empty): the set lies inside [0, end)."""
        return self._stops[-1] if self._stops else 0

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self._starts, self._stops):
            yield from range(a, b)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SeqSet):
            return NotImplemented
        return self._starts == other._starts and self._stops == other._stops

    def __repr__(self) -> str:
        shown = ", ".join(f"[{a},{b})" for a, b in list(self.ranges())[:8])
        more = f", ... {self.num_ranges - 8} more" if self.num_ranges > 8 else ""
        return f"SeqSet({shown}{more})"

    @property
    def num_ranges(self) -> int:
        return len(self._starts)

    def ranges(self) -> Iterator[tuple[int, int]]:
        """The canonical runs, ascending."""
        return zip(self._starts, self._stops)

    def difference_ranges(self, a: int, b: int) -> list[tuple[int, int]]:
        """The runs of [a, b) that are NOT in the set, ascending (what still has to be delivered).

            set  [(2, 4), (6, 7)],  [a, b) = [0, 8)   ->   [(0, 2), (4, 6), (7, 8)]
        """
        _check_seq(a, "range start")
        if type(b) is not int or not a <= b <= SEQ_LIMIT:
            raise ValueError(f"range stop: expected an int in [{a}, 2**63], got {b!r:.40}")
        missing: list[tuple[int, int]] = []
        cursor = a
        i = bisect.bisect_right(self._stops, a)  # first range that ends after a
        while cursor < b and i < len(self._starts):
            start, stop = self._starts[i], self._stops[i]
            if start >= b:
                break
            if start > cursor:
                missing.append((cursor, start))
            cursor = max(cursor, stop)
            i += 1
        if cursor < b:
            missing.append((cursor, b))
        return missing

    def issubset(self, other: "SeqSet") -> bool:
        """Every member of self is in other: each of self's runs lies inside one run of other
        (other is canonical, so a run can never straddle two of its runs)."""
        for a, b in self.ranges():
            i = bisect.bisect_right(other._starts, a) - 1
            if i < 0 or other._stops[i] < b:
                return False
        return True

    def count_in(self, a: int, b: int) -> int:
        """How many members lie in [a, b)."""
        return (b - a) - sum(y - x for x, y in self.difference_ranges(a, b))

    def copy(self) -> "SeqSet":
        out = SeqSet()
        out._starts = list(self._starts)
        out._stops = list(self._stops)
        return out

    # ---- wire -----------------------------------------------------------------------------------
    def to_wire(self) -> list[list[int]]:
        """[[a, b], ...]: the canonical runs as msgpack-able lists."""
        return [[a, b] for a, b in self.ranges()]

    @classmethod
    def from_wire(cls, obj: Any, max_ranges: int = DEFAULT_MAX_RANGES) -> "SeqSet":
        """Parse [[a, b], ...] from a peer; strict: ProtocolError unless sorted, disjoint, a < b,
        within [0, 2**63], exact ints, and at most `max_ranges` runs. Touching runs are merged."""
        def bad(why: str) -> ProtocolError:
            return ProtocolError("field", f"seq set: {why}")

        if type(obj) is not list:
            raise bad(f"expected a list of [start, stop] pairs, got {type(obj).__name__}")
        if len(obj) > max_ranges:
            raise bad(f"{len(obj)} ranges, limit {max_ranges}")
        out = cls()
        prev_stop = -1
        for i, pair in enumerate(obj):
            if type(pair) is not list or len(pair) != 2:
                raise bad(f"range {i}: expected [start, stop], got {pair!r:.40}")
            a, b = pair
            if type(a) is not int or type(b) is not int:
                raise bad(f"range {i}: start and stop must be ints, got {pair!r:.40}")
            if not 0 <= a < b <= SEQ_LIMIT:
                raise bad(f"range {i}: need 0 <= start < stop <= 2**63, got [{a}, {b}]")
            if a < prev_stop:
                raise bad(f"range {i}: [{a}, {b}) is unsorted or overlaps the previous range")
            if a == prev_stop:  # touching: legal but not canonical, merge
                out._stops[-1] = b
            else:
                out._starts.append(a)
                out._stops.append(b)
            prev_stop = b
        return out
