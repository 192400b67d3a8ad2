"""`dfpipe torchrun ARGS`: torchrun with the same arguments, ending with a trainer rank's own exit
status when it is one the deployments must not restart (drafter_trainer.train.FINAL_EXITS: 2-7).

torchrun exits 1 whenever a worker fails, whatever the worker's status, so under a bare torchrun
systemd's RestartPreventExitStatus never sees a 4 (checkpoints keep failing) or a 7 (no checkpoint
verifies) and restarts the trainer into the same failure. The systemd unit and the compose shapes
run the trainer through this instead; every other outcome is torchrun's own.
"""
from __future__ import annotations

import os
import sys

# Set by the compose files: end with 0 on a final status (Docker cannot be told which statuses not
# to restart; systemd can: RestartPreventExitStatus).
FINAL_AS_SUCCESS = "DFPIPE_FINAL_EXIT_AS_SUCCESS"


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
        from drafter_trainer.train import FINAL_EXITS
        final = sorted({f.exitcode for f in e.failures.values()} & set(FINAL_EXITS))
        if not final:
            return 1
        if os.environ.get(FINAL_AS_SUCCESS) == "1":
            # Docker's on-failure restarts every non-zero status: a final one ends the container
            # with 0 instead, this line and the rank's log saying why
            print(f"dfpipe torchrun: a trainer rank exited with status {final[0]} (restarting would not help: its "
                  f"log says why); ending with 0 so that the container is not restarted ({FINAL_AS_SUCCESS})",
                  file=sys.stderr)
            return 0
        print(f"dfpipe torchrun: a trainer rank exited with status {final[0]} (restarting would not help: "
              "its log says why); passing it on", file=sys.stderr)
        return final[0]
    return 0
