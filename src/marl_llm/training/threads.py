"""How many threads torch uses (trainer.threads): the physical cores this process may run on,
less those other processes keep busy.

OS facts only: the CPU affinity (SLURM's --cpus-per-task, taskset), the core topology in sysfs, a
cgroup's CPU quota (docker --cpus, a Kubernetes limit) and the CPUs' busy time over a short
sample (/proc/stat; the load average only where there is none). Why the load matters: torch's
parallel regions wait for their slowest thread, and a thread that shares its core with another
busy process is slow: on a 2-core machine that two other jobs kept busy, a `debug=tiny` run took
4.3x as long with 2 threads as with 1, while on the idle machine 2 threads were 1.7x faster than 1
(results/threads.md, docs/logging.md#threads).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def busy_cpus_sampled(cpus: set[int], seconds: float = SAMPLE_S) -> float | None:
    """CPUs' worth of time the CPUs `cpus` spent busy over the next `seconds` (this process sleeps
    meanwhile: it is the others' load), or None without /proc/stat."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    busy = 0.0
    for cpu in cpus:
        a, b = before.get(f"cpu{cpu}"), after.get(f"cpu{cpu}")
        if a is None or b is None:
            return None
        busy += (b[0] - a[0]) / max(b[1] - a[1], 1)
    return busy


def busy_cpus_load(cpus: set[int]) -> float | None:
    """The 1-minute load average, as busy CPUs among `cpus`, where those are all the machine's (a
    VM, a whole node; elsewhere the load is other CPUs' too and says nothing about these). Only a
    fallback where /proc/stat cannot be read: it lags (see SAMPLE_S)."""
    if not hasattr(os, "getloadavg") or len(cpus) < (os.cpu_count() or 0):
        return None
    return min(float(len(cpus)), os.getloadavg()[0])


@dataclass(frozen=True)
class Threads:
    count: int
    why: str  # what auto saw, for the run's first line ("": a number given)


def choose_threads(setting: Any, deterministic: bool = False) -> Threads:
    """trainer.threads resolved: a number as given; auto: the fewer of torch's default
    (OMP_NUM_THREADS, else the machine's cores) and available_cores(), less the cores other
    processes keep busy (a 0.5 s sample of its CPUs' busy time; without /proc/stat the 1-minute load
    average, where this process may use every CPU), at least 1. With trainer.deterministic the load
    is left out, so a rerun or a resume on the machine picks the same count (float sums split over
    another number of threads round differently)."""
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
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    busy = busy_cpus_sampled(cpus)
    if busy is None:
        busy = busy_cpus_load(cpus)
    if busy is None:
        return Threads(most, why)
    free = cores * (1.0 - min(busy / len(cpus), 1.0))  # hyper-threads and quotas: the same share of cores
    count = max(1, min(most, math.floor(free + OTHERS_SHARE)))
    return Threads(count, f"{why}, {busy:.1f} of {len(cpus)} CPUs busy with other processes")


def torch_threads(setting: Any, deterministic: bool = False) -> int:
    return choose_threads(setting, deterministic).count
