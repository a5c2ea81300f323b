"""Confinement of a candidate process: namespaces, a private root, no privileges (stdlib only).

Runs in the sandbox's own fresh interpreter, before any untrusted code exists in the process.
The sequence (see the package docstring for who does what):

1. `enter_namespaces` (in the candidate's parent, C): new user, mount, PID, network, IPC and UTS
   namespaces. The judge writes C's uid/gid map (inner root = the caller's uid, or `nobody` when
   the caller is root); C then forbids nested user namespaces (a nested one could mount an
   uncapped tmpfs) and caps the number of tasks (RLIMIT_NPROC counts per user namespace).
2. `build_root` (in the candidate, PID 1 of its namespace): a tmpfs root that holds only the
   standard library and the shared libraries it loads, read-only, with site-packages and
   dist-packages masked; /dev/null, /dev/zero, /dev/urandom; a size- and inode-capped tmpfs at
   /tmp (/dev/shm points there). No /proc, no home, no venv, no project or run dir. The old root
   is detached entirely (pivot_root + lazy unmount).
3. `drop_privileges`: empty bounding set, no ambient capabilities, uid 0 keeps no special
   meaning on exec (securebits), no_new_privs, and all capabilities cleared.

In both modes (keeper.py): `set_limits`, a fresh empty session keyring (`join_new_session_keyring`),
then Landlock (process mode) and the seccomp filter (landlock.py, seccomp.py).
"""

import ctypes
import os
import resource

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
ALL_NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 4, 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# SECBIT_NOROOT | _LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE | _LOCKED
SECUREBITS = 0x01 | 0x02 | 0x40 | 0x80
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126, "keyctl": 250},
             "aarch64": {"pivot_root": 41, "capset": 91, "keyctl": 219}}
KEYCTL_JOIN_SESSION_KEYRING = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _ok(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _b(s):
    return None if s is None else os.fsencode(s)


def unshare(flags):
    _ok(_libc.unshare(flags), "unshare")


def mount(source, target, fstype, flags, data=None):
    _ok(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), "mount %s" % target)


def prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
    _ok(_libc.prctl(option, arg2, arg3, arg4, arg5), "prctl %d" % option)


def _syscall(name, *args):
    numbers = _SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise OSError("the sandbox does not know the %s syscall on %s" % (name, os.uname().machine))
    _ok(_libc.syscall(numbers[name], *args), name)


def write_id_maps(pid, outer_uid, outer_gid):
    """(In the judge, outside the namespace.) Inner root of `pid`'s new user namespace is
    `outer_uid`/`outer_gid`; no supplementary groups can be set inside."""
    for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % outer_uid), ("gid_map", "0 %d 1" % outer_gid)):
        fd = os.open("/proc/%d/%s" % (pid, name), os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def enter_namespaces(sync_w, sync_r, max_tasks, bind_paths):
    """(In C.) New namespaces; wait for the judge to map our ids; then no nested user namespaces
    and at most `max_tasks` tasks (processes and threads) for everything in this namespace.
    Returns O_PATH fds of `bind_paths`, opened in the new mount namespace (a bind needs its source
    there) while our ids are still the caller's (which can reach e.g. a Python under /root)."""
    if os.geteuid() == 0:
        try:
            os.setgroups([])  # root's groups would stay ours inside (setgroups is denied there)
        except PermissionError:
            pass  # root of a user namespace that denies setgroups: it has no host groups to drop
    unshare(ALL_NAMESPACES)
    fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in bind_paths]
    os.write(sync_w, b"u")
    if os.read(sync_r, 1) != b"k":
        raise OSError("the judge did not map the sandbox's ids")
    # Become the mapped inner root: our kernel ids are now the mapped outer ones (nobody when
    # the caller is root), so nothing we create or touch belongs to the caller's root.
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    fd = os.open("/proc/sys/user/max_user_namespaces", os.O_WRONLY)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NPROC, (max_tasks, max_tasks))
    return fds


def _locked_flags(path):
    """Flags of the mount at `path` that a user namespace may not clear on remount."""
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if f & st:
            out |= ms
    return out


def build_root(spec, fds):
    """(In the candidate, PID 1.) Make the private root described by `spec` and enter it.

    spec: {"binds": [[path, "dir" | "file" | "dev"], ...] (sources open as `fds`, O_PATH),
           "symlinks": [[path, target], ...], "masks": [path, ...], "tmp_bytes": int, "tmp_inodes": int}
    """
    new = "/tmp"  # any existing dir: the tmpfs mounted on it is visible in this namespace only
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=755")
    for path, target in spec["symlinks"]:
        os.makedirs(os.path.dirname(new + path), exist_ok=True)
        os.symlink(target, new + path)
    for (path, kind), fd in zip(spec["binds"], fds):
        dst = new + path
        if kind == "dir":
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
        mount("/proc/self/fd/%d" % fd, dst, None, MS_BIND | MS_REC)
        ro = 0 if kind == "dev" else MS_RDONLY | MS_NODEV
        mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | ro | _locked_flags(dst))
    for path in spec["masks"]:
        mount("tmpfs", new + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=2,mode=555")
    os.makedirs(new + "/tmp", exist_ok=True)
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%d,nr_inodes=%d,mode=1777" % (spec["tmp_bytes"], spec["tmp_inodes"]))
    os.makedirs(new + "/dev", exist_ok=True)
    if not os.path.lexists(new + "/dev/shm"):
        os.symlink("/tmp", new + "/dev/shm")
    os.makedirs(new + "/.old")
    _syscall("pivot_root", _b(new), _b(new + "/.old"))
    os.chdir("/")
    _ok(_libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for fd in fds:
        os.close(fd)
    os.chdir("/tmp")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges():
    """No capability now or after any exec, and no way to gain one."""
    prctl(PR_SET_SECUREBITS, SECUREBITS)
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability this kernel knows
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _syscall("capset", ctypes.byref(header), ctypes.byref(data))


def join_new_session_keyring():
    """A fresh, empty, anonymous session keyring: the keys of the trainer's session (and of the
    runs before) are out of this process's reach, and what it adds dies with it."""
    numbers = _SYSCALLS.get(os.uname().machine, {})
    if "keyctl" not in numbers or _libc.syscall(numbers["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        raise OSError(err, "keyctl(KEYCTL_JOIN_SESSION_KEYRING): %s" % os.strerror(err))


def set_limits(limits):
    """RLIMIT_* of the candidate: {"as": bytes, "cpu": s, "fsize": bytes, "nofile": n, "nproc": n or
    None}."""

    def cap(res, value):
        soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_FSIZE, limits["fsize"])
    cap(resource.RLIMIT_AS, limits["as"])
    cap(resource.RLIMIT_NOFILE, limits["nofile"])
    if limits.get("nproc") is not None:
        cap(resource.RLIMIT_NPROC, limits["nproc"])
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    cpu = limits["cpu"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1 if hard == resource.RLIM_INFINITY else min(cpu + 1, hard)))
