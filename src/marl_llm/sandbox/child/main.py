"""The sandbox's judge zygote: `python -I -S main.py <socket fd> <trainer pid>`, one per trainer
process, started by zygote.py. Everything a judge needs is imported once here; each request (a
config and its pipes, one message on a SOCK_SEQPACKET socket) is served by a forked judge
(judge.py), and answered with the judge's pid and a pidfd of it. The zygote holds nothing of any
job (judges read theirs after forking), so a fork carries no test to the candidate.

It is undumpable (so are the judges it forks): a process-mode candidate of the same uid cannot
read or write its memory or take its fds through /proc, ptrace or pidfd_getfd. It outlives the
trainer only to clean up: when the trainer dies (its parent-death signal, or the socket's end),
it kills every live judge and removes their cgroups and work dirs, then leaves.
"""

import json
import os
import signal
import socket
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cleanup  # noqa: E402
import confine  # noqa: E402
import judge  # noqa: E402

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
_REPLY_TIMEOUT_S = 10.0
_SIGNALS = {signal.SIGCHLD, signal.SIGTERM}

_judges = {}  # pid -> (pidfd, its run's cgroup dirs, its work dir)


def _reap(signum=None, frame=None):
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        entry = _judges.pop(pid, None)
        if entry is not None:
            os.close(entry[0])


def _trainer_gone():
    """End every live judge (their candidates die with them) and remove what their runs left."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    for pidfd, _, _ in _judges.values():
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
    for _, cgroups, workdir in _judges.values():
        for path in cgroups:
            cleanup.remove_cgroup(path, timeout_s=2.0)
        if workdir:
            cleanup.remove_workdir(workdir)
    os._exit(0)


def serve_forever(sock_fd, trainer_pid):
    """Fork a judge for each request until the trainer is gone."""

    def on_parent_death(signum, frame):
        # The signal comes when the trainer *thread* that started us ends; only the trainer
        # process's death (we are then someone else's child) is the end.
        if os.getppid() != trainer_pid:
            _trainer_gone()

    # Judges and candidates (our forks) are the first the OOM killer takes, before the trainer; as
    # root this is also the floor below which none of them may set it. (Written while our /proc
    # files are still ours: an undumpable process's belong to root.)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    confine.prctl(PR_SET_DUMPABLE, 0)
    signal.signal(signal.SIGTERM, on_parent_death)
    signal.signal(signal.SIGCHLD, _reap)
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != trainer_pid:
        _trainer_gone()
    sock = socket.socket(fileno=sock_fd)
    while True:
        sock.settimeout(None)
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 22, 8)
        except OSError:
            msg, fds = b"", []
        if not msg:
            _trainer_gone()
        cfg = json.loads(msg)
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # reaped only after its pidfd is open
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                for sig in _SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
                judge.judge_main(cfg, fds)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(70)
        pidfd = os.pidfd_open(pid)
        _judges[pid] = (pidfd, cfg.get("cgroups", []), cfg.get("workdir", ""))
        for fd in fds:
            os.close(fd)
        sock.settimeout(_REPLY_TIMEOUT_S)
        try:
            socket.send_fds(sock, [b"%d" % pid], [pidfd])
        except OSError:
            _trainer_gone()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


if __name__ == "__main__":
    serve_forever(int(sys.argv[1]), int(sys.argv[2]))
