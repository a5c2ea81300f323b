"""The task interface: one module per task implements it, one YAML under conf/task/ selects it.

A task is a cooperative environment for N agents. Each agent sees only its own prompt (one user
message per turn); the task scores the *joint* action with one team reward and, in multi-turn
tasks, writes every agent's next prompt from its own history plus environment feedback.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from marl_llm.config import UserError
from marl_llm.registry import schema_registrar


@dataclass
class Problem:
    """One environment instance (a HumanEval problem, a post to summarize, ...)."""

    uid: str
    data: dict[str, Any]
    # Seeds the sampling of this problem's rollouts (rollout.sample_key); the trainer sets it
    # from (run seed, position in the training stream). None: the global RNG (evaluation).
    sample_key: int | None = None


@dataclass
class JointReward:
    """The team reward of one joint action, unshifted (in the task's natural range).

    levels: the reward's components as they add up to `total` (gated), e.g.
        {"structure": 1.0, "syntax": 0.5, "tests": 0.0, "cooperation": 0.0}; logged as
        rewards/<level>/mean.
    info: diagnostics the task needs to write feedback (per-test results, ...). Not logged.
    passed: code tasks only: the combined program passed every test (pass@k); None otherwise.
    ungated: each level's credit as if the earlier levels had passed (tasks that report it);
        logged as rewards/<level>_ungated/mean and, summed, reward_ungated.
    done: the environment ended the episode (e.g. StrBuild reached its success threshold): the
        joint action is not expanded in later turns, whatever the horizon.
    local: each agent's own (role) reward, in agent order, where the task gives one (task=env);
        AT-GRPO scores agent i's candidate alpha * total + local[i]. Empty: none.
    """

    total: float
    levels: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    passed: bool | None = None
    ungated: dict[str, float] = field(default_factory=dict)
    done: bool = False
    local: list[float] = field(default_factory=list)


@dataclass
class Turn:
    """What one agent saw and did in one turn."""

    prompt: str
    action: str


class Task(ABC):
    """Base class of every task.

    Subclasses set `agent_names` (or `agents_for`, when the config names them) and implement the
    four abstract methods. `cfg` is the task's config node (conf/task/<name>.yaml, its schema the
    dataclass registered with the task).
    """

    agent_names: ClassVar[tuple[str, ...]] = ()
    # Fields every data row must have (checked with the file / hub id named in the error).
    required_fields: ClassVar[tuple[str, ...]] = ()
    # Turns the environment supports (None: any; single-turn tasks do not override next_prompts).
    max_turns: ClassVar[int | None] = None
    # Evaluation's name for the fraction of final joint actions with reward.passed (code: pass@1).
    success_metric: ClassVar[str] = "pass@1"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._data = None

    @classmethod
    def agents_for(cls, cfg: Any) -> tuple[str, ...] | None:
        """The agents this task is played by under its config node `cfg`, known before it loads
        (config validation checks the keys of algo.agent_sampling against them); None: only the
        loaded task knows."""
        return tuple(cls.agent_names) or None

    @property
    def num_agents(self) -> int:
        return len(self.agent_names)

    @property
    def name(self) -> str:
        return str(self.cfg.name)

    @property
    def reward_shift(self) -> float:
        """Training reward = task reward + `task.reward_shift` (0 for a schema without the key)."""
        return float(self.cfg.get("reward_shift", 0.0) or 0.0)

    def use_tokenizers(self, tokenizers: list[Any]) -> None:
        """Each agent's tokenizer (agent order), given once the models load, for a task that sizes its
        prompts in tokens (task=env cuts observations to task.max_observation_tokens). Default: unused."""

    def take_metrics(self) -> dict[str, float]:
        """The task's own metrics since the last call (TRL-style names, `<agent>/` segments), logged
        with a training step's and an evaluation's (task=env: observations/clipped_ratio). Default: none."""
        return {}

    # -- data --------------------------------------------------------------------------------
    def packaged_rows(self, split_name: str) -> list[dict[str, Any]]:
        """Rows of split `split_name` of the task's packaged source: by default the offline sample
        written for this project, src/marl_llm/samples/<task>/<split>.jsonl."""
        from marl_llm.tasks.data import read_packaged_sample

        return read_packaged_sample(self.name, split_name)

    def load_split(self, split: str) -> list[Problem]:
        """Problems of `split` ("train" or "eval"), in a fixed order, from `task.data`."""
        from marl_llm.tasks.data import TaskData

        if self._data is None:
            self._data = TaskData(self.cfg.data, self.name, self.required_fields, self.packaged_rows)
        rows = self._data.split(split)
        return [Problem(uid=str(r.get("task_id", f"{self.name}/{split}/{i}")), data=dict(r)) for i, r in enumerate(rows)]

    @abstractmethod
    def initial_prompts(self, problem: Problem) -> list[str]:
        """The first user message of every agent, in `agent_names` order."""

    @abstractmethod
    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        """Score joint actions in one batch (so slow scorers, e.g. sandboxed tests, run in parallel).

        problems[j] is the instance of joint action j; joint_actions[j][i] is agent i's text.
        """

    def history_rewards(self, problems: list[Problem], histories: list[list[list[Turn]]]) -> list[JointReward]:
        """Score the last joint action of each history (histories[j][i]: agent i's turns so far,
        the scored one last). Tasks whose state carries over between turns (StrBuild: blocks
        placed earlier stay) replay the whole history; by default only the last actions count."""
        return self.joint_rewards(problems, [[h[-1].action for h in hist] for hist in histories])

    def next_prompts(
        self, problem: Problem, histories: list[list[Turn]], reward: JointReward
    ) -> list[str]:
        """Every agent's next user message after a turn (multi-turn tasks override this).

        histories[i] holds agent i's turns so far (last one included); `reward` is the joint
        reward of the last joint action, whose `info` carries the environment's feedback.
        """
        raise UserError(f"task {self.name} is single-turn: set algo.num_turns=1")

    # -- the papers' baselines (marl_llm.algos.baselines) ------------------------------------
    def single_prompt(self, problem: Problem) -> str:
        """One agent's prompt for the whole job (algo=single)."""
        raise UserError(f"task {self.name} has no single-agent form (algo=single)")

    def split_single(self, text: str) -> list[str]:
        """The single agent's answer cut into the N agents' parts, scored by `joint_rewards`."""
        raise UserError(f"task {self.name} has no single-agent form (algo=single)")

    def single_next_prompt(self, problem: Problem, history: list[Turn], reward: JointReward) -> str:
        raise UserError(f"algo=single runs one turn on task {self.name}: set algo.num_turns=1")

    def sequential_prompt(self, problem: Problem, agent: int, prompt: str, previous: list[tuple[str, str]]) -> str:
        """Agent `agent`'s prompt when it acts after the agents in `previous` ((name, text) pairs)."""
        shown = "\n\n".join(f"The {name} agent has already written:\n<<<\n{text.strip()}\n>>>" for name, text in previous)
        return f"{prompt}\n\n{shown}\n\nWrite your own part so that it fits with theirs. Output only your part."

    def discussion_prompt(self, problem: Problem, agent: int, histories: list[list[Turn]]) -> str:
        """Agent `agent`'s revision prompt after every agent drafted once (one-round discussion)."""
        own = histories[agent][-1]
        others = "\n\n".join(f"The {self.agent_names[j]} agent's draft:\n<<<\n{h[-1].action.strip()}\n>>>"
                              for j, h in enumerate(histories) if j != agent)
        return (f"{histories[agent][0].prompt}\n\nYour draft:\n<<<\n{own.action.strip()}\n>>>\n\n{others}\n\n"
                "Revise your draft so that your part and theirs work together. Output only your revised part.")


def take_task_metrics(task: Any) -> dict[str, float]:
    """`task.take_metrics()`, and {} for a task written to the interface without subclassing Task
    (it has no such hook, and no metrics of its own)."""
    take = getattr(task, "take_metrics", None)
    return take() if take is not None else {}


def seed_problems(name: str, split: str, num_train: int, eval_seed: int, num_eval: int) -> list[Problem]:
    """The problems of a task whose instances are generated from seeds (the grid games, task=env):
    training seeds 0 .. num_train - 1, evaluation seeds eval_seed .. eval_seed + num_eval - 1."""
    if split == "train":
        seeds = range(num_train)
    elif split == "eval":
        seeds = range(eval_seed, eval_seed + num_eval)
    else:
        raise ValueError(f"unknown split {split!r}: expected train or eval")
    return [Problem(uid=f"{name}/{split}/{s}", data={"seed": s}) for s in seeds]


TASKS: dict[str, Callable[[Any], Task]] = {}


# Class decorator: `@register_task("name", schema=NameTaskConfig)` makes a Task available as
# `task=<name>`, its config keys typed and checked by its schema (a dataclass with `name`).
register_task = schema_registrar(TASKS, "task", "task")


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
