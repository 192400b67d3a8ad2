"""`--help` of dfpipe and every subcommand prints and exits 0 (argparse formats help with `%`)."""
from __future__ import annotations

import argparse

import pytest

from dfpipe.cli import build_parser, main


def _subcommands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_the_subcommand_list_is_read_from_the_parser():
    assert {"prepare-data", "target-server", "trainer", "export", "eval"} <= set(_subcommands())


@pytest.mark.parametrize("argv", [[], *[[name] for name in _subcommands()]], ids=lambda a: " ".join(a) or "dfpipe")
def test_help_exits_0_and_prints_usage(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: dfpipe")


def test_prepare_data_module_help_exits_0(capsys):
    from target_server.data import main as prepare_main
    with pytest.raises(SystemExit) as done:
        prepare_main(["--help"])
    assert done.value.code == 0 and "--chat-template-kwargs" in capsys.readouterr().out
