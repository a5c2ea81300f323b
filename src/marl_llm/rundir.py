"""A run dir belongs to one run: a fresh run claims it, and never starts in a dir that holds another.

Light on purpose (no torch): the CLI checks a dir named on its command line before Hydra writes its
own files (.hydra/, the job log) into it.
"""

from __future__ import annotations

import os
from pathlib import Path

RUN_MARKER = ".marl-llm-run"
CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
METRICS = "metrics.jsonl"


def requeued() -> bool:
    """A SLURM job that was requeued (timeout, pre-emption): it resumes without being told."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0


def held(run_dir: Path) -> list[str]:
    """The files that show run_dir holds a run (started, checkpointed or logging)."""
    return [name for name in (RUN_MARKER, CHECKPOINT, PREVIOUS, METRICS) if (run_dir / name).exists()]


def refusal(run_dir: Path, files: list[str]) -> str:
    return (f"{run_dir} already holds a run ({', '.join(files)}): continue it with trainer.resume=true, or start "
            "this one in a new dir (leave hydra.run.dir unset, or name a new one)")


def claim(run_dir: Path, resume: bool) -> str | None:
    """Makes run_dir this run's own: a fresh run creates it with a marker file, exclusively, so
    that it never writes over (or appends to) another run, whether finished, still running, or
    started in the same instant. A resume takes over its dir. Returns why not (None: claimed)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        (run_dir / RUN_MARKER).touch()
        return None
    files = held(run_dir)
    if not files:
        try:  # O_EXCL: of two runs starting here at once, one gets the dir
            os.close(os.open(run_dir / RUN_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return None
        except FileExistsError:
            files = [RUN_MARKER]
    return refusal(run_dir, files)
