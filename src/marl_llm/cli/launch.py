"""The `marl-llm` console script's and `python -m marl_llm`'s first lines: a Ctrl-C from here until a
run claims its dir ends the process with one line and the shell's 130, wherever it lands.

Why not a KeyboardInterrupt: one raised while Hydra imports or omegaconf builds the config schemas
can be caught by their own cleanup, which then fails on the half-built state with another
exception and a traceback (seen: omegaconf's `_invalidate_flags_cache` on None). Nothing is open
before the run claims its dir, so exiting at once loses nothing; the run then handles Ctrl-C itself
(runs/rundir.py), and this handler is back when it ends.
"""

from __future__ import annotations

import os
import signal
import sys

from marl_llm.runs import NOT_STARTED  # light: the handler must import nothing (an import it interrupts
#                                        may be half done: omegaconf's, seen)


def _before_the_run(signum, frame) -> None:
    sys.stderr.write(NOT_STARTED + "\n")  # one write: ranks share the pipe (config.print_stderr_line)
    sys.stderr.flush()
    os._exit(130)  # 128 + SIGINT, as a shell reports it


def main() -> None:
    signal.signal(signal.SIGINT, _before_the_run)
    from marl_llm.cli.train import main as train_main  # Hydra, omegaconf, the schemas: seconds

    train_main()
