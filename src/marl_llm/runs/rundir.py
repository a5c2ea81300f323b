"""A run dir belongs to one run: a fresh run claims it, and never starts in a dir that holds another.

While a run lives it holds an exclusive `flock` on an open descriptor of the run dir itself (the
kernel drops it when the process dies, however it dies), so a second writer (two resumes at once,
a resume while the run goes on) is refused in one line. The lock is the directory's, not a file's
existence: deleting or replacing `<run_dir>/.marl-llm-lock` (which says who holds the dir, and is
flocked too, as older marl-llm versions lock it) lets no second writer in. That file is opened
without following a link and used only when it is a plain file of its own, so a link or hard link
planted there (to any file the user can write) is refused, never truncated. A run refused before
it started (a bad data file, model path or LoRA target) gives its claim back, so the corrected
command runs in the same dir.

Light on purpose (no torch): the CLI checks a dir named on its command line before Hydra writes its
own files (.hydra/, the job log) into it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import sys
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from marl_llm.config import UserError
from marl_llm.runs.atomic import atomic_write_text

RUN_MARKER = ".marl-llm-run"
LOCK = ".marl-llm-lock"
CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
METRICS = "metrics.jsonl"
# What an interrupted atomic write leaves: atomic.py's `.<name>.<8 random chars>.tmp` files and
# export.py's `.agents.tmp-<random>` dirs.
LEFTOVER = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$|^\.agents\.tmp-[a-z0-9_]{8}$")

log = logging.getLogger("marl_llm")


def _restart_count() -> int:
    """How often SLURM has requeued this job (SLURM_RESTART_COUNT; 0 outside SLURM)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def requeued() -> bool:
    """A SLURM job that was requeued (timeout, pre-emption): it resumes without being told."""
    return _restart_count() > 0


def slurm_attempt() -> dict[str, Any]:
    """What a resume record says of the SLURM job it runs in: {"slurm": {"job_id": "<array>_<index>"
    (or the plain id), "restart_count": n}}, n > 0 for a requeued job; {} outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array}_{index}" if array and index else job
    return {"slurm": {"job_id": job_id, "restart_count": _restart_count()}}


def held(run_dir: Path) -> list[str]:
    """The files that show run_dir holds a run (started, checkpointed or logging)."""
    return [name for name in (RUN_MARKER, CHECKPOINT, PREVIOUS, METRICS) if (run_dir / name).exists()]


def refusal(run_dir: Path, files: list[str], sweep_dir: Path | None = None) -> str:
    """Why a fresh run may not start in run_dir, and the command that works: resume=true where
    there is a checkpoint to continue, if_possible where there is none (true would refuse)."""
    if sweep_dir is not None:  # a relaunched sweep: every job, not only this one, must go on
        return (f"{run_dir} already holds a run ({', '.join(files)}): to continue the whole sweep, run the same "
                f"command with hydra.sweep.dir={sweep_dir} trainer.resume=if_possible (each job continues "
                "from its checkpoint, starts over without one, and a finished job is skipped), or give it a new "
                "hydra.sweep.dir")
    how = ("continue it with trainer.resume=true" if CHECKPOINT in files or PREVIOUS in files else
           "it has no checkpoint: start it over there with trainer.resume=if_possible (its logs are kept aside)")
    return f"{run_dir} already holds a run ({', '.join(files)}): {how}, or start this one in a new dir " \
           "(leave hydra.run.dir unset, or name a new one)"


@dataclass
class _Lock:
    """The descriptors whose flocks hold a run dir: the dir's own (None where the file system cannot
    lock a directory) and its lock file's (which also says who holds it)."""

    dir_fd: int | None
    file_fd: int

    def close(self) -> None:
        for fd in (self.file_fd, self.dir_fd):
            if fd is not None:
                os.close(fd)  # its lock goes with it


# The run dirs this process holds: {resolved dir: (its lock, whether its claim made the marker)}.
_CLAIMS: dict[str, tuple[_Lock | None, bool]] = {}
# flock's errors where a file system has no locks (some network mounts), or none on directories (NFS: EBADF).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


class _Refused(Exception):
    """Why a run dir cannot be locked (one line)."""


def _flock(fd: int) -> bool | None:
    """Take fd's exclusive lock: True, False (another process holds it) or None (not supported here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        return None
    return True


def _open_lock_file(run_dir: Path, create: bool) -> int | None:
    """The lock file's descriptor (None: there is none and `create` is false). Opened without
    following a link and kept only when it is a plain file with no other name: a symbolic or hard
    link planted there would have the run truncate (and write into) whatever it points to."""
    path = run_dir / LOCK
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fix = f"remove it (rm {shlex.quote(str(path))}; marl-llm makes its own) and run again"
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        if err.errno == errno.ENOENT and not create:
            return None
        if err.errno == errno.ELOOP:
            with contextlib.suppress(OSError):
                fix = f"to {os.readlink(path)}: marl-llm never follows it; {fix}"
            raise _Refused(f"{path} is a symbolic link ({fix})") from None
        raise _Refused(f"{path} cannot be opened as marl-llm's lock file ({err.strerror}): {fix}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = (f"a hard link (one of {st.st_nlink} names of a file)" if stat.S_ISREG(st.st_mode) else
                "no plain file")
        raise _Refused(f"{path} is {what}, never marl-llm's lock file: {fix}")
    return fd


def _busy(run_dir: Path) -> str:
    holder = "another process"
    with contextlib.suppress(OSError, _Refused):
        fd = _open_lock_file(run_dir, create=False)
        if fd is not None:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or holder
            os.close(fd)
    return (f"{run_dir} is in use: a marl-llm run ({holder}) is writing to it now; a second writer would mix its "
            "logs and checkpoints into that run's. Wait for that run to end (or stop it), then run this command "
            "again, or start this one in a new dir (leave hydra.run.dir unset)")


def _lock(run_dir: Path, create: bool = True) -> tuple[_Lock | None, str | None]:
    """(the run dir's lock, None), or (None, why not). A file system without locks (some network
    mounts) is run on unlocked, with a warning: (None, None). create=False (a probe): a dir
    without a lock file is locked by its directory alone, and nothing is written."""
    dir_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # not inherited by exec'd children
    dir_locked = _flock(dir_fd)
    if not dir_locked:
        os.close(dir_fd)
        if dir_locked is False:
            return None, _busy(run_dir)
        dir_fd = None
    try:
        file_fd = _open_lock_file(run_dir, create)
    except _Refused as why:
        if dir_fd is not None:
            os.close(dir_fd)
        return None, str(why)
    lock = _Lock(dir_fd, file_fd) if file_fd is not None else None
    file_locked = _flock(file_fd) if file_fd is not None else None
    if file_locked is False:  # a marl-llm from before directory locks holds it
        if lock is not None:
            lock.close()
        return None, _busy(run_dir)
    if dir_locked is None and file_locked is None:
        if lock is not None:
            lock.close()
        if create:
            log.warning(f"warning: {run_dir} cannot be locked: nothing stops a second run from writing into it while "
                        "this one runs")
        return None, None
    if lock is None:  # a probe of a dir without a lock file: its directory lock alone
        os.close(dir_fd)
    return lock, None


def in_use(run_dir: Path) -> str | None:
    """Why run_dir is taken by a live run right now (its lock is held, or its lock file is a link),
    or None. Takes nothing, writes nothing."""
    if not run_dir.is_dir():
        return None
    lock, why = _lock(run_dir, create=False)
    if lock is not None:
        lock.close()
    return why


def claim(run_dir: Path, resume: bool, sweep_dir: Path | None = None) -> str | None:
    """Makes run_dir this run's own for as long as the process lives (`release` gives it back):
    its lock, then, for a fresh run, a marker file made exclusively, so that it never writes over
    (or appends to) another run, whether finished, still running, or started in the same instant.
    A resume takes over its dir. Temp files that an interrupted save left behind are removed.
    Returns why not (None: claimed). `sweep_dir`: the run is a job of that sweep (the advice)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    key = str(run_dir.resolve())
    if key in _CLAIMS:
        return f"{run_dir} is in use by another run of this process"
    lock, why = _lock(run_dir)
    if why:
        return why
    made_marker = False
    if resume:
        try:  # its marker, never following a link planted in its place (nothing is written to it)
            os.close(os.open(run_dir / RUN_MARKER, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644))
        except OSError as err:
            if lock is not None:
                lock.close()
            what = "is a symbolic link: marl-llm never follows it" if err.errno == errno.ELOOP else \
                f"cannot be marl-llm's run marker ({err.strerror})"
            return f"{run_dir / RUN_MARKER} {what}; remove it and run again"
    else:
        files = held(run_dir)
        if not files:
            try:  # O_EXCL: of two runs starting here at once, one gets the dir
                os.close(os.open(run_dir / RUN_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                made_marker = True
            except FileExistsError:
                files = [RUN_MARKER]
        if files:
            if lock is not None:
                lock.close()
            return refusal(run_dir, files, sweep_dir)
    if lock is not None:  # who holds it, for the refusal of a second writer (a plain file of its own: _open_lock_file)
        os.ftruncate(lock.file_fd, 0)
        os.pwrite(lock.file_fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _CLAIMS[key] = (lock, made_marker)
    remove_leftovers(run_dir)
    return None


def release(run_dir: Path, started: bool) -> None:
    """Give run_dir back (its lock). A fresh run that never started (refused while it was being
    built, or stopped before its first step) also takes back its marker and config.yaml, so the
    same command, corrected, can start there."""
    lock, made_marker = _CLAIMS.pop(str(run_dir.resolve()), (None, False))
    if made_marker and not started:
        for name in (RUN_MARKER, "config.yaml"):
            (run_dir / name).unlink(missing_ok=True)
    if lock is not None:
        lock.close()


def remove_leftovers(run_dir: Path) -> None:
    """Remove the temp files and dirs of writes that a kill interrupted (a checkpoint's can be
    tens of MB), saying how much; the lock guarantees no live run is writing them."""
    removed, size = [], 0
    for p in run_dir.iterdir():
        if not LEFTOVER.match(p.name):
            continue
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                size += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                shutil.rmtree(p)
            else:
                size += p.lstat().st_size
                p.unlink()
            removed.append(p.name)
    if removed:
        log.info(f"removed {len(removed)} temp file(s) that an interrupted save left in {run_dir} "
                 f"({size / 2**20:.1f} MiB): {', '.join(sorted(removed))}")


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
    started: bool = False  # past building: the run logs, a Ctrl-C has something to continue
    claimed: bool = False  # this process holds the run dir (rank 0): released when the run ends


def sweep_dir() -> Path | None:
    """The sweep dir when this run is a job of a Hydra sweep (-m), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        return Path(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else None
    except Exception:  # noqa: BLE001  (no Hydra context: the Python API)
        return None


SUMMARY = "summary.json"


def finished(run_dir: Path, step: int, max_steps: int) -> bool:
    """The run in run_dir trained all its steps and wrote its summary (a relaunched sweep skips it)."""
    return step >= max_steps and (run_dir / SUMMARY).is_file()


def finished_value(run_dir: Path) -> float:
    """What `train` returned for the finished run (its summary's last held-out result)."""
    try:
        summary = json.loads((run_dir / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0.0
    final = summary.get("after") or summary.get("before") or {}
    return float(final.get("pass@1", final.get("reward", 0.0)))


def disk_full_line(err: OSError, progress: Progress) -> str | None:
    """A write that failed for want of space, as one line: where, that nothing was lost (every
    write is atomic or an append that a resume cuts back), and the command that goes on; None for
    any other error."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = Path(err.filename) if err.filename else progress.run_dir
    what = "quota exceeded" if err.errno == errno.EDQUOT else "disk full"
    free = ""
    with contextlib.suppress(OSError, TypeError):
        free = f" ({shutil.disk_usage(where if where.exists() else where.parent).free / 2**20:.0f} MiB free there)"
    if progress.run_dir is None or not progress.started:
        return f"{what}: writing {where} failed{free}; nothing was trained yet: free space, then run the same command"
    run_dir = progress.run_dir.resolve()
    checkpoint = next((run_dir / n for n in (CHECKPOINT, PREVIOUS) if (run_dir / n).exists()), None)
    if checkpoint is None:
        return (f"{what}: writing {where} failed{free}; the run stopped at step {progress.step} before its first "
                f"checkpoint; free space, then start it over with: {resume_command(run_dir, 'if_possible')}")
    step = f" (step {progress.checkpoint[0]})" if progress.checkpoint and Path(progress.checkpoint[1]).resolve() == checkpoint \
        else ""
    return (f"{what}: writing {where} failed{free}; nothing was lost: {checkpoint}{step} is intact (a half-written "
            f"file is removed, and a resume repeats the steps after that checkpoint); free space, then continue with: "
            f"{resume_command(run_dir, 'true')}")


def non_finite(metrics: dict[str, float]) -> dict[str, float]:
    """The step's losses and gradient norms that are not finite numbers (NaN, inf)."""
    return {k: v for k, v in metrics.items() if (k.rsplit("/", 1)[-1] == "grad_norm" or k.endswith("loss"))
            and isinstance(v, (int, float)) and not math.isfinite(v)}


def last_checkpoint(progress: Progress) -> tuple[int, str] | None:
    """(step, file) of the run's last checkpoint that still exists: one that a save in progress
    moved aside is checkpoint.prev.pt now."""
    checkpoint = progress.checkpoint
    if checkpoint is not None and not Path(checkpoint[1]).exists():
        run_dir = progress.run_dir.resolve()
        checkpoint = (checkpoint[0], str(run_dir / PREVIOUS)) if (run_dir / PREVIOUS).exists() else None
    return checkpoint


def non_finite_line(progress: Progress, broken: dict[str, float]) -> str:
    """Why a run stopped at a non-finite loss or gradient, what it kept, and what to change."""
    team = {k: v for k, v in broken.items() if "/" not in k}  # the team's, when the agents' are alike
    what = ", ".join(f"{k}={v}" for k, v in (team or broken).items())
    checkpoint = last_checkpoint(progress)
    kept = (f"its last checkpoint, {checkpoint[1]} (step {checkpoint[0]}), is kept as it was" if checkpoint else
            "it had written no checkpoint yet")
    return (f"step {progress.step}/{progress.max_steps}: {what}: the run stopped before a save or export could keep "
            f"non-finite weights; {kept}. Usual causes: too high an algo.learning_rate, no algo.max_grad_norm, rewards "
            "of extreme size; change the setting and start a new run dir")


def interrupted_line(progress: Progress) -> str:
    """Where a Ctrl-C'd run stopped and the command that goes on from there."""
    if progress.run_dir is None or not progress.started:
        return NOT_STARTED
    run_dir = progress.run_dir.resolve()
    reached = f"interrupted at step {progress.step}/{progress.max_steps}"
    checkpoint = last_checkpoint(progress)  # stopped between the renames of a save: checkpoint.prev.pt
    if checkpoint is None:  # trainer.resume=true would refuse: nothing to continue from
        return (f"{reached}, no checkpoint yet; start it over in its dir (its logs are kept aside) with: "
                f"{resume_command(run_dir, 'if_possible')}")
    step, path = checkpoint
    return (f"{reached}, last checkpoint {path} (step {step}); continue with: "
            f"{resume_command(run_dir, 'true')}")


from marl_llm.runs import NOT_STARTED  # noqa: E402  (the line lives with the package: cli/launch.py reads it light)


@contextlib.contextmanager
def interrupt_handling(progress: Progress) -> Iterator[None]:
    """Ctrl-C while a run lives: the first raises KeyboardInterrupt (the run closes its loggers and
    says where it stopped); a second one, during that cleanup, ends the process at once with the
    same one line and the shell's 130 (128 + SIGINT). Outside the main thread: Python's own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []

    def on_sigint(signum: int, frame: Any) -> None:
        pressed.append(signum)
        if len(pressed) == 1:
            raise KeyboardInterrupt
        if progress.main:
            print(interrupted_line(progress), file=sys.stderr, flush=True)
        os._exit(130)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
