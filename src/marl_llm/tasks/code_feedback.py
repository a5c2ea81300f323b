"""Turn-2 feedback on a joint action scored by the `fixed` code reward (`task.prompts=own`,
`task.feedback`): what each agent is told about its last answer before it revises it.

The detailed mode shows a test as the candidate calls it makes and its error, never the expected
output, which the next turn could copy instead of solving (docs/rewards_code.md measures this:
`marl-llm-bench reward-hacks`).
"""

from __future__ import annotations

import ast
from typing import Any

from marl_llm.sandbox import Status
from marl_llm.tasks.base import JointReward
from marl_llm.tasks.code_reward import AUX_NAME, LEVEL_MAX, MAX_REWARD

__all__ = ["FEEDBACK_MODES", "REVISE", "feedback", "shown_error", "shown_inputs"]

FEEDBACK_MODES = ("detailed", "binary", "level", "plain")
REVISE = "Revise your function."

_MAX_FEEDBACK_TESTS = 20
_MAX_LINE_CHARS = 240


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
    inputs and its error, never the expected outputs; aux-usage warnings), "binary" (passed or not), "level" (reward levels reached),
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
