"""The candidate's processes (stdlib only), forked by the judge before it reads the job, so that
they never hold the tests: C, the namespace keeper (it holds the candidate's PID reserved and kills
it when the judge dies), and the candidate, confined step by step before it serves the judge's
calls (candidate.py).

The candidate's confinement, in order: (namespaces mode) new namespaces, the private root, no
privileges (confine.py); (process mode) nobody's uid when the trainer is root, and death with its
judge; then in both modes its rlimits, a scrubbed environment, no inherited fds, a fresh empty
session keyring, no_new_privs, (process mode) Landlock (landlock.py), and last the seccomp filter
(seccomp.py)."""

import os
import signal

import candidate
import confine
import landlock
import seccomp

PR_SET_PDEATHSIG = 1


def clean_env():
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp"}


def become_candidate(cfg, parent_pid, req_r, rep_w):
    """(In the candidate's process; in namespaces mode, inside its namespaces and root already.)
    The rest of its confinement, then serve the judge."""
    process_mode = cfg["mode"] == "process"
    if process_mode and cfg["drop_to"] >= 0:
        for name in cfg["preimport"]:  # the stdlib may be unreadable to nobody (a Python under /root)
            try:
                __import__(name)
            except BaseException:
                pass
        os.setgroups([])
        os.setgid(cfg["drop_to"])
        os.setuid(cfg["drop_to"])
        if os.getuid() != cfg["drop_to"] or os.geteuid() != cfg["drop_to"]:
            os._exit(70)
    # Dies with its parent (set after the uid change, which clears it). (As PID 1 of its namespace,
    # its parent is outside: `parent_pid` None.)
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(70)
    confine.set_limits(cfg["limits"])
    os.environ.clear()
    os.environ.update(clean_env())
    if process_mode:
        os.environ["HOME"] = os.environ["TMPDIR"] = cfg["workdir"]
    for fd in range(3, 1024):
        if fd not in (req_r, rep_w):
            try:
                os.close(fd)
            except OSError:
                pass
    try:
        confine.join_new_session_keyring()
    except OSError:
        if not cfg["seccomp"]:  # (with the filter, keyrings are out of reach anyway)
            raise
    confine.prctl(confine.PR_SET_NO_NEW_PRIVS, 1)
    if cfg["landlock_abi"]:
        landlock.restrict(cfg["landlock_abi"], cfg["landlock_rules"] + [[cfg["workdir"], "rw"]])
    if cfg["seccomp"]:
        seccomp.install(cfg["single_task"], process_mode)
    candidate.serve(req_r, rep_w)


def run_keeper(cfg, judge_pid, req_r, rep_w, c2j_w, j2c_r, to_close):
    """C: confine, start the candidate, hold its PID until the judge is done."""
    try:
        for fd in to_close:
            os.close(fd)
        os.dup2(cfg["fds"]["out"], 1)
        os.dup2(cfg["fds"]["err"], 2)
        os.close(cfg["fds"]["out"])
        os.close(cfg["fds"]["err"])
        if cfg["mode"] == "process":
            os.setsid()  # its own process group, which the judge ends as a whole
            os.chdir(cfg["workdir"])
            os.write(c2j_w, b"%d\n" % os.getpid())
            os.close(c2j_w)
            os.close(j2c_r)
            become_candidate(cfg, judge_pid, req_r, rep_w)
        # Undumpable as a fork of the zygote: dumpable again, so that the judge may write our
        # uid/gid maps (C holds nothing of the job; the candidate cannot see it).
        confine.prctl(confine.PR_SET_DUMPABLE, 1)
        confine.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
        bind_fds = confine.enter_namespaces(c2j_w, j2c_r, cfg["max_tasks"], [p for p, _ in cfg["binds"]])
        # Again: becoming the namespace's root changed our uid (to nobody's, when the trainer is
        # root), which clears the parent-death signal. (If the judge died in between: see below.)
        confine.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
        cp = os.fork()
        if cp == 0:
            os.close(c2j_w)
            os.close(j2c_r)
            # A new session: kill(0, sig) reaches the caller's process group even across PID
            # namespaces, and ours would otherwise be the zygote's (every run, the judges).
            os.setsid()
            confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            confine.build_root(cfg, bind_fds)
            confine.drop_privileges()
            become_candidate(cfg, None, req_r, rep_w)
        for fd in bind_fds + [req_r, rep_w]:
            os.close(fd)

        def kill(signum=None, frame=None):
            try:
                os.kill(cp, signal.SIGKILL)  # PID 1 of the namespace: everything in it ends
            except OSError:
                pass

        signal.signal(signal.SIGUSR1, kill)
        signal.signal(signal.SIGTERM, kill)
        if os.getppid() != judge_pid:
            kill()
        os.write(c2j_w, b"%d\n" % cp)
        info = os.waitid(os.P_PID, cp, os.WEXITED | os.WNOWAIT)  # reaped only when we exit
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        os.write(c2j_w, b"x %d\n" % code)
        os.read(j2c_r, 1)  # the judge is done with the PID (or gone)
        os._exit(0)
    except BaseException as e:
        try:
            os.write(2, ("sandbox: the isolation setup failed: %s\n" % (e,)).encode())
        finally:
            os._exit(71)
