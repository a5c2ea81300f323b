"""task=team: your own cooperative task from two Python functions, no module of its own needed.

    prompts(row) -> one user message per agent: a list in `task.agents` order, or a dict by agent
    reward(row, completions) -> the team reward of one joint action (completions in agent order):
        a float, or a dict of reward levels whose sum is the total (logged as rewards/<level>/...)

Both are named in the config as `module:function` (importable: installed or on PYTHONPATH), so a
run's config.yaml rebuilds them on a resume or in marl-llm-eval:

    marl-llm task=team task.agents=[writer,editor] task.prompts=my_team:prompts \\
        task.reward=my_team:reward task.data.files.train=rows.jsonl

`marl_llm.train_team(...)` fills these from the functions it is given (a lambda or a closure is
kept in the process under `@<name>`: such a run resumes only from Python, with the same functions).
Single-turn: there is no feedback between turns (algo.num_turns=1).
"""

from __future__ import annotations

import importlib
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List

from omegaconf import OmegaConf

from marl_llm.config import DataConfig, UserError, check_value
from marl_llm.tasks.base import JointReward, Problem, Task, register_task

# Functions handed to marl_llm.train_team that no import path reaches (lambdas, closures), by key.
IN_PROCESS: dict[str, Callable[..., Any]] = {}


@dataclass
class TeamTaskConfig:
    name: str = "team"
    # The agents, in the order `prompts` and `reward` use.
    agents: List[str] = field(default_factory=lambda: ["agent1", "agent2"])
    # module:function of the prompt formatter and of the joint reward (or @<key>: marl_llm.train_team's).
    prompts: str = "???"
    reward: str = "???"
    # Rows from your files (task.data.files.train=..., .test=...) or a hub dataset (task.data.hub_id).
    data: DataConfig = field(default_factory=lambda: DataConfig(source="auto", train_split="train",
                                                                eval_split="test"))
    # Training reward = reward + shift.
    reward_shift: float = 0.0

    @staticmethod
    def check(cfg: Any) -> None:
        for key in ("prompts", "reward"):
            check_value(not OmegaConf.is_missing(cfg.task, key), f"task.{key}",
                        f"name your function: task.{key}=<module>:<function> (docs/extending.md)")
        agents = list(cfg.task.agents)
        check_value(len(agents) >= 1 and len(set(agents)) == len(agents), "task.agents",
                    f"{agents} must name at least one agent, each once")


def resolve_function(spec: str, key: str, kind: str = "function") -> Callable[..., Any]:
    """The function (or class: `kind`) a `module:function` (or `@<key>`) setting names; UserError
    naming the fix."""
    spec = str(spec)
    if spec.startswith("@"):
        if spec[1:] not in IN_PROCESS:
            raise UserError(f"{key}={spec} is a {kind} marl_llm.train_team was given in another process: resume or "
                            f"evaluate this run from Python with the same {kind}, or name an importable one "
                            f"({key}=module:{kind})")
        return IN_PROCESS[spec[1:]]
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise UserError(f"{key}={spec!r}: name a {kind} as module:{kind} (e.g. {key}=my_team:"
                        f"{'reward' if kind == 'function' else 'Game'})")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"{key}={spec}: cannot import {module_name!r} ({err}): install it or put its directory "
                        "on PYTHONPATH") from None
    except (Exception, SystemExit) as err:  # the module's own code (an exit() in it would end the run silently)
        frames = traceback.extract_tb(err.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise UserError(f"{key}={spec}: importing {module_name!r} raised {type(err).__name__}: {err}{where}: fix "
                        "the module") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{key}={spec}: {module_name} has no {qualname!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{key}={spec}: {qualname} is not a {kind}")
    return obj


@register_task("team", schema=TeamTaskConfig)
class TeamTask(Task):
    success_metric = "success_rate"
    max_turns = 1  # no feedback between turns

    @classmethod
    def agents_for(cls, cfg: Any) -> tuple[str, ...]:
        return tuple(str(a) for a in cfg.agents)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.agent_names = self.agents_for(cfg)
        self.prompt_fn = resolve_function(cfg.prompts, "task.prompts")
        self.reward_fn = resolve_function(cfg.reward, "task.reward")

    def packaged_rows(self, split_name: str) -> list[dict[str, Any]]:
        raise UserError("task=team has no packaged sample: give your rows with task.data.files.train=<file> (and "
                        ".test=<file> for evaluation) or task.data.hub_id=<dataset id>")

    def initial_prompts(self, problem: Problem) -> list[str]:
        out = _call(self.prompt_fn, f"task.prompts={self.cfg.prompts}", problem, problem.data)
        if isinstance(out, dict):
            missing = [a for a in self.agent_names if a not in out]
            if missing:
                raise UserError(f"task.prompts={self.cfg.prompts} returned no prompt for {missing} (agents: "
                                f"{list(self.agent_names)})")
            out = [out[a] for a in self.agent_names]
        if not isinstance(out, (list, tuple)) or len(out) != self.num_agents or not all(isinstance(p, str) for p in out):
            raise UserError(f"task.prompts={self.cfg.prompts} must return {self.num_agents} strings (one per agent: "
                            f"{list(self.agent_names)}) or a dict by agent, not {type(out).__name__}")
        empty = [a for a, p in zip(self.agent_names, out) if not p.strip()]
        if empty:
            raise UserError(f"task.prompts={self.cfg.prompts} returned an empty prompt for {empty} on {problem.uid}: "
                            "every agent needs a prompt (an empty one teaches nothing)")
        return list(out)

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        return [self._reward(p, actions) for p, actions in zip(problems, joint_actions, strict=True)]

    def _reward(self, problem: Problem, actions: list[str]) -> JointReward:
        out = _call(self.reward_fn, f"task.reward={self.cfg.reward}", problem, problem.data, list(actions))
        if isinstance(out, JointReward):
            return out
        if isinstance(out, dict):
            levels = {str(k): float(v) for k, v in out.items()}
            total = sum(levels.values())
        elif isinstance(out, (int, float)) and not isinstance(out, bool):
            levels, total = {}, float(out)
        else:
            raise UserError(f"task.reward={self.cfg.reward} must return a float or a dict of reward levels, "
                            f"not {type(out).__name__}")
        if not math.isfinite(total):
            raise UserError(f"task.reward={self.cfg.reward} returned {total} for {problem.uid}: return a finite number")
        return JointReward(total=total, levels=levels)


def _call(fn: Callable[..., Any], key: str, problem: Problem, *args: Any) -> Any:
    """The user's function, whose exception becomes one line: what it raised, on which row, and
    where in the user's code (the innermost frame), not a traceback through the trainer."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as err:  # any error of the user's code; an exit() would end the run silently
        frames = traceback.extract_tb(err.__traceback__)
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        message = " ".join(str(err).split())[:200]
        raise UserError(f"{key} raised {type(err).__name__}{': ' + message if message else ''} on {problem.uid}"
                        f"{where}: fix the function (what it gets and returns: docs/configuration.md#taskteam)") from None
