"""What a sweep's launching process prints about its SLURM jobs (`-m hydra/launcher=slurm`).

submitit polls `sacct` for the jobs' states while the sweep waits. Where sacct fails (SLURM
accounting storage disabled, a login node without it), every poll printed sacct's own error, then
submitit's warning three times: through its stdout handler, its stderr handler and Hydra's root
logger (submitit issue #1720). `quiet_submitit` makes that one line, once, in this process only
(the jobs' own logs are left as submitit writes them): each submitit message goes to one stream,
and the first sacct failure is said with sacct's error; later polls' failures are not repeated.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys

SACCT_FAILED = "Bypassing sacct error"


class SacctFailedOnce(logging.Filter):
    """Lets the first of submitit's sacct warnings through, rewritten to say what it means; drops the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False
        self.stderr = ""  # sacct's own error, kept by CapturedSacctStderr

    def filter(self, record: logging.LogRecord) -> bool:
        if SACCT_FAILED not in record.getMessage():
            return True
        if self.said:
            return False
        self.said = True
        why = self.stderr or record.getMessage()
        record.msg = (f"sacct failed ({why}): submitit cannot read the jobs' states from SLURM accounting and waits "
                      "for their result files instead (said once, not at every poll)")
        record.args = ()
        return True


class CapturedSacctStderr:
    """Stands in for the `subprocess` module inside submitit.core.core: sacct's stderr is captured
    (kept for the one line above) instead of printed at every poll; every other call is unchanged."""

    def __init__(self, once: SacctFailedOnce) -> None:
        self.once = once

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    def check_output(self, command, *args, **kwargs):
        if list(command)[:1] != ["sacct"] or "stderr" in kwargs:
            return subprocess.check_output(command, *args, **kwargs)
        try:
            return subprocess.check_output(command, *args, stderr=subprocess.PIPE, **kwargs)
        except subprocess.CalledProcessError as err:
            self.once.stderr = " ".join((err.stderr or b"").decode(errors="replace").split())
            raise


@functools.cache
def quiet_submitit() -> None:
    """In the process that launches a sweep: one line per submitit message, the sacct failure
    once (see the module's docstring). Nothing happens without the `slurm` extra."""
    try:
        from submitit.core import core
        from submitit.core import logger as submitit_logger
    except ImportError:
        return
    log = submitit_logger.get_logger()
    log.propagate = False  # Hydra's root handler printed a third copy
    for handler in log.handlers:  # submitit's: warnings to stderr and, again, everything to stdout
        if getattr(handler, "stream", None) is sys.stdout:
            handler.addFilter(lambda record: record.levelno < logging.WARNING)
    once = SacctFailedOnce()
    log.addFilter(once)
    core.subprocess = CapturedSacctStderr(once)  # type: ignore[attr-defined]
