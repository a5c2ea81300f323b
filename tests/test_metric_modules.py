"""The task metrics as `evaluate` modules, loaded offline from the installed package."""

from __future__ import annotations

import evaluate
import pytest

from marl_llm import metrics
from marl_llm.tasks.writing_reward import WritingRewardSpec, score_writing

SHORT = "The cat sat on the mat and then slept all day long."
LONG = ("The cat, however, sat on the warm mat in the sun; therefore it slept for the whole long afternoon, and "
        "furthermore it dreamed of fish and birds outside the window.")


def test_writing_reward_module_matches_the_training_reward():
    module = metrics.load("writing_reward", "tldr")
    out = module.compute(first=[SHORT, SHORT], second=[LONG, SHORT])
    expected = [score_writing(SHORT, LONG, WritingRewardSpec()), score_writing(SHORT, SHORT, WritingRewardSpec())]
    assert out["rewards"] == pytest.approx([r.total for r in expected])
    assert out["reward"] == pytest.approx(sum(r.total for r in expected) / 2)
    assert out["length"] == pytest.approx(sum(r.levels["length"] for r in expected) / 2)
    assert out["style_ungated"] == pytest.approx(sum(r.ungated["style"] for r in expected) / 2)
    assert out["rewards"][0] > out["rewards"][1]  # identical texts fail the length band


def test_writing_reward_module_arxiv_bands_and_log_form():
    module = evaluate.load(metrics.path("writing_reward"), "arxiv")
    out = module.compute(first=[SHORT], second=[LONG])
    assert out["reward"] == 0.0 and out["structure"] == 0.0  # arXiv needs 128-256 words
    lin = metrics.load("writing_reward").compute(first=[SHORT], second=[LONG])
    log = metrics.load("writing_reward").compute(first=[SHORT], second=[LONG], transition_form="log")
    assert log["style_ungated"] != lin["style_ungated"]


def test_writing_reward_module_paper_variant_is_the_reference_reward():
    """variant=paper scores as task.reward.variant=paper does (the reference trainers' reward,
    fixture-checked in test_writing_reward_paper.py), unstripped; it differs from fixed here."""
    from marl_llm.tasks.writing_reward_paper import PaperRewardSpec, score_writing_paper

    for task in ("tldr", "arxiv"):
        module = metrics.load("writing_reward", task)
        first, second = [SHORT, " " + SHORT], [LONG, LONG + "  "]
        out = module.compute(first=first, second=second, variant="paper")
        expected = [score_writing_paper(a, b, PaperRewardSpec.for_task(task)) for a, b in zip(first, second)]
        assert out["rewards"] == [r.total for r in expected]
        assert out["style_ungated"] == pytest.approx(sum(r.ungated["style"] for r in expected) / 2)
    tldr = metrics.load("writing_reward", "tldr")
    assert tldr.compute(first=[SHORT], second=[LONG], variant="paper")["rewards"] != \
        tldr.compute(first=[SHORT], second=[LONG])["rewards"]
    with pytest.raises(ValueError, match="variant='own'"):
        tldr.compute(first=[SHORT], second=[LONG], variant="own")


def test_pass_at_k_module_runs_programs_in_the_sandbox():
    module = metrics.load("pass_at_k")
    good, bad = "def f(x):\n    return x + 1\n", "def f(x):\n    return x\n"
    hostile = "import sys\ndef f(x):\n    sys.exit(0)\n"
    test = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(5) == 6\n"
    out = module.compute(predictions=[[good, bad], [bad, hostile]], references=[test, test], entry_points=["f", "f"],
                         k=[1, 2])
    assert out["passed"] == [[True, False], [False, False]]
    assert out["pass@1"] == pytest.approx((0.5 + 0.0) / 2) and out["pass@2"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="entry_points"):
        module.compute(predictions=[[good]], references=[test])


def test_unknown_metric_lists_the_available_ones():
    with pytest.raises(ValueError, match="writing_reward, pass_at_k"):
        metrics.path("bleu")
