"""The papers' comparison rows: a single agent doing the whole job, and prompt-only teams.

- `single`: one agent writes every part in one answer (the task's `single_prompt`); the task
  cuts the answer into the parts (`split_single`) and scores them with the same joint reward.
  Trained with GRPO, i.e. MAGRPO with one agent (same advantages, loss, options and metrics).
- `parallel`: the agents act independently on their own prompts and the outputs are simply
  concatenated into the joint action (the untrained MAGRPO team). Evaluation only.
- `sequential`: agent i sees the outputs of agents 0..i-1 before writing. Evaluation only.
- `discussion`: every agent drafts, sees the others' drafts, and revises (one round); the
  revised joint action is scored. Evaluation only.

Evaluation-only algorithms have `trainable = False`: the trainer evaluates them (same metrics as
every algorithm) and runs no training step.
"""

from __future__ import annotations

from typing import Any

from marl_llm.algos.base import AgentBatch, Algorithm, register_algorithm
from marl_llm.algos.magrpo import MAGRPO
from marl_llm.algos.schemas import SINGLE_AGENT, PromptBaselineConfig, SingleConfig
from marl_llm.training.episodes import JointTree, Terminate, collect_tree
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.config import UserError
from marl_llm.tasks.base import JointReward, Problem, Task, Turn


class SingleAgentTask(Task):
    """`task` seen by one agent that writes every part: same data, same joint reward."""

    agent_names = SINGLE_AGENT

    def __init__(self, task: Task):
        from marl_llm.tasks.turn_based import TurnTask

        if isinstance(task, TurnTask):
            raise UserError(f"algo=single does not wrap turn-based tasks: for one agent on {task.name} set "
                            "'task.roles=[plan]' with algo=at_grpo or algo=magrpo")
        if type(task).single_prompt is Task.single_prompt:
            task.single_prompt(None)  # raises the task's UserError: no single-agent form
        super().__init__(task.cfg)
        self.inner = task
        self.max_turns = task.max_turns

    def load_split(self, split: str) -> list[Problem]:
        return self.inner.load_split(split)

    def initial_prompts(self, problem: Problem) -> list[str]:
        return [self.inner.single_prompt(problem)]

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        return self.inner.joint_rewards(problems, [self.inner.split_single(a[0]) for a in joint_actions])

    def next_prompts(self, problem: Problem, histories: list[list[Turn]], reward: JointReward) -> list[str]:
        return [self.inner.single_next_prompt(problem, histories[0], reward)]


@register_algorithm("single", schema=SingleConfig)
class SingleAgent(MAGRPO):
    @classmethod
    def task_view(cls, task: Task, cfg: Any) -> Task:
        return SingleAgentTask(task)


class PromptOnly(Algorithm):
    """An untrained team: only `rollout_tree` (and the number of turns it takes) differs."""

    trainable = False

    @property
    def eval_turns(self) -> int:
        return 1

    def collect(self, problems: list[Problem]) -> JointTree:
        raise RuntimeError(f"algo={self.cfg.name} is evaluation-only")

    def advantages(self, tree: JointTree) -> list[AgentBatch]:
        raise RuntimeError(f"algo={self.cfg.name} is evaluation-only")

    def update(self, batches: list[AgentBatch], end_of_epoch: bool = False) -> dict[str, float]:
        raise RuntimeError(f"algo={self.cfg.name} is evaluation-only")


@register_algorithm("parallel", schema=PromptBaselineConfig)
class Parallel(PromptOnly):
    def rollout_tree(self, problems: list[Problem], widths: list[int], sampling: list[SamplingParams],
                     terminate: Terminate | None = None, joint_mode: str = "align") -> JointTree:
        return collect_tree(self.task, self.rollout.generate, problems, widths[:1], sampling)


@register_algorithm("sequential", schema=PromptBaselineConfig)
class Sequential(PromptOnly):
    def rollout_tree(self, problems: list[Problem], widths: list[int], sampling: list[SamplingParams],
                     terminate: Terminate | None = None, joint_mode: str = "align") -> JointTree:
        return collect_tree(self.task, self.rollout.generate, problems, widths[:1], sampling, order="sequential")


@register_algorithm("discussion", schema=PromptBaselineConfig)
class Discussion(PromptOnly):
    @property
    def eval_turns(self) -> int:
        return 2  # draft, then revise after seeing the others' drafts

    def rollout_tree(self, problems: list[Problem], widths: list[int], sampling: list[SamplingParams],
                     terminate: Terminate | None = None, joint_mode: str = "align") -> JointTree:
        task = self.task

        def revise(problem: Problem, histories: list[list[Turn]], reward: JointReward) -> list[str]:
            return [task.discussion_prompt(problem, i, histories) for i in range(task.num_agents)]

        return collect_tree(task, self.rollout.generate, problems, [widths[0], 1], sampling, next_prompts=revise)
