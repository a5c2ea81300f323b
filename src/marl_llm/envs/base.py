"""The interface of a grid environment: `reset(seed)`, `step(actions)`, `render()`, `copy()`.

An environment is one episode's state. `step` applies a list of moves in order (stopping early
when the episode ends) and returns the summed per-move reward; `copy()` gives an independent
state for trying actions without committing them (AT-GRPO scores a candidate on a copy, and the
chosen candidate is then applied to the *same* object that is later scored and rendered).
"""

from __future__ import annotations

import copy as _copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


@dataclass
class StepResult:
    """What `step(actions)` did.

    reward: sum of the per-move rewards (plus terminal bonuses/penalties) of the moves applied;
    applied: moves actually executed (valid or not) before the episode ended; valid / invalid:
    counts among them; done: the episode is over (solved, or the move cap was hit); success:
    solved (a move-cap ending is never a success).
    """

    reward: float = 0.0
    applied: int = 0
    valid: int = 0
    invalid: int = 0
    done: bool = False
    success: bool = False
    info: dict = field(default_factory=dict)


class GridEnv(ABC):
    @abstractmethod
    def reset(self, seed: int) -> None:
        """Generate the level of `seed` (deterministic per seed) and start a new episode."""

    @abstractmethod
    def step(self, actions: list[str]) -> StepResult:
        """Apply moves ("U", "D", "L", "R") in order; see StepResult."""

    @abstractmethod
    def render(self) -> str:
        """The ASCII observation shown to the agents (grid, legend, progress line)."""

    # Set by step(): the episode is over / it ended solved (a move cap is never a success).
    _done: bool = False
    _success: bool = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def success(self) -> bool:
        return self._success

    @abstractmethod
    def optimal_length(self) -> int | None:
        """Moves of a shortest solution from the current state (None: unsolvable)."""

    def copy(self) -> "GridEnv":
        return _copy.deepcopy(self)
