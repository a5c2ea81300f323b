"""The writing reward as the reference trainer computes it (`task.reward.variant=paper`), max 3.0.

Reference: OpenMLRL/LLM_Collab_Writing at commit 7e59995e20251de8819bdf2a57d8296193cb2b03,
`rewards/tldr_rewards.py` (tldr_combined_reward) and `rewards/arxiv_rewards.py`
(arxiv_combined_reward), the functions its `train_magrpo.py` hands to the MAGRPO trainer. That
trainer passes the two decoded completions as they are (not stripped) and applies scale 1.0 and
shift 0.0 (its configs), so the training reward is the function's value. This module is written
for this project; the word lists, bands and caps are data in `writing_reward_paper.json`.

The reference returns one float per pair; its four gated levels map one to one onto this
project's levels (same names and maxima as `writing_reward`):

1. structure (0.5): both texts have words[0]..words[1] whitespace-separated tokens, else stop.
2. length (1.0): r = len(text 2) / len(text 1) in characters, *unstripped*; len(text 1) = 0
   stops. Band [ramp_lo, lo, hi, ramp_hi]: full on [lo, hi], (r - ramp_lo) / (lo - ramp_lo) on
   [ramp_lo, lo), 1 - (r - hi) / (ramp_hi - hi) on (hi, ramp_hi], stop elsewhere. A ramp edge
   scores 0 but does not stop.
3. vocabulary (0.5): r = unique words(text 2) / unique words(text 1), words being `\\w+` runs
   (Unicode) of the lowercased text, stopwords *included*; no words in text 1 stops. Same band
   rule, times 0.5 (TLDR's band is open above: r >= 2.0 is full credit).
4. style (1.0): 0.4 T + 0.6 J. T = 0 with no category, else min(1, 0.4 + min(0.05 (k - 1), 0.6))
   for k of the 12 categories with a phrase occurring as a raw substring of the lowercased text
   (TLDR: text 2; arXiv: text 1 + text 2 concatenated without a separator, so a phrase may span
   the join). J = min(Jaccard, cap) / cap over the non-stopword word sets; two empty sets give
   Jaccard 1.0.

Arithmetic follows the reference's order of operations, so totals match it bit for bit (the
fixture test checks every pair). `ungated` gives each level as if the earlier ones had passed
(a level that cannot be measured, e.g. no words in text 1, counts 0 there).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Sequence

from marl_llm.tasks.base import JointReward

DATA_FILE = "writing_reward_paper.json"
_WORD = re.compile(r"\w+")


@lru_cache(maxsize=1)
def paper_data() -> dict:
    """The reference's lists, bands and weights (writing_reward_paper.json, shipped in the package)."""
    return json.loads(resources.files("marl_llm.tasks").joinpath(DATA_FILE).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class PaperRewardSpec:
    """One task's parameters from the data file (task = tldr | arxiv)."""

    task: str
    words: tuple[int, int]
    length_ratio: tuple[float | None, ...]
    vocabulary_ratio: tuple[float | None, ...]
    jaccard_cap: float
    transitions_in: str  # "second" | "first+second"

    @classmethod
    def for_task(cls, task: str) -> "PaperRewardSpec":
        tasks = paper_data()["tasks"]
        if task not in tasks:
            raise ValueError(f"the paper writing reward exists for {sorted(tasks)}, not {task!r}")
        t = tasks[task]
        return cls(task=task, words=tuple(t["words"]), length_ratio=tuple(t["length_ratio"]),
                   vocabulary_ratio=tuple(t["vocabulary_ratio"]), jaccard_cap=float(t["jaccard_cap"]),
                   transitions_in=str(t["transitions_in"]))


@lru_cache(maxsize=1)
def stopwords() -> frozenset[str]:
    return frozenset(paper_data()["stopwords"])


@lru_cache(maxsize=1)
def transitions() -> dict[str, tuple[str, ...]]:
    return {cat: tuple(phrases) for cat, phrases in paper_data()["transitions"].items()}


def word_list(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def token_count(text: str) -> int:
    return len(text.split())


def unique_word_count(text: str) -> int:
    """Distinct lowercased words, stopwords included (the reference's vocabulary measure)."""
    return len(set(word_list(text)))


def content_words(text: str) -> set[str]:
    sw = stopwords()
    return {w for w in word_list(text) if w not in sw}


def jaccard(text1: str, text2: str) -> float:
    a, b = content_words(text1), content_words(text2)
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def transition_categories(text: str) -> list[str]:
    """Categories (data-file order) with a phrase anywhere in the lowercased text, inside words too."""
    low = text.lower()
    return [cat for cat, phrases in transitions().items() if any(p in low for p in phrases)]


def transition_score(k: int) -> float:
    s = paper_data()["style"]
    if k <= 0:
        return 0.0
    return min(s["transition_base"] + min((k - 1) * s["transition_step"], s["transition_step_cap"]), 1.0)


def band_credit(r: float, band: Sequence[float | None], full: float) -> float | None:
    """Credit of ratio r in [ramp_lo, lo, hi, ramp_hi], written as the reference computes it; None: stop."""
    ramp_lo, lo, hi, ramp_hi = band
    if lo <= r and (hi is None or r <= hi):
        return full
    if ramp_lo <= r < lo:
        return full * ((r - ramp_lo) / (lo - ramp_lo))
    if hi is not None and ramp_hi is not None and hi < r <= ramp_hi:
        return full * (1.0 - ((r - hi) / (ramp_hi - hi)))
    return None


def score_writing_paper(text1: str, text2: str, spec: PaperRewardSpec) -> JointReward:
    """The reference's joint reward of agent 1's `text1` and agent 2's `text2` (see the docstring).

    Pass the texts as generated (unstripped): leading/trailing whitespace counts in the length ratio.
    """
    lm = paper_data()["level_max"]
    n1, n2 = token_count(text1), token_count(text2)
    lo_w, hi_w = spec.words
    structure = lm["structure"] if (lo_w <= n1 <= hi_w and lo_w <= n2 <= hi_w) else None

    len1, len2 = len(text1), len(text2)
    length_ratio = len2 / len1 if len1 > 0 else None
    length = None if length_ratio is None else band_credit(length_ratio, spec.length_ratio, lm["length"])

    u1, u2 = unique_word_count(text1), unique_word_count(text2)
    vocab_ratio = u2 / u1 if u1 > 0 else 0.0
    vocabulary = band_credit(vocab_ratio, spec.vocabulary_ratio, lm["vocabulary"]) if u1 > 0 else None

    style_text = text2 if spec.transitions_in == "second" else text1 + text2
    cats = transition_categories(style_text)
    t_score = transition_score(len(cats))
    jac = jaccard(text1, text2)
    j_score = min(jac, spec.jaccard_cap) / spec.jaccard_cap
    w = paper_data()["style"]
    style = w["transition_weight"] * t_score + w["jaccard_weight"] * j_score

    gated = (("structure", structure), ("length", length), ("vocabulary", vocabulary), ("style", style))
    levels = dict.fromkeys(lm, 0.0)
    stopped_at = None
    total = 0.0
    for name, value in gated:
        if value is None:
            stopped_at = name
            break
        levels[name] = value
        total += value
    ungated = {name: value or 0.0 for name, value in gated}
    info = {"words": (n1, n2), "length_ratio": length_ratio, "vocabulary_ratio": vocab_ratio,
            "transition_categories": cats, "transition_score": t_score, "jaccard": jac, "stopped_at": stopped_at,
            "variant": "paper"}
    return JointReward(total=total, levels=levels, info=info, ungated=ungated)
