"""What a sandbox run may see and use on this machine, worked out once per trainer process.

* `layout()`: the candidate's private root: the sandbox interpreter's standard library and the
  directories of the shared libraries its extension modules load (found with `ldd`), read-only,
  with every site-packages / dist-packages below them masked; three harmless devices.
  `landlock_rules()` is the same view for process mode, as Landlock rules.
* `landlock_abi()`, `seccomp_available()`: what this kernel offers (child/landlock.py,
  child/seccomp.py).
* `RunCgroup`: cgroups per run where this process may create them (root, or a delegated v2
  subtree): one memory cap over all of a run's processes and its /tmp, and at most one CPU. A run
  gets `max_procs` tasks only with both; otherwise the candidate gets a single task (no fork, no
  threads), so that its RLIMIT_AS is a cap over the whole run and its processes cannot starve a
  sibling run. Cgroups of dead trainers are swept once per trainer process.

Whether this kernel lets the sandbox create its namespaces at all is measured by confining one
program (confinement.py); this module starts no run and imports nothing of the sandbox.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_TOP_SYMLINKS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib64")


@dataclass(frozen=True)
class Layout:
    binds: tuple[tuple[str, str], ...]  # (path, "dir" | "file" | "dev"), bound read-only (devices rw)
    symlinks: tuple[tuple[str, str], ...]  # (path, target) recreated in the private root
    masks: tuple[str, ...]  # dirs hidden under an empty read-only tmpfs


def _sandbox_sys_path() -> list[str]:
    out = subprocess.run([sys.executable, "-I", "-S", "-c", "import sys, json; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return [p for p in json.loads(out.stdout) if p and os.path.isdir(p)]


def _shared_lib_dirs(stdlib: list[str]) -> set[str]:
    """Real directories of the shared libraries the stdlib's extension modules need."""
    modules = [f for d in stdlib for f in glob.glob(os.path.join(d, "*.so"))]
    dirs: set[str] = set()
    ldd = shutil.which("ldd")
    if ldd and modules:
        try:
            out = subprocess.run([ldd, *modules], capture_output=True, text=True, timeout=120).stdout
            for m in re.finditer(r"(?:=>\s*)?(/\S+\.so[^\s]*)\s+\(0x", out):
                dirs.add(os.path.dirname(os.path.realpath(m.group(1))))
        except (OSError, subprocess.SubprocessError):
            pass
    if not dirs:  # no ldd: the usual places of the C library and its neighbours
        arch = f"{os.uname().machine}-linux-gnu"
        for d in (f"/usr/lib/{arch}", f"/lib/{arch}", "/usr/lib64", "/lib64"):
            if os.path.isdir(d):
                dirs.add(os.path.realpath(d))
    return dirs


def _package_dirs(root: str) -> list[str]:
    """site-packages / dist-packages at or one `python*` level below `root`."""
    found = []
    for pattern in ("site-packages", "dist-packages", "python*/site-packages", "python*/dist-packages"):
        found += [p for p in glob.glob(os.path.join(root, pattern)) if os.path.isdir(p)]
    return found


@functools.lru_cache(maxsize=None)
def layout() -> Layout:
    stdlib = _sandbox_sys_path()
    dirs = sorted(set(stdlib) | _shared_lib_dirs(stdlib), key=len)
    binds: list[tuple[str, str]] = []
    for d in dirs:  # a dir inside one already bound comes with it (binds are recursive)
        if not any(d == b or d.startswith(b.rstrip("/") + "/") for b, _ in binds):
            binds.append((d, "dir"))
    masks = sorted({m for d, _ in binds for m in _package_dirs(d)})
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append(("/etc/ld.so.cache", "file"))
    binds += [(d, "dev") for d in DEVICES if os.path.exists(d)]
    symlinks = tuple((p, os.readlink(p)) for p in _TOP_SYMLINKS if os.path.islink(p))
    return Layout(tuple(binds), symlinks, tuple(masks))


@functools.lru_cache(maxsize=None)
def landlock_rules(lay: Layout) -> tuple[tuple[str, str], ...]:
    """`lay` as Landlock rules (child/landlock.py): its files and directories readable, its devices
    read-write; a directory with a masked one below it may only be listed, and each of its other
    entries is readable, so that nothing below a mask can be read."""
    rules: list[tuple[str, str]] = []

    def around(d: str, masks: list[str]) -> None:
        if not masks:
            rules.append((d, "read"))
            return
        rules.append((d, "list"))
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            return
        for name in entries:
            p = os.path.join(d, name)
            if p in masks or (os.path.islink(p) and not os.path.realpath(p).startswith(d.rstrip("/") + "/")):
                continue  # masked, or a link out of the tree (which would widen the rule)
            around(p, [m for m in masks if m.startswith(p + "/")])

    for path, kind in lay.binds:
        if kind == "dir":
            around(path, [m for m in lay.masks if m.startswith(path.rstrip("/") + "/")])
        else:
            rules.append((path, "dev" if kind == "dev" else "read"))
    return tuple(rules)


# ------------------------------------------------------------------------------------------------
# What the kernel offers
# ------------------------------------------------------------------------------------------------

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child")


@functools.lru_cache(maxsize=None)
def _child_module(name: str):
    """A stdlib-only module of child/ (which the sandbox's own interpreter imports by file)."""
    spec = importlib.util.spec_from_file_location(f"marl_llm_sandbox_child_{name}", os.path.join(_CHILD, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def landlock_abi() -> int:
    """This kernel's Landlock ABI version (0: none)."""
    return _child_module("landlock").abi()


@functools.lru_cache(maxsize=None)
def seccomp_available() -> bool:
    """Whether the candidate's seccomp filter can be installed here: seccomp filters with the
    kill-process action (Linux 4.14+), on an architecture the filter knows."""
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            actions = f.read().split()
    except OSError:
        return False
    return {"kill_process", "errno", "allow"} <= set(actions) and _child_module("seccomp").supported()


# ------------------------------------------------------------------------------------------------
# Cgroups per run
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupBase:
    """Where this process can make a run's cgroups: (version, dir) for memory, and for cpu (None
    where this machine gives us no cpu controller)."""

    memory: tuple[int, str]
    cpu: tuple[int, str] | None


def _own_cgroups() -> dict[str, str]:
    """{"memory": path, "cpu": path, "": v2 path} of this process, from /proc/self/cgroup."""
    own: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return own
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            own[""] = path
        for c in controllers.split(","):
            if c in ("memory", "cpu"):
                own[c] = path
    return own


def _v1_mounts() -> dict[str, tuple[str, str]]:
    """{controller: (mount point, mount root)} of cgroup v1 hierarchies, from mountinfo."""
    mounts: dict[str, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return mounts
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] == "cgroup":
            for c in tail[2].split(","):
                if c in ("memory", "cpu"):
                    mounts[c] = (fields[4], fields[3])
    return mounts


def _v1_dir(controller: str, own: dict[str, str], mounts: dict[str, tuple[str, str]]) -> str | None:
    if controller not in own or controller not in mounts:
        return None
    point, root = mounts[controller]
    path = own[controller]
    if root != "/" and (path + "/").startswith(root.rstrip("/") + "/"):
        path = path[len(root.rstrip("/")):]
    return point.rstrip("/") + path.rstrip("/")


@functools.lru_cache(maxsize=None)
def cgroup_base() -> CgroupBase | None:
    """Where this process can make a memory cgroup per run (and a cpu one), or None. The first
    call also removes the cgroups that dead trainers left (`sweep_stale_cgroups`)."""
    base = _find_cgroup_base()
    if base is not None:
        sweep_stale_cgroups(base)
    return base


def _find_cgroup_base() -> CgroupBase | None:
    own, mounts = _own_cgroups(), _v1_mounts()
    mem1 = _v1_dir("memory", own, mounts)
    if mem1 is not None and _can_make_child(mem1, 1, "memory"):
        cpu1 = _v1_dir("cpu", own, mounts)
        return CgroupBase((1, mem1), (1, cpu1) if cpu1 is not None and _can_make_child(cpu1, 1, "cpu") else None)
    if "" in own and os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        here = "/sys/fs/cgroup" + own[""].rstrip("/")
        # A cgroup with processes cannot give its children controllers (v2's "no internal
        # processes" rule): try our own (a delegated, empty subtree) and then its parent.
        for base in (here, os.path.dirname(here)):
            if base.startswith("/sys/fs/cgroup") and _can_make_child(base, 2, "memory"):
                return CgroupBase((2, base), (2, base) if _can_make_child(base, 2, "cpu") else None)
    return None


_CONTROL_FILE = {(1, "memory"): "memory.limit_in_bytes", (2, "memory"): "memory.max",
                 (1, "cpu"): "cpu.cfs_quota_us", (2, "cpu"): "cpu.max"}


def _can_make_child(base: str, version: int, controller: str) -> bool:
    probe = os.path.join(base, f"marl-sandbox-probe-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        if version == 2:
            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            if controller not in enabled:
                with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                    f.write("+" + controller)
        return os.path.exists(os.path.join(probe, _CONTROL_FILE[version, controller]))
    except OSError:
        return False
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


_LEFT_BY = re.compile(r"marl-sandbox-(?:probe-)?(\d+)-\w+$")


def left_by_dead_trainers(d: str) -> list[str]:
    """Entries of `d` that a sandbox run made (a run cgroup or work dir, named after its trainer's
    PID) for a trainer that is gone. (A reused PID keeps its entries: they wait for the next
    sweep.)"""
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        m = _LEFT_BY.match(name)
        if m is not None and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            out.append(os.path.join(d, name))
    return out


def sweep_stale_cgroups(base: CgroupBase) -> list[str]:
    """Remove the run cgroups of trainers that are gone (killed before they could remove them, and
    whose zygote died too): what is still in them is killed. Returns the paths removed."""
    dirs = {base.memory[1]} | ({base.cpu[1]} if base.cpu else set())
    removed = [path for d in dirs for path in left_by_dead_trainers(d)
               if _child_module("cleanup").remove_cgroup(path, timeout_s=2.0)]
    if removed:
        log.info("sandbox: removed %d cgroups that dead trainers left behind", len(removed))
    return removed


class RunCgroup:
    """A run's cgroups: every process of the run, and the pages of its /tmp, count against one
    memory limit (the kernel's OOM killer acts inside it only); with a cpu controller, the run may
    use at most one CPU, so that its processes cannot starve a sibling run."""

    CPU_PERIOD_US = 100_000

    def __init__(self, base: CgroupBase, limit_bytes: int):
        name = f"marl-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
        self.version, memory_base = base.memory
        self.path = os.path.join(memory_base, name)
        self.paths = [self.path]
        os.mkdir(self.path)
        try:
            if self.version == 2:
                self._write(self.path, "memory.max", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                    self._write(self.path, "memory.swap.max", "0")
            else:
                self._write(self.path, "memory.limit_in_bytes", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                    self._write(self.path, "memory.memsw.limit_in_bytes", str(limit_bytes))
            self.cpu_limited = base.cpu is not None
            if base.cpu is not None:
                cpu_version, cpu_base = base.cpu
                cpu_path = os.path.join(cpu_base, name)
                if cpu_path != self.path:
                    os.mkdir(cpu_path)
                    self.paths.append(cpu_path)
                if cpu_version == 2:
                    self._write(cpu_path, "cpu.max", f"{self.CPU_PERIOD_US} {self.CPU_PERIOD_US}")
                else:
                    self._write(cpu_path, "cpu.cfs_period_us", str(self.CPU_PERIOD_US))
                    self._write(cpu_path, "cpu.cfs_quota_us", str(self.CPU_PERIOD_US))
        except OSError:
            self.remove()
            raise

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(p, "cgroup.procs") for p in self.paths]

    @staticmethod
    def _write(path: str, name: str, value: str) -> None:
        with open(os.path.join(path, name), "w") as f:
            f.write(value)

    def oom_killed(self) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        except (OSError, ValueError):
            pass
        return False

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left in it (nothing, normally) and remove it."""
        for path in self.paths:
            if not _child_module("cleanup").remove_cgroup(path, timeout_s):
                log.warning("sandbox: could not remove the cgroup %s", path)


def set_dumpable(flag: bool) -> None:
    """prctl(PR_SET_DUMPABLE): an undumpable process's memory, fds and /proc files are out of reach
    of other processes of its uid (no ptrace, /proc/<pid>/mem or /fd, core dumps)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, int(flag), 0, 0, 0)
