"""Joint multi-turn rollouts as trees of joint actions (shared by training and evaluation).

Turn 0 expands every problem into `widths[0]` joint actions; at turn t > 0 every joint action of
turn t-1 that is not terminated is expanded into `widths[t]` children, each agent prompted with
its own history plus the environment's feedback on its parent. Every joint action is scored once
by the task's joint reward, all of a turn in one batch (sandboxed tests run in parallel).

    MAGRPO training (align):  widths = [G, G, ...]  → G^T leaves per problem
    MAGRPO training (cross):  widths = [G], every agent's G samples combined → G^N joint actions
    greedy evaluation:        widths = [1, 1, ...] at temperature 0
    sampled pass@k:           widths = [n, 1, ...]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from marl_llm.rollout import Completion, GenRequest, SamplingParams
from marl_llm.tasks.base import JointReward, Problem, Task, Turn


@dataclass
class JointNode:
    """One joint action: what every agent saw and wrote at one turn, and its team reward."""

    problem: int  # index into the step's problem list
    turn: int
    parent: int  # index of the parent node in the previous turn (turn 0: the problem index)
    messages: list[str]  # agent i's user message
    completions: list[Completion]  # agent i's completion
    choice: tuple[int, ...]  # agent i's sample index within its sibling group (cross mode)
    reward: JointReward = field(default_factory=lambda: JointReward(0.0))
    histories: list[list[Turn]] = field(default_factory=list)  # per agent, this turn included
    terminated: bool = False  # not expanded in later turns

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]


@dataclass
class JointTree:
    problems: list[Problem]
    turns: list[list[JointNode]]

    def nodes(self):
        return (n for turn in self.turns for n in turn)


def collect_tree(
    task: Task,
    generate: Callable[[list[GenRequest]], list[Completion]],
    problems: list[Problem],
    widths: list[int],
    sampling: list[SamplingParams],
    joint_mode: str = "align",
    terminate: Callable[[JointNode], bool] | None = None,
) -> JointTree:
    """Roll out `len(widths)` turns for every problem; see the module docstring."""
    n_agents = task.num_agents
    turns: list[list[JointNode]] = []
    # Parents of the next turn: (problem index, parent index, per-agent messages, histories).
    frontier = [(b, b, task.initial_prompts(p), [[] for _ in range(n_agents)]) for b, p in enumerate(problems)]
    for t, width in enumerate(widths):
        if not frontier:
            break
        requests = [GenRequest(i, msgs[i], sampling[i]) for (_, _, msgs, _) in frontier
                    for i in range(n_agents) for _ in range(width)]
        completions = generate(requests)
        nodes: list[JointNode] = []
        for f, (b, parent, msgs, hist) in enumerate(frontier):
            base = f * n_agents * width
            # samples[i][g]: agent i's g-th completion for this parent
            samples = [completions[base + i * width: base + (i + 1) * width] for i in range(n_agents)]
            choices = (itertools.product(range(width), repeat=n_agents) if joint_mode == "cross"
                       else ((g,) * n_agents for g in range(width)))
            for choice in choices:
                comps = [samples[i][g] for i, g in enumerate(choice)]
                histories = [hist[i] + [Turn(msgs[i], comps[i].text)] for i in range(n_agents)]
                nodes.append(JointNode(b, t, parent, list(msgs), comps, tuple(choice), histories=histories))
        rewards = task.joint_rewards([problems[n.problem] for n in nodes], [n.texts for n in nodes])
        for n, r in zip(nodes, rewards):
            n.reward = r
            n.terminated = t == len(widths) - 1 or (terminate is not None and terminate(n))
        turns.append(nodes)
        frontier = [(n.problem, j, task.next_prompts(problems[n.problem], n.histories, n.reward), n.histories)
                    for j, n in enumerate(nodes) if not n.terminated]
    return JointTree(problems, turns)
