"""Joint reward of two cooperating writers (TLDR summarization, arXiv expansion), max 3.0.

Gated levels: a failed level stops the accumulation (later levels stay 0 in `levels`); every
level is also computed *ungated* (as if all earlier levels passed) for diagnostics.

1. structure (0.5): both outputs have words[0]..words[1] words (whitespace-separated), else 0.
2. length (1.0): r = chars(text 2) / chars(text 1) scored by the band `length_ratio`.
3. vocabulary (0.5): r = unique words(text 2) / unique words(text 1) by `vocabulary_ratio`.
4. style (1.0): 0.4 * T + 0.6 * J.
   T, transition words: k = number of the 12 categories below found in text 2 (or in both
   texts, `transitions_in: both`); T = 0 if k = 0, else min(1, 0.4 + min(0.05 (k - 1), 0.6))
   (`transition_form: linear`, the reference code) or min(1, 0.4 + 0.6 ln k / ln 12) (`log`,
   the papers' description: grows with the log of the category count, 1.0 at all 12).
   J, shared content: min(Jaccard(non-stopword word sets of the two texts), cap) / cap.

A band [ramp_lo, lo, hi, ramp_hi] gives full credit in [lo, hi], rises linearly from 0 at
ramp_lo to full at lo, falls linearly from full at hi to 0 at ramp_hi, and stops outside
[ramp_lo, ramp_hi]; a None bound is unbounded (e.g. vocabulary >= 2.0 → full credit).

Transition phrases match on word boundaries, case-insensitively: the reference implementation
matches raw substrings, so "so" fires inside "also", "as" inside "has", "if" inside "different".
Words for uniqueness and Jaccard are lowercased runs of letters, digits and apostrophes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from marl_llm.tasks.base import JointReward

LEVEL_MAX = {"structure": 0.5, "length": 1.0, "vocabulary": 0.5, "style": 1.0}
MAX_REWARD = sum(LEVEL_MAX.values())  # 3.0

TRANSITIONS: dict[str, tuple[str, ...]] = {
    "elaboration": ("furthermore", "moreover", "in addition", "additionally", "also", "besides", "what is more",
                    "further"),
    "examples": ("for example", "for instance", "such as", "e.g.", "to illustrate", "namely", "including"),
    "explanation": ("in other words", "that is", "i.e.", "specifically", "this means", "to clarify", "put simply"),
    "cause-effect": ("because", "therefore", "thus", "as a result", "consequently", "hence", "so", "due to",
                     "since", "accordingly"),
    "contrast": ("however", "but", "on the other hand", "nevertheless", "nonetheless", "whereas", "yet",
                 "instead", "in contrast", "conversely"),
    "sequence": ("first", "firstly", "second", "secondly", "third", "then", "next", "finally", "lastly",
                 "subsequently"),
    "emphasis": ("indeed", "in fact", "especially", "particularly", "notably", "above all", "importantly",
                 "clearly", "significantly"),
    "summary": ("in summary", "in conclusion", "overall", "to sum up", "in short", "in brief", "ultimately",
                "to summarize"),
    "comparison": ("similarly", "likewise", "in the same way", "compared to", "compared with", "just as",
                   "equally", "by comparison"),
    "concession": ("although", "though", "even though", "despite", "in spite of", "admittedly", "granted",
                   "even so", "of course"),
    "condition": ("if", "unless", "provided that", "as long as", "in case", "otherwise", "only if"),
    "time": ("meanwhile", "afterwards", "before", "after", "during", "later", "eventually", "when", "while",
             "until", "now", "currently"),
}

STOPWORDS = frozenset("""
a about above after again against all am an and any are aren't as at be because been before being below
between both but by can can't cannot could couldn't did didn't do does doesn't doing don't down during
each few for from further had hadn't has hasn't have haven't having he he'd he'll he's her here here's
hers herself him himself his how how's i i'd i'll i'm i've if in into is isn't it it's its itself let's
me more most mustn't my myself no nor not of off on once only or other ought our ours ourselves out over
own same shan't she she'd she'll she's should shouldn't so some such than that that's the their theirs
them themselves then there there's these they they'd they'll they're they've this those through to too
under until up very was wasn't we we'd we'll we're we've were weren't what what's when when's where
where's which while who who's whom why why's with won't would wouldn't you you'd you'll you're you've
your yours yourself yourselves also just will s t
""".split())

_WORD = re.compile(r"[a-z0-9']+")


def _phrase_pattern(phrase: str) -> re.Pattern[str]:
    # Word boundaries that also work for phrases ending in punctuation ("e.g."): no word
    # character may touch the phrase on either side; inner spaces match any whitespace.
    body = r"\s+".join(re.escape(part) for part in phrase.split())
    return re.compile(rf"(?<![\w]){body}(?![\w])", re.IGNORECASE)


_CATEGORY_PATTERNS = {cat: [_phrase_pattern(p) for p in phrases] for cat, phrases in TRANSITIONS.items()}


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def transition_categories(text: str) -> list[str]:
    """The transition categories with at least one phrase in `text` (word-boundary matches)."""
    return [cat for cat, pats in _CATEGORY_PATTERNS.items() if any(p.search(text) for p in pats)]


def transition_score(k: int, form: str = "linear") -> float:
    if k <= 0:
        return 0.0
    if form == "linear":
        return min(1.0, 0.4 + min(0.05 * (k - 1), 0.6))
    if form == "log":
        return min(1.0, 0.4 + 0.6 * math.log(k) / math.log(len(TRANSITIONS)))
    raise ValueError(f"transition_form={form!r}: expected linear or log")


def jaccard(a: str, b: str) -> float:
    sa = {w for w in words(a) if w not in STOPWORDS}
    sb = {w for w in words(b) if w not in STOPWORDS}
    union = sa | sb
    return len(sa & sb) / len(union) if union else 0.0


def band_score(x: float, band: Sequence[float | None], full: float) -> float | None:
    """Credit of `x` in band [ramp_lo, lo, hi, ramp_hi] (see the module docstring); None: stop."""
    ramp_lo, lo = (-math.inf if v is None else float(v) for v in band[:2])
    hi, ramp_hi = (math.inf if v is None else float(v) for v in band[2:])
    if lo <= x <= hi:
        return full
    if ramp_lo <= x < lo:
        return full * (x - ramp_lo) / (lo - ramp_lo)
    if hi < x <= ramp_hi:
        return full * (ramp_hi - x) / (ramp_hi - hi)
    return None


@dataclass
class WritingRewardSpec:
    """Bands and caps (task.reward in the task YAML; the defaults are TLDR's)."""

    words: tuple[int, int] = (8, 256)
    length_ratio: tuple[float | None, ...] = (1.1, 1.6, 3.2, 5.0)
    vocabulary_ratio: tuple[float | None, ...] = (1.3, 2.0, None, None)
    jaccard_cap: float = 0.03
    transitions_in: str = "second"
    transition_form: str = "linear"

    @classmethod
    def from_cfg(cls, cfg: Any) -> "WritingRewardSpec":
        return cls(words=tuple(cfg.words), length_ratio=tuple(cfg.length_ratio),
                   vocabulary_ratio=tuple(cfg.vocabulary_ratio), jaccard_cap=float(cfg.jaccard_cap),
                   transitions_in=str(cfg.transitions_in), transition_form=str(cfg.transition_form))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else 0.0)


def score_writing(text1: str, text2: str, spec: WritingRewardSpec) -> JointReward:
    """The joint reward of agent 1's `text1` and agent 2's `text2` (see the module docstring).

    levels: gated credit per level (summing to total); ungated: every level's credit as if the
    earlier levels had passed; info: the measured quantities (word counts, ratios, categories).
    """
    n1, n2 = len(text1.split()), len(text2.split())
    lo_words, hi_words = spec.words
    structure = LEVEL_MAX["structure"] if (lo_words <= n1 <= hi_words and lo_words <= n2 <= hi_words) else None

    length_ratio = _ratio(len(text2.strip()), len(text1.strip()))
    length = band_score(length_ratio, spec.length_ratio, LEVEL_MAX["length"])

    u1, u2 = len(set(words(text1))), len(set(words(text2)))
    vocab_ratio = _ratio(u2, u1)
    vocabulary = band_score(vocab_ratio, spec.vocabulary_ratio, LEVEL_MAX["vocabulary"])

    cats = transition_categories(text2 if spec.transitions_in == "second" else f"{text1}\n{text2}")
    t_score = transition_score(len(cats), spec.transition_form)
    jac = jaccard(text1, text2)
    j_score = min(jac, spec.jaccard_cap) / spec.jaccard_cap
    style = LEVEL_MAX["style"] * (0.4 * t_score + 0.6 * j_score)

    ungated = {"structure": structure or 0.0, "length": length or 0.0, "vocabulary": vocabulary or 0.0,
               "style": style}
    levels = dict.fromkeys(LEVEL_MAX, 0.0)
    stopped_at = None
    for name, value in (("structure", structure), ("length", length), ("vocabulary", vocabulary), ("style", style)):
        if value is None:
            stopped_at = name
            break
        levels[name] = value
    info = {"words": (n1, n2), "length_ratio": length_ratio, "vocabulary_ratio": vocab_ratio,
            "transition_categories": cats, "transition_score": t_score, "jaccard": jac, "stopped_at": stopped_at}
    return JointReward(total=sum(levels.values()), levels=levels, info=info, ungated=ungated)
