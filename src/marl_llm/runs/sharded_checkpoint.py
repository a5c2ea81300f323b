"""Sharded checkpoints: for runs whose trained weights are FSDP shards (trainer.fsdp with
algo.lora=null, or a separate critic), each rank writes its own shards with
torch.distributed.checkpoint (DCP) instead of rank 0 writing whole fp32 models.

    <run_dir>/checkpoint/        the latest: DCP's files (.metadata, one __<rank>_0.distcp per
                                 rank), meta.pt (rank 0: step, RNG, config, logs, LoRA adapters and
                                 the algorithm's state, as in checkpoint.pt) and COMPLETE
    <run_dir>/checkpoint.prev/   the one before, kept until the next save is complete

Complete or ignored: every rank writes into `.checkpoint.tmp/`; after all ranks are done, rank 0
writes `meta.pt`, then `COMPLETE` (last), then renames the previous checkpoint to
`checkpoint.prev/` and the new one into place. A directory without `COMPLETE` is never read, so a
kill at any moment (kill -9 of any rank included) leaves the previous checkpoint usable.

What is sharded (`parts`): every fully fine-tuned policy (model + AdamW state, by name) and every
critic whose trunk is a model of its own; the rest (LoRA adapters, value heads of adapter critics,
buffers, RNG) is small and sits in meta.pt. DCP stores each tensor with its global shape, so a
resume reshards: on another number of ranks, or on one process (nothing sharded then); on the same
number of ranks it restores every shard exactly. Resuming reads the newest usable checkpoint of
either kind (a run may have saved `checkpoint.pt` on one process since).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from marl_llm.config import UserError
from marl_llm.distributed import data_parallel as distributed
from marl_llm.distributed import fsdp, placement
from marl_llm.models.policies import AgentPolicies
from marl_llm.runs.checkpoint import FAULT_ENV, checkpoint_state, read_checkpoint, restore_checkpoint

SHARDED = "checkpoint"
SHARDED_PREVIOUS = "checkpoint.prev"
TMP = ".checkpoint.tmp"
META = "meta.pt"
COMPLETE = "COMPLETE"


def parts(policies: AgentPolicies, algorithm: Any) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """The checkpoint's sharded parts by name: (module, its optimizer) of every fully fine-tuned
    policy and of the algorithm's own trained models (`Algorithm.checkpoint_parts`)."""
    where = placement.current()
    found = {f"policy/{k}/{name}": (policies.models[k], opt) for (k, name), opt in policies.optimizers.items()
             if policies.full and where.holds((k, name))}  # placement=groups: this rank's policy only
    if algorithm is not None:
        found.update(algorithm.checkpoint_parts())
    return found


def is_sharded_run(policies: AgentPolicies, algorithm: Any) -> bool:
    """Whether this run saves sharded checkpoints: some part's trained weights are FSDP shards."""
    return any(fsdp.trains_sharded(module) for module, _ in parts(policies, algorithm).values())


def _state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The part's model and optimizer state as DCP saves and loads it (shards as DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    return {"model": model_state, "optim": optim_state}


def _fault(step: int) -> None:
    """Fault injection for the kill tests (checkpoint.FAULT_ENV): SIGKILL this rank after its
    shards are written, before the checkpoint is complete."""
    if os.environ.get(FAULT_ENV) == f"kill_in_checkpoint:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def save_sharded_checkpoint(run_dir: Path, cfg: DictConfig, policies: AgentPolicies, step: int,
                            wandb_id: str | None, algorithm: Any) -> Path:
    """Every rank calls (a collective); returns the checkpoint's directory."""
    import torch.distributed.checkpoint as dcp

    main = distributed.world().is_main
    tmp, path, previous = run_dir / TMP, run_dir / SHARDED, run_dir / SHARDED_PREVIOUS
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed save's leftovers
        tmp.mkdir(parents=True)
    distributed.barrier()
    named = parts(policies, algorithm)
    every = sorted(set().union(*distributed.gather_objects(sorted(named))))  # placement=groups: ranks hold others
    dcp.save({name: _state(*part) for name, part in named.items()}, checkpoint_id=str(tmp))
    _fault(step)
    distributed.barrier()  # every rank's shards are on disk
    if main:
        meta = checkpoint_state(run_dir, cfg, None if policies.full else policies, step, wandb_id,
                                algorithm.state_dict() if algorithm is not None else None)
        meta.update(weights=policies.kind, parts=every, world_size=distributed.world().size)
        torch.save(meta, tmp / META)
        (tmp / COMPLETE).write_text(f"step {step}\n")
        if path.exists():
            if previous.exists():  # its marker first: a half-removed directory is never complete
                (previous / COMPLETE).unlink(missing_ok=True)
                shutil.rmtree(previous)
            os.rename(path, previous)
        os.rename(tmp, path)
    distributed.barrier()
    return path


def _read_sharded(directory: Path) -> tuple[dict[str, Any] | None, str]:
    if not directory.is_dir():
        return None, "missing"
    if not (directory / COMPLETE).is_file():
        return None, "incomplete (no COMPLETE marker: its save was interrupted)"
    try:
        meta = torch.load(directory / META, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        return None, f"unreadable ({type(err).__name__}: {str(err)[:120]})"
    meta["path"] = str(directory)
    return meta, ""


def read_any_checkpoint(run_dir: Path, main: bool = True) -> dict[str, Any] | None:
    """The newest usable checkpoint of the run dir, sharded (`checkpoint/`, then `checkpoint.prev/`)
    or whole (checkpoint.read_checkpoint, with its fallback); None: none exists. A sharded one
    carries "sharded": True."""
    found: list[dict[str, Any]] = []
    unusable: list[str] = []
    for name in (SHARDED, SHARDED_PREVIOUS):
        meta, why = _read_sharded(run_dir / name)
        if meta is not None:
            meta["sharded"] = True
            found.append(meta)
            break  # the latest complete one; the previous is only its fallback
        if why != "missing":
            unusable.append(f"{name}/ is {why}")
    try:
        whole = read_checkpoint(run_dir, main)
    except UserError:
        if not found:
            raise
        whole = None
    if whole is not None:
        found.append(whole)
    if not found:
        return None
    newest = max(found, key=lambda c: c["step"])
    if unusable and main:
        logging.getLogger("marl_llm").warning(f"warning: {'; '.join(unusable)}; resuming from {newest['path']} "
                                              f"(step {newest['step']})")
    return newest


def restore_any_checkpoint(run_dir: Path, ckpt: dict[str, Any], policies: AgentPolicies, algorithm: Any = None,
                           main: bool = True) -> None:
    """restore_checkpoint, and for a sharded checkpoint its parts first, resharded to how this
    run holds them (every rank calls)."""
    if ckpt.get("sharded"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        named = parts(policies, algorithm)
        every = sorted(set().union(*distributed.gather_objects(sorted(named))))
        if every != sorted(ckpt["parts"]):
            raise UserError(f"{ckpt['path']} holds {ckpt['parts']} but this config trains {every}; resume with "
                            "the config the run was started with, or start a new run dir (hydra.run.dir=...)")
        state = {name: _state(*part) for name, part in named.items()}
        dcp.load(state, checkpoint_id=ckpt["path"])
        for name, (module, optimizer) in named.items():
            set_state_dict(module, optimizer, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optim"])
    restore_checkpoint(run_dir, ckpt, policies, algorithm, main)
