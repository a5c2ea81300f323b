"""The judge: the trusted side of a sandbox run (stdlib only).

Forked, per run, from the zygote (main.py). It forks the candidate's processes *before* it reads
the job (keeper.py: so they never hold the tests), then runs the test code itself, in its own
namespace, with a stand-in for each program name that forwards the call to the candidate
(channel.py) and decodes the answer (codec.py). Only the judge compares, and only the judge writes
the verdict, on a pipe the candidate's processes never hold.

Processes: trainer -> judge J -> C (namespace keeper: holds the candidate's PID reserved, kills
it when J dies) -> candidate (PID 1 of its namespace; its end ends everything in it).

Records to the trainer, one per line, fields separated by spaces (text fields hex-encoded):
  P pid              the candidate's PID (the trainer can kill its namespace)
  I                  alive, the job is read next
  S line msg         the program does not compile
  L flag msg         the program ran (flag P/F/T/M)
  B step             a step begins
  R test flag msg    a test's verdict (P/F/T/M)
  U step flag msg    a setup step failed
  X n                stopped after n timed-out tests
  E code             the candidate's processes ended (exit code, or -signal)
  D                  done
"""

import builtins
import json
import os
import resource
import signal
import threading
import time

import candidate
import codec
import confine
from channel import Channel, Gone, Timeout, read_line, rebuild_exception
from keeper import run_keeper

_GRACE_S = 0.5  # the judge waits this long past a step's limit for the candidate's own timeout


class _EqFailure(AssertionError):
    pass


class _Reported(Exception):
    pass


def _hex(s, cap=600):
    try:
        b = str(s).encode("utf-8", "replace")
    except BaseException:
        b = b"<unprintable>"
    return b[:cap].hex().encode("ascii") or b"-"


def _watch_control(fd, cand_pid, process_mode):
    """The trainer ends a judge by closing its control pipe (or by dying): leave at once. With
    namespaces our death makes C end the candidate's namespace; in process mode we end the
    candidate's process group first (its id is still reserved: the candidate is our unreaped
    child)."""
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except OSError:
            break
    if process_mode:
        _end_process_group(cand_pid)
    os._exit(1)


def _end_process_group(pid):
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _set_own_limits(limits):
    """The judge's own limits (after the candidate's processes are forked, which set theirs): its
    memory at most the run's `memory_mb` past what it holds now, its CPU time the run's wall-clock
    cap. A crafted answer that slipped past the codec's bounds cannot make it outgrow the run."""
    with open("/proc/self/statm") as f:
        held = os.sysconf("SC_PAGE_SIZE") * int(f.read().split()[0])
    for res, value in ((resource.RLIMIT_AS, held + limits["as_extra"]), (resource.RLIMIT_CPU, limits["cpu"]),
                       (resource.RLIMIT_CORE, 0)):
        _, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, hard))


def judge_main(cfg, fds):
    """One run. fds: [control/job, results, candidate stdout, candidate stderr, judge stderr]."""
    control, result_fd, out_fd, err_fd, jerr_fd = fds
    os.dup2(jerr_fd, 2)
    os.close(jerr_fd)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    cfg["fds"] = {"out": out_fd, "err": err_fd}
    judge_pid = os.getpid()
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    c2j_r, c2j_w = os.pipe()
    j2c_r, j2c_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        run_keeper(cfg, judge_pid, req_r, rep_w, c2j_w, j2c_r, (req_w, rep_r, c2j_r, j2c_w, result_fd, control))
    for fd in (req_r, rep_w, c2j_w, j2c_r, out_fd, err_fd):
        os.close(fd)
    _set_own_limits(cfg["judge_limits"])

    def emit(*fields):
        line = b" ".join(fields) + b"\n"
        while line:
            line = line[os.write(result_fd, line):]

    def num(i):
        return str(i).encode("ascii")

    if cfg["mode"] == "namespaces":
        if os.read(c2j_r, 1) != b"u":
            emit(b"E", b"71")
            emit(b"D")
            os._exit(0)
        confine.write_id_maps(pid, cfg["ids"][0], cfg["ids"][1])
        for procs in cfg["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(pid))
        os.write(j2c_w, b"k")
    line = read_line(c2j_r)
    if line is None:
        emit(b"E", b"71")
        emit(b"D")
        os._exit(0)
    cand_pid = int(line)
    emit(b"P", num(cand_pid))
    emit(b"I")
    head = candidate._read_exact(control, 4)
    job = candidate._read_exact(control, int.from_bytes(head, "big")) if head else None
    if job is None:
        os._exit(1)
    process_mode = cfg["mode"] == "process"
    threading.Thread(target=_watch_control, args=(control, cand_pid, process_mode), daemon=True).start()
    channel = Channel(req_w, rep_r, c2j_r)
    try:
        _judge(json.loads(job), channel, emit, num)
    finally:
        if process_mode:
            _end_process_group(cand_pid)  # our unreaped child: its ids are still its own
        else:
            try:
                os.kill(cand_pid, signal.SIGKILL)  # still reserved: C holds it unreaped
            except OSError:
                pass
        code = channel.wait_exit()
        if code is not None:
            emit(b"E", num(code))
        emit(b"D")
        os.close(result_fd)  # the trainer is done with us: it need not wait for C
        os.close(2)
        try:
            os.write(j2c_w, b"x")
        except OSError:
            pass
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass
    os._exit(0)


def _judge(job, channel, emit, num):
    timeout_s = float(job["timeout_s"])
    program_scope = job["scope"] == "program"
    timed_out = [False]
    deadline = [0.0]

    def on_alarm(signum, frame):
        timed_out[0] = True
        raise Timeout()

    signal.signal(signal.SIGALRM, on_alarm)

    def remaining():
        return max(deadline[0] - time.monotonic(), 0.001)

    def describe(e):
        try:
            if timed_out[0] or isinstance(e, Timeout):
                return "timed out after %gs" % timeout_s
            t = type(e)
            if t is _EqFailure or t is _Reported or t is Gone:
                return str(e.args[0])
            msg = str(e)
            return t.__name__ + ": " + msg if msg else t.__name__
        except BaseException:
            return "<unprintable exception>"

    def run(code, ns):
        """Run one code object under the per-test time limit -> (flag, error)."""
        timed_out[0] = False
        deadline[0] = time.monotonic() + timeout_s
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s + _GRACE_S)
            try:
                if type(code) is tuple:  # program scope: (code object or None, error) pieces
                    refresh(ns)
                    for piece, error in code:
                        if piece is None:
                            raise _Reported(error)
                        exec(piece, ns)
                else:
                    exec(code, ns)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as e:  # noqa: B036  (the tests' own exceptions are verdicts)
            signal.setitimer(signal.ITIMER_REAL, 0)
            if timed_out[0] or isinstance(e, Timeout):
                return b"T", describe(e)
            if isinstance(e, MemoryError):
                return b"M", "MemoryError"
            return b"F", describe(e)
        return b"P", ""

    class Remote:
        """Stands in for a program function: the call runs in the candidate's process."""

        def __init__(self, name):
            self.name = name

        def __repr__(self):
            return "<function %s>" % self.name

        def __call__(self, *args, **kwargs):
            try:
                payload = {"op": "call", "name": self.name, "args": codec.encode(args), "kwargs": codec.encode(kwargs)}
            except (codec.EncodeError, RecursionError) as e:
                raise TypeError("an argument cannot be sent to the sandbox: %s" % e)
            reply = channel.request(payload, remaining())
            return _answer(reply)

    def _answer(reply):
        if "unreadable" in reply:
            raise TypeError("the candidate's answer cannot be read: %s" % reply["unreadable"])
        if "r" in reply:
            try:
                return codec.decode(reply["r"])
            except codec.Unreadable as e:
                raise TypeError("the candidate's answer cannot be read: %s" % e)
            except (ValueError, TypeError, RecursionError, ArithmeticError) as e:
                raise TypeError("the candidate's answer cannot be read: a malformed value (%s)" % describe(e))
        if "t" in reply:
            timed_out[0] = True
            raise Timeout()
        if "m" in reply:
            raise MemoryError()
        return_error = reply.get("e")
        raise rebuild_exception(return_error if type(return_error) is list and len(return_error) == 2 else ["", ""])

    # ---- compile the (trusted) test code ---------------------------------------------------
    test_codes = []
    for step, (kind, index, src) in enumerate(job["steps"]):
        pieces = [(expr, "eval") for expr in job["evals"][step]] if program_scope else []
        compiled = []
        for piece_src, mode in pieces + [(src, "exec")]:
            try:
                compiled.append((compile(piece_src, "<test>", mode), None))
            except BaseException as e:
                compiled.append((None, describe(e)))
        if program_scope:  # a piece that does not compile fails the test when reached
            test_codes.append((kind, index, tuple(compiled), None))
        else:
            test_codes.append((kind, index, compiled[0][0], compiled[0][1]))
    prelude = compile(job["prelude"], "<test prelude>", "exec")

    # ---- load the program in the candidate's process ----------------------------------------
    load = {"op": "load", "program": job["program"], "preload": job["preload"], "timeout": timeout_s}
    timed_out[0] = False
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s + _GRACE_S)
        try:
            channel.send(load)
            reply = channel.receive()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as e:  # noqa: B036
        signal.setitimer(signal.ITIMER_REAL, 0)
        flag = b"T" if timed_out[0] or isinstance(e, Timeout) else b"F"
        emit(b"L", flag, _hex(describe(e)))
        return
    if "syntax" in reply:
        try:
            line, msg = int(reply["syntax"][0]), str(reply["syntax"][1])
        except BaseException:
            line, msg = 0, "syntax error"
        emit(b"S", num(line), _hex(msg))
        return
    flag = str(reply.get("load", "F")).encode()[:1]
    if flag not in (b"P", b"F", b"T", b"M"):
        flag = b"F"
    error = reply.get("error", "")
    if "unreadable" in reply:
        error = "the candidate's answer cannot be read: " + reply["unreadable"]
    emit(b"L", flag, _hex(error))
    if flag != b"P":
        return
    names = reply.get("names") if type(reply.get("names")) is dict else {}

    value_names = set()
    if program_scope:
        ns = {"__builtins__": builtins}
        for name in job["preload"]:
            try:
                ns[name] = __import__(name)
            except BaseException:
                pass
        referenced = set()
        for _, _, pieces, _ in test_codes:
            for piece, _ in pieces:
                if piece is not None:
                    stack = [piece]
                    while stack:
                        c = stack.pop()
                        referenced.update(c.co_names)
                        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
        for name, kind in names.items():
            if type(name) is not str or name in ns:
                continue
            if kind == "f":
                ns[name] = Remote(name)
            elif name in referenced:
                value_names.add(name)

    def refresh(ns):
        # Program values the tests read are fetched as they are now (the program may change them).
        for name in value_names:
            reply = channel.request({"op": "get", "name": name}, remaining())
            ns[name] = _answer(reply)

    def assert_eq(left, right, got_is_left):
        if left == right:
            return
        got, expected = (left, right) if got_is_left else (right, left)

        def short(v):
            try:
                s = repr(v)
            except ValueError:  # an int past the 4300 digits that int -> str allows
                if type(v) is int:
                    return "an int of about %d digits" % (v.bit_length() * 0.30103 + 1)
                return "a %s that holds an int of over 4300 digits" % type(v).__name__
            except BaseException:
                s = "<unrepresentable>"
            return s if len(s) <= 120 else s[:117] + "..."

        raise _EqFailure("expected " + short(expected) + ", got " + short(got))

    def run_steps(ns):
        timeouts = 0
        for step, (kind, index, code, compile_error) in enumerate(test_codes):
            if timeouts >= job["max_timeouts"]:
                emit(b"X", num(timeouts))
                break
            emit(b"B", num(step))
            if code is None:
                flag, err = b"F", compile_error
            elif channel.gone:
                flag, err = b"F", "not run: " + channel.gone
            else:
                flag, err = run(code, ns)
            if kind == "t":
                emit(b"R", num(index), flag, _hex(err))
            elif flag != b"P":
                emit(b"U", num(step), flag, _hex(err))
            if flag == b"T":
                timeouts += 1

    if program_scope:
        run_steps(ns)
        return
    entry = Remote(job["entry_point"])
    tns = {"__name__": "__check__", "__builtins__": builtins, "__sandbox_assert_eq__": assert_eq}
    flag, err = run(prelude, tns)
    if flag != b"P":
        emit(b"U", b"-1", flag, _hex(err))
    tns[job["param"]] = entry
    if job["entry_point"] not in tns:
        tns[job["entry_point"]] = entry
    run_steps(tns)
