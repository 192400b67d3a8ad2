"""`dfpipe` command line: one entry point for both services and the tools around them."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from common.config import Config, ConfigError, load_config
from common.exits import EXIT_CONFIG, EXIT_UNTRUSTED, as_supervised
from common.preflight import UntrustedConfig
from common.liveness import stop_with_launcher
from dfpipe.cpu_fla import quiet_fla_on_cpu
from target_server.data import add_arguments as add_prepare_arguments

DEFAULT_CONFIG = os.environ.get("DFPIPE_CONFIG", "")


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config or None, args.set)


def _add_config(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("-c", "--config", default=DEFAULT_CONFIG, required=required and not DEFAULT_CONFIG,
                   help="YAML config (default: $DFPIPE_CONFIG)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.lr=3e-4")


def _print(obj: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, indent=1, sort_keys=True, default=str))
    else:
        from .ctl import render
        print(render(obj))


def _main_of(module: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand that is all `dfpipe.<module>.main(args)`, its module imported when it runs."""
    return lambda args: importlib.import_module(f"dfpipe.{module}").main(args)


def cmd_target_server(args: argparse.Namespace) -> int:
    quiet_fla_on_cpu()
    from target_server.server import main
    return main(_config(args))


def cmd_trainer(args: argparse.Namespace) -> int:
    quiet_fla_on_cpu()
    from drafter_trainer.train import main
    return main(_config(args))


def cmd_ctl(args: argparse.Namespace) -> int:
    from common.channel import CurveKeys

    from .ctl import control
    cfg = _config(args)
    endpoint = args.endpoint or (cfg.service.target_endpoint if args.service == "target" else cfg.service.trainer_endpoint)
    reply = control(endpoint, args.service, args.command, timeout_s=args.timeout, curve=CurveKeys.from_config(cfg))
    _print(reply, args.json)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from common.channel import ChannelError, make_curve_keys
    try:
        server, client = make_curve_keys(args.out)
    except ChannelError as e:
        raise SystemExit(f"dfpipe keys: {e}") from None
    print(f"CURVE keys in {args.out} (keep the .key_secret files private; a host needs only its own):\n"
          f"  service.curve_server_key: {server}   (clients may use {server.removesuffix('_secret')})\n"
          f"  service.curve_client_key: {client}   "
          f"(the server may use {os.path.join(args.out, 'client.key')})")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from .ctl import top
    return top(_config(args), interval=args.interval, iterations=args.iterations, once=args.once)


def _inspect_info(args: argparse.Namespace) -> dict[str, Any]:
    from drafter_trainer.checkpoint import checkpoint_root, inspect, inspect_run
    path = args.path
    if path and not os.path.isdir(checkpoint_root(path)):
        return inspect(path)
    if not path:
        cfg = _config(args)
        path = cfg.resolve(cfg.train.out_dir)
    info = inspect_run(path)
    if not info["checkpoints"]:
        raise SystemExit(f"dfpipe inspect: no checkpoint under {checkpoint_root(path)}")
    if "verified" not in info:
        print(f"dfpipe inspect: no checkpoint under {checkpoint_root(path)} verifies (each one's failed check "
              "below; README, \"The trainer crashed\")", file=sys.stderr)
    return info


def cmd_inspect(args: argparse.Namespace) -> int:
    from common.trust import Untrusted
    try:
        info = _inspect_info(args)
    except Untrusted as e:   # another user controls what would be read: one line, nothing of it read
        raise SystemExit(f"dfpipe inspect: refused: {e}") from None
    if not args.json:
        info.pop("have", None)
        if isinstance(info.get("time"), (int, float)):   # when it was saved: a date and an age, not epoch seconds
            info["time"] = saved_at(info["time"])
    _print(info, args.json)
    return 0 if info.get("verified", "").startswith("ok") else 1


def saved_at(when: float, now: float | None = None) -> str:
    """A checkpoint's save time as people read it: local date and time, and how long ago."""
    import time

    from common.metrics import human_duration
    now = time.time() if now is None else now
    return f"{time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(when))} ({human_duration(now - when)} ago)"


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from target_server.data import run
    return run(args, _config(args))


def cmd_export(args: argparse.Namespace) -> int:
    from .export_cmd import export_checkpoint
    out = export_checkpoint(_config(args), args.checkpoint, args.out, args.target)
    print(f"exported drafter to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(args.config or None, args.set, fresh=args.fresh)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dfpipe", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("demo", help="both services on CPU with the tiny target and demo data, end to end")
    _add_config(p)
    p.add_argument("--fresh", action="store_true",
                   help="start afresh: delete the run folder of an earlier demo (by default an interrupted run "
                        "continues from its checkpoint)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("target-server", help="run the target server (long-lived)")
    _add_config(p, required=True)
    p.set_defaults(fn=cmd_target_server)

    p = sub.add_parser("trainer", help="run the drafter trainer (one rank; under torchrun for several)")
    _add_config(p, required=True)
    p.set_defaults(fn=cmd_trainer)

    p = sub.add_parser("ctl", help="send a control command to a running service")
    p.add_argument("service", choices=["target", "trainer"])
    p.add_argument("command", choices=["status", "pause", "resume", "drain", "shutdown", "checkpoint"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--endpoint", default="", help="override the endpoint from the config")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    _add_config(p)
    p.set_defaults(fn=cmd_ctl)

    p = sub.add_parser("keys", help="make ZeroMQ CURVE certificates for tcp:// endpoints outside loopback")
    p.add_argument("--out", required=True, help="folder for the server and client certificates (made 0700)")
    p.set_defaults(fn=cmd_keys)

    p = sub.add_parser("top", help="live view of both services")
    _add_config(p)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: until Ctrl-C)")
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    p.set_defaults(fn=cmd_top)

    sub.add_parser("torchrun", add_help=False,
                   help="torchrun (the same arguments), passing on a trainer rank's exit status 2-8 (the ones "
                        "the deployments do not restart: common/exits.py) instead of torchrun's 1")

    p = sub.add_parser("inspect", help="what a checkpoint holds (step, epoch, sample accounting) and whether it "
                                       "verifies (exit 1 when it does not)")
    p.add_argument("path", nargs="?", default="",
                   help="a checkpoint folder, or a run folder: every checkpoint verified, the newest that "
                        "verifies shown (default: the run folder of -c)")
    p.add_argument("--json", action="store_true")
    _add_config(p)
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("prepare-data", help="tokenize a chat file (JSONL or Parquet; OpenAI or ShareGPT rows) "
                                            "into a prepared folder (bad rows counted and reported)")
    add_prepare_arguments(p)
    _add_config(p)
    p.set_defaults(fn=cmd_prepare_data)

    p = sub.add_parser("regenerate", help="replace every assistant turn of a chat JSONL with the target's own "
                                          "answers, from an OpenAI-compatible server (vLLM, SGLang, transformers serve)")
    from .regenerate import add_arguments as regenerate_arguments
    regenerate_arguments(p)
    p.set_defaults(fn=_main_of("regenerate"))

    p = sub.add_parser("export", help="export a checkpoint as a drafter SGLang/vLLM can load")
    _add_config(p)
    p.add_argument("--checkpoint", default="", help="checkpoint folder (default: latest)")
    p.add_argument("--target", default="",
                   help="target model folder the drafter is checked against: hidden size, vocabulary, layer count "
                        "(default: the config's target; a built-in target is not checked)")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("eval", help="speculative decoding with the drafter: acceptance length, lossless check")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", required=True, help="JSONL chat file or text file, one prompt per line")
    p.add_argument("--block-size", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=0, help="evaluate the first N prompts only")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_main_of("eval"))

    p = sub.add_parser("quantize-fp8", help="write a model's block-wise FP8 checkpoint (e4m3 weights, 128x128 "
                                            "scales), the format of the published FP8 models")
    p.add_argument("--model", required=True, help="model folder, or builtin:tiny-qwen3.5 / builtin:tiny-qwen3")
    p.add_argument("--out", required=True, help="new folder for the FP8 checkpoint")
    p.set_defaults(fn=_main_of("quantize_fp8"))

    p = sub.add_parser("make-toy-target", help="train a tiny Qwen3.5 LM on a structured corpus (a target worth drafting for)")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_main_of("toy_target"))
    return ap


def main(argv: list[str] | None = None) -> int:
    stop_with_launcher()   # first: a service `dfpipe demo` started stops with the demo, however it dies
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:   # torchrun's own arguments, which argparse would take for ours
        from .torchrun import main as torchrun_main
        return torchrun_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        status = int(args.fn(args) or 0)
    except ConfigError as e:
        print(f"dfpipe: config error: {e}", file=sys.stderr)
        status = EXIT_UNTRUSTED if isinstance(e, UntrustedConfig) else EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    if args.fn in (cmd_target_server, cmd_trainer) and "TORCHELASTIC_RUN_ID" not in os.environ:
        # a service as its container's own process: under compose a final status ends it with 0 (a
        # torchrun rank's status is `dfpipe torchrun`'s to pass on: a rank ending with 0 would not stop it)
        status = as_supervised(status, "dfpipe target-server" if args.fn is cmd_target_server else "dfpipe trainer")
    return status


if __name__ == "__main__":
    sys.exit(main())
