"""Joint multi-turn rollouts as trees of joint actions (shared by training and evaluation).

Turn 0 expands every problem into `widths[0]` joint actions; at turn t > 0 every joint action of
turn t-1 that is not terminated is expanded into `widths[t]` children, each agent prompted with
its own history plus the environment's feedback on its parent. Every joint action is scored once
by the task's joint reward, all of a turn in one batch (sandboxed tests run in parallel).

    MAGRPO training (align):  widths = [G, G, ...]  → G^T leaves per problem
    MAGRPO training (cross):  widths = [G], every agent's G samples combined → G^N joint actions
    greedy evaluation:        widths = [1, 1, ...] at temperature 0
    sampled pass@k:           widths = [n, 1, ...]
    prompt-only baselines:    order="sequential" (agent i sees agents < i), or a second turn whose
                              prompts show the other agents' drafts (one-round discussion)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from marl_llm.rollout.base import Completion, GenRequest, sample_key

from marl_llm.rollout.sampling import SamplingParams
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


def trajectories(tree: JointTree) -> list[list[JointNode]]:
    """The tree's chains of joint actions, root to end (a width-1 tree: one per environment)."""
    chains = []
    for t, turn in enumerate(tree.turns):
        for node in turn:
            if node.terminated:
                chain, parent = [node], node.parent
                for earlier in range(t - 1, -1, -1):
                    chain.append(tree.turns[earlier][parent])
                    parent = chain[-1].parent
                chains.append(chain[::-1])
    return chains


NextPrompts = Callable[[Problem, list[list[Turn]], JointReward], list[str]]
# Early termination: given a sibling group (the joint actions sampled under one parent), which of
# them are not expanded in later turns.
Terminate = Callable[[list[JointNode]], list[bool]]


def collect_tree(
    task: Task,
    generate: Callable[[list[GenRequest]], list[Completion]],
    problems: list[Problem],
    widths: list[int],
    sampling: list[SamplingParams],
    joint_mode: str = "align",
    terminate: Terminate | None = None,
    order: str = "parallel",
    next_prompts: NextPrompts | None = None,
    expand: Callable[[list[JointNode]], list[JointNode]] | None = None,
) -> JointTree:
    """Roll out `len(widths)` turns for every problem; see the module docstring.

    order: "parallel" (every agent acts on its own prompt at once, the MAGRPO setting) or
        "sequential" (agent i's g-th prompt also shows agents 0..i-1's g-th outputs, via
        `task.sequential_prompt`; one generate call per agent).
    next_prompts: how a turn's prompts follow from the previous one (default: the task's
        environment feedback, `task.next_prompts`).
    expand: which of a parent's non-terminated children are expanded in the next turn (default:
        all; AT-GRPO's greedy continuation keeps the best one).
    """
    if order not in ("parallel", "sequential"):
        raise ValueError(f"order={order!r}: expected parallel or sequential")
    if order == "sequential" and joint_mode != "align":
        raise ValueError("sequential rollouts pair the g-th outputs: joint_mode must be align")
    next_prompts = next_prompts or task.next_prompts
    n_agents = task.num_agents
    turns: list[list[JointNode]] = []
    # Parents of the next turn: (problem index, parent index, per-agent messages, histories,
    # sampling key of the path to it).
    frontier = [(b, b, task.initial_prompts(p), [[] for _ in range(n_agents)], p.sample_key)
                for b, p in enumerate(problems)]
    for t, width in enumerate(widths):
        if not frontier:
            break
        # messages[f][i][g] / samples[f][i][g]: agent i's g-th prompt and completion under parent f.
        messages = [[[msgs[i]] * width for i in range(n_agents)] for (_, _, msgs, _, _) in frontier]
        samples: list[list[list[Completion]]] = [[[] for _ in range(n_agents)] for _ in frontier]
        agent_groups = [list(range(n_agents))] if order == "parallel" else [[i] for i in range(n_agents)]
        for group in agent_groups:
            if order == "sequential" and group[0] > 0:
                i = group[0]
                for f, (b, _, _, _, _) in enumerate(frontier):
                    messages[f][i] = [task.sequential_prompt(problems[b], i, messages[f][i][g],
                                                             [(task.agent_names[j], samples[f][j][g].text) for j in range(i)])
                                      for g in range(width)]
            requests = [GenRequest(i, messages[f][i][g], sampling[i], sample_key(frontier[f][4], t, i, g))
                        for f in range(len(frontier)) for i in group for g in range(width)]
            completions = iter(generate(requests))
            for f in range(len(frontier)):
                for i in group:
                    samples[f][i] = [next(completions) for _ in range(width)]
        nodes: list[JointNode] = []
        groups: list[slice] = []  # each parent's children (a sibling group) in `nodes`
        node_keys: dict[int, int | None] = {}
        for f, (b, parent, _, hist, key) in enumerate(frontier):
            first = len(nodes)
            choices = (itertools.product(range(width), repeat=n_agents) if joint_mode == "cross"
                       else ((g,) * n_agents for g in range(width)))
            for choice in choices:
                comps = [samples[f][i][g] for i, g in enumerate(choice)]
                msgs = [messages[f][i][g] for i, g in enumerate(choice)]
                histories = [hist[i] + [Turn(msgs[i], comps[i].text)] for i in range(n_agents)]
                nodes.append(JointNode(b, t, parent, msgs, comps, tuple(choice), histories=histories))
                node_keys[id(nodes[-1])] = sample_key(key, t, *choice)
            groups.append(slice(first, len(nodes)))
        rewards = task.history_rewards([problems[n.problem] for n in nodes], [n.histories for n in nodes])
        for n, r in zip(nodes, rewards):
            n.reward = r
            n.terminated = t == len(widths) - 1 or r.done
        if terminate is not None:
            for group in groups:
                for n, stop in zip(nodes[group], terminate(nodes[group])):
                    n.terminated = n.terminated or stop
        turns.append(nodes)
        keep = [n for n in nodes if not n.terminated]
        if expand is not None:
            siblings: dict[tuple[int, int], list[JointNode]] = {}
            for n in keep:
                siblings.setdefault((n.problem, n.parent), []).append(n)
            keep_ids = {id(n) for group in siblings.values() for n in expand(group)}
            keep = [n for n in keep if id(n) in keep_ids]
        index = {id(n): j for j, n in enumerate(nodes)}
        frontier = [(n.problem, index[id(n)], next_prompts(problems[n.problem], n.histories, n.reward), n.histories,
                     node_keys[id(n)]) for n in keep]
    return JointTree(problems, turns)
