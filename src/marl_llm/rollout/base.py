"""The rollout interface (small on purpose, as verl's): what the algorithms ask for
(`GenRequest`: an agent's message and its sampling), what they get back (`Completion`: exact token
ids, never re-tokenized), and the backend's two calls (`Rollout`). Backends: decode.HFRollout (the
trainer's own models) and vllm.VLLMRollout (GPU)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the task modules that import this stay light (no torch)
    import torch

    from marl_llm.rollout.sampling import SamplingParams

# Progress events for whoever watches the run (the console's progress, training.console.Watch, which lists
# them): debug records of a logger that nothing prints, enabled only while watched. Other modules
# report by the logger's name without importing this one.
PROGRESS = logging.getLogger("marl_llm.progress")
PROGRESS.propagate = False

@dataclass
class GenRequest:
    agent: int
    message: str  # the agent's user message for this turn
    sampling: SamplingParams
    # Seeds this request's random draws (None: the global RNG). A request draws the same tokens
    # whatever else shares its batch, so splitting a step's problems over data-parallel ranks
    # samples exactly what one process would (see sample_key).
    key: int | None = None


def sample_key(*parts: int | str | None) -> int | None:
    """A 63-bit key from a path of parts (run seed, problem draw, turn, agent, sibling), or None
    when the path starts from no key (evaluation: the global RNG)."""
    if parts and parts[0] is None:
        return None
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Completion:
    prompt_ids: torch.Tensor  # [P] int64 on CPU, no padding
    completion_ids: torch.Tensor  # [C] int64 on CPU: generated ids through the first EOS, nothing after
    text: str  # the completion decoded without special tokens
    truncated: bool  # hit max_new_tokens before any EOS
    # [C] float32 on CPU: each completion token's log-prob under the sampler that drew it (vLLM's
    # raw model distribution, temperature 1: the trainer's definition), NaN where the sampler
    # reported none; None from HFRollout (the trainer's own model). The update corrects the
    # sampler/trainer mismatch with it (algo.rollout_is_cap, algos/losses.py).
    rollout_logprobs: torch.Tensor | None = None
    # [L] int64 on CPU: the ids the policy loss scores when algo.loss_tokens asks for others than
    # the completion's (algos/loss_tokens.py: comlrl's padded rows, or the ids before the first
    # pad); None: completion_ids. Only the loss reads it; lengths and stats stay the completion's.
    loss_ids: torch.Tensor | None = None

    @property
    def scored_ids(self) -> torch.Tensor:
        """The ids the policy loss scores: loss_ids when set, else completion_ids."""
        return self.completion_ids if self.loss_ids is None else self.loss_ids


class Rollout(Protocol):
    """What the algorithms generate with: HFRollout (default) or vllm_rollout.VLLMRollout."""

    def generate(self, requests: list[GenRequest]) -> list[Completion]: ...

    def update_weights(self) -> None:
        """Called after every update: a backend with its own copy of the weights syncs them."""

    def release(self) -> None:
        """Called at the end of every rollout phase (before the update) and evaluation: the
        backend frees what the phase held (KV caches; vLLM sleeps)."""
