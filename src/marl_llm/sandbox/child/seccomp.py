"""The candidate's seccomp filter (stdlib only): the syscalls that reach past the sandbox's other
walls, refused in both isolation modes.

Why hand-written classic BPF: the filter is installed in the sandbox's own `python -I -S` (no
site-packages, so no libseccomp bindings), in the candidate just before its program runs; it is a
flat list of checks that can be read against the tables below. Only x86-64 and aarch64 are known;
a syscall made through another ABI of the same kernel (i386's `int 0x80`, x32's numbers on
x86-64) ends the process, since the numbers below would not match it.

Refused everywhere (errno in brackets):
  io_uring_setup / _enter / _register [ENOSYS]   a second syscall path no filter sees
  userfaultfd [EPERM]                            (user-mode too) stalls the kernel on our pages
  keyctl, add_key, request_key [EPERM]           kernel keyrings: a channel between runs
  ptrace [EPERM] (PTRACE_TRACEME too), process_vm_readv / _writev, pidfd_getfd, kcmp [EPERM]
  bpf, perf_event_open [EPERM]
  socket / socketpair of a family other than AF_UNIX, AF_INET, AF_INET6 [EAFNOSUPPORT]
      (AF_NETLINK, AF_VSOCK, AF_PACKET, ...: kernel and host interfaces, not the network)
  clone / unshare with a CLONE_NEW* flag, setns [EPERM]; clone3 [ENOSYS: the C library then
      uses clone, whose flags the filter can read]
  `single_task` (no memory cgroup: RLIMIT_AS is the run's only cap): memory that no RLIMIT_AS
      counts: memfd_create, memfd_secret, shmget, msgget [EPERM]
  `process_mode` (no namespaces): socket() of every family [EACCES: the network, the host's
      UNIX sockets] (socketpair stays), and setsid / setpgid [EPERM: the process group is the run]
"""

import ctypes
import errno
import os
import struct

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0 = 0, 4, 16  # (the low half of args[0] on a little-endian machine)
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

# AUDIT_ARCH_* and the syscall numbers of each architecture this filter knows.
ARCHES = {
    "x86_64": (0xC000003E, {
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323,
        "keyctl": 250, "add_key": 248, "request_key": 249, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "pidfd_getfd": 438, "kcmp": 312, "bpf": 321, "perf_event_open": 298,
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "unshare": 272, "setns": 308,
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "setsid": 112, "setpgid": 109,
    }),
    "aarch64": (0xC00000B7, {
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 282,
        "keyctl": 219, "add_key": 217, "request_key": 218, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "pidfd_getfd": 438, "kcmp": 272, "bpf": 280, "perf_event_open": 241,
        "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "unshare": 97, "setns": 268,
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "setsid": 157, "setpgid": 154,
    }),
}
_X32_BIT = 0x40000000  # x86-64's x32 ABI: the same kernel entry, numbers with this bit set

_REFUSED = [
    (("io_uring_setup", "io_uring_enter", "io_uring_register", "clone3"), errno.ENOSYS),
    (("userfaultfd", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev",
      "pidfd_getfd", "kcmp", "bpf", "perf_event_open", "setns"), errno.EPERM),
]
_UNCOUNTED_MEMORY = ("memfd_create", "memfd_secret", "shmget", "msgget")
_SESSIONS = ("setsid", "setpgid")


def supported():
    """Whether this machine's architecture is one the filter knows."""
    return os.uname().machine in ARCHES


def _insn(code, k, jt=0, jf=0):
    return struct.pack("HBBI", code, jt, jf, k)


def program(machine, single_task, process_mode):
    """The filter's instructions (bytes of struct sock_filter) for `machine`."""
    arch, nr = ARCHES[machine]
    out = [_insn(_LD_W_ABS, _ARCH), _insn(_JEQ_K, arch, 1, 0), _insn(_RET_K, RET_KILL_PROCESS),
           _insn(_LD_W_ABS, _NR)]
    if machine == "x86_64":
        out += [_insn(_JGE_K, _X32_BIT, 0, 1), _insn(_RET_K, RET_KILL_PROCESS)]

    def refuse(name, err):  # nr == name -> ERRNO(err), else on
        out.extend([_insn(_JEQ_K, nr[name], 0, 1), _insn(_RET_K, RET_ERRNO | err)])

    for names, err in _REFUSED:
        for name in names:
            refuse(name, err)
    for name in _UNCOUNTED_MEMORY if single_task else ():
        refuse(name, errno.EPERM)
    for name in _SESSIONS if process_mode else ():
        refuse(name, errno.EPERM)
    # clone / unshare: refuse any namespace flag in args[0]
    for name in ("clone", "unshare"):
        out += [_insn(_JEQ_K, nr[name], 0, 4), _insn(_LD_W_ABS, _ARG0), _insn(_JSET_K, CLONE_NEW_ANY, 0, 1),
                _insn(_RET_K, RET_ERRNO | errno.EPERM), _insn(_RET_K, RET_ALLOW)]
    # socket / socketpair: the family in args[0]
    if process_mode:
        refuse("socket", errno.EACCES)
    for name in ("socketpair",) if process_mode else ("socket", "socketpair"):
        families = (AF_UNIX,) if name == "socketpair" and process_mode else (AF_UNIX, AF_INET, AF_INET6)
        n = len(families)
        out += [_insn(_JEQ_K, nr[name], 0, n + 3), _insn(_LD_W_ABS, _ARG0)]
        out += [_insn(_JEQ_K, fam, n - i, 0) for i, fam in enumerate(families)]
        out += [_insn(_RET_K, RET_ERRNO | errno.EAFNOSUPPORT), _insn(_RET_K, RET_ALLOW)]
    out.append(_insn(_RET_K, RET_ALLOW))
    return b"".join(out)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(single_task, process_mode):
    """Install the filter on this process (and everything it will start). Needs no_new_privs."""
    code = program(os.uname().machine, single_task, process_mode)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "seccomp: %s" % os.strerror(err))
