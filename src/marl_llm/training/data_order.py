"""Which training problems each step sees: a pure function of (seed, step), so a resumed run sees
exactly the batches the uninterrupted run would have seen, on any number of ranks.

trainer.data_order: `shuffle` (marl-llm's default) draws each epoch in a fresh order; `in_order`
walks the training set in its own order every epoch, as the reference trainers' DataLoader
(comlrl 1.4.3: shuffle=False)."""

from __future__ import annotations

import dataclasses

import torch

from marl_llm.rollout.base import sample_key
from marl_llm.tasks import Problem


DATA_ORDERS = ("shuffle", "in_order")


def batch_for_step(problems: list[Problem], step: int, size: int, seed: int, order: str = "shuffle") -> list[Problem]:
    """The step's problems: epoch-wise shuffles derived from (seed, epoch) (`order="in_order"`: the
    set's own order every epoch), so the data order is a pure function of the step and a resumed
    run sees exactly the batches it would have seen. Each draw k carries its own sampling key
    (seed, k): what its rollouts sample does not depend on which rank or batch it lands in."""
    out = []
    for k in range(step * size, (step + 1) * size):
        epoch, pos = divmod(k, len(problems))
        if order == "shuffle":
            pos = int(torch.randperm(len(problems), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))[pos])
        out.append(dataclasses.replace(problems[pos], sample_key=sample_key(seed, k)))
    return out


def ends_epoch(step: int, size: int, num_problems: int, max_steps: int) -> bool:
    """Does trainer step `step` (draws step*size .. (step+1)*size - 1, batch_for_step) finish a pass
    over the training set? The run's last step counts as one, so no held-back sample is left."""
    if step + 1 == max_steps:
        return True
    return num_problems > 0 and ((step + 1) * size) // num_problems > (step * size) // num_problems
