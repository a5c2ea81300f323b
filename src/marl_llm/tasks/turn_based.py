"""Turn-based environment tasks: agents act in turn order on a shared, changing state.

Unlike the joint-reward tasks (every agent acts on its own prompt, one team reward for the joint
action), an episode here has a state that each agent's action may change, and each action gets
its own score, mixed from the team's outcome and the agent's role reward:

    r = alpha * team + local        (AT-GRPO, arXiv 2510.11062; alpha = algo.alpha)

An `Episode` is one environment instance. Per turn, for each agent in turn order:

    prompt = episode.observation(i)
    outcomes = episode.evaluate(i, candidate_texts)   # each scored on its own copy of the state
    episode.commit(i, outcomes[best])                 # the scored copy BECOMES the state
    ...
    episode.end_turn()

Scoring on copies lets K candidates start from the same state; committing the very object that
was scored (not re-applying the action to another object) keeps stepping, scoring and prompting
on one state (the public AT-GRPO code steps the originals but scores deep copies, so rewards go
stale from turn 2 and `done` never fires).

`run_episodes` plays episodes with K candidates per agent and turn (K = 1 with greedy sampling is
plain evaluation) and returns the committed path as a JointTree (one node per env and turn) plus
every candidate's group, keyed by (environment uid, agent, turn).
"""

from __future__ import annotations

import copy
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from marl_llm.training.episodes import JointNode, JointTree, Terminate
from marl_llm.rollout.base import Completion, GenRequest, sample_key
from marl_llm.tasks.base import JointReward, Problem, Task, Turn

if TYPE_CHECKING:  # annotations only: a task module stays light (no torch)
    from marl_llm.rollout.sampling import SamplingParams


@dataclass
class Outcome:
    """One candidate action scored on its own copy of the state.

    team: the team's outcome after the action (e.g. 1.0 if the level is solved); local: the
    acting agent's role reward (e.g. the summed per-move reward); state: the episode state the
    action led to (committing adopts it); info: what the next agents and the logs are shown.
    """

    team: float
    local: float
    state: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def score(self, alpha: float) -> float:
        return alpha * self.team + self.local


class Episode(ABC):
    """One environment instance being played (see the module docstring)."""

    uid: str  # unique per environment instance: the group key's first part

    @property
    @abstractmethod
    def done(self) -> bool: ...

    @property
    @abstractmethod
    def success(self) -> bool: ...

    @abstractmethod
    def observation(self, agent: int) -> str:
        """Agent `agent`'s prompt now (it sees what earlier agents committed this turn)."""

    @abstractmethod
    def evaluate(self, agent: int, texts: list[str]) -> list[Outcome]:
        """Score each candidate text of `agent` on its own copy of the current state."""

    @abstractmethod
    def commit(self, agent: int, outcome: Outcome) -> None:
        """Make `outcome` (one of evaluate's) the agent's action: its state becomes the state."""

    @abstractmethod
    def end_turn(self) -> None: ...

    def levels(self) -> dict[str, float]:
        """Reward components to log for the episode so far."""
        return {}

    def fork(self) -> "Episode":
        """An independent copy of the episode (its task is shared, not copied)."""
        memo = {id(v): v for v in vars(self).values() if isinstance(v, Task)}
        return copy.deepcopy(self, memo)


class TurnTask(Task):
    """A task whose problems are played as Episodes (turn order = `agent_names`)."""

    # evaluation reports the fraction of solved episodes under this name
    success_metric = "success_rate"

    @abstractmethod
    def new_episode(self, problem: Problem) -> Episode: ...

    @property
    def num_turns(self) -> int:
        return int(self.cfg.max_turns)

    def evaluate_many(self, agent: int, jobs: list[tuple[Episode, list[str]]]) -> list[list[Outcome]]:
        """Score the candidate texts of several episodes (each on its own copies); tasks whose
        scoring runs programs override this to run all of them in one parallel batch."""
        return [episode.evaluate(agent, texts) for episode, texts in jobs]

    # The joint-reward interface does not apply: agents act on a shared state in turn order.
    def initial_prompts(self, problem: Problem) -> list[str]:
        return [self.new_episode(problem).observation(i) for i in range(self.num_agents)]

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        raise TypeError(f"task {self.name} is turn-based: play it with marl_llm.tasks.turn_based.run_episodes")


def collect_episode_tree(task: TurnTask, generate: Callable[[list[GenRequest]], list[Completion]],
                         problems: list[Problem], widths: list[int], sampling: list[SamplingParams],
                         terminate: Terminate | None = None) -> JointTree:
    """A MAGRPO rollout tree on a turn-based task: at turn t every unfinished node is forked
    `widths[t]` times; in each fork the agents act once in turn order (agent i sees what agents
    < i did in that fork). A node's reward is the sum of its agents' scores (team + local); its
    children continue from its own state. Widths of 1 with greedy sampling: plain evaluation."""
    turns: list[list[JointNode]] = []
    # (problem index, parent node index, episode, sampling key of the path to it)
    frontier = [(b, b, task.new_episode(p), p.sample_key) for b, p in enumerate(problems)]
    for t, width in enumerate(widths):
        if not frontier:
            break
        forks = [(b, parent, ep.fork() if width > 1 else ep) for b, parent, ep, _ in frontier for _ in range(width)]
        fork_keys = [sample_key(key, t, g) for _, _, _, key in frontier for g in range(width)]
        prompts: list[list[str]] = [[] for _ in forks]
        chosen: list[list[Completion]] = [[] for _ in forks]
        scores = [0.0] * len(forks)
        for i in range(task.num_agents):
            requests = [GenRequest(i, ep.observation(i), sampling[i], sample_key(key, i))
                        for (_, _, ep), key in zip(forks, fork_keys)]
            completions = generate(requests)
            outcomes = task.evaluate_many(i, [(ep, [c.text]) for (_, _, ep), c in zip(forks, completions)])
            for j, ((_, _, ep), req, comp, [outcome]) in enumerate(zip(forks, requests, completions, outcomes)):
                ep.commit(i, outcome)
                prompts[j].append(req.message)
                chosen[j].append(comp)
                scores[j] += outcome.score(1.0)
        nodes = []
        for j, (b, parent, ep) in enumerate(forks):
            ep.end_turn()
            nodes.append(_turn_node(b, t, parent, prompts[j], chosen[j], j % width, scores[j], ep, t == len(widths) - 1))
        if terminate is not None:  # the forks of one parent are a sibling group
            for start in range(0, len(nodes), width):
                group = nodes[start:start + width]
                for node, (_, _, ep), stop in zip(group, forks[start:start + width], terminate(group)):
                    if stop and not node.terminated:
                        node.terminated, node.reward.passed = True, ep.success
        turns.append(nodes)
        frontier = [(n.problem, j, forks[j][2], fork_keys[j]) for j, n in enumerate(nodes) if not n.terminated]
    return JointTree(problems, turns)


def _turn_node(problem: int, turn: int, parent: int, prompts: list[str], completions: list[Completion],
               choice: int, score: float, episode: Episode, last_turn: bool) -> JointNode:
    """The joint action an episode committed in one turn, as a node of the rollout tree."""
    terminated = episode.done or last_turn
    reward = JointReward(score, episode.levels(), passed=episode.success if terminated else None)
    history = [[Turn(p, c.text)] for p, c in zip(prompts, completions)]
    return JointNode(problem, turn, parent, prompts, completions, (choice,) * len(prompts), reward, history,
                     terminated=terminated)


def env_key(index: int, uid: str) -> str:
    """A group key's environment part: unique per environment *instance* of a step, even when one
    level is drawn twice (the uid alone would merge the two episodes' groups)."""
    return f"{index}/{uid}"


@dataclass
class CandidateGroup:
    """The K candidates of one agent at one turn of one environment: an AT-GRPO group."""

    key: tuple[str, int, int]  # (environment instance, agent, turn)
    completions: list[Completion]
    scores: list[float]
    chosen: int
    # Each candidate's score as the components that add up to it, e.g. {"team": alpha * team,
    # "local": local} (algo.reward_levels=normalize_then_sum normalizes each on its own).
    levels: list[dict[str, float]] = field(default_factory=list)


def run_episodes(task: TurnTask, generate: Callable[[list[GenRequest]], list[Completion]], problems: list[Problem],
                 sampling: list[SamplingParams], num_turns: int, k: int = 1, alpha: float = 1.0,
                 select: str = "best", rng: random.Random | None = None) -> tuple[JointTree, list[CandidateGroup]]:
    """Play every problem for up to `num_turns` turns; K candidates per agent and turn.

    select: "best" (greedy continuation from the highest-scoring candidate, ties to the first)
    or "random". Returns the committed path as a JointTree (node = one env's turn; reward.total =
    the joint action's reward as collect_episode_tree and the evaluation score it, the agents'
    summed team + own rewards whatever alpha; reward.passed = solved when the episode ended) and
    the groups (the candidates' scores, alpha * team + own).
    """
    if select not in ("best", "random"):
        raise ValueError(f"select={select!r}: expected best or random")
    rng = rng or random.Random(0)
    episodes = [task.new_episode(p) for p in problems]
    groups: list[CandidateGroup] = []
    turns: list[list[JointNode]] = []
    parents = list(range(len(problems)))  # node index of each env's previous turn
    for t in range(num_turns):
        active = [b for b, e in enumerate(episodes) if not e.done]
        if not active:
            break
        prompts: dict[int, list[str]] = {b: [] for b in active}
        chosen: dict[int, list[Completion]] = {b: [] for b in active}
        scores: dict[int, float] = {b: 0.0 for b in active}
        for i in range(task.num_agents):
            requests = []
            for b in active:
                prompts[b].append(episodes[b].observation(i))
                requests += [GenRequest(i, prompts[b][-1], sampling[i], sample_key(problems[b].sample_key, t, i, c))
                             for c in range(k)]
            completions = generate(requests)
            candidates = [completions[j * k:(j + 1) * k] for j in range(len(active))]
            scored = task.evaluate_many(i, [(episodes[b], [c.text for c in comps])
                                            for b, comps in zip(active, candidates)])
            for b, comps, outcomes in zip(active, candidates, scored):
                values = [o.score(alpha) for o in outcomes]
                c = values.index(max(values)) if select == "best" else rng.randrange(k)
                groups.append(CandidateGroup((env_key(b, episodes[b].uid), i, t), comps, values, c,
                                             [{"team": alpha * o.team, "local": o.local} for o in outcomes]))
                episodes[b].commit(i, outcomes[c])
                chosen[b].append(comps[c])
                scores[b] += outcomes[c].score(1.0)
        nodes = []
        for b in active:
            episodes[b].end_turn()
            nodes.append(_turn_node(b, t, parents[b], prompts[b], chosen[b], 0, scores[b], episodes[b],
                                    t == num_turns - 1))
        for j, n in enumerate(nodes):
            parents[n.problem] = j
        turns.append(nodes)
    return JointTree(problems, turns), groups
