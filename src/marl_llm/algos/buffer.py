"""comlrl's update granularity: a per-policy buffer of samples, drained turn group by turn group.

The reference trainers (comlrl 1.4.3 MAGRPOTrainer and MAACTrainer) do not take one optimizer
step per prompt. Each agent keeps a buffer that is filled in rollout order, across prompts:

    for each sample, in rollout order (MAGRPO: a tree's sibling groups depth first; actor-critic:
    a trajectory's turns), agent by agent:
        buffer[policy].append(sample)
        once every agent's sample of that rollout position is in: drain each buffer holding
        >= rollout_buffer_size samples
    at the end of every epoch: drain every non-empty buffer

    drain(buffer): for each turn, in order: shuffle that turn's samples, cut them into batches of
    train_batch_size samples, one optimizer step per batch

so one prompt yields about (samples per prompt) / rollout_buffer_size drains, each of one step
per turn present (HumanEval, G=4, 2 turns, buffer 2: about 2.5 steps per prompt). The buffer
persists across trainer steps and is part of the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

import torch

from marl_llm.config import UserError
from marl_llm.distributed.data_parallel import world
from marl_llm.rollout.base import Completion


@dataclass
class BufferedSample:
    """One buffered sample: MAGRPO's node (the G completions of one sibling group with their
    advantages: Tensor[G]) or an actor-critic turn sample (one completion). `extra` carries what an
    algorithm needs at drain time (tensors or plain values)."""

    turn: int
    completions: list[Completion]
    advantages: torch.Tensor
    extra: dict[str, Any] | None = None


class SampleBuffer:
    """Per-policy buffers with comlrl's drain rule; `key` names a policy (any hashable)."""

    @classmethod
    def from_cfg(cls, algo_cfg: Any, seed: int) -> "SampleBuffer | None":
        """The buffer algo.rollout_buffer_size asks for (None: the algorithm's own granularity)."""
        if algo_cfg.get("rollout_buffer_size") is None:
            return None
        if world().size > 1:
            raise UserError("algo.rollout_buffer_size (comlrl's per-agent buffer) runs on one process: set "
                            "algo.rollout_buffer_size=null for data-parallel runs")
        return cls(algo_cfg.rollout_buffer_size, algo_cfg.train_batch_size, seed)

    def __init__(self, size: int, batch_size: int | None, seed: int):
        self.size = size
        self.batch_size = batch_size or size
        self.seed = seed
        self.items: dict[Hashable, list[BufferedSample]] = {}
        self.drains = 0  # drains so far: seeds each drain's shuffle (resumable, rank-independent)

    def push(self, key: Hashable, sample: BufferedSample) -> bool:
        """Append; True when the buffer is full (drain it once the rollout position is complete)."""
        items = self.items.setdefault(key, [])
        items.append(sample)
        return len(items) >= self.size

    def pending(self) -> list[Hashable]:
        """Policies whose buffers hold samples (drained at the end of an epoch)."""
        return [k for k, v in self.items.items() if v]

    def run(self, positions: Iterable[list[tuple[Hashable, BufferedSample]]],
            train: Callable[[Hashable, list[list[BufferedSample]]], None], end_of_epoch: bool) -> None:
        """comlrl's fill-and-drain loop over a trainer step's samples: each rollout position's
        samples (one per agent) go in, then every buffer that became full is drained into
        `train(key, batches)`; at the end of an epoch every non-empty buffer is."""
        for position in positions:
            full = [key for key, sample in position if self.push(key, sample)]
            for key in dict.fromkeys(full):
                train(key, self.drain(key))
        if end_of_epoch:
            for key in self.pending():
                train(key, self.drain(key))

    def drain(self, key: Hashable) -> list[list[BufferedSample]]:
        """Empty `key`'s buffer into its optimizer batches: turn by turn (ascending), each turn's
        samples shuffled and cut into batches of `batch_size`."""
        items, self.items[key] = self.items.get(key, []), []
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.drains)
        self.drains += 1
        batches = []
        for turn in sorted({s.turn for s in items}):
            group = [s for s in items if s.turn == turn]
            group = [group[j] for j in torch.randperm(len(group), generator=gen).tolist()]
            batches.extend(group[s:s + self.batch_size] for s in range(0, len(group), self.batch_size))
        return batches

    # ---------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        def plain(s: BufferedSample) -> dict[str, Any]:
            return {"turn": s.turn, "advantages": s.advantages, "extra": s.extra,
                    # Completion's fields in order (Completion(*c) also reads the older 4-tuples).
                    "completions": [(c.prompt_ids, c.completion_ids, c.text, c.truncated, c.rollout_logprobs,
                                     c.loss_ids) for c in s.completions]}
        return {"drains": self.drains, "items": [(k, [plain(s) for s in v]) for k, v in self.items.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drains = state["drains"]
        self.items = {k: [BufferedSample(s["turn"], [Completion(*c) for c in s["completions"]], s["advantages"],
                                         s["extra"]) for s in v]
                      for k, v in state["items"]}


def step_stats(prefix: str, parts: list[dict[str, float]]) -> dict[str, float]:
    """The stats of one policy's (or critic's) optimizer steps of a trainer step, under `prefix`,
    with `<prefix>/optimizer_steps` (0 when its buffer did not drain)."""
    out = {f"{prefix}/{k}": v for k, v in merge_update_stats(parts).items()}
    out[f"{prefix}/optimizer_steps"] = float(sum(p.get("optimizer_steps", 1.0) for p in parts))
    return out


def merge_update_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """One policy's stats over several optimizer steps: token and step counts add up, length
    extremes stay extremes, everything else is the mean over the steps."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        if key in ("num_tokens", "prompt_tokens", "optimizer_steps"):
            out[key] = sum(values)
        elif key in ("completions/min_length", "completions/min_terminated_length"):
            out[key] = min(values)
        elif key in ("completions/max_length", "completions/max_terminated_length"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out
