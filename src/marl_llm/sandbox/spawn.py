"""One sandbox run, the trainer's side: give the run its memory cgroup and work dir, fork its judge
from the zygote with the judge's config and pipes, feed it the job, collect the verdict records and
the candidate's output under the time limits, end the judge, and leave nothing behind. What comes
back is raw (`RawRun`); runner.py turns it into a TestOutcome."""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass

from marl_llm.sandbox import isolation
from marl_llm.sandbox.limits import NOBODY, SandboxLimits
from marl_llm.sandbox.zygote import Judge, track, untrack, zygote

log = logging.getLogger(__name__)

_MAX_RESULT_BYTES = 1 << 20  # the judge's records (it is trusted; this only bounds a bug)
_EXIT_GRACE_S = 0.25  # after the judge exits, how long to wait for the candidate's pipes


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


def _judge_config(limits: SandboxLimits, cgroup: isolation.MemoryCgroup | None, workdir: str | None) -> dict:
    root = os.geteuid() == 0
    lay = isolation.layout() if limits.isolation == "namespaces" else None
    return {
        "mode": limits.isolation,
        "ids": [NOBODY, NOBODY] if root else [os.geteuid(), os.getegid()],
        "binds": [list(b) for b in lay.binds] if lay else [],
        "symlinks": [list(s) for s in lay.symlinks] if lay else [],
        "masks": list(lay.masks) if lay else [],
        "tmp_bytes": int(limits.tmp_mb) << 20,
        "tmp_inodes": int(limits.tmp_inodes),
        "cgroup_procs": cgroup.procs_file if cgroup else "",
        # C, the namespace keeper, is a task of the same user namespace: +1.
        "max_tasks": (int(limits.max_procs) if cgroup else 1) + 1,
        "limits": {"as": int(limits.memory_mb) << 20, "cpu": int(limits.total_s()) + 1,
                   "fsize": int(limits.max_file_mb) << 20, "nofile": 256},
        "workdir": workdir or "",
        "drop_to": NOBODY if root and limits.isolation == "process" else -1,
        "preimport": list(_PREIMPORT),
    }


# Imported before the uid drop in process mode as root (the stdlib may be unreadable to nobody).
_PREIMPORT = ("abc", "array", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal",
              "enum", "fractions", "functools", "hashlib", "heapq", "itertools", "math", "numbers", "operator",
              "random", "re", "statistics", "string", "struct", "textwrap", "typing", "unicodedata")


def run_judge(payload: bytes, limits: SandboxLimits) -> RawRun:
    """Run one job (`payload`, the JSON the judge reads) under `limits`."""
    cgroup = None
    base = isolation.cgroup_base() if limits.isolation == "namespaces" else None
    if base is not None:
        try:
            cgroup = isolation.MemoryCgroup(*base, (int(limits.memory_mb) + int(limits.tmp_mb)) << 20)
        except OSError as e:
            log.warning("sandbox: no memory cgroup for this run (%s); the candidate gets a single task", e)
    workdir = tempfile.mkdtemp(prefix="marl-sandbox-") if limits.isolation == "process" else None
    # control (job in, and closed to end the judge), results, candidate stdout/stderr, judge stderr
    pipes = [os.pipe() for _ in range(5)]
    theirs = [pipes[0][0]] + [w for _, w in pipes[1:]]
    ours = [pipes[0][1]] + [r for r, _ in pipes[1:]]
    judge: Judge | None = None
    try:
        if workdir and os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        zygote.spawn(_judge_config(limits, cgroup, workdir), theirs)
        for fd in theirs:
            os.close(fd)
        theirs = []
        judge = Judge(ours[0])
        track(judge)
        raw = _drive(judge, *ours[1:], len(payload).to_bytes(4, "big") + payload, limits)
        if cgroup is not None:
            raw.oom = cgroup.oom_killed()
        return raw
    finally:
        if judge is not None:
            judge.kill()
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


def _remove_workdir(path: str) -> None:
    """Remove a process-mode work dir. The program may have made its dirs unreadable: they are
    made ours again top-down first, touching nothing but real directories inside `path` (never a
    symlink's target, never `path`'s parent)."""
    try:
        os.chmod(path, 0o700)
        for dirpath, dirnames, _ in os.walk(path):
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if stat.S_ISDIR(os.lstat(p).st_mode):
                    os.chmod(p, 0o700)
    except OSError:
        pass
    for _ in range(3):  # a killed straggler may still be creating files for a moment
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.05)
    log.warning("sandbox: could not remove %s", path)
