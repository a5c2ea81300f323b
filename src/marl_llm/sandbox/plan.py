"""The test plan: the trainer splits the (trusted) test code with `ast` into steps; parsing runs
no code. The judge (child/judge.py) runs the steps; the trainer counts the tests from its own
parse, never from what a child reports."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

#: A run stops after this many tests hit the per-test time limit.
MAX_TEST_TIMEOUTS = 2
#: Longest error message / test source kept per test.
MAX_ERROR_CHARS = 300


def _cap(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


_EQ_HELPER = "__sandbox_assert_eq__"


@dataclass
class _Plan:
    prelude: str  # module-level test code except the `check` def (METADATA, helpers, imports)
    param: str  # check's parameter name (usually "candidate")
    steps: list[tuple[str, int, str]]  # (kind "t"est / "s"etup, test index or -1, source)
    sources: list[str]  # display source of each test
    # "check": tests call `candidate` from their own namespace (run_tests); "program": each test
    # runs in the program's own globals, after its `evals` (run_program_scope_tests).
    scope: str = "check"
    evals: list[list[str]] = field(default_factory=list)  # per step, program scope only
    preload: list[str] = field(default_factory=list)  # modules bound in the program's globals
    max_timeouts: int = MAX_TEST_TIMEOUTS


def _contains_name(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


class _EqAsserts(ast.NodeTransformer):
    """`assert A == B` -> `__sandbox_assert_eq__(A, B, got_is_left)`.

    Same evaluation order and truth test as the assert; the helper only adds an
    "expected X, got Y" message. The side that calls the candidate is the "got" side.
    """

    def __init__(self, candidate_names: set[str]):
        self.names = candidate_names

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            got_left = _contains_name(left, self.names) or not _contains_name(right, self.names)
            call = ast.Call(
                func=ast.Name(id=_EQ_HELPER, ctx=ast.Load()),
                args=[left, right, ast.Constant(value=got_left)],
                keywords=[],
            )
            return ast.copy_location(ast.Expr(value=call), node)
        return node


def _display_source(test_code: str, stmt: ast.stmt) -> str:
    src = ast.get_source_segment(test_code, stmt) if not _is_compound(stmt) else None
    if src is None or "\n" in src:
        src = ast.unparse(stmt)
    return _cap(src, MAX_ERROR_CHARS)


def _is_compound(stmt: ast.stmt) -> bool:
    return isinstance(stmt, (ast.For, ast.While, ast.If, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith))


def _is_check_call(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id == "check"
    )


def _make_plan(test_code: str, entry_point: str) -> _Plan:
    """Split test code into a prelude and one step per top-level statement of `check`'s body.

    A step that is or contains an `assert` and reaches the candidate (names it, or a name an
    earlier step bound from it) is a test; the others (imports, assignments, helper defs, asserts
    of constants such as `assert True`) are setup steps run in order. Without a `check`
    function, the module-level statements that would be tests are the tests.
    """
    tree = ast.parse(test_code)
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if checks:
        check = checks[-1]
        body = check.body
        param = check.args.args[0].arg if check.args.args else "candidate"
        prelude_nodes = [n for n in tree.body if n is not check and not _is_check_call(n)]
    else:
        body = [n for n in tree.body if not _is_check_call(n)]
        param = "candidate"
        prelude_nodes = []
    fixer = _EqAsserts({param, entry_point})
    steps: list[tuple[str, int, str]] = []
    sources: list[str] = []
    # Names that carry the candidate: itself, and what earlier statements bind from it (`r =
    # candidate(x)`, a helper def that calls it). An assert that reaches none of them (`assert
    # True`, `assert 1 == 1`) exercises nothing and is not a test.
    reaching = {param, entry_point}
    for stmt in body:
        is_def = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        reaches = _contains_name(stmt, reaching)
        if reaches and is_def:
            reaching.add(stmt.name)
        elif reaches:
            reaching.update(n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
        is_test = not is_def and reaches and any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        if not checks and not is_test:
            prelude_nodes.append(stmt)
            continue
        display = _display_source(test_code, stmt) if is_test else ""
        module = ast.Module(body=[fixer.visit(stmt)], type_ignores=[])
        code = ast.unparse(ast.fix_missing_locations(module))
        if is_test:
            steps.append(("t", len(sources), code))
            sources.append(display)
        else:
            steps.append(("s", -1, code))
    prelude = ast.unparse(ast.Module(body=prelude_nodes, type_ignores=[]))
    return _Plan(prelude, param, steps, sources)
