"""The offline CoopHumanEval-style sample (samples/coophumaneval/test.jsonl).

Every reference (aux, main) pair must earn the full joint reward in the sandbox, and the tests
must be able to fail: a constant main, or the reference main with a useless aux, does not pass.
"""

from __future__ import annotations

import ast
import json
from importlib.resources import files

import pytest

from marl_llm.sandbox import SandboxLimits
from marl_llm.tasks.code_reward import AUX_NAME, MAX_REWARD, score_many

FIELDS = ("task_id", "prompt", "entry_point", "test", "aux_solution", "main_solution")
SAMPLE = files("marl_llm").joinpath("samples/coophumaneval/test.jsonl")


def _load() -> list[dict]:
    text = SAMPLE.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


ROWS = _load()
IDS = [row["task_id"] for row in ROWS]


def _top_level_functions(code: str) -> list[str]:
    return [n.name for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _score(pairs: list[tuple[dict, str, str]]):
    items = [(r["prompt"], r["test"], r["entry_point"], aux, main) for r, aux, main in pairs]
    return score_many(items, SandboxLimits(), workers=2)


# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------


def test_sample_loads_with_required_fields() -> None:
    assert len(ROWS) >= 16
    assert len(set(IDS)) == len(IDS)
    for i, row in enumerate(ROWS):
        for key in FIELDS:
            assert isinstance(row.get(key), str) and row[key].strip(), (row.get("task_id"), key)
        assert row["task_id"] == f"CoopHumanEval/{i}"
    assert len({row["entry_point"] for row in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_prompt_test_and_solutions_are_well_formed(row: dict) -> None:
    entry = row["entry_point"]
    # The prompt is a HumanEval-style stub: the entry point with a docstring that has examples.
    tree = ast.parse(row["prompt"])
    stubs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry]
    assert len(stubs) == 1
    doc = ast.get_docstring(stubs[0])
    assert doc and doc.count(">>> ") >= 2
    # The test defines check(candidate) with 5-10 asserts.
    test_tree = ast.parse(row["test"])
    checks = [n for n in test_tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    assert len(checks) == 1
    n_asserts = sum(isinstance(n, ast.Assert) for n in ast.walk(checks[0]))
    assert 5 <= n_asserts <= 10
    # aux's code defines only `aux`, main's code only the entry point, which calls aux.
    assert _top_level_functions(row["aux_solution"]) == [AUX_NAME]
    assert _top_level_functions(row["main_solution"]) == [entry]
    main_tree = ast.parse(row["main_solution"])
    assert any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == AUX_NAME for n in ast.walk(main_tree)
    )


# ---------------------------------------------------------------------------------------------
# Rewards in the sandbox
# ---------------------------------------------------------------------------------------------


def test_reference_pairs_earn_the_full_reward() -> None:
    results = _score([(r, r["aux_solution"], r["main_solution"]) for r in ROWS])
    for row, res in zip(ROWS, results):
        info = res.info
        assert res.passed is True, (row["task_id"], info["status"], info["tests"])
        assert res.levels["tests"] == 1.0, row["task_id"]
        assert info["tests_passed"] == info["tests_total"] >= 5, row["task_id"]
        assert info["calls_aux"] and not info["thin_wrapper"] and not info["discarded_aux"], row["task_id"]
        assert res.total == MAX_REWARD == 4.0, (row["task_id"], res.levels)


def test_constant_mains_fail() -> None:
    pairs = []
    for r in ROWS:
        for value in ("None", "0", '""', "[]"):
            pairs.append((r, r["aux_solution"], f"def {r['entry_point']}(*args):\n    return {value}\n"))
    results = _score(pairs)
    for (row, _, main), res in zip(pairs, results):
        assert res.passed is False, (row["task_id"], main)
        assert res.levels["tests"] < 1.0, (row["task_id"], main)


def test_reference_main_needs_a_working_aux() -> None:
    """The main solutions really use aux's result: with a useless aux they fail."""
    broken_aux = f"def {AUX_NAME}(*args, **kwargs):\n    return None\n"
    results = _score([(r, broken_aux, r["main_solution"]) for r in ROWS])
    for row, res in zip(ROWS, results):
        assert res.passed is False, row["task_id"]
