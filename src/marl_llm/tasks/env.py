"""task=env: your own multi-turn environment, in the style of gymnasium / PettingZoo, no subclassing.

Any class with two methods, named as `module:Class` (task.env) or passed to marl_llm.train_team:

    class Guess:
        agents = ["guesser", "checker"]        # or task.agents=[...], or set in __init__ (possible_agents too)

        def reset(self, seed):                 # -> each agent's first observation (its first prompt):
            ...                                #    a list in agent order or a dict by agent (optionally
                                               #    (observations, info), as gymnasium returns)
        def step(self, actions):               # actions: {agent: its completion} for every agent
            ...                                # -> (observations, rewards, team_reward, done[, info])

observations: every agent's next prompt (str); rewards: each agent's own reward (a list or dict of
numbers, or None); team_reward: a number, or a dict of reward levels whose sum is the total (logged
as rewards/<level>/...); done: the episode is over; info (optional dict): {"success": bool} is
evaluation's success_rate.

Every agent acts once per turn on its own observation (PettingZoo's parallel API); the episode
runs for algo.num_turns turns or until `done`. How the algorithms read it:

    MAGRPO       team_reward is the joint reward of the turn; the rollout tree forks the environment
                 at every node (G children: G - 1 copies with copy.deepcopy, the last child steps the
                 parent's own object), returns r + discount * mean(children's returns)
    AT-GRPO      groups per (environment, agent, turn); candidate score alpha * team_reward + the
                 agent's own reward; the episode continues from the best joint action
    CoLLM-CC/DC  one trajectory per environment (no copies); team_reward is r_t of the TD targets

Problems are seeds: training draws seeds 0 .. num_train_seeds - 1, evaluation the fixed seeds
eval_seed .. eval_seed + num_eval_seeds - 1. The environment is user code and runs in the trainer's
process, like task=team's reward (generated text only ever reaches it as strings: code the agents
write runs only in the sandbox, if your environment sends it there). An environment that breaks
the contract (a wrong number of observations, a reward that is not a number, an exception) stops
the run with one line naming the method, the agent where there is one, and the fix.
"""

from __future__ import annotations

import copy
import math
import sysconfig
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from omegaconf import OmegaConf

from marl_llm.config import UserError, check_value
from marl_llm.tasks.base import JointReward, Problem, Task, Turn, register_task, seed_problems
from marl_llm.tasks.team import resolve_function


@dataclass
class EnvTaskConfig:
    name: str = "env"
    # module:Class of the environment (or @<key>: a class marl_llm.train_team was given).
    env: str = "???"
    # Keyword arguments of the class, e.g. {low: 1, high: 100}.
    env_kwargs: Dict[str, Any] = field(default_factory=dict)
    # The agents in the order of the observations (null: the class's `agents` or `possible_agents`).
    agents: Optional[List[str]] = None
    # Training seeds 0 .. num_train_seeds - 1 (a new episode every draw); evaluation: the fixed seeds
    # eval_seed .. eval_seed + num_eval_seeds - 1.
    num_train_seeds: int = 100000
    eval_seed: int = 100000
    num_eval_seeds: int = 32
    # Training reward = team reward + shift.
    reward_shift: float = 0.0
    # The longest observation (characters) reset() or step() may return: a longer one stops the run
    # with one line naming the environment, the method and this limit, instead of a prompt that
    # tokenizes and decodes for minutes. 1,000,000 characters are ~250,000 tokens, more than any
    # supported model reads.
    max_observation_chars: int = 1_000_000

    @staticmethod
    def check(cfg: Any) -> None:
        t = cfg.task
        check_value(not OmegaConf.is_missing(t, "env"), "task.env",
                    "name your environment class: task.env=<module>:<Class> (docs/extending.md)")
        if t.agents is not None:
            agents = list(t.agents)
            check_value(len(agents) >= 1 and len(set(agents)) == len(agents), "task.agents",
                        f"{agents} must name at least one agent, each once")
        check_value(t.num_train_seeds >= 1, "task.num_train_seeds", "must be >= 1")
        check_value(t.num_eval_seeds >= 1, "task.num_eval_seeds", "must be >= 1")
        check_value(t.get("max_observation_chars", 1) >= 1, "task.max_observation_chars",
                    "must be >= 1 (characters; default 1,000,000)")


def _where(err: BaseException) -> str:
    """`file:line` in the environment's code where `err` was raised: the innermost frame outside
    Python's own library and installed packages (exit() is site's, and under logger=wandb sys.exit
    is wandb's exit hook), else the first frame of the environment's method (an installed one)."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = next((i for i in range(len(frames) - 1, -1, -1) if frames[i].filename == __file__), -1)
    theirs = frames[ours + 1:] or frames
    library = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
    own = [f for f in theirs if not f.filename.startswith(("<", *library))]
    where = own[-1] if own else theirs[0] if theirs else None
    return f" at {where.filename}:{where.lineno}" if where else ""


# What user code raises to end the process (exit(), sys.exit(), SystemExit): in an environment's
# method it would end the run with exit code 0 and no line at all. Ctrl-C (KeyboardInterrupt) stays
# the run's own interruption.
ESCAPES = (Exception, SystemExit)


def _raised(err: BaseException) -> str:
    """What the user's code raised, for the one line: `ValueError: msg`, or the exit it called."""
    if isinstance(err, SystemExit):
        return (f"SystemExit({err.code!r}) (it called exit() or sys.exit(): an environment's methods must return; "
                "to end an episode return done=True, to stop the run raise an exception)")
    return f"{type(err).__name__}: {err}"


def _number(value: Any) -> float | None:
    """A finite real number as float, else None (bools are not rewards)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


@register_task("env", schema=EnvTaskConfig)
class EnvTask(Task):
    """The joint-reward task interface over a user's environment (see the module docstring).

    Between the turns of a rollout, each joint action's environment is kept in `_live` under the
    Turn objects its children's histories extend (collect_tree builds a child's history from its
    parent's), and taken up by the children when the next turn is scored."""

    success_metric = "success_rate"

    @classmethod
    def agents_for(cls, cfg: Any) -> tuple[str, ...] | None:
        return tuple(str(a) for a in cfg.agents) if cfg.get("agents") is not None else None

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.spec = str(cfg.env)
        self.factory: Callable[..., Any] = resolve_function(self.spec, "task.env", kind="class")
        self.kwargs = dict(OmegaConf.to_container(cfg.env_kwargs, resolve=True)) if OmegaConf.is_config(
            cfg.env_kwargs) else dict(cfg.env_kwargs or {})
        probe = self.make()
        for method in ("reset", "step"):
            if not callable(getattr(probe, method, None)):
                raise UserError(f"task.env={self.spec}: {type(probe).__name__} has no {method}() method: an environment "
                                "needs reset(seed) and step(actions) (docs/extending.md)")
        named = self.agents_for(cfg) or getattr(probe, "possible_agents", None) or getattr(probe, "agents", None)
        if not named:
            raise UserError(f"task.env={self.spec}: name the agents, as task.agents=[a,b] or an `agents` list on the "
                            "class")
        self.agent_names = tuple(str(a) for a in named)
        if len(set(self.agent_names)) != len(self.agent_names):
            raise UserError(f"task.env={self.spec}: the agents {list(self.agent_names)} must be named once each")
        self._observe(self._call(probe, "reset", 0), "reset", 0)  # a broken reset stops the run before models load
        self._live: dict[int, tuple[Turn, Any]] = {}

    # -- the environment's calls, checked ------------------------------------------------------
    def make(self) -> Any:
        try:
            return self.factory(**self.kwargs)
        except ESCAPES as err:  # the user's constructor: one line naming it
            raise UserError(f"task.env={self.spec}: creating it with task.env_kwargs={self.kwargs} raised "
                            f"{_raised(err)}{_where(err)}") from None

    def _call(self, env: Any, method: str, arg: Any, seed: int | None = None, turn: int | None = None) -> Any:
        try:
            return getattr(env, method)(arg)
        except UserError:
            raise
        except ESCAPES as err:  # the user's environment: one line naming the method
            at = f"reset(seed={arg})" if method == "reset" else f"step() at turn {turn} of the episode of seed {seed}"
            raise UserError(f"task.env={self.spec}: {at} raised {_raised(err)}{_where(err)}: fix the "
                            "environment") from None

    def _observe(self, obs: Any, method: str, seed: int, turn: int | None = None) -> list[str]:
        """Observations in agent order; UserError naming the method and the agent when malformed."""
        at = f"reset(seed={seed})" if method == "reset" else f"step() (turn {turn}, seed {seed})"
        if method == "reset" and isinstance(obs, tuple) and len(obs) == 2 and isinstance(obs[1], dict) \
                and isinstance(obs[0], (list, tuple, dict)):
            obs = obs[0]  # gymnasium's (observations, info)
        obs = self._per_agent(obs, at, "observation")
        limit = int(self.cfg.get("max_observation_chars", EnvTaskConfig.max_observation_chars))
        for name, o in zip(self.agent_names, obs):
            if not isinstance(o, str):
                raise UserError(f"task.env={self.spec}: {at} returned a {type(o).__name__} observation for agent "
                                f"{name}: an observation is the agent's prompt, a str")
            if len(o) > limit:
                raise UserError(f"task.env={self.spec}: {at} returned a {len(o):,}-character observation for agent "
                                f"{name}, more than task.max_observation_chars={limit:,}: return a shorter prompt "
                                "(what the agent must read this turn), or raise task.max_observation_chars")
        return obs

    def _per_agent(self, values: Any, at: str, what: str) -> list[Any]:
        n = self.num_agents
        if isinstance(values, dict):
            missing = [a for a in self.agent_names if a not in values]
            if missing:
                raise UserError(f"task.env={self.spec}: {at} returned no {what} for agent {missing[0]} (agents: "
                                f"{', '.join(self.agent_names)}): give one per agent, by name")
            return [values[a] for a in self.agent_names]
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} {what}s" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise UserError(f"task.env={self.spec}: {at} returned {got} for {n} agent{'s' * (n != 1)} "
                            f"({', '.join(self.agent_names)}): return one {what} per agent, a list in that order or "
                            "a dict by agent")
        return list(values)

    def _step(self, env: Any, actions: list[str], seed: int, turn: int) -> JointReward:
        out = self._call(env, "step", dict(zip(self.agent_names, actions)), seed, turn)
        at = f"step() (turn {turn}, seed {seed})"
        if not isinstance(out, tuple) or len(out) not in (4, 5):
            raise UserError(f"task.env={self.spec}: {at} returned {type(out).__name__}"
                            f"{f' of {len(out)}' if isinstance(out, tuple) else ''}: return a tuple (observations, "
                            "rewards, team_reward, done) or (..., info)")
        obs, rewards, team, done = out[:4]
        info = out[4] if len(out) == 5 else {}
        if not isinstance(info, dict):
            raise UserError(f"task.env={self.spec}: {at} returned a {type(info).__name__} info: give a dict or leave "
                            "it out")
        local: list[float] = []
        if rewards is not None:
            for name, r in zip(self.agent_names, self._per_agent(rewards, at, "reward")):
                value = _number(r)
                if value is None:
                    raise UserError(f"task.env={self.spec}: {at} returned the reward {r!r} for agent {name}: a "
                                    "reward is a finite number")
                local.append(value)
        if isinstance(team, dict):
            levels = {}
            for level, v in team.items():
                value = _number(v)
                if value is None:
                    raise UserError(f"task.env={self.spec}: {at} returned {v!r} for the team reward level {level!r}: "
                                    "a reward is a finite number")
                levels[str(level)] = value
            total = sum(levels.values())
        else:
            levels, total = {}, _number(team)
            if total is None:
                raise UserError(f"task.env={self.spec}: {at} returned the team reward {team!r}: give a finite number "
                                "or a dict of reward levels")
        if not isinstance(done, bool) and type(done).__name__ != "bool_":
            raise UserError(f"task.env={self.spec}: {at} returned done={done!r}: give True or False")
        success = info.get("success")
        observations = None if done else self._observe(obs, "step", seed, turn)
        return JointReward(total=total, levels=levels, local=local, done=bool(done),
                           passed=None if success is None else bool(success),
                           info={"observations": observations, "env_info": info})

    # -- the joint-reward task interface -----------------------------------------------------------
    def load_split(self, split: str) -> list[Problem]:
        c = self.cfg
        return seed_problems(self.name, split, int(c.num_train_seeds), int(c.eval_seed), int(c.num_eval_seeds))

    def initial_prompts(self, problem: Problem) -> list[str]:
        seed = int(problem.data["seed"])
        return self._observe(self._call(self.make(), "reset", seed), "reset", seed)

    def history_rewards(self, problems: list[Problem], histories: list[list[list[Turn]]]) -> list[JointReward]:
        """Step each joint action's environment: at turn 0 a fresh one reset to the problem's seed;
        later, its parent's (forked when the parent has several children)."""
        children: dict[int, int] = {}  # parent key -> children still to step
        for hist in histories:
            if len(hist[0]) > 1:
                children[id(hist[0][-2])] = children.get(id(hist[0][-2]), 0) + 1
        live, out = {}, []
        for problem, hist in zip(problems, histories):
            seed, turn = int(problem.data["seed"]), len(hist[0])
            if turn == 1:
                env = self.make()
                self._call(env, "reset", seed)
            else:
                key = id(hist[0][-2])
                entry = self._live.get(key)
                if entry is None or entry[0] is not hist[0][-2]:
                    raise RuntimeError(f"task=env: no environment state for turn {turn - 1} of seed {seed}: "
                                       "histories must extend the ones this task scored")
                children[key] -= 1
                env = entry[1] if children[key] == 0 else self._fork(entry[1], seed)
            reward = self._step(env, [h[-1].action for h in hist], seed, turn)
            if not reward.done:
                live[id(hist[0][-1])] = (hist[0][-1], env)
            out.append(reward)
        self._live = live
        return out

    def _fork(self, env: Any, seed: int) -> Any:
        try:
            return copy.deepcopy(env)
        except ESCAPES as err:
            raise UserError(f"task.env={self.spec}: copy.deepcopy of the environment (seed {seed}) raised "
                            f"{_raised(err)}{_where(err)}: a rollout tree forks it when a joint action has several "
                            "children (algo.num_generations > 1 after the first turn); make it copyable (e.g. "
                            "__deepcopy__) or set algo.num_turns=1") from None

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        """One step from the reset state (the joint action is each episode's first)."""
        return self.history_rewards(problems, [[[Turn("", a)] for a in actions] for actions in joint_actions])

    def next_prompts(self, problem: Problem, histories: list[list[Turn]], reward: JointReward) -> list[str]:
        return list(reward.info["observations"])
