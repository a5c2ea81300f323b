"""task.prompts=paper on the writing tasks against the reference formatters' own prompts.

tests/fixtures/writing_prompts_paper.jsonl holds the prompts the per-agent formatters of
OpenMLRL/LLM_Collab_Writing (train_magrpo.py, train_maac.py) built for every row of the packaged
TLDR and arXiv samples and for crafted rows, written by scripts/reference_fixtures/writing_prompts.py
(see docs/rewards_writing.md, "Prompts").
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest

from conftest import REPO, compose_config
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.tasks import build_task
from marl_llm.tasks.base import Problem
from marl_llm.tasks.data import read_packaged_sample
from marl_llm.tasks.writing import paper_prompt_data

TASKS = ("tldr", "arxiv")
FIXTURE = REPO / "tests" / "fixtures" / "writing_prompts_paper.jsonl"
PAPER_PRESETS = [f"{algo}_{task}_paper{lora}" for algo in ("magrpo", "collm_cc", "collm_dc") for task in TASKS
                 for lora in ("", "_lora")]


@lru_cache(maxsize=None)
def fixture() -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").split("\n") if line]
    return lines[0]["meta"], lines[1:]


def rows_of(task: str) -> list[dict]:
    return [r for r in fixture()[1] if r["task"] == task]


@lru_cache(maxsize=None)
def task_for(task: str, *overrides: str):
    cfg = compose_config([f"task={task}", "run_dir=/tmp/x", *overrides])
    validate(cfg)
    return build_task(cfg.task)


def test_fixtures_come_from_the_reference_commit():
    meta, rows = fixture()
    data = paper_prompt_data()
    assert meta["commit"] == data["reference"]["commit"] == "7e59995e20251de8819bdf2a57d8296193cb2b03"
    assert {"train_magrpo.py", "train_maac.py"} <= set(meta["trainers"])
    assert meta["rows"] == len(rows)
    assert meta["fields"] == {t: data["tasks"][t]["field"] for t in TASKS}


@pytest.mark.parametrize("task", TASKS)
def test_fixtures_cover_every_packaged_row_and_the_edge_cases(task):
    rows = rows_of(task)
    by_source = {r["source"]: r["row"] for r in rows}
    files = sorted(p.stem for p in (REPO / "src" / "marl_llm" / "samples" / task).glob("*.jsonl"))
    assert files
    for split in files:
        packaged = read_packaged_sample(task, split)
        assert packaged == [by_source[f"samples/{task}/{split}.jsonl:{i}"] for i in range(len(packaged))]
    crafted = {s.split(":", 1)[1] for s in by_source if s.startswith("crafted:")}
    assert {"empty", "whitespace", "missing_field", "null", "non_ascii", "very_long", "braces", "list_value"} <= crafted
    # The edge cases really reach both branches of the reference formatters.
    errors = [r for r in rows if r["prompts"][0] == paper_prompt_data()["tasks"][task]["if_empty"]]
    assert {r["source"] for r in errors} == {f"crafted:{k}" for k in ("empty", "missing_field", "null")}


@pytest.mark.parametrize("task", TASKS)
def test_the_reference_reads_the_configured_text_field(task):
    """The field the reference formatters read is the task's `text_field` (no mismatch to fix)."""
    assert paper_prompt_data()["tasks"][task]["field"] == task_for(task).cfg.text_field


@pytest.mark.parametrize("task", TASKS)
def test_paper_prompts_equal_the_reference_on_every_row(task):
    paper = task_for(task, "task.prompts=paper")
    assert paper.prompt_variant == "paper"
    for r in rows_of(task):
        got = paper.initial_prompts(Problem(uid=r["source"], data=dict(r["row"])))
        assert got == r["prompts"], r["source"]
        assert all(isinstance(p, str) for p in got)


@pytest.mark.parametrize("task", TASKS)
def test_paper_prompts_through_the_data_pipeline(task):
    """Rows as the packaged data source loads them give the fixtures' prompts (nothing stripped)."""
    paper = task_for(task, "task.prompts=paper", "task.data.source=packaged")
    expected = {r["source"]: r["prompts"] for r in rows_of(task)}
    for split, name in (("train", paper.cfg.data.packaged_train_split), ("eval", paper.cfg.data.packaged_eval_split)):
        problems = paper.load_split(split)
        assert problems
        for i, p in enumerate(problems):
            assert paper.initial_prompts(p) == expected[f"samples/{task}/{name}.jsonl:{i}"]


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_paper_presets_train_with_the_reference_prompts(preset):
    cfg = compose_config([f"experiment={preset}", "run_dir=/tmp/x"])
    validate(cfg)
    assert cfg.task.prompts == "paper" and cfg.model.chat_template is False
    task = build_task(cfg.task)
    r = rows_of(cfg.task.name)[0]
    assert task.initial_prompts(Problem(uid="0", data=dict(r["row"]))) == r["prompts"]


@pytest.mark.parametrize("task", TASKS)
def test_own_is_the_default_and_unchanged(task):
    own = task_for(task)
    assert own.cfg.prompts == "own" and own.prompt_variant == "own" and own.paper_prompts is None
    assert task_for(task, "task.prompts=own").initial_prompts  # the explicit setting composes too
    for r in rows_of(task)[:8]:
        problem = Problem(uid=r["source"], data=dict(r["row"]))
        got = own.initial_prompts(problem)
        text = own.source_text(problem)
        assert got == [f"{role}\n\n{own.source_label}:\n{text}" for role in own.roles]
        assert got != r["prompts"]
        assert not text.endswith("TL;DR:")
    assert own.roles[0].startswith(("Write a concise summary", "Based on the abstract below"))


def test_an_unknown_prompt_setting_is_refused():
    cfg = compose_config(["task=tldr", "task.prompts=mine", "run_dir=/tmp/x"])
    with pytest.raises(UserError, match="task.prompts"):
        validate(cfg)


def test_paper_prompts_leave_the_single_baseline_alone():
    """The reference has no single-agent formatter for these trainers: algo=single keeps its own."""
    r = rows_of("tldr")[0]
    problem = Problem(uid="0", data=dict(r["row"]))
    assert task_for("tldr", "task.prompts=paper").single_prompt(problem) == task_for("tldr").single_prompt(problem)
