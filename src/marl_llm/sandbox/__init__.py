"""Run untrusted, model-generated Python against tests (see docs/sandbox.md).

Modules, each importing only those above it: isolation.py (what a run may see and use here: the
private root's layout, memory cgroups), plan.py (the test plan, parsed with `ast`), limits.py
(SandboxLimits), zygote.py (the judge zygote, live runs, kill_all), spawn.py (one run's processes
and pipes, driven under the time limits), confinement.py (whether this machine can confine
programs; require_isolation), runner.py (the public run API and result summaries)."""

from marl_llm.sandbox.confinement import namespaces_error, require_isolation
from marl_llm.sandbox.limits import ISOLATION_MODES, NOBODY, SandboxLimits, limits_from_config
from marl_llm.sandbox.plan import MAX_ERROR_CHARS, MAX_TEST_TIMEOUTS, _make_plan
from marl_llm.sandbox.runner import (ProgramScopeTest, Status, TestOutcome, TestResult, run_program_scope_tests,
                                     run_program_scope_tests_many, run_programs, run_tests, run_tests_many)
from marl_llm.sandbox.zygote import kill_all

__all__ = [
    "ISOLATION_MODES", "MAX_ERROR_CHARS", "MAX_TEST_TIMEOUTS", "NOBODY", "ProgramScopeTest", "SandboxLimits",
    "Status", "TestOutcome", "TestResult", "_make_plan", "kill_all", "limits_from_config", "namespaces_error",
    "require_isolation", "run_program_scope_tests",
    "run_program_scope_tests_many", "run_programs", "run_tests", "run_tests_many",
]
