"""The `paper` variant of the aux/main code reward (`task.reward.variant=paper`).

It scores a joint action as the reference implementation does (OpenMLRL/LLM_Collab_Code_Generation,
rewards/code_rewards.py `execution_reward_aux` with the helpers of rewards/code_utils.py, the
reward CoMLRL's MAGRPO trains HumanEval and CoopHumanEval on), quirks included, so that runs
with it are comparable with the paper's. `marl_llm.tasks.code_reward` is the `fixed` variant;
docs/rewards_code.md lists every difference and its effect.

Text handling (all static, in this process; nothing here executes model code):

* a completion's code is its `def` blocks only (markdown fences removed; a block is a `def`
  line and the following lines indented deeper than it, or starting with a tab, blank lines and
  docstring lines; any `def` line, nested ones included, starts a new block; prose-looking
  lines are dropped); `aux` and the entry point are then cut out of that, each up to its first
  line that is neither blank nor indented deeper;
* the program is the prompt's import lines, the cleaned aux function, the cleaned main
  function (nothing else of the prompt: helpers such as `poly` are missing);
* the tests are the lines of `def check(candidate):`'s body (up to the next blank-line-`def`)
  that start with `assert` plus whitespace and contain "candidate", deduplicated, with every
  "candidate" replaced by the entry point's name. Multi-line asserts keep their first line only,
  asserts inside loops lose their loop variable, `assert(` lines and helper-based checks are
  dropped: this is why some canonical solutions do not get full test credit.

Levels (gated like the reference; max 4.0):

1. structure: +0.4 if aux's function exists and contains `return` + whitespace anywhere
   (optional); +0.6 likewise for main (required, else stop);
2. syntax: +0.5 if the program parses, else stop; no test lines: stop here;
3. tests: + passed / total. In the sandbox (`run_program_scope_tests`), as the reference's
   harness: the program is executed into globals that hold `math`, then each test line in those
   same globals; a line `assert f(args) == expected` (args without a `)`) first evaluates
   `f(args)` and `expected` separately (the candidate runs twice), then the line; testing stops
   after 3 timed-out tests;
4. cooperation, if a test passed and aux's function is non-empty: +0.5 if main's text matches
   `aux(`; then +1.0 unless main is a wrapper (its body, without docstrings, comments and `def`
   lines, is one `return ...aux...` line, or `x = aux(...)` + `return x`, or empty), and -0.5 if
   a line of main is exactly `aux (c)` (one whitespace, one character: the reference's pattern,
   which almost never matches a discarded call).

The per-test time limit is `task.sandbox.timeout_s` (the reference uses a 10 s alarm).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from marl_llm.sandbox import ProgramScopeTest, SandboxLimits, Status, TestOutcome, run_program_scope_tests_many
from marl_llm.tasks.base import JointReward
from marl_llm.tasks.code_reward import AUX_NAME, LEVEL_MAX, syntax_error_site

__all__ = [
    "MAX_TIMEOUTS",
    "PRELOAD",
    "calls_aux",
    "clean_code",
    "function_of",
    "has_return",
    "ignores_aux_result",
    "is_wrapper",
    "program_of",
    "prompt_imports",
    "score_joint",
    "score_many",
    "assert_lines",
]

# The reference's values.
AUX_POINTS = 0.4
MAIN_POINTS = 0.6
SYNTAX_POINTS = 0.5
USES_AUX_POINTS = 0.5
NOT_WRAPPER_POINTS = 1.0
IGNORED_CALL_PENALTY = 0.5
#: Testing stops after this many timed-out tests.
MAX_TIMEOUTS = 3
#: Modules bound in the globals the program and its tests run in.
PRELOAD = ("math",)
#: A line containing one of these is never dropped as prose.
CODE_MARKERS = ("def ", "return ", "if ", "for ", "while ", "=", "(", ")", "[", "]")
QUOTES = ('"""', "'''")

_ANY_DEF = re.compile(r"\s*def\s+\w+\s*\(")
_HAS_DEF = re.compile(r"def\s+\w+\s*\(")
_PROSE = re.compile(r"[A-Z][a-z].*[.!?:]$")
_RETURN = re.compile(r"return\s+")
_FROM_IMPORT = re.compile(r"from\s+[\w.]+\s+import\s+.*$")
_IMPORT = re.compile(r"import\s+[\w.,\s]+$")
_CHECK_BODY = re.compile(r"def check\(candidate\):(.*?)(?=\n\ndef|\Z)", re.S)
_ASSERT_HEAD = re.compile(r"assert\s")
_EQ_TEST = re.compile(r"assert\s+(\w+)\(([^)]*)\)\s*==\s*(.+)")
_AUX_CALL = re.compile(rf"\b{AUX_NAME}\s*\(")
_AUX_ASSIGN = re.compile(rf"(\w+)\s*=\s*{AUX_NAME}\s*\(")
_AUX_BARE_CALL = re.compile(rf"{AUX_NAME}\s\([^)]\)")


# ----------------------------------------------------------------------------------------------
# Text handling
# ----------------------------------------------------------------------------------------------


def _deeper(line: str, indent: int) -> bool:
    return line.startswith(" " * (indent + 1)) or line.startswith("\t")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def clean_code(text: str) -> str:
    """The `def` blocks of a completion, joined by blank lines ("" when there is none)."""
    if not text or not isinstance(text, str):
        return ""
    text = re.sub(r"```\s*", "", re.sub(r"```python\s*", "", text))
    lines = text.split("\n")
    blocks: list[list[str]] = []
    block: list[str] | None = None
    indent = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if _ANY_DEF.match(line):
            block = [line]
            blocks.append(block)
            indent = _indent(line)
        elif block is not None:
            if not stripped or _deeper(line, indent):
                block.append(line)
            elif stripped.startswith(QUOTES):
                block.append(line)
                quote = stripped[:3]
                if not (stripped.endswith(quote) and len(stripped) > 3):
                    # a docstring at the def's level: take lines up to the one closing it
                    i += 1
                    while i < len(lines):
                        block.append(lines[i])
                        if quote in lines[i]:
                            break
                        i += 1
            else:
                block = None
        i += 1
    kept = [
        line for line in "\n\n".join("\n".join(b) for b in blocks).split("\n")
        if not _looks_like_prose(line)
    ]  # fmt: skip
    result = "\n".join(kept).strip()
    return result if _HAS_DEF.search(result) else ""


def _looks_like_prose(line: str) -> bool:
    stripped = line.strip()
    return (
        bool(stripped)
        and not stripped.startswith(("#",) + QUOTES)
        and not any(marker in line for marker in CODE_MARKERS)
        and _PROSE.match(stripped) is not None
    )


def function_of(text: str, name: str) -> str:
    """The definition of `name` cut out of `clean_code(text)` ("" when absent)."""
    if not text or not name:
        return ""
    head = re.compile(rf"\s*def\s+{re.escape(name)}\s*\(")
    picked: list[str] = []
    inside = False
    indent = 0
    for line in clean_code(text).split("\n"):
        if head.match(line):
            picked, inside, indent = [line], True, _indent(line)
        elif inside:
            if line.strip() and not _deeper(line, indent):
                break
            picked.append(line)
    return "\n".join(picked).strip()


def has_return(function: str) -> bool:
    """The reference's "defined with a return statement": `return` + whitespace anywhere."""
    return bool(function) and _RETURN.search(function) is not None


def prompt_imports(prompt: str) -> str:
    """The prompt's import lines (stripped, first occurrences, in order)."""
    found: dict[str, None] = {}
    for line in (prompt or "").split("\n"):
        line = line.strip()
        if _FROM_IMPORT.match(line) or _IMPORT.match(line):
            found.setdefault(line)
    return "\n".join(found)


def program_of(aux_function: str, main_function: str, imports: str) -> str:
    """The tested program: imports, then the cleaned aux and main functions."""
    parts = [imports, clean_code(aux_function), clean_code(main_function)]
    return "\n\n".join(p for p in parts if p)


def assert_lines(test_code: str, entry_point: str) -> list[str]:
    """The assert lines the reference runs as tests, with `candidate` renamed to the entry point."""
    if not test_code or not entry_point:
        return []
    m = _CHECK_BODY.search(test_code)
    if m is None:
        return []
    lines: dict[str, None] = {}
    for line in m.group(1).strip().split("\n"):
        line = line.strip()
        if _ASSERT_HEAD.match(line) and "candidate" in line:
            lines.setdefault(line)
    return [line.replace("candidate", entry_point) for line in lines]


def _evaluated_first(line: str) -> tuple[str, ...]:
    """For `assert f(args) == expected`: the call and the expected value, evaluated before the
    line itself (the reference evaluates them to print them)."""
    m = _EQ_TEST.search(line)
    return (f"{m.group(1)}({m.group(2)})", m.group(3)) if m else ()


def calls_aux(main_function: str) -> bool:
    return bool(main_function) and _AUX_CALL.search(main_function) is not None


def is_wrapper(main_function: str) -> bool:
    """The reference's thin-wrapper verdict on main's function text."""
    if not main_function:
        return False
    body: list[str] = []
    in_docstring = False
    for line in main_function.split("\n"):
        s = line.strip()
        if not s:
            continue
        if s.startswith(QUOTES):
            # a one-line docstring is skipped; any other line starting with quotes (the closing
            # line of a docstring included) opens one
            if not (s.endswith(s[:3]) and len(s) > 3):
                in_docstring = True
            continue
        if in_docstring:
            if any(q in s for q in QUOTES):
                in_docstring = False
            continue
        if s.startswith("#") or s.startswith("def "):
            continue
        body.append(s)
    if not body:
        return True
    if len(body) == 1:
        return body[0].startswith("return ") and AUX_NAME in body[0]
    if len(body) == 2:
        m = _AUX_ASSIGN.search(body[0])
        return m is not None and body[1] == f"return {m.group(1)}"
    return False


def ignores_aux_result(main_function: str) -> bool:
    """The reference's discarded-call check: a stripped line that is exactly `aux`, one
    whitespace character, `(`, one character other than `)`, `)`."""
    if not main_function or AUX_NAME not in main_function:
        return False
    for line in main_function.split("\n"):
        s = line.strip()
        if s and not s.startswith("#") and _AUX_BARE_CALL.fullmatch(s):
            return True
    return False


# ----------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------


@dataclass
class _Stage:
    levels: dict[str, float]
    info: dict[str, Any]
    total: float = 0.0  # accumulated in the reference's order (same float rounding)
    program: str = ""
    tests: list[str] = field(default_factory=list)
    needs_tests: bool = False


def _add(stage: _Stage, level: str, points: float) -> None:
    stage.levels[level] += points
    stage.total += points


def _static_levels(prompt: str, test_code: str, entry_point: str, aux_text: str, main_text: str) -> _Stage:
    aux_function = function_of(aux_text, AUX_NAME)
    main_function = function_of(main_text, entry_point)
    imports = prompt_imports(prompt)
    program = program_of(aux_function, main_function, imports)
    info: dict[str, Any] = {
        "variant": "paper",
        "entry_point": entry_point,
        "aux_code": aux_function,
        "main_code": main_function,
        "program": program,
        "aux_defined": bool(aux_function),
        "aux_returns": has_return(aux_function),
        "main_defined": bool(main_function),
        "main_returns": has_return(main_function),
        "main_redefined_aux": False,
        "syntax_error": None,
        "status": "not_run",
        "tests": [],
        "tests_passed": 0,
        "tests_total": 0,
        "calls_aux": calls_aux(main_function),
        "thin_wrapper": is_wrapper(main_function),
        "discarded_aux": ignores_aux_result(main_function),
        "stopped_at": None,
    }
    stage = _Stage(dict.fromkeys(LEVEL_MAX, 0.0), info, program=program)
    if info["aux_returns"]:
        _add(stage, "structure", AUX_POINTS)
    if not info["main_returns"]:
        info["stopped_at"] = "structure"
        return stage
    _add(stage, "structure", MAIN_POINTS)
    error = syntax_error_site(imports, clean_code(aux_function), clean_code(main_function), program)
    if error is not None:
        info["syntax_error"] = error
        info["stopped_at"] = "syntax"
        return stage
    _add(stage, "syntax", SYNTAX_POINTS)
    stage.tests = assert_lines(test_code, entry_point)
    info["tests_total"] = len(stage.tests)
    if not stage.tests:  # the reference stops here: no test reward, no bonus
        info["stopped_at"] = "tests"
        return stage
    stage.needs_tests = True
    return stage


def _finish(stage: _Stage, outcome: TestOutcome) -> None:
    info = stage.info
    info["status"] = outcome.status.value
    info["tests"] = [{"source": r.source, "passed": r.passed, "error": r.error} for r in outcome.per_test]
    info["tests_passed"] = passed = outcome.tests_passed
    _add(stage, "tests", passed / len(stage.tests))
    if passed < 1 or not info["aux_defined"]:
        info["stopped_at"] = "tests"
        return
    if not info["calls_aux"]:
        return
    _add(stage, "cooperation", USES_AUX_POINTS)
    if not info["thin_wrapper"]:
        _add(stage, "cooperation", NOT_WRAPPER_POINTS)
    if info["discarded_aux"]:
        _add(stage, "cooperation", -IGNORED_CALL_PENALTY)


def score_many(
    items: Sequence[tuple[str, str, str, str, str]], limits: SandboxLimits | None = None, workers: int = 2
) -> list[JointReward]:
    """Score many (problem_prompt, test_code, entry_point, aux_text, main_text), in order; the
    programs that reach the tests level run in the sandbox, `workers` at a time."""
    stages = [_static_levels(*item) for item in items]
    jobs = [
        (s.program, [ProgramScopeTest(line, _evaluated_first(line)) for line in s.tests])
        for s in stages if s.needs_tests
    ]  # fmt: skip
    outcomes = iter(run_program_scope_tests_many(jobs, limits or SandboxLimits(), workers, PRELOAD, MAX_TIMEOUTS))
    for stage in stages:
        if stage.needs_tests:
            _finish(stage, next(outcomes))
    return [
        JointReward(total=s.total, levels=s.levels, info=s.info, passed=s.info["status"] == Status.PASSED.value)
        for s in stages
    ]


def score_joint(
    problem_prompt: str,
    test_code: str,
    entry_point: str,
    aux_text: str,
    main_text: str,
    limits: SandboxLimits | None = None,
) -> JointReward:
    """The reference's reward of one (aux, main) pair; `info` has the keys of
    `marl_llm.tasks.code_reward.score_joint` (so turn-2 feedback works) plus "variant"."""
    return score_many([(problem_prompt, test_code, entry_point, aux_text, main_text)], limits, workers=1)[0]
