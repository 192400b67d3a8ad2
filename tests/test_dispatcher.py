"""The dispatcher hands each seq to one worker; a replan sees every seq in exactly one place
(pending, being computed, or elsewhere: the caller's ring snapshot), because no worker can take or
finish a seq while the replan's plan is computed."""
from __future__ import annotations

import threading
import time

from target_server.delivery import Dispatcher, Work


def test_work_is_taken_in_order_held_out_first_and_once() -> None:
    d = Dispatcher()
    d.reset([3, 1, 2])
    d.reset_heldout([0])
    taken = [d.take(0.1) for _ in range(4)]
    assert taken == [Work(0, heldout=True), Work(1), Work(2), Work(3)]
    assert d.take(0.05) is None and d.computing == {1, 2, 3} and d.computing_heldout == {0}
    d.done(Work(2))
    assert d.computing == {1, 3} and not d.idle()


def _blocked_while_planning(d: Dispatcher, replan, action) -> tuple[list[object], float]:
    """Run `action` in a thread while `replan`'s plan is being computed; when did it return?"""
    inside, release = threading.Event(), threading.Event()
    results: list[object] = []
    returned_at: list[float] = []

    def plan(busy: set[int]) -> list[int]:
        results.append(sorted(busy))
        inside.set()
        release.wait(5)
        return [7, 8]

    planner = threading.Thread(target=replan, args=(plan,))
    planner.start()
    assert inside.wait(5)
    worker = threading.Thread(target=lambda: (results.append(action()), returned_at.append(time.monotonic())))
    worker.start()
    time.sleep(0.2)
    assert not returned_at, "a worker took or finished work while the plan was being computed"
    released = time.monotonic()
    release.set()
    planner.join(5)
    worker.join(5)
    assert returned_at and returned_at[0] >= released
    return results, released


def test_replan_holds_off_take_and_done_until_the_new_plan_is_in_place() -> None:
    d = Dispatcher()
    d.reset([1, 2])
    assert d.take(0.1) == Work(1)
    # take() waits for the replan: it then gets the new plan's first seq, never the replaced 2
    results, _ = _blocked_while_planning(d, d.replan, lambda: d.take(5))
    assert results == [[1], Work(7)]
    # done() of a seq being computed also waits: the plan saw it as computing, consistently
    results, _ = _blocked_while_planning(d, d.replan, lambda: d.done(Work(1)))
    assert results == [[1, 7], None] and d.computing == {7}
    assert d.pending() == [7, 8]


def test_replan_heldout_sees_the_indices_being_computed() -> None:
    d = Dispatcher()
    d.reset_heldout([0, 1])
    assert d.take(0.1) == Work(0, heldout=True)
    results, _ = _blocked_while_planning(d, d.replan_heldout, lambda: d.take(5))
    assert results == [[0], Work(7, heldout=True)]
    assert d.pending_heldout() == [8]


def test_a_seq_handed_out_again_counts_as_recomputed_and_held_out_work_never_does() -> None:
    d = Dispatcher()
    # then a trainer died with seqs 1 and 2 trained but not checkpointed: its successor needs them again
    for seqs, recomputed in (([0, 1, 2], 0), ([1, 2, 3], 2)):
        d.reset(seqs)
        d.reset_heldout([0])
        taken = [d.take(0.1) for _ in range(4)]
        assert taken == [Work(0, heldout=True), *(Work(seq) for seq in seqs)]
        for w in taken:
            d.done(w)
        assert d.recomputed == recomputed
    assert list(d.taken.ranges()) == [(0, 4)]
