"""How many threads torch uses (trainer.threads): the physical cores this process may run on,
less those other processes keep busy.

OS facts only: the CPU affinity (SLURM's --cpus-per-task, taskset), the core topology in sysfs, a
cgroup's CPU quota (docker --cpus, a Kubernetes limit) and the CPUs' busy time over a short
sample (/proc/stat; the load average only where there is none). Why the load matters: torch's
parallel regions wait for their slowest thread, and a thread that shares its core with another
busy process is slow: on a 2-core machine that two other jobs kept busy, a `debug=tiny` run took
4.3x as long with 2 threads as with 1, while on the idle machine 2 threads were 1.7x faster than 1
(results/threads.md, docs/logging.md#threads).

`auto` decides at the start (`choose_threads`) and again during the run (`AutoThreads`): the load
of a shared machine comes and goes, and 2 threads kept from an idle start ran 8.5x as long as 1
once two other jobs arrived.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from marl_llm.config import UserError


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time a cgroup quota allows this process (docker --cpus, a Kubernetes limit),
    or None when there is none (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or float(period) <= 0:
        return None
    return float(quota) / float(period)


def available_cores() -> int:
    """Physical cores this process may run on: its CPU affinity (SLURM's --cpus-per-task, taskset)
    with the hyper-threads of one core counted once, at most a cgroup quota's CPUs."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology / "physical_package_id").read_text().strip() + "/"
                      + (topology / "core_id").read_text().strip())
        except OSError:  # no sysfs topology: count the CPU
            cores.add(f"cpu{cpu}")
    quota = cgroup_cpu_quota()
    return max(1, min(len(cores), math.ceil(quota)) if quota else len(cores))


# A core counts as the other processes' once they keep it busy more than this share of the time.
OTHERS_SHARE = 0.3
# How long auto watches the CPUs' busy time (/proc/stat) before the run starts. Why a sample and not
# the 1-minute load average: the average lags by about a minute both ways. Each of 3 runs of the main
# job started right after the one before had ended read a load of 1.0 from the finished run and took
# one thread on an idle 2-core machine (results/magrpo_humaneval.md); a job that has just started is
# not in it yet.
SAMPLE_S = 0.5


def _cpu_times() -> dict[str, tuple[int, int]]:
    """cpu<N> -> (busy, total) jiffies since boot, from /proc/stat (empty where there is none)."""
    times = {}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields[:8]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            times[name] = (sum(values) - idle, sum(values))
    return times


def busy_between(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], cpus: set[int]) -> float | None:
    """CPUs' worth of busy time of the CPUs `cpus` between two _cpu_times() readings (each CPU's
    busy share of its ticks, summed), or None where a CPU is missing from either."""
    busy = 0.0
    for cpu in cpus:
        a, b = before.get(f"cpu{cpu}"), after.get(f"cpu{cpu}")
        if a is None or b is None:
            return None
        busy += (b[0] - a[0]) / max(b[1] - a[1], 1)
    return busy


def busy_cpus_sampled(cpus: set[int], seconds: float = SAMPLE_S) -> float | None:
    """CPUs' worth of time the CPUs `cpus` spent busy over the next `seconds` (this process sleeps
    meanwhile: it is the others' load), or None without /proc/stat."""
    before = _cpu_times()
    time.sleep(seconds)
    return busy_between(before, _cpu_times(), cpus)


def busy_cpus_load(cpus: set[int]) -> float | None:
    """The 1-minute load average, as busy CPUs among `cpus`, where those are all the machine's (a
    VM, a whole node; elsewhere the load is other CPUs' too and says nothing about these). Only a
    fallback where /proc/stat cannot be read: it lags (see SAMPLE_S)."""
    if not hasattr(os, "getloadavg") or len(cpus) < (os.cpu_count() or 0):
        return None
    return min(float(len(cpus)), os.getloadavg()[0])


def process_cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def threads_for_load(busy: float, cpus: int, cores: int, most: int) -> int:
    """auto's count where other processes keep `busy` CPUs' worth of this process's `cpus` CPUs
    busy: the cores they leave (hyper-threads and quotas: the same share of the cores), a core
    counting as theirs once they keep it busy more than OTHERS_SHARE of the time; 1 to `most`."""
    free = cores * (1.0 - min(busy / cpus, 1.0))
    return max(1, min(most, math.floor(free + OTHERS_SHARE)))


@dataclass(frozen=True)
class Threads:
    count: int
    why: str  # what auto saw, for the run's first line ("": a number given)
    # auto's most (torch's default, the cores) where it follows the load during the run
    # (AutoThreads); 0: the count stays (a number given, trainer.deterministic, one core, no /proc/stat).
    ceiling: int = 0
    cores: int = 0


def choose_threads(setting: Any, deterministic: bool = False) -> Threads:
    """trainer.threads resolved: a number as given; auto: the fewer of torch's default
    (OMP_NUM_THREADS, else the machine's cores) and available_cores(), less the cores other
    processes keep busy (a 0.5 s sample of its CPUs' busy time; without /proc/stat the 1-minute load
    average, where this process may use every CPU), at least 1. With trainer.deterministic the load
    is left out, so a rerun or a resume on the machine picks the same count (float sums split over
    another number of threads round differently), and the count stays for the whole run."""
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return Threads(setting, "")
    if str(setting).lower() != "auto":
        raise UserError(f"trainer.threads={setting} is not a choice: auto (the physical cores this process may use, "
                        f"less those other processes keep busy) or a number of threads, e.g. trainer.threads=1")
    cores = available_cores()
    most = min(torch.get_num_threads(), cores)
    why = f"auto: {cores} core{'s' if cores > 1 else ''}"
    if most <= 1 or deterministic:
        return Threads(most, why + (", the load left out (trainer.deterministic)" if deterministic and most > 1 else ""))
    cpus = process_cpus()
    busy = busy_cpus_sampled(cpus)
    ceiling = most if busy is not None else 0  # during the run only /proc/stat tells the others' load
    if busy is None:
        busy = busy_cpus_load(cpus)
    if busy is None:
        return Threads(most, why)
    return Threads(threads_for_load(busy, len(cpus), cores, most),
                   f"{why}, {busy:.1f} of {len(cpus)} CPUs busy with other processes", ceiling, cores)


def torch_threads(setting: Any, deterministic: bool = False) -> int:
    return choose_threads(setting, deterministic).count


# ------------------------------------------------------------------------------ during the run
# A decision during the run looks back at least this long: a shorter window takes a burst (a compile,
# another job's start) for load, and makes the count flap with it.
MIN_WINDOW_S = 10.0
# The console's progress events (rollout.PROGRESS, by name: no import of the rollout here) at which
# auto may decide again: a phase starts (each step's rollout and update, an evaluation's rollouts),
# a generate call starts or one of its chunks ends, a micro-batch of an update starts. All come from
# the trainer's thread, between pieces of work.
PROGRESS = logging.getLogger("marl_llm.progress")
BOUNDARIES = frozenset({"phase", "generate", "generated", "micro-batch"})
try:
    CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/<pid>/stat's times
except (AttributeError, ValueError, OSError):
    CLOCK_TICKS = 100


def _children() -> list[str]:
    """The pids of this process's live children (any of its threads' forks), from /proc."""
    pids: list[str] = []
    try:
        for task in os.scandir("/proc/self/task"):
            pids += Path(task.path, "children").read_text().split()
    except OSError:
        pass
    return pids


def own_cpu_s() -> float:
    """CPU seconds this run has used: this process (all its threads) and its children, the reaped
    ones (os.times) and the live ones with what they reaped (/proc/<pid>/stat: the sandbox's zygote
    with its judges, a vLLM engine). A decision during the run takes it out of the CPUs' busy time:
    the run's own work is not load."""
    mine = os.times()
    total = mine.user + mine.system + mine.children_user + mine.children_system
    for pid in _children():
        try:  # after the command's closing parenthesis: state, ppid, ... utime (14th), stime, cutime, cstime
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) / CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            pass  # gone meanwhile: os.times counts it once it is reaped
    return total


@dataclass(frozen=True)
class LoadReading:
    at: float  # time.monotonic()
    cpu_times: dict[str, tuple[int, int]]  # _cpu_times()
    own_cpu_s: float  # own_cpu_s()


def read_load() -> LoadReading:
    return LoadReading(time.monotonic(), _cpu_times(), own_cpu_s())


def others_busy(before: LoadReading, after: LoadReading, cpus: set[int]) -> float | None:
    """CPUs' worth of the CPUs `cpus` that other processes kept busy between two readings: their
    busy time less this run's own, per second (None without /proc/stat)."""
    busy = busy_between(before.cpu_times, after.cpu_times, cpus)
    if busy is None or after.at <= before.at:
        return None
    return max(0.0, busy - (after.own_cpu_s - before.own_cpu_s) / (after.at - before.at))


def load_line() -> str:
    """'load average 3.62, 6 runnable tasks' (/proc/loadavg: the machine's, this run's threads among
    them), or '' where there is none."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
        return f"; load average {float(fields[0]):.2f}, {fields[3].split('/')[0]} runnable tasks"
    except (OSError, IndexError, ValueError):
        return ""


class AutoThreads(logging.Handler):
    """trainer.threads=auto during the run. At each boundary between pieces of work (BOUNDARIES),
    once MIN_WINDOW_S have passed since the last decision, auto decides again as at the start, from
    what other processes kept busy since then: the busy time of this process's CPUs (/proc/stat)
    less this run's own (own_cpu_s), no sample to wait for. A new count is set and `announce` gets
    one line saying what changed and why. Per boundary a clock read; per decision /proc/stat and a
    few small /proc files.

    Only where the start followed the load (Threads.ceiling): a number given, trainer.deterministic
    or one core keep the count for the whole run. Bitwise reproducibility is what auto trades for
    speed: a float sum split over another number of threads rounds differently, so two runs (or a
    run and its resume) that met other loads differ in the last bits; a number, or
    trainer.deterministic, is reproducible.

    Each data-parallel rank decides for itself, no collective: the ranks' replicas stay equal
    because what every rank computes alike after the gradients' all-reduce is elementwise (the
    optimizer step) or a norm ATen sums in an order of its own (clip_grad_norm_ measured bitwise
    equal under 1 and 2 threads), and a rank on a busier node should not make the others slow."""

    def __init__(self, threads: Threads, announce: Callable[[str], None],
                 read: Callable[[], LoadReading] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(logging.DEBUG)
        self.count, self.ceiling, self.cores = threads.count, threads.ceiling, threads.cores
        self.cpus = process_cpus()
        self.announce, self.read, self.clock = announce, read or read_load, clock
        self.thread = threading.get_ident()  # torch.set_num_threads sets the calling thread's OpenMP count
        self.last: LoadReading | None = None
        self.phase = ""
        self._level: int | None = None

    def attach(self) -> None:
        """Start following the load (a no-op where the count stays)."""
        if not self.ceiling or self.last is not None:
            return
        self.last = self.read()
        PROGRESS.addHandler(self)
        if not PROGRESS.isEnabledFor(logging.DEBUG):  # the console's Watch sets it while a run trains
            self._level = PROGRESS.level
            PROGRESS.setLevel(logging.DEBUG)

    def detach(self) -> None:
        PROGRESS.removeHandler(self)
        if self._level is not None:
            PROGRESS.setLevel(self._level)
            self._level = None
        self.last = None

    def emit(self, record: logging.LogRecord) -> None:
        event = record.getMessage()
        if event not in BOUNDARIES or threading.get_ident() != self.thread:
            return
        if event == "phase":
            self.phase = record.__dict__.get("phase", "")
        self.revisit()

    def revisit(self) -> int:
        """Decide again if MIN_WINDOW_S have passed since the last decision; returns the count."""
        if self.last is None or self.clock() - self.last.at < MIN_WINDOW_S:
            return self.count
        now = self.read()
        busy, window = others_busy(self.last, now, self.cpus), now.at - self.last.at
        self.last = now
        if busy is None:
            return self.count
        count = threads_for_load(busy, len(self.cpus), self.cores, self.ceiling)
        if count != self.count:
            torch.set_num_threads(count)
            self.announce(f"torch threads: {self.count} -> {count}" + (f" ({self.phase})" if self.phase else "")
                          + f" [auto: {busy:.1f} of {len(self.cpus)} CPUs busy with other processes over the last "
                          f"{window:.0f} s{load_line()}]")
            self.count = count
        return self.count
