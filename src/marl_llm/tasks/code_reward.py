"""Joint reward of a helper (`aux`) and a main function on HumanEval-style problems.

Max 4.0, gated levels (a failed level stops the accumulation; later levels stay 0):

1. structure (max 1.0): +0.4 if aux's code defines `aux` and it returns a value (optional);
   +0.6 if main's code defines the entry point and it returns a value (required, else stop).
2. syntax (max 0.5): prompt context + aux + main parse with `ast.parse` -> +0.5, else stop.
3. tests (max 1.0): +1.0 * passed / total, the combined program run in `marl_llm.sandbox`.
4. cooperation (max 1.5), only if every test passed and aux is defined: +0.5 if main calls
   `aux`; +1.0 more if main is not a thin wrapper (its body just `return aux(...)`); -0.5 if the
   result of an `aux(...)` call is discarded (a bare expression statement). No level above the
   tests pays for code that does not solve the problem: with a partial test level, a constant
   answer that stores `aux(...)`'s result would otherwise outscore a correct solution.

Only `ast.parse` runs here (parsing executes nothing); programs run in the sandbox.

The prompt's *context* is every top-level statement of the HumanEval prompt except the
entry-point stub: imports plus, for a few problems, helper definitions such as `poly`
(HumanEval/32) or `encode_cyclic` (HumanEval/38). It precedes aux and main in the combined
program (main may call those helpers, as the reference solutions do), and a trusted copy of it
precedes the test code, whose `check` uses them.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from marl_llm.sandbox import SandboxLimits, Status, TestOutcome, run_tests_many
from marl_llm.tasks.base import JointReward

__all__ = [
    "AUX_NAME",
    "LEVEL_MAX",
    "MAX_REWARD",
    "combine",
    "extract_code",
    "prompt_context",
    "score_joint",
    "score_many",
    "solved",
    "syntax_error_site",
    "full_test_code",
]

AUX_NAME = "aux"
LEVEL_MAX = {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 1.5}
MAX_REWARD = sum(LEVEL_MAX.values())  # 4.0


# ----------------------------------------------------------------------------------------------
# Code extraction and combination
# ----------------------------------------------------------------------------------------------

# A fenced block: ```lang ... ``` (an unclosed fence, i.e. a truncated completion, runs to the end).
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)
_PY_LANGS = {"", "python", "py", "python3", "py3"}
_CODE_START = re.compile(r"^(?:async\s+def\s|def\s|class\s|import\s|from\s+[\w.]+\s+import\s|@\w|#)")
_ASSIGN_START = re.compile(r"^[A-Za-z_]\w*(?:\s*:[^=]+)?\s*=[^=]")


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def extract_code(text: str) -> str:
    """The Python code of a completion: fenced blocks if any, else the text minus stray prose.

    With fences, Python-ish blocks (```python, ```py or bare) are joined, preferring those that
    define something. Without fences, prose lines before the first code-looking line are
    dropped, and trailing unindented lines are dropped while the code does not parse. Pure
    prose gives "".
    """
    text = text.replace("\r\n", "\n")
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in _PY_LANGS]
    if blocks:
        with_defs = [b for b in blocks if re.search(r"^\s*(?:async\s+)?def\s", b, re.M)]
        return "\n\n".join(b.strip("\n") for b in (with_defs or blocks)).strip("\n") + "\n"
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if _CODE_START.match(line)), None)
    if start is None:
        start = next((i for i, line in enumerate(lines) if _ASSIGN_START.match(line)), None)
    if start is None:  # no code-looking line: the text is code only if it parses
        stripped = text.strip("\n")
        return stripped + "\n" if stripped.strip() and _parses(stripped) else ""
    lines = lines[start:]
    candidate = lines[:]
    for _ in range(200):  # drop trailing prose until the code parses
        while candidate and not candidate[-1].strip():
            candidate.pop()
        if not candidate or _parses("\n".join(candidate)):
            break
        last = candidate[-1]
        if last[:1].isspace() or _CODE_START.match(last):
            break  # an indented or code-looking line: a real syntax error, keep it
        candidate.pop()
    if candidate and _parses("\n".join(candidate)):
        lines = candidate
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines) + "\n" if lines else ""


def prompt_context(prompt: str, entry_point: str) -> str:
    """Every top-level statement of the problem prompt except the entry-point stub."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return "\n".join(l for l in prompt.split("\n") if re.match(r"(?:import|from)\s", l))
    body = [
        n for n in tree.body
        if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry_point)
    ]  # fmt: skip
    return ast.unparse(ast.Module(body=body, type_ignores=[]))


def full_test_code(prompt: str, test_code: str, entry_point: str) -> str:
    """The test code preceded by the prompt's context (helpers the tests call, e.g. `poly`)."""
    context = prompt_context(prompt, entry_point)
    return f"{context}\n\n\n{test_code}" if context else test_code


def _drop_definitions(code: str, name: str) -> tuple[str, bool]:
    """Remove top-level definitions of `name` (with decorators) from `code`."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code, False
    spans = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno or node.lineno))
    if not spans:
        return code, False
    lines = code.split("\n")
    keep = [line for i, line in enumerate(lines, 1) if not any(a <= i <= b for a, b in spans)]
    return "\n".join(keep), True


def combine(prompt: str, aux_code: str, main_code: str, entry_point: str) -> str:
    """The program that is tested: prompt context, then aux's code, then main's code.

    Any top-level definition of `aux` in main's code is dropped (main must not redefine aux).
    """
    main_code, _ = _drop_definitions(main_code, AUX_NAME)
    parts = [prompt_context(prompt, entry_point), aux_code.strip("\n"), main_code.strip("\n")]
    return "\n\n\n".join(p for p in parts if p.strip()) + "\n"


# ----------------------------------------------------------------------------------------------
# Static analysis
# ----------------------------------------------------------------------------------------------


def _own_nodes(fn: ast.AST):
    """Nodes of a function's body, not descending into nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    found = None
    for node in tree.body:  # the last top-level definition wins, as at run time
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            found = node
    return found


def _defines(code: str, name: str) -> tuple[bool, bool]:
    """(is `name` defined at top level, does it return a value)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return _defines_by_text(code, name)
    fn = _function(tree, name)
    if fn is None:
        return False, False
    returns = any(isinstance(n, ast.Return) and n.value is not None for n in _own_nodes(fn))
    return True, returns


def _defines_by_text(code: str, name: str) -> tuple[bool, bool]:
    """`_defines` for code that does not parse (the syntax level will fail it anyway)."""
    lines = code.split("\n")
    head = re.compile(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(")
    for i, line in enumerate(lines):
        if head.match(line):
            body = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and not nxt[:1].isspace():
                    break
                body.append(nxt)
            return True, any(re.match(r"^\s+return\s+\S", b) for b in body)
    return False, False


def _is_aux_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == AUX_NAME


def _cooperation_facts(main_code: str, entry_point: str) -> dict[str, bool]:
    try:
        tree = ast.parse(main_code)
    except (SyntaxError, ValueError):
        return {"calls_aux": False, "thin_wrapper": False, "discarded_aux": False}
    calls = any(_is_aux_call(n) for n in ast.walk(tree))
    discarded = any(isinstance(n, ast.Expr) and _is_aux_call(n.value) for n in ast.walk(tree))
    thin = False
    fn = _function(tree, entry_point)
    if fn is not None:
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        thin = len(body) == 1 and isinstance(body[0], ast.Return) and _is_aux_call(body[0].value)
    return {"calls_aux": calls, "thin_wrapper": thin, "discarded_aux": discarded}


def syntax_error_site(context: str, aux_code: str, main_code: str, program: str) -> dict[str, Any] | None:
    """Where the combined program fails to parse: the agent whose code is at fault, line, msg."""
    try:
        ast.parse(program)
        return None
    except (SyntaxError, ValueError) as e:
        combined = e
    for agent, code in (("aux", aux_code), ("main", main_code), ("prompt", context)):
        try:
            ast.parse(code)
        except SyntaxError as e:
            return {"agent": agent, "line": e.lineno or 0, "msg": e.msg}
        except ValueError as e:  # e.g. null bytes
            return {"agent": agent, "line": 0, "msg": str(e)}
    return {"agent": "combined", "line": getattr(combined, "lineno", 0) or 0, "msg": getattr(combined, "msg", str(combined))}


# ----------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------


@dataclass
class _Stage:
    """One joint action between the static levels and the sandbox run."""

    levels: dict[str, float]
    info: dict[str, Any]
    program: str = ""
    test_code: str = ""
    entry_point: str = ""
    needs_tests: bool = False
    aux_defined: bool = False
    coop: dict[str, bool] = field(default_factory=dict)


def _static_levels(prompt: str, test_code: str, entry_point: str, aux_text: str, main_text: str) -> _Stage:
    levels = dict.fromkeys(LEVEL_MAX, 0.0)
    aux_code = extract_code(aux_text)
    main_raw = extract_code(main_text)
    main_code, redefined = _drop_definitions(main_raw, AUX_NAME)
    context = prompt_context(prompt, entry_point)
    program = combine(prompt, aux_code, main_code, entry_point)
    aux_defined, aux_returns = _defines(aux_code, AUX_NAME)
    main_defined, main_returns = _defines(main_code, entry_point)
    info: dict[str, Any] = {
        "entry_point": entry_point,
        "aux_code": aux_code,
        "main_code": main_code,
        "program": program,
        "aux_defined": aux_defined,
        "aux_returns": aux_returns,
        "main_defined": main_defined,
        "main_returns": main_returns,
        "main_redefined_aux": redefined,
        "syntax_error": None,
        "status": "not_run",
        "tests": [],
        "tests_passed": 0,
        "tests_total": 0,
        "calls_aux": False,
        "thin_wrapper": False,
        "discarded_aux": False,
        "stopped_at": None,
    }
    stage = _Stage(levels, info, program, full_test_code(prompt, test_code, entry_point), entry_point)
    stage.aux_defined = aux_defined
    # 1. structure
    if aux_defined and aux_returns:
        levels["structure"] += 0.4
    if not (main_defined and main_returns):
        info["stopped_at"] = "structure"
        return stage
    levels["structure"] += 0.6
    # 2. syntax
    error = syntax_error_site(context, aux_code, main_code, program)
    if error is not None:
        info["syntax_error"] = error
        info["stopped_at"] = "syntax"
        return stage
    levels["syntax"] = 0.5
    stage.coop = _cooperation_facts(main_code, entry_point)
    info.update(stage.coop)
    stage.needs_tests = True
    return stage


def _finish(stage: _Stage, outcome: TestOutcome) -> None:
    levels, info = stage.levels, stage.info
    info["status"] = outcome.status.value
    info["tests"] = [{"source": r.source, "passed": r.passed, "error": r.error} for r in outcome.per_test]
    info["tests_passed"] = outcome.tests_passed
    info["tests_total"] = outcome.tests_total
    if outcome.tests_total:
        levels["tests"] = outcome.tests_passed / outcome.tests_total
    if not solved(outcome) or not stage.aux_defined:
        info["stopped_at"] = "tests"
        return
    coop = 0.0
    if stage.coop["calls_aux"]:
        coop += 0.5
        if not stage.coop["thin_wrapper"]:
            coop += 1.0
    if stage.coop["discarded_aux"]:
        coop -= 0.5
    levels["cooperation"] = coop


def solved(outcome: TestOutcome) -> bool:
    """Every test ran and passed: what opens the cooperation level."""
    return outcome.tests_total > 0 and outcome.tests_passed == outcome.tests_total


def _reward(stage: _Stage) -> JointReward:
    total = round(sum(stage.levels.values()), 10)
    return JointReward(total=total, levels=stage.levels, info=stage.info, passed=stage.info["status"] == Status.PASSED.value)


def score_many(
    items: Sequence[tuple[str, str, str, str, str]], limits: SandboxLimits | None = None, workers: int = 2
) -> list[JointReward]:
    """Score many (problem_prompt, test_code, entry_point, aux_text, main_text) at once.

    The static levels are computed here; all programs that reach the tests level run in the
    sandbox in parallel (`workers` processes at a time). Order is preserved.
    """
    stages = [_static_levels(*item) for item in items]
    jobs = [(s.program, s.test_code, s.entry_point) for s in stages if s.needs_tests]
    outcomes = iter(run_tests_many(jobs, limits or SandboxLimits(), workers=workers))
    for stage in stages:
        if stage.needs_tests:
            _finish(stage, next(outcomes))
    return [_reward(s) for s in stages]


def score_joint(
    problem_prompt: str,
    test_code: str,
    entry_point: str,
    aux_text: str,
    main_text: str,
    limits: SandboxLimits | None = None,
) -> JointReward:
    """The joint reward of one (aux, main) pair of completions (see the module docstring).

    info: entry_point, aux_code, main_code (extracted; aux definitions removed from main),
    program (combined), aux_defined, aux_returns, main_defined, main_returns,
    main_redefined_aux, syntax_error ({agent, line, msg} or None), status (a sandbox Status
    value, or "not_run"), tests ([{source, passed, error}]), tests_passed, tests_total,
    calls_aux, thin_wrapper, discarded_aux, stopped_at (the level that failed, or None).
    """
    return score_many([(problem_prompt, test_code, entry_point, aux_text, main_text)], limits, workers=1)[0]
