"""How many threads torch uses (trainer.threads): the physical cores this process may run on.

OS facts only: the CPU affinity (SLURM's --cpus-per-task, taskset), the core topology in sysfs
and a cgroup's CPU quota (docker --cpus, a Kubernetes limit).
"""

from __future__ import annotations

import math
import os
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


def torch_threads(setting: Any) -> int:
    """trainer.threads resolved: a number as given; auto: the fewer of torch's default
    (OMP_NUM_THREADS, else the machine's cores, whatever the process may use) and
    available_cores(). More threads than cores the process gets make every parallel region wait
    for threads that are not running."""
    if str(setting).lower() == "auto":
        return min(torch.get_num_threads(), available_cores())
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise UserError(f"trainer.threads={setting} is not a choice: auto (the physical cores this process may use, at "
                    f"most torch's default) or a number of threads, e.g. trainer.threads=1")
