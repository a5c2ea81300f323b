"""A `marl-llm` command refused before its run started (a bad value that only validation sees, a
model path that is no checkpoint, a Ctrl-C while the model loads) takes back the run dir it made,
so failed commands leave no dir that holds nothing but Hydra's record of a run that never was.

Taken back is only what this command made and wrote, and only while nothing else is there:

- `RecordNewRunDir` (a Hydra callback, added by cli/train.py for a single run) notes, before Hydra
  makes the job's dir, which dirs of its path do not exist yet: those are this command's own. A
  dir that existed before (named with hydra.run.dir=) is never removed, nor are its parents.
- `take_back` removes the files Hydra and the run wrote there before the run started (.hydra/'s
  three YAML files, the job log cli.log, the run lock) and then, with rmdir, the dirs noted,
  deepest first, each only when empty. Any other file (a run's marker, metrics, checkpoints, a
  user's file, a W&B dir) keeps the dir and everything in it as it is; a dir whose lock another
  process holds is left alone.

Sweeps (-m) and runs under torchrun / accelerate launch keep their dirs: their jobs' and ranks'
dirs are shared and made concurrently.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

# The dirs this command makes for its job's run dir, the run dir first (empty: none, or not known).
_MADE: list[Path] = []

HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
JOB_LOG = "cli.log"  # configure.JOB_LOGGING's file
CALLBACK = "marl_llm_new_run_dir"
OVERRIDE = f"+hydra.callbacks.{CALLBACK}._target_={__name__}.RecordNewRunDir"


class RecordNewRunDir(Callback):
    """Before Hydra makes the run dir (run_job), note which dirs of its path are new. Hydra's
    `${now:...}` is resolved once per config (cached), so the path read here is the one made."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        _MADE.clear()
        try:
            path = Path(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir"))))  # as run_job makes it
        except Exception:  # noqa: BLE001  (a dir this cannot resolve is never taken back)
            return
        for p in (path, *path.parents):
            if os.path.lexists(p):
                break
            _MADE.append(p)


def take_back(output_dir: str | None = None) -> None:
    """Remove the run dir this command made, and the parents it made, when it holds only what
    the command wrote before its run started (module docstring). `output_dir`: the job's dir
    (default: Hydra's, hydra.runtime.output_dir); nothing is removed unless it is the dir noted.
    Never raises."""
    if not _MADE:
        return
    with contextlib.suppress(Exception):
        if output_dir is None:
            from hydra.core.hydra_config import HydraConfig

            output_dir = HydraConfig.get().runtime.output_dir
        if Path(os.path.abspath(output_dir)) == _MADE[0]:
            _take_back(_MADE[0])
    _MADE.clear()


def _take_back(run_dir: Path) -> None:
    from marl_llm.runs.rundir import LOCK

    if run_dir.is_symlink() or not run_dir.is_dir():
        return
    hydra_dir = run_dir / ".hydra"
    ours = {".hydra", JOB_LOG, LOCK}
    if set(os.listdir(run_dir)) - ours:
        return
    if hydra_dir.exists() and (hydra_dir.is_symlink() or not hydra_dir.is_dir()
                               or set(os.listdir(hydra_dir)) - set(HYDRA_FILES)):
        return
    lock = None
    if (run_dir / LOCK).exists():  # a run that took the dir since (it would have written its marker too)
        lock = os.open(run_dir / LOCK, os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            return
    try:
        _close_logs_in(run_dir)
        for name in HYDRA_FILES:
            (hydra_dir / name).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            hydra_dir.rmdir()
        for name in (JOB_LOG, LOCK):
            (run_dir / name).unlink(missing_ok=True)
    finally:
        if lock is not None:
            os.close(lock)
    for made in _MADE:  # deepest first; rmdir refuses a dir that is not empty
        try:
            made.rmdir()
        except OSError:
            return


def _close_logs_in(run_dir: Path) -> None:
    """Close the job log's handler (Hydra's job logging writes cli.log there) before it is removed."""
    for handler in list(logging.getLogger().handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir:
            logging.getLogger().removeHandler(handler)
            handler.close()
