"""task=env: your own multi-turn environment, in the style of gymnasium / PettingZoo, no subclassing.

Any class with two methods, named as `module:Class` (task.env) or passed to marl_llm.train_team:

    class Guess:
        agents = ["guesser", "checker"]        # or task.agents=[...], or set in __init__ (possible_agents too)

        def reset(self, seed):                 # -> each agent's first observation (its first prompt):
            ...                                #    a list in agent order or a dict by agent (optionally
                                               #    (observations, infos), as gymnasium and PettingZoo return)
        def step(self, actions):               # actions: {agent: its completion} for every agent
            ...                                # -> (observations, rewards, team_reward, done[, info])
                                               #    or PettingZoo's (observations, rewards, terminations,
                                               #    truncations, infos)

The project's own return: observations (every agent's next prompt, a str); rewards (each agent's
own: a list or dict of numbers, or None); team_reward (a number, or a dict of reward levels that sum
to it, logged as rewards/<level>/...); done; info ({"success": bool} is success_rate).

PettingZoo's parallel API (a pettingzoo.ParallelEnv, or any class whose step returns its five
dicts): rewards by agent (required: the team reward is their mean, or their sum under
task.pettingzoo_team_reward=sum), terminations and truncations by agent (the episode ends when
any agent's is True: every agent acts every turn here), infos by agent ({"success": bool} in any
agent's info is success_rate). A PettingZoo AEC environment (agents act in turn) is refused by name.

Every agent acts each turn; an episode runs algo.num_turns turns or until done. The algorithms read:

    MAGRPO       team_reward is the joint reward of the turn; the tree forks the environment at every
                 node (G children: G - 1 copy.deepcopy copies, the last steps the parent's own object)
    AT-GRPO      groups per (environment, agent, turn); candidate score alpha * team_reward + the
                 agent's own reward; the episode continues from the best joint action (forked too)
    CoLLM-CC/DC  one trajectory per environment (no copies); team_reward is r_t of the TD targets

Problems are seeds: training draws 0 .. num_train_seeds - 1, evaluation eval_seed .. eval_seed +
num_eval_seeds - 1. It is user code and runs in the trainer's process, like task=team's reward.

Building the task tries the environment dry, before any model loads (PettingZoo's api_test in
spirit): reset(0), a step with placeholder actions, a copy.deepcopy (a rollout tree's fork) and a
second step of each, every return checked. A broken contract, then or later, stops the run with
one line naming the class, the method, the agent, the user's file:line and the fix. Observations
are cut to task.max_observation_tokens (each agent's tokenizer) ending in TRUNCATION_MARKER, and
counted as observations/clipped_ratio (and <agent>/...); one over task.max_observation_chars is a
bug's size and stops the run before it is tokenized.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from omegaconf import OmegaConf

from marl_llm.config import UserError, check_choice, check_value
from marl_llm.tasks.base import JointReward, Problem, Task, Turn, register_task, seed_problems
from marl_llm.tasks.team import resolve_function

# What every agent "writes" in the dry run: text an environment must survive, as it must survive
# whatever a model writes.
DRY_RUN_ACTION = "(a placeholder action: marl-llm tries the environment before any model loads)"
# Ends an observation cut to task.max_observation_tokens, so the agent (and whoever reads the
# samples) sees that it was cut.
TRUNCATION_MARKER = "\n[... observation cut here: task.max_observation_tokens={cap}]"
# An observation is cut to cap x this many characters before it is tokenized (tokenizing a
# 1,000,000-character string takes seconds; no tokenizer averages more characters per token), so
# the token cap costs the same for any length.
CHARS_PER_TOKEN_BOUND = 32
# How a PettingZoo environment's per-agent rewards make the team reward (task.pettingzoo_team_reward).
TEAM_REWARDS: dict[str, Callable[[list[float]], float]] = {"mean": lambda xs: sum(xs) / len(xs), "sum": sum}
# The smallest task.max_observation_tokens: the marker itself takes ~20 tokens.
MIN_OBSERVATION_TOKENS = 64

log = logging.getLogger("marl_llm")


@dataclass
class EnvTaskConfig:
    name: str = "env"
    # What run names, W&B groups and tags, summaries and report tables call this task (null: the
    # environment's class name, so runs of different environments are told apart).
    label: Optional[str] = None
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
    # A PettingZoo environment's team reward from its per-agent rewards: mean | sum.
    pettingzoo_team_reward: str = "mean"
    # Observations are cut to this many tokens (the agent's tokenizer), ending in a visible marker,
    # and counted as observations/clipped_ratio; the memory plan budgets prompts of this length
    # (plus the chat template) for task=env.
    max_observation_tokens: int = 1024
    # The longest observation (characters) reset() or step() may return at all: a longer one is an
    # environment's bug (a whole log file) and stops the run with one line naming the environment,
    # the method and this limit, before it is tokenized.
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
        check_choice(cfg, "task.pettingzoo_team_reward", TEAM_REWARDS)
        check_value(t.max_observation_tokens >= MIN_OBSERVATION_TOKENS, "task.max_observation_tokens",
                    f"must be >= {MIN_OBSERVATION_TOKENS} (tokens; the truncation marker takes ~20)")
        check_value(t.max_observation_chars >= 1, "task.max_observation_chars",
                    "must be >= 1 (characters; default 1,000,000)")


def _shown(path: str) -> str:
    """A file as the one line shows it: relative to the current directory when inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _defined_at(obj: Any) -> str:
    """`file:line` where a function or class is defined ("" for a builtin or a C extension)."""
    try:
        target = inspect.unwrap(obj)
        code = getattr(target, "__code__", None)
        if code is not None:
            return f"{_shown(code.co_filename)}:{code.co_firstlineno}"
        return f"{_shown(inspect.getsourcefile(target) or '')}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        return ""


def _where(err: BaseException, fallback: str = "") -> str:
    """` at file:line` in the environment's code where `err` was raised: the innermost frame outside
    Python's own library and installed packages (exit() is site's, and under logger=wandb sys.exit
    is wandb's exit hook), else the first frame of the environment's method (an installed one).
    `fallback`: where the called method is defined, for an error raised before any of its lines ran
    (a call with the wrong arguments)."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = next((i for i in range(len(frames) - 1, -1, -1) if frames[i].filename == __file__), -1)
    theirs = frames[ours + 1:]
    if not theirs:
        return f" at {fallback}" if fallback else ""
    library = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
    own = [f for f in theirs if not f.filename.startswith(("<", *library))]
    where = own[-1] if own else theirs[0]
    return f" at {_shown(where.filename)}:{where.lineno}"


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


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's too


def _pettingzoo_class(env: Any, name: str) -> bool:
    """`env` is a pettingzoo.<name> (ParallelEnv, AECEnv). Without pettingzoo imported no object
    can be one, so this never imports it (it is no dependency of marl-llm)."""
    module = sys.modules.get("pettingzoo")
    cls = getattr(module, name, None) if module is not None else None
    return isinstance(cls, type) and isinstance(env, cls)


@dataclass
class _Call:
    """One call of the environment, as the one line names it."""

    env: Any
    method: str  # reset | step
    seed: int
    turn: int = 0
    dry: bool = False  # the dry run when the task is built

    def at(self, located: bool = True) -> str:
        """`Guess.step() (games.py:52) at turn 2 of the episode of seed 7`; `located`: with where the
        method is defined (an error in what it returned; an exception names the line it raised at)."""
        where = _defined_at(getattr(type(self.env), self.method, None)) if located else ""
        what = f"{type(self.env).__name__}.{self.method}({f'seed={self.seed}' if self.method == 'reset' else ''})"
        what += f" ({where})" if where else ""
        if self.method == "step":
            what += f" at turn {self.turn} of the episode of seed {self.seed}"
        if self.dry:
            what += " in the dry run before training" + (", with placeholder actions," if self.method == "step" else "")
        return what


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
        self.team_reward = TEAM_REWARDS[str(cfg.get("pettingzoo_team_reward", "mean"))]
        self.max_chars = int(cfg.get("max_observation_chars", EnvTaskConfig.max_observation_chars))
        self.max_tokens = int(cfg.get("max_observation_tokens", EnvTaskConfig.max_observation_tokens))
        self._tokenizers: list[Any] | None = None  # each agent's, once the models load (use_tokenizers)
        self._marker_ids: dict[int, list[int]] = {}  # the truncation marker's ids, by tokenizer
        self._said_cut = False  # the first cut observation is logged, the rest counted
        self._live: dict[int, tuple[Turn, Any]] = {}
        self._check_kwargs()
        probe = self.make()
        self._check_kind(probe)
        named = self.agents_for(cfg) or getattr(probe, "possible_agents", None) or getattr(probe, "agents", None)
        if not named:
            raise UserError(f"task.env={self.spec}: name the agents, as task.agents=[a,b] or an `agents` list on the "
                            f"class {type(probe).__name__}")
        self.agent_names = tuple(str(a) for a in named)
        if len(set(self.agent_names)) != len(self.agent_names):
            raise UserError(f"task.env={self.spec}: the agents {list(self.agent_names)} must be named once each")
        # Observations seen and cut to max_observation_tokens per agent since take_metrics.
        self._seen = dict.fromkeys(self.agent_names, 0)
        self._cut = dict.fromkeys(self.agent_names, 0)
        self._dry_run(probe)

    # -- the environment's calls, checked ------------------------------------------------------
    def _check_kwargs(self) -> None:
        try:
            inspect.signature(self.factory).bind(**self.kwargs)
        except TypeError as err:  # the keyword arguments do not fit: name the class's own parameters
            params = ", ".join(inspect.signature(self.factory).parameters)
            where = _defined_at(self.factory.__init__ if isinstance(self.factory, type) else self.factory)
            name = f"{getattr(self.factory, '__qualname__', self.spec)}({params})" + (f" at {where}" if where else "")
            raise UserError(f"task.env={self.spec}: task.env_kwargs={self.kwargs} do not fit {name}: {err}; change "
                            "task.env_kwargs") from None
        except ValueError:
            pass  # no signature (a builtin): the call itself says what is wrong

    def make(self) -> Any:
        try:
            return self.factory(**self.kwargs)
        except ESCAPES as err:  # the user's constructor: one line naming it
            raise UserError(f"task.env={self.spec}: creating it with task.env_kwargs={self.kwargs} raised "
                            f"{_raised(err)}{_where(err, _defined_at(self.factory))}") from None

    def _check_kind(self, env: Any) -> None:
        cls = type(env).__name__
        if _pettingzoo_class(env, "AECEnv") or callable(getattr(env, "agent_iter", None)) and \
                callable(getattr(env, "last", None)):
            raise UserError(f"task.env={self.spec}: {cls} is a PettingZoo AEC environment (agents act in turn); "
                            "task=env plays the parallel API, every agent each turn: wrap it with "
                            "pettingzoo.utils.conversions.aec_to_parallel, or write a parallel one (docs/extending.md)")
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise UserError(f"task.env={self.spec}: {cls} has no {method}() method: an environment "
                                "needs reset(seed) and step(actions) (docs/extending.md)")

    def _dry_run(self, env: Any) -> None:
        """reset(0), a step with placeholder actions, a copy (the fork a rollout tree makes) and a
        second step of each, every return checked: a broken environment stops the run here, before
        any model loads, not after a rollout."""
        actions = [DRY_RUN_ACTION] * self.num_agents
        self._observe(self._call(_Call(env, "reset", 0, dry=True), 0), _Call(env, "reset", 0, dry=True))
        if self._step(env, actions, 0, 1, dry=True).done:
            return
        twin = self._fork(env, 0, dry=True)
        for each in (twin, env):
            self._step(each, actions, 0, 2, dry=True)

    def _call(self, call: _Call, arg: Any) -> Any:
        try:
            return getattr(call.env, call.method)(arg)
        except UserError:
            raise
        except ESCAPES as err:  # the user's environment: one line naming the method
            fallback = _defined_at(getattr(type(call.env), call.method, None))
            raise UserError(f"task.env={self.spec}: {call.at(located=False)} raised {_raised(err)}"
                            f"{_where(err, fallback)}: fix the environment") from None

    def _fail(self, call: _Call, what: str) -> UserError:
        return UserError(f"task.env={self.spec}: {call.at()} {what}")

    def _observe(self, obs: Any, call: _Call) -> list[str]:
        """Observations in agent order, each cut to max_observation_tokens once the tokenizers are
        known; UserError naming the method and the agent when malformed."""
        if call.method == "reset" and isinstance(obs, tuple) and len(obs) == 2 and isinstance(obs[1], dict) \
                and isinstance(obs[0], (list, tuple, dict)):
            obs = obs[0]  # gymnasium's and PettingZoo's (observations, infos)
        obs = self._per_agent(obs, call, "observation")
        for name, o in zip(self.agent_names, obs):
            if not isinstance(o, str):
                raise self._fail(call, f"returned a {type(o).__name__} observation for agent {name}: an observation "
                                       "is the agent's prompt, a str")
            if len(o) > self.max_chars:
                raise self._fail(call, f"returned a {len(o):,}-character observation for agent {name}, more than "
                                       f"task.max_observation_chars={self.max_chars:,}: return a shorter prompt (what "
                                       "the agent must read this turn), or raise task.max_observation_chars")
        if self._tokenizers is None or call.dry:
            return obs
        return [self._cap(i, o, call) for i, o in enumerate(obs)]

    def _per_agent(self, values: Any, call: _Call, what: str) -> list[Any]:
        n = self.num_agents
        if isinstance(values, dict):
            missing = [a for a in self.agent_names if a not in values]
            if missing:
                raise self._fail(call, f"returned no {what} for agent {missing[0]} (agents: "
                                       f"{', '.join(self.agent_names)}): give one per agent, by name")
            return [values[a] for a in self.agent_names]
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} {what}s" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise self._fail(call, f"returned {got} for {n} agent{'s' * (n != 1)} ({', '.join(self.agent_names)}): "
                                   f"return one {what} per agent, a list in that order or a dict by agent")
        return list(values)

    def _reward(self, call: _Call, value: Any, what: str) -> float:
        number = _number(value)
        if number is None:
            raise self._fail(call, f"returned {what}: a reward is a finite number")
        return number

    def _step(self, env: Any, actions: list[str], seed: int, turn: int, dry: bool = False) -> JointReward:
        call = _Call(env, "step", seed, turn, dry)
        out = self._call(call, dict(zip(self.agent_names, actions)))
        if isinstance(out, tuple) and len(out) == 5 and isinstance(out[3], dict):
            return self._pettingzoo_step(out, call)
        if _pettingzoo_class(env, "ParallelEnv") or not isinstance(out, tuple) or len(out) not in (4, 5):
            got = f"{type(out).__name__}{f' of {len(out)}' if isinstance(out, tuple) else ''}"
            raise self._fail(call, f"returned {got}: return a tuple (observations, rewards, team_reward, done), the "
                                   "same with an info dict last, or PettingZoo's (observations, rewards, "
                                   "terminations, truncations, infos) with dicts by agent")
        obs, rewards, team, done = out[:4]
        info = out[4] if len(out) == 5 else {}
        if not isinstance(info, dict):
            raise self._fail(call, f"returned a {type(info).__name__} info: give a dict or leave it out")
        local: list[float] = []
        if rewards is not None:
            local = [self._reward(call, r, f"the reward {r!r} for agent {name}")
                     for name, r in zip(self.agent_names, self._per_agent(rewards, call, "reward"))]
        if isinstance(team, dict):
            levels = {str(level): self._reward(call, v, f"{v!r} for the team reward level {level!r}")
                      for level, v in team.items()}
            total = sum(levels.values())
        else:
            levels, total = {}, _number(team)
            if total is None:
                raise self._fail(call, f"returned the team reward {team!r}: give a finite number or a dict of "
                                       "reward levels")
        if not _is_bool(done):
            raise self._fail(call, f"returned done={done!r}: give True or False")
        success = info.get("success")
        observations = None if done else self._observe(obs, call)
        return JointReward(total=total, levels=levels, local=local, done=bool(done),
                           passed=None if success is None else bool(success),
                           info={"observations": observations, "env_info": info})

    def _pettingzoo_step(self, out: tuple, call: _Call) -> JointReward:
        """PettingZoo's (observations, rewards, terminations, truncations, infos), dicts by agent:
        the team reward is the agents' rewards' task.pettingzoo_team_reward (mean or sum)."""
        obs, rewards, terminations, truncations, infos = out
        if not isinstance(rewards, dict):
            raise self._fail(call, f"returned PettingZoo's five values with rewards as a {type(rewards).__name__}: "
                                   "give a dict of every agent's reward")
        local = [self._reward(call, r, f"the reward {r!r} for agent {name}")
                 for name, r in zip(self.agent_names, self._per_agent(rewards, call, "reward"))]
        ended = False
        for what, flags in (("termination", terminations), ("truncation", truncations)):
            for name, flag in zip(self.agent_names, self._per_agent(flags, call, what)):
                if not _is_bool(flag):
                    raise self._fail(call, f"returned the {what} {flag!r} for agent {name}: give True or False")
                ended = ended or bool(flag)
        if not isinstance(infos, dict) or not all(isinstance(v, dict) for v in infos.values()):
            raise self._fail(call, "returned infos that are not a dict of dicts by agent: give {agent: {...}}, "
                                   "each possibly empty")
        said = [bool(i["success"]) for i in infos.values() if i.get("success") is not None]
        observations = None if ended else self._observe(obs, call)
        return JointReward(total=self.team_reward(local), local=local, done=ended,
                           passed=any(said) if said else None,
                           info={"observations": observations, "env_info": infos})

    # -- the observation cap ----------------------------------------------------------------------
    def use_tokenizers(self, tokenizers: list[Any]) -> None:
        self._tokenizers = list(tokenizers)

    def _cap(self, agent: int, text: str, call: _Call) -> str:
        """`text` cut to max_observation_tokens of agent `agent`'s tokenizer, ending in the marker."""
        name, cap, tok = self.agent_names[agent], self.max_tokens, self._tokenizers[agent]
        self._seen[name] += 1
        head = text[:cap * CHARS_PER_TOKEN_BOUND]
        ids = tok(head, add_special_tokens=False)["input_ids"]
        if len(ids) <= cap and len(head) == len(text):
            return text
        marker = TRUNCATION_MARKER.format(cap=cap)
        if id(tok) not in self._marker_ids:
            self._marker_ids[id(tok)] = tok(marker, add_special_tokens=False)["input_ids"]
        keep = max(cap - len(self._marker_ids[id(tok)]), 0)
        if not self._said_cut:  # once a run: the metric counts the rest
            self._said_cut = True
            log.warning(f"task.env={self.spec}: {call.at(located=False)} returned an observation of more than "
                        f"{cap} tokens for agent {name}: cut to task.max_observation_tokens={cap}, ending in "
                        f"{marker.strip()!r} (counted as observations/clipped_ratio; raise the setting to keep more)")
        self._cut[name] += 1
        return tok.decode(ids[:keep]) + marker

    def take_metrics(self) -> dict[str, float]:
        seen = sum(self._seen.values())
        if not seen:
            return {}
        out = {"observations/clipped_ratio": sum(self._cut.values()) / seen}
        for name in self.agent_names:
            if self._seen[name]:
                out[f"{name}/observations/clipped_ratio"] = self._cut[name] / self._seen[name]
        self._seen = dict.fromkeys(self.agent_names, 0)
        self._cut = dict.fromkeys(self.agent_names, 0)
        return out

    # -- the joint-reward task interface -----------------------------------------------------------
    def load_split(self, split: str) -> list[Problem]:
        c = self.cfg
        return seed_problems(self.name, split, int(c.num_train_seeds), int(c.eval_seed), int(c.num_eval_seeds))

    def initial_prompts(self, problem: Problem) -> list[str]:
        seed = int(problem.data["seed"])
        env = self.make()
        call = _Call(env, "reset", seed)
        return self._observe(self._call(call, seed), call)

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
                self._call(_Call(env, "reset", seed), seed)
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

    def _fork(self, env: Any, seed: int, dry: bool = False) -> Any:
        cls = type(env).__name__
        try:
            twin = copy.deepcopy(env)
        except ESCAPES as err:
            where = _where(err, _defined_at(getattr(type(env), "__deepcopy__", None) or type(env)))
            raise UserError(f"task.env={self.spec}: copy.deepcopy of {cls} (seed {seed}"
                            f"{', in the dry run before training' if dry else ''}) raised {_raised(err)}{where}: a "
                            "rollout tree copies the environment when a joint action has several children (MAGRPO, "
                            "AT-GRPO after the first turn); make it copyable (e.g. __deepcopy__), see "
                            "docs/extending.md") from None
        if twin is env:
            raise UserError(f"task.env={self.spec}: copy.deepcopy of {cls} returned the same object "
                            f"({_defined_at(getattr(type(env), '__deepcopy__', None) or type(env))}): the copies "
                            "of a rollout tree would share one episode; return a new object from __deepcopy__")
        return twin

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        """One step from the reset state (the joint action is each episode's first)."""
        return self.history_rewards(problems, [[[Turn("", a)] for a in actions] for actions in joint_actions])

    def next_prompts(self, problem: Problem, histories: list[list[Turn]], reward: JointReward) -> list[str]:
        return list(reward.info["observations"])
