"""`--help` of dfpipe and every subcommand prints and exits 0 (argparse formats help with `%`)."""
from __future__ import annotations

import argparse

import pytest

from dfpipe.cli import build_parser, main
from machine_speed import scaled


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


def test_the_services_command_line_needs_no_http_client():
    """The GPU hosts run the services from a minimal set of wheels: building the parser (every
    subcommand's, `regenerate` included) must not import httpx2, which only `regenerate` uses."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys; sys.modules['httpx2'] = None\n"
            "from dfpipe.cli import build_parser\n"
            "build_parser().parse_args(['trainer', '-c', ''])\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=scaled(120),
                          env={**os.environ, "PYTHONPATH": repo})
    assert done.returncode == 0, done.stderr[-2000:]
