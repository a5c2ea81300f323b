"""What a sandbox run may see and use on this machine, worked out once per trainer process.

* `layout()`: the candidate's private root: the sandbox interpreter's standard library and the
  directories of the shared libraries its extension modules load (found with `ldd`), read-only,
  with every site-packages / dist-packages below them masked; three harmless devices.
* `MemoryCgroup`: a memory cgroup per run (v2, or v1's memory controller) where this process may
  create one (root, or a delegated v2 subtree): one cap over all of a run's processes and its
  /tmp. Without one, the candidate gets a single task (no fork, no threads) so that its
  RLIMIT_AS is a cap over the whole run.

Whether this kernel lets the sandbox create its namespaces at all is measured by confining one
program (confinement.py); this module starts no run and imports nothing of the sandbox.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: What `task.sandbox.isolation=process` gives up (printed when it is chosen).
PROCESS_MODE_LOSSES = (
    "the candidate runs as the trainer's user (or nobody when it is root) with the trainer's view of the "
    "file system: it can read the user's files and the run's logs; it shares the network, the PID space (it "
    "can signal the trainer and other runs of the same user) and /tmp; processes that call setsid() can "
    "outlive the run; the memory limit is per process"
)

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


# ------------------------------------------------------------------------------------------------
# Memory cgroups
# ------------------------------------------------------------------------------------------------


def _own_cgroup(version: int) -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if version == 2 and hid == "0" and controllers == "":
            return path
        if version == 1 and "memory" in controllers.split(","):
            return path
    return None


@functools.lru_cache(maxsize=None)
def cgroup_base() -> tuple[int, str] | None:
    """(version, dir) under which this process can make a memory cgroup per run, or None."""
    own1 = _own_cgroup(1)
    if own1 is not None:
        base = "/sys/fs/cgroup/memory" + own1.rstrip("/")
        if _can_make_child(base, 1):
            return 1, base
    own2 = _own_cgroup(2)
    if own2 is not None and os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        here = "/sys/fs/cgroup" + own2.rstrip("/")
        # A cgroup with processes cannot give its children controllers (v2's "no internal
        # processes" rule): try our own (a delegated, empty subtree) and then its parent.
        for base in (here, os.path.dirname(here)):
            if base.startswith("/sys/fs/cgroup") and _can_make_child(base, 2):
                return 2, base
    return None


def _can_make_child(base: str, version: int) -> bool:
    probe = os.path.join(base, f"marl-sandbox-probe-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        if version == 2:
            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            if "memory" not in enabled:
                with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
            return os.path.exists(os.path.join(probe, "memory.max"))
        return os.path.exists(os.path.join(probe, "memory.limit_in_bytes"))
    except OSError:
        return False
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


class MemoryCgroup:
    """A memory cgroup holding one run: every process of the run, and the pages of its /tmp,
    count against one limit; the kernel's OOM killer acts inside it only."""

    def __init__(self, version: int, base: str, limit_bytes: int):
        self.version = version
        self.path = os.path.join(base, f"marl-sandbox-{os.getpid()}-{secrets.token_hex(6)}")
        os.mkdir(self.path)
        try:
            if version == 2:
                self._write("memory.max", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                    self._write("memory.swap.max", "0")
            else:
                self._write("memory.limit_in_bytes", str(limit_bytes))
                if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                    self._write("memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError:
            self.remove()
            raise

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
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
        end = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                pass
            if self.version == 2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
                try:
                    self._write("cgroup.kill", "1")
                except OSError:
                    pass
            else:
                try:
                    with open(self.procs_file) as f:
                        for pid in f.read().split():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except (OSError, ValueError):
                                pass
                except OSError:
                    pass
            if time.monotonic() > end:
                log.warning("sandbox: could not remove the cgroup %s", self.path)
                return
            time.sleep(0.01)
