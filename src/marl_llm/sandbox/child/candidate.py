"""The candidate's side: run the program and answer the judge's calls (stdlib only).

Everything in this process is untrusted once the program has run: it may rewrite this loop, the
codec, anything. That is harmless by construction: the process holds no test, no expected value
and no channel to the trainer; it can only answer calls, and the judge decides what an answer is
worth. The loop exists so that honest programs are called the way in-process tests call them.

Messages on both pipes are a 4-byte big-endian length and a JSON body (codec.dumps).
  judge -> candidate: {"op": "load", "program", "scope", "preload", "timeout"}
                      {"op": "call", "id", "name", "args", "kwargs", "timeout"}
                      {"op": "get", "id", "name", "timeout"}
  candidate -> judge: {"syntax": [line, message]} | {"load": flag, "error", "names": {name: "f"|"v"}}
                      {"id", "r": value} | {"id", "e": [type name, message]} | {"id", "t": 1} | {"id", "m": 1}
"""

import builtins
import signal
import sys
from os import _exit, read as _read, write as _write
from signal import ITIMER_REAL, setitimer as _setitimer

import codec


def read_message(fd, limit):
    """One message from `fd`, or None at end of file. A message over `limit` bytes or not
    readable raises codec.Unreadable (saying why); after one over the limit (`.fatal`) the stream
    is out of step."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > limit:
        e = codec.Unreadable("an answer of %d bytes (the sandbox reads up to %d)" % (n, limit))
        e.fatal = True
        raise e
    body = _read_exact(fd, n)
    return None if body is None else codec.loads(body)


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        b = _read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def write_message(fd, message):
    data = codec.dumps(message)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[_write(fd, data):]


class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _describe(e):
    try:
        name = type(e).__name__
        msg = str(e)
        return [name, msg[:300]]
    except BaseException:
        return ["Exception", "<unprintable exception>"]


def serve(req_fd, rep_fd):
    """Answer the judge until it closes the request pipe."""
    signal.signal(signal.SIGALRM, _on_alarm)
    ns = {}

    def timed(fn, timeout):
        _setitimer(ITIMER_REAL, max(float(timeout), 0.001))
        try:
            return fn()
        finally:
            _setitimer(ITIMER_REAL, 0)

    def flush():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass

    while True:
        msg = read_message(req_fd, codec.MAX_MESSAGE_BYTES)
        if msg is None:
            flush()
            _exit(0)
        op = msg.get("op")
        if op == "load":
            try:
                code = compile(msg["program"], "<program>", "exec")
            except BaseException as e:
                write_message(rep_fd, {"syntax": [getattr(e, "lineno", None) or 0, " ".join(_describe(e))]})
                continue
            ns.clear()
            ns.update({"__name__": "__candidate__", "__builtins__": builtins})
            for name in msg.get("preload", ()):
                try:
                    ns[name] = __import__(name)
                except BaseException:
                    pass
            reply = {"load": "P", "error": ""}
            try:
                timed(lambda: exec(code, ns), msg["timeout"])
            except _Timeout:
                reply = {"load": "T", "error": "timed out after %gs" % msg["timeout"]}
            except MemoryError:
                reply = {"load": "M", "error": "MemoryError"}
            except BaseException as e:
                name, text = _describe(e)
                reply = {"load": "F", "error": name + ": " + text if text else name}
            try:
                reply["names"] = {str(k): ("f" if callable(v) else "v") for k, v in list(ns.items())
                                  if type(k) is str and not k.startswith("__")}
            except BaseException:
                reply["names"] = {}
            flush()
            write_message(rep_fd, reply)
        elif op in ("call", "get"):
            reply = {"id": msg.get("id")}
            try:
                if op == "call":
                    fn = ns.get(msg["name"])
                    if fn is None:
                        raise NameError("name %r is not defined" % msg["name"])
                    args = codec.decode(msg["args"])
                    kwargs = codec.decode(msg["kwargs"])
                    reply["r"] = timed(lambda: codec.encode_result(fn(*args, **kwargs)), msg["timeout"])
                else:
                    if msg["name"] not in ns:
                        raise NameError("name %r is not defined" % msg["name"])
                    reply["r"] = timed(lambda: codec.encode_result(ns[msg["name"]]), msg["timeout"])
            except _Timeout:
                reply["t"] = 1
            except MemoryError:
                reply["m"] = 1
            except BaseException as e:
                reply["e"] = _describe(e)
            flush()
            try:
                write_message(rep_fd, reply)
            except (TypeError, ValueError):  # e.g. a str subclass made the JSON encoder fail
                write_message(rep_fd, {"id": msg.get("id"), "e": ["TypeError", "the result could not be sent"]})
        else:
            _exit(0)
