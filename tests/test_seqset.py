"""SeqSet: a set of batch seqs as ranges, checked against a plain Python set."""
from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.protocol import ProtocolError
from common.seqset import SEQ_LIMIT, SeqSet

# Small values so random operations collide, touch and overlap often.
seqs = st.integers(0, 60)
ranges = st.tuples(seqs, st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1]))
ops = st.lists(st.one_of(st.tuples(st.just("add"), seqs), st.tuples(st.just("range"), ranges),
                         st.tuples(st.just("update"), st.lists(ranges, max_size=4)),
                         st.tuples(st.just("discard"), seqs), st.tuples(st.just("remove"), ranges),
                         st.tuples(st.just("difference"), st.lists(ranges, max_size=4)),
                         st.tuples(st.just("pop"), st.none())), max_size=30)


def _ranges(rs: list) -> list[range]:
    return [range(*r) for r in rs]


# op -> (what it does to a SeqSet, the same on a Python set)
APPLY = {
    "add": (SeqSet.add, set.add),
    "range": (lambda s, r: s.add_range(*r), lambda ref, r: ref.update(range(*r))),
    "update": (lambda s, rs: s.update(SeqSet.from_ranges(rs)), lambda ref, rs: ref.update(*_ranges(rs))),
    "discard": (SeqSet.discard, set.discard),
    "remove": (lambda s, r: s.remove_range(*r), lambda ref, r: ref.difference_update(range(*r))),
    "difference": (lambda s, rs: s.difference_update(SeqSet.from_ranges(rs)),
                   lambda ref, rs: ref.difference_update(*_ranges(rs))),
}


def _apply(ops_list: list) -> tuple[SeqSet, set[int]]:
    s, ref = SeqSet(), set()
    for op, arg in ops_list:
        if op in APPLY:
            APPLY[op][0](s, arg)
            APPLY[op][1](ref, arg)
        elif ref:
            assert s.pop_first() == min(ref)
            ref.remove(min(ref))
        else:
            with pytest.raises(KeyError):
                s.pop_first()
    return s, ref


@settings(max_examples=300, deadline=None)
@given(ops, ranges)
def test_seqset_behaves_like_a_python_set(ops_list: list, window: tuple[int, int]) -> None:
    s, ref = _apply(ops_list)
    assert list(s) == sorted(ref)
    assert len(s) == s.size == len(ref)
    assert s.end == (max(ref) + 1 if ref else 0)
    assert bool(s) == bool(ref)
    for x in range(0, 80):
        assert (x in s) == (x in ref)
    a, b = window
    missing = [x for r in s.difference_ranges(a, b) for x in range(*r)]
    assert missing == sorted(set(range(a, b)) - ref)
    assert s.count_in(a, b) == len(set(range(a, b)) & ref)
    # canonical: sorted, disjoint, non-touching, non-empty runs
    runs = list(s.ranges())
    assert all(x < y for x, y in runs)
    assert all(runs[i][1] < runs[i + 1][0] for i in range(len(runs) - 1))


@settings(max_examples=200, deadline=None)
@given(ops, ops)
def test_equal_members_means_equal_sets(ops1: list, ops2: list) -> None:
    s1, ref1 = _apply(ops1)
    s2, ref2 = _apply(ops2)
    assert (s1 == s2) == (ref1 == ref2)
    assert SeqSet(sorted(ref1)) == s1


@settings(max_examples=200, deadline=None)
@given(ops, ops)
def test_union_and_subset_agree_with_python_sets(ops1: list, ops2: list) -> None:
    s1, ref1 = _apply(ops1)
    s2, ref2 = _apply(ops2)
    before = s1.copy()
    assert list(SeqSet.union_of(s1, s2)) == sorted(ref1 | ref2)
    assert s1 == before  # union_of builds a new set
    assert s1.issubset(s2) == (ref1 <= ref2)
    assert s1.issubset(SeqSet.union_of(s1, s2))


@settings(max_examples=200, deadline=None)
@given(ops)
def test_wire_round_trip_is_exact(ops_list: list) -> None:
    s, _ = _apply(ops_list)
    assert SeqSet.from_wire(s.to_wire()) == s


def test_the_size_of_a_set_wider_than_sys_maxsize_is_exact() -> None:
    # a peer may send [[0, 2**63]]: len() cannot say how many that is, `size` can
    everything = SeqSet.from_wire([[0, SEQ_LIMIT]])
    assert everything.size == SEQ_LIMIT > sys.maxsize and everything.end == SEQ_LIMIT
    with pytest.raises(OverflowError):
        len(everything)


def test_touching_ranges_merge_into_one_run() -> None:
    s = SeqSet()
    s.add_range(0, 3)
    s.add_range(5, 7)
    s.add_range(3, 5)
    assert list(s.ranges()) == [(0, 7)]
    assert s.to_wire() == [[0, 7]]


def test_difference_ranges_lists_what_is_missing_from_an_epoch() -> None:
    s = SeqSet.from_ranges([(2, 4), (6, 7)])
    assert s.difference_ranges(0, 8) == [(0, 2), (4, 6), (7, 8)]
    assert s.difference_ranges(2, 4) == []
    assert s.difference_ranges(5, 5) == []


def test_copy_is_independent() -> None:
    s = SeqSet([1, 2])
    c = s.copy()
    c.add(10)
    assert 10 not in s and 10 in c


def test_non_int_members_are_refused_locally() -> None:
    s = SeqSet()
    for bad in (-1, True, 1.0, 1 << 63):
        with pytest.raises(ValueError):
            s.add(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        s.add_range(5, 4)
    assert "3" not in s and True not in SeqSet([1])


def test_from_wire_merges_touching_runs() -> None:
    assert SeqSet.from_wire([[0, 2], [2, 4], [6, 7]]) == SeqSet.from_ranges([(0, 4), (6, 7)])


@pytest.mark.parametrize("wire, why", [
    ({"a": 1}, "not a list"),
    ([[0, 1, 2]], "not a pair"),
    ([(0, 1)], "tuple is not a list (msgpack always gives lists)"),
    ([[3, 5], [1, 2]], "unsorted"),
    ([[0, 5], [4, 8]], "overlapping"),
    ([[-1, 2]], "negative"),
    ([[2, 2]], "empty range"),
    ([[3, 1]], "reversed"),
    ([[0, 1.0]], "float"),
    ([[False, 1]], "bool"),
    ([[0, (1 << 63) + 1]], "beyond int64"),
    ([[2 * i, 2 * i + 1] for i in range(11)], "too many ranges"),
])
def test_from_wire_rejects_malformed_sets(wire: object, why: str) -> None:
    with pytest.raises(ProtocolError):
        SeqSet.from_wire(wire, max_ranges=10)
