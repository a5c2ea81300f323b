"""The sandbox's judge zygote: `python -I -S main.py <socket fd>`, one per trainer process, started
by zygote.py. Everything a judge needs is imported once here; each request (a config and its
pipes, passed over the socket) is served by a forked judge (judge.py). The zygote holds nothing of
any job (judges read theirs after forking), so a fork carries no test to the candidate."""

import json
import os
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import confine  # noqa: E402
import judge  # noqa: E402

PR_SET_PDEATHSIG = 1


def serve_forever(sock_fd):
    """The judges' zygote: one per trainer process, everything imported once; each request (a
    config and its pipes, passed over the socket) is served by a forked judge. It holds nothing
    of any job (judges read theirs after forking), so a fork carries no test to the candidate."""
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # it ends with the trainer
    sock = socket.socket(fileno=sock_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # judges are reaped by the kernel
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                judge.judge_main(json.loads(msg), fds)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        sock.sendall(b"%d\n" % pid)


if __name__ == "__main__":
    serve_forever(int(sys.argv[1]))
