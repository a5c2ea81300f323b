"""Whether this machine can confine programs: `namespaces_error()` confines one empty program and
says why that failed (None when it worked), measured once per trainer process rather than guessed
from sysctls; `require_isolation` turns a refusal into one line naming the way out before a run."""

from __future__ import annotations

import functools
import json
import logging

from marl_llm.sandbox import isolation
from marl_llm.sandbox.limits import ISOLATION_MODES, SandboxLimits
from marl_llm.sandbox.plan import _make_plan
from marl_llm.sandbox.spawn import run_judge

log = logging.getLogger(__name__)


def probe_confinement() -> str | None:
    """Confine an empty program once: None if that works, else what failed."""
    plan = _make_plan("def check(candidate):\n    pass\n", "__program__")
    job = json.dumps({"program": "", "entry_point": "__program__", "param": plan.param, "prelude": "",
                      "steps": [], "timeout_s": 10.0, "max_timeouts": 1, "scope": "check", "evals": [],
                      "preload": []}).encode()
    raw = run_judge(job, SandboxLimits(timeout_s=10.0, isolation="namespaces"))
    if any(r[:1] == [b"L"] and r[1:2] == [b"P"] for r in raw.records):
        return None
    detail = (raw.stderr or raw.judge_stderr).decode("utf-8", "replace").strip().splitlines()
    code = next((r[1].decode() for r in raw.records if r[:1] == [b"E"] and len(r) > 1), "no exit code")
    return detail[-1] if detail else f"the confined process ended ({code})"


@functools.lru_cache(maxsize=None)
def namespaces_error() -> str | None:
    """None when a program can be confined here; else the reason, in a few words."""
    return probe_confinement()


_warned_process_mode = False


def require_isolation(limits: SandboxLimits) -> None:
    """Before a run starts: refuse (one line, naming the way out) where the kernel cannot confine
    programs and the user did not opt in to the weaker mode; say what the weaker mode loses."""
    from marl_llm.config import UserError

    global _warned_process_mode
    if limits.isolation not in ISOLATION_MODES:
        raise UserError(f"task.sandbox.isolation={limits.isolation}: use namespaces (the default) or process")
    if limits.isolation == "process":
        if not _warned_process_mode:
            log.warning("task.sandbox.isolation=process: generated code runs with weaker isolation: %s",
                        isolation.PROCESS_MODE_LOSSES)
            _warned_process_mode = True
        return
    why = namespaces_error()
    if why is not None:
        raise UserError(
            f"the code sandbox cannot isolate programs on this machine ({why}): it needs unprivileged user "
            "namespaces (ask the admin for user.max_user_namespaces > 0, or kernel.unprivileged_userns_clone=1, "
            "or an AppArmor profile that allows them), or accept weaker isolation with "
            f"task.sandbox.isolation=process ({isolation.PROCESS_MODE_LOSSES})")
