"""Sharded checkpoints: for runs whose trained weights are FSDP shards (trainer.fsdp with
algo.lora=null, or a separate critic), each rank writes its own shards with
torch.distributed.checkpoint (DCP) instead of rank 0 writing whole fp32 models.

    <run_dir>/checkpoint/        the latest: DCP's files (.metadata, one __<rank>_0.distcp per
                                 rank), meta.pt (rank 0: step, RNG, config, logs, LoRA adapters and
                                 the algorithm's state, as in checkpoint.pt), SHA256SUMS (the
                                 SHA-256 of each of those files) and COMPLETE
    <run_dir>/checkpoint.prev/   the one before, kept until the next save is complete

Complete or ignored: every rank writes into `.checkpoint.tmp/`; after all ranks are done (each
has hashed its share of the shard files), rank 0 writes `meta.pt`, `SHA256SUMS`, then `COMPLETE`
(last), then renames the previous checkpoint to `checkpoint.prev/` and the new one into place. A
directory without `COMPLETE` is never read, so a kill at any moment (kill -9 of any rank
included) leaves the previous checkpoint usable.

Verified before it is read: a resume reads nothing of a checkpoint before every file SHA256SUMS
lists matches it (the ranks share the hashing of the shards), and a checkpoint without a usable
SHA256SUMS is refused (runs/digest.py says what that does and does not guarantee). Then it is
read as data only: meta.pt with torch.load(weights_only=True), `.metadata` and the shards through
runs/safe_dcp.py, never DCP's own plain pickle.

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
from marl_llm.runs import digest
from marl_llm.runs.atomic import fsync_dir, fsync_file
from marl_llm.runs.checkpoint import FAULT_ENV, checkpoint_state, load_plain, read_checkpoint, restore_checkpoint, \
    unverified_fix

SHARDED = "checkpoint"
SHARDED_PREVIOUS = "checkpoint.prev"
TMP = ".checkpoint.tmp"
META = "meta.pt"
COMPLETE = "COMPLETE"
DCP_METADATA = ".metadata"


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
    written = dcp.save({name: _state(*part) for name, part in named.items()}, checkpoint_id=str(tmp))
    _fault(step)
    # Every rank's shards are on disk (DCP's save ends with a collective). The ranks share the
    # hashing: each takes every size-th shard file of the global metadata DCP returned to all.
    w = distributed.world()
    shards = sorted({info.relative_path for info in written.storage_data.values()})
    mine = {name: digest.file_digest(tmp / name) for name in shards[w.rank::w.size]}
    sums = {name: sha for share in distributed.gather_objects(mine) for name, sha in share.items()}
    if main:
        meta = checkpoint_state(run_dir, cfg, None if policies.full else policies, step, wandb_id,
                                algorithm.state_dict() if algorithm is not None else None)
        meta.update(weights=policies.kind, parts=every, world_size=w.size)
        torch.save(meta, tmp / META)
        fsync_file(tmp / META)
        sums.update({name: digest.file_digest(tmp / name) for name in (META, DCP_METADATA)})
        digest.write_sums(tmp / digest.SUMS, sums)
        (tmp / COMPLETE).write_text(f"step {step}\n")
        fsync_file(tmp / COMPLETE)
        fsync_dir(tmp)
        if path.exists():
            if previous.exists():  # its marker first: a half-removed directory is never complete
                (previous / COMPLETE).unlink(missing_ok=True)
                shutil.rmtree(previous)
            os.rename(path, previous)
        os.rename(tmp, path)
        fsync_dir(run_dir)
    distributed.barrier()
    return path


def _check_sharded(directory: Path) -> tuple[dict[str, Any] | None, str]:
    """This rank's verdict on a sharded checkpoint: (its meta.pt with its DCP metadata, "") or
    (None, why not). Every file is checked against SHA256SUMS before any byte of it is unpickled:
    meta.pt and .metadata by every rank (each reads them), the shards by their share of ranks."""
    if not directory.is_dir():
        return None, "missing"
    if not (directory / COMPLETE).is_file():
        return None, "incomplete (no COMPLETE marker: its save was interrupted)"
    try:
        sums = digest.read_sums(directory / digest.SUMS)
    except digest.Unverified as err:
        return None, (f"unverified (no {digest.SUMS}: a checkpoint is loaded only with its digests)"
                      if err.missing else f"unverifiable ({err})")
    lacking = [name for name in (META, DCP_METADATA) if name not in sums]
    if lacking:
        return None, f"unverifiable ({digest.SUMS} lists no {', '.join(lacking)})"
    w = distributed.world()
    shards = sorted(set(sums) - {META, DCP_METADATA})
    changed = digest.verify_sums(directory, sums, [META, DCP_METADATA, *shards[w.rank::w.size]])
    if changed:
        return None, changed
    from marl_llm.runs import safe_dcp

    try:
        dcp_metadata = safe_dcp.read_metadata(directory / DCP_METADATA, set(shards))
    except ValueError as err:
        return None, str(err)
    meta, why = load_plain(directory / META, META)
    if meta is None:
        return None, why
    if not isinstance(meta, dict) or "step" not in meta:
        return None, f"incomplete ({META} holds no step)"
    meta["path"] = str(directory)
    meta["dcp_metadata"] = dcp_metadata  # DCP loads with this, never unpickling .metadata itself
    return meta, ""


def _read_sharded(directory: Path) -> tuple[dict[str, Any] | None, str]:
    """_check_sharded, agreed by every rank (a collective): unusable if any rank found it so."""
    meta, why = _check_sharded(directory)
    why = next((w for w in distributed.gather_objects(why) if w), "")
    return (None, why) if why else (meta, "")


def read_any_checkpoint(run_dir: Path, main: bool = True) -> dict[str, Any] | None:
    """The newest usable checkpoint of the run dir, sharded (`checkpoint/`, then `checkpoint.prev/`)
    or whole (checkpoint.read_checkpoint, with its fallback); None: none exists. A sharded one
    carries "sharded": True. Every rank calls (the sharded ones' verification is shared). Only
    checkpoints present but refused (changed bytes, no digests): UserError."""
    found: list[dict[str, Any]] = []
    unusable: list[tuple[str, str]] = []
    for name in (SHARDED, SHARDED_PREVIOUS):
        meta, why = _read_sharded(run_dir / name)
        if meta is not None:
            meta["sharded"] = True
            found.append(meta)
            break  # the latest complete one; the previous is only its fallback
        if why != "missing":
            unusable.append((name, why))
    try:
        whole = read_checkpoint(run_dir, main)
    except UserError:
        if not found:
            raise
        whole = None
    if whole is not None:
        found.append(whole)
    refused = [(name, why) for name, why in unusable if not why.startswith("incomplete")]
    if not found:
        if not refused:  # nothing, or only interrupted saves: nothing to resume
            return None
        unverified = [name for name, why in refused if why.startswith("unverified")]
        raise UserError(f"no usable checkpoint in {run_dir}: {', '.join(f'{n}/ is {w}' for n, w in refused)}; "
                        + (unverified_fix(run_dir, unverified, sharded=True) if unverified else
                           "start a new run dir (leave hydra.run.dir unset, or name a new one)"))
    newest = max(found, key=lambda c: c["step"])
    if unusable and main:
        logging.getLogger("marl_llm").warning(f"warning: {'; '.join(f'{n}/ is {w}' for n, w in unusable)}; resuming "
                                              f"from {newest['path']} (step {newest['step']})")
    return newest


def restore_any_checkpoint(run_dir: Path, ckpt: dict[str, Any], policies: AgentPolicies, algorithm: Any = None,
                           main: bool = True) -> None:
    """restore_checkpoint, and for a sharded checkpoint its parts first, resharded to how this
    run holds them (every rank calls)."""
    if ckpt.get("sharded"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_state_dict

        named = parts(policies, algorithm)
        every = sorted(set().union(*distributed.gather_objects(sorted(named))))
        if every != sorted(ckpt["parts"]):
            raise UserError(f"{ckpt['path']} holds {ckpt['parts']} but this config trains {every}; resume with "
                            "the config the run was started with, or start a new run dir (hydra.run.dir=...)")
        from marl_llm.runs import safe_dcp

        state = {name: _state(*part) for name, part in named.items()}
        try:
            dcp.load(state, storage_reader=safe_dcp.VerifiedReader(ckpt["path"], ckpt["dcp_metadata"]),
                     planner=safe_dcp.PlainDataLoadPlanner())
        except CheckpointException as err:  # raised on every rank: DCP gathers the failures
            planted = safe_dcp.refused_global(err)
            if planted is None:
                raise
            raise UserError(f"{ckpt['path']} is not plain data (a value in it would run {planted} when loaded; "
                            "marl-llm loads only tensors and plain data): refused; its digests match, so it was "
                            "written so on purpose: start a new run dir") from None
        for name, (module, optimizer) in named.items():
            set_state_dict(module, optimizer, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optim"])
    restore_checkpoint(run_dir, ckpt, policies, algorithm, main)
