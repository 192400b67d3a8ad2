"""Command line: `dfpipe prepare-data`, or `python -m target_server.data`."""
from __future__ import annotations

import argparse
import json
import os
import sys

from common.config import Config, ConfigError, load_config
from target_server.data.prepare import OVERLONG_POLICIES, _tokenizer_for, prepare_data, template_setting
from target_server.data.rows import ROW_FORMATS, DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """prepare-data's options; unset ones come from the config's data section (and target.tokenizer)."""
    parser.add_argument("--input", "--jsonl", dest="input", required=True,
                        help="chat file: .jsonl (one conversation a line) or .parquet (one a row)")
    parser.add_argument("--tokenizer", default="",
                        help="tokenizer folder, the target's (default: the config's target.tokenizer or target.model)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--format", choices=("auto", *ROW_FORMATS), default=None,
                        help="row format: openai (messages), sharegpt (conversations); default data.format, auto: "
                             "detected per file")
    parser.add_argument("--max-len", type=int, default=None, help="longest document in tokens (default data.max_len)")
    parser.add_argument("--overlong", choices=OVERLONG_POLICIES, default=None, help="default data.overlong")
    parser.add_argument("--max-row-bytes", type=int, default=None,
                        help="a larger row (JSONL line, Parquet row) is a bad row, never parsed "
                             "(default data.max_row_bytes)")
    parser.add_argument("--max-bad-share", type=float, default=None, metavar="SHARE",
                        help="stop (exit status 2) when more than this share of the rows is bad; 1 allows any "
                             "(default data.max_bad_share)")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template, a file or inline text; any template works, generation markers "
                             "are not needed (default data.chat_template, else the tokenizer's own)")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                        help='template variables as a JSON object, e.g. \'{"enable_thinking": false}\' '
                             "(default data.chat_template_kwargs)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    """Prepare args.input into args.out; 0, or 2 with the reason on stderr."""
    d = cfg.data
    max_bad_share = d.max_bad_share if args.max_bad_share is None else args.max_bad_share
    try:
        kwargs = d.chat_template_kwargs
        if args.chat_template_kwargs is not None:
            try:
                kwargs = json.loads(args.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise DataError(f"--chat-template-kwargs is not JSON: {e}") from e
        tokenizer_dir = args.tokenizer
        if not tokenizer_dir:
            try:
                tokenizer_dir = _tokenizer_for(cfg)
            except DataError:
                raise DataError("no tokenizer: pass --tokenizer, or a config (-c) whose target.tokenizer or "
                                "target.model folder holds one") from None
        report = prepare_data(args.input, tokenizer_dir, args.out,
                              d.max_len if args.max_len is None else args.max_len, args.overlong or d.overlong,
                              template_setting(cfg) if args.chat_template is None else args.chat_template,
                              kwargs, args.format or d.format,
                              d.max_row_bytes if args.max_row_bytes is None else args.max_row_bytes,
                              max_bad_share)
    except DataError as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    if warning := report.check_bad_share(args.input, max_bad_share):
        print(f"prepare-data: warning: {warning}", file=sys.stderr)
    print(f"wrote {args.out} (bad rows listed in {os.path.join(args.out, 'bad_rows.jsonl')})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tokenize a chat file (JSONL or Parquet) into a prepared folder.")
    add_arguments(parser)
    parser.add_argument("-c", "--config", default="", help="YAML config whose data section gives the defaults")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config or None, args.set)
    except ConfigError as e:
        print(f"prepare-data: config error: {e}", file=sys.stderr)
        return 2
    return run(args, cfg)
