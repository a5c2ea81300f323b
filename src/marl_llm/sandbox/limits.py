"""What a sandboxed run is allowed: `SandboxLimits` (time, memory, processes, output, disk, the
isolation mode), built from a `task.sandbox` config node with `limits_from_config`."""

from __future__ import annotations

from dataclasses import dataclass, fields

#: uid/gid the candidate runs as, seen from outside, when the trainer is root.
NOBODY = 65534
ISOLATION_MODES = ("namespaces", "process")


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run.

    timeout_s: wall-clock limit of each test and of loading the program.
    memory_mb: the candidate's memory: RLIMIT_AS of each of its processes, and, with a memory
        cgroup, the cap over all of them together (plus `tmp_mb` for its /tmp).
    max_procs: tasks (processes + threads) the candidate may have, with a memory cgroup; without
        one it gets a single task, so that memory_mb caps the whole run.
    max_output_bytes: kept bytes of stdout and of stderr, each.
    max_file_mb: RLIMIT_FSIZE, the largest file the program may write.
    tmp_mb / tmp_inodes: size and file count of the candidate's private /tmp (also /dev/shm).
    total_timeout_s: wall-clock cap of the whole run; None means ``3 * timeout_s + 2``.
    isolation: "namespaces" (the default: see docs/sandbox.md) or "process", a weaker mode
        for kernels without unprivileged user namespaces (confinement.process_mode_losses says what it cannot promise).
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_procs: int = 32
    max_output_bytes: int = 65536
    max_file_mb: int = 16
    tmp_mb: int = 64
    tmp_inodes: int = 4096
    total_timeout_s: float | None = None
    isolation: str = "namespaces"

    def total_s(self) -> float:
        if self.total_timeout_s is not None:
            return float(self.total_timeout_s)
        return 3.0 * self.timeout_s + 2.0

    def watchdog_s(self) -> float:
        return 1.5 * self.timeout_s + 2.0


def limits_from_config(sb: object) -> SandboxLimits:
    """SandboxLimits from a `task.sandbox` config node (keys it lacks keep their defaults)."""
    kwargs = {}
    for f in fields(SandboxLimits):
        value = sb.get(f.name) if hasattr(sb, "get") else getattr(sb, f.name, None)
        if value is not None:
            kwargs[f.name] = value
    return SandboxLimits(**kwargs)
