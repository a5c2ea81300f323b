"""task.reward.variant=paper against the reference writing rewards' own outputs.

The fixtures hold >= 1040 crafted pairs per task with the reward the reference code
(OpenMLRL/LLM_Collab_Writing, rewards/{tldr,arxiv}_rewards.py) returned for each, written by
scripts/reference_fixtures/writing_rewards.py (see docs/rewards_writing.md).
"""

from __future__ import annotations

import gzip
import json
import sys
from functools import lru_cache

import pytest

from conftest import REPO, compose_config
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.tasks import build_task
from marl_llm.tasks.writing_reward_paper import (PaperRewardSpec, paper_data, score_writing_paper,
                                                 transition_categories)

TASKS = ("tldr", "arxiv")
LEVELS = ("structure", "length", "vocabulary", "style")
TOL = 1e-9


@lru_cache(maxsize=None)
def fixture(task: str) -> tuple[dict, list[dict]]:
    path = REPO / "tests" / "fixtures" / f"writing_reward_paper_{task}.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return lines[0]["meta"], lines[1:]


def task_for(task: str, variant: str | None):
    overrides = [f"task={task}", "run_dir=/tmp/x"] + ([f"task.reward.variant={variant}"] if variant else [])
    cfg = compose_config(overrides)
    validate(cfg)
    return build_task(cfg.task)


@lru_cache(maxsize=None)
def fixed_totals(task: str) -> tuple[float, ...]:
    """The default (`fixed`) task reward of every fixture pair (cached: the slowest step here)."""
    _, rows = fixture(task)
    fixed = task_for(task, None)
    assert fixed.reward_variant == "fixed" and fixed.paper_spec is None
    return tuple(j.total for j in fixed.joint_rewards([None] * len(rows), [[r["text1"], r["text2"]] for r in rows]))


def reached_level(stopped_at: str | None) -> int:
    return 4 if stopped_at is None else LEVELS.index(stopped_at) + 1


@pytest.mark.parametrize("task", TASKS)
def test_fixtures_come_from_the_reference_commit_and_are_broad(task):
    meta, rows = fixture(task)
    assert meta["commit"] == paper_data()["reference"]["commit"]
    assert len(rows) >= 1040 and meta["pairs"] == len(rows)
    kinds = {r["kind"] for r in rows}
    assert {"word_gate", "length_edge", "vocabulary_edge", "transitions", "substring_hit", "whitespace",
            "contractions_unicode", "empty", "identical", "stopwords_only"} <= kinds
    assert sum(r["reached"] == 4 for r in rows) >= 500  # most pairs exercise the style level


@pytest.mark.parametrize("task", TASKS)
def test_paper_matches_the_reference_on_every_pair(task):
    _, rows = fixture(task)
    spec = PaperRewardSpec.for_task(task)
    bad = []
    for i, r in enumerate(rows):
        got = score_writing_paper(r["text1"], r["text2"], spec)
        if not (abs(got.total - r["reward"]) <= TOL and reached_level(got.info["stopped_at"]) == r["reached"]):
            bad.append((i, r["kind"], got.total, r["reward"], got.info["stopped_at"], r["reached"]))
        assert abs(sum(got.levels.values()) - got.total) <= TOL
    assert not bad, f"{len(bad)}/{len(rows)} pairs differ, e.g. {bad[:5]}"


@pytest.mark.parametrize("task", TASKS)
def test_variant_switch_reaches_the_right_function(task):
    """Through the composed config: `paper` scores the raw texts like the reference on every pair;
    the default stays `fixed` (and differs somewhere); an unknown variant is rejected."""
    _, rows = fixture(task)
    paper = task_for(task, "paper")
    assert paper.reward_variant == "paper" and paper.paper_spec == PaperRewardSpec.for_task(task)
    actions = [[r["text1"], r["text2"]] for r in rows]
    problems = [None] * len(rows)
    paper_totals = [j.total for j in paper.joint_rewards(problems, actions)]
    assert all(abs(p - r["reward"]) <= TOL for p, r in zip(paper_totals, rows))
    assert any(abs(f - r["reward"]) > TOL for f, r in zip(fixed_totals(task), rows))
    with pytest.raises(UserError, match="task.reward.variant"):
        validate(compose_config([f"task={task}", "run_dir=/tmp/x", "task.reward.variant=bogus"]))


def test_fixed_agreement_with_the_reference_is_reported():
    """How often the default `fixed` reward equals the reference (printed; run with -s to see)."""
    lines = []
    for task in TASKS:
        _, rows = fixture(task)
        agree = [abs(t - r["reward"]) <= TOL for t, r in zip(fixed_totals(task), rows)]
        style = [a for a, r in zip(agree, rows) if r["reached"] == 4]
        lines.append(f"{task}: fixed agrees with the reference on {sum(agree)}/{len(agree)} pairs "
                     f"({100 * sum(agree) / len(agree):.1f}%), on {sum(style)}/{len(style)} style-level pairs "
                     f"({100 * sum(style) / len(style):.1f}%)")
        assert sum(agree) < len(agree)
    print("\n" + "\n".join(lines), file=sys.stderr)


def test_paper_edge_cases_by_hand():
    tldr, arxiv = PaperRewardSpec.for_task("tldr"), PaperRewardSpec.for_task("arxiv")
    # Both texts stopword-only: two empty content sets give Jaccard 1.0 (full Jaccard credit).
    one, two = "the and of to a in is it", "the and of to a in is it was for on are as with his they at be this"
    r = score_writing_paper(one, two, tldr)
    assert r.info["jaccard"] == 1.0 and r.info["stopped_at"] is None
    # Transition phrases are raw substrings: "has" holds "as" (time), and arXiv reads text 1 + text 2
    # joined without a separator ("...th" + "us..." holds "thus").
    assert transition_categories("the cashier") == ["time"]
    assert "cause_effect" in transition_categories("blah th" + "us blah")
    # Lengths are unstripped: trailing spaces move the length ratio.
    a = "w" * 10 + " b c d e f g h"
    assert score_writing_paper(a, a + " " * 10, tldr).info["length_ratio"] == (len(a) + 10) / len(a)
    # Unknown task names fail loudly.
    with pytest.raises(ValueError, match="paper writing reward"):
        PaperRewardSpec.for_task("humaneval")
    assert arxiv.transitions_in == "first+second" and tldr.transitions_in == "second"


def test_data_file_ships_in_the_package():
    import tomllib

    pkg_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.json" in pkg_data.get("marl_llm.tasks", []) + pkg_data.get("*", [])  # its own globs or every package's
    d = paper_data()
    assert len(d["stopwords"]) == 106 and len(d["transitions"]) == 12
    assert sum(len(v) for v in d["transitions"].values()) == 279
