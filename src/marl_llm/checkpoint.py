"""Checkpoints that hold everything needed to resume, written atomically.

`<run_dir>/checkpoint.pt` holds the adapters, the optimizer states, the step, every RNG state,
the resolved config and the W&B run id. It is written to a temporary file in the same directory
and renamed over the old one, so a crash mid-write never loses the previous checkpoint.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from marl_llm.atomic import atomic_write, atomic_write_text  # noqa: F401  (re-exported)
from marl_llm.config import UserError
from marl_llm.models import AgentPolicies

CHECKPOINT = "checkpoint.pt"


def atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, cfg: DictConfig, policies: AgentPolicies, step: int,
                    wandb_id: str | None, algorithm_state: dict[str, Any] | None = None) -> Path:
    """algorithm_state: the algorithm's own training state (critics, ...), `Algorithm.state_dict()`."""
    path = run_dir / CHECKPOINT
    atomic_torch_save({
        "step": step,
        "adapters": policies.adapter_state(),
        "optimizers": policies.optimizer_state(),
        "algorithm": algorithm_state or {},
        "rng": rng_state(),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "wandb_id": wandb_id,
    }, path)
    return path


def load_checkpoint(run_dir: Path, policies: AgentPolicies, algorithm: Any = None) -> dict[str, Any] | None:
    """Restore adapters, optimizers, the algorithm's state (critics) and RNG states from run_dir;
    returns the checkpoint (or None)."""
    path = run_dir / CHECKPOINT
    if not path.is_file():
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    try:
        policies.load_adapter_state(ckpt["adapters"])
        policies.load_optimizer_state(ckpt["optimizers"])
        if algorithm is not None:
            algorithm.load_state_dict(ckpt.get("algorithm", {}))
    except (KeyError, RuntimeError, ValueError) as err:
        raise UserError(f"{path} does not match this config's agents/adapters ({err}); resume with the "
                        "config the run was started with, or start a new run dir (hydra.run.dir=...)") from None
    set_rng_state(ckpt["rng"])
    return ckpt
