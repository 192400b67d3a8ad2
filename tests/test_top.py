"""`dfpipe top`: one frame fits an 80x24 terminal and shows what a user watches, whatever answers.

The status dicts have the shape of TargetServer.status() (target_server/server.py) and
Trainer.status() (drafter_trainer/train.py) mid-run, values included; the end-to-end tests run
`dfpipe top --once` against the real services too (test_target_server, test_e2e_trainer).
"""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from common.metrics import TokenRate, human_duration, time_left_s
from dfpipe.ctl import TOP_HEIGHT, TOP_WIDTH, TopView, audit_text, summary_line, uncommitted_batches

TARGET_EP, TRAINER_EP = "ipc:///tmp/dfpt/target.sock", "ipc:///tmp/dfpt/trainer.sock"


def target_status() -> dict:
    stages = {"forward": {"seconds": 12.5, "count": 40, "mean_ms": 312.5}}
    return {
        "pid": 4242, "state": "serving", "uptime_s": 125.0, "model_loads": 1, "workers": 2,
        "ring": [{"worker": 0, "device": "cpu", "state": "serving", "path": "/dev/shm/dfpt-a-0",
                  "slots": {"FREE": 1, "WRITING": 1, "READY": 1}},
                 {"worker": 1, "device": "cpu", "state": "serving", "path": "/dev/shm/dfpt-a-1",
                  "slots": {"FREE": 2, "WRITING": 0, "READY": 1}}],
        "consumer_epoch": 3,
        "batches": {"produced": 57, "acked": 41, "redelivered": 2, "recomputed": 1, "quarantined": 0, "discarded": 0},
        "tokens": 25_000, "tokens_per_s": 200.0, "epoch_sizes": [60], "pending": 9, "computing": 2,
        "heldout": {"batches": 4, "produced": 4, "announced": 4, "acked": 2, "discarded": 0, "quarantined": 0,
                    "pending": 0},
        "session": {"job": "run-1", "ranks": [0, 1], "epochs": 1, "have": 12, "delivered": 33, "committed": 30,
                    "last_commit_step": 18, "in_flight": 5, "heldout_acked": 2},
        "sessions": 2, "fenced": 1, "bad_messages": 0, "stages": stages,
    }


def trainer_status() -> dict:
    return {
        "pid": 4343, "state": "training", "step": 21, "epoch": 0, "samples_trained": 164,
        "samples_duplicated": 0, "epoch_samples": 240, "documents_trained": 181, "documents_duplicated": 0,
        "epoch_documents": 265, "last_checkpoint": "/runs/demo/run/step-00000018",
        "loss": 4.123456, "batches_trained": 41, "batches_planned": 60, "skipped_steps": 0,
        "checkpoint_failures": 0, "last_checkpoint_error": "", "metrics_lines_lost": 0, "tokens": 19_800,
        "tokens_per_s": 660.0, "implied_acceptance_length": 1.8731, "acceptance_per_position": [0.61, 0.22, 0.05],
        "feed": {"state": "streaming", "batches": 41}, "world": 2,
        "stages": {"step": {"seconds": 20.0, "count": 21, "mean_ms": 952.4}},
        "startup": {"first_step_s": 9.5, "model_s": 1.2},
        "eval": {"step": 20, "tau": 1.7512, "acceptance_per_position": [0.55, 0.2, 0.04], "loss": 4.5, "batches": 2},
        "compile": {"state": "off"},
    }


def render(target: dict | None, trainer: dict | None, view: TopView | None = None, now: float = 1000.0) -> list[str]:
    """One frame as an 80-column terminal shows it, line by line."""
    view = view or TopView(TARGET_EP, TRAINER_EP)
    console = Console(file=io.StringIO(), width=TOP_WIDTH, height=TOP_HEIGHT, color_system=None)
    console.print(view.frame(target, trainer, now=now))
    return console.file.getvalue().rstrip("\n").split("\n")


def fits(lines: list[str]) -> None:
    assert len(lines) <= TOP_HEIGHT, "\n".join(lines)
    assert all(len(line) <= TOP_WIDTH for line in lines), "\n".join(lines)


def test_a_frame_of_both_services_fits_80x24_and_shows_what_matters() -> None:
    lines = render(target_status(), trainer_status())
    fits(lines)
    text = "\n".join(lines)
    target, trainer = text.split("trainer training")   # the trainer's panel title, below the target's
    assert "target server serving" in target
    assert "rate 200 tok/s" in target
    assert "ring slots ready 2   writing 1   free 3" in target
    assert "uncommitted batches 15" in target             # 33 delivered, the commit took 30 - 12 of them
    assert "in flight 5" in target and "last commit step 18" in target
    session_start = target_status()
    session_start["session"]["last_commit_step"] = -1          # before the trainer's first commit
    assert "last commit none" in "\n".join(render(session_start, None))
    assert "step 21" in trainer and "rate 660 tok/s" in trainer
    assert "trained samples 164/240 (0 duplicated), documents 181/265 (0 duplicated)" in trainer
    assert "loss 4.1235" in trainer and "tau 1.87" in trainer and "eval tau 1.75 (step 20)" in trainer
    assert "last checkpoint step-00000018" in trainer


def test_a_multi_host_trainer_shows_each_hosts_shard_and_one_host_shows_none() -> None:
    trainer = trainer_status()
    trainer["cluster"] = {"host_rank": 0, "num_hosts": 2,
                          "hosts": [{"host": 0, "batches_trained": 6, "batches_planned": 10},
                                    {"host": 1, "batches_trained": 8, "batches_planned": 10}],
                          "total": {"batches_trained": 14, "batches_planned": 20}}
    lines = render(target_status(), trainer)
    fits(lines)
    assert "batches per host 0: 6/10   1: 8/10" in "\n".join(lines)
    trainer["cluster"] = {"host_rank": 0, "num_hosts": 1,
                          "hosts": [{"host": 0, "batches_trained": 6, "batches_planned": 10}]}
    assert "per host" not in "\n".join(render(target_status(), trainer))
    trainer["cluster"] = {"hosts": [{"host": "x"}, None, {"host": 2, "batches_trained": 1}]}
    text = "\n".join(render(target_status(), trainer))
    assert "batches per host -: -/-   2: 1/-" in text


def test_every_frame_shows_the_services_own_rates_also_when_no_step_ended_between_two() -> None:
    view = TopView(TARGET_EP, TRAINER_EP)
    for now in (1000.0, 1001.0, 1002.0):   # a slow step: the token counts stay put between refreshes
        target, trainer = "\n".join(render(target_status(), trainer_status(), view, now=now)).split("trainer training")
        assert "rate 200 tok/s" in target and "rate 660 tok/s" in trainer, now
    starting = trainer_status()
    starting["tokens_per_s"] = None        # before the first step
    assert "rate - tok/s" in "\n".join(render(target_status(), starting, view)).split("trainer training")[1]


def test_a_services_rate_is_over_its_last_window_and_drops_to_zero_when_it_stalls() -> None:
    rate = TokenRate(window_s=10.0)
    assert rate.per_s(0.0) is None                     # no step yet
    rate.mark(0.0, 0)                                  # the first batch arrives
    for step in range(1, 31):                          # a step of 100 tokens every 2 s
        rate.mark(2.0 * step, 100 * step)
    assert rate.per_s(60.0) == 50.0
    assert rate.per_s(69.0) == 50.0                    # between two step ends: the same rate, not 0
    rate.mark(62.0, 4_000)                             # a step of 1,000 tokens: 1,400 over the last 10 s
    assert rate.per_s(62.0) == 140.0
    assert rate.per_s(72.5) == 0.0                     # no step for a whole window: stalled
    rate.mark(80.0, 10)                                # the count went back (a new accounting): anew
    assert rate.per_s(80.0) is None


def test_with_both_services_down_the_frame_says_so_and_the_view_keeps_going() -> None:
    view = TopView(TARGET_EP, TRAINER_EP)
    lines = render(None, None, view)
    fits(lines)
    text = "\n".join(lines)
    assert "target server not answering" in text and "trainer not answering" in text
    assert TARGET_EP in text and TRAINER_EP in text
    # a service coming back is shown on the next refresh
    assert "target server serving" in "\n".join(render(target_status(), None, view, now=1001.0))


def test_a_status_with_missing_or_odd_fields_renders_dashes_not_a_crash() -> None:
    odd_target = {"state": "warming", "ring": "not a list", "batches": None, "session": {"delivered": "x"}}
    odd_trainer = {"state": "waiting_for_target", "loss": None, "eval": None, "step": True}
    lines = render(odd_target, odd_trainer)
    fits(lines)
    text = "\n".join(lines)
    assert "target server warming" in text and "trainer waiting_for_target" in text
    assert "loss -" in text and "uncommitted batches -" in text and "last checkpoint none" in text
    state = {"state": "[bold]odd[/]"}      # a state string is shown as it is, not read as markup
    assert "target server [bold]odd[/]" in "\n".join(render(state, None))


@pytest.mark.parametrize("session, uncommitted", [
    ({"have": 0, "delivered": 7, "committed": 0}, 7),           # nothing committed yet
    ({"have": 12, "delivered": 7, "committed": 0}, 7),          # a resumed session: its `have` is durable
    ({"have": 12, "delivered": 7, "committed": 19}, 0),         # all committed
    (None, None),
])
def test_uncommitted_batches_are_the_delivered_ones_no_commit_holds(session: dict | None,
                                                                    uncommitted: int | None) -> None:
    assert uncommitted_batches(session) == uncommitted


def test_the_one_line_views_show_reported_values_only_and_the_time_left() -> None:
    """`dfpipe top` into a file and the demo's line: a trainer waiting for its target (no loss yet:
    nan; no rate: None; no plan: epoch sizes 0) shows neither None, nan nor x/0."""
    waiting = {"state": "waiting_for_target", "step": 0, "epoch": 0, "loss": float("nan"), "tokens_per_s": None,
               "samples_trained": 148, "epoch_samples": 0, "samples_duplicated": 0, "documents_trained": 150,
               "epoch_documents": 0, "documents_duplicated": 0, "progress": None, "eta_s": None, "eval": None}
    line = summary_line(None, waiting)
    assert "None" not in line and "nan" not in line and "/0" not in line, line
    assert line == ("target: not answering | trainer[waiting_for_target] step 0 epoch 0, samples 148 (0 duplicated), "
                    "documents 150 (0 duplicated)")
    training = {**trainer_status(), "progress": 0.6833, "eta_s": 95.0}
    line = summary_line(target_status(), training)
    assert line.startswith("target[serving] produced 57 acked 41 quarantined 0 epoch 3 | trainer[training] step 21 "
                           "epoch 0, 68.3% of the plan, 1m35s left, loss 4.1235, 660 tok/s, eval tau 1.751 (step 20), "
                           "samples 164/240 (0 duplicated)"), line
    frame = "\n".join(render(target_status(), training))
    assert "done 68.3%   left 1m35s" in frame, frame
    assert audit_text({}) == "samples - (- duplicated), documents - (- duplicated)"


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (185, "3m05s"), (3720, "1h02m"),
                                           (2 * 86400 + 3 * 3600 + 59, "2d03h")])
def test_durations_read_as_people_say_them(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def test_the_time_left_is_the_rest_at_the_rate_and_none_without_one() -> None:
    assert time_left_s(40, 100, 2.0) == 30.0
    assert time_left_s(40, 100, None) is None and time_left_s(40, 100, 0.0) is None
    assert time_left_s(120, 100, 2.0) == 0.0
