"""`dfpipe ctl` and `dfpipe top`: talk to running services over their control endpoints."""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from common.channel import CurveKeys, RequestTimeout, request
from common.config import Config
from common.metrics import human_duration
from common.protocol import Control, Reply, next_rid


def control(endpoint: str, service: str, command: str, timeout_s: float = 5.0,
            args: dict[str, Any] | None = None, curve: CurveKeys | None = None) -> dict[str, Any]:
    """One control request; a clear error (never a hang) when the service does not answer.
    curve: the CURVE keys of a tcp:// endpoint outside loopback (`CurveKeys.from_config`)."""
    try:
        reply = request(endpoint, Control(rid=next_rid(), cmd=command, args=args or {}), timeout_s=timeout_s,
                        curve=curve)
    except RequestTimeout as e:
        raise SystemExit(f"dfpipe ctl: {service} at {endpoint} did not answer within {timeout_s:g}s: {e}") from None
    if not isinstance(reply, Reply):
        raise SystemExit(f"dfpipe ctl: unexpected answer {type(reply).__name__} from {service}")
    if not reply.ok:
        raise SystemExit(f"dfpipe ctl: {service} refused '{command}': {reply.error}")
    return reply.result


def try_status(endpoint: str, timeout_s: float = 1.0, curve: CurveKeys | None = None) -> dict[str, Any] | None:
    try:
        reply = request(endpoint, Control(rid=next_rid(), cmd="status", args={}), timeout_s=timeout_s, retries=0,
                        curve=curve)
    except RequestTimeout:
        return None
    return reply.result if isinstance(reply, Reply) and reply.ok else None


def render(obj: Any, indent: int = 0) -> str:
    pad = "  " * indent
    if isinstance(obj, dict):
        lines = []
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v and not all(isinstance(x, (int, float, str)) for x in
                                                             (v.values() if isinstance(v, dict) else v)):
                lines += [f"{pad}{k}:", render(v, indent + 1)]
            else:
                lines.append(f"{pad}{k}: {v}")
        return "\n".join(lines)
    if isinstance(obj, list):
        return "\n".join(f"{pad}- " + render(x, indent + 1).lstrip() for x in obj)
    return f"{pad}{obj}"


def target_summary(target: dict | None) -> str:
    """The target server's status on one line; only the values it reported."""
    if target is None:
        return "target: not answering"
    b = target.get("batches") if isinstance(target.get("batches"), dict) else {}
    return (f"target[{target.get('state')}] produced {_num(b.get('produced'))} acked {_num(b.get('acked'))} "
            f"quarantined {_num(b.get('quarantined'))} epoch {_num(target.get('consumer_epoch'))}")


def trainer_summary(trainer: dict | None) -> str:
    """The trainer's status on one line, most telling first (a terminal line cut short keeps it):
    step, progress through the plan and the time left, loss, rate, the last eval, the audit. A value
    the trainer has not reported yet (no loss before its first step, no plan before the target's
    WELCOME, no time left before a rate) is left out, not shown as None or nan."""
    if trainer is None:
        return "trainer: not answering"
    parts = [f"trainer[{trainer.get('state')}] step {_num(trainer.get('step'))} epoch {_num(trainer.get('epoch'))}"]
    if reported(trainer.get("progress")):
        parts.append(f"{100 * trainer['progress']:.1f}% of the plan")
    if reported(trainer.get("eta_s")):
        parts.append(f"{human_duration(trainer['eta_s'])} left")
    if reported(trainer.get("loss")):
        parts.append(f"loss {trainer['loss']:.4f}")
    if reported(trainer.get("tokens_per_s")):
        parts.append(f"{trainer['tokens_per_s']:,.0f} tok/s")
    ev = trainer.get("eval")
    if isinstance(ev, dict) and reported(ev.get("tau")):
        parts.append(f"eval tau {ev['tau']:.3f} (step {_num(ev.get('step'))})")
    return ", ".join([*parts, audit_text(trainer)])


def summary_line(target: dict | None, trainer: dict | None) -> str:
    return f"{target_summary(target)} | {trainer_summary(trainer)}"


# ---- dfpipe top: one panel per service, sized for an 80x24 terminal -----------------------------

TOP_WIDTH, TOP_HEIGHT = 80, 24


def reported(value: Any) -> bool:
    """A number the service reported: not None, not a bool, not nan (a loss before the first step)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _num(value: Any, fmt: str = "{:,.0f}") -> str:
    """A status number for display; '-' where the service did not report one (or reported junk)."""
    return fmt.format(value) if reported(value) else "-"


def audit_text(info: dict[str, Any]) -> str:
    """The exactly-once audit of a trainer status or a checkpoint, as every view shows it: source rows
    (samples) and the documents they make (a template that re-renders earlier turns, or a split,
    makes several of one row), each trained of the epoch's, and how many of them twice. The
    epoch's size only once it is known (the target server's WELCOME): never `148/0`."""
    def trained(kind: str) -> str:
        total = info.get(f"epoch_{kind}")
        of = f"/{_num(total)}" if reported(total) and total > 0 else ""
        return f"{kind} {_num(info.get(f'{kind}_trained'))}{of} ({_num(info.get(f'{kind}_duplicated'))} duplicated)"
    return ", ".join(trained(kind) for kind in ("samples", "documents"))


def _duration(seconds: Any) -> str:
    return human_duration(seconds) if reported(seconds) else "-"


def _commit_step(step: Any) -> str:
    # the session reports -1 until the trainer's first checkpoint commits
    return f"step {step}" if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else "none"


def _line(*fields: tuple[str, str]) -> Text:
    """`label value` pairs on one row; cut with an ellipsis rather than wrapped, so the frame's height is fixed."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, (label, value) in enumerate(fields):
        text.append(("   " if i else "") + label + " ", style="dim")
        text.append(value, style="bold")
    return text


def ring_slots(rings: Any) -> dict[str, int]:
    """Slots of every worker's ring by state (target status 'ring': a list of {'slots': {state: n}})."""
    total = {"READY": 0, "WRITING": 0, "FREE": 0}
    for ring in rings if isinstance(rings, list) else []:
        slots = ring.get("slots") if isinstance(ring, dict) else None
        for state in total:
            n = slots.get(state) if isinstance(slots, dict) else None
            total[state] += n if isinstance(n, int) else 0
    return total


def uncommitted_batches(session: Any) -> int | None:
    """Batches the trainer session holds that no checkpoint has committed yet: a crash now would
    have the target deliver them again. The session starts holding `have` (its checkpoint's, durable);
    a commit replaces `committed` with the new checkpoint's set, which contains `have`."""
    if not isinstance(session, dict):
        return None
    delivered, committed, have = (session.get(k) for k in ("delivered", "committed", "have"))
    if not all(isinstance(n, int) for n in (delivered, committed, have)):
        return None
    return max(0, delivered - max(0, committed - have))


def _title(name: str, state: Any, style: str = "bold") -> Text:
    # a Text, not markup: a state string is the service's, and may hold brackets
    return Text.assemble(f"{name} ", (str(state), style))


def _down(name: str, endpoint: str) -> Panel:
    return Panel(Text(f"not answering at {endpoint}", style="red", no_wrap=True, overflow="ellipsis"),
                 title=_title(name, "not answering", "bold red"), title_align="left", border_style="red")


def target_panel(status: dict[str, Any] | None, endpoint: str) -> Panel:
    if status is None:
        return _down("target server", endpoint)
    batches = status.get("batches") if isinstance(status.get("batches"), dict) else {}
    slots = ring_slots(status.get("ring"))
    session = status.get("session")
    rows = [
        _line(("rate", f"{_num(status.get('tokens_per_s'))} tok/s"), ("up", _duration(status.get("uptime_s"))),
              ("workers", _num(status.get("workers"))), ("consumer epoch", _num(status.get("consumer_epoch")))),
        _line(("batches produced", _num(batches.get("produced"))), ("acked", _num(batches.get("acked"))),
              ("pending", _num(status.get("pending"))), ("quarantined", _num(batches.get("quarantined")))),
        _line(("ring slots ready", _num(slots["READY"])), ("writing", _num(slots["WRITING"])),
              ("free", _num(slots["FREE"]))),
    ]
    if isinstance(session, dict):
        rows.append(_line(("trainer ranks", _num(len(session.get("ranks") or []))),
                          ("in flight", _num(session.get("in_flight"))),
                          ("uncommitted batches", _num(uncommitted_batches(session))),
                          ("last commit", _commit_step(session.get("last_commit_step")))))
    else:
        rows.append(_line(("trainer session", "none")))
    return Panel(Group(*rows), title=_title("target server", status.get("state", "?")), title_align="left")


def host_progress(cluster: Any) -> str:
    """Per host, its shard's batches trained of planned (trainer status 'cluster'); '' on one host."""
    hosts = cluster.get("hosts") if isinstance(cluster, dict) else None
    if not isinstance(hosts, list) or len(hosts) < 2:
        return ""
    return "   ".join(f"{_num(h.get('host'))}: {_num(h.get('batches_trained'))}/{_num(h.get('batches_planned'))}"
                      for h in hosts if isinstance(h, dict))


def trainer_panel(status: dict[str, Any] | None, endpoint: str) -> Panel:
    if status is None:
        return _down("trainer", endpoint)
    last_eval = status.get("eval") if isinstance(status.get("eval"), dict) else {}
    checkpoint = status.get("last_checkpoint")
    failures = status.get("checkpoint_failures")
    rows = [
        _line(("step", _num(status.get("step"))), ("epoch", _num(status.get("epoch"))),
              ("rate", f"{_num(status.get('tokens_per_s'))} tok/s"),
              ("done", f"{_num(status.get('progress'), '{:.1%}')}"), ("left", _duration(status.get("eta_s")))),
        _line(("trained", audit_text(status))),
        _line(("loss", _num(status.get("loss"), "{:.4f}")),
              ("tau", _num(status.get("implied_acceptance_length"), "{:.2f}")),
              ("eval tau", f"{_num(last_eval.get('tau'), '{:.2f}')} (step {_num(last_eval.get('step'))})"
               if last_eval else "-")),
        _line(("last checkpoint", os.path.basename(str(checkpoint).rstrip("/")) if checkpoint else "none"),
              ("failed saves", _num(failures)), ("skipped steps", _num(status.get("skipped_steps")))),
    ]
    if hosts := host_progress(status.get("cluster")):   # a multi-host run: each host's shard, so a host that lags shows
        rows.append(_line(("batches per host", hosts)))
    return Panel(Group(*rows), title=_title("trainer", status.get("state", "?")), title_align="left")


class TopView:
    """Polls both services' status and renders one frame: a header, then one panel per service.
    Every number is the service's own (its rates too: `common.metrics.TokenRate`), so the view,
    `ctl`, the demo and the Prometheus gauges agree."""

    def __init__(self, target_endpoint: str, trainer_endpoint: str, curve: CurveKeys | None = None) -> None:
        self.target_endpoint, self.trainer_endpoint = target_endpoint, trainer_endpoint
        self.curve = curve

    def poll(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return (try_status(self.target_endpoint, curve=self.curve),
                try_status(self.trainer_endpoint, curve=self.curve))

    def frame(self, target: dict[str, Any] | None, trainer: dict[str, Any] | None,
              now: float | None = None) -> Group:
        now = time.time() if now is None else now
        header = Text(f"dfpipe top  {time.strftime('%H:%M:%S', time.localtime(now))}   Ctrl-C quits",
                      style="dim", no_wrap=True, overflow="ellipsis")
        return Group(header, target_panel(target, self.target_endpoint),
                     trainer_panel(trainer, self.trainer_endpoint))


def top(cfg: Config, interval: float = 1.0, iterations: int = 0, once: bool = False) -> int:
    """A live view of both services (`once`: print one frame and exit). Stdout not a terminal (a
    log file, a pipe) and not `once`: one summary line per refresh instead of redrawn frames."""
    view = TopView(cfg.service.target_endpoint, cfg.service.trainer_endpoint, CurveKeys.from_config(cfg))
    console = Console()
    if once:
        console.print(view.frame(*view.poll()))
        return 0
    live = Live(console=console, auto_refresh=False) if console.is_terminal else contextlib.nullcontext()
    n = 0
    try:
        with live:
            while True:
                target, trainer = view.poll()
                if console.is_terminal:
                    live.update(view.frame(target, trainer), refresh=True)
                else:
                    print(f"{time.strftime('%H:%M:%S')} {summary_line(target, trainer)}", flush=True)
                n += 1
                if iterations and n >= iterations:
                    return 0
                time.sleep(interval)
    except KeyboardInterrupt:
        return 0
