"""The judge's channel to the candidate's process (stdlib only): requests out, answers in, each
matched by id; and what the judge makes of an answer that is an exception."""

import builtins
import os
import select
import signal

import candidate
import codec


class Timeout(BaseException):
    """A step ran past its time limit (raised by the judge's alarm)."""


class Gone(Exception):
    """The candidate's processes no longer answer."""


def read_line(fd):
    out = b""
    while not out.endswith(b"\n"):
        b = os.read(fd, 1)
        if not b:
            return None
        out += b
    return out.strip()


class Channel:
    """Requests to the candidate; each answer is matched by id (a late answer to a call that
    timed out is dropped)."""

    def __init__(self, req_w, rep_r, c2j_r):
        self.req_w, self.rep_r, self.c2j_r = req_w, rep_r, c2j_r
        self.next_id = 0
        self.gone = None  # why the candidate no longer answers
        self.exit_code = None

    def _mark_gone(self, why):
        if self.gone is None:
            self.gone = why

    def _ended(self):
        code = self.wait_exit()
        if code is not None and code < 0:
            try:
                return "the candidate's process was killed by %s" % signal.Signals(-code).name
            except ValueError:
                pass
        if code is not None:
            return "the candidate's process exited (code %d)" % code
        return "the candidate's process ended"

    def send(self, msg):
        if self.gone:
            raise Gone(self.gone)
        try:
            candidate.write_message(self.req_w, msg)
        except Timeout:
            self._mark_gone("the candidate stopped reading")
            raise
        except OSError:
            self._mark_gone(self._ended())
            raise Gone(self.gone)

    def receive(self, want_id=None):
        """The next answer (to request `want_id`: answers to earlier requests are dropped). An
        unreadable answer comes back as {"unreadable": why}."""
        while True:
            try:
                reply = candidate.read_message(self.rep_r, codec.MAX_REPLY_BYTES)
            except Timeout:
                self._mark_gone("the candidate stopped answering")
                raise
            except codec.Unreadable as e:
                if getattr(e, "fatal", False):  # the rest of the stream cannot be read in step
                    self._mark_gone("the candidate sent %s" % e)
                    raise Gone(self.gone)
                return {"unreadable": str(e)}
            except (OSError, ValueError):
                reply = None
            if reply is None:
                self._mark_gone(self._ended())
                raise Gone(self.gone)
            if type(reply) is not dict:
                continue
            if want_id is None or reply.get("id") == want_id:
                return reply

    def request(self, msg, timeout):
        self.next_id += 1
        msg["id"] = self.next_id
        msg["timeout"] = timeout
        self.send(msg)
        return self.receive(self.next_id)

    def wait_exit(self):
        """The candidate's exit code as C reported it (None if unknown)."""
        if self.exit_code is None:
            r, _, _ = select.select([self.c2j_r], [], [], 0.2)
            if r:
                line = read_line(self.c2j_r)
                if line and line.startswith(b"x "):
                    self.exit_code = int(line[2:])
        return self.exit_code


def rebuild_exception(e):
    try:
        name, msg = str(e[0]), str(e[1])
    except BaseException:
        return Exception("the candidate raised an exception")
    cls = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(msg)
        except BaseException:
            pass
    return Exception(name + ": " + msg if msg else name)
