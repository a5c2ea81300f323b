"""Turn-2 feedback on a joint action scored by the `fixed` code reward (`task.prompts=own`,
`task.feedback`): what each agent is told about its last answer before it revises it.

The detailed mode shows a test as the candidate calls it makes and its error, never the expected
output, which the next turn could copy instead of solving. Nor does it show which tests failed
when the tests expect yes/no or a few repeated results (`few_answers`): there a test's verdict is its answer (a FAIL on an input where turn 1 said False
means True), and flipping turn 1's answers on the inputs marked FAIL passes without solving
anything. docs/rewards_code.md measures both (`marl-llm-bench reward-hacks`).
"""

from __future__ import annotations

import ast
from typing import Any

from marl_llm.sandbox import Status
from marl_llm.tasks.base import JointReward
from marl_llm.tasks.code_reward import AUX_NAME, LEVEL_MAX, MAX_REWARD

__all__ = ["FEEDBACK_MODES", "FEW_ANSWERS", "REVISE", "asserted_answer", "call_args", "expected_answers", "feedback", "few_answers",
           "shown_error", "shown_inputs"]

FEEDBACK_MODES = ("detailed", "binary", "level", "plain")
REVISE = "Revise your function."

_MAX_FEEDBACK_TESTS = 20
_MAX_LINE_CHARS = 240
# Tests whose expected results are yes/no, or repeat at most this many distinct values, get no
# per-test verdicts: with k values a FAIL leaves k - 1 candidates for the answer, so a yes/no
# function's answers are its verdicts, and each further turn narrows the others. (Distinct values
# that do not repeat say nothing of the domain: four tests of a sum expect four sums.) Measured on
# HumanEval's training split: docs/rewards_code.md.
FEW_ANSWERS = 3


def _cap_line(s: str, n: int = _MAX_LINE_CHARS) -> str:
    s = " ".join(s.split())  # one line
    return s if len(s) <= n else s[: n - 3] + "..."


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else f"{x:.1f}"


def shown_inputs(source: str, names: set[str]) -> str:
    """What the detailed feedback shows of a test: the calls of the candidate it makes (their
    inputs), never the expected values, which would let the next turn copy them instead of
    solving: `assert candidate([1, 2]) == 5` shows `candidate([1, 2])`."""
    try:
        tree = ast.parse(source.strip())
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "a test that does not parse"
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            text = ast.get_source_segment(source.strip(), node) or ast.unparse(node)
            if text not in calls:
                calls.append(text)
    return ", ".join(calls) if calls else "a check of an earlier call's result"


def call_args(node: ast.AST, names: set[str]) -> tuple | None:
    """The literal arguments of a call `name(<literals>)` for a name in `names`, or None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
            and not node.keywords):
        return None
    try:
        return tuple(ast.literal_eval(a) for a in node.args)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return False, None


def asserted_answer(test: ast.expr, names: set[str]) -> tuple[tuple, Any] | None:
    """(the call's literal args, the value expected of it) an assert's test states, or None:
    `f(x) == v` (either side, or `is`), `abs(f(x) - v) < tol`, `f(x)` (True), `not f(x)` (False)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        args = call_args(test.operand, names)
        return (args, False) if args is not None else None
    if (args := call_args(test, names)) is not None:
        return args, True
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(op, (ast.Eq, ast.Is)):
        for call, value in ((left, right), (right, left)):
            args, (ok, expected) = call_args(call, names), _literal(value)
            if args is not None and ok:
                return args, expected
    if isinstance(op, (ast.Lt, ast.LtE)) and isinstance(left, ast.Call) and len(left.args) == 1:
        inner = left.args[0]  # abs(f(x) - y) < tol, math.fabs(...) alike
        if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub):
            args, (ok, expected) = call_args(inner.left, names), _literal(inner.right)
            if args is not None and ok:
                return args, expected
    return None


def expected_answers(sources: list[str], names: set[str]) -> list[str]:
    """The values (their reprs) that the tests' asserts expect of the candidate, one per assert
    that states its value as a literal (tests that compute theirs add nothing)."""
    values = []
    for source in sources:
        try:
            tree = ast.parse(source.strip())
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert) and (pair := asserted_answer(node.test, names)) is not None:
                values.append(repr(pair[1]))
    return values


def few_answers(answers: list[str]) -> bool:
    """Whether the stated answers come from a domain small enough that verdicts reveal them: all
    yes/no, or at most FEW_ANSWERS distinct values that repeat."""
    distinct = set(answers)
    return bool(distinct) and (distinct <= {"True", "False"} or len(distinct) < len(answers)
                               and len(distinct) <= FEW_ANSWERS)


def _wrong_result(error: str) -> bool:
    """Whether a failed test's error is a wrong value (not an exception the candidate raised)."""
    return (error.startswith("expected ") and ", got " in error) or error.startswith("AssertionError")


def shown_error(error: str) -> str:
    """A failed test's error without the expected value: "expected 5, got 1" (the sandbox's
    comparison) becomes "wrong result (got 1)", an assertion's own message is dropped (tests
    often put the answer there); other errors (the candidate's exceptions, timeouts) stay."""
    if error.startswith("expected ") and ", got " in error:
        # The last ", got " splits it: what follows is then always part of the candidate's value.
        return f"wrong result (got {error.rsplit(', got ', 1)[1]})"
    if error.startswith("AssertionError"):
        return "wrong result"
    return error


def _definition_lines(agent: str, info: dict[str, Any]) -> list[str]:
    entry = info.get("entry_point", "the entry point")
    aux_state = (
        "defined, returns a value" if info.get("aux_returns")
        else "defined, but never returns a value" if info.get("aux_defined")
        else "not found"
    )  # fmt: skip
    main_state = (
        "defined, returns a value" if info.get("main_returns")
        else "defined, but never returns a value" if info.get("main_defined")
        else "not found"
    )  # fmt: skip
    lines = [f"Definitions found: `{AUX_NAME}` ({aux_state}); `{entry}` ({main_state})."]
    if agent == "aux" and not info.get("aux_defined"):
        lines.append(f"Your code must define a function named `{AUX_NAME}`.")
    if agent == "main" and not (info.get("main_defined") and info.get("main_returns")):
        lines.append(f"Your code must define `{entry}` with the given signature and return its result.")
    if agent == "main" and info.get("main_redefined_aux"):
        lines.append(f"You defined `{AUX_NAME}` yourself; it was removed. Do not redefine `{AUX_NAME}`, call it.")
    return lines


def _test_lines(info: dict[str, Any]) -> list[str]:
    status = info.get("status", "not_run")
    if status == "not_run":
        return ["Tests: not run (an earlier level failed)."]
    tests = info.get("tests", [])
    lines = [f"Tests: {info.get('tests_passed', 0)}/{info.get('tests_total', 0)} passed (status: {status})."]
    if status == Status.TIMEOUT.value:
        lines.append("The code is too slow or loops forever on some inputs.")
    elif status == Status.OUT_OF_MEMORY.value:
        lines.append("The code ran out of memory.")
    names = {"candidate", info.get("entry_point", "")}
    answers = expected_answers([t["source"] for t in tests], names)
    if few_answers(answers):  # a verdict would be the answer: the exceptions only
        distinct = len(set(answers))
        lines.append(f"Which tests failed is not shown: the tests expect only {distinct} distinct "
                     f"result{'s' if distinct > 1 else ''}, so a test's verdict would give its answer away.")
        errors = [t for t in tests if not t["passed"] and not _wrong_result(t["error"])]
        for t in errors[:_MAX_FEEDBACK_TESTS]:
            lines.append("  " + _cap_line(f"ERROR: {shown_inputs(t['source'], names)} -> {t['error']}"))
        return lines
    for t in tests[:_MAX_FEEDBACK_TESTS]:
        if t["passed"]:
            lines.append("  " + _cap_line(f"PASS: {shown_inputs(t['source'], names)}"))
        else:
            lines.append("  " + _cap_line(f"FAIL: {shown_inputs(t['source'], names)} -> {shown_error(t['error'])}"))
    if len(tests) > _MAX_FEEDBACK_TESTS:
        rest = tests[_MAX_FEEDBACK_TESTS:]
        lines.append(f"  ... {len(rest)} more tests, {sum(not t['passed'] for t in rest)} of them failed.")
    return lines


def _cooperation_lines(agent: str, info: dict[str, Any]) -> list[str]:
    if info.get("status", "not_run") == "not_run":
        return []
    lines = []
    if not info.get("calls_aux"):
        lines.append(
            f"The main function does not call `{AUX_NAME}(...)`."
            if agent == "aux"
            else f"Your function does not call `{AUX_NAME}(...)`; use the helper."
        )
    if info.get("thin_wrapper"):
        lines.append(
            f"The main function only returns `{AUX_NAME}(...)` (a thin wrapper); the work should be shared."
            if agent == "aux"
            else f"Your function is a thin wrapper: it only returns `{AUX_NAME}(...)`. Add your own logic around the helper."
        )
    if info.get("discarded_aux"):
        lines.append(f"The result of a `{AUX_NAME}(...)` call is discarded; use the value it returns.")
    return lines


def _syntax_lines(agent: str, info: dict[str, Any]) -> list[str]:
    err = info.get("syntax_error")
    if not err:
        return []
    where = "your code" if err["agent"] == agent else f"the {err['agent']} code"
    return [_cap_line(f"Syntax error in {where} at line {err['line']}: {err['msg']}")]


def feedback(agent: str, own_code: str, reward: JointReward, mode: str = "detailed") -> str:
    """The turn-2 diagnostics for `agent` ("aux" or "main") after the joint `reward`.

    Modes: "detailed" (definitions, syntax error, every test's pass/fail with the candidate's
    inputs and its error, never the expected outputs, and no verdicts where the tests expect
    yes/no or a few repeated results (few_answers), only the exceptions; aux-usage warnings), "binary" (passed
    or not), "level" (reward levels reached),
    "plain" (just the code). Each starts with the agent's previous code and ends with
    "Revise your function.".
    """
    if agent not in ("aux", "main"):
        raise ValueError(f"feedback agent must be 'aux' or 'main', got {agent!r}")
    if mode not in FEEDBACK_MODES:
        raise ValueError(f"task.feedback={mode!r}: expected one of {FEEDBACK_MODES}")
    info = reward.info
    parts = [f"Your previous code:\n```python\n{own_code.strip()}\n```"]
    if mode == "binary":
        ok = bool(reward.passed)
        parts.append("Result: the combined program passed all tests." if ok else "Result: the combined program did not pass all tests.")
    elif mode == "level":
        reached = ", ".join(f"{k} {_fmt(reward.levels.get(k, 0.0))}/{_fmt(m)}" for k, m in LEVEL_MAX.items())
        line = f"Reward levels: {reached} (total {_fmt(reward.total)}/{_fmt(MAX_REWARD)})."
        stopped = info.get("stopped_at")
        if stopped in ("structure", "syntax"):
            line += f" Stopped at the {stopped} level."
        parts.append(line)
    elif mode == "detailed":
        lines = _definition_lines(agent, info) + _syntax_lines(agent, info) + _test_lines(info) + _cooperation_lines(agent, info)
        parts.append("\n".join(lines))
    parts.append(REVISE)
    return "\n\n".join(parts)
