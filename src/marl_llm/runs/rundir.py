"""A run dir belongs to one run: a fresh run claims it, and never starts in a dir that holds another.

Light on purpose (no torch): the CLI checks a dir named on its command line before Hydra writes its
own files (.hydra/, the job log) into it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from marl_llm.config import UserError
from marl_llm.runs.atomic import atomic_write_text

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


RESUMES = "resumes.jsonl"
# What a run started over in its dir (trainer.resume=if_possible, a requeued SLURM job, without a
# checkpoint) would write afresh: the earlier attempt's are moved aside, never cut or overwritten.
ATTEMPT_FILES = (METRICS, "samples.jsonl", "config.yaml", "wandb.json", "summary.json")


def set_aside(run_dir: Path) -> dict[str, str]:
    """Rename the earlier attempt's logs to <stem>.attempt-<k><suffix> (k: 1 for the first
    attempt, one more for each later one); returns {old name: new name}."""
    taken = [int(m.group(1)) for p in run_dir.iterdir() if (m := re.search(r"\.attempt-(\d+)\.", p.name))]
    k = max(taken, default=0) + 1
    moved = {}
    for name in ATTEMPT_FILES:
        path = run_dir / name
        if path.exists():
            aside = f"{path.stem}.attempt-{k}{path.suffix}"
            os.replace(path, run_dir / aside)
            moved[name] = aside
    return moved


def record(run_dir: Path, entry: dict[str, Any]) -> None:
    """Append one line to the run dir's resumes.jsonl, atomically: a kill leaves the old file or the new one."""
    path = run_dir / RESUMES
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    atomic_write_text(path, before + json.dumps({"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                                 **entry}) + "\n")


class Interrupted(Exception):
    """Ctrl-C (SIGINT) stopped a run: the one line to print (where it got to and how to go on),
    and whether this process prints it (data-parallel rank 0)."""

    def __init__(self, line: str, main: bool = True):
        super().__init__(line)
        self.main = main


def run_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides of this run: Hydra's record of the running job, else the run
    dir's .hydra/overrides.yaml; None when neither exists (a run started from Python)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001  (no Hydra context)
        pass
    saved = run_dir / ".hydra" / "overrides.yaml"
    if saved.is_file():
        import yaml

        return [str(o) for o in yaml.safe_load(saved.read_text()) or []]
    return None


def resume_command(run_dir: Path, resume: str = "true") -> str:
    """The command that continues this run in its dir: its own overrides (less any run dir or
    trainer.resume), then hydra.run.dir=<run_dir> trainer.resume=<resume>."""
    overrides = run_overrides(run_dir)
    if overrides is None:
        return f"marl-llm <the run's overrides> hydra.run.dir={shlex.quote(str(run_dir))} trainer.resume={resume}"
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    kept = [o for o, k in zip(overrides, keys) if k not in ("trainer.resume", "hydra.run.dir")]
    where = [] if "run_dir" in keys else [f"hydra.run.dir={run_dir}"]
    return " ".join(["marl-llm", *(shlex.quote(a) for a in [*kept, *where, f"trainer.resume={resume}"])])


def resume_mode(cfg: Any) -> str:
    """trainer.resume as "off", "on" (continue from the run dir's checkpoint; none is an error) or
    "if_possible" (without a checkpoint, start over in the dir). A SLURM job that was requeued
    (timeout, pre-emption) resumes if possible without being told: it may have been stopped
    before its first checkpoint."""
    value = cfg.trainer.resume
    modes = {"false": "off", "true": "on", "if_possible": "if_possible"}
    mode = modes.get(str(value).lower()) if isinstance(value, (bool, str)) else None
    if mode is None:
        raise UserError(f"trainer.resume={value} is not a choice: true (continue the run in hydra.run.dir), "
                        "if_possible (continue, or start over there when it has no checkpoint) or false")
    return "if_possible" if requeued() else mode


@dataclass
class Progress:
    """How far a run has got: what an interrupted run reports."""

    run_dir: Path | None = None  # set once the run dir is this run's
    step: int = 0
    max_steps: int = 0
    checkpoint: tuple[int, str] | None = None  # (step, file) of the last checkpoint written or resumed from
    main: bool = True


def interrupted_line(progress: Progress) -> str:
    """Where a Ctrl-C'd run stopped and the command that goes on from there."""
    run_dir = progress.run_dir.resolve()
    reached = f"interrupted at step {progress.step}/{progress.max_steps}"
    if progress.checkpoint is None:  # trainer.resume=true would refuse: nothing to continue from
        return (f"{reached}, no checkpoint yet; start it over in its dir (its logs are kept aside) with: "
                f"{resume_command(run_dir, 'if_possible')}")
    step, path = progress.checkpoint
    return (f"{reached}, last checkpoint {path} (step {step}); continue with: "
            f"{resume_command(run_dir, 'true')}")
