"""StrBuild (CoLLM, arXiv 2601.21972) without Minecraft: two builders spell a string in 5x5 block
letters with `/setblock x y z block` commands, each with its own block palette, over 4 turns.

The simulator is `marl_llm.envs.strbuild.StrBuildEnv`. Agents act in parallel each turn (the joint
action is applied in agent order, then the turn is scored); blocks stay between turns, so a turn's
reward is computed by replaying the whole history of the joint actions (`history_rewards`):

    reward = 2 * coverage - 1.5 * extra_ratio - adjacency_ratio - 0.25 * absent_agents

Each turn's feedback (the next prompt) shows the target wall, the current build, the missing and
extra positions, same-block neighbours and the agent's rejected commands. An episode ends at the
horizon or, with `task.end_on_success` (default), when the build is near-perfect (coverage >=
success_coverage and extra_ratio <= success_max_extra: `passed`, and the node is not expanded
further); the CoLLM reference ends it only at the horizon (or its trainer's early termination).

Reward (`task.reward.variant`): `fixed` is the simulator's above; `paper` the CoLLM reference's
(tasks/strbuild_reward_paper.py, docs/rewards_strbuild.md): each turn's joint action alone on an
empty wall, extra blocks over the background, adjacency over every placed block by colour key,
complete palettes, exact block names, list markers stripped, 150 commands per agent.

Targets: `task.train_targets` / `task.eval_targets` when given, else random uppercase strings of
`min_letters`..`max_letters` letters, the evaluation set drawn first from `eval_seed` and never
used for training.

The wall leaves `task.letter_gap` empty columns between letters (1; the reference's configs: 2).

Prompts (`task.prompts`): `own` is the wording above; `paper` the CoLLM reference's prompts
(strbuild_prompts_paper.json, docs/prompts_strbuild.md): turn 1 shows the wall's bounding box and
the agent's blocks (no target picture), later turns every target position of the letters and the
agent's previous commands. They show no build state. As the reference sends them, turn 1 is a
`Message` with the system text as its system message (the chat template gets [system, user]),
later turns a raw `Message` (tokenized as plain text, no template).
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, List

from marl_llm.config import UserError, check_choice, check_value
from marl_llm.envs.strbuild import FONT, GAP, HEIGHT, StrBuildEnv
from marl_llm.models.prompting import Message
from marl_llm.tasks import strbuild_reward_paper
from marl_llm.tasks.base import JointReward, Problem, Task, Turn, register_task

INSTRUCTIONS = (
    "You are {name}, one of {n} builders who spell {target!r} as 5x5 block letters on a wall. Each turn every "
    "builder writes Minecraft commands, one per line: /setblock x y z block. Use only your own blocks, only on "
    "target cells, and alternate blocks with the other builder so that neighbours differ. Output only commands.\n\n"
)
# Ends every prompt: without it the 135M model describes the puzzle instead of writing commands.
OUTRO = ("\n\nWrite your /setblock commands now, one per line, for missing target positions (z is 0), e.g.\n"
         "/setblock 0 4 0 {first}\n/setblock 1 4 0 {second}")

PAPER_PROMPTS = "strbuild_prompts_paper.json"


@lru_cache(maxsize=1)
def paper_prompts() -> dict[str, Any]:
    """The reference's prompt texts (task.prompts=paper), shipped in the package."""
    return json.loads(resources.files("marl_llm.tasks").joinpath(PAPER_PROMPTS).read_text(encoding="utf-8"))


@dataclass
class StrBuildRewardConfig:
    # fixed: this simulator's reward (blocks stay between turns); paper: the CoLLM reference's
    # (each turn alone on an empty wall; docs/rewards_strbuild.md).
    variant: str = "fixed"


@dataclass
class StrBuildTaskConfig:
    """task=strbuild (marl_llm.tasks.strbuild): spell a string in 5x5 block letters with /setblock."""

    name: str = "strbuild"
    # One block palette per builder (disjoint); the number of palettes is the number of agents.
    palettes: List[List[str]] = field(default_factory=lambda: [["red_wool", "orange_wool", "yellow_wool"],
                                                                ["blue_wool", "cyan_wool", "purple_wool"]])
    max_turns: int = 4
    success_coverage: float = 0.95
    success_max_extra: float = 0.05
    # Success ends the episode (its node is not expanded). false: only the horizon (and the
    # algorithm's early termination) ends it, as in the CoLLM reference.
    end_on_success: bool = True
    reward: StrBuildRewardConfig = field(default_factory=StrBuildRewardConfig)
    # Explicit targets (uppercase letters and spaces); empty: random strings as below.
    train_targets: List[str] = field(default_factory=list)
    eval_targets: List[str] = field(default_factory=list)
    min_letters: int = 1
    max_letters: int = 2
    num_train: int = 10000
    # The evaluation strings (distinct, never trained on) are drawn from this seed.
    eval_seed: int = 100000
    num_eval: int = 16
    reward_shift: float = 0.0
    # own: this project's feedback prompts; paper: the CoLLM reference's (docs/prompts_strbuild.md).
    prompts: str = "own"
    # Empty columns between letters on the wall (the CoLLM reference's configs: 2, dataset.spacing).
    letter_gap: int = 1

    @staticmethod
    def check(cfg: Any) -> None:
        t = cfg.task
        check_choice(cfg, "task.prompts", ("paper", "own"))
        check_choice(cfg, "task.reward.variant", ("fixed", "paper"))
        check_value(1 <= t.max_turns, "task.max_turns", "must be >= 1")
        check_value(0 < t.success_coverage <= 1, "task.success_coverage", "must be in (0, 1]")
        check_value(t.success_max_extra >= 0, "task.success_max_extra", "must be >= 0")
        check_value(t.num_eval >= 1, "task.num_eval", "must be >= 1")
        check_value(t.letter_gap >= 0, "task.letter_gap", "must be >= 0")


@register_task("strbuild", schema=StrBuildTaskConfig)
class StrBuildTask(Task):
    success_metric = "success_rate"

    @classmethod
    def agents_for(cls, cfg: Any) -> tuple[str, ...]:
        return tuple(f"builder{i + 1}" for i in range(len(cfg.palettes)))  # one builder per palette

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.palettes = tuple(tuple(str(b) for b in p) for p in cfg.palettes)
        if len(self.palettes) < 1:
            raise UserError("task.palettes is empty: give one list of block names per builder")
        self.agent_names = self.agents_for(cfg)
        self.max_turns = int(cfg.max_turns)
        self.letter_gap = int(cfg.get("letter_gap", GAP))
        if self.letter_gap < 0:
            raise UserError(f"task.letter_gap={self.letter_gap}: need >= 0 empty columns between letters")
        self.prompt_style = str(cfg.get("prompts", "own"))
        self.reward_variant = str(cfg.get("reward", {}).get("variant", "fixed"))
        self.end_on_success = bool(cfg.get("end_on_success", True))
        if self.prompt_style == "paper" and len(self.palettes) > 2:
            raise UserError(f"task.prompts=paper has the reference's prompts for 1 or 2 builders, not "
                            f"{len(self.palettes)}: give at most two task.palettes or use task.prompts=own")
        try:  # checks the palettes (disjoint, no air) once, with the simulator's own messages
            self.new_env("A")
        except ValueError as err:
            raise UserError(f"task.palettes: {err}") from None

    def new_env(self, target: str) -> StrBuildEnv:
        c = self.cfg
        return StrBuildEnv(target, self.palettes, max_turns=self.max_turns, letter_gap=self.letter_gap,
                           success_coverage=float(c.success_coverage), success_max_extra=float(c.success_max_extra),
                           end_on_success=self.end_on_success)

    # -- data --------------------------------------------------------------------------------
    def load_split(self, split: str) -> list[Problem]:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}: expected train or eval")
        c = self.cfg
        given = list(c.train_targets if split == "train" else c.eval_targets)
        if given:
            targets = [str(t).upper() for t in given]
            bad = [t for t in targets if any(ch not in FONT for ch in t) or not t.strip()]
            if bad:
                raise UserError(f"task.{split}_targets {bad}: use uppercase letters A-Z and spaces")
        else:
            held_out = self._random_targets(int(c.eval_seed), int(c.num_eval), set())
            targets = held_out if split == "eval" else self._random_targets(0, int(c.num_train), set(held_out))
        return [Problem(uid=f"strbuild/{split}/{j}", data={"target": t}) for j, t in enumerate(targets)]

    def _random_targets(self, seed: int, n: int, exclude: set[str]) -> list[str]:
        """`n` random targets never in `exclude`; distinct when drawing the evaluation set (empty
        `exclude`), drawn with replacement for training."""
        lo, hi = int(self.cfg.min_letters), int(self.cfg.max_letters)
        if not 1 <= lo <= hi:
            raise UserError(f"task.min_letters={lo}, task.max_letters={hi}: need 1 <= min_letters <= max_letters")
        distinct = not exclude
        possible = sum(26 ** k for k in range(lo, hi + 1)) - len(exclude)
        if possible < 1 or (distinct and n > possible):
            raise UserError(f"only {max(possible, 0)} distinct targets of {lo}-{hi} letters: lower task.num_eval "
                            "or raise task.max_letters")
        rng, out, seen = random.Random(seed), [], set(exclude)
        while len(out) < n:
            t = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(lo, hi)))
            if t not in seen:
                out.append(t)
                if distinct:
                    seen.add(t)
        return out

    # -- prompts and scoring -----------------------------------------------------------------
    def _prompt(self, problem: Problem, agent: int, feedback: str) -> str:
        palette = self.palettes[agent]
        return (INSTRUCTIONS.format(name=self.agent_names[agent], n=self.num_agents, target=problem.data["target"])
                + feedback + OUTRO.format(first=palette[0], second=palette[1 % len(palette)]))

    def initial_prompts(self, problem: Problem) -> list[str]:
        env = self.new_env(problem.data["target"])
        if self.prompt_style == "paper":
            return [self._paper_prompt(env, i) for i in range(self.num_agents)]
        return [self._prompt(problem, i, env.feedback(i)) for i in range(self.num_agents)]

    # task.prompts=paper: the reference's texts, filled with this simulator's wall.
    def _paper_blocks(self, agent: int) -> str:
        """The agent's block lines: its palette, then the remove block."""
        data = paper_prompts()
        blocks = [*self.palettes[agent], *(b for b in data["extra_blocks"] if b not in self.palettes[agent])]
        return "\n".join(data["block_line"].format(block=b) for b in blocks)

    def _paper_first_turn(self, env: StrBuildEnv, agent: int) -> str:
        """Agent `agent`'s turn-1 text without the system part: the wall's bounding box (inclusive,
        [x, y, z] with no spaces) and its blocks, the remove block last."""
        data = paper_prompts()
        key = "single" if self.num_agents == 1 else f"agent{agent + 1}"
        return data["first_turn"][key].format(bbox_from="[0,0,0]", bbox_to=f"[{env.width - 1},{HEIGHT - 1},0]",
                                              blocks=self._paper_blocks(agent)).rstrip()

    def _paper_prompt(self, env: StrBuildEnv, agent: int) -> Message:
        """Turn 1: the agent's first-turn text as the user message, the system text as its system
        message (the reference's chat [system, user])."""
        return Message(self._paper_first_turn(env, agent), system=paper_prompts()["system"].rstrip())

    def _paper_followup(self, env: StrBuildEnv, agent: int, turn: int, previous: str) -> Message:
        """Turn `turn` (>= 2), sent raw (the reference skips the chat template): the system text, the
        letter positions (top row first, left to right), the first-turn text again and the agent's
        previous completion (left out when blank)."""
        data = paper_prompts()
        cells = sorted(env.target_cells(), key=lambda p: (-p[1], p[0], p[2]))
        limits = strbuild_reward_paper.command_caps(self.num_agents, int(data["max_commands_total"]))
        positions = ("\n".join(data["position_line"].format(x=x, y=y, z=z) for x, y, z in cells)
                     if cells else data["no_positions"])
        parts = [data["system"].rstrip(), "", data["followup"].format(
            turn=turn, target_count=max(1, len(cells) // 2) if cells else 0, max_commands=limits[agent],
            positions=positions, blocks=self._paper_blocks(agent)),
            "", self._paper_first_turn(env, agent)]
        if previous.strip():
            parts += ["", data["previous_commands"], previous.strip()]
        return Message("\n".join(parts).strip(), raw=True)

    def replay(self, problem: Problem, history: list[list[Turn]]) -> JointReward:
        """Build the target from scratch with every turn's joint action; the last turn's score
        (task.reward.variant=paper: the last turn's joint action alone, as the reference)."""
        if self.reward_variant == "paper":
            return self._paper_reward(problem, [turns[-1].action for turns in history])
        env = self.new_env(problem.data["target"])
        result = None
        for t in range(len(history[0])):
            if env.done:  # the episode ended earlier; later actions have no effect
                break
            for i, turns in enumerate(history):
                env.step(i, turns[t].action)
            result = env.end_turn()
        assert result is not None
        built, target = set(env.state), env.target_cells()
        iou = len(built & target) / len(built | target) if built | target else 0.0
        levels = {"coverage": result.coverage, "extra_ratio": result.extra_ratio,
                  "adjacency_ratio": result.adjacency_ratio, "absent_agents": float(result.absent_agents),
                  "iou": iou}
        return JointReward(result.reward, levels, info={"feedback": [env.feedback(i) for i in range(self.num_agents)]},
                           passed=result.success, done=result.success and self.end_on_success)

    def _paper_reward(self, problem: Problem, actions: list[str]) -> JointReward:
        """The reference's score of one joint action on an empty wall. Success (the project's
        criterion on the reference's coverage and extra ratio) ends the episode only with
        task.end_on_success; the feedback of `own` prompts shows that joint action alone."""
        env = self.new_env(problem.data["target"])
        s = strbuild_reward_paper.score(actions, self.palettes, env.target_cells(), env.width,
                                        int(paper_prompts()["max_commands_total"]))
        for i, action in enumerate(actions):
            env.step(i, action)
        env.end_turn()
        passed = s.coverage >= float(self.cfg.success_coverage) and s.extra_ratio <= float(self.cfg.success_max_extra)
        levels = {"coverage": s.coverage, "extra_ratio": s.extra_ratio, "adjacency_ratio": s.adjacency_ratio,
                  "incomplete_palettes": float(s.incomplete_palettes), "iou": s.iou}
        return JointReward(s.reward, levels, info={"feedback": [env.feedback(i) for i in range(self.num_agents)]},
                           passed=passed, done=passed and self.end_on_success)

    def history_rewards(self, problems: list[Problem], histories: list[list[list[Turn]]]) -> list[JointReward]:
        return [self.replay(p, h) for p, h in zip(problems, histories)]

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        """One turn from an empty wall."""
        return [self.replay(p, [[Turn("", a)] for a in actions]) for p, actions in zip(problems, joint_actions)]

    def next_prompts(self, problem: Problem, histories: list[list[Turn]], reward: JointReward) -> list[str]:
        if self.prompt_style == "paper":
            env = self.new_env(problem.data["target"])
            return [self._paper_followup(env, i, len(h) + 1, h[-1].action) for i, h in enumerate(histories)]
        return [self._prompt(problem, i, fb) for i, fb in enumerate(reward.info["feedback"])]
