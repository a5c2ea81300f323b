"""The sandbox's public run API and what a run comes to: run HumanEval-style tests
(`run_tests`), tests in the program's own scope (`run_program_scope_tests`) or bare programs
(`run_programs`), singly or a pool at a time, and summarise each run's records into a
`TestOutcome`. The processes of a run are spawn.py's; what the machine allows is confinement.py's."""

from __future__ import annotations

import json
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from enum import Enum

from marl_llm.sandbox.confinement import namespaces_error
from marl_llm.sandbox.limits import ISOLATION_MODES, SandboxLimits
from marl_llm.sandbox.plan import MAX_ERROR_CHARS, MAX_TEST_TIMEOUTS, _cap, _make_plan, _Plan
from marl_llm.sandbox.spawn import RawRun, run_judge
from marl_llm.sandbox.zygote import kill_all

log = logging.getLogger(__name__)


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
# One run
# ------------------------------------------------------------------------------------------------


def _run_plan(program: str, entry_point: str, plan: _Plan, limits: SandboxLimits) -> TestOutcome:
    if limits.isolation not in ISOLATION_MODES:
        return _failure(plan, f"sandbox: unknown isolation {limits.isolation!r} (use {' or '.join(ISOLATION_MODES)})")
    if limits.isolation == "namespaces":
        why = namespaces_error()
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
    return _summarize(plan, run_judge(payload, limits))


# ------------------------------------------------------------------------------------------------
# What a run comes to: its records, summarised
# ------------------------------------------------------------------------------------------------


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


def _summarize(plan: _Plan, raw: RawRun) -> TestOutcome:
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


# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------


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
        futures = [pool.submit(reported, job) for job in jobs]
        # Waited on in short slices: a Ctrl-C the kernel hands to another thread only sets Python's
        # flag, and a main thread blocked in one long wait would not see it until a program ends
        # (seen under load: 240 s of 60 s programs run on after the signal).
        while futures_wait(futures, timeout=0.2).not_done:
            pass
        return [f.result() for f in futures]
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
