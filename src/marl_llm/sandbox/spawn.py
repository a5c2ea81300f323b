"""One sandbox run, the trainer's side: give the run its cgroups and work dir, fork its judge from
the zygote with the judge's config and pipes, feed it the job, collect the verdict records and the
candidate's output under the time limits, end the judge, and leave nothing behind. What comes back
is raw (`RawRun`); runner.py turns it into a TestOutcome."""

from __future__ import annotations

import logging
import os
import selectors
import tempfile
import time
from dataclasses import dataclass

from marl_llm.sandbox import isolation
from marl_llm.sandbox.limits import NOBODY, SandboxLimits
from marl_llm.sandbox.zygote import Judge, track, untrack, zygote

log = logging.getLogger(__name__)

_MAX_RESULT_BYTES = 1 << 20  # the judge's records (it is trusted; this only bounds a bug)
_EXIT_GRACE_S = 0.25  # after the judge exits, how long to wait for the candidate's pipes
# Output past its cap is not read into the trainer: the pipe is emptied into /dev/null in the
# kernel (splice) at most every _DRAIN_EVERY_S, a pipe's worth (_PIPE_BYTES) at a time, so a flood
# costs the trainer a few syscalls a second whatever its rate (it had cost 2.15 CPU-seconds per
# 10 s of flood, reading 64 KiB at a time), and a program that prints a lot still runs to its end,
# at up to _PIPE_BYTES / _DRAIN_EVERY_S (the pipe's size, 1 MiB where the kernel allows it).
_DRAIN_EVERY_S = 0.05
_PIPE_BYTES = 1 << 20


@dataclass
class RawRun:
    """What a run left: the judge's records (split into fields), the candidate's output and how the
    run ended."""

    records: list[list[bytes]]
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    judge_stderr: bytes
    killed: str | None  # "wall" / "stall" when the trainer killed the run for time
    oom: bool = False


def _judge_config(limits: SandboxLimits, cgroup: isolation.RunCgroup | None, workdir: str | None) -> dict:
    root = os.geteuid() == 0
    process_mode = limits.isolation == "process"
    lay = isolation.layout()
    # Many tasks only where the run's cgroups cap them all, memory and CPU; else a single task.
    single_task = cgroup is None or not cgroup.cpu_limited
    abi = isolation.landlock_abi() if process_mode else 0
    return {
        "mode": limits.isolation,
        "ids": [NOBODY, NOBODY] if root else [os.geteuid(), os.getegid()],
        "binds": [] if process_mode else [list(b) for b in lay.binds],
        "symlinks": [] if process_mode else [list(s) for s in lay.symlinks],
        "masks": [] if process_mode else list(lay.masks),
        "tmp_bytes": int(limits.tmp_mb) << 20,
        "tmp_inodes": int(limits.tmp_inodes),
        "cgroup_procs": cgroup.procs_files if cgroup else [],
        "cgroups": cgroup.paths if cgroup else [],
        # C, the namespace keeper, is a task of the same user namespace: +1.
        "max_tasks": (1 if single_task else int(limits.max_procs)) + 1,
        "single_task": single_task,
        "limits": {"as": int(limits.memory_mb) << 20, "cpu": int(limits.total_s()) + 1,
                   "fsize": int(limits.max_file_mb) << 20, "nofile": 256,
                   # process mode: RLIMIT_NPROC counts all of the user's processes: 1 means no fork
                   "nproc": 1 if process_mode else None},
        "judge_limits": {"as_extra": int(limits.memory_mb) << 20, "cpu": int(limits.total_s()) + 2},
        "workdir": workdir or "",
        "drop_to": NOBODY if root and process_mode else -1,
        "preimport": list(_PREIMPORT),
        "seccomp": isolation.seccomp_available(),
        "landlock_abi": abi,
        "landlock_rules": [list(r) for r in isolation.landlock_rules(lay)] if abi else [],
    }


# Imported before the uid drop in process mode as root (the stdlib may be unreadable to nobody).
_PREIMPORT = ("abc", "array", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal",
              "enum", "fractions", "functools", "hashlib", "heapq", "itertools", "math", "numbers", "operator",
              "random", "re", "statistics", "string", "struct", "textwrap", "typing", "unicodedata")


def _protect_the_trainer(limits: SandboxLimits) -> None:
    """Process mode as an ordinary user on a kernel without Landlock: the candidate shares our uid
    and can reach /proc, so the trainer makes itself undumpable (its memory and fds, which hold
    the verdicts, out of the candidate's reach; debuggers cannot attach to it either)."""
    global _trainer_protected
    if (limits.isolation == "process" and not _trainer_protected and os.geteuid() != 0
            and isolation.landlock_abi() == 0):
        isolation.set_dumpable(False)
        _trainer_protected = True


_trainer_protected = False


def run_judge(payload: bytes, limits: SandboxLimits) -> RawRun:
    """Run one job (`payload`, the JSON the judge reads) under `limits`."""
    _protect_the_trainer(limits)
    cgroup = None
    base = isolation.cgroup_base() if limits.isolation == "namespaces" else None
    if base is not None:
        try:
            cgroup = isolation.RunCgroup(base, (int(limits.memory_mb) + int(limits.tmp_mb)) << 20)
        except OSError as e:
            log.warning("sandbox: no cgroup for this run (%s); the candidate gets a single task", e)
    workdir = None
    if limits.isolation == "process":
        sweep_stale_workdirs()
        workdir = tempfile.mkdtemp(prefix=f"marl-sandbox-{os.getpid()}-")
    # control (job in, and closed to end the judge), results, candidate stdout/stderr, judge stderr
    pipes = [os.pipe() for _ in range(5)]
    _pipe_size([pipes[2][0], pipes[3][0]])
    theirs = [pipes[0][0]] + [w for _, w in pipes[1:]]
    ours = [pipes[0][1]] + [r for r, _ in pipes[1:]]
    judge: Judge | None = None
    try:
        if workdir and os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        _, pidfd = zygote.spawn(_judge_config(limits, cgroup, workdir), theirs)
        for fd in theirs:
            os.close(fd)
        theirs = []
        judge = Judge(ours[0], pidfd)
        track(judge)
        raw = _drive(judge, *ours[1:], len(payload).to_bytes(4, "big") + payload, limits)
        if cgroup is not None:
            raw.oom = cgroup.oom_killed()
        return raw
    finally:
        if judge is not None:
            judge.end()
            untrack(judge)
        elif ours:
            os.close(ours[0])
        for fd in theirs + ours[1:]:
            try:
                os.close(fd)
            except OSError:
                pass
        if cgroup is not None:
            cgroup.remove()
        if workdir is not None:
            _remove_workdir(workdir)


def _drive(judge: Judge, res_fd: int, out_fd: int, err_fd: int, jerr_fd: int, payload: bytes,
           limits: SandboxLimits) -> RawRun:
    """Feed the job, collect the pipes under the time limits; end the judge on a time limit.
    The judge has ended when its result pipe and stderr reach end of file."""
    sel = selectors.DefaultSelector()
    in_fd = judge.control_w
    for fd in (in_fd, res_fd, out_fd, err_fd, jerr_fd):
        os.set_blocking(fd, False)
    sel.register(in_fd, selectors.EVENT_WRITE)
    for fd in (res_fd, out_fd, err_fd, jerr_fd):
        sel.register(fd, selectors.EVENT_READ)
    caps = {out_fd: limits.max_output_bytes, err_fd: limits.max_output_bytes, res_fd: _MAX_RESULT_BYTES,
            jerr_fd: 8192}
    bufs = {fd: bytearray() for fd in caps}
    truncated = {out_fd: False, err_fd: False}
    reading = set(caps)
    draining: set[int] = set()  # output pipes past their cap: emptied, never read (_drain)
    next_drain = 0.0
    records: list[list[bytes]] = []
    pending = b""
    to_send = memoryview(payload)
    start = last_progress = time.monotonic()
    ended_at: float | None = None
    killed: str | None = None
    while True:
        now = time.monotonic()
        if ended_at is None and res_fd not in reading and jerr_fd not in reading:
            ended_at = now
        if ended_at is not None:
            if not reading or now - ended_at > _EXIT_GRACE_S:
                break
            wait = ended_at + _EXIT_GRACE_S - now
        else:
            if now - start > limits.total_s():
                killed = "wall"
                break
            if now - last_progress > limits.watchdog_s():
                killed = "stall"
                break
            wait = min(start + limits.total_s(), last_progress + limits.watchdog_s()) - now
        if draining:
            if now >= next_drain:
                for fd in list(draining):
                    dropped = _drain(fd)
                    if dropped is None:  # end of file
                        draining.discard(fd)
                        reading.discard(fd)
                    elif dropped:
                        truncated[fd] = True
                next_drain = now + _DRAIN_EVERY_S
            wait = min(wait, next_drain - now)
        for key, _ in sel.select(timeout=max(wait, 0.0)):
            fd = key.fd
            if fd == in_fd:
                try:
                    to_send = to_send[os.write(in_fd, to_send[:65536]):]
                except BlockingIOError:
                    continue
                except OSError:  # the judge died before reading everything
                    to_send = to_send[:0]
                if not to_send:
                    sel.unregister(in_fd)  # the pipe stays open: closing it would end the judge
                continue
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(fd)
                reading.discard(fd)
                continue
            buf = bufs[fd]
            room = caps[fd] - len(buf)
            if room > 0:
                buf += data[:room]
            if len(data) > room and fd in truncated:
                truncated[fd] = True
            if fd in truncated and len(buf) >= caps[fd]:  # full: from now on emptied, not read
                sel.unregister(fd)
                draining.add(fd)
                continue
            if fd == res_fd and room > 0:
                lines = (pending + data[:room]).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line:
                        records.append(line.split(b" "))
                        last_progress = time.monotonic()
    judge.kill()  # ends it if a time limit struck; its death ends the candidate's namespace
    sel.close()
    return RawRun(records, bytes(bufs[out_fd]), bytes(bufs[err_fd]), truncated[out_fd], truncated[err_fd],
                bytes(bufs[jerr_fd]), killed)


def _pipe_size(fds: list[int]) -> None:
    """Let the candidate's output pipes hold _PIPE_BYTES (best effort: an unprivileged user may be
    held to less by /proc/sys/fs/pipe-user-pages-soft; the default 64 KiB then)."""
    import fcntl

    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux only
    if set_size is None:
        return
    for fd in fds:
        try:
            fcntl.fcntl(fd, set_size, _PIPE_BYTES)
        except OSError:
            pass


_DEVNULL: int | None = None


def _drain(fd: int) -> int | None:
    """Empty what a pipe holds into /dev/null without reading it into this process (splice: the
    kernel drops the pages): the bytes dropped, None at end of file (the writers closed it and it
    is empty)."""
    global _DEVNULL
    if _DEVNULL is None:
        _DEVNULL = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "splice"):
            dropped = os.splice(fd, _DEVNULL, _PIPE_BYTES)
        else:  # no splice (not Linux): read and drop
            dropped = len(os.read(fd, _PIPE_BYTES))
    except BlockingIOError:
        return 0
    except OSError:
        return None
    return dropped or None


def _remove_workdir(path: str) -> None:
    if not isolation._child_module("cleanup").remove_workdir(path):
        log.warning("sandbox: could not remove %s", path)


_swept = False


def sweep_stale_workdirs() -> None:
    """Once per trainer process: remove the process-mode work dirs of trainers that are gone."""
    global _swept
    if not _swept:
        _swept = True
        for path in isolation.left_by_dead_trainers(tempfile.gettempdir()):
            if os.path.isdir(path) and not os.path.islink(path) and os.lstat(path).st_uid in (os.geteuid(), NOBODY):
                _remove_workdir(path)
