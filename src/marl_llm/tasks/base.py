"""The task interface: one module per task implements it, one YAML under conf/task/ selects it.

A task is a cooperative environment for N agents. Each agent sees only its own prompt (one user
message per turn); the task scores the *joint* action with one team reward and, in multi-turn
tasks, writes every agent's next prompt from its own history plus environment feedback.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from marl_llm.registry import registrar


@dataclass
class Problem:
    """One environment instance (a HumanEval problem, a post to summarize, ...)."""

    uid: str
    data: dict[str, Any]


@dataclass
class JointReward:
    """The team reward of one joint action, unshifted (in the task's natural range).

    levels: the reward's components as they add up to `total` (gated), e.g.
        {"structure": 1.0, "syntax": 0.5, "tests": 0.0, "cooperation": 0.0}; logged as
        rewards/<level>/mean.
    info: diagnostics the task needs to write feedback (per-test results, ...). Not logged.
    passed: code tasks only: the combined program passed every test (pass@k); None otherwise.
    """

    total: float
    levels: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    passed: bool | None = None


@dataclass
class Turn:
    """What one agent saw and did in one turn."""

    prompt: str
    action: str


class Task(ABC):
    """Base class of every task.

    Subclasses set `agent_names` and implement the four abstract methods. `cfg` is the task's
    config node (conf/task/<name>.yaml, schema in marl_llm.config).
    """

    agent_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Any):
        self.cfg = cfg

    @property
    def num_agents(self) -> int:
        return len(self.agent_names)

    @abstractmethod
    def load_split(self, split: str) -> list[Problem]:
        """Problems of `split` ("train" or "eval"), in a fixed order."""

    @abstractmethod
    def initial_prompts(self, problem: Problem) -> list[str]:
        """The first user message of every agent, in `agent_names` order."""

    @abstractmethod
    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        """Score joint actions in one batch (so slow scorers, e.g. sandboxed tests, run in parallel).

        problems[j] is the instance of joint action j; joint_actions[j][i] is agent i's text.
        """

    def next_prompts(
        self, problem: Problem, histories: list[list[Turn]], reward: JointReward
    ) -> list[str]:
        """Every agent's next user message after a turn (multi-turn tasks override this).

        histories[i] holds agent i's turns so far (last one included); `reward` is the joint
        reward of the last joint action, whose `info` carries the environment's feedback.
        """
        raise NotImplementedError(f"task {type(self).__name__} is single-turn: set algo.num_turns=1")


TASKS: dict[str, Callable[[Any], Task]] = {}


# Class decorator: `@register_task("name")` makes a Task available as `task=<name>`.
register_task = registrar(TASKS, "task")


def import_submodules(package: str) -> None:
    """Import every module of `package`, so their registration decorators run."""
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{mod.name}")


def build_task(cfg: Any) -> Task:
    import_submodules("marl_llm.tasks")
    if cfg.name not in TASKS:
        raise ValueError(f"unknown task.name={cfg.name!r}; registered tasks: {sorted(TASKS)}")
    return TASKS[cfg.name](cfg)
