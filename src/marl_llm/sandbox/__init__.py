"""Run untrusted, model-generated Python against tests (see docs/sandbox.md)."""

from marl_llm.sandbox.plan import MAX_ERROR_CHARS, MAX_TEST_TIMEOUTS, _make_plan
from marl_llm.sandbox.runner import (NOBODY, ISOLATION_MODES, ProgramScopeTest, SandboxLimits, Status,
                                         TestOutcome, TestResult, kill_all, limits_from_config,
                                         require_isolation, run_program_scope_tests,
                                         run_program_scope_tests_many, run_programs, run_tests, run_tests_many)

__all__ = [
    "ISOLATION_MODES", "MAX_ERROR_CHARS", "MAX_TEST_TIMEOUTS", "NOBODY", "ProgramScopeTest", "SandboxLimits",
    "Status", "TestOutcome", "TestResult", "_make_plan", "kill_all", "limits_from_config", "require_isolation",
    "run_program_scope_tests",
    "run_program_scope_tests_many", "run_programs", "run_tests", "run_tests_many",
]
