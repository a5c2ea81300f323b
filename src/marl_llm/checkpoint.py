"""Checkpoints that hold everything needed to resume, written atomically, with a fallback.

`<run_dir>/checkpoint.pt` holds the adapters (with algo.lora=null: every policy's full weights,
fp32 master weights as trained, under the same "adapters" key, marked by "weights": "full"), the
optimizer states, the step, every RNG state, the resolved config, the W&B run id and how far the
local logs had got. It is written to a temporary file in the same directory; then the previous
checkpoint becomes `checkpoint.prev.pt` and the new one is renamed into place. A kill at any
moment leaves at least one complete checkpoint, and a corrupt or partial `checkpoint.pt` (a bad
copy, a full disk) is detected on resume, which then falls back to `checkpoint.prev.pt` and says
so.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from marl_llm.atomic import atomic_write, atomic_write_text  # noqa: F401  (re-exported)
from marl_llm.config import UserError
from marl_llm.models import AgentPolicies
from marl_llm.rundir import CHECKPOINT, PREVIOUS

# What an older checkpoint's numpy RNG state (a uint32 array) unpickles through: nothing else.
NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
REQUIRED = ("step", "adapters", "optimizers", "rng", "config", "wandb_id")
LOGS = ("metrics.jsonl", "samples.jsonl")
# Fault injection for the kill-and-resume tests: "kill_in_checkpoint:<step>" SIGKILLs the run
# halfway through writing that step's checkpoint.
FAULT_ENV = "MARL_LLM_FAULT"


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain data (checkpoints load with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    if isinstance(n, dict):
        n = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    np.random.set_state(n)  # checkpoints from before plain data hold numpy's own tuple
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, cfg: DictConfig, policies: AgentPolicies, step: int,
                    wandb_id: str | None, algorithm_state: dict[str, Any] | None = None) -> Path:
    """algorithm_state: the algorithm's own training state (critics, ...), `Algorithm.state_dict()`."""
    path = run_dir / CHECKPOINT
    state = {
        "step": step,
        "adapters": policies.adapter_state(),
        "weights": policies.kind,  # "lora" | "full" (algo.lora=null)
        "optimizers": policies.optimizer_state(),
        "algorithm": algorithm_state or {},
        "rng": rng_state(),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "wandb_id": wandb_id,
        # Bytes of each local log at this step: a resumed run cuts the logs back to them, so the
        # steps it repeats are not logged twice.
        "log_bytes": {name: (run_dir / name).stat().st_size if (run_dir / name).exists() else 0 for name in LOGS},
    }

    def write(tmp: str) -> None:
        torch.save(state, tmp)
        if os.environ.get(FAULT_ENV) == f"kill_in_checkpoint:{step}":
            with open(tmp, "r+b") as f:  # half a file on disk, then the process is gone
                f.truncate(os.path.getsize(tmp) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        if path.exists():
            os.replace(path, run_dir / PREVIOUS)  # the last good checkpoint stays until the next save

    atomic_write(path, write)
    return path


def _read(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(checkpoint, "") or (None, why it cannot be used)."""
    if not path.is_file():
        return None, "missing"
    try:
        # Tensors and plain data only: unpickling anything else could run code planted in the file.
        # Older checkpoints hold numpy's RNG state as an array: its reconstruction is allowed too.
        with torch.serialization.safe_globals(NUMPY_ARRAY_GLOBALS):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        return None, (f"not plain data (it would run {found.group(1) if found else 'code'} when loaded; marl-llm loads "
                      "only tensors and plain data)")
    except Exception as err:  # noqa: BLE001  (a truncated zip, garbage bytes, ...)
        return None, f"unreadable ({type(err).__name__}: {str(err)[:120]})"
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
    return (None, f"incomplete (no {', '.join(missing)})") if missing else (ckpt, "")


def load_checkpoint(run_dir: Path, policies: AgentPolicies, algorithm: Any = None,
                    main: bool = True) -> dict[str, Any] | None:
    """Restore adapters, optimizers, the algorithm's state (critics) and RNG states from run_dir,
    falling back to the previous checkpoint when the latest is corrupt; cut the local logs back
    to the checkpoint's step (to nothing when there is no checkpoint: the run starts over).
    Returns the checkpoint (or None: nothing to resume). `main`: this process owns the run dir's
    logs and messages (data-parallel ranks other than 0 only read)."""
    path = run_dir / CHECKPOINT
    ckpt, why = _read(path)
    if ckpt is None:
        previous, why_previous = _read(run_dir / PREVIOUS)
        if previous is None:
            if why == "missing" and why_previous == "missing":
                if main:  # killed (or requeued) before its first checkpoint: its log lines are redone
                    _cut_logs(run_dir, {name: 0 for name in LOGS})
                return None
            raise UserError(f"no usable checkpoint in {run_dir}: {CHECKPOINT} is {why}, {PREVIOUS} is {why_previous}; "
                            "start a new run dir (hydra.run.dir=...) or drop trainer.resume")
        if main:
            print(f"[marl-llm] warning: {path} is {why}; resuming from {PREVIOUS} (step {previous['step']})", flush=True)
        ckpt, path = previous, run_dir / PREVIOUS
    kind = ckpt.get("weights", "lora")  # checkpoints from before full fine-tuning hold adapters
    if kind != policies.kind:
        have, want = ("full weights (algo.lora=null)", "LoRA adapters") if kind == "full" else \
            ("LoRA adapters", "full weights (algo.lora=null)")
        raise UserError(f"{path} holds {have} but this config trains {want}; resume with the config the run was "
                        "started with, or start a new run dir (hydra.run.dir=...)")
    try:
        policies.load_adapter_state(ckpt["adapters"])
        policies.load_optimizer_state(ckpt["optimizers"])
        if algorithm is not None:
            algorithm.load_state_dict(ckpt.get("algorithm", {}))
    except (KeyError, RuntimeError, ValueError) as err:
        raise UserError(f"{path} does not match this config's agents/adapters ({err}); resume with the "
                        "config the run was started with, or start a new run dir (hydra.run.dir=...)") from None
    set_rng_state(ckpt["rng"])
    ckpt["path"] = str(path)
    if main:
        _cut_logs(run_dir, ckpt.get("log_bytes", {}))
    return ckpt


def _cut_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Truncate each log to the size it had at the checkpoint, so repeated steps are logged once."""
    for name, size in sizes.items():
        log = run_dir / name
        if log.exists() and log.stat().st_size > size:
            with open(log, "r+b") as f:
                f.truncate(size)
