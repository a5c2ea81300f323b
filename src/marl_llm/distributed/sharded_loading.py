"""Sharded loading (`trainer.fsdp_load=sharded`): a model built on the meta device
(`models.loading.empty_model`) and sharded by FSDP gets its weights here, each rank reading only
the rows of its own shards from the checkpoint's safetensors files (docs/distributed.md#fsdp)."""

from __future__ import annotations

import os
from typing import Any

import torch

from marl_llm.config import UserError


def shard_rows(param: Any) -> tuple[int, int]:
    """The rows [start, stop) of dimension 0 that this rank holds of a sharded parameter: FSDP2
    shards dimension 0 as torch.chunk does (equal chunks of ceil(rows / ranks), the last ones
    shorter or empty)."""
    rows, ranks = param.shape[0], param.device_mesh.size()
    chunk = -(-rows // ranks)
    start = min(param.device_mesh.get_local_rank() * chunk, rows)
    return start, min(start + chunk, rows)


def load_shards(model: Any, device: torch.device) -> None:
    """Give a model sharded on the meta device (`loading.empty_model`, then fully_shard) its
    weights: each rank allocates its own shards on `device` and reads only their rows from the
    checkpoint's safetensors files, one tensor at a time, so a rank's memory while loading is its
    shards plus one tensor's rows (results/sharded_loading.md), never a whole model. The
    buffers (rotary frequencies, computed when the model was built) are kept as they were."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    files = getattr(model, "marl_checkpoint", None)
    if files is None:
        raise RuntimeError("a model on the meta device without `marl_checkpoint` (loading.empty_model) to load from")
    buffers = [(module, name, b) for module in model.modules() for name, b in module._buffers.items() if b is not None]
    model.to_empty(device=device)
    for module, name, b in buffers:
        module._buffers[name] = b.to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in files:
                raise UserError(f"trainer.fsdp_load=sharded: the checkpoint {os.path.dirname(next(iter(files.values())))} "
                                f"has no tensor {name}: set trainer.fsdp_load=whole (transformers maps its names)")
            sharded = isinstance(p, DTensor)
            local = p.to_local() if sharded else p
            with safe_open(files[name], framework="pt") as f:  # opened per tensor: only its rows are mapped
                rows = f.get_slice(name)[slice(*shard_rows(p))] if sharded else f.get_tensor(name)
            if rows.shape != local.shape:
                raise RuntimeError(f"{name}: the checkpoint's rows {shard_rows(p) if sharded else 'all'} have "
                                   f"the shape {tuple(rows.shape)}, this rank's shard {tuple(local.shape)}")
            local.copy_(rows)
