"""Run untrusted, model-generated Python against HumanEval-style tests.

This module is the ONLY place where model code runs. The calling process never executes it:
every program runs in a fresh ``python -I -S`` interpreter (the *harness*, whose source is
``_HARNESS`` below) that receives the program and the tests on stdin and reports results on a
dedicated pipe.

Isolation of each run
---------------------
* a separate process per program, in a new session / process group that is SIGKILLed as a
  whole when the run ends or times out;
* a fresh temporary directory as cwd (and HOME/TMPDIR), removed afterwards;
* scrubbed environment (PATH, LANG, HOME, TMPDIR only): no tokens, keys, HF_* or WANDB_*;
* ``-I -S``: no PYTHON* variables, no user site, no site-packages (stdlib only), cwd not on
  sys.path;
* limits set inside the harness before any untrusted code exists in that process: RLIMIT_AS
  (memory), RLIMIT_CPU, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_CORE=0. They are set by the fresh
  interpreter itself rather than in a ``preexec_fn``: ``preexec_fn`` is not safe in a threaded
  caller (``run_tests_many`` and the trainer are threaded) and can deadlock the fork;
* network cut with ``unshare(CLONE_NEWNET)`` (via ctypes; silently skipped where not allowed);
* when the caller is root, the harness drops to ``nobody`` (uid/gid 65534) so RLIMIT_NPROC
  applies and root-only files are unreadable. If the interpreter's stdlib is not readable by
  nobody (e.g. a pyenv under /root), it is bind-mounted read-only into the run's temp dir in a
  private mount namespace; where that is not allowed a fixed list of common stdlib modules is
  imported before the privilege drop instead;
* stdout/stderr are captured but capped to ``max_output_bytes`` each.

Results cannot be faked by ordinary means
-----------------------------------------
* The parent never trusts exit codes or stdout. Results travel on a separate pipe as lines that
  start with a random per-run nonce; the harness reads the nonce from stdin (then replaces stdin
  with /dev/null) before the program runs. Lines without the nonce are ignored, and a test with
  no reported result counts as failed: ``sys.exit``/``os._exit``/``SystemExit``, killing the
  harness or closing its pipe all fail closed.
* The test count comes from the parent's own parse of the test code, never from the child.
* The harness captured every builtin and function it uses (exec, compile, os.write, type, ...)
  in closures before the program ran; it never looks them up again, so patching ``builtins``,
  ``os``, ``json`` or ``__main__`` does not reach it.
* Test code runs in its own namespace with a pristine copy of the builtins; the program's
  ``check`` (or any other name) is invisible to it. After every call of the candidate, the real
  ``builtins`` module and every stdlib module the tests import are restored from snapshots
  taken before the program ran, the test namespace (reachable through the caller's frame) is
  restored to its state before the call, and the harness's SIGALRM handler is re-installed.
* Every value returned by the candidate must consist of exact plain builtin types only
  (int, float, complex, bool, str, bytes, None, list, tuple, dict, set, frozenset, checked
  recursively); anything else (e.g. an object whose ``__eq__`` is always True) fails the test.
* A candidate that leaves threads running fails (a thread could re-patch modules while the
  tests run).

Program-scope tests
-------------------
``run_program_scope_tests`` reproduces harnesses that ``exec`` assert lines into the program's
own globals (the reference code reward's, see ``marl_llm.tasks.code_reward_paper``): same
process isolation, limits and nonce-tagged results, but the tests share the program's namespace
and there is no candidate wrapper, so the guarantees about returned types and the test namespace
above do not hold there; only the builtins and the preloaded modules are restored before each
test.

Residual limits (documented, not solved)
----------------------------------------
The tests and the program share one interpreter, so this is defence against accidents and
naive reward hacking, not a security boundary against a determined program: code that inspects
the harness's memory (``gc.get_objects``, ``sys._getframe``, frame locals) can find the nonce or
the harness's closures; ``ctypes`` can rewrite any object (even immutable builtin types);
mutations of objects *referenced* by a module (e.g. a class's methods, a dict inside a module)
are not restored, only module attributes; a process that calls ``setsid()`` escapes the group
kill (RLIMIT_CPU still bounds its CPU time); when not running as root there is no uid switch,
so the program can read whatever the caller's user can read; and parallel runs share the
``nobody`` uid (and its RLIMIT_NPROC budget) and can signal each other.

Timeouts
--------
``SandboxLimits.timeout_s`` is the time limit of each test (and of loading the program),
enforced in the harness with SIGALRM and, should the program disable that, by a parent-side
watchdog that kills the run when no result arrives for ``1.5 * timeout_s + 2`` seconds. A run
stops after ``MAX_TEST_TIMEOUTS`` timed-out tests; the whole run is capped at
``total_timeout_s`` (default ``3 * timeout_s + 2``).
"""

from __future__ import annotations

import ast
import errno
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import Enum

log = logging.getLogger(__name__)

__all__ = [
    "MAX_TEST_TIMEOUTS",
    "ProgramScopeTest",
    "SandboxLimits",
    "Status",
    "TestOutcome",
    "TestResult",
    "run_program_scope_tests",
    "run_program_scope_tests_many",
    "run_tests",
    "run_tests_many",
]

#: A run stops after this many tests hit the per-test time limit.
MAX_TEST_TIMEOUTS = 2
#: uid/gid the harness switches to when the caller is root.
NOBODY = 65534
#: Longest error message / test source kept per test.
MAX_ERROR_CHARS = 300
_MAX_RESULT_BYTES = 8 << 20  # cap on the results pipe (a program may flood it)
_EXIT_GRACE_S = 0.25  # after the harness exits, how long to wait for pipes held by stragglers


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run.

    timeout_s: wall-clock limit of each test and of loading the program (see module docstring).
    memory_mb: RLIMIT_AS of the harness process (address space, not RSS).
    max_procs: RLIMIT_NPROC (processes + threads of the sandbox uid).
    max_output_bytes: kept bytes of stdout and of stderr, each.
    max_file_mb: RLIMIT_FSIZE, the largest file the program may write.
    total_timeout_s: wall-clock cap of the whole run; None means ``3 * timeout_s + 2``.
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_procs: int = 32
    max_output_bytes: int = 65536
    max_file_mb: int = 16
    total_timeout_s: float | None = None

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


# ----------------------------------------------------------------------------------------------
# Test plan: the parent splits the (trusted) test code with `ast`; parsing runs no code.
# ----------------------------------------------------------------------------------------------

_EQ_HELPER = "__sandbox_assert_eq__"


@dataclass
class _Plan:
    prelude: str  # module-level test code except the `check` def (METADATA, helpers, imports)
    param: str  # check's parameter name (usually "candidate")
    steps: list[tuple[str, int, str]]  # (kind "t"est / "s"etup, test index or -1, source)
    sources: list[str]  # display source of each test
    modules: list[str]  # modules the test code imports (guarded against patching)
    # "check": tests call `candidate` from their own namespace (run_tests); "program": each test
    # runs in the program's own globals, after its `evals` (run_program_scope_tests).
    scope: str = "check"
    evals: list[list[str]] = field(default_factory=list)  # per step, program scope only
    preload: list[str] = field(default_factory=list)  # modules bound in the program's globals
    max_timeouts: int = MAX_TEST_TIMEOUTS


def _contains_name(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


class _EqAsserts(ast.NodeTransformer):
    """`assert A == B` -> `__sandbox_assert_eq__(A, B, got_is_left)`.

    Same evaluation order and truth test as the assert; the helper only adds an
    "expected X, got Y" message. The side that calls the candidate is the "got" side.
    """

    def __init__(self, candidate_names: set[str]):
        self.names = candidate_names

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            got_left = _contains_name(left, self.names) or not _contains_name(right, self.names)
            call = ast.Call(
                func=ast.Name(id=_EQ_HELPER, ctx=ast.Load()),
                args=[left, right, ast.Constant(value=got_left)],
                keywords=[],
            )
            return ast.copy_location(ast.Expr(value=call), node)
        return node


def _display_source(test_code: str, stmt: ast.stmt) -> str:
    src = ast.get_source_segment(test_code, stmt) if not _is_compound(stmt) else None
    if src is None or "\n" in src:
        src = ast.unparse(stmt)
    return _cap(src, MAX_ERROR_CHARS)


def _is_compound(stmt: ast.stmt) -> bool:
    return isinstance(stmt, (ast.For, ast.While, ast.If, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith))


def _is_check_call(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id == "check"
    )


def _make_plan(test_code: str, entry_point: str) -> _Plan:
    """Split test code into a prelude and one step per top-level statement of `check`'s body.

    A step that is or contains an `assert` and reaches the candidate (names it, or a name an
    earlier step bound from it) is a test; the others (imports, assignments, helper defs, asserts
    of constants such as `assert True`) are setup steps run in order. Without a `check`
    function, the module-level statements that would be tests are the tests.
    """
    tree = ast.parse(test_code)
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if checks:
        check = checks[-1]
        body = check.body
        param = check.args.args[0].arg if check.args.args else "candidate"
        prelude_nodes = [n for n in tree.body if n is not check and not _is_check_call(n)]
    else:
        body = [n for n in tree.body if not _is_check_call(n)]
        param = "candidate"
        prelude_nodes = []
    fixer = _EqAsserts({param, entry_point})
    steps: list[tuple[str, int, str]] = []
    sources: list[str] = []
    # Names that carry the candidate: itself, and what earlier statements bind from it (`r =
    # candidate(x)`, a helper def that calls it). An assert that reaches none of them (`assert
    # True`, `assert 1 == 1`) exercises nothing and is not a test.
    reaching = {param, entry_point}
    for stmt in body:
        is_def = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        reaches = _contains_name(stmt, reaching)
        if reaches and is_def:
            reaching.add(stmt.name)
        elif reaches:
            reaching.update(n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
        is_test = not is_def and reaches and any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        if not checks and not is_test:
            prelude_nodes.append(stmt)
            continue
        display = _display_source(test_code, stmt) if is_test else ""
        module = ast.Module(body=[fixer.visit(stmt)], type_ignores=[])
        code = ast.unparse(ast.fix_missing_locations(module))
        if is_test:
            steps.append(("t", len(sources), code))
            sources.append(display)
        else:
            steps.append(("s", -1, code))
    prelude = ast.unparse(ast.Module(body=prelude_nodes, type_ignores=[]))
    modules: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            modules.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            modules.add(n.module)
    return _Plan(prelude, param, steps, sources, sorted(modules))


# ----------------------------------------------------------------------------------------------
# The harness (runs in the child). Self-contained: `-I -S` cannot import this package.
# ----------------------------------------------------------------------------------------------

_HARNESS = r'''
import builtins, os, signal, sys

def _sandbox_main(argv):
    import _thread, json, resource, time
    result_fd = int(argv[1]); mem_bytes = int(argv[2]); cpu_s = int(argv[3])
    nproc = int(argv[4]); fsize = int(argv[5]); drop = argv[6] == "1"; uid = int(argv[7])

    # ---- 1. isolation: nothing untrusted exists in this process yet -------------------------
    libc = None
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(0x40000000)  # CLONE_NEWNET: an empty network namespace; may be refused
    except Exception:
        pass

    def nobody_can_list(path):
        # Can uid/gid `uid` reach and read `path`? (we are root here, os.access would lie)
        parts = os.path.abspath(path).split(os.sep)
        for i in range(1, len(parts) + 1):
            p = os.sep.join(parts[:i]) or os.sep
            try:
                st = os.stat(p)
            except OSError:
                return False
            need = 0o5 if i == len(parts) else 0o1
            if st.st_uid == uid:
                mode = st.st_mode >> 6
            elif st.st_gid == uid:
                mode = st.st_mode >> 3
            else:
                mode = st.st_mode
            if mode & need != need:
                return False
        return True

    if drop:
        hidden = [p for p in sys.path if os.path.isdir(p) and not nobody_can_list(p)]
        if hidden:
            exposed = False
            try:
                # A private mount namespace: bind mounts below never propagate to the caller.
                MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
                if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
                    raise OSError("unshare(CLONE_NEWNS) failed")
                if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
                    raise OSError("cannot make / private")
                roots = [p for p in hidden if not any(p != q and p.startswith(q + os.sep) for q in hidden)]
                mapping = {}
                for k, src in enumerate(roots):
                    dst = os.path.join(os.getcwd(), ".pylib", str(k))
                    os.makedirs(dst, mode=0o755)
                    os.chmod(os.path.dirname(dst), 0o755)
                    if libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None) != 0:
                        raise OSError("bind mount failed")
                    libc.mount(b"none", dst.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
                    mapping[src] = dst
                def remap(p):
                    for src, dst in mapping.items():
                        if p == src or p.startswith(src + os.sep):
                            return dst + p[len(src):]
                    return p

                sys.path[:] = [remap(p) for p in sys.path]
                # Packages imported at startup (collections, encodings, ...) find their
                # submodules through __path__, not sys.path.
                for mod in list(sys.modules.values()):
                    path = getattr(mod, "__path__", None)
                    if isinstance(path, list):
                        path[:] = [remap(p) for p in path]
                sys.path_importer_cache.clear()
                exposed = True
            except Exception:
                pass
            if not exposed:
                # Fallback: import common stdlib modules while they are still readable.
                for name in ("abc", "array", "bisect", "cmath", "collections", "copy",
                             "dataclasses", "datetime", "decimal", "enum", "fractions",
                             "functools", "hashlib", "heapq", "itertools", "math", "numbers",
                             "operator", "random", "re", "statistics", "string", "struct",
                             "textwrap", "typing", "unicodedata"):
                    try:
                        __import__(name)
                    except Exception:
                        pass

    def limit(res, value):
        soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))

    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_FSIZE, fsize)
    limit(resource.RLIMIT_NPROC, nproc)
    limit(resource.RLIMIT_AS, mem_bytes)
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1 if hard == resource.RLIM_INFINITY else min(cpu_s + 1, hard)))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too-large writes raise OSError instead
    if drop:
        # Refuse to run the program as root: any failure here aborts the harness.
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            os._exit(70)

    # ---- 2. read the job (nonce first: before any program code runs) ------------------------
    chunks = []
    while True:
        b = os.read(0, 1 << 16)
        if not b:
            break
        chunks.append(b)
    job = json.loads(b"".join(chunks))
    del chunks
    nul = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    nonce = job["nonce"].encode("ascii")

    # ---- 3. capture everything the harness uses, before the program can patch it ------------
    _write = os.write; _exit = os._exit; _exec = exec; _compile = compile; _type = type
    _id = id; _repr = repr; _str = str; _len = len; _callable = callable
    _encode = str.encode; _hex = bytes.hex; _bjoin = b"".join; _sjoin = b" ".join
    _exc_info = sys.exc_info; _setitimer = signal.setitimer; _signal = signal.signal
    _ITIMER_REAL = signal.ITIMER_REAL; _SIGALRM = signal.SIGALRM; _monotonic = time.monotonic
    _isinstance = isinstance; _MemoryError = MemoryError; _SyntaxError = SyntaxError
    _TypeError = TypeError; _NameError = NameError; _RuntimeError = RuntimeError
    _count_threads = _thread._count; _modules = sys.modules
    _dict = dict; _dict_clear = dict.clear; _dict_update = dict.update; _tuple = tuple
    _stdout = sys.stdout; _stderr = sys.stderr
    pristine_builtins = dict(builtins.__dict__)

    guarded = []  # (name, module, its __dict__, snapshot)
    for name in job["modules"]:
        try:
            __import__(name)
            mod = _modules[name]
        except BaseException:
            continue
        guarded.append((name, mod, mod.__dict__, dict(mod.__dict__)))
    guarded.append(("builtins", builtins, builtins.__dict__, pristine_builtins))

    def emit(*fields):
        line = _bjoin((b"\n", nonce, b" ", _sjoin(fields), b"\n"))
        while line:
            n = _write(result_fd, line)
            line = line[n:]

    def num(i):
        return _encode(_str(i), "ascii")

    def text(s, cap=600):
        try:
            b = _encode(s, "utf-8", "replace")
        except BaseException:
            b = b"<unprintable>"
        return _encode(_hex(b[:cap]), "ascii") or b"-"

    class _Timeout(BaseException):
        pass

    class _EqFailure(AssertionError):
        pass

    class _Reported(Exception):  # a test piece that did not compile; args[0] says why
        pass

    timed_out = [False]
    deadline = [0.0]

    def on_alarm(signum, frame):
        timed_out[0] = True
        raise _Timeout()

    def restore(rearm):
        # Undo the candidate's patches of builtins and of the modules the tests import.
        for name, mod, d, snap in guarded:
            if _modules.get(name) is not mod:
                _modules[name] = mod
            _dict_clear(d)
            _dict_update(d, snap)
        _signal(_SIGALRM, on_alarm)
        if rearm:  # the candidate may have cancelled the step's timer
            left = deadline[0] - _monotonic()
            _setitimer(_ITIMER_REAL, left if left > 0.001 else 0.001)

    def describe(e):
        try:
            if timed_out[0] or _isinstance(e, _Timeout):
                return "timed out after %gs" % job["timeout_s"]
            t = _type(e)
            if t is _EqFailure or t is _Reported:
                return _str(e.args[0])
            msg = _str(e)
            name = t.__name__
            return name + ": " + msg if msg else name
        except BaseException:
            return "<unprintable exception>"

    def run(code, ns):
        """Run one code object under the per-test time limit -> (flag, error)."""
        timed_out[0] = False
        try:
            restore(False)
            deadline[0] = _monotonic() + job["timeout_s"]
            _setitimer(_ITIMER_REAL, job["timeout_s"])
            try:
                if _type(code) is _tuple:  # program scope: (code object or None, error) pieces
                    for piece, error in code:
                        if piece is None:
                            raise _Reported(error)
                        _exec(piece, ns)
                else:
                    _exec(code, ns)
            finally:
                _setitimer(_ITIMER_REAL, 0)
        except:  # noqa: E722  (bare on purpose: no name lookup the program could patch)
            e = _exc_info()[1]
            _setitimer(_ITIMER_REAL, 0)
            if timed_out[0] or _isinstance(e, _Timeout):
                return b"T", describe(e)
            if _isinstance(e, _MemoryError):
                return b"M", "MemoryError"
            return b"F", describe(e)
        if timed_out[0]:  # the program swallowed the timeout
            return b"T", "timed out after %gs" % job["timeout_s"]
        return b"P", ""

    def check_plain(value):
        stack = [value]
        seen = set()
        budget = 10_000_000
        while stack:
            x = stack.pop()
            t = _type(x)
            budget -= 1
            if budget < 0:
                raise _TypeError("candidate returned a value too large to validate")
            if (t is int or t is float or t is complex or t is bool or t is str or t is bytes
                    or x is None):
                continue
            if t is list or t is tuple or t is set or t is frozenset or t is dict:
                if _id(x) in seen:
                    continue
                seen.add(_id(x))
                if t is dict:
                    stack.extend(_dict.keys(x))
                    stack.extend(_dict.values(x))
                else:
                    stack.extend(x)
                continue
            raise _TypeError("the candidate returned a non-builtin type: " + _str(t.__name__))

    # ---- 4. compile the (trusted) test code while compile() is certainly the real one --------
    program_scope = job["scope"] == "program"
    test_codes = []
    for step, (kind, index, src) in enumerate(job["steps"]):
        pieces = [(expr, "eval") for expr in job["evals"][step]] if program_scope else []
        compiled = []
        for piece_src, mode in pieces + [(src, "exec")]:
            try:
                compiled.append((_compile(piece_src, "<test>", mode), None))
            except BaseException as e:
                compiled.append((None, describe(e)))
        if program_scope:  # a piece that does not compile fails the test when reached
            test_codes.append((kind, index, _tuple(compiled), None))
        else:
            test_codes.append((kind, index, compiled[0][0], compiled[0][1]))
    prelude = _compile(job["prelude"], "<test prelude>", "exec")
    signal.signal(signal.SIGALRM, on_alarm)

    # ---- 5. load the program --------------------------------------------------------------
    emit(b"I")  # alive: the watchdog counts from here
    try:
        program = _compile(job["program"], "<program>", "exec")
    except:  # noqa: E722
        e = _exc_info()[1]
        line = getattr(e, "lineno", None) if _isinstance(e, _SyntaxError) else None
        emit(b"S", num(line or 0), text(describe(e)))
        emit(b"D")
        _exit(0)
    if program_scope:  # the tests will run in these globals: the preloaded modules, the builtins
        prog_ns = {"__builtins__": builtins}
        for name in job["preload"]:
            if _modules.get(name) is not None:
                prog_ns[name] = _modules[name]
    else:
        prog_ns = {"__name__": "__candidate__", "__builtins__": builtins}
    flag, err = run(program, prog_ns)
    if flag == b"P" and _count_threads():
        flag, err = b"F", "the program left threads running"
    emit(b"L", flag, text(err))
    if flag != b"P":
        emit(b"D")
        try:
            _stdout.flush(); _stderr.flush()
        except BaseException:
            pass
        _exit(0)

    def run_steps(ns):
        timeouts = 0
        for step, (kind, index, code, compile_error) in enumerate(test_codes):
            if timeouts >= job["max_timeouts"]:
                emit(b"X", num(timeouts))
                break
            emit(b"B", num(step))
            if code is None:
                flag, err = b"F", compile_error
            else:
                flag, err = run(code, ns)
            if kind == "t":
                emit(b"R", num(index), flag, text(err))
            elif flag != b"P":
                emit(b"U", num(step), flag, text(err))
            if flag == b"T":
                timeouts += 1
        emit(b"D")
        try:
            _stdout.flush(); _stderr.flush()
        except BaseException:
            pass
        _exit(0)  # skip the program's atexit handlers and non-daemon threads

    if program_scope:  # no candidate wrapper, no separate test namespace
        run_steps(prog_ns)
    entry = prog_ns.get(job["entry_point"])

    def candidate(*args, **kwargs):
        if entry is None or not _callable(entry):
            raise _NameError("name %r is not defined" % job["entry_point"])
        # The candidate can reach the test namespace through its caller's frame
        # (sys._getframe(2).f_globals): undo whatever it changed there during the call. Test code
        # itself does not run during the call, so this loses no legitimate assignment.
        saved = _dict(tns)
        try:
            value = entry(*args, **kwargs)
        finally:
            restore(True)
            _dict_clear(tns)
            _dict_update(tns, saved)
            _dict_clear(tns_builtins)
            _dict_update(tns_builtins, pristine_builtins)
        if _count_threads():
            raise _RuntimeError("the candidate left threads running")
        check_plain(value)
        return value

    def assert_eq(left, right, got_is_left):
        if left == right:
            return
        got, expected = (left, right) if got_is_left else (right, left)

        def short(v):
            try:
                s = _repr(v)
            except BaseException:
                s = "<unrepresentable>"
            return s if _len(s) <= 120 else s[:117] + "..."

        raise _EqFailure("expected " + short(expected) + ", got " + short(got))

    # ---- 6. run the tests in their own namespace with pristine builtins ---------------------
    tns_builtins = dict(pristine_builtins)
    tns = {"__name__": "__check__", "__builtins__": tns_builtins, "__sandbox_assert_eq__": assert_eq}
    flag, err = run(prelude, tns)
    if flag != b"P":
        emit(b"U", b"-1", flag, text(err))
    tns[job["param"]] = candidate
    if job["entry_point"] not in tns:
        tns[job["entry_point"]] = candidate
    run_steps(tns)

_sandbox_main(sys.argv)
'''


# ----------------------------------------------------------------------------------------------
# The parent side.
# ----------------------------------------------------------------------------------------------


def _cap(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _clean_env(tmp: str) -> dict[str, str]:
    # Built from scratch: nothing of the caller's environment (tokens, HF_*, WANDB_*) leaks.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": tmp,
        "TMPDIR": tmp,
    }


@dataclass
class _Raw:
    records: list[list[bytes]]
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    killed: str | None  # "wall" / "stall" when the parent killed the run for time
    returncode: int | None


def _has_exited(pid: int) -> bool:
    """True once the child is a zombie; WNOWAIT keeps it unreaped so its pgid stays ours."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None and info.si_pid == pid


def _drive(proc: subprocess.Popen, result_fd: int, payload: bytes, nonce: bytes, limits: SandboxLimits) -> _Raw:
    """Feed the job, collect the three pipes under the time limits, then kill the group."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    in_fd, out_fd, err_fd = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
    for fd in (in_fd, out_fd, err_fd, result_fd):
        os.set_blocking(fd, False)
    sel.register(in_fd, selectors.EVENT_WRITE)
    for fd in (out_fd, err_fd, result_fd):
        sel.register(fd, selectors.EVENT_READ)
    pidfd = -1
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except OSError:
            pidfd = -1

    caps = {out_fd: limits.max_output_bytes, err_fd: limits.max_output_bytes, result_fd: _MAX_RESULT_BYTES}
    bufs = {out_fd: bytearray(), err_fd: bytearray(), result_fd: bytearray()}
    truncated = {out_fd: False, err_fd: False}
    reading = {out_fd, err_fd, result_fd}
    records: list[list[bytes]] = []
    pending = b""  # incomplete last line of the results pipe
    to_send = memoryview(payload)
    start = last_progress = time.monotonic()
    exited_at: float | None = None
    killed: str | None = None

    while True:
        now = time.monotonic()
        if exited_at is None and _has_exited(proc.pid):
            exited_at = now
        if exited_at is not None:
            if not reading or now - exited_at > _EXIT_GRACE_S:
                break
            wait = exited_at + _EXIT_GRACE_S - now
        else:
            if now - start > limits.total_s():
                killed = "wall"
                break
            if now - last_progress > limits.watchdog_s():
                killed = "stall"
                break
            wait = min(start + limits.total_s(), last_progress + limits.watchdog_s()) - now
        if pidfd < 0:
            wait = min(wait, 0.02)
        for key, _ in sel.select(timeout=max(wait, 0.0)):
            fd = key.fd
            if fd == pidfd:
                sel.unregister(pidfd)
                continue
            if fd == in_fd:
                try:
                    n = os.write(in_fd, to_send[:65536])
                    to_send = to_send[n:]
                except BlockingIOError:
                    continue
                except OSError:  # the harness died before reading everything
                    to_send = to_send[:0]
                if not to_send:
                    sel.unregister(in_fd)
                    proc.stdin.close()
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
            if fd == result_fd and room > 0:
                lines = (pending + data[:room]).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    parts = line.split(b" ")
                    if len(parts) >= 2 and secrets.compare_digest(parts[0], nonce):
                        records.append(parts[1:])
                        last_progress = time.monotonic()

    # Kill the whole process group while the leader is still unreaped (its pgid cannot have
    # been reused), then reap it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        returncode: int | None = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        returncode = None
    sel.close()
    if pidfd >= 0:
        os.close(pidfd)
    return _Raw(
        records=records,
        stdout=bytes(bufs[out_fd]),
        stderr=bytes(bufs[err_fd]),
        stdout_truncated=truncated[out_fd],
        stderr_truncated=truncated[err_fd],
        killed=killed,
        returncode=returncode,
    )


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


def _remove_tree(path: str) -> None:
    pylib = os.path.join(path, ".pylib")
    if os.path.isdir(pylib):
        # The stdlib bind mounts live in the child's private mount namespace only; never delete
        # through one should it somehow be visible here.
        for name in os.listdir(pylib):
            if os.path.ismount(os.path.join(pylib, name)):
                log.error("sandbox: %s is a mount point; not removing %s", name, path)
                return

    def onerror(func, p, exc_info):  # e.g. a directory the program made unreadable
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    for _ in range(3):  # a killed straggler may still be creating files for a moment
        shutil.rmtree(path, onerror=onerror)
        if not os.path.exists(path):
            return
        time.sleep(0.05)
    log.warning("sandbox: could not remove %s", path)


def _summarize(plan: _Plan, raw: _Raw) -> TestOutcome:
    total = len(plan.sources)
    results: dict[int, tuple[bytes, str]] = {}
    syntax: str | None = None
    load: tuple[bytes, str] | None = None
    done = stopped = False
    flags: list[bytes] = []
    for rec in raw.records:
        try:
            kind = rec[0]
            if kind == b"S" and syntax is None:
                syntax = f"line {int(rec[1])}: {_decode_hex(rec[2])}"
            elif kind == b"L" and len(rec) >= 3 and load is None:
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
            elif kind == b"D":
                done = True
        except (IndexError, ValueError):
            continue  # a garbled record: ignored, the test stays unreported (= failed)

    stderr = _output(raw.stderr, raw.stderr_truncated)
    rc = raw.returncode
    oom_crash = raw.killed is None and rc is not None and rc != 0 and not done and (
        "MemoryError" in stderr or "Cannot allocate memory" in stderr or "out of memory" in stderr
    )
    if syntax is not None:
        missing = f"not run: syntax error in the program ({syntax})"
    elif load is not None and load[0] != b"P":
        missing = f"not run: the program failed while loading ({load[1]})"
    elif raw.killed is not None:
        missing = "not run: the sandbox run timed out"
    elif stopped:
        missing = f"not run: stopped after {plan.max_timeouts} timed-out tests"
    elif rc is not None and rc < 0:
        try:
            signame = signal.Signals(-rc).name
        except ValueError:
            signame = str(-rc)
        missing = f"not run: the sandbox process was killed by {signame}"
    else:
        missing = f"not run: the sandbox process ended early (exit code {rc})"

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
    elif raw.killed is not None or b"T" in flags or (rc is not None and rc == -signal.SIGXCPU):
        status = Status.TIMEOUT
    elif b"M" in flags or oom_crash:
        status = Status.OUT_OF_MEMORY
    else:
        status = Status.FAILED
    if raw.killed is not None:
        stderr += f"\n[sandbox: killed after {'the wall-clock limit' if raw.killed == 'wall' else 'no progress'}]"
    return TestOutcome(status, n_passed, total, per_test, _output(raw.stdout, raw.stdout_truncated), stderr)


def _failure(plan: _Plan | None, message: str) -> TestOutcome:
    sources = plan.sources if plan is not None else []
    per_test = [TestResult(s, False, f"not run: {message}") for s in sources]
    return TestOutcome(Status.FAILED, 0, len(sources), per_test, "", message)


def run_tests(program: str, test_code: str, entry_point: str, limits: SandboxLimits | None = None) -> TestOutcome:
    """Run HumanEval-style `test_code` (defining `check(candidate)`) against `program`.

    `candidate` is bound to the program's `entry_point`. Every top-level statement of check's
    body that is or contains an assert is one test; all tests run (each under the per-test
    time limit) until `MAX_TEST_TIMEOUTS` of them time out. Never raises: failures of the
    sandbox itself come back as a FAILED outcome with the reason in `stderr`.
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


def _run_plan(program: str, entry_point: str, plan: _Plan, limits: SandboxLimits) -> TestOutcome:
    nonce = secrets.token_hex(16)
    job = {
        "nonce": nonce,
        "program": program,
        "entry_point": entry_point,
        "param": plan.param,
        "prelude": plan.prelude,
        "steps": plan.steps,
        "modules": plan.modules,
        "timeout_s": float(limits.timeout_s),
        "max_timeouts": plan.max_timeouts,
        "scope": plan.scope,
        "evals": plan.evals,
        "preload": plan.preload,
    }
    payload = json.dumps(job).encode("utf-8", "surrogatepass")
    drop = os.geteuid() == 0
    tmp = tempfile.mkdtemp(prefix="marl-sandbox-")
    read_fd = write_fd = -1
    proc: subprocess.Popen | None = None
    try:
        if drop:
            os.chown(tmp, NOBODY, NOBODY)
        os.chmod(tmp, 0o700)
        read_fd, write_fd = os.pipe()
        argv = [
            sys.executable, "-I", "-S", "-c", _HARNESS,
            str(write_fd),
            str(int(limits.memory_mb) << 20),
            str(math.ceil(limits.total_s()) + 1),
            str(int(limits.max_procs)),
            str(int(limits.max_file_mb) << 20),
            "1" if drop else "0",
            str(NOBODY),
        ]  # fmt: skip
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp,
            env=_clean_env(tmp),
            pass_fds=(write_fd,),
            start_new_session=True,
            close_fds=True,
        )
        os.close(write_fd)
        write_fd = -1
        raw = _drive(proc, read_fd, payload, nonce.encode("ascii"), limits)
        return _summarize(plan, raw)
    finally:
        if proc is not None:
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
        for fd in (read_fd, write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as e:
                    if e.errno != errno.EBADF:
                        raise
        _remove_tree(tmp)


def run_tests_many(
    jobs: list[tuple[str, str, str]], limits: SandboxLimits | None = None, workers: int = 2
) -> list[TestOutcome]:
    """`run_tests` for each (program, test_code, entry_point), `workers` at a time, in order."""
    limits = limits or SandboxLimits()
    if not jobs:
        return []
    if workers <= 1 or len(jobs) == 1:
        return [run_tests(p, t, e, limits) for p, t, e in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], job[2], limits), jobs))


@dataclass
class ProgramScopeTest:
    """One test of `run_program_scope_tests`: each of `evals` (expressions) is evaluated, then
    `source` (a statement, e.g. an assert line) is executed, all in the program's own globals;
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
    """Run `tests` inside the program's own global namespace: the harness of reference rewards
    that `exec` the program into a dict and then `exec` assert lines into that same dict.

    The globals start as the `preload` stdlib modules (bound by name) plus the builtins; the
    program runs in them, then each test in order, each under the per-test time limit, until
    `max_timeouts` tests have timed out. Same process isolation, limits and result channel as
    `run_tests`, but no candidate wrapper: nothing checks the returned types, and tests see (and
    may change) everything the program defines. Unless `limits.total_timeout_s` is set, the run
    may last `(max_timeouts + 1) * timeout_s + 2` seconds. Never raises.
    """
    limits = limits or SandboxLimits()
    if limits.total_timeout_s is None:
        limits = replace(limits, total_timeout_s=(max_timeouts + 1) * float(limits.timeout_s) + 2.0)
    plan = _Plan(
        prelude="",
        param="",
        steps=[("t", i, t.source) for i, t in enumerate(tests)],
        sources=[_cap(t.source, MAX_ERROR_CHARS) for t in tests],
        modules=sorted(set(preload)),
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

    def one(job: tuple[str, list[ProgramScopeTest]]) -> TestOutcome:
        return run_program_scope_tests(job[0], job[1], limits, preload, max_timeouts)

    if workers <= 1 or len(jobs) == 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, jobs))


# A test file with no tests: the harness runs the program and reports nothing else.
_NO_TESTS = "def check(candidate):\n    pass\n"


def run_programs(programs: list[str], limits: SandboxLimits | None = None, workers: int = 2) -> list[TestOutcome]:
    """Run each program for its output alone (e.g. a tool agent's script that prints moves), with
    the same isolation and limits as the tests; read `.stdout`, `.stderr` and `.status`."""
    return run_tests_many([(p, _NO_TESTS, "__program__") for p in programs], limits, workers)
