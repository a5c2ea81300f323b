"""The machine a benchmark ran on, for its report's header: the CPU's model and the memory.
Light (no torch), and imported by both `marl-llm-bench` and its subcommands, so that neither
imports the other."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first), else what platform knows."""
    if Path("/proc/cpuinfo").exists():
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), platform.processor())
    return platform.processor()


def memory_gib() -> float:
    """Physical memory, GiB, to a tenth."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
