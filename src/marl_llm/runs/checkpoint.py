"""Checkpoints that hold everything needed to resume, written atomically, with a fallback.

`<run_dir>/checkpoint.pt` holds the adapters (with algo.lora=null: every policy's full weights,
fp32 master weights as trained, under the same "adapters" key, marked by "weights": "full"), the
optimizer states, the step, the RNG states (CUDA: the rank's own GPU's), the resolved config, the W&B run id and how far the
local logs had got. It is written to a temporary file in the same directory; then the previous
checkpoint becomes `checkpoint.prev.pt` and the new one is renamed into place. A kill at any
moment leaves at least one complete checkpoint. Each checkpoint's SHA-256 is kept beside it
(`checkpoint.pt.sha256`, runs/digest.py) and checked before any byte of it is unpickled, so a
corrupt or partial `checkpoint.pt` (a bad copy, changed bytes of the same size, a full disk), or
one whose digest is missing or malformed, is refused on resume, which then falls back to
`checkpoint.prev.pt` and says so. A save that finds the disk full raises ENOSPC (the trainer
says so in one line). A resume compares its config with the checkpoint's (plain data, as the
whole checkpoint): settings that change training are refused unless
trainer.resume_allow_changes names them (FREE_ON_RESUME lists the ones that need no permission).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shlex
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from marl_llm.runs import digest
from marl_llm.runs.atomic import atomic_write
from marl_llm.config import UserError
from marl_llm.models.policies import AgentPolicies
from marl_llm.runs.rundir import CHECKPOINT, PREVIOUS

# What an older checkpoint's numpy RNG state (a uint32 array) unpickles through: nothing else.
NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
REQUIRED = ("step", "adapters", "optimizers", "rng", "config", "wandb_id")
LOGS = ("metrics.jsonl", "samples.jsonl")
# Fault injection for the kill-and-resume tests: "kill_in_checkpoint:<step>" SIGKILLs the run
# halfway through writing that step's checkpoint.
FAULT_ENV = "MARL_LLM_FAULT"
# torch reports a write that failed for want of space as a RuntimeError without errno: with less
# than this left on the run dir's file system, that is what it was.
FULL_BELOW = 16 * 2**20


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain data (checkpoints load with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # This rank's own GPU only (the current device: each rank's, set when it joined the
        # group): a resume may see another number of GPUs (torchrun against SLURM's
        # --gpus-per-task), and the other GPUs' generators are other ranks' business.
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    if isinstance(n, dict):
        n = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    np.random.set_state(n)  # checkpoints from before plain data hold numpy's own tuple
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])
    elif "cuda" in state:  # an older checkpoint: every visible GPU's state; this rank's is its device's
        device = torch.cuda.current_device()
        if device < len(state["cuda"]):
            torch.cuda.set_rng_state(state["cuda"][device])


def checkpoint_state(run_dir: Path, cfg: DictConfig, policies: AgentPolicies | None, step: int,
                     wandb_id: str | None, algorithm_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint holds, as plain data and CPU tensors. policies=None: the policies' weights
    and optimizer states are kept elsewhere (a sharded checkpoint's own files: sharded_checkpoint.py)."""
    return {
        "step": step,
        "adapters": policies.adapter_state() if policies is not None else None,
        "weights": policies.kind if policies is not None else None,  # "lora" | "full" (algo.lora=null)
        "optimizers": policies.optimizer_state() if policies is not None else None,
        "algorithm": algorithm_state or {},
        "rng": rng_state(),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "wandb_id": wandb_id,
        # Bytes of each local log at this step: a resumed run cuts the logs back to them, so the
        # steps it repeats are not logged twice.
        "log_bytes": {name: (run_dir / name).stat().st_size if (run_dir / name).exists() else 0 for name in LOGS},
    }


def save_checkpoint(run_dir: Path, cfg: DictConfig, policies: AgentPolicies, step: int,
                    wandb_id: str | None, algorithm_state: dict[str, Any] | None = None) -> Path:
    """algorithm_state: the algorithm's own training state (critics, ...), `Algorithm.state_dict()`."""
    path = run_dir / CHECKPOINT
    state = checkpoint_state(run_dir, cfg, policies, step, wandb_id, algorithm_state)

    sha256 = []

    def write(tmp: str) -> None:
        try:
            torch.save(state, tmp)
        except RuntimeError as err:  # torch's zip writer on a full disk: "file write failed", "unexpected pos"
            if shutil.disk_usage(run_dir).free < FULL_BELOW:  # the partial temp file is still there
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
            raise
        if os.environ.get(FAULT_ENV) == f"kill_in_checkpoint:{step}":
            with open(tmp, "r+b") as f:  # half a file on disk, then the process is gone
                f.truncate(os.path.getsize(tmp) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        sha256.append(digest.file_digest(tmp))  # verified on resume (digest.verify)

    def rotate(tmp: str) -> None:  # with Ctrl-C held back, right before tmp becomes checkpoint.pt
        if path.exists():
            digest.move(path, run_dir / PREVIOUS)  # the last good checkpoint stays until the next save
        digest.write_digest(path, sha256[0])

    atomic_write(path, write, before_replace=rotate)  # a failure removes the temp file; the old ones stay
    return path


def refused_global(err: pickle.UnpicklingError) -> str:
    """The global that torch.load(weights_only=True) refused to run, by its dotted name ("code"
    where its message names none)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return found.group(1) if found else "code"


def load_plain(path: Path, what: str = "it") -> tuple[Any, str]:
    """(what the torch.save file holds, "") or (None, why it cannot be used). Tensors and plain data
    only: unpickling anything else could run code planted in the file. Older checkpoints hold
    numpy's RNG state as an array: its reconstruction is allowed too."""
    try:
        with torch.serialization.safe_globals(NUMPY_ARRAY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True), ""
    except pickle.UnpicklingError as err:
        return None, (f"not plain data ({what} would run {refused_global(err)} when loaded; marl-llm "
                      "loads only tensors and plain data)")
    except Exception as err:  # noqa: BLE001  (a truncated zip, garbage bytes, ...)
        return None, f"unreadable ({'' if what == 'it' else what + ': '}{type(err).__name__}: {str(err)[:120]})"


def _read(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(checkpoint, "") or (None, why it cannot be used)."""
    if not path.is_file():
        return None, "missing"
    # Before anything is unpickled: bytes changed since the save (same size included), or no
    # usable digest (deleted, emptied, another file's) refuse the file.
    changed = digest.verify(path)
    if changed:
        return None, changed
    ckpt, why = load_plain(path)
    if why:
        return None, why
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
    return (None, f"incomplete (no {', '.join(missing)})") if missing else (ckpt, "")


def unverified_fix(run_dir: Path, names: list[str], sharded: bool = False) -> str:
    """The fix for checkpoints without digests (written by a marl-llm from before it recorded
    them, or whose digests were removed): record their digests, by hand, if they are trusted."""
    where = shlex.quote(str(run_dir))
    if sharded:
        how = " && ".join(f"(cd {where}/{n} && sha256sum .metadata meta.pt __*.distcp > {digest.SUMS})" for n in names)
    else:
        how = " && ".join(f"sha256sum {n} > {n}{digest.SUFFIX}" for n in names)
        how = f"cd {where} && {how}"
    return (f"a checkpoint without its digests is never loaded; if you trust {' and '.join(names)} (written by a "
            f"marl-llm from before digests, and nobody else writes this dir), record them with: {how}; then "
            "resume again; else start a new run dir")


def read_checkpoint(run_dir: Path, main: bool = True) -> dict[str, Any] | None:
    """The run dir's checkpoint, falling back to the previous one when the latest is corrupt (and
    saying so), with its file under "path". None: neither file exists (nothing to resume; the
    trainer decides whether that is an error). Both present but unusable: UserError. Read before
    the model loads, so that a refusal (no checkpoint, a changed config) costs seconds. `main`:
    this process prints (data-parallel ranks other than 0 only read)."""
    path = run_dir / CHECKPOINT
    ckpt, why = _read(path)
    if ckpt is None:
        previous, why_previous = _read(run_dir / PREVIOUS)
        if previous is None:
            if why == "missing" and why_previous == "missing":
                return None
            raise UserError(f"no usable checkpoint in {run_dir}: {CHECKPOINT} is {why}, {PREVIOUS} is {why_previous}; "
                            + (unverified_fix(run_dir, [n for n, w in ((CHECKPOINT, why), (PREVIOUS, why_previous))
                                                        if w.startswith("unverified")])
                               if "unverified" in why + why_previous else
                               "start a new run dir (leave hydra.run.dir unset, or name a new one)"))
        if main:
            logging.getLogger("marl_llm").warning(f"warning: {path} is {why}; resuming from {PREVIOUS} "
                                                  f"(step {previous['step']})")
        ckpt, path = previous, run_dir / PREVIOUS
    ckpt["path"] = str(path)
    return ckpt


def restore_checkpoint(run_dir: Path, ckpt: dict[str, Any], policies: AgentPolicies, algorithm: Any = None,
                       main: bool = True) -> None:
    """Restore adapters, optimizers, the algorithm's state (critics) and RNG states from a
    checkpoint that read_checkpoint returned, and cut the local logs back to its step."""
    path = ckpt["path"]
    kind = ckpt.get("weights", "lora")  # checkpoints from before full fine-tuning hold adapters
    if kind is not None and kind != policies.kind:  # None: a sharded checkpoint (checked there)
        have, want = ("full weights (algo.lora=null)", "LoRA adapters") if kind == "full" else \
            ("LoRA adapters", "full weights (algo.lora=null)")
        raise UserError(f"{path} holds {have} but this config trains {want}; resume with the config the run was "
                        "started with, or start a new run dir (hydra.run.dir=...)")
    try:
        if ckpt["adapters"] is not None:  # None: restored from a sharded checkpoint's own files
            policies.load_adapter_state(ckpt["adapters"])
            policies.load_optimizer_state(ckpt["optimizers"])
        if algorithm is not None:
            algorithm.load_state_dict(ckpt.get("algorithm", {}))
    except (KeyError, RuntimeError, ValueError) as err:
        raise UserError(f"{path} does not match this config's agents/adapters ({err}); resume with the "
                        "config the run was started with, or start a new run dir (hydra.run.dir=...)") from None
    set_rng_state(ckpt["rng"])
    if main:
        _cut_logs(run_dir, ckpt.get("log_bytes", {}))


def load_checkpoint(run_dir: Path, policies: AgentPolicies, algorithm: Any = None,
                    main: bool = True) -> dict[str, Any] | None:
    """read_checkpoint, then restore_checkpoint. Returns the checkpoint (None: nothing to resume,
    nothing restored)."""
    ckpt = read_checkpoint(run_dir, main)
    if ckpt is not None:
        restore_checkpoint(run_dir, ckpt, policies, algorithm, main)
    return ckpt


# Settings a resume may change without trainer.resume_allow_changes, by key or by section: none
# of them changes what the run learns. They say where the run dir is, what the run logs and
# evaluates, how often it saves, how long it runs, and where and how fast it computes (the same
# math, at most with other floating-point rounding: micro-batches are weighted to sum to the same
# loss). Everything else (seed, learning rate, G, model, task, algorithm, ...) is refused unless
# allowed: a resumed run's restored optimizer and data order belong to the checkpoint's settings.
FREE_ON_RESUME = (
    "run_dir", "logger", "cluster", "plan",
    "trainer.max_steps",  # a longer (or shorter) run; with a non-constant LR schedule it is not free
    "trainer.resume", "trainer.resume_allow_changes", "trainer.save_every", "trainer.summary_file",
    "trainer.eval_every", "trainer.eval_protocol", "trainer.eval_interval", "trainer.eval_before", "trainer.eval_after", "trainer.eval_max_problems",
    "trainer.eval_num_samples", "trainer.eval_k",
    "trainer.sequences_per_generate", "trainer.completions_per_micro_batch", "trainer.decode",
    "trainer.compile_decode", "trainer.gradient_checkpointing", "trainer.deterministic", "trainer.peak_tflops",
    "trainer.distributed_timeout_min", "trainer.vllm_gpu_memory_utilization", "trainer.vllm_sleep", "trainer.fsdp",
    "trainer.fsdp_unshard_rollout", "trainer.fsdp_load", "trainer.placement", "trainer.placement_groups",
    "trainer.placement_devices",
    "trainer.work_split",  # the same steps, spread otherwise (a sharded checkpoint reshards)
    "model.device", "model.attn_implementation",
    "model.name",  # a label (runs from before model=local was named after its checkpoint dir)
    "trainer.export_agents", "trainer.export_with_checkpoints",  # what is written at the end, not how it trains
    "trainer.history_every", "trainer.history_keep",  # the agents kept along the way (export.export_history)
    "trainer.threads", "trainer.progress", "trainer.progress_every_s",  # speed and console only
    "task.sandbox.workers", "task.sandbox.isolation",  # how programs are run, not what they score
)
ABSENT = "(absent)"  # a key one of the two configs does not have (a setting added since, another algo's)


def config_changes(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every leaf that differs between two resolved
    configs (plain containers); a key that only one of them has is a change from or to ABSENT."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return {} if old == new else {prefix: (old, new)}
    changes: dict[str, tuple[Any, Any]] = {}
    for key in [*new, *(k for k in old if k not in new)]:
        name = f"{prefix}.{key}" if prefix else str(key)
        changes.update(config_changes(old.get(key, ABSENT), new.get(key, ABSENT), name))
    return changes


def _leaves(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict) or not tree:
        return [prefix]
    return [leaf for key, value in tree.items() for leaf in _leaves(value, f"{prefix}.{key}" if prefix else str(key))]


def _covers(entry: str, key: str) -> bool:
    return key == entry or key.startswith(entry + ".")


def free_on_resume(key: str, old_config: dict[str, Any]) -> bool:
    if key == "trainer.max_steps":  # a cosine schedule decays over trainer.max_steps
        return (old_config.get("algo") or {}).get("lr_scheduler", "constant") == "constant"
    return any(_covers(entry, key) for entry in FREE_ON_RESUME)


def added_setting(key: str, cfg: DictConfig) -> bool:
    """A config field the checkpoint's marl-llm did not have yet (its behaviour then was the
    field's default); a key added to a map (algo.policy_map.<agent>) is not one."""
    from marl_llm.config_keys import chosen_schemas, walk_key

    schemas, _ = chosen_schemas([f"algo={cfg.algo.get('name')}", f"task={cfg.task.get('name')}"])
    return walk_key(key, schemas, False)[0] == "ok"


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def check_resume_config(ckpt: dict[str, Any], cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """The changes from the checkpoint's config to this one (all of them, to record). Raises
    UserError, listing each one `old -> new`, when one that changes training is not allowed by
    trainer.resume_allow_changes (keys or sections, or `all`)."""
    old = ckpt["config"]
    new = OmegaConf.to_container(cfg, resolve=True)
    changes = config_changes(old, new)
    allowed = [str(a) for a in (cfg.trainer.get("resume_allow_changes") or [])]
    keys = [*_leaves(old), *_leaves(new)]  # every key either config has
    unknown = [a for a in allowed if a != "all" and not any(_covers(a, k) for k in keys)]
    if unknown:
        raise UserError(f"trainer.resume_allow_changes names {', '.join(unknown)}, which is no config key: name "
                        "keys (algo.learning_rate) or sections (algo), or [all]")
    refused = [k for k in changes if not free_on_resume(k, old)
               and not (changes[k][0] == ABSENT and added_setting(k, cfg))
               and not any(a == "all" or _covers(a, k) for a in allowed)]
    if refused:
        listed = ", ".join(f"{k} {_show(changes[k][0])} -> {_show(changes[k][1])}" for k in refused)
        raise UserError(f"resuming {ckpt['path']} (step {ckpt['step']}) with settings that change training: {listed}; "
                        f"drop these changes, or accept them with trainer.resume_allow_changes=[{','.join(refused)}] "
                        "(or [all])")
    return changes


def _cut_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Truncate each log to the size it had at the checkpoint, so repeated steps are logged once."""
    for name, size in sizes.items():
        log = run_dir / name
        if log.exists() and log.stat().st_size > size:
            with open(log, "r+b") as f:
                f.truncate(size)
