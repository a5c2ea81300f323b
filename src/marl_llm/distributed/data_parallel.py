"""Data-parallel training over several processes: torchrun, `accelerate launch`, or the tasks of
one SLURM job (hydra/launcher=slurm with gpus_per_node > 1 starts one task per GPU).

    torchrun --nproc_per_node 4 -m marl_llm algo=magrpo task=humaneval
    accelerate launch --num_processes 4 -m marl_llm algo=magrpo task=humaneval

Every rank holds the same agents (the frozen base plus the LoRA adapters, and critics) and
takes its own contiguous share of the step's problems. After each backward pass over a rank's
share, `sync_gradients` all-reduces the trainable parameters' gradients only (LoRA and value
heads; the frozen base has none), each rank's weighted by its share of the global batch, so every
rank applies the same optimizer step a single process would over the whole batch. Rank 0 alone
writes the run dir (metrics, samples, checkpoints, W&B, summaries) and evaluates; the other
ranks wait for it.

Why not torch DDP's wrapper: a rank's number of forward/backward passes per step is data
dependent (episodes end early, turns fork unevenly), and DDP all-reduces inside every backward,
which would stall ranks that did fewer passes. One all-reduce per optimizer step, after the
rank's passes are done, needs no such agreement. Accelerate's PartialState sets up the process
group (nccl on GPUs, gloo on CPU) and the device from the launcher's environment.

With `trainer.fsdp=true` the frozen base is sharded over the ranks (`marl_llm.distributed.fsdp`); its forward
passes then run in lockstep, and every collective below first lets a rank that is done with its
passes serve the others' (`before_collectives`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

# The process's place in the world lives in a light module (config checks and tasks read it
# without torch); re-exported here, where the collectives are.
from marl_llm.distributed.world import World, export_submitit_env, launched_world_size, set_world, world

T = TypeVar("T")


def init(timeout_min: float, cpu: bool | None = None) -> World:
    """Join the launcher's process group (idempotent); a single process stays World(0, 1, 0).
    `timeout_min` bounds how long ranks wait for rank 0's evaluations and checkpoints."""
    if world().size > 1 or launched_world_size() <= 1:
        return world()
    from marl_llm.extras import require

    require("distributed", f"a run of {launched_world_size()} data-parallel processes")
    from accelerate import PartialState

    if cpu is None:
        cpu = not torch.cuda.is_available()
    if not cpu and "LOCAL_RANK" in os.environ:
        # Before NCCL or anything else touches CUDA: otherwise each rank's first allocation
        # (a CUDA context) lands on GPU 0.
        torch.cuda.set_device(cuda_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()))
    state = PartialState(cpu=cpu, timeout=timedelta(minutes=timeout_min))
    if state.num_processes > 1 and not cpu:
        # "cuda" means this rank's GPU from here on.
        torch.cuda.set_device(cuda_index(state.local_process_index, torch.cuda.device_count()))
    return set_world(World(state.process_index, state.num_processes, state.local_process_index))


def cuda_index(local_rank: int, visible: int) -> int:
    """The GPU (index among the `visible` ones) of the rank with this local rank: its local rank,
    or 0 where the launcher shows each task only its own GPU (CUDA_VISIBLE_DEVICES per task, e.g.
    SLURM's --gpus-per-task). More ranks per node than GPUs is refused: they would share GPUs."""
    if visible == 1:
        return 0
    if not 0 <= local_rank < visible:
        from marl_llm.config import UserError

        raise UserError(f"local rank {local_rank} but this node shows {visible} GPUs: start at most {visible} "
                        f"processes per node (torchrun --nproc_per_node {visible})")
    return local_rank


def shard(items: Sequence[T], w: World | None = None) -> list[T]:
    """This rank's contiguous share of a global batch (sizes differ by at most one)."""
    w = w or world()
    n = len(items)
    return list(items[w.rank * n // w.size:(w.rank + 1) * n // w.size])


def _dist():
    import torch.distributed as dist

    return dist


# Called before each collective of this module: an FSDP-sharded model's lockstep drains there
# (the ranks' own collectives must never interleave with its rounds).
_BEFORE_COLLECTIVES: list[Callable[[], None]] = []


def before_collectives(fn: Callable[[], None]) -> None:
    _BEFORE_COLLECTIVES.append(fn)


def settle() -> None:
    """With an FSDP-sharded base, wait until every rank has run its forward passes so far (a rank
    that is done serves the others' with dummy passes); a no-op otherwise. Every collective below
    starts with it; code calls it where a phase changes the kind of pass, e.g. from passes without
    gradients to passes with them."""
    for fn in _BEFORE_COLLECTIVES:
        fn()


# Gradients are all-reduced in float32 buckets of at most this many elements (64 MiB), one
# buffer reused for every bucket: the sync's extra memory is one bucket, not a copy of every
# trained parameter's gradient (full fine-tuning: the whole model's). DDP's buckets are 25 MiB.
BUCKET_ELEMENTS = 1 << 24


def sync_gradients(params: Iterable[torch.Tensor], weight: float) -> float:
    """Replace every parameter's gradient with the weighted mean over ranks: sum_r w_r g_r / sum_r w_r.

    `weight` is this rank's share of the global batch in the unit its loss is normalized by
    (samples, or tokens for token-mean losses), so the result is the gradient of the loss over
    the whole batch. A parameter without a gradient counts as zero (and gets one). The weights
    are summed first (one all-reduce of a number); then, bucket by bucket (BUCKET_ELEMENTS), the
    gradients are copied into a float32 buffer, scaled by the weight, all-reduced, divided by the
    total and written back into each gradient in place. Returns the global weight (this rank's
    weight on one process)."""
    params = list(params)
    if world().size == 1:
        return weight
    settle()
    device = params[0].device
    weights = torch.tensor([float(weight)], device=device)
    _dist().all_reduce(weights)
    total = float(weights)
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if buckets[-1] and size + p.numel() > BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    largest = max(sum(p.numel() for p in b) for b in buckets)
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32  # a float64 run's stays exact
    buf = torch.empty(largest, dtype=dtype, device=device)
    for bucket in buckets:
        flat = buf[:sum(p.numel() for p in bucket)]
        offset = 0
        for p in bucket:
            part = flat[offset:offset + p.numel()]
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.detach().reshape(-1))
            offset += p.numel()
        flat.mul_(weight)
        _dist().all_reduce(flat)
        if total > 0:
            flat.div_(total)
        offset = 0
        for p in bucket:
            part = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = part.to(p.dtype, copy=True)
            else:
                p.grad.copy_(part)
            offset += p.numel()
    return total


def all_sum(value: float) -> float:
    """The sum of a number over ranks (the value itself on one process)."""
    if world().size == 1:
        return value
    settle()
    t = torch.tensor([float(value)], dtype=torch.float64)
    if _dist().get_backend() == "nccl":
        t = t.cuda()
    _dist().all_reduce(t)
    return float(t)


def broadcast_parameters(params: Iterable[torch.Tensor]) -> None:
    """Copy rank 0's values of these parameters to every rank (they start identical anyway, being
    seeded alike; this makes it hold whatever the launcher or filesystem did)."""
    if world().size == 1:
        return
    settle()
    with torch.no_grad():
        for p in params:
            _dist().broadcast(p.data, src=0)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's value of a picklable object, on every rank."""
    if world().size == 1:
        return obj
    settle()
    box = [obj]
    _dist().broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if world().size == 1:
        return [obj]
    settle()
    out: list[Any] = [None] * world().size
    _dist().all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world().size > 1:
        settle()
        _dist().barrier()


# How a step's per-rank metrics combine: sums for counts, extremes for extremes, else the mean
# over the ranks that report the key (a rank whose episodes all ended early lacks later turns).
def _combine(key: str, values: list[float]) -> float:
    leaf = key.rsplit("/", 1)[-1]
    if leaf in ("num_tokens", "prompt_tokens", "joint_actions") or key.startswith("perf/throughput") or key.endswith("tokens_per_s"):
        return float(sum(values))
    if leaf.startswith("max_") or leaf in ("peak_rss_gib", "peak_gpu_mem_gib") or key in ("step_time", "perf/time_per_step") \
            or key.startswith("timing/"):
        return float(max(values))
    if leaf.startswith("min_"):
        return float(min(values))
    return float(sum(values) / len(values))


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics over all ranks (every rank gets the same dict)."""
    if world().size == 1:
        return metrics
    per_rank = gather_objects(metrics)
    keys = list(dict.fromkeys(k for m in per_rank for k in m))
    return {k: _combine(k, [m[k] for m in per_rank if k in m]) for k in keys}


def shutdown() -> None:
    if world().size > 1 and _dist().is_initialized():
        _dist().destroy_process_group()
    set_world(World())
    _BEFORE_COLLECTIVES.clear()
