"""Removing what a run leaves on the host (stdlib only): its cgroups and, in process mode, its work
dir. The one implementation, used by the trainer after each run (spawn.py, isolation.RunCgroup),
by the zygote when the trainer has died (main.py), and by the sweeps of what dead trainers left
behind (isolation.sweep_stale_cgroups, spawn.sweep_stale_workdirs)."""

import os
import shutil
import signal
import stat
import time


def remove_cgroup(path, timeout_s=5.0):
    """Kill what is left in the cgroup at `path` (nothing, normally) and remove it. True when it
    is gone."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            pass
        kill = os.path.join(path, "cgroup.kill")  # cgroup v2 (Linux 5.14+): every task at once
        try:
            if os.path.exists(kill):
                with open(kill, "w") as f:
                    f.write("1")
            else:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (OSError, ValueError):
                            pass
        except OSError:
            pass
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def remove_workdir(path):
    """Remove a process-mode work dir. The program may have made its dirs unreadable: they are
    made ours again top-down first, touching nothing but real directories inside `path` (never a
    symlink's target, never `path`'s parent). True when it is gone."""
    try:
        os.chmod(path, 0o700)
        for dirpath, dirnames, _ in os.walk(path):
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if stat.S_ISDIR(os.lstat(p).st_mode):
                    os.chmod(p, 0o700)
    except OSError:
        pass
    for _ in range(3):  # a killed straggler may still be creating files for a moment
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return True
        time.sleep(0.05)
    return False
