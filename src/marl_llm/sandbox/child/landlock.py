"""Landlock for the candidate in process mode (stdlib only): unprivileged file-system confinement,
no namespaces needed (Linux 5.13+), and, from ABI 6 (Linux 6.12), no signals to processes outside
the candidate's domain (the judge, the zygote, the trainer).

The candidate may read the standard library and the shared libraries it loads (not the
site-packages below them: see `isolation.landlock_rules`), read and write its work dir and
/dev/null, /dev/zero, /dev/urandom and /dev/random; nothing else, /proc included. From ABI 4 it
may neither bind nor connect TCP sockets. Hand-written for the same reason as seccomp.py: this runs
in the sandbox's stdlib-only interpreter.
"""

import ctypes
import os
import struct

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same on x86-64 and aarch64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi():
    """The kernel's Landlock ABI version; 0 where it has none (or it is disabled)."""
    n = _libc.syscall(ctypes.c_long(_CREATE_RULESET), None, ctypes.c_size_t(0),
                      ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(n), 0)


def handled_fs(version):
    """Every file-system right ABI `version` knows (what the ruleset denies unless a rule allows)."""
    rights = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if version >= 2:
        rights |= REFER
    if version >= 3:
        rights |= TRUNCATE
    if version >= 5:
        rights |= IOCTL_DEV
    return rights


def _check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, "landlock %s: %s" % (what, os.strerror(err)))
    return ret


def restrict(version, rules):
    """Confine this process (and all it starts) to `rules`: [(path, "read" | "list" | "rw" | "dev")].
    "list" lets a directory be listed only (not its files read). Needs no_new_privs."""
    fs = handled_fs(version)
    if version >= 6:
        attr = struct.pack("QQQ", fs, _NET_BIND_TCP | _NET_CONNECT_TCP, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
    elif version >= 4:
        attr = struct.pack("QQ", fs, _NET_BIND_TCP | _NET_CONNECT_TCP)
    else:
        attr = struct.pack("Q", fs)
    ruleset = _check(_libc.syscall(ctypes.c_long(_CREATE_RULESET), attr, ctypes.c_size_t(len(attr)),
                                   ctypes.c_uint32(0)), "create_ruleset")
    allowed = {"read": READ_FILE | READ_DIR, "list": READ_DIR, "dev": READ_FILE | WRITE_FILE | (fs & IOCTL_DEV),
               "rw": fs & ~EXECUTE}
    try:
        for path, kind in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since the trainer listed it
            try:
                rights = allowed[kind] & fs
                if not os.path.isdir(path):
                    rights &= READ_FILE | WRITE_FILE | TRUNCATE | IOCTL_DEV | EXECUTE
                if not rights:
                    continue
                attr = struct.pack("=Qi", rights, fd)
                _check(_libc.syscall(ctypes.c_long(_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                     attr, ctypes.c_uint32(0)), "add_rule %s" % path)
            finally:
                os.close(fd)
        _check(_libc.syscall(ctypes.c_long(_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
               "restrict_self")
    finally:
        os.close(ruleset)
