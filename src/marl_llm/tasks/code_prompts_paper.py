"""The reference's prompts for HumanEval and CoopHumanEval (`task.prompts=paper`).

The paper presets train with the prompts of OpenMLRL/LLM_Collab_Code_Generation, which both its
MAGRPO and its actor-critic trainer (comlrl, `external.mode: level_feedback`, `sandbox_slice: 1`,
`external_prompt_passthrough: false`) build the same way:

* turn 1: each agent's formatter applied to the problem (aux: "Create a helper function ...",
  main: "Solve this coding problem ..."); the main prompt repeats the entry point's parameters, as
  the first `def name(params)` with non-empty parameters in the text shows them, and a text with
  no such `def` gives the formatters' error line instead of a prompt;
* turn t > 1: a per-agent report (the agent's earlier prompts and responses, then diagnostics of
  the last joint action: definitions, syntax, the first test, aux usage) that takes the place of
  the problem text in the same formatter, so the next prompt is the formatter's frame around it.

The wording is data (`code_prompts_paper.json`, next to this module); this module fills it. The
diagnostics are the reference's, quirks included: definitions and the program come from
`code_reward_paper` (the reference's text handling); the test is `check`'s first assert line that
mentions the candidate (one line, so a multi-line assert is cut), run in the program's own globals
(`math` preloaded) through `marl_llm.sandbox`, never in this process; aux usage uses the
reference's AST walk, which flags `x = aux(...)` as "never used" whenever no later read of `x`
was visited before the call (the usual case). `feedback_facts_many` computes these facts for
`HumanEvalTask.joint_rewards`, which keeps them in `JointReward.info["paper_feedback"]`.
Sources, commits and what is not reproduced: docs/prompts_code.md.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any, Sequence

from marl_llm.sandbox import ProgramScopeTest, SandboxLimits, TestOutcome, run_program_scope_tests_many
from marl_llm.tasks.base import Turn
from marl_llm.tasks.code_reward import AUX_NAME
from marl_llm.tasks.code_reward_paper import (
    PRELOAD,
    assert_lines,
    calls_aux,
    function_of,
    has_return,
    is_wrapper,
    program_of,
    prompt_imports,
)

__all__ = [
    "INFO_KEY",
    "TEMPLATES",
    "aux_misuse",
    "feedback_facts",
    "feedback_facts_many",
    "feedback_text",
    "format_prompt",
    "initial_prompts",
    "next_prompts",
    "signature_params",
    "feedback_tests",
]

TEMPLATES: dict[str, Any] = json.loads(Path(__file__).with_name("code_prompts_paper.json").read_text(encoding="utf-8"))
#: Where `HumanEvalTask.joint_rewards` keeps the facts of the turn-2 report.
INFO_KEY = "paper_feedback"
AGENTS = ("aux", "main")

_FMT = TEMPLATES["formatter"]
_FB = TEMPLATES["feedback"]
_DX = TEMPLATES["diagnostics"]
_SIGNATURE = re.compile(_FMT["signature_pattern"])
_CHECK_HEAD = re.compile(r"\s*def\s+check\s*\(candidate\)\s*:\s*")
_TIMED_OUT = re.compile(r"timed out after [0-9.e+-]+s$")


# ----------------------------------------------------------------------------------------------
# Formatters
# ----------------------------------------------------------------------------------------------


def signature_params(text: str) -> list[str]:
    """The parameters of the first `def name(params)` in `text` with a non-empty parameter list
    (cut at the first `)`, split at commas, stripped)."""
    m = _SIGNATURE.search(text or "")
    if m is None:
        return []
    return [p.strip() for p in m.group(1).split(",") if p.strip()]


def format_prompt(agent: str, text: str, entry_point: str) -> str:
    """Agent `agent`'s formatter around `text` (the problem at turn 1, the report afterwards)."""
    params = signature_params(text)
    if not params or not entry_point:
        return _FMT["no_signature"]
    return _FMT[agent].format(prompt=text, entry_point=entry_point, params=_FMT["param_separator"].join(params))


def initial_prompts(problem_prompt: str, entry_point: str) -> list[str]:
    return [format_prompt(agent, problem_prompt, entry_point) for agent in AGENTS]


# ----------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------


def feedback_tests(test_code: str, entry_point: str) -> list[str]:
    """The test lines of the report: the test code cut to `check`'s first line that starts with
    "assert" and mentions the candidate (that line alone, stripped; the whole test code when
    there is none), then split into test lines as the paper reward does."""
    if not isinstance(test_code, str) or not test_code.strip():
        return assert_lines(test_code, entry_point)
    lines = test_code.splitlines()
    head = next((i for i, line in enumerate(lines) if _CHECK_HEAD.match(line)), None)
    before = lines if head is None else lines[:head]
    after = lines[(head + 1) if head is not None else 0:]
    first = next((s for s in (line.strip() for line in after) if s.startswith("assert") and "candidate" in s), None)
    if first is None:
        return assert_lines(test_code, entry_point)
    preamble = "\n".join(before).strip()
    cut = "\n".join(([preamble] if preamble else []) + ["def check(candidate):", f"    {first}"]) + "\n"
    return assert_lines(cut, entry_point)


def _definition(code: str, name: str, description: str) -> tuple[bool, str]:
    function = function_of(code, name)
    if not function:
        return False, _DX["not_defined"].format(description=description)
    if not has_return(function):
        return False, _DX["no_return"].format(description=description)
    return True, _DX["defined"].format(description=description)


def _syntax(program: str) -> tuple[bool, str, dict[str, Any] | None]:
    description = _DX["program_description"]
    try:
        ast.parse(program)
    except SyntaxError as e:
        where = {"line": e.lineno, "offset": e.offset, "msg": e.msg}
        return False, _DX["syntax_error"].format(description=description, error=str(e)), where
    except ValueError as e:  # e.g. a null byte (the reference would stop with this error)
        return False, _DX["syntax_error"].format(description=description, error=str(e)), None
    return True, _DX["syntax_ok"].format(description=description), None


def aux_misuse(main_function: str) -> list[str]:
    """The reference's "called but misused" findings on main's function, "Line N: reason", in the
    order its AST walk meets the `aux(...)` calls.

    The walk is pre-order in field order and records the names read so far: a call assigned to a
    name counts as "never used" unless a read of that name on a later line was already visited,
    and as "reassigned" when such a read exists but an assignment to the name comes first.
    """
    if not main_function or AUX_NAME not in main_function:
        return []
    try:
        tree = ast.parse(main_function)
    except (SyntaxError, ValueError):
        return []
    parents: dict[int, ast.AST] = {}
    reads: dict[str, list[int]] = {}
    found: list[str] = []

    def reassigned_before_read(name: str, line: int) -> int | None:
        assigns, later_reads = [], []
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and node.lineno > line:
                assigns += [node.lineno for t in node.targets if isinstance(t, ast.Name) and t.id == name]
            if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load) and node.lineno > line:
                later_reads.append(node.lineno)
        if not assigns:
            return None
        first = min(assigns)
        return first if first < min(later_reads, default=float("inf")) else None

    def reason(call: ast.Call) -> str | None:
        parent = parents.get(id(call))
        if parent is None or isinstance(parent, ast.Expr):
            return _DX["misuse_standalone"]
        if isinstance(parent, ast.Assign):
            for target in parent.targets:
                if not isinstance(target, ast.Name):
                    continue
                if not any(line > parent.lineno for line in reads.get(target.id, [])):
                    return _DX["misuse_unused"].format(name=target.id)
                again = reassigned_before_read(target.id, parent.lineno)
                if again:
                    return _DX["misuse_reassigned"].format(name=target.id, line=again)
        return None  # returned, passed on, computed with, tested, collected or used otherwise

    def visit(node: ast.AST) -> None:
        children = list(ast.iter_child_nodes(node))
        for child in children:
            parents[id(child)] = node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == AUX_NAME:
            why = reason(node)
            if why is not None:
                found.append(_DX["misuse"].format(line=node.lineno, reason=why))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads.setdefault(node.id, []).append(node.lineno)
        for child in children:
            visit(child)

    try:
        visit(tree)
    except RecursionError:
        return []
    return found


def _static_facts(
    prompt: str, test_code: str, entry_point: str, aux_text: str, main_text: str
) -> tuple[dict[str, Any], str, list[str]]:
    """(facts without the test results, the program, its test lines: none when nothing runs)."""
    aux_function = function_of(aux_text, AUX_NAME)
    main_function = function_of(main_text, entry_point)
    aux_ok, aux_message = _definition(aux_text, AUX_NAME, _DX["aux_description"])
    main_ok, main_message = _definition(main_text, entry_point, _DX["main_description"].format(entry_point=entry_point))
    program = program_of(aux_function, main_function, prompt_imports(prompt))
    syntax_ok, syntax_message, syntax_error = _syntax(program)
    facts = {
        "aux_defined": aux_ok,
        "aux_message": aux_message,
        "main_defined": main_ok,
        "main_message": main_message,
        "syntax_ok": syntax_ok,
        "syntax_message": syntax_message,
        "syntax_error": syntax_error,
        "aux_called": calls_aux(main_function),
        "aux_misuse": aux_misuse(main_function),
        "wrapper": is_wrapper(main_function),
        "tests_passed": 0,
        "tests_total": 0,
        "failures": [],
    }
    cases = feedback_tests(test_code, entry_point) if syntax_ok and test_code and entry_point else []
    return facts, program, cases


def _as_exec_error(text: str) -> str:
    """A SyntaxError message as `exec` of a string reports it (file "<string>")."""
    return re.sub(r"\(<(?:program|test)>, line ", f"({_DX['exec_filename']}, line ", text)


def _error(message: str) -> tuple[str, str]:
    """(exception name, message) of a failed test from the sandbox's error text."""
    timeout = (_DX["timeout_type"], _DX["timeout_message"])
    for prefix in ("not run: the program failed while loading (", "not run: syntax error in the program ("):
        if message.startswith(prefix) and message.endswith(")"):
            message = message[len(prefix):-1]
            if prefix.startswith("not run: syntax"):  # "line N: SyntaxError: ..."
                message = message.split(": ", 1)[1] if ": " in message else message
            break
    if _TIMED_OUT.match(message) or message == "not run: the sandbox run timed out":
        return timeout
    name, _, text = message.partition(": ")
    return name, _as_exec_error(text)


def _finish(facts: dict[str, Any], cases: list[str], outcome: TestOutcome) -> None:
    facts["tests_total"] = len(cases)
    for case, result in zip(cases, outcome.per_test):
        if result.passed:
            facts["tests_passed"] += 1
        else:
            error_type, error_message = _error(result.error)
            facts["failures"].append({"case": case, "error_type": error_type, "error_message": error_message})


def feedback_facts_many(
    items: Sequence[tuple[str, str, str, str, str]], limits: SandboxLimits | None = None, workers: int = 2
) -> list[dict[str, Any]]:
    """The report's facts for each (problem_prompt, test_code, entry_point, aux_text, main_text);
    the programs with a test run in the sandbox, `workers` at a time."""
    staged = [_static_facts(*item) for item in items]
    jobs = [(program, [ProgramScopeTest(c) for c in cases]) for _, program, cases in staged if cases]
    outcomes = iter(run_program_scope_tests_many(jobs, limits or SandboxLimits(), workers, PRELOAD))
    for facts, _, cases in staged:
        if cases:
            _finish(facts, cases, next(outcomes))
    return [facts for facts, _, _ in staged]


def feedback_facts(problem_prompt: str, test_code: str, entry_point: str, aux_text: str, main_text: str,
                   limits: SandboxLimits | None = None) -> dict[str, Any]:
    return feedback_facts_many([(problem_prompt, test_code, entry_point, aux_text, main_text)], limits, workers=1)[0]


# ----------------------------------------------------------------------------------------------
# Turn t > 1
# ----------------------------------------------------------------------------------------------


def _definition_line(role: str, facts: dict[str, Any]) -> str:
    defined = facts[f"{role}_defined"]
    return _FB["definition"].format(role=_FB["role"][role], state=_FB["defined_state"][str(defined).lower()],
                                    message=facts[f"{role}_message"])


def feedback_text(agent: str, facts: dict[str, Any], entry_point: str, prompts: list[str], responses: list[str]) -> str:
    """Agent `agent`'s report after a joint action: its earlier prompts and responses, then the
    diagnostics in `facts` (from `feedback_facts`)."""
    lines: list[str] = []
    if prompts:
        lines += [_FB["prompt_history"],
                  *(_FB["prompt_item"].format(turn=t, text=p) for t, p in enumerate(prompts, 1)), ""]
    if responses:
        lines += [_FB["response_history"][agent],
                  *(_FB["response_item"].format(turn=t, text=r) for t, r in enumerate(responses, 1)), ""]
    order = ("aux", "main") if agent == "aux" else ("main", "aux")
    syntax_state = _FB["syntax_state"][str(facts["syntax_ok"]).lower()]
    lines += [_FB["header"], *(_definition_line(role, facts) for role in order),
              _FB["syntax"].format(state=syntax_state, message=facts["syntax_message"])]
    if facts["syntax_error"]:
        lines.append(_FB["syntax_error"].format(**facts["syntax_error"]))
    if facts["tests_total"] > 0:
        lines.append(_FB["tests"].format(passed=facts["tests_passed"], total=facts["tests_total"]))
        lines += [_FB["failed_case"].format(**failure) for failure in facts["failures"]]
    else:
        lines.append(_FB["no_tests"])
    if agent == "main" and facts["main_defined"]:
        if not facts["aux_called"]:
            lines.append(_FB["aux_not_called"])
        elif facts["aux_misuse"]:
            shown = facts["aux_misuse"][: _FB["aux_misused_shown"]]
            lines.append(_FB["aux_misused"].format(reasons=_FB["aux_misused_separator"].join(shown)))
        else:
            lines.append(_FB["aux_used"])
        if facts["wrapper"]:
            lines.append(_FB["wrapper"])
    lines.append(_FB["revise"][agent].format(entry_point=entry_point))
    return "\n".join(lines)


def next_prompts(problem: dict[str, Any], histories: list[list[Turn]], facts: dict[str, Any]) -> list[str]:
    """Both agents' next prompts: each agent's report, framed by its formatter.

    histories[i]: agent i's turns so far (prompt seen, response); `facts` describe the last joint
    action. The history holds the prompts the agents saw, as the actor-critic trainer records them
    (MAGRPO records the unformatted report from turn 2 on: the two differ from turn 3).
    """
    entry_point = problem["entry_point"]
    prompts = []
    for agent, history in zip(AGENTS, histories):
        text = feedback_text(agent, facts, entry_point, [t.prompt for t in history], [t.action for t in history])
        prompts.append(format_prompt(agent, text, entry_point))
    return prompts
