"""Where this process stands among the ranks of a run (light: no torch, so that config checks and
tasks can read it). The process group itself: data_parallel.py."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_WORLD = World()


def world() -> World:
    return _WORLD


def set_world(w: World) -> World:
    """data_parallel.init / shutdown: this process's place from now on."""
    global _WORLD
    _WORLD = w
    return w


def export_submitit_env() -> None:
    """Inside a SLURM/submitit job with several tasks (one per GPU), export the torch.distributed
    variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) that torchrun would have set."""
    if "RANK" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    try:
        import submitit
    except ImportError:
        return
    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def launched_world_size() -> int:
    """How many processes the launcher started (1 when none)."""
    export_submitit_env()
    return int(os.environ.get("WORLD_SIZE", "1"))
