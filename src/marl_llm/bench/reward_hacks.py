"""`marl-llm-bench reward-hacks`: what the code rewards pay for answers that solve nothing.

    marl-llm-bench reward-hacks --out results          # results/reward_hacks.{md,json}, a few minutes
    marl-llm-bench reward-hacks --problems 3 --out /tmp/x   # the test

Three measurements, on the HumanEval training split (test[33:163], 130 problems) and the packaged
CoopHumanEval sample (all 20 problems), through the real task (`HumanEvalTask`: its
`joint_rewards` and `next_prompts`, every program in the sandbox):

1. **Copying the turn-2 feedback.** Turn 1 is a joint action that solves nothing (aux returns its
   argument, main returns None). An attacker then reads main's turn-2 prompt, collects every
   `candidate(<literal args>)` whose expected value the text shows (`== <literal>`, `abs(... -
   <literal>) < tol`, `not ...`), and answers turn 2 with a main that looks its arguments up in
   that table. The pass rate it earns (every test passed) is the part of a multi-turn gain that is
   leakage, per feedback mode (`task.feedback` under `task.prompts=own`, and `task.prompts=paper`,
   the reference's level_feedback) and reward variant.
2. **Answers inferred from the verdicts.** Turn 1's main answers False on every input. The
   attacker reads which inputs main's turn-2 feedback marks PASS or FAIL and answers turn 2 with
   the opposite on the failed ones: right wherever the tests expect yes/no, so the pass rate is
   what the verdicts give away (the yes/no problems counted apart).
3. **Answers that solve nothing**, scored by both reward variants on the same problems: `return
   None`; a constant with aux's result stored (the best of a few constants per problem); an object
   whose `__eq__` is always true; builtins shadowed from a default argument (`def f(*a,
   _=globals().update(abs=...))`, which the paper harness's shared globals let through).

Measures, never asserts; the figures are quoted in docs/rewards_code.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

from marl_llm.runs.atomic import atomic_write_text
from marl_llm.tasks.code_feedback import asserted_answer, call_args, expected_answers

MODES = ("detailed", "binary", "level", "plain", "paper")  # the last: task.prompts=paper
VARIANTS = ("fixed", "paper")
AUX = "def aux(x):\n    return x\n"
CONSTANTS = (False, True, 0, 1, "", [])
# Shadows: names whose calls become 0 (so `abs(x - y) < tol` and `sorted(a) == sorted(b)` hold)
# or True (so `assert all(...)` holds).
ZERO_NAMES = ("abs", "len", "sorted", "set", "tuple", "list", "round", "sum", "min", "max", "str", "int",
              "float", "dict", "frozenset", "reversed")
TRUE_NAMES = ("all", "any", "bool", "isinstance", "callable")


# ------------------------------------------------------------------------------ the answers
def stub_main(entry: str) -> str:
    return f"def {entry}(*args, **kwargs):\n    return None\n"


def constant_with_aux_main(entry: str, value: Any) -> str:
    return f"def {entry}(*args, **kwargs):\n    helper = aux(args)\n    return {value!r}\n"


def always_equal_main(entry: str) -> str:
    return (f"def {entry}(*args, **kwargs):\n"
            "    class Anything:\n"
            "        __eq__ = __le__ = __ge__ = __lt__ = __gt__ = lambda self, other: True\n"
            "        __ne__ = lambda self, other: False\n"
            "        __bool__ = lambda self: True\n"
            "        __hash__ = lambda self: 0\n"
            "        __abs__ = __neg__ = lambda self: 0\n"
            "        __sub__ = __rsub__ = __add__ = __radd__ = lambda self, other: self\n"
            "    return Anything()\n")


def shadowing_main(entry: str) -> str:
    zero = ", ".join(f"{n!r}: (lambda *a, **k: 0)" for n in ZERO_NAMES)
    true = ", ".join(f"{n!r}: (lambda *a, **k: True)" for n in TRUE_NAMES)
    return f"def {entry}(*args, _=globals().update({{{zero}, {true}}}), **kwargs):\n    return 0\n"


# ------------------------------------------------------------------------------- the copier
def copied_table(text: str, entry: str) -> dict[str, Any]:
    """{repr(args): expected} for every test whose inputs and expected output `text` shows."""
    names = {"candidate", entry}
    table: dict[str, Any] = {}
    for line in text.splitlines():
        start = line.find("assert ")
        if start < 0:
            continue
        rest = line[start:]
        cuts = [len(rest)] + [i for i in range(len(rest) - 4, 0, -1) if rest.startswith(" -> ", i)]
        for cut in cuts:  # the test line ends where the error starts: try the longest that parses
            try:
                tree = ast.parse(rest[:cut].strip())
            except (SyntaxError, ValueError, RecursionError):
                continue
            stmt = tree.body[0] if tree.body else None
            if isinstance(stmt, ast.Assert) and (pair := asserted_answer(stmt.test, names)) is not None:
                table[repr(pair[0])] = pair[1]
            break
    return table


def copier_main(entry: str, table: dict[str, Any], default: Any = None) -> str:
    return (f"def {entry}(*args, **kwargs):\n"
            f"    answers = {{{', '.join(f'{k!r}: {v!r}' for k, v in table.items())}}}\n"
            f"    return answers.get(repr(args), {default!r})\n")


# ----------------------------------------------------------------------------- the inferer
TURN1_ANSWER = False  # what the inferer's turn-1 main returns on every input


def _calls(line: str, names: set[str]) -> list[tuple]:
    """The literal args of every `name(...)` call written in a line of feedback text."""
    found = []
    for name in names:
        for match in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", line):
            for end in (j + 1 for j in range(match.end() - 1, len(line)) if line[j] == ")"):
                try:  # the shortest text up to a ")" that parses (a ")" inside a string does not)
                    node = ast.parse(line[match.start():end], mode="eval").body
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    continue
                if (args := call_args(node, names)) is not None:
                    found.append(args)
                break
    return found


def verdict_table(text: str, entry: str, turn1: Any = TURN1_ANSWER) -> dict[str, Any]:
    """{repr(args): answer} inferred from the verdicts `text` shows of a turn-1 main that returned
    `turn1` (a bool) on every input: a PASS means the answer is `turn1`, a FAIL means `not turn1`
    (right wherever the tests expect yes/no)."""
    table: dict[str, Any] = {}
    for line in text.splitlines():
        verdict = line.upper()
        failed, passed = "FAIL" in verdict, "PASS" in verdict
        if failed == passed:
            continue
        for args in _calls(line, {"candidate", entry}):
            table[repr(args)] = (not turn1) if failed else turn1
    return table


# --------------------------------------------------------------------------------- measuring
def _task(dataset: str, variant: str, mode: str) -> Any:
    from marl_llm.configure import compose_config
    from marl_llm.tasks import build_task

    prompts = "paper" if mode == "paper" else "own"
    feedback = "detailed" if mode == "paper" else mode
    cfg = compose_config([f"task={dataset}", f"task.reward.variant={variant}", f"task.prompts={prompts}",
                          f"task.feedback={feedback}", "task.data.source=packaged", "run_dir=/tmp/unused"])
    return build_task(cfg.task)


def _problems(task: Any, dataset: str, limit: int | None) -> list[Any]:
    problems = task.load_split("train")
    if dataset == "coophumaneval":  # the whole sample: its eval split too
        problems = task.load_split("eval") + problems
    return problems[:limit] if limit else problems


def copy_feedback(dataset: str, variant: str, mode: str, limit: int | None) -> dict[str, Any]:
    from marl_llm.tasks.base import Turn

    task = _task(dataset, variant, mode)
    problems = _problems(task, dataset, limit)
    first = [[AUX, stub_main(p.data["entry_point"])] for p in problems]
    rewards = task.joint_rewards(problems, first)
    second, shown = [], 0
    for problem, actions, reward in zip(problems, first, rewards):
        prompts = task.initial_prompts(problem)
        histories = [[Turn(prompt, action)] for prompt, action in zip(prompts, actions)]
        main_prompt = task.next_prompts(problem, histories, reward)[1]
        table = copied_table(main_prompt, problem.data["entry_point"])
        shown += bool(table)
        second.append([AUX, copier_main(problem.data["entry_point"], table)])
    after = task.joint_rewards(problems, second)
    return {"problems": len(problems), "turn1_passed": sum(r.passed for r in rewards),
            "turn2_passed": sum(r.passed for r in after), "pass_rate": sum(r.passed for r in after) / len(problems),
            "problems_with_copied_answers": shown,
            "mean_tests_level": statistics.mean(r.levels["tests"] for r in after)}


def infer_from_verdicts(dataset: str, variant: str, mode: str, limit: int | None) -> dict[str, Any]:
    """Turn 1 answers TURN1_ANSWER everywhere; turn 2 answers each input the feedback marks FAIL
    with the opposite (verdict_table). Counted over all problems and over the yes/no ones (every
    answer their tests state is True or False)."""
    from marl_llm.tasks.base import Turn

    task = _task(dataset, variant, mode)
    problems = _problems(task, dataset, limit)
    first = [[AUX, constant_with_aux_main(p.data["entry_point"], TURN1_ANSWER)] for p in problems]
    rewards = task.joint_rewards(problems, first)
    second, inferred = [], 0
    for problem, actions, reward in zip(problems, first, rewards):
        histories = [[Turn(prompt, action)] for prompt, action in zip(task.initial_prompts(problem), actions)]
        table = verdict_table(task.next_prompts(problem, histories, reward)[1], problem.data["entry_point"])
        inferred += bool(table)
        second.append([AUX, copier_main(problem.data["entry_point"], table, TURN1_ANSWER)])
    after = task.joint_rewards(problems, second)
    stated = [set(expected_answers([p.data["test"]], {"candidate", p.data["entry_point"]})) for p in problems]
    yes_no = [bool(values) and values <= {"True", "False"} for values in stated]
    return {"problems": len(problems), "yes_no_problems": sum(yes_no), "problems_with_inferred_answers": inferred,
            "turn1_passed": sum(r.passed for r in rewards), "turn2_passed": sum(r.passed for r in after),
            "turn2_passed_yes_no": sum(r.passed for r, y in zip(after, yes_no) if y),
            "mean_tests_level": statistics.mean(r.levels["tests"] for r in after),
            "mean_tests_level_turn1": statistics.mean(r.levels["tests"] for r in rewards)}


def hacks(dataset: str, variant: str, limit: int | None) -> dict[str, Any]:
    task = _task(dataset, variant, "detailed")
    problems = _problems(task, dataset, limit)
    entries = [p.data["entry_point"] for p in problems]

    def score(mains: list[str]) -> list[Any]:
        return task.joint_rewards(problems, [[AUX, m] for m in mains])

    out: dict[str, Any] = {}
    for name, make in (("return_none", stub_main), ("always_equal", always_equal_main),
                       ("shadowed_builtins", shadowing_main)):
        rewards = score([make(e) for e in entries])
        out[name] = {"passed": sum(r.passed for r in rewards), "mean_reward": statistics.mean(r.total for r in rewards),
                     "max_reward": max(r.total for r in rewards),
                     "passed_problems": [p.uid for p, r in zip(problems, rewards) if r.passed]}
    best = [0.0] * len(problems)
    for value in CONSTANTS:  # the attacker keeps whichever constant pays most on each problem
        best = [max(b, r.total) for b, r in zip(best, score([constant_with_aux_main(e, value) for e in entries]))]
    out["constant_with_aux"] = {"mean_reward": statistics.mean(best), "max_reward": max(best),
                                "above_correct_without_aux": sum(b > 2.5 for b in best)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="marl-llm-bench reward-hacks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--problems", type=int, default=0, help="the first N problems of each set (0: all)")
    ap.add_argument("--datasets", default="humaneval,coophumaneval")
    args = ap.parse_args(argv)
    datasets = [d for d in args.datasets.split(",") if d]
    limit = args.problems or None
    t0 = time.perf_counter()
    report: dict[str, Any] = {"command": "marl-llm-bench reward-hacks " + " ".join(argv or []),
                              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "copy_feedback": {},
                              "infer_from_verdicts": {}, "hacks": {}}
    for dataset in datasets:
        report["copy_feedback"][dataset] = {v: {m: copy_feedback(dataset, v, m, limit) for m in MODES} for v in VARIANTS}
        report["infer_from_verdicts"][dataset] = {v: {m: infer_from_verdicts(dataset, v, m, limit) for m in MODES}
                                                  for v in VARIANTS}
        report["hacks"][dataset] = {v: hacks(dataset, v, limit) for v in VARIANTS}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "reward_hacks.json", json.dumps(report, indent=2))
    atomic_write_text(out / "reward_hacks.md", render(report))
    print((out / "reward_hacks.md").read_text())
    return 0


def render(report: dict[str, Any]) -> str:
    lines = ["# What the code rewards pay for solving nothing (`marl-llm-bench reward-hacks`)", "",
             f"`{report['command'].strip()}`, {report['date']}, {report['seconds']} s. Method: the docstring of "
             "`src/marl_llm/bench/reward_hacks.py`; discussion: docs/rewards_code.md.", "",
             "## Copying the turn-2 feedback", "",
             "Pass rate at turn 2 of a main that only looks up the answers the turn-2 feedback shows (turn 1 "
             "solved nothing), and its mean tests level (the share of tests passed, 0-1). `paper` mode: "
             "`task.prompts=paper` (the reference's level_feedback).", "",
             "| problems | reward variant | " + " | ".join(MODES) + " |", "|---|---|" + "---|" * len(MODES)]
    for dataset, by_variant in report["copy_feedback"].items():
        for variant, by_mode in by_variant.items():
            n = next(iter(by_mode.values()))["problems"]
            cells = [f"{by_mode[m]['turn2_passed']}/{n} ({100 * by_mode[m]['pass_rate']:.0f}%; tests "
                     f"{by_mode[m]['mean_tests_level']:.2f})" for m in MODES]
            lines.append(f"| {dataset} ({n}) | {variant} | " + " | ".join(cells) + " |")
    lines += ["", "## Answers inferred from the verdicts", "",
              f"Turn 1: main returns {TURN1_ANSWER!r} on every input (aux its argument). Turn 2: main answers "
              f"{not TURN1_ANSWER!r} on every input the feedback marks FAIL, {TURN1_ANSWER!r} elsewhere. Problems "
              "passed in full at turn 2, of them the yes/no ones (every answer their tests state is True or False), "
              "and the mean tests level (turn 1's in brackets).", "",
              "| problems | reward variant | " + " | ".join(MODES) + " |", "|---|---|" + "---|" * len(MODES)]
    for dataset, by_variant in report.get("infer_from_verdicts", {}).items():
        for variant, by_mode in by_variant.items():
            first = next(iter(by_mode.values()))
            cells = [f"{by_mode[m]['turn2_passed']}/{first['problems']}, yes/no {by_mode[m]['turn2_passed_yes_no']}/"
                     f"{first['yes_no_problems']}; tests {by_mode[m]['mean_tests_level']:.2f} "
                     f"({by_mode[m]['mean_tests_level_turn1']:.2f})" for m in MODES]
            lines.append(f"| {dataset} ({first['problems']}) | {variant} | " + " | ".join(cells) + " |")
    lines += ["", "## Answers that solve nothing", "",
              "Problems passed in full (every test), mean and max reward (max 4.0; a correct main that does "
              "not call aux gets 2.5). `constant_with_aux`: per problem the best of "
              f"{', '.join(repr(c) for c in CONSTANTS)} returned after `helper = aux(args)`.", "",
              "| problems | reward variant | answer | passed | mean reward | max reward | note |", "|---|---|---|---|---|---|---|"]
    for dataset, by_variant in report["hacks"].items():
        for variant, found in by_variant.items():
            for name, f in found.items():
                note = (f"above 2.5 on {f['above_correct_without_aux']}" if name == "constant_with_aux"
                        else ", ".join(f["passed_problems"]) if name != "return_none" else "")
                passed = "" if name == "constant_with_aux" else str(f["passed"])
                lines.append(f"| {dataset} | {variant} | {name} | {passed} | {f['mean_reward']:.2f} | "
                             f"{f['max_reward']:.2f} | {note} |")
    return "\n".join(lines) + "\n"
