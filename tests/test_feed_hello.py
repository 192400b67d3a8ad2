"""The feed's side of a re-HELLO: an announcement of the session a HELLO replaces, still on its way
when the HELLO was sent, is not taken (acking it under the replaced session would let the next
session deliver the batch again: trained twice). Once the answer comes, announcements count again."""
from __future__ import annotations

import torch

from common.config import Config
from common.protocol import Announce, Hello, Welcome, new_session_secret, plan_id
from common.seqset import SeqSet
from drafter_trainer.feed import RingFeed


class Chan:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def announce(epoch: int, seq: int) -> Announce:
    return Announce(consumer_epoch=epoch, worker=0, slot=seq % 4, pub_seq=seq + 1, seq=seq, epoch=0, heldout=False)


def test_announcements_of_a_session_being_replaced_wait_for_the_welcome() -> None:
    feed = RingFeed(Config(), 0, 1, "job", SeqSet(), torch.device("cpu"), 1, secret=new_session_secret())
    chan = Chan()
    feed.consumer_epoch, feed.state = 3, "streaming"   # in session 3, streaming
    feed._on_message(chan, announce(3, 0))
    assert [a.seq for a in feed._pending] == [0]

    feed._hello(chan)                                  # e.g. the server went silent: HELLO again
    assert isinstance(chan.sent[-1], Hello)
    feed._on_message(chan, announce(3, 1))             # sent before the server read the HELLO
    assert [a.seq for a in feed._pending] == [0], "taken under the session the HELLO replaces"

    feed._on_message(chan, Welcome(rid=1, consumer_epoch=3, rings=[], target={}, epoch_sizes=[4], ready=[],
                                   heldout_batches=0, plan={"seed": 0, "id": plan_id({"seed": 0})}))   # the same session goes on
    feed._on_message(chan, announce(3, 1))             # the server announces the rank's slots again
    assert [a.seq for a in feed._pending] == [0, 1]
