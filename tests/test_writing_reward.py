"""The writing reward: every band and gate edge on hand-made texts, transitions on word boundaries."""

from __future__ import annotations

import math

import pytest

from marl_llm.tasks.writing_reward import (LEVEL_MAX, TRANSITIONS, WritingRewardSpec, band_score, jaccard,
                                           score_writing, transition_categories, transition_score)

TLDR = WritingRewardSpec()
ARXIV = WritingRewardSpec(words=(128, 256), length_ratio=(0.8, 1.3, 1.6, 2.0), vocabulary_ratio=(0.5, 0.7, 1.3, 1.7),
                          jaccard_cap=0.23, transitions_in="both")


def words_text(n: int, prefix: str = "w", width: int = 4) -> str:
    """n distinct words of equal length: prefix + zero-padded index."""
    return " ".join(f"{prefix}{i:0{width}d}" for i in range(n))


# ------------------------------------------------------------------------------------ bands
@pytest.mark.parametrize("x,expected", [
    (1.6, 1.0), (3.2, 1.0), (2.4, 1.0),          # full band, both edges inclusive
    (1.1, 0.0), (1.35, 0.5), (1.5999, 0.9998),   # [1.1, 1.6): linear 0 -> 1, 1.1 itself scores 0 but continues
    (4.1, 0.5), (5.0, 0.0),                      # (3.2, 5.0]: linear 1 -> 0
    (1.0999, None), (5.0001, None), (0.0, None), (math.inf, None),  # outside: stop
])
def test_tldr_length_band(x, expected):
    got = band_score(x, TLDR.length_ratio, 1.0)
    assert got == expected if expected is None else got == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("band,x,expected", [
    (TLDR.vocabulary_ratio, 2.0, 0.5), (TLDR.vocabulary_ratio, 50.0, 0.5), (TLDR.vocabulary_ratio, math.inf, 0.5),
    (TLDR.vocabulary_ratio, 1.65, 0.25), (TLDR.vocabulary_ratio, 1.3, 0.0), (TLDR.vocabulary_ratio, 1.2999, None),
    (ARXIV.length_ratio, 1.3, 1.0), (ARXIV.length_ratio, 1.05, 0.5), (ARXIV.length_ratio, 1.8, 0.5),
    (ARXIV.length_ratio, 0.79, None), (ARXIV.length_ratio, 2.01, None),
    (ARXIV.vocabulary_ratio, 0.6, 0.25), (ARXIV.vocabulary_ratio, 1.0, 0.5), (ARXIV.vocabulary_ratio, 1.5, 0.25),
    (ARXIV.vocabulary_ratio, 1.7, 0.0), (ARXIV.vocabulary_ratio, 1.71, None), (ARXIV.vocabulary_ratio, 0.49, None),
])
def test_vocabulary_and_arxiv_bands(band, x, expected):
    got = band_score(x, band, 0.5 if band in (TLDR.vocabulary_ratio, ARXIV.vocabulary_ratio) else 1.0)
    assert got == expected if expected is None else got == pytest.approx(expected, abs=1e-9)


# ------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("n1,n2,ok", [(8, 8, True), (7, 20, False), (20, 7, False), (256, 256, True),
                                      (8, 257, False)])
def test_structure_word_bounds_gate_everything(n1, n2, ok):
    r = score_writing(words_text(n1, "a"), words_text(n2, "b"), TLDR)
    assert r.levels["structure"] == (0.5 if ok else 0.0)
    if not ok:
        assert r.total == 0.0 and r.info["stopped_at"] == "structure"
        assert all(v == 0.0 for v in r.levels.values())
        # The ungated levels are still measured: (7, 20) words have a length ratio inside the band.
        assert r.ungated["length"] == (band_score(r.info["length_ratio"], TLDR.length_ratio, 1.0) or 0.0)
        assert (r.ungated["length"] == 1.0) == ((n1, n2) == (7, 20))


# ------------------------------------------------------------------------------- gating
def test_length_failure_stops_later_levels_but_ungated_keeps_them():
    one = words_text(10, "a")  # 10 words of 5 chars: 59 chars
    two = words_text(10, "b") + " however"  # ratio ~1.15 chars: inside the ramp, but vocabulary ratio 1.1 fails
    r = score_writing(one, one + " " + one, TLDR)  # identical words: ratio 2.0 chars, vocabulary ratio 1.0
    assert r.levels["length"] == 1.0 and r.levels["vocabulary"] == 0.0 and r.info["stopped_at"] == "vocabulary"
    assert r.total == pytest.approx(1.5) and r.levels["style"] == 0.0
    assert r.ungated["style"] == pytest.approx(0.6)  # J = 1 (identical content), T = 0 -> 0.6 * 1
    r2 = score_writing(one, two, TLDR)
    assert r2.info["stopped_at"] == "vocabulary" and r2.total == pytest.approx(0.5 + r2.levels["length"])


def test_full_reward_by_hand():
    one = "alpha beta gamma delta epsilon zeta eta theta"  # 8 unique words, 47 chars
    # 16 words, two shared (alpha, beta), transitions: however (contrast), for example (examples).
    two = ("however alpha beta for example iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi "
           "psi omega")
    r = score_writing(one, two, TLDR)
    ratio = len(two) / len(one)
    assert 1.6 <= ratio <= 3.2 and r.levels["length"] == 1.0
    u1, u2 = 8, len(set(two.split()))
    assert u2 / u1 >= 2.0 and r.levels["vocabulary"] == 0.5
    assert sorted(r.info["transition_categories"]) == ["contrast", "examples"]
    t = 0.4 + 0.05  # k = 2
    sw = {"however", "for"}  # stop words dropped from Jaccard
    s1 = set(one.split())
    s2 = set(two.split()) - sw
    j = min(len(s1 & s2) / len(s1 | s2), 0.03) / 0.03
    assert r.levels["style"] == pytest.approx(0.4 * t + 0.6 * j)
    assert r.total == pytest.approx(0.5 + 1.0 + 0.5 + 0.4 * t + 0.6 * j)
    assert r.total <= 3.0 and sum(LEVEL_MAX.values()) == 3.0


def test_arxiv_transitions_count_both_texts():
    one, two = words_text(130, "a") + " moreover", words_text(170, "b") + " because"
    tldr_style = score_writing(one, two, TLDR).info["transition_categories"]
    arxiv_style = score_writing(one, two, ARXIV).info["transition_categories"]
    assert tldr_style == ["cause-effect"] and sorted(arxiv_style) == ["cause-effect", "elaboration"]


# ----------------------------------------------------------------------------- transitions
@pytest.mark.parametrize("text", [
    "The cashier has a glass of different liquid",       # as, if inside words
    "Whatsoever the butterfly, the soft nowhere island",  # so, but, now inside words
    "Thenceforth the firstborn sinceer theorem",           # then, first, since inside words
])
def test_transitions_do_not_fire_inside_words(text):
    assert transition_categories(text) == []


@pytest.mark.parametrize("text,category", [
    ("so it went", "cause-effect"), ("It rained, e.g. all day", "examples"), ("For  instance, no", "examples"),
    ("HOWEVER, no", "contrast"), ("i.e. the point", "explanation"), ("in\nconclusion it ends", "summary"),
    ("only if it works", "condition"), ("(meanwhile) at home", "time"),
])
def test_transitions_fire_on_word_boundaries(text, category):
    assert category in transition_categories(text)


def test_transition_score_forms():
    assert transition_score(0) == 0.0 and transition_score(0, "log") == 0.0
    assert transition_score(1) == pytest.approx(0.4) and transition_score(1, "log") == pytest.approx(0.4)
    assert transition_score(3) == pytest.approx(0.5)
    assert transition_score(12) == pytest.approx(0.95) and transition_score(12, "log") == pytest.approx(1.0)
    assert transition_score(2, "log") == pytest.approx(0.4 + 0.6 * math.log(2) / math.log(12))
    with pytest.raises(ValueError, match="transition_form"):
        transition_score(2, "cubic")
    assert len(TRANSITIONS) == 12


def test_log_form_changes_the_style_level():
    one = words_text(10, "a")
    two = words_text(30, "b") + " however because first"
    lin = score_writing(one, two, TLDR)
    log = score_writing(one, two, WritingRewardSpec(transition_form="log"))
    assert lin.info["transition_score"] == pytest.approx(0.5)
    assert log.info["transition_score"] == pytest.approx(0.4 + 0.6 * math.log(3) / math.log(12))
    assert log.levels["style"] > lin.levels["style"]


def test_jaccard_ignores_stopwords_and_caps():
    assert jaccard("the cat and the dog", "a cat or a dog") == 1.0
    assert jaccard("the cat", "the dog") == 0.0
    r = score_writing(words_text(10, "a") + " shared", words_text(40, "b") + " shared", TLDR)
    assert r.info["jaccard"] == pytest.approx(1 / 51)
    assert r.ungated["style"] == pytest.approx(0.6 * (1 / 51) / 0.03)


def test_empty_first_text_is_structure_failure_not_a_crash():
    r = score_writing("", words_text(20), TLDR)
    assert r.total == 0.0 and r.info["stopped_at"] == "structure"
