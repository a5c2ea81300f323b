"""Whether this machine can confine programs: `namespaces_error()` confines one empty program and
says why that failed (None when it worked), measured once per trainer process rather than guessed
from sysctls; `require_isolation` turns a refusal into one line naming the way out before a run,
and says in one line what this machine's sandbox cannot promise (`process_mode_losses`,
`namespaces_gaps`)."""

from __future__ import annotations

import functools
import json
import logging
import os

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


_NO_SECCOMP = ("the kernel has no seccomp filter with the kill-process action (Linux 4.14+, x86-64 or aarch64): "
               "io_uring, userfaultfd, keyctl, ptrace, bpf and netlink/vsock sockets stay open to the candidate")


def process_mode_losses() -> str:
    """What `task.sandbox.isolation=process` cannot promise on this machine, in one sentence."""
    root = os.geteuid() == 0
    who = "nobody" if root else "the trainer's user"
    abi = isolation.landlock_abi()
    out = [f"the candidate runs as {who} without namespaces, with a single task (no fork, no threads); its work "
           "dir is in the host's temp dir with no size cap (only a cap per file), so it can fill that disk"]
    if abi == 0:
        out.append(f"this kernel has no Landlock (Linux 5.13+), so it can read every file {who} can (datasets and "
                   "their answers included) and what /proc shows of other processes")
        if not root:
            out.append("it can read and write the memory of the user's other processes (the trainer, the "
                       "sandbox's judges and zygote are made undumpable, so not theirs) and lower its OOM score")
    else:
        out.append("it can learn which paths exist on the host (not read them)")
    if abi < 6:
        out.append("this kernel's Landlock cannot scope signals (ABI 6, Linux 6.12), so it can stop or kill "
                   + ("other runs' candidates" if root else "the user's processes, the trainer included"))
    if not isolation.seccomp_available():
        out.append(_NO_SECCOMP)
    return "; ".join(out)


def namespaces_gaps() -> list[str]:
    """What the default mode cannot promise on this machine, a line each (none on a full kernel)."""
    gaps = []
    if not isolation.seccomp_available():
        gaps.append(_NO_SECCOMP)
    base = isolation.cgroup_base()
    if base is None:
        gaps.append("no cgroup per run here (not root and no delegated cgroup subtree): each candidate gets a "
                    "single task (no fork, no threads), so that its memory limit covers the whole run")
    elif base.cpu is None:
        gaps.append("no cpu controller for the runs' cgroups: each candidate gets a single task (no fork, no "
                    "threads), so that no run's processes can starve a sibling run of CPU")
    return gaps


_said: set[str] = set()


def require_isolation(limits: SandboxLimits) -> None:
    """Before a run starts: refuse (one line, naming the way out) where the kernel cannot confine
    programs and the user did not opt in to the weaker mode; say (once, a line each) what this
    machine's sandbox cannot promise."""
    from marl_llm.config import UserError

    if limits.isolation not in ISOLATION_MODES:
        raise UserError(f"task.sandbox.isolation={limits.isolation}: use namespaces (the default) or process")
    if limits.isolation == "process":
        _say_once(log.warning, "task.sandbox.isolation=process: generated code runs with weaker isolation: "
                  + process_mode_losses())
        return
    why = namespaces_error()
    if why is not None:
        raise UserError(
            f"the code sandbox cannot isolate programs on this machine ({why}): it needs unprivileged user "
            "namespaces (ask the admin for user.max_user_namespaces > 0, or kernel.unprivileged_userns_clone=1, "
            "or an AppArmor profile that allows them), or accept weaker isolation with "
            f"task.sandbox.isolation=process ({process_mode_losses()})")
    for gap in namespaces_gaps():
        _say_once(log.info if gap.startswith("no cgroup per run") else log.warning, "sandbox: " + gap)


def _say_once(say, line: str) -> None:
    if line not in _said:
        _said.add(line)
        say(line)
