"""The feed's side of a re-HELLO: an announcement of the session a HELLO replaces, still on its way
when the HELLO was sent, is not taken (acking it under the replaced session would let the next
session deliver the batch again: trained twice). Once the answer comes, announcements count again."""
from __future__ import annotations

import shutil
import tempfile
import uuid

import torch

from common.channel import RouterChannel
from common.config import Config
from common.protocol import Announce, Hello, RingInfo, Welcome, new_session_secret, plan_id
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


def test_a_welcome_naming_a_ring_that_is_gone_is_said_plainly_and_the_rank_asks_again() -> None:
    feed = RingFeed(Config(), 0, 1, "job", SeqSet(), torch.device("cpu"), 1, secret=new_session_secret())
    gone = f"/dev/shm/dfpt-gone-{uuid.uuid4().hex[:10]}.w0.1"   # e.g. removed by an operator cleaning /dev/shm
    feed._on_message(Chan(), Welcome(rid=1, consumer_epoch=1, target={}, epoch_sizes=[4], ready=[], heldout_batches=0,
                                     rings=[RingInfo(worker=0, path=gone, slot_count=2, slot_size=2 << 20,
                                                     producer_epoch=1)],
                                     plan={"seed": 0, "id": plan_id({"seed": 0})}))
    assert feed.state == "connecting" and not feed.welcomed.is_set(), "no session without its ring: HELLO again"
    assert feed.error.startswith("cannot map the ring the target server named for worker 0: no ring at ")


def test_hello_is_said_only_once_a_process_of_ours_listens_at_the_endpoint() -> None:
    sock_dir = tempfile.mkdtemp(prefix="dfh", dir="/tmp")   # short: a unix socket path is at most 107 bytes
    try:
        cfg = Config()
        cfg.service.target_endpoint = f"ipc://{sock_dir}/target.sock"
        feed = RingFeed(cfg, 0, 1, "job", SeqSet(), torch.device("cpu"), 1, secret=new_session_secret())
        chan = Chan()
        assert not feed._hello_if_ours(chan) and chan.sent == [], "nobody listens yet: nothing is sent"
        router = RouterChannel(cfg.service.target_endpoint)
        try:
            assert feed._hello_if_ours(chan) and isinstance(chan.sent[-1], Hello)
        finally:
            router.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
