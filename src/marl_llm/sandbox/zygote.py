"""The trainer's handle on the judges: the judge zygote (child/main.py), one warm interpreter per
trainer process that forks one judge per run, and the set of live judges that `kill_all` ends on
an interrupt and at exit."""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

_MAIN = str(Path(__file__).resolve().parent / "child" / "main.py")


class _Zygote:
    """The judges' zygote (child/main.py `serve_forever`), started on first use: each run's judge
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


zygote = _Zygote()


class Judge:
    """One run's judge as the trainer holds it: closing its control pipe ends it."""

    def __init__(self, control_w: int):
        self.control_w = control_w
        self.lock = threading.Lock()

    def kill(self) -> None:
        with self.lock:
            if self.control_w >= 0:
                os.close(self.control_w)
                self.control_w = -1


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
        j.kill()


atexit.register(kill_all)
atexit.register(zygote.close)
