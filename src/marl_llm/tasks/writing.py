"""Writing tasks with two cooperating agents, one turn, scored by `writing_reward` (max 3.0).

- `task=tldr`: a Reddit post (trl-lib/tldr, field `prompt`). Agent `concise` writes a short
  factual summary; agent `detailed` a longer one with more unique words and transition words.
- `task=arxiv`: an abstract (OpenMLRL/arXiv_abstract, field `abstract_text`). Agent `background`
  writes introduction content on background and motivation; agent `methods` on methodology and
  implications; each is told what the other covers.

Reward: `task.reward.variant` picks the function. `fixed` (default): `writing_reward`, the
re-authored reward, on the stripped texts. `paper`: `writing_reward_paper`, the reference
trainer's reward reproduced exactly, on the texts as generated (the reference does not strip);
it takes its bands and lists from its data file and ignores the other `task.reward` fields.
See docs/rewards_writing.md.

Prompts: `task.prompts` picks the agents' wording. `own` (default): the role texts below.
`paper`: the reference trainers' per-agent prompts, byte for byte: the templates in
writing_prompts_paper.json filled with the row's `text_field` value as is (no stripping, a
trailing "TL;DR:" kept; a missing or empty value gives the reference's error prompt). The
single-agent baseline keeps its own prompt either way.

Data: `task.data` (see marl_llm.tasks.data); the offline samples were written for this project.
The single-agent baseline (`algo=single`) writes both parts in one answer, separated by the
line SINGLE_SEPARATOR; a missing separator leaves part 2 empty (structure fails: reward 0).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, ClassVar, List, Optional

from omegaconf import MISSING

from marl_llm.config import DataConfig, check_choice, check_value
from marl_llm.tasks.base import JointReward, Problem, Task, register_task
from marl_llm.tasks.writing_reward import WritingRewardSpec, score_writing
from marl_llm.tasks.writing_reward_paper import PaperRewardSpec, score_writing_paper

SINGLE_SEPARATOR = "[PART 2]"
_PART1 = re.compile(r"^\s*\[PART 1\]\s*", re.IGNORECASE)


@lru_cache(maxsize=None)
def paper_prompt_data() -> dict[str, Any]:
    """writing_prompts_paper.json: the reference's prompt templates (see its `_about`)."""
    text = resources.files("marl_llm.tasks").joinpath("writing_prompts_paper.json").read_text(encoding="utf-8")
    return json.loads(text)


@dataclass(frozen=True)
class PaperPrompts:
    """The reference's prompts of one writing task: one template per agent around the row's text."""

    field: str
    if_empty: str
    # (before, after) of each agent's template: the prompt is before + text + after.
    parts: tuple[tuple[str, str], ...]

    @classmethod
    def for_task(cls, task: str) -> "PaperPrompts":
        data = paper_prompt_data()
        spec, mark = data["tasks"][task], data["placeholder"]
        parts = []
        for template in spec["agents"]:
            before, sep, after = template.partition(mark)
            if not sep or mark in after:
                raise ValueError(f"writing_prompts_paper.json: a {task} template must hold {mark} exactly once")
            parts.append((before, after))
        return cls(field=spec["field"], if_empty=spec["if_empty"], parts=tuple(parts))

    def render(self, row: dict[str, Any], field: str | None = None) -> list[str]:
        """Every agent's prompt for a data row, reading `field` (default: the reference's field)."""
        value = row.get(field or self.field, "")
        if not value:  # missing, None, empty: the reference answers with a fixed prompt
            return [self.if_empty for _ in self.parts]
        text = format(value, "")  # what an f-string inserts
        return [before + text + after for before, after in self.parts]


class WritingTask(Task):
    """Two writers, one turn. Subclasses set the agent names and the three prompt texts."""

    # Role instructions of agent 1 and agent 2, and of the single agent doing both.
    roles: ClassVar[tuple[str, str]] = ("", "")
    single_role: ClassVar[str] = ""
    source_label: ClassVar[str] = "text"
    # Which reference reward `variant=paper` reproduces (tldr | arxiv).
    paper_task: ClassVar[str] = ""
    max_turns = 1

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.required_fields = (str(cfg.text_field),)
        self.spec = WritingRewardSpec.from_cfg(cfg.reward)
        self.reward_variant = str(getattr(cfg.reward, "variant", "fixed"))
        if self.reward_variant not in ("paper", "fixed"):
            raise ValueError(f"task.reward.variant={self.reward_variant!r}: expected paper or fixed")
        self.paper_spec = PaperRewardSpec.for_task(self.paper_task) if self.reward_variant == "paper" else None
        self.prompt_variant = str(getattr(cfg, "prompts", "own"))
        if self.prompt_variant not in ("paper", "own"):
            raise ValueError(f"task.prompts={self.prompt_variant!r}: expected paper or own")
        self.paper_prompts = PaperPrompts.for_task(self.paper_task) if self.prompt_variant == "paper" else None

    def score(self, text1: str, text2: str) -> JointReward:
        """The joint reward of one pair of generated texts under `task.reward.variant`."""
        if self.paper_spec is not None:
            return score_writing_paper(text1, text2, self.paper_spec)
        return score_writing(text1.strip(), text2.strip(), self.spec)

    def source_text(self, problem: Problem) -> str:
        return str(problem.data[self.cfg.text_field]).strip()

    def _prompt(self, problem: Problem, instruction: str) -> str:
        return f"{instruction}\n\n{self.source_label}:\n{self.source_text(problem)}"

    def initial_prompts(self, problem: Problem) -> list[str]:
        if self.paper_prompts is not None:
            return self.paper_prompts.render(problem.data, str(self.cfg.text_field))
        return [self._prompt(problem, role) for role in self.roles]

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        if len(problems) != len(joint_actions):
            raise ValueError(f"{len(problems)} problems but {len(joint_actions)} joint actions")
        out = []
        for actions in joint_actions:
            if len(actions) != 2:
                raise ValueError(f"expected 2 actions ({', '.join(self.agent_names)}), got {len(actions)}")
            out.append(self.score(actions[0], actions[1]))
        return out

    # -- the single-agent baseline ---------------------------------------------------------------
    def single_prompt(self, problem: Problem) -> str:
        return self._prompt(problem, self.single_role)

    def split_single(self, text: str) -> list[str]:
        head, sep, tail = text.partition(SINGLE_SEPARATOR)
        return [_PART1.sub("", head).strip(), tail.strip() if sep else ""]


@dataclass
class WritingRewardConfig:
    """Gated writing reward (marl_llm.tasks.writing_reward). A band [ramp_lo, lo, hi, ramp_hi]
    scores full credit in [lo, hi], rises linearly over [ramp_lo, lo), falls over (hi, ramp_hi],
    and stops the accumulation outside [ramp_lo, ramp_hi]; null bounds are unbounded."""

    # Both outputs must have this many words (inclusive), else the total is 0.
    words: List[int] = field(default_factory=lambda: [8, 256])
    # chars(agent 2) / chars(agent 1).
    length_ratio: List[Optional[float]] = field(default_factory=lambda: [1.1, 1.6, 3.2, 5.0])
    # unique lowercased words(agent 2) / unique words(agent 1).
    vocabulary_ratio: List[Optional[float]] = field(default_factory=lambda: [1.3, 2.0, None, None])
    # Jaccard similarity of the two outputs' non-stopword sets, credited up to this cap.
    jaccard_cap: float = 0.03
    # Which text the transition words are counted in: second (agent 2) | both (agent 1 + 2).
    transitions_in: str = "second"
    # Transition term T over k categories found: linear (the reference code, 0.4 + 0.05 (k-1)) |
    # log (the papers' text, 0.4 + 0.6 ln k / ln 12).
    transition_form: str = "linear"
    # fixed: the reward above (marl_llm.tasks.writing_reward) | paper: the reference trainer's
    # reward reproduced exactly (marl_llm.tasks.writing_reward_paper; its own bands and lists, the
    # fields above are ignored). Differences: docs/rewards_writing.md.
    variant: str = "fixed"


@dataclass
class WritingTaskConfig:
    name: str = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    # The row field holding the source text (trl-lib/tldr: prompt; arXiv_abstract: abstract_text).
    text_field: str = MISSING
    reward: WritingRewardConfig = field(default_factory=WritingRewardConfig)
    # Training reward = task reward + shift (the writing papers train on the unshifted [0, 3]).
    reward_shift: float = 0.0
    # Prompt wording: own (marl-llm's prompts) | paper (the reference trainers' per-agent formatters,
    # byte for byte; docs/rewards_writing.md, "Prompts").
    prompts: str = "own"

    @staticmethod
    def check(cfg: Any) -> None:
        r = cfg.task.reward
        check_choice(cfg, "task.prompts", ("paper", "own"))
        check_choice(cfg, "task.reward.variant", ("paper", "fixed"))
        check_choice(cfg, "task.reward.transitions_in", ("second", "both"))
        check_choice(cfg, "task.reward.transition_form", ("linear", "log"))
        check_value(len(r.words) == 2 and 0 <= r.words[0] <= r.words[1], "task.reward.words",
                    "must be [min, max] with min <= max")
        for key in ("length_ratio", "vocabulary_ratio"):
            band = [float("inf") if v is None else v for v in r[key]]
            check_value(len(band) == 4 and all(x <= y for x, y in zip(band, band[1:])), f"task.reward.{key}",
                        f"{list(r[key])} must be 4 non-decreasing bounds [ramp_lo, lo, hi, ramp_hi] (null: unbounded)")
        check_value(r.jaccard_cap > 0, "task.reward.jaccard_cap", "must be > 0")


@register_task("tldr", schema=WritingTaskConfig)
class TLDRTask(WritingTask):
    agent_names = ("concise", "detailed")
    source_label = "Reddit post"
    paper_task = "tldr"
    roles = (
        "Write a concise summary of the Reddit post below: one or a few sentences stating only the key facts. "
        "Another writer produces a longer, detailed summary. Output only your summary.",
        "Write a detailed summary of the Reddit post below. Use a rich vocabulary with many different words and "
        "connect the ideas with transition words (for example, however, therefore, in addition). Another writer "
        "produces a one-sentence summary; yours should be clearly longer. Output only your summary.",
    )
    single_role = (
        "Write two summaries of the Reddit post below. First a concise summary: one or a few sentences with "
        f"only the key facts. Then a line containing only {SINGLE_SEPARATOR}, then a detailed, clearly longer "
        "summary with a rich vocabulary and transition words (for example, however, therefore). Output only the "
        "two summaries."
    )

    def source_text(self, problem: Problem) -> str:
        # trl-lib/tldr prompts end with "TL;DR:" (a completion cue for base models): drop it.
        return re.sub(r"\s*TL;DR:\s*$", "", super().source_text(problem))


@register_task("arxiv", schema=WritingTaskConfig)
class ArxivTask(WritingTask):
    agent_names = ("background", "methods")
    source_label = "Abstract"
    paper_task = "arxiv"
    roles = (
        "Based on the abstract below, write the introduction's content on the background and motivation of the "
        "work (150-250 words). Another writer covers the methodology and implications: do not repeat them. "
        "Output only your paragraph.",
        "Based on the abstract below, write the introduction's content on the methodology and the implications "
        "of the work (150-250 words). Another writer covers the background and motivation: do not repeat them. "
        "Output only your paragraph.",
    )
    single_role = (
        "Based on the abstract below, write an introduction in two parts. First a paragraph on the background "
        f"and motivation (150-250 words), then a line containing only {SINGLE_SEPARATOR}, then a paragraph on the "
        "methodology and implications (150-250 words). Output only the two paragraphs."
    )
