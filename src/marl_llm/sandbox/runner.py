"""The trainer's side of a sandbox run: start the judge, feed it the job, collect the verdict and
the candidate's output under the time limits, and leave nothing behind."""

from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path

from marl_llm.sandbox import isolation
from marl_llm.sandbox.plan import MAX_ERROR_CHARS, MAX_TEST_TIMEOUTS, _cap, _make_plan, _Plan

log = logging.getLogger(__name__)

#: uid/gid the candidate runs as, seen from outside, when the trainer is root.
NOBODY = 65534
ISOLATION_MODES = ("namespaces", "process")
_MAIN = str(Path(__file__).resolve().parent / "child" / "main.py")
_MAX_RESULT_BYTES = 1 << 20  # the judge's records (it is trusted; this only bounds a bug)
_EXIT_GRACE_S = 0.25  # after the judge exits, how long to wait for the candidate's pipes


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run.

    timeout_s: wall-clock limit of each test and of loading the program.
    memory_mb: the candidate's memory: RLIMIT_AS of each of its processes, and, with a memory
        cgroup, the cap over all of them together (plus `tmp_mb` for its /tmp).
    max_procs: tasks (processes + threads) the candidate may have, with a memory cgroup; without
        one it gets a single task, so that memory_mb caps the whole run.
    max_output_bytes: kept bytes of stdout and of stderr, each.
    max_file_mb: RLIMIT_FSIZE, the largest file the program may write.
    tmp_mb / tmp_inodes: size and file count of the candidate's private /tmp (also /dev/shm).
    total_timeout_s: wall-clock cap of the whole run; None means ``3 * timeout_s + 2``.
    isolation: "namespaces" (the default: see the package docstring) or "process", a weaker mode
        for kernels without unprivileged user namespaces (isolation.PROCESS_MODE_LOSSES).
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_procs: int = 32
    max_output_bytes: int = 65536
    max_file_mb: int = 16
    tmp_mb: int = 64
    tmp_inodes: int = 4096
    total_timeout_s: float | None = None
    isolation: str = "namespaces"

    def total_s(self) -> float:
        if self.total_timeout_s is not None:
            return float(self.total_timeout_s)
        return 3.0 * self.timeout_s + 2.0

    def watchdog_s(self) -> float:
        return 1.5 * self.timeout_s + 2.0


class Status(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    OUT_OF_MEMORY = "out_of_memory"
    SYNTAX_ERROR = "syntax_error"


@dataclass
class TestResult:
    """One test: a top-level statement of ``check``'s body that is or contains an assert."""

    __test__ = False  # not a pytest class

    source: str
    passed: bool
    error: str = ""


@dataclass
class TestOutcome:
    __test__ = False  # not a pytest class

    status: Status
    tests_passed: int
    tests_total: int
    per_test: list[TestResult] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""


# ------------------------------------------------------------------------------------------------
# Live runs: an interrupted trainer (Ctrl-C, an exception) ends them all before it goes on.
# ------------------------------------------------------------------------------------------------

_live: set["_Judge"] = set()
_live_lock = threading.Lock()


def kill_all() -> None:
    """End every sandbox run of this process now (their judges; each judge's death ends its
    candidate's namespace). Called on interrupt and at exit."""
    with _live_lock:
        judges = list(_live)
    for j in judges:
        j.kill()


class _Zygote:
    """The judges' zygote (child/judge.py `serve_forever`), started on first use: each run's judge
    is a fork of it, so a run pays no interpreter start-up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _MAIN, str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True, close_fds=True,
            )  # fmt: skip
        finally:
            theirs.close()
        self.sock = ours
        self.reader = ours.makefile("rb")

    def spawn(self, cfg: dict, fds: list[int]) -> int:
        """Fork a judge for `cfg`, handing it `fds`; its pid."""
        with self.lock:
            for attempt in (0, 1):
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
                assert self.sock is not None
                try:
                    socket.send_fds(self.sock, [json.dumps(cfg).encode()], fds)
                    line = self.reader.readline()
                    if line:
                        return int(line)
                except OSError:
                    pass
                self.close()  # it died: start a new one once
            raise OSError("the sandbox's judge process could not be started")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_zygote = _Zygote()


class _Judge:
    """One run's judge as the trainer holds it: closing its control pipe ends it."""

    def __init__(self, control_w: int):
        self.control_w = control_w
        self.lock = threading.Lock()

    def kill(self) -> None:
        with self.lock:
            if self.control_w >= 0:
                os.close(self.control_w)
                self.control_w = -1


atexit.register(kill_all)
atexit.register(_zygote.close)


# ------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------


@dataclass
class _Raw:
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


def _run_plan(program: str, entry_point: str, plan: _Plan, limits: SandboxLimits) -> TestOutcome:
    if limits.isolation not in ISOLATION_MODES:
        return _failure(plan, f"sandbox: unknown isolation {limits.isolation!r} (use {' or '.join(ISOLATION_MODES)})")
    if limits.isolation == "namespaces":
        why = isolation.namespaces_error()
        if why is not None:
            return _failure(plan, f"sandbox: cannot isolate programs here ({why}); see task.sandbox.isolation")
    job = {
        "program": program,
        "entry_point": entry_point,
        "param": plan.param,
        "prelude": plan.prelude,
        "steps": plan.steps,
        "timeout_s": float(limits.timeout_s),
        "max_timeouts": plan.max_timeouts,
        "scope": plan.scope,
        "evals": plan.evals,
        "preload": plan.preload,
    }
    payload = json.dumps(job).encode("utf-8", "surrogatepass")
    return _summarize(plan, _spawn(payload, limits))


def _spawn(payload: bytes, limits: SandboxLimits) -> _Raw:
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
    judge: _Judge | None = None
    try:
        if workdir and os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        _zygote.spawn(_judge_config(limits, cgroup, workdir), theirs)
        for fd in theirs:
            os.close(fd)
        theirs = []
        judge = _Judge(ours[0])
        with _live_lock:
            _live.add(judge)
        raw = _drive(judge, *ours[1:], len(payload).to_bytes(4, "big") + payload, limits)
        if cgroup is not None:
            raw.oom = cgroup.oom_killed()
        return raw
    finally:
        if judge is not None:
            judge.kill()
            with _live_lock:
                _live.discard(judge)
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


def _drive(judge: _Judge, res_fd: int, out_fd: int, err_fd: int, jerr_fd: int, payload: bytes,
           limits: SandboxLimits) -> _Raw:
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
    return _Raw(records, bytes(bufs[out_fd]), bytes(bufs[err_fd]), truncated[out_fd], truncated[err_fd],
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


def _decode_hex(h: bytes) -> str:
    if h == b"-":
        return ""
    try:
        return bytes.fromhex(h.decode("ascii")).decode("utf-8", "replace")
    except (ValueError, UnicodeDecodeError):
        return "<garbled>"


def _output(data: bytes, truncated: bool) -> str:
    text = data.decode("utf-8", "replace")
    return text + "\n[... output truncated ...]" if truncated else text


def _summarize(plan: _Plan, raw: _Raw) -> TestOutcome:
    total = len(plan.sources)
    results: dict[int, tuple[bytes, str]] = {}
    syntax: str | None = None
    load: tuple[bytes, str] | None = None
    done = stopped = False
    exit_code: int | None = None
    flags: list[bytes] = []
    for rec in raw.records:
        try:
            kind = rec[0]
            if kind == b"S" and syntax is None:
                syntax = f"line {int(rec[1])}: {_decode_hex(rec[2])}"
            elif kind == b"L" and load is None:
                load = (rec[1], _decode_hex(rec[2]))
                flags.append(rec[1])
            elif kind == b"R":
                i = int(rec[1])
                if 0 <= i < total and i not in results:
                    results[i] = (rec[2], _decode_hex(rec[3]))
                    flags.append(rec[2])
            elif kind == b"U":
                flags.append(rec[2])
            elif kind == b"X":
                stopped = True
            elif kind == b"E":
                exit_code = int(rec[1])
            elif kind == b"D":
                done = True
        except (IndexError, ValueError):
            continue

    stderr = _output(raw.stderr, raw.stderr_truncated)
    oom = raw.oom or exit_code == -signal.SIGKILL and "MemoryError" in stderr
    if syntax is not None:
        missing = f"not run: syntax error in the program ({syntax})"
    elif load is not None and load[0] != b"P":
        missing = f"not run: the program failed while loading ({load[1]})"
    elif raw.killed is not None:
        missing = "not run: the sandbox run timed out"
    elif stopped:
        missing = f"not run: stopped after {plan.max_timeouts} timed-out tests"
    elif oom:
        missing = "not run: the program ran out of memory"
    else:
        missing = "not run: the sandbox run ended early"

    per_test = []
    for i, src in enumerate(plan.sources):
        if i in results:
            flag, err = results[i]
            passed = flag == b"P"
            per_test.append(TestResult(src, passed, "" if passed else _cap(err or "failed", MAX_ERROR_CHARS)))
        else:
            per_test.append(TestResult(src, False, missing))
    n_passed = sum(r.passed for r in per_test)

    if syntax is not None:
        status = Status.SYNTAX_ERROR
    elif total > 0 and n_passed == total:
        status = Status.PASSED
    elif total == 0 and load is not None and load[0] == b"P" and done:
        status = Status.PASSED  # nothing to test and the program loaded fine
    elif oom or b"M" in flags:
        status = Status.OUT_OF_MEMORY
    elif raw.killed is not None or b"T" in flags or exit_code in (-signal.SIGXCPU,):
        status = Status.TIMEOUT
    else:
        status = Status.FAILED
    if raw.killed is not None:
        stderr += f"\n[sandbox: killed after {'the wall-clock limit' if raw.killed == 'wall' else 'no progress'}]"
    if raw.judge_stderr or (not done and raw.killed is None):
        log.warning("sandbox: the judge ended abnormally: %s",
                    raw.judge_stderr.decode("utf-8", "replace")[-2000:])
    return TestOutcome(status, n_passed, total, per_test, _output(raw.stdout, raw.stdout_truncated), stderr)


def _failure(plan: _Plan | None, message: str) -> TestOutcome:
    sources = plan.sources if plan is not None else []
    per_test = [TestResult(s, False, f"not run: {message}") for s in sources]
    return TestOutcome(Status.FAILED, 0, len(sources), per_test, "", message)


def probe_confinement() -> str | None:
    """Confine an empty program once: None if that works, else what failed."""
    plan = _make_plan("def check(candidate):\n    pass\n", "__program__")
    job = json.dumps({"program": "", "entry_point": "__program__", "param": plan.param, "prelude": "",
                      "steps": [], "timeout_s": 10.0, "max_timeouts": 1, "scope": "check", "evals": [],
                      "preload": []}).encode()
    raw = _spawn(job, SandboxLimits(timeout_s=10.0, isolation="namespaces"))
    if any(r[:1] == [b"L"] and r[1:2] == [b"P"] for r in raw.records):
        return None
    detail = (raw.stderr or raw.judge_stderr).decode("utf-8", "replace").strip().splitlines()
    code = next((r[1].decode() for r in raw.records if r[:1] == [b"E"] and len(r) > 1), "no exit code")
    return detail[-1] if detail else f"the confined process ended ({code})"


# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------


def limits_from_config(sb: object) -> SandboxLimits:
    """SandboxLimits from a `task.sandbox` config node (keys it lacks keep their defaults)."""
    kwargs = {}
    for f in fields(SandboxLimits):
        value = sb.get(f.name) if hasattr(sb, "get") else getattr(sb, f.name, None)
        if value is not None:
            kwargs[f.name] = value
    return SandboxLimits(**kwargs)


_warned_process_mode = False


def require_isolation(limits: SandboxLimits) -> None:
    """Before a run starts: refuse (one line, naming the way out) where the kernel cannot confine
    programs and the user did not opt in to the weaker mode; say what the weaker mode loses."""
    from marl_llm.config import UserError

    global _warned_process_mode
    if limits.isolation not in ISOLATION_MODES:
        raise UserError(f"task.sandbox.isolation={limits.isolation}: use namespaces (the default) or process")
    if limits.isolation == "process":
        if not _warned_process_mode:
            log.warning("task.sandbox.isolation=process: generated code runs with weaker isolation: %s",
                        isolation.PROCESS_MODE_LOSSES)
            _warned_process_mode = True
        return
    why = isolation.namespaces_error()
    if why is not None:
        raise UserError(
            f"the code sandbox cannot isolate programs on this machine ({why}): it needs unprivileged user "
            "namespaces (ask the admin for user.max_user_namespaces > 0, or kernel.unprivileged_userns_clone=1, "
            "or an AppArmor profile that allows them), or accept weaker isolation with "
            f"task.sandbox.isolation=process ({isolation.PROCESS_MODE_LOSSES})")


def run_tests(program: str, test_code: str, entry_point: str, limits: SandboxLimits | None = None) -> TestOutcome:
    """Run HumanEval-style `test_code` (defining `check(candidate)`) against `program`.

    `candidate` stands for the program's `entry_point`. Every top-level statement of check's body
    that is or contains an assert is one test; all tests run (each under the per-test time limit)
    until `MAX_TEST_TIMEOUTS` of them time out. Never raises: failures of the sandbox itself come
    back as a FAILED outcome with the reason in `stderr`.
    """
    limits = limits or SandboxLimits()
    try:
        plan = _make_plan(test_code, entry_point)
    except Exception as e:  # a broken test file is a dataset problem; report, don't raise
        return _failure(None, f"sandbox: cannot parse the test code: {e!r}")
    try:
        return _run_plan(program, entry_point, plan, limits)
    except Exception as e:
        log.exception("sandbox: run failed")
        return _failure(plan, f"sandbox error: {e!r}")


_progress = logging.getLogger("marl_llm.progress")  # the trainer's progress display counts these


def _map_in_pool(fn, jobs: list, workers: int) -> list:
    def reported(job):
        try:
            return fn(job)
        finally:
            _progress.debug("sandbox job")

    if workers <= 1 or len(jobs) == 1:
        try:
            return [reported(job) for job in jobs]
        except BaseException:
            kill_all()
            raise
    pool = ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="sandbox")
    try:
        return list(pool.map(reported, jobs))
    except BaseException:  # Ctrl-C: end the running programs now, start no more
        pool.shutdown(wait=False, cancel_futures=True)
        kill_all()
        raise
    finally:
        pool.shutdown(wait=True)


def run_tests_many(
    jobs: list[tuple[str, str, str]], limits: SandboxLimits | None = None, workers: int = 2
) -> list[TestOutcome]:
    """`run_tests` for each (program, test_code, entry_point), `workers` at a time, in order."""
    limits = limits or SandboxLimits()
    if not jobs:
        return []
    return _map_in_pool(lambda job: run_tests(job[0], job[1], job[2], limits), jobs, workers)


@dataclass
class ProgramScopeTest:
    """One test of `run_program_scope_tests`: each of `evals` (expressions) is evaluated, then
    `source` (a statement, e.g. an assert line) is executed, with the program's names in scope;
    the test passes when none of them raises. A piece that does not compile fails the test when
    it is reached (the pieces before it have run)."""

    __test__ = False  # not a pytest class

    source: str
    evals: tuple[str, ...] = ()


def run_program_scope_tests(
    program: str,
    tests: list[ProgramScopeTest],
    limits: SandboxLimits | None = None,
    preload: tuple[str, ...] = (),
    max_timeouts: int = MAX_TEST_TIMEOUTS,
) -> TestOutcome:
    """Run `tests` with the program's global names in scope: the harness of reference rewards that
    `exec` the program into a dict and then `exec` assert lines into that same dict.

    The program runs in globals that hold the `preload` stdlib modules; then each test runs in the
    judge, in one namespace shared by the tests, where every function the program defines stands
    for a call into the candidate's process and every other name the tests read is the program's
    current value. Each test runs under the per-test time limit, until `max_timeouts` tests have
    timed out. Unless `limits.total_timeout_s` is set, the run may last
    `(max_timeouts + 1) * timeout_s + 2` seconds. Never raises.
    """
    limits = limits or SandboxLimits()
    if limits.total_timeout_s is None:
        limits = replace(limits, total_timeout_s=(max_timeouts + 1) * float(limits.timeout_s) + 2.0)
    plan = _Plan(
        prelude="",
        param="",
        steps=[("t", i, t.source) for i, t in enumerate(tests)],
        sources=[_cap(t.source, MAX_ERROR_CHARS) for t in tests],
        scope="program",
        evals=[list(t.evals) for t in tests],
        preload=list(preload),
        max_timeouts=max_timeouts,
    )
    try:
        return _run_plan(program, "", plan, limits)
    except Exception as e:
        log.exception("sandbox: run failed")
        return _failure(plan, f"sandbox error: {e!r}")


def run_program_scope_tests_many(
    jobs: list[tuple[str, list[ProgramScopeTest]]],
    limits: SandboxLimits | None = None,
    workers: int = 2,
    preload: tuple[str, ...] = (),
    max_timeouts: int = MAX_TEST_TIMEOUTS,
) -> list[TestOutcome]:
    """`run_program_scope_tests` for each (program, tests), `workers` at a time, in order."""
    if not jobs:
        return []
    return _map_in_pool(lambda job: run_program_scope_tests(job[0], job[1], limits, preload, max_timeouts),
                        jobs, workers)


# A test file with no tests: the judge runs the program and reports nothing else.
_NO_TESTS = "def check(candidate):\n    pass\n"


def run_programs(programs: list[str], limits: SandboxLimits | None = None, workers: int = 2) -> list[TestOutcome]:
    """Run each program for its output alone (e.g. a tool agent's script that prints moves), with
    the same isolation and limits as the tests; read `.stdout`, `.stderr` and `.status`."""
    return run_tests_many([(p, _NO_TESTS, "__program__") for p in programs], limits, workers)
