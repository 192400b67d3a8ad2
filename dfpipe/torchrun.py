"""`dfpipe torchrun ARGS`: torchrun with the same arguments, ending with a trainer rank's own exit
status when it is one the deployments must not restart (common.exits.FINAL_EXITS).

torchrun exits 1 whenever a worker fails, whatever the worker's status, so under a bare torchrun
systemd's RestartPreventExitStatus never sees a 4 (out_dir cannot be written) or a 7 (no checkpoint
verifies) and restarts the trainer into the same failure. The systemd unit and the compose shapes
run the trainer through this instead; every other outcome is torchrun's own. Under compose
(FINAL_AS_SUCCESS=1) a final status ends it with 0 (`common.exits.as_supervised`).
"""
from __future__ import annotations

import sys

from common.exits import EXIT_FAILED, EXIT_OK, FINAL_EXITS, as_supervised


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun

    if "-h" in argv or "--help" in argv:   # torchrun's own help, under our name (its main swallows the exit)
        parser = get_args_parser()
        parser.prog = "dfpipe torchrun"
        parser.parse_args(argv)
    try:
        torchrun(argv)
    except ChildFailedError as e:
        final = sorted({f.exitcode for f in e.failures.values()} & FINAL_EXITS)
        if not final:
            return EXIT_FAILED
        status = as_supervised(final[0], "dfpipe torchrun: a trainer rank")
        if status == final[0]:
            print(f"dfpipe torchrun: a trainer rank exited with status {status} (restarting would not help: "
                  f"its log says why); passing it on", file=sys.stderr)
        return status
    return EXIT_OK

