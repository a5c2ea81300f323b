"""The trainer's handle on the judges: the judge zygote (child/main.py), one warm interpreter per
trainer process that forks one judge per run, and the set of live judges that `kill_all` ends on
an interrupt and at exit.

Every wait on a judge or the zygote has a deadline: a zygote that does not answer within
`SPAWN_TIMEOUT_S` (stopped, wedged) is killed and started again once, and a judge that is still
there `END_GRACE_S` after its run was ended is killed through its pidfd (which cannot name a
reused pid)."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

_MAIN = str(Path(__file__).resolve().parent / "child" / "main.py")
SPAWN_TIMEOUT_S = 10.0  # the zygote forks a judge in milliseconds; this is for a stopped or wedged one
END_GRACE_S = 0.5  # a judge whose run has ended leaves at once; past this it is killed


class _Zygote:
    """The judges' zygote (child/main.py `serve_forever`), started on first use: each run's judge
    is a fork of it, so a run pays no interpreter start-up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _MAIN, str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True, close_fds=True,
            )  # fmt: skip
        finally:
            theirs.close()
        ours.settimeout(SPAWN_TIMEOUT_S)
        self.sock = ours

    def spawn(self, cfg: dict, fds: list[int]) -> tuple[int, int]:
        """Fork a judge for `cfg`, handing it `fds`: (its pid, a pidfd of it)."""
        with self.lock:
            for attempt in (0, 1):
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
                assert self.sock is not None
                try:
                    socket.send_fds(self.sock, [json.dumps(cfg).encode()], fds)
                    msg, pidfds, _, _ = socket.recv_fds(self.sock, 64, 1)
                    if msg and len(pidfds) == 1:
                        return int(msg), pidfds[0]
                    for fd in pidfds:
                        os.close(fd)
                except (OSError, ValueError):  # it died, or did not answer in time (socket.timeout)
                    pass
                self.close()  # start a new one, once
            raise OSError(f"the sandbox's judge process could not be started (no answer in {SPAWN_TIMEOUT_S:g} s)")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


zygote = _Zygote()


class Judge:
    """One run's judge as the trainer holds it: closing its control pipe ends it (it ends its
    candidate's processes first); `end` makes sure it has gone."""

    def __init__(self, control_w: int, pidfd: int):
        self.control_w = control_w
        self.pidfd = pidfd
        self.lock = threading.Lock()

    def kill(self) -> None:
        with self.lock:
            if self.control_w >= 0:
                os.close(self.control_w)
                self.control_w = -1

    def end(self, grace_s: float = END_GRACE_S) -> None:
        """Close its control pipe, give it `grace_s` to leave, then kill it (a stopped or wedged
        judge does not leave by itself). Waits at most `grace_s` plus a moment for the kill."""
        self.kill()
        with self.lock:
            if self.pidfd < 0:
                return
            if not select.select([self.pidfd], [], [], grace_s)[0]:  # readable once it has exited
                try:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except OSError:
                    pass
                select.select([self.pidfd], [], [], 1.0)
            os.close(self.pidfd)
            self.pidfd = -1

    def kill_now(self) -> None:
        """End it at once (an interrupt, the trainer's exit): its candidate's processes die with it."""
        self.kill()
        with self.lock:
            if self.pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except OSError:
                    pass


# ------------------------------------------------------------------------------------------------
# Live runs: an interrupted trainer (Ctrl-C, an exception) ends them all before it goes on.
# ------------------------------------------------------------------------------------------------

_live: set[Judge] = set()
_live_lock = threading.Lock()


def track(judge: Judge) -> None:
    """Count `judge` among the live runs that `kill_all` ends."""
    with _live_lock:
        _live.add(judge)


def untrack(judge: Judge) -> None:
    with _live_lock:
        _live.discard(judge)


def kill_all() -> None:
    """End every sandbox run of this process now (their judges; each judge's death ends its
    candidate's namespace). Called on interrupt and at exit."""
    with _live_lock:
        judges = list(_live)
    for j in judges:
        j.kill_now()


atexit.register(kill_all)
atexit.register(zygote.close)
