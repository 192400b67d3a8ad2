"""`dfpipe ctl` and `dfpipe top`: talk to running services over their control endpoints."""
from __future__ import annotations

import sys
import time
from typing import Any

from common.channel import CurveKeys, RequestTimeout, request
from common.config import Config
from common.protocol import Control, Reply, next_rid


class ControlError(RuntimeError):
    pass


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
                lines.append(f"{pad}{k}:")
                lines.append(render(v, indent + 1))
            else:
                lines.append(f"{pad}{k}: {v}")
        return "\n".join(lines)
    if isinstance(obj, list):
        return "\n".join(f"{pad}- " + render(x, indent + 1).lstrip() for x in obj)
    return f"{pad}{obj}"


def summary_line(target: dict | None, trainer: dict | None) -> str:
    if target is None:
        t = "target: not answering"
    else:
        b = target.get("batches", {})
        t = (f"target[{target.get('state')}] produced {b.get('produced', 0)} acked {b.get('acked', 0)} "
             f"quarantined {b.get('quarantined', 0)} epoch {target.get('consumer_epoch')}")
    if trainer is None:
        r = "trainer: not answering"
    else:
        loss = trainer.get("loss")
        r = (f"trainer[{trainer.get('state')}] step {trainer.get('step')} epoch {trainer.get('epoch')} "
             f"samples {trainer.get('samples_trained')}/{trainer.get('epoch_samples')} "
             f"loss {loss if loss is None else round(loss, 4)} tok/s {trainer.get('tokens_per_s')}")
        ev = trainer.get("eval")
        if ev:
            r += f" eval tau {round(ev['tau'], 3)} (step {ev['step']})"
    return f"{t} | {r}"


def top(cfg: Config, interval: float = 1.0, iterations: int = 0) -> int:
    n = 0
    try:
        while True:
            target = try_status(cfg.service.target_endpoint, curve=CurveKeys.from_config(cfg))
            trainer = try_status(cfg.service.trainer_endpoint, curve=CurveKeys.from_config(cfg))
            stamp = time.strftime("%H:%M:%S")
            if sys.stdout.isatty():
                sys.stdout.write("\x1b[2J\x1b[H")
                print(f"dfpipe top  {stamp}\n")
                print("== target ==\n" + (render(target) if target else "not answering"))
                print("\n== trainer ==\n" + (render(trainer) if trainer else "not answering"))
            else:
                print(f"{stamp} {summary_line(target, trainer)}", flush=True)
            n += 1
            if iterations and n >= iterations:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
