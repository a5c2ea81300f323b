"""Sokoban and Plan-Path with two roles (PettingLLMs / AT-GRPO, arXiv 2510.11062).

Turn order [tool, plan], up to `task.max_turns` turns:
- `tool` writes a Python program that prints a move list; the program runs in the sandbox (never
  in the trainer) and its moves are tried on a copy of the state: its local reward is what those
  moves would earn, its team reward whether they would solve the level.
- `plan` sees the tool's program, output and the result of its moves, reasons, and ends with a
  line `#### ["U", "R", ...]`; its moves are played on the real state (its local reward is the
  per-move reward they earn, its team reward whether the level is solved after them).

Per-move rewards are the environments' (marl_llm.envs): Sokoban −0.01 per move, −0.05 invalid,
+1 box onto / −0.5 box off a goal, potential shaping, +10 solved, −5 at the move cap; Plan-Path
−0.01 per move, −0.1 invalid, shaping, +1 at the goal, +0.5 for an optimal path. Success means
solved: a move cap is a failure.

A move list that cannot be used (`task.unparseable_plan_reward`, null: off): the plan's `####`
list missing, unparseable or empty, or the tool's program missing, failed without moves, or
printing no move list, plays no move and so earns 0, more than an invalid move. With the key set
(PettingLLMs: −2) its local reward is that value instead. A tool program that prints [] is a
valid plan of no moves (0), as in PettingLLMs.

Levels: training seeds 0, 1, 2, ... (new levels every step); evaluation on `num_eval_levels`
fixed levels with seeds eval_seed + i (100 levels from 100000 by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from marl_llm.envs.actions import parse_action_list, parse_final_actions
from marl_llm.envs.base import GridEnv
from marl_llm.envs.plan_path import PlanPathEnv
from marl_llm.envs.sokoban import SokobanEnv
from marl_llm.config import SandboxConfig, UserError
from marl_llm.sandbox import limits_from_config, require_isolation, run_programs
from marl_llm.tasks.base import Problem, register_task, seed_problems
from marl_llm.tasks.code_reward import extract_code
from marl_llm.tasks.turn_based import Episode, Outcome, TurnTask

ROLES = ("tool", "plan")
_MAX_SHOWN = 600  # characters of program output shown to the plan agent


def _cap(text: str, n: int = _MAX_SHOWN) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + " ...[truncated]"


@dataclass
class GridGameTaskConfig:
    """Sokoban / Plan-Path with a tool agent and a planning agent (marl_llm.tasks.grid_games)."""

    name: str = MISSING
    # Agents in turn order: [tool, plan] (the paper's two roles) or [plan] (one agent: the
    # single-agent baseline) or [tool].
    roles: List[str] = field(default_factory=lambda: ["tool", "plan"])
    # Map side (Sokoban: including the outer wall) and, for Sokoban, the number of boxes.
    size: int = 5
    num_boxes: int = 1
    # Plan-Path: probability that a cell is a wall.
    wall_prob: float = 0.22
    # Moves before the episode ends as a failure, and turns per episode.
    max_moves: int = 200
    max_turns: int = 4
    # Training levels: seeds 0 .. num_train_levels-1 (new levels every step); evaluation: the
    # fixed levels eval_seed .. eval_seed + num_eval_levels - 1.
    num_train_levels: int = 100000
    eval_seed: int = 100000
    num_eval_levels: int = 100
    reward_shift: float = 0.0
    # Role (local) reward of a candidate whose move list cannot be used: the plan's `####` list
    # missing, unparseable or empty; the tool's program missing, failed without moves, or printing
    # no move list (a printed [] is a plan of no moves). Null: the moves' own reward (0 for none),
    # which ranks it above an invalid move. PettingLLMs: -2.
    unparseable_plan_reward: Optional[float] = None
    # The tool agent's programs run here (timeout per program).
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


class GridEpisode(Episode):
    def __init__(self, task: "GridGameTask", problem: Problem, env: GridEnv):
        self.task = task
        self.uid = problem.uid
        self.env = env
        self.turn = 0
        self.tool: dict[str, Any] | None = None  # what the tool committed this turn
        self.history: list[str] = []  # one line per finished turn
        self.moves_reward = 0.0  # per-move rewards of the real (plan) moves so far

    @property
    def done(self) -> bool:
        return self.env.done or self.turn >= self.task.num_turns

    @property
    def success(self) -> bool:
        return self.env.success

    # -- prompts -----------------------------------------------------------------------------
    def _state_block(self) -> str:
        past = "\n".join(self.history) if self.history else "(none yet)"
        return (f"Current state (turn {self.turn + 1} of {self.task.num_turns}):\n{self.env.render()}\n\n"
                f"Moves played in earlier turns:\n{past}")

    def observation(self, agent: int) -> str:
        t = self.task
        if t.agent_names[agent] == "tool":
            return (f"You are the tool agent in a team of two playing {t.game}. {t.rules}\n\n{self._state_block()}\n\n"
                    "Write a Python program (standard library only, no input) that computes the moves from this "
                    'state and prints them as one JSON list, e.g. ["U", "R", "R"]. It is stopped after '
                    f"{t.limits.timeout_s:g} seconds. Output only the program in a ```python block.")
        team = "in a team of two " if len(t.agent_names) > 1 else ""
        tool_block = ""
        if self.tool is not None:
            tool = self.tool
            tool_block = (f"The tool agent's program:\n```python\n{_cap(tool.get('code', ''), 1500)}\n```\n"
                          f"Its output: {_cap(tool.get('output', '')) or '(nothing)'}\n"
                          f"Its moves, tried on a copy of the state: {tool.get('summary', 'none')}\n\n")
        return (f"You are the planning agent {team}playing {t.game}. {t.rules}\n\n{self._state_block()}\n\n"
                f"{tool_block}Think step by step, then end your answer with one line: #### followed by the JSON list "
                'of moves to play now, e.g. #### ["U", "L"]')

    # -- scoring on copies -------------------------------------------------------------------
    def _try(self, actions: list[str]) -> tuple[GridEnv, Any]:
        copy = self.env.copy()
        return copy, copy.step(actions)

    @staticmethod
    def _summary(actions: list[str], env: GridEnv, result: Any, error: str | None) -> str:
        if error:
            return f"no moves ({error})"
        status = "solved" if env.success else ("failed (move cap)" if env.done else "not solved")
        return (f"{actions} -> {result.valid} valid, {result.invalid} invalid moves, reward {result.reward:+.2f}, "
                f"{status}")

    def evaluate(self, agent: int, texts: list[str]) -> list[Outcome]:
        if self.task.agent_names[agent] == "tool":
            codes = [extract_code(t) for t in texts]
            return self.tool_outcomes(codes, run_programs(codes, self.task.limits, self.task.workers))
        outcomes = []
        for text in texts:
            actions, error = parse_final_actions(text)
            env, result = self._try(actions)
            local = self.task.unusable_reward(result.reward, unusable=not actions)
            outcomes.append(Outcome(float(env.success), local, env, {
                "actions": actions, "error": error, "reward": result.reward,
                "summary": self._summary(actions, env, result, error)}))
        return outcomes

    def tool_outcomes(self, codes: list[str], runs: list[Any]) -> list[Outcome]:
        """Outcomes of the tool's programs from their sandbox runs: the printed moves tried on copies."""
        outcomes = []
        for code, run in zip(codes, runs):
            actions, error = parse_action_list(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "")
            if not code.strip():
                error = "no program"
            elif run.status.value != "passed" and not actions:
                error = f"the program did not finish cleanly ({run.status.value})"
            env, result = self._try(actions)
            local = self.task.unusable_reward(result.reward, unusable=error is not None)
            outcomes.append(Outcome(float(env.success), local, None, {
                "code": code, "output": run.stdout, "actions": actions, "error": error,
                "summary": self._summary(actions, env, result, error)}))
        return outcomes

    def commit(self, agent: int, outcome: Outcome) -> None:
        if self.task.agent_names[agent] == "tool":
            self.tool = outcome.info
            return
        # The state the plan's moves were scored on becomes the real state (no re-stepping).
        self.env = outcome.state
        self.moves_reward += outcome.info["reward"]
        self.history.append(f"turn {self.turn + 1}: {outcome.info['summary']}")

    def end_turn(self) -> None:
        self.turn += 1
        self.tool = None

    def levels(self) -> dict[str, float]:
        return {"solved": float(self.env.success), "moves_reward": self.moves_reward}


class GridGameTask(TurnTask):
    agent_names = ROLES
    game = ""
    rules = ""

    @classmethod
    def agents_for(cls, cfg: Any) -> tuple[str, ...]:
        return tuple(cfg.roles)  # the roles in turn order

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        roles = tuple(cfg.get("roles", ROLES) if hasattr(cfg, "get") else ROLES)
        if not roles or len(set(roles)) != len(roles) or any(r not in ROLES for r in roles):
            raise UserError(f"task.roles={list(roles)}: use [tool, plan], [plan] or [tool] (turn order)")
        self.agent_names = roles
        sb = cfg.sandbox
        self.limits = limits_from_config(sb)
        require_isolation(self.limits)  # before any model loads
        self.workers = int(sb.workers)
        penalty = cfg.get("unparseable_plan_reward") if hasattr(cfg, "get") else None
        self.unparseable_plan_reward = None if penalty is None else float(penalty)

    def unusable_reward(self, moves_reward: float, unusable: bool) -> float:
        """A candidate's local reward: `task.unparseable_plan_reward` for an unusable move list
        (when set), else what its moves earned."""
        return self.unparseable_plan_reward if unusable and self.unparseable_plan_reward is not None else moves_reward

    def make_env(self) -> GridEnv:
        raise NotImplementedError

    def evaluate_many(self, agent: int, jobs: list[tuple[Episode, list[str]]]) -> list[list[Outcome]]:
        """The tool's programs of every episode run in one parallel sandbox batch."""
        if self.agent_names[agent] != "tool":
            return super().evaluate_many(agent, jobs)
        codes = [[extract_code(t) for t in texts] for _, texts in jobs]
        runs = iter(run_programs([c for cs in codes for c in cs], self.limits, self.workers))
        return [episode.tool_outcomes(cs, [next(runs) for _ in cs]) for (episode, _), cs in zip(jobs, codes)]

    def load_split(self, split: str) -> list[Problem]:
        c = self.cfg
        return seed_problems(self.name, split, int(c.num_train_levels), int(c.eval_seed), int(c.num_eval_levels))

    def new_episode(self, problem: Problem) -> GridEpisode:
        env = self.make_env()
        env.reset(int(problem.data["seed"]))
        return GridEpisode(self, problem, env)


@register_task("sokoban", schema=GridGameTaskConfig)
class SokobanTask(GridGameTask):
    game = "Sokoban"
    rules = ("Push every box ($) onto a goal (.); * is a box on a goal, @ the player (+ on a goal), # a wall. "
             "Moves: U (up), D (down), L (left), R (right); walking into a box pushes it if the cell behind "
             "it is free.")

    def make_env(self) -> GridEnv:
        c = self.cfg
        return SokobanEnv(size=int(c.size), num_boxes=int(c.num_boxes), max_moves=int(c.max_moves))


@register_task("plan_path", schema=GridGameTaskConfig)
class PlanPathTask(GridGameTask):
    game = "Plan-Path"
    rules = ("Move the agent (@) to the goal (G) on the grid; # is a wall, . free ground. Moves: U (up, row - 1), "
             "D (down, row + 1), L (left, column - 1), R (right, column + 1). A shortest path earns a bonus.")

    def make_env(self) -> GridEnv:
        c = self.cfg
        return PlanPathEnv(size=int(c.size), wall_prob=float(c.wall_prob), max_moves=int(c.max_moves))
